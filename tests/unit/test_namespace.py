"""kvtierd.contract.namespace: the namespace identity, its wire form and what follows from it."""

from __future__ import annotations

import pytest
import torch

from kvtierd.contract import protocol as P
from kvtierd.contract.namespace import WIRE_FIELDS, NamespaceId, Sharding, format_ranks, parse_ranks
from kvtierd.contract.region_view import namespace_from_record, namespace_record

REPL = NamespaceId("deepseek-ai/DeepSeek-V3", "bfloat16", 16, 1_124_352, Sharding.REPLICATED, 0)
SHARD = NamespaceId("meta-llama/Llama-3.1-70B", "float16", 16, 81920, Sharding.SHARDED, 4)


def test_namespace_names_differ():
    assert REPL.name() == "deepseek-ai/DeepSeek-V3:bfloat16:16t:1124352B:replicated"
    assert SHARD.name() == "meta-llama/Llama-3.1-70B:float16:16t:81920B:sharded/tp4"
    other_tp = NamespaceId(SHARD.model, SHARD.dtype, 16, 81920, Sharding.SHARDED, 8)
    assert other_tp.name() != SHARD.name()
    assert other_tp != SHARD


def test_from_wire():
    wire = {"model": "m", "dtype": "bf16", "block_tokens": 16, "block_bytes": 1000, "sharding": "replicated"}
    repl = NamespaceId.from_wire(wire, world_size=8)
    assert repl.sharding is Sharding.REPLICATED
    assert repl.world_size == 0        # replicated namespaces are shared across TP sizes
    assert repl == NamespaceId.from_wire(wire, world_size=2)
    sharded = NamespaceId.from_wire(dict(wire, sharding="sharded"), world_size=8)
    assert sharded.sharding is Sharding.SHARDED and sharded.world_size == 8
    assert sharded != NamespaceId.from_wire(dict(wire, sharding="sharded"), world_size=4)


@pytest.mark.parametrize("block_bytes,page,per_shard", [(1, 4096, 1), (4096, 4096, 1), (4097, 4096, 2),
                                                        (1_124_352, 65536, 18), (65536 * 3, 65536, 3)])
def test_shards_and_entry_pages(block_bytes, page, per_shard):
    repl = NamespaceId("m", "d", 16, block_bytes, Sharding.REPLICATED, 0)
    assert repl.shards == 1
    assert repl.pages_per_shard(page) == per_shard
    assert repl.entry_pages(page) == per_shard
    assert repl.entry_bytes == block_bytes
    sharded = NamespaceId("m", "d", 16, block_bytes, Sharding.SHARDED, 4)
    assert sharded.shards == 4
    assert sharded.pages_per_shard(page) == per_shard
    assert sharded.entry_pages(page) == 4 * per_shard
    assert sharded.entry_bytes == 4 * block_bytes


def test_sharding_given_by_value_and_replicated_world_size_ignored():
    ns = NamespaceId("m", "d", 16, 4096, "sharded", 2)
    assert ns.sharding is Sharding.SHARDED and ns == NamespaceId("m", "d", 16, 4096, Sharding.SHARDED, 2)
    assert NamespaceId("m", "d", 16, 4096, "replicated", 8) == NamespaceId("m", "d", 16, 4096)
    with pytest.raises(ValueError):
        NamespaceId("m", "d", 16, 4096, "mixed")


def test_wire_round_trip_leaves_world_size_to_hello():
    wire = SHARD.to_wire()
    assert wire == {"model": SHARD.model, "dtype": "float16", "block_tokens": 16, "block_bytes": 81920,
                    "sharding": "sharded"}
    assert type(wire["sharding"]) is str
    assert NamespaceId.from_wire(wire, world_size=4) == SHARD
    assert NamespaceId.from_wire(REPL.to_wire(), world_size=8) == REPL
    P.validate_fields("hello.namespace", wire, P.NAMESPACE_FIELDS)


def test_the_wire_checks_are_the_declared_ones():
    assert list(P.NAMESPACE_FIELDS) == ["model", "dtype", "block_tokens", "block_bytes", "sharding"]
    for name, check in WIRE_FIELDS.items():
        assert P.NAMESPACE_FIELDS[name] == P.Field(**check)
    assert P.NAMESPACE_FIELDS["sharding"].choices == ("replicated", "sharded")


def test_for_kv_caches():
    tensors = [torch.zeros(8, 16, 576, dtype=torch.bfloat16) for _ in range(3)]
    ns = NamespaceId.for_kv_caches(tensors, "mla", 16)
    assert ns == NamespaceId("mla", "bfloat16", 16, 3 * 16 * 576 * 2, Sharding.REPLICATED)
    assert NamespaceId.for_kv_caches(tensors, "gqa", 16, "sharded").sharding is Sharding.SHARDED


def test_a_node_slice_is_part_of_a_sharded_identity_only():
    wire = dict(SHARD.to_wire())
    half = NamespaceId.from_wire(wire, 16, range(8, 16))
    assert half.name() == "meta-llama/Llama-3.1-70B:float16:16t:81920B:sharded/tp16[8-15]"
    assert (half.shards, half.entry_bytes, half.shard_of(8), half.shard_of(15)) == (8, 8 * 81920, 0, 7)
    assert half != NamespaceId.from_wire(wire, 16, range(8))                 # the other node's half
    assert half != NamespaceId.from_wire(wire, 8)                            # a TP=8 single-node engine
    assert NamespaceId.from_wire(wire, 16, range(16)) == NamespaceId.from_wire(wire, 16)   # the whole world
    assert NamespaceId.from_wire(wire, 16, range(16)).node_ranks == ()
    repl = NamespaceId.from_wire(REPL.to_wire(), 16, range(8, 16))           # one copy per node, any node
    assert repl == REPL and repl.node_ranks == () and repl.shard_of(12) == 0
    with pytest.raises(ValueError, match="world of 8"):
        NamespaceId.from_wire(wire, 8, range(4, 12))
    with pytest.raises(ValueError, match="distinct"):
        NamespaceId.from_wire(wire, 16, [1, 1])


@pytest.mark.parametrize("ranks", [(), tuple(range(8, 16)), (0, 2, 5), (63,)])
def test_a_node_slice_survives_the_namespace_record(ranks):
    ns = NamespaceId("m", "d", 16, 4096, Sharding.SHARDED, 64, ranks)
    assert namespace_from_record(namespace_record(ns)) == ns
    assert namespace_from_record(namespace_record(REPL)) == REPL


def test_a_namespace_record_written_before_node_slices_reads_as_the_whole_world():
    record = namespace_record(SHARD)
    assert int(record["node_ranks"]) == 0 and namespace_from_record(record).node_ranks == ()


@pytest.mark.parametrize("text,ranks", [("8-15", tuple(range(8, 16))), ("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)),
                                        ("5", (5,)), ("2, 0", (0, 2))])
def test_rank_lists_read_and_written(text, ranks):
    assert parse_ranks(text) == ranks
    assert parse_ranks(format_ranks(ranks)) == ranks


@pytest.mark.parametrize("text", ["", "a", "8-", "-3", "3-1", "1,1", "0-3,2", "1;2"])
def test_bad_rank_lists(text):
    with pytest.raises(ValueError):
        parse_ranks(text)

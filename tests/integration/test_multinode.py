"""Engines that span nodes: one TP=16 engine over two daemons, its ranks 0-7 on node A's and
8-15 on node B's (two daemons on one machine stand for two nodes), one real process per rank.

Each rank names its node's ranks as an operator would ($KVTIER_NODE_RANKS), so each daemon
counts the votes of its own node's ranks only: in a replicated namespace the node's lowest rank
writes the node's copy, in a sharded one an entry holds the node's eight shards. Every block's
bytes are derived from its key (and rank, when sharded), so a foreign, torn or other rank's block
cannot pass.

| what | test |
|---|---|
| replicated (MLA): one copy per node, written by ranks 0 and 8; every rank loads it byte-exact; no job open, no entry WRITING after the stores (issue 25: 0 hits on node B before) | test_a_replicated_engine_caches_one_copy_per_node |
| sharded: each node's entries hold its eight shards, in a namespace of its own slice (issue 25: jobs open until job_timeout before); a TP=8 single-node engine of the same model shares nothing with a node half | test_a_sharded_engine_caches_each_nodes_shards |
| blocks evicted on node B only: B's ranks load the prefix B holds (the engine recomputes the rest), node A's ranks load everything | test_blocks_evicted_on_one_node_only |
| node B's daemon SIGKILLed with a store in flight and restarted: A keeps the store, B loses it and re-attaches; the next store fills B; every rank loads byte-exact | test_node_b_restarted_mid_run |
"""

from __future__ import annotations

import signal

import pytest

from kvtierd.contract.codes import StoreOutcome

from .ranks import CacheSpec, all_call
from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TP, PER_NODE = 16, 8
SPEC = CacheSpec(layers=2, num_blocks=16, row_shape=(16, 64))      # 4 KiB blocks
MODEL = "tiny-mla-two-nodes"


def node_of(rank: int) -> int:
    return rank // PER_NODE


def node_ranks(node: int) -> list[int]:
    return list(range(node * PER_NODE, (node + 1) * PER_NODE))


def layout(kind: str, model: str = MODEL) -> dict:
    return {"model": model, "dtype": SPEC.dtype, "block_tokens": SPEC.row_shape[0], "block_bytes": SPEC.block_bytes(),
            "sharding": kind}


def connect(procs, nodes, engine: str, kind: str) -> list[dict]:
    """Rank r of a TP=16 engine attaches to node r // 8's daemon, naming that node's ranks."""
    return all_call(procs, "connect", engine=engine, world_size=TP, spec=SPEC, layout=layout(kind),
                    per_rank=[{"rank": r, "seed": r, "socket": nodes[node_of(r)].socket,
                               "node_ranks": node_ranks(node_of(r))} for r in range(TP)])


def content_keys(keys: list[bytes], rank: int, kind: str) -> list[bytes]:
    """What a rank's blocks are derived from: the key, and the rank when each holds its own shard."""
    return [k + bytes([rank]) for k in keys] if kind == "sharded" else keys


def store(procs, job: int, keys: list[bytes], kind: str) -> list[dict]:
    blocks = list(range(len(keys)))
    all_call(procs, "fill_keys", per_rank=[{"keys": content_keys(keys, r, kind), "block_ids": blocks}
                                           for r in range(len(procs))])
    return all_call(procs, "store", job=job, keys=keys, block_ids=blocks)


def load(procs, job: int, keys: list[bytes], kind: str) -> list[int]:
    """Every rank loads ``keys`` into scrubbed blocks; returns each rank's hits after checking that
    exactly those leading blocks hold their bytes."""
    blocks = list(range(8, 8 + len(keys)))
    all_call(procs, "fill", block_ids=blocks, seed=999)
    results = all_call(procs, "load", job=job, keys=keys, block_ids=blocks)
    assert all(r["ok"] for r in results), results
    hits = [r["hits"] for r in results]
    for r, (proc, n) in enumerate(zip(procs, hits)):
        exact = proc.call("verify_keys", keys=content_keys(keys, r, kind)[:n], block_ids=blocks[:n])
        assert exact == [True] * n, f"rank {r} loaded wrong bytes"
    return hits


def settled(daemon) -> dict:
    """The daemon's stats, after checking that no job is open and no entry is WRITING."""
    stats = daemon.stats()
    assert (stats["open_jobs"], stats["entries_writing"], stats["entries_pinned"]) == (0, 0, 0), stats
    return stats


@pytest.fixture
def nodes(start_daemon):
    return [start_daemon(), start_daemon()]


def test_a_replicated_engine_caches_one_copy_per_node(nodes, ranks):
    procs = ranks(TP)
    info = connect(procs, nodes, "mla-16", "replicated")
    keys = keys_for("mla-16", 6)
    for result in store(procs, 1, keys, "replicated"):
        assert result["ok"] and result["outcomes"] == [StoreOutcome.WRITE] * 6, result
    assert all_call(procs, "lookup", keys=keys) == [6] * TP           # issue 25: 0 on every rank (no READY)
    assert [r for r in range(TP) if info[r]["writer"]] == [0, 8]      # each node's lowest rank
    for daemon in nodes:
        stats = settled(daemon)
        assert stats["entries_ready"] == 6
        assert stats["bytes_written"] == 6 * SPEC.block_bytes()                       # one copy on each node
        assert stats["bytes_saved_dedup"] == 6 * SPEC.block_bytes() * (PER_NODE - 1)  # the node's other ranks
    assert load(procs, 2, keys, "replicated") == [6] * TP
    for daemon in nodes:
        assert settled(daemon)["load_jobs_done"] == 1


def test_a_sharded_engine_caches_each_nodes_shards(nodes, ranks):
    procs = ranks(TP)
    info = connect(procs, nodes, "gqa-16", "sharded")
    assert all(i["writer"] for i in info)
    keys = keys_for("gqa-16", 5)
    for result in store(procs, 1, keys, "sharded"):
        assert result["ok"] and result["outcomes"] == [StoreOutcome.WRITE] * 5, result
    for node, daemon in enumerate(nodes):
        stats = settled(daemon)                     # issue 25: the job open until job_timeout, 5 entries WRITING
        assert stats["entries_ready"] == 5
        assert stats["bytes_written"] == 5 * SPEC.block_bytes() * PER_NODE      # the node's eight shards
        (ns,) = stats["namespace_list"]
        assert ns["name"].endswith(f"sharded/tp16[{node * 8}-{node * 8 + 7}]"), ns
        assert ns["entry_pages"] == PER_NODE
    assert load(procs, 2, keys, "sharded") == [5] * TP

    # A TP=8 single-node engine of the same model on node A holds other bytes per rank: it never
    # sees the node half's entries, nor they its.
    all_call(procs[:8], "close")
    all_call(procs[:8], "connect", engine="gqa-8", world_size=8, spec=SPEC, layout=layout("sharded"),
             socket=nodes[0].socket, per_rank=[{"rank": r, "seed": r} for r in range(8)])
    assert all_call(procs[:8], "lookup", keys=keys) == [0] * 8
    names = sorted(ns["name"].rsplit(":", 1)[1] for ns in nodes[0].stats()["namespace_list"])
    assert names == ["sharded/tp16[0-7]", "sharded/tp8"]


def test_blocks_evicted_on_one_node_only(nodes, ranks):
    procs = ranks(TP)
    connect(procs, nodes, "mla-evict", "replicated")
    keys = keys_for("mla-evict", 8)
    assert all(r["ok"] for r in store(procs, 1, keys, "replicated"))
    assert nodes[1].call("evict", admin=True, count=3)["evicted"] == 3
    on_b = [procs[8].call("lookup", keys=[k]) for k in keys]
    kept = on_b.index(0)                           # the prefix node B still holds
    assert on_b.count(0) == 3 and kept < len(keys)
    # Node A's ranks load every block; node B's the prefix it holds: what they report short is
    # exactly what the engine recomputes. Nobody waits, nobody gets another node's bytes.
    assert load(procs, 2, keys, "replicated") == [8] * PER_NODE + [kept] * PER_NODE
    assert all_call(procs, "lookup", keys=keys) == [8] * PER_NODE + [kept] * PER_NODE
    for daemon in nodes:
        settled(daemon)


def test_node_b_restarted_mid_run(nodes, ranks):
    procs = ranks(TP)
    connect(procs, nodes, "mla-restart", "replicated")
    first, second = keys_for("mla-restart-1", 4), keys_for("mla-restart-2", 4)
    assert all(r["ok"] for r in store(procs, 1, first, "replicated"))

    # The second store is in flight on every rank (requests sent, copies started, nobody voted
    # after a copy yet) when node B's daemon is SIGKILLed; a new one adopts its region.
    blocks = list(range(len(second)))
    all_call(procs, "fill_keys", keys=second, block_ids=blocks)
    all_call(procs, "store_hold", job=2, keys=second, block_ids=blocks)
    nodes[1].stop(signal.SIGKILL)
    nodes[1].start()
    results = [r for (r,) in all_call(procs, "finish", jobs=[2])]
    assert all(r["ok"] for r in results[:PER_NODE]), results
    assert not results[8]["ok"] and results[8]["error_type"] == "DaemonUnavailable"   # B's writer: lost
    assert all_call(procs, "lookup", keys=second) == [4] * PER_NODE + [0] * PER_NODE
    assert all_call(procs, "lookup", keys=first) == [4] * TP                          # recovered on B

    # The next store of those blocks: present on A, written on B (its ranks re-attached).
    outcomes = [r["outcomes"] for r in store(procs, 3, second, "replicated")]
    assert outcomes == [[StoreOutcome.PRESENT] * 4] * PER_NODE + [[StoreOutcome.WRITE] * 4] * PER_NODE
    assert load(procs, 4, first + second, "replicated") == [8] * TP
    for daemon in nodes:
        stats = settled(daemon)
        assert stats["entries_ready"] == 8

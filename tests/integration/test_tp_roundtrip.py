"""A real daemon and one real process per TP rank: store, load back elsewhere, compare bytes."""

from __future__ import annotations

import hashlib

import pytest

from kvtierd.contract.codes import StoreOutcome

from .ranks import CacheSpec, all_call

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def keys_for(prefix: str, n: int) -> list[bytes]:
    # vLLM-style keys: a 32-byte block hash plus a 4-byte group index.
    return [hashlib.sha256(f"{prefix}-{i}".encode()).digest() + b"\0\0\0\0" for i in range(n)]


def connect(ranks, daemon, engine: str, spec: CacheSpec, kind: str, seeds: list[int], model: str = "tiny-mla"):
    layout = {"model": model, "dtype": spec.dtype, "block_tokens": spec.row_shape[0],
              "block_bytes": spec.block_bytes(), "sharding": kind}
    return all_call(ranks, "connect", socket=daemon.socket, engine=engine, world_size=len(ranks),
                    spec=spec, layout=layout,
                    per_rank=[{"rank": r, "seed": seeds[r]} for r in range(len(ranks))])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_store_then_load_into_other_blocks(daemon, ranks, tp, kind):
    spec = CacheSpec(num_blocks=16)
    procs = ranks(tp)
    # Replicated KV is identical on every rank; sharded KV differs per rank.
    seeds = [7] * tp if kind == "replicated" else [100 + r for r in range(tp)]
    info = connect(procs, daemon, f"rt-{kind}-{tp}", spec, kind, seeds)
    writers = [i["writer"] for i in info]
    assert writers == ([True] + [False] * (tp - 1) if kind == "replicated" else [True] * tp)

    keys = keys_for(f"rt-{kind}-{tp}", 6)
    src, dst = list(range(6)), list(range(8, 14))
    before = all_call(procs, "hashes", block_ids=src)
    stored = all_call(procs, "store", job=1, keys=keys, block_ids=src)
    for s in stored:
        assert s["ok"], s
        assert s["outcomes"] == [StoreOutcome.WRITE] * 6
    assert all(n == 6 for n in all_call(procs, "lookup", keys=keys))

    loaded = all_call(procs, "load", job=2, keys=keys, block_ids=dst)
    assert [(x["hits"], x["ok"]) for x in loaded] == [(6, True)] * tp
    after = all_call(procs, "hashes", block_ids=dst)
    for r in range(tp):
        assert after[r] == before[r], f"rank {r} loaded other bytes than it stored"

    stats = daemon.stats()
    assert stats["entries_ready"] == 6
    shards = tp if kind == "sharded" else 1
    assert stats["bytes_written"] == 6 * spec.block_bytes() * shards
    assert stats["entries_pinned"] == 0 and stats["open_jobs"] == 0


def test_one_copy_every_rank_loads_rank0_bytes(daemon, ranks):
    """Replicated TP=4 where ranks 1-3 hold garbage: all load rank 0's bytes; D2H bytes = 1x."""
    tp, n = 4, 8
    spec = CacheSpec(num_blocks=16)
    procs = ranks(tp)
    connect(procs, daemon, "one-copy", spec, "replicated", seeds=[1, 666, 667, 668])
    keys = keys_for("one-copy", n)
    src = list(range(n))
    rank0 = procs[0].call("hashes", block_ids=src)
    garbage = all_call(procs[1:], "hashes", block_ids=src)
    assert all(g != rank0 for g in garbage)

    for s in all_call(procs, "store", job=10, keys=keys, block_ids=src):
        assert s["ok"], s
    dst = list(range(8, 16))
    for x in all_call(procs, "load", job=11, keys=keys, block_ids=dst):
        assert x["hits"] == n and x["ok"], x
    for r, hashes in enumerate(all_call(procs, "hashes", block_ids=dst)):
        assert hashes == rank0, f"rank {r} did not load rank 0's copy"

    stats = daemon.stats()
    assert stats["bytes_written"] == n * spec.block_bytes()             # not TP x
    assert stats["bytes_saved_dedup"] == (tp - 1) * n * spec.block_bytes()
    assert stats["pages_used"] == n * -(-spec.block_bytes() // stats["page_size"])


def _fill(daemon, procs, kind: str, spec: CacheSpec, rounds: int) -> int:
    connect(procs, daemon, f"cap-{kind}", spec, kind, seeds=[3] * len(procs))
    for job in range(rounds):
        keys = keys_for(f"cap-{kind}-{job}", spec.num_blocks)
        for s in all_call(procs, "store", job=job, keys=keys, block_ids=list(range(spec.num_blocks))):
            assert s["ok"], s
    stats = daemon.stats()
    assert stats["evictions"] > 0, "the region never filled up; raise rounds"
    return stats["entries_ready"]


def test_capacity_replicated_holds_tp_times_sharded(start_daemon, ranks):
    """Same region size, same per-rank block bytes: replicated at TP=4 holds 4x the blocks."""
    spec = CacheSpec(layers=2, num_blocks=16, row_shape=(16, 1024), dtype="bfloat16")  # 64 KiB: one page
    procs = ranks(4)
    replicated = _fill(start_daemon(size="12MiB"), procs, "replicated", spec, rounds=12)
    all_call(procs, "close")
    sharded = _fill(start_daemon(size="12MiB"), procs, "sharded", spec, rounds=4)
    # One entry is 1 page replicated and 4 pages sharded: the page count bounds both.
    assert 4 * sharded <= replicated < 4 * (sharded + 1)

"""Job semantics across real processes: conflicts, timeouts, no-space prefixes, pins and LRU."""

from __future__ import annotations

import time

import pytest

from kvtier import Client, NamespaceId
from kvtierd.contract.codes import StoreOutcome

from .ranks import CacheSpec, RankError, all_call
from .test_tp_roundtrip import connect, keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ONE_PAGE = CacheSpec(layers=2, num_blocks=16, row_shape=(16, 1024), dtype="bfloat16")  # 64 KiB blocks


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def coordinator(daemon, engine: str, spec: CacheSpec, world_size: int, kind: str = "replicated") -> Client:
    layout = NamespaceId("tiny-mla", spec.dtype, spec.row_shape[0], spec.block_bytes(), kind)
    return Client(daemon.socket, engine_id=engine, rank=None, world_size=world_size, namespace=layout)


def test_rank_with_different_keys_gets_conflict_and_job_aborts(daemon, ranks):
    procs = ranks(2)
    connect(procs, daemon, "conflict", ONE_PAGE, "replicated", seeds=[1, 1])
    keys_a, keys_b = keys_for("a", 4), keys_for("b", 4)
    first = procs[0].call("store", job=5, keys=keys_a, block_ids=[0, 1, 2, 3])
    assert first["ok"]                      # rank 0 copied and voted; rank 1's vote is missing
    with pytest.raises(RankError) as err:
        procs[1].call("store", job=5, keys=keys_b, block_ids=[0, 1, 2, 3])
    assert err.value.type == "Conflict"
    assert "aborted" in str(err.value)
    stats = daemon.stats()
    assert stats["aborted_jobs"] == {"conflict": 1}
    assert stats["entries_ready"] == 0 and stats["entries_writing"] == 0
    assert stats["pages_used"] == 0         # the writer had committed: nothing is fenced
    assert procs[0].call("lookup", keys=keys_a) == 0
    # The job id is burnt; rank 0 asking again learns that it was aborted.
    with pytest.raises(RankError) as err:
        procs[0].call("store", job=5, keys=keys_a, block_ids=[0, 1, 2, 3])
    assert err.value.type == "JobAborted"


def test_job_timeout_aborts_and_frees_pages(start_daemon, ranks):
    daemon = start_daemon(job_timeout=1.0)
    procs = ranks(2)
    connect(procs, daemon, "timeout", ONE_PAGE, "replicated", seeds=[1, 1])
    keys = keys_for("t", 3)
    assert procs[0].call("store", job=1, keys=keys, block_ids=[0, 1, 2])["ok"]
    assert daemon.stats()["entries_writing"] == 3
    # Rank 1 never votes: the job times out, its entries vanish and its pages are freed.
    stats = wait_for(lambda: (s := daemon.stats())["aborted_jobs"].get("timeout") and s, what="job timeout")
    assert stats["entries_writing"] == 0 and stats["pages_used"] == 0
    assert procs[0].call("lookup", keys=keys) == 0
    with pytest.raises(RankError) as err:
        procs[1].call("store", job=1, keys=keys, block_ids=[0, 1, 2])
    assert err.value.type == "JobTimeout"


def test_no_space_stores_the_prefix_that_fits(start_daemon, ranks):
    daemon = start_daemon(size="12MiB")
    capacity = daemon.stats()["pages_total"]
    procs = ranks(1)
    connect(procs, daemon, "nospace", ONE_PAGE, "replicated", seeds=[1])
    n = capacity + 20
    keys = keys_for("ns", n)
    result = procs[0].call("store", job=1, keys=keys, block_ids=[i % 16 for i in range(n)])
    assert result["ok"]
    assert result["outcomes"] == [StoreOutcome.WRITE] * capacity + [StoreOutcome.NO_SPACE] * 20
    assert procs[0].call("lookup", keys=keys) == capacity
    stats = daemon.stats()
    assert stats["store_no_space_keys"] == 20 and stats["evictions"] == 0
    # A second job with already-present keys and one more key: present ones are PRESENT, the new
    # one evicts the least recently used entry (not one of this job's own keys).
    again = procs[0].call("store", job=2, keys=keys[-30:-20] + keys_for("extra", 1), block_ids=list(range(11)))
    assert again["outcomes"] == [StoreOutcome.PRESENT] * 10 + [StoreOutcome.WRITE]
    assert procs[0].call("lookup", keys=keys[-30:-20]) == 10
    assert procs[0].call("lookup", keys=keys[:1]) == 0      # the oldest went


def test_pinned_entries_survive_eviction_pressure(start_daemon, ranks):
    # LRU: once unpinned, the entries are evicted by the flood below; slru would rightly keep them
    # (they were loaded: used again), which tests/unit/test_policy_slru.py covers.
    daemon = start_daemon("--policy", "lru", size="12MiB")
    procs = ranks(1)
    connect(procs, daemon, "pins", ONE_PAGE, "replicated", seeds=[1])
    pinned_keys = keys_for("pinned", 8)
    assert procs[0].call("store", job=1, keys=pinned_keys, block_ids=list(range(8)))["ok"]
    coord = coordinator(daemon, "pins", ONE_PAGE, 1)
    try:
        assert coord.open_load(1000, pinned_keys) == 8         # pinned until rank 0 releases
        assert daemon.stats()["entries_pinned"] == 8
        for job in range(2, 14):                               # ~12 x 16 blocks: far beyond capacity
            assert procs[0].call("store", job=job, keys=keys_for(f"p{job}", 16), block_ids=list(range(16)))["ok"]
        assert daemon.stats()["evictions"] > 0
        assert procs[0].call("lookup", keys=pinned_keys) == 8
        coord.abort(1000)                                      # drop the pins
        assert daemon.stats()["entries_pinned"] == 0
        for job in range(20, 32):
            procs[0].call("store", job=job, keys=keys_for(f"q{job}", 16), block_ids=list(range(16)))
        assert procs[0].call("lookup", keys=pinned_keys) == 0
    finally:
        coord.close()


def test_lru_evicts_least_recently_used_first(start_daemon, ranks):
    daemon = start_daemon("--policy", "lru", size="12MiB")
    capacity = daemon.stats()["pages_total"]
    procs = ranks(1)
    connect(procs, daemon, "lru", ONE_PAGE, "replicated", seeds=[1])
    half = capacity // 2
    old, young = keys_for("old", half), keys_for("young", capacity - half)
    procs[0].call("store", job=1, keys=old, block_ids=[i % 16 for i in range(half)])
    procs[0].call("store", job=2, keys=young, block_ids=[i % 16 for i in range(len(young))])
    assert procs[0].call("lookup", keys=old) == half            # touching "old" makes "young" older
    procs[0].call("store", job=3, keys=keys_for("new", 10), block_ids=list(range(10)))
    assert procs[0].call("lookup", keys=old) == half
    assert procs[0].call("lookup", keys=young[:10]) == 0        # the 10 least recently used went
    assert procs[0].call("lookup", keys=young[10:]) == len(young) - 10


def test_coordinator_opens_jobs_ranks_copy_and_vote(daemon, ranks):
    spec = CacheSpec(num_blocks=16)
    procs = ranks(2)
    connect(procs, daemon, "coord", spec, "replicated", seeds=[5, 99])
    coord = coordinator(daemon, "coord", spec, 2)
    try:
        keys = keys_for("coord", 5)
        decision = coord.open_store(7, keys)
        assert decision.outcomes == [StoreOutcome.WRITE] * 5
        assert coord.job_status([7])[0]["state"] == "open"
        for r in all_call(procs, "store", job=7, keys=keys, block_ids=[0, 1, 2, 3, 4]):
            assert r["ok"] and r["outcomes"] == [StoreOutcome.WRITE] * 5
        assert coord.job_status([7])[0]["state"] == "done"
        assert coord.lookup(keys) == 5
        assert coord.open_load(8, keys) == 5
        for r in all_call(procs, "load", job=8, keys=keys, block_ids=[10, 11, 12, 13, 14]):
            assert r["hits"] == 5 and r["ok"]
        assert coord.job_status([8])[0]["state"] == "done"
        src = procs[0].call("hashes", block_ids=[0, 1, 2, 3, 4])
        for hashes in all_call(procs, "hashes", block_ids=[10, 11, 12, 13, 14]):
            assert hashes == src
    finally:
        coord.close()

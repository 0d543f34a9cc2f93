"""Unit tests of kvtierd.store.Store: the state machine of entries, jobs, votes and pins.

No sockets, no files: the region is a RegionView over an in-memory buffer (4 KiB pages), and
time is a fake clock the tests advance. Every scenario ends with ``store.verify()`` (the store's
own consistency checker); the ``env`` fixture also runs it at teardown.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.protocol import PAGES_DTYPE, ErrorCode, RequestError, StoreOutcome
from kvtierd.contract.region_format import CHAIN_END, EntryState, Geometry, RegionView
from kvtierd.store import Store

PAGE = 4096
W, P, N = StoreOutcome.WRITE, StoreOutcome.PRESENT, StoreOutcome.NO_SPACE
TIMEOUT = 10.0


# ---------------------------------------------------------------------------- helpers
class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_view(num_pages: int) -> RegionView:
    geo = Geometry.for_pages(num_pages, PAGE)
    view = RegionView(bytearray(geo.file_bytes), geo)
    view.format(generation=1, created_unix_ns=0)
    return view


def reopen(view: RegionView, clock=None) -> Store:
    """A restarted daemon: a fresh Store over the same region bytes."""
    return Store(RegionView(view.raw, view.geometry), job_timeout=TIMEOUT, clock=clock or FakeClock())


def lay(kind: str = "replicated", world_size: int = 1, block_bytes: int = PAGE, model: str = "m",
        dtype: str = "bf16", block_tokens: int = 16) -> NamespaceId:
    return NamespaceId.from_wire({"model": model, "dtype": dtype, "block_tokens": block_tokens,
                                  "block_bytes": block_bytes, "sharding": kind}, world_size)


def keys(prefix: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(start, start + n)]


def pages(p: bytes) -> list[int]:
    return np.frombuffer(p, PAGES_DTYPE).tolist()


class Env:
    def __init__(self, num_pages: int = 64):
        self.clock = FakeClock()
        self.view = make_view(num_pages)
        self.store = Store(self.view, job_timeout=TIMEOUT, clock=self.clock)

    def ranks(self, engine: str, world_size: int, layout: NamespaceId) -> list:
        return [self.store.attach(engine, r, world_size, layout) for r in range(world_size)]

    def engine(self, engine: str, world_size: int = 1, kind: str = "replicated", **kw) -> list:
        return self.ranks(engine, world_size, lay(kind, world_size, **kw))

    def put(self, sessions: list, job: int, ks: list[bytes]) -> tuple[list, dict]:
        """The whole store protocol: every rank stores, then the writers commit."""
        outcomes, got = None, {}
        for s in sessions:
            outcomes, got[s.rank] = self.store.store(s, job, ks)
        for s in sessions:
            if s.rank in s.engine.writers:
                self.store.commit(s, job, True)
        return outcomes, got

    def get(self, sessions: list, job: int, ks: list[bytes]) -> tuple[int, dict]:
        """The whole load protocol: every rank loads, then releases."""
        hits, got = None, {}
        for s in sessions:
            hits, got[s.rank] = self.store.load(s, job, ks)
        for s in sessions:
            self.store.release(s, job)
        return hits, got

    def has(self, session, key: bytes) -> bool:
        """Without touching the LRU (unlike lookup)."""
        e = session.engine.ns.index.get(key)
        return e is not None and e.state is EntryState.READY

    def stats(self) -> dict:
        return self.store.stats()


@pytest.fixture
def env():
    e = Env()
    yield e
    e.store.verify()


def small(num_pages: int) -> Env:
    return Env(num_pages)


@contextlib.contextmanager
def err(code: ErrorCode):
    """Expect a RequestError with exactly this code."""
    with pytest.raises(RequestError) as info:
        yield info
    assert info.value.code is code, f"expected {code.name}, got {info.value.code.name}: {info.value.message}"


# ---------------------------------------------------------------------------- replicated
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("writer_first", [True, False])
def test_replicated_one_writer_ready_after_all_votes(env, tp, writer_first):
    block = 2 * PAGE + 100              # 3 pages per block
    sess = env.engine("e", tp, block_bytes=block)
    ks = keys("k", 3)
    st_ = env.store
    order = sess if writer_first else sess[1:] + sess[:1]
    rank0_pages = None
    for s in order:
        out, pg = st_.store(s, 1, ks)
        assert out == [W, W, W]
        if s.rank == 0:
            assert len(pg) == 3 and all(len(pages(p)) == 3 for p in pg)
            rank0_pages = pg
        else:
            assert pg == []             # a non-writer's store is its vote
        assert st_.lookup(sess[-1], ks) == 0
    assert env.stats()["entries_writing"] == 3
    flat = [p for pg in rank0_pages for p in pages(pg)]
    assert len(set(flat)) == 9
    st_.verify()
    st_.commit(sess[0], 1, True)        # the writer's vote, after its copy: the last one
    for s in sess:
        assert st_.lookup(s, ks) == 3
    stats = env.stats()
    assert stats["entries_ready"] == 3 and stats["entries_writing"] == 0
    assert stats["bytes_written"] == 3 * block                 # one copy, not TP copies
    assert stats["bytes_saved_dedup"] == 3 * block * (tp - 1)
    assert stats["pages_used"] == 9
    assert st_.job_states(sess[0], [1]) == [{"job": 1, "kind": "store", "state": "done", "cause": ""}]
    # every rank loads rank 0's single copy
    hits, got = env.get(sess, 2, ks + [b"missing"])
    assert hits == 3
    for r in range(tp):
        assert got[r] == rank0_pages
    assert env.stats()["entries_pinned"] == 0
    st_.verify()


def test_replicated_ready_waits_for_last_non_writer(env):
    sess = env.engine("e", 4)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.commit(sess[0], 1, True)
    st_.store(sess[1], 1, [b"a"])
    st_.store(sess[2], 1, [b"a"])
    assert st_.lookup(sess[0], [b"a"]) == 0
    assert st_.job_states(sess[0], [1])[0]["waiting"] == 1
    st_.store(sess[3], 1, [b"a"])
    assert st_.lookup(sess[0], [b"a"]) == 1
    st_.verify()


def test_replicated_namespace_shared_across_tp_sizes(env):
    """Replicated blocks do not depend on TP: an engine at TP=2 and one at TP=4 share entries."""
    a = env.engine("a", 2)
    b = env.engine("b", 4)
    assert a[0].engine.ns is b[0].engine.ns
    env.put(a, 1, [b"x"])
    assert env.store.lookup(b[0], [b"x"]) == 1
    out, _ = env.put(b, 1, [b"x", b"y"])
    assert out == [P, W]
    assert env.store.lookup(a[1], [b"x", b"y"]) == 2


# ---------------------------------------------------------------------------- sharded
def test_sharded_every_rank_writes_its_own_shard(env):
    block = 2 * PAGE
    sess = env.engine("e", 4, "sharded", block_bytes=block)
    ks = keys("k", 3)
    st_ = env.store
    got = {}
    for s in sess:
        out, got[s.rank] = st_.store(s, 1, ks)
        assert out == [W, W, W]
        assert len(got[s.rank]) == 3 and all(len(pages(p)) == 2 for p in got[s.rank])
    for i in range(3):
        shards = [set(pages(got[r][i])) for r in range(4)]
        union = set().union(*shards)
        assert len(union) == 8                          # disjoint shards
        entry = sess[0].engine.ns.index[ks[i]]
        assert pages(entry.pages) == [p for r in range(4) for p in pages(got[r][i])]   # rank order
    all_pages = [p for r in range(4) for pg in got[r] for p in pages(pg)]
    assert len(set(all_pages)) == 24
    # storing is not voting for a writer: every rank must commit
    for s in sess[:3]:
        st_.commit(s, 1, True)
        assert st_.lookup(s, ks) == 0
    st_.commit(sess[3], 1, True)
    assert st_.lookup(sess[0], ks) == 3
    stats = env.stats()
    assert stats["bytes_written"] == 3 * 4 * block
    assert stats["bytes_saved_dedup"] == 0
    hits, loaded = env.get(sess, 2, ks)
    assert hits == 3
    for r in range(4):
        assert loaded[r] == got[r]
    st_.verify()


def test_sharded_namespaces_differ_by_tp(env):
    a = env.engine("a", 2, "sharded")
    b = env.engine("b", 4, "sharded")
    assert a[0].engine.ns is not b[0].engine.ns
    env.put(a, 1, [b"x"])
    assert env.store.lookup(b[0], [b"x"]) == 0


def test_sharded_writer_commit_before_store_is_conflict(env):
    sess = env.engine("e", 2, "sharded")
    env.store.store(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.commit(sess[1], 1, True)
    env.store.store(sess[1], 1, [b"a"])
    env.store.commit(sess[0], 1, True)
    env.store.commit(sess[1], 1, True)
    assert env.store.lookup(sess[0], [b"a"]) == 1


# ---------------------------------------------------------------------------- coordinator
@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_coordinator_opens_jobs_ranks_copy_and_vote(env, kind):
    layout = lay(kind, 2)
    coord = env.store.attach("e", None, 2, layout)
    sess = env.ranks("e", 2, layout)
    st_ = env.store
    ks = keys("k", 2)
    assert st_.lookup(coord, ks) == 0
    out, pg = st_.store(coord, 7, ks)
    assert out == [W, W] and pg == []
    with err(ErrorCode.FORBIDDEN):
        st_.commit(coord, 7, True)
    assert env.stats()["entries_writing"] == 2
    outs, got = env.put(sess, 7, ks)
    assert outs == [W, W]
    assert all(len(got[r]) == 2 for r in sess[0].engine.writers)
    assert st_.lookup(coord, ks) == 2
    assert st_.job_states(coord, [7])[0]["state"] == "done"
    hits, pg = st_.load(coord, 8, ks)
    assert hits == 2 and pg == []
    assert env.stats()["entries_pinned"] == 2
    with err(ErrorCode.FORBIDDEN):
        st_.release(coord, 8)
    hits, loaded = env.get(sess, 8, ks)
    assert hits == 2
    assert env.stats()["entries_pinned"] == 0
    assert st_.job_states(coord, [8])[0]["state"] == "done"
    # the coordinator leaving does not disturb the ranks' jobs
    st_.store(coord, 9, [b"z"])
    st_.detach(coord)
    env.put(sess, 9, [b"z"])
    assert st_.lookup(sess[0], [b"z"]) == 1
    st_.verify()


def test_coordinator_may_abort(env):
    layout = lay("replicated", 2)
    coord = env.store.attach("e", None, 2, layout)
    sess = env.ranks("e", 2, layout)
    env.store.store(coord, 1, [b"a"])
    env.store.store(sess[1], 1, [b"a"])
    env.store.abort(coord, 1)
    assert env.stats()["pages_used"] == 0
    with err(ErrorCode.ABORTED):
        env.store.store(sess[0], 1, [b"a"])
    env.store.abort(coord, 1)       # aborting an aborted job is a no-op
    env.store.verify()


# ---------------------------------------------------------------------------- agreement
def test_store_decision_is_fixed_by_first_request():
    env = small(4)
    st_ = env.store
    other = env.engine("o", 1)
    env.put(other, 1, keys("p", 4))
    hits, _ = st_.load(other[0], 2, keys("p", 4))        # pin everything: no room
    assert hits == 4
    sess = env.engine("e", 2)
    out0, pg0 = st_.store(sess[0], 1, [b"p0", b"x"])
    assert out0 == [P, N] and pg0 == []
    st_.release(other[0], 2)                               # room now, but the decision stands
    out1, _ = st_.store(sess[1], 1, [b"p0", b"x"])
    assert out1 == out0
    st_.commit(sess[0], 1, True)
    assert st_.lookup(sess[0], [b"x"]) == 0
    st_.verify()


def test_load_decision_is_fixed_by_first_request(env):
    sess = env.engine("e", 2)
    env.put(sess, 1, [b"a"])
    hits, pg0 = env.store.load(sess[0], 2, [b"a", b"b"])
    assert hits == 1
    env.put(sess, 3, [b"b"])
    hits1, pg1 = env.store.load(sess[1], 2, [b"a", b"b"])
    assert hits1 == 1 and pg1 == pg0
    env.store.release(sess[0], 2)
    env.store.release(sess[1], 2)
    env.store.verify()


@pytest.mark.parametrize("how", ["keys", "order", "kind_load", "fewer"])
def test_conflicting_request_aborts_job(env, how):
    sess = env.engine("e", 2)
    st_ = env.store
    ks = keys("k", 3)
    out, pg = st_.store(sess[0], 1, ks)
    assert out == [W] * 3 and len(pg) == 3
    assert env.stats()["pages_used"] == 3
    with err(ErrorCode.CONFLICT):
        if how == "keys":
            st_.store(sess[1], 1, keys("z", 3))
        elif how == "order":
            st_.store(sess[1], 1, ks[::-1])
        elif how == "fewer":
            st_.store(sess[1], 1, ks[:2])
        else:
            st_.load(sess[1], 1, ks)
    # entries gone at once; pages quarantined until the writer that holds them answers
    assert env.stats()["entries_writing"] == 0
    assert st_.lookup(sess[0], ks) == 0
    assert all(k not in sess[0].engine.ns.index for k in ks)
    assert env.stats()["pages_quarantined"] == 3
    st_.verify()
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    assert env.stats()["pages_used"] == 0 and env.stats()["pages_quarantined"] == 0
    assert st_.job_states(sess[0], [1])[0] == {"job": 1, "kind": "store", "state": "aborted", "cause": "conflict"}
    assert env.store.aborted["conflict"] == 1
    # the keys can be stored again by a new job
    out, _ = env.put(sess, 2, ks)
    assert out == [W] * 3
    st_.verify()


def test_conflicting_load_aborts_and_unpins(env):
    sess = env.engine("e", 2)
    env.put(sess, 1, [b"a", b"b"])
    env.store.load(sess[0], 2, [b"a", b"b"])
    assert env.stats()["entries_pinned"] == 2
    with err(ErrorCode.CONFLICT):
        env.store.load(sess[1], 2, [b"a"])
    assert env.stats()["entries_pinned"] == 0
    with err(ErrorCode.ABORTED):
        env.store.release(sess[0], 2)
    with err(ErrorCode.CONFLICT):
        env.store.store(sess[0], 1, [b"a", b"b"])   # finished store job: id not reused


def test_job_kind_mismatch_on_commit_release(env):
    sess = env.engine("e", 1)
    env.store.store(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.release(sess[0], 1)
    env.store.commit(sess[0], 1, True)
    env.store.load(sess[0], 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.commit(sess[0], 2, True)
    env.store.release(sess[0], 2)


# ---------------------------------------------------------------------------- capacity
def fill_count(env: Env, kind: str, tp: int) -> int:
    sess = env.engine("e", tp, kind, block_bytes=PAGE)
    ks = keys("k", 200)
    out, _ = env.put(sess, 1, ks)
    n = out.count(W)
    assert out == [W] * n + [N] * (200 - n)     # a prefix
    assert env.store.lookup(sess[0], ks) == n
    env.store.verify()
    return n


def test_capacity_replicated_holds_tp_times_sharded():
    rep = fill_count(small(64), "replicated", 4)
    shd = fill_count(small(64), "sharded", 4)
    assert rep == 64 and shd == 16
    assert rep == 4 * shd


# ---------------------------------------------------------------------------- eviction
def test_lru_eviction_order_across_namespaces():
    env = small(8)
    st_ = env.store
    a = env.engine("a", 1, model="A")
    b = env.engine("b", 2, model="B")
    assert a[0].engine.ns is not b[0].engine.ns
    env.put(a, 1, [b"a1", b"a2"])
    env.put(b, 1, [b"b1", b"b2"])
    env.put(a, 2, [b"a3", b"a4"])
    env.put(b, 2, [b"b3", b"b4"])
    assert env.stats()["pages_free"] == 0
    assert st_.lookup(a[0], [b"a1"]) == 1          # lookup refreshes a1
    env.get(b, 3, [b"b1"])                          # load refreshes b1
    # LRU now: a2 b2 a3 a4 b3 b4 a1 b1
    out, _ = env.put(b, 4, [b"c1", b"c2", b"c3"])
    assert out == [W, W, W]
    assert env.stats()["evictions"] == 3
    gone = {k for k in [b"a2", b"b2", b"a3"]}
    for s, k in [(a[0], b"a1"), (a[0], b"a2"), (a[0], b"a3"), (a[0], b"a4"),
                 (b[0], b"b1"), (b[0], b"b2"), (b[0], b"b3"), (b[0], b"b4")]:
        assert env.has(s, k) == (k not in gone), k
    # a PRESENT key in a store job is touched too
    out, _ = env.put(a, 3, [b"a4"])
    assert out == [P]
    env.put(a, 4, [b"d1"])                          # LRU: b3 b4 a1 b1 c* a4 -> evicts b3
    assert not env.has(b[0], b"b3") and env.has(a[0], b"a4")
    st_.verify()


def test_pinned_entries_survive_eviction_pressure():
    env = small(8)
    st_ = env.store
    a = env.engine("a", 2)
    env.put(a, 1, keys("a", 8))
    hits, _ = st_.load(a[0], 2, keys("a", 3))       # pin a0..a2 (rank 1 has not even loaded yet)
    assert hits == 3
    b = env.engine("b", 1, model="B")
    out, _ = env.put(b, 1, keys("b", 8))
    assert out == [W] * 5 + [N] * 3
    assert all(env.has(a[0], k) for k in keys("a", 3))
    assert env.stats()["entries_pinned"] == 3 and env.stats()["evictable"] == 5
    st_.verify()
    st_.load(a[1], 2, keys("a", 3))
    st_.release(a[0], 2)
    assert env.stats()["entries_pinned"] == 3      # pinned until every rank released
    st_.release(a[1], 2)
    assert env.stats()["entries_pinned"] == 0
    # unpinned entries are evictable again, as the most recently used
    out, _ = env.put(b, 2, keys("b", 3, 8))
    assert out == [W] * 3
    assert all(env.has(a[0], k) for k in keys("a", 3))
    assert not any(env.has(b[0], k) for k in keys("b", 3))
    out, _ = env.put(b, 3, keys("b", 5, 11))
    assert out == [W] * 5
    assert not any(env.has(a[0], k) for k in keys("a", 3))
    st_.verify()


def test_overlapping_pins_need_every_load_released():
    env = small(4)
    st_ = env.store
    a = env.engine("a", 1)
    env.put(a, 1, [b"x", b"y"])
    st_.load(a[0], 2, [b"x"])
    st_.load(a[0], 3, [b"x", b"y"])
    st_.release(a[0], 2)
    assert env.stats()["entries_pinned"] == 2
    st_.verify()
    b = env.engine("b", 1, model="B")
    out, _ = env.put(b, 1, keys("b", 3))
    assert out == [W, W, N]
    st_.release(a[0], 3)
    out, _ = env.put(b, 2, keys("c", 4))
    assert out == [W] * 4                            # x and y are evictable again
    assert not env.has(a[0], b"x") and not env.has(a[0], b"y")


def test_writing_entries_are_never_evicted():
    env = small(6)
    st_ = env.store
    a = env.engine("a", 2)
    st_.store(a[0], 1, keys("a", 4))                 # WRITING, not voted
    b = env.engine("b", 1, model="B")
    out, _ = env.put(b, 1, keys("b", 4))
    assert out == [W, W, N, N]
    out, _ = env.put(b, 2, keys("c", 2))             # evicts b0, b1, never a WRITING entry
    assert out == [W, W]
    assert env.stats()["entries_writing"] == 4
    st_.store(a[1], 1, keys("a", 4))
    st_.commit(a[0], 1, True)
    assert st_.lookup(a[0], keys("a", 4)) == 4
    st_.verify()


def test_job_keys_are_never_evicted_for_the_same_job():
    env = small(4)
    st_ = env.store
    a = env.engine("a", 1)
    env.put(a, 1, keys("r", 4))
    out, _ = env.put(a, 2, keys("r", 4) + [b"new"])
    assert out == [P, P, P, P, N]
    assert st_.lookup(a[0], keys("r", 4)) == 4
    # with two of the job's keys present, the new key evicts an entry outside the job
    out, _ = env.put(a, 3, [b"r3", b"new", b"r0"])
    assert out == [P, W, P]
    assert env.has(a[0], b"r0") and env.has(a[0], b"r3")
    assert sum(env.has(a[0], k) for k in [b"r1", b"r2"]) == 1
    st_.verify()


def test_present_includes_keys_being_written_by_another_job(env):
    a = env.engine("a", 2)
    b = env.engine("b", 1)                           # same namespace
    st_ = env.store
    st_.store(a[0], 1, [b"x"])
    out, pg = st_.store(b[0], 1, [b"x", b"y"])
    assert out == [P, W] and len(pg) == 1
    assert st_.lookup(b[0], [b"x"]) == 0
    hits, _ = st_.load(b[0], 2, [b"x", b"y"])
    assert hits == 0                                 # WRITING is not a hit
    st_.release(b[0], 2)
    st_.commit(b[0], 1, True)
    st_.store(a[1], 1, [b"x"])
    st_.commit(a[0], 1, True)
    assert st_.lookup(b[0], [b"x", b"y"]) == 2


# ---------------------------------------------------------------------------- no space
def test_no_space_stores_a_prefix_and_reports_present():
    env = small(8)
    st_ = env.store
    a = env.engine("a", 1)
    env.put(a, 1, keys("p", 5))
    st_.load(a[0], 2, keys("p", 5))                  # pinned: 3 pages left
    out, got = env.put(a, 3, [b"p0", b"n0", b"n1", b"n2", b"n3", b"p4", b"n4"])
    assert out == [P, W, W, W, N, P, N]
    assert len(got[0]) == 3
    assert st_.lookup(a[0], [b"n0", b"n1", b"n2", b"n3"]) == 3
    st_.release(a[0], 2)
    stats = env.stats()
    assert stats["store_no_space_keys"] == 2 and stats["store_present_keys"] == 2
    st_.verify()


def test_entry_bigger_than_region_is_refused_at_attach():
    env = small(8)
    with err(ErrorCode.NO_SPACE):
        env.store.attach("big", 0, 1, lay(block_bytes=8 * PAGE + 1))
    with err(ErrorCode.NO_SPACE):
        env.store.attach("big", 0, 4, lay("sharded", 4, block_bytes=3 * PAGE))
    assert env.store.engines == {} and env.store.sessions == {}
    s = env.store.attach("big", 0, 1, lay(block_bytes=8 * PAGE))   # exactly the region fits
    out, _ = env.put([s], 1, [b"a", b"b"])
    assert out == [W, N]
    out, _ = env.put([s], 2, [b"b"])
    assert out == [W]                                 # evicts a
    env.store.verify()


# ---------------------------------------------------------------------------- aborts and timeouts
def test_failed_vote_aborts_and_frees(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[1], 1, [b"a", b"b"])
    st_.store(sess[0], 1, [b"a", b"b"])
    assert env.stats()["pages_used"] == 2
    st_.commit(sess[0], 1, False)
    assert env.stats()["pages_used"] == 0 and env.stats()["entries_writing"] == 0
    assert st_.lookup(sess[0], [b"a"]) == 0
    assert st_.job_states(sess[1], [1])[0]["cause"] == "vote_failed"
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    with err(ErrorCode.ABORTED):
        st_.store(sess[1], 1, [b"a", b"b"])
    st_.verify()


def test_non_writer_failed_vote_quarantines_until_writer_commits(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.store(sess[1], 1, [b"a"])
    st_.commit(sess[1], 1, False)                    # a non-writer may vote no
    assert env.stats()["pages_quarantined"] == 1
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    assert env.stats()["pages_used"] == 0


def test_store_job_timeout_aborts_and_quarantines(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a", b"b"])              # the writer holds pages, rank 1 never votes
    env.clock.advance(TIMEOUT - 0.5)
    st_.expire()
    assert st_.job_states(sess[0], [1])[0]["state"] == "open"
    env.clock.advance(1.0)
    nxt = st_.expire()
    assert st_.job_states(sess[0], [1])[0] == {"job": 1, "kind": "store", "state": "aborted", "cause": "timeout"}
    assert st_.aborted["timeout"] == 1
    assert env.stats()["entries_writing"] == 0 and env.stats()["pages_quarantined"] == 2
    assert nxt is not None and nxt > env.clock()
    st_.verify()
    with err(ErrorCode.TIMEOUT):
        st_.store(sess[1], 1, [b"a", b"b"])
    with err(ErrorCode.TIMEOUT):
        st_.commit(sess[0], 1, True)                 # late writer: told, and its pages freed
    assert env.stats()["pages_used"] == 0 and env.stats()["pages_quarantined"] == 0
    with err(ErrorCode.TIMEOUT):
        st_.commit(sess[0], 1, True)                 # still a precise error from the tombstone
    st_.verify()


def test_store_job_timeout_without_writer_frees_at_once(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[1], 1, [b"a"])                    # the vote, but the writer never came
    assert env.stats()["pages_used"] == 1
    env.clock.advance(TIMEOUT + 1)
    st_.expire()
    assert env.stats()["pages_used"] == 0
    with err(ErrorCode.TIMEOUT):
        st_.store(sess[0], 1, [b"a"])


def test_quarantine_deadline_frees_pages(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    env.clock.advance(TIMEOUT + 1)
    st_.expire()
    assert env.stats()["pages_quarantined"] == 1
    env.clock.advance(TIMEOUT / 2)
    st_.expire()
    assert env.stats()["pages_quarantined"] == 1
    env.clock.advance(TIMEOUT)
    assert st_.expire() is None
    assert env.stats()["pages_quarantined"] == 0 and env.stats()["pages_used"] == 0
    with err(ErrorCode.TIMEOUT):
        st_.commit(sess[0], 1, True)
    st_.verify()


def test_load_job_timeout_drops_pins(env):
    sess = env.engine("e", 2)
    st_ = env.store
    env.put(sess, 1, [b"a", b"b"])
    st_.load(sess[0], 2, [b"a", b"b"])
    st_.load(sess[1], 2, [b"a", b"b"])
    st_.release(sess[1], 2)
    assert env.stats()["entries_pinned"] == 2
    env.clock.advance(TIMEOUT + 1)
    st_.expire()
    assert env.stats()["entries_pinned"] == 0 and env.stats()["evictable"] == 2
    with err(ErrorCode.TIMEOUT):
        st_.release(sess[0], 2)
    assert st_.lookup(sess[0], [b"a", b"b"]) == 2    # the entries themselves stay
    st_.verify()


def test_job_ids_are_not_reused(env):
    sess = env.engine("e", 1)
    st_ = env.store
    env.put(sess, 1, [b"a"])
    env.get(sess, 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.store(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.load(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.load(sess[0], 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.commit(sess[0], 1, True)
    with err(ErrorCode.CONFLICT):
        st_.release(sess[0], 2)
    with err(ErrorCode.CONFLICT):
        st_.abort(sess[0], 1)
    with err(ErrorCode.UNKNOWN_JOB):
        st_.commit(sess[0], 99, True)
    with err(ErrorCode.UNKNOWN_JOB):
        st_.release(sess[0], 99)
    with err(ErrorCode.UNKNOWN_JOB):
        st_.abort(sess[0], 99)
    assert st_.job_states(sess[0], [1, 2, 99]) == [
        {"job": 1, "kind": "store", "state": "done", "cause": ""},
        {"job": 2, "kind": "load", "state": "done", "cause": ""},
        {"job": 99, "state": "unknown"},
    ]
    # job ids are per engine
    other = env.engine("o", 1)
    out, _ = env.put(other, 1, [b"b"])
    assert out == [W]


def test_quarantined_job_id_stays_taken_after_its_tombstone_is_dropped(env, monkeypatch):
    import kvtierd.store as store_mod
    monkeypatch.setattr(store_mod, "TOMBSTONES", 2)
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.abort(sess[1], 1)                            # quarantined: rank 0 may still be copying
    for j in range(2, 6):                            # push job 1's tombstone out
        env.put(sess, j, [f"x{j}".encode()])
    assert 1 not in sess[0].engine.tombstones
    with err(ErrorCode.ABORTED):
        st_.store(sess[1], 1, [b"b"])                # not a new job over the quarantined one
    with err(ErrorCode.ABORTED):
        st_.load(sess[1], 1, [b"b"])
    st_.verify()
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    assert env.stats()["pages_quarantined"] == 0
    st_.verify()


def test_release_before_load_is_conflict(env):
    sess = env.engine("e", 2)
    env.put(sess, 1, [b"a"])
    env.store.load(sess[0], 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.release(sess[1], 2)
    env.get(sess, 2, [b"a"])


# ---------------------------------------------------------------------------- quarantine
def quarantine_setup(num_pages=8):
    env = small(num_pages)
    sess = env.engine("e", 2)
    _, pg = env.store.store(sess[0], 1, keys("q", 3))   # the writer has its pages, is copying
    held = {p for x in pg for p in pages(x)}
    env.store.abort(sess[1], 1)
    assert env.stats()["pages_quarantined"] == 3
    return env, sess, held


def fill_other(env: Env, job: int, n: int) -> tuple[list, set]:
    other = env.store.engines.get("o")
    other = list(other.ranks.values()) if other else env.engine("o", 1, model="O")
    out, got = env.put(other, job, keys(f"o{job}_", n))
    return out, {p for x in got[0] for p in pages(x)}


def test_quarantined_pages_not_reused_until_writer_commits():
    env, sess, held = quarantine_setup()
    out, used = fill_other(env, 1, 8)
    assert out == [W] * 5 + [N] * 3
    assert not used & held
    env.store.verify()
    with err(ErrorCode.ABORTED):
        env.store.commit(sess[0], 1, True)
    assert env.stats()["pages_quarantined"] == 0 and env.stats()["pages_free"] == 3
    out, used = fill_other(env, 2, 3)
    assert out == [W] * 3 and used == held
    env.store.verify()


def test_quarantined_pages_freed_when_writer_detaches():
    env, sess, held = quarantine_setup()
    env.store.detach(sess[0], "died")
    assert env.stats()["pages_quarantined"] == 0 and env.stats()["pages_free"] == 8
    env.store.verify()


def test_quarantined_pages_freed_at_deadline():
    env, sess, held = quarantine_setup()
    env.clock.advance(TIMEOUT + 0.1)
    env.store.expire()
    assert env.stats()["pages_quarantined"] == 0 and env.stats()["pages_free"] == 8
    with err(ErrorCode.ABORTED):
        env.store.commit(sess[0], 1, True)
    env.store.verify()


def test_quarantine_waits_for_every_sharded_writer():
    env = small(16)
    sess = env.engine("e", 2, "sharded")
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.store(sess[1], 1, [b"a"])
    st_.commit(sess[1], 1, True)                     # rank 1 finished copying and voted
    st_.abort(sess[0], 1)
    assert env.stats()["pages_quarantined"] == 2   # rank 0 may still be copying
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, False)
    assert env.stats()["pages_quarantined"] == 0
    st_.verify()


# ---------------------------------------------------------------------------- sessions
def test_dead_rank_aborts_unvoted_jobs_and_drops_pins(env):
    sess = env.engine("e", 2)
    st_ = env.store
    env.put(sess, 1, [b"a"])
    st_.load(sess[0], 2, [b"a"])
    st_.load(sess[1], 2, [b"a"])
    st_.release(sess[0], 2)
    st_.store(sess[0], 3, [b"b"])                    # rank 1 has not voted
    assert env.stats()["entries_pinned"] == 1 and env.stats()["entries_writing"] == 1
    st_.detach(sess[1], "died")
    stats = env.stats()
    assert stats["entries_pinned"] == 0 and stats["entries_writing"] == 0 and stats["open_jobs"] == 0
    assert stats["pages_quarantined"] == 1          # rank 0 is alive and holds b's pages
    assert st_.aborted["rank_died"] == 2
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 3, True)
    assert env.stats()["pages_used"] == 1            # only a
    st_.verify()


def test_rank_leaving_after_its_vote_does_not_abort(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[1], 1, [b"a"])
    st_.detach(sess[1])
    assert env.stats()["open_jobs"] == 1
    st_.store(sess[0], 1, [b"a"])
    st_.commit(sess[0], 1, True)
    assert st_.lookup(sess[0], [b"a"]) == 1
    st_.verify()


def test_engine_removed_when_last_session_leaves(env):
    layout = lay("replicated", 2)
    coord = env.store.attach("e", None, 2, layout)
    sess = env.ranks("e", 2, layout)
    st_ = env.store
    env.put(sess, 1, [b"a"])
    st_.store(coord, 2, [b"b"])
    st_.store(sess[0], 2, [b"b"])
    st_.store(sess[1], 2, [b"b"])                    # voted; rank 0 copying
    st_.detach(sess[1])
    assert "e" in st_.engines and env.stats()["open_jobs"] == 1
    st_.detach(sess[0])                              # writer gone before its vote: abort, free
    assert env.stats()["open_jobs"] == 0 and env.stats()["pages_quarantined"] == 0
    assert "e" in st_.engines                        # the coordinator is still there
    st_.detach(coord)
    assert "e" not in st_.engines and st_.sessions == {}
    st_.detach(coord)                                # idempotent
    # a restarted engine may change its world size, and reuse job ids
    sess = env.engine("e", 4)
    out, _ = env.put(sess, 1, [b"a", b"c"])
    assert out == [P, W]
    st_.verify()


def test_engine_leaving_frees_quarantine_at_once(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.abort(sess[1], 1)
    assert env.stats()["pages_quarantined"] == 1
    st_.detach(sess[1])
    assert env.stats()["pages_quarantined"] == 1
    st_.detach(sess[0])
    assert env.stats()["pages_quarantined"] == 0 and env.stats()["pages_used"] == 0
    st_.verify()


def test_attach_validation(env):
    st_ = env.store
    layout = lay("replicated", 2)
    s0 = st_.attach("e", 0, 2, layout)
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", 0, 2, layout)                # rank taken
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", 1, 4, layout)                # world size
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", 1, 2, lay("replicated", 2, model="other"))
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", None, 2, lay("sharded", 2))
    with err(ErrorCode.BAD_REQUEST):
        st_.attach("e", 2, 2, layout)
    assert set(st_.sessions) == {s0.id}
    s1 = st_.attach("e", 1, 2, layout)
    assert s1.id != s0.id
    st_.detach(s0)
    s0b = st_.attach("e", 0, 2, layout)              # a rank may attach again after leaving
    assert s0b.id not in (s0.id, s1.id)
    st_.verify()


def test_bad_rank_leaves_no_engine_behind(env):
    st_ = env.store
    with err(ErrorCode.BAD_REQUEST):
        st_.attach("e", 4, 4, lay("replicated", 4))
    assert st_.engines == {} and st_.sessions == {}
    st_.attach("e", 0, 2, lay("replicated", 2))      # not held to the refused world size


# ---------------------------------------------------------------------------- namespaces
def test_namespaces_never_mix(env):
    st_ = env.store
    a = env.engine("a", 1, model="m1")
    b = env.engine("b", 1, model="m2")
    c = env.engine("c", 1, dtype="fp8")
    d = env.engine("d", 1, block_tokens=32)
    e = env.engine("e", 1, block_bytes=2 * PAGE)
    f = env.engine("f", 1, "sharded")
    g = env.engine("g", 1, model="m1")               # same namespace as a
    _, ga = env.put(a, 1, [b"k"])
    for other in (b, c, d, e, f):
        assert st_.lookup(other[0], [b"k"]) == 0
        hits, _ = env.get(other, 1, [b"k"])
        assert hits == 0
        out, got = env.put(other, 2, [b"k"])
        assert out == [W]
        assert not set(pages(got[0][0])) & set(pages(ga[0][0]))
    assert st_.lookup(g[0], [b"k"]) == 1
    _, gl = env.get(g, 1, [b"k"])
    assert gl[0] == ga[0]
    assert len(st_.namespaces) == 6
    st_.verify()


# ---------------------------------------------------------------------------- recovery
def build_state(env: Env):
    st_ = env.store
    a = env.engine("a", 2, model="A", block_bytes=PAGE)
    b = env.engine("b", 2, "sharded", model="B", block_bytes=PAGE)
    _, pa = env.put(a, 1, keys("a", 4))
    _, pb = env.put(b, 1, keys("b", 2))
    st_.lookup(a[0], [b"a0"])                        # a0 is now the youngest
    st_.store(a[0], 2, [b"w0", b"w1"])               # WRITING at the crash
    st_.store(b[0], 2, [b"w2"])
    st_.load(a[0], 3, [b"a1"])                       # pinned at the crash: READY all the same
    st_.verify()
    return a, b, pa, pb


def test_recovery_keeps_ready_and_discards_writing():
    env = small(16)
    a, b, pa, pb = build_state(env)
    before_a = {k: env.store.engines["a"].ns.index[k].pages for k in keys("a", 4)}
    before_b = {k: env.store.engines["b"].ns.index[k].pages for k in keys("b", 2)}
    st2 = reopen(env.view)
    assert st2.recovered == {"ready": 6, "writing_discarded": 3, "corrupt_discarded": 0}
    st2.verify()
    stats = st2.stats()
    assert stats["entries_ready"] == 6 and stats["entries_writing"] == 0
    assert stats["pages_used"] == 4 + 2 * 2 and stats["pages_free"] == 16 - 8
    assert stats["evictable"] == 6 and stats["entries_pinned"] == 0
    a2 = [st2.attach("a2", r, 2, lay("replicated", 2, model="A")) for r in range(2)]
    b2 = [st2.attach("b2", r, 2, lay("sharded", 2, model="B")) for r in range(2)]
    assert st2.lookup(a2[0], [b"w0"]) == 0 and st2.lookup(b2[0], [b"w2"]) == 0
    assert {k: a2[0].engine.ns.index[k].pages for k in keys("a", 4)} == before_a
    assert {k: b2[0].engine.ns.index[k].pages for k in keys("b", 2)} == before_b
    for r in range(2):
        st2.load(b2[r], 1, keys("b", 2))
    for r in range(2):
        st2.release(b2[r], 1)
    st2.verify()


def test_recovery_lru_follows_ticks():
    env = small(8)
    a = env.engine("a", 1)
    env.put(a, 1, keys("k", 8))
    env.store.lookup(a[0], [b"k0", b"k1"])
    env.store.lookup(a[0], [b"k4"])
    env.get(a, 2, [b"k2"])
    # LRU: k3 k5 k6 k7 k0 k1 k4 k2
    st2 = reopen(env.view)
    st2.verify()
    s = st2.attach("a", 0, 1, lay())
    order = []
    for i in range(8):
        before = set(s.engine.ns.index)
        out, _ = st2.store(s, 10 + i, [f"n{i}".encode()])
        assert out == [W]
        st2.commit(s, 10 + i, True)
        order += sorted(before - set(s.engine.ns.index))
    assert order[:4] == [b"k3", b"k5", b"k6", b"k7"]
    assert set(order[4:6]) == {b"k0", b"k1"}        # same tick: either order
    assert order[6:] == [b"k4", b"k2"]
    st2.verify()


def test_recovery_after_clean_shutdown():
    env = small(8)
    a = env.engine("a", 2)
    env.put(a, 1, keys("k", 3))
    env.store.store(a[0], 2, [b"x"])
    env.store.lookup(a[0], [b"k0"])
    env.store.shutdown()
    assert env.store.sessions == {} and env.store.engines == {}
    assert int(env.view.header["tick"]) == env.store.tick
    env.store.verify()
    st2 = reopen(env.view)
    assert st2.recovered["ready"] == 3 and st2.recovered["writing_discarded"] == 0
    assert st2.tick == env.store.tick
    st2.verify()
    # ticks keep growing after a restart: new touches are younger than recovered ones
    s = st2.attach("a", 0, 1, lay())
    st2.lookup(s, [b"k1"])
    assert int(st2.view.entries["tick"][s.engine.ns.index[b"k1"].slot]) > env.store.tick - 1


def test_recovered_entries_can_be_evicted_and_reused():
    env = small(4)
    a = env.engine("a", 1)
    env.put(a, 1, keys("k", 4))
    st2 = reopen(env.view)
    s = st2.attach("a", 0, 1, lay())
    out, _ = st2.store(s, 1, keys("n", 4))
    assert out == [W] * 4
    st2.commit(s, 1, True)
    assert st2.lookup(s, keys("k", 4)) == 0 and st2.stats()["evictions"] == 4
    st2.verify()
    st3 = reopen(st2.view)
    assert st3.recovered["ready"] == 4
    s3 = st3.attach("a", 0, 1, lay())
    assert st3.lookup(s3, keys("n", 4)) == 4
    st3.verify()


def corrupt_env():
    """Namespace A: 1-page entries; namespace B: 2-page entries (chains of different lengths)."""
    env = small(32)
    a = env.engine("a", 1, model="A")
    b = env.engine("b", 1, model="B", block_bytes=2 * PAGE)
    env.put(a, 1, keys("a", 4))
    env.put(b, 1, keys("b", 4))
    ia = a[0].engine.ns.index
    ib = b[0].engine.ns.index
    return env, ia, ib


def slot_pages(idx, key):
    e = idx[key]
    return e.slot, pages(e.pages)


@pytest.mark.parametrize("damage", [
    "shared_page", "first_out_of_range", "link_out_of_range", "chain_short", "chain_long_short_row",
    "cycle", "bad_ns", "key_len_zero", "duplicate_key", "page_count_huge", "page_count_wrong",
    "bad_state", "ns_record_garbage", "key_len_too_long",
])
def test_recovery_discards_corrupt_entries(damage):
    env, ia, ib = corrupt_env()
    view = env.view
    ents = view.entries
    sa, pa = slot_pages(ia, b"a1")
    sb, pb = slot_pages(ib, b"b1")
    lost = {b"a1"}
    if damage == "shared_page":
        sb2, pb2 = slot_pages(ib, b"b2")
        ents[sb2]["first_page"] = pb[0]            # b2 now claims b1's pages; b1 is older
        lost = {b"b2"}
    elif damage == "first_out_of_range":
        ents[sa]["first_page"] = view.geometry.num_pages + 5
    elif damage == "link_out_of_range":
        view.chain[pb[0]] = view.geometry.num_pages
        lost = {b"b1"}
    elif damage == "chain_short":
        view.chain[pb[0]] = CHAIN_END
        lost = {b"b1"}
    elif damage == "chain_long_short_row":
        view.chain[pa[0]] = pb[0]                 # a 1-page entry whose chain goes on
    elif damage == "cycle":
        view.chain[pb[1]] = pb[0]
        lost = {b"b1"}
    elif damage == "bad_ns":
        ents[sa]["ns"] = 999
    elif damage == "key_len_zero":
        ents[sa]["key_len"] = 0
    elif damage == "key_len_too_long":
        ents[sa]["key_len"] = 200
    elif damage == "duplicate_key":
        sa2, _ = slot_pages(ia, b"a2")
        ents[sa2]["key"][:2] = np.frombuffer(b"a1", np.uint8)  # a2's record now says a1 (younger)
        lost = {b"a2"}
    elif damage == "page_count_huge":
        ents[sa]["page_count"] = 0xFFFFFFF0
    elif damage == "page_count_wrong":
        ents[sb]["page_count"] = 1
        lost = {b"b1"}
    elif damage == "bad_state":
        ents[sa]["state"] = 77
    elif damage == "ns_record_garbage":
        view.namespaces[ents[sa]["ns"]]["sharding"] = 9
        lost = set(keys("a", 4))
    st2 = reopen(view)
    st2.verify()
    assert st2.recovered["ready"] + st2.recovered["corrupt_discarded"] <= 8
    a2 = st2.attach("a2", 0, 1, lay(model="A"))
    b2 = st2.attach("b2", 0, 1, lay(model="B", block_bytes=2 * PAGE))
    for s, ks in [(a2, keys("a", 4)), (b2, keys("b", 4))]:
        for k in ks:
            assert (st2.lookup(s, [k]) == 1) == (k not in lost), (damage, k)
    st2.verify()
    # the store keeps working over the whole region: fill it, then reopen once more
    out, _ = st2.store(a2, 1, keys("n", 40))
    st2.commit(a2, 1, True)
    assert W in out and out == sorted(out)          # a prefix of W, then NO_SPACE
    assert st2.stats()["pages_free"] == 0
    st2.verify()
    st3 = reopen(st2.view)
    st3.verify()
    assert st3.recovered["corrupt_discarded"] == 0


# ---------------------------------------------------------------------------- randomized
ENGINES = {
    "r2": ("replicated", 2, "M"),
    "s2": ("sharded", 2, "M"),
    "r1": ("replicated", 1, "M"),          # shares its namespace with r2
    "r3": ("replicated", 3, "N"),
}
KEYS = [bytes([i]) for i in range(5)]
JOBS = st.integers(0, 5)
KEYLISTS = st.lists(st.sampled_from(KEYS), unique=True, max_size=4)


class StoreMachine(RuleBasedStateMachine):
    """Random interleavings of every store operation over a few engines and a small region.

    After every step: ``verify()`` and the counters agree, and every READY entry was either
    recovered at the last restart or written by a job that every rank of its engine voted on
    (the writers with a successful commit) -- invariants 1 and 5, checked against a model.
    Only RequestError may come out of the store.
    """

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.view = make_view(12)
        self.store = Store(self.view, job_timeout=TIMEOUT, clock=self.clock)
        self.sessions: list = []
        self.jobs: dict = {}            # (engine, generation, job) -> {"writes", "votes", "ws", "layout"}
        self.gen: dict = {}             # engine id -> how many times it was (re)created
        self.recovered: set = set()     # (layout, key) READY at the last restart

    # -- operations, recorded in the model when the store accepts them
    def job_model(self, session, job):
        e = session.engine
        return self.jobs.setdefault((e.id, self.gen.get(e.id, 0), job), {
            "writes": set(), "votes": set(), "ws": e.world_size, "layout": e.ns.layout})

    def do_store(self, s, job, ks):
        try:
            outcomes, pgs = self.store.store(s, job, ks)
        except RequestError:
            return
        assert len(outcomes) == len(ks)
        m = self.job_model(s, job)
        m["writes"] = {k for k, o in zip(ks, outcomes) if o == W}
        if s.rank is not None and s.rank in s.engine.writers:
            assert len(pgs) == len(m["writes"])
            assert all(len(p) == 4 * s.engine.ns.pages_per_shard for p in pgs)
            event("writer got pages" if pgs else "writer got nothing to write")
        else:
            assert pgs == []
            if s.rank is not None:
                m["votes"].add(s.rank)

    def do_commit(self, s, job, ok):
        try:
            self.store.commit(s, job, ok)
        except RequestError as exc:
            event(f"commit refused: {exc.code.name}")
            return
        if ok:
            self.job_model(s, job)["votes"].add(s.rank)

    def do_load(self, s, job, ks):
        try:
            hits, pgs = self.store.load(s, job, ks)
        except RequestError:
            return
        assert 0 <= hits <= len(ks)
        assert len(pgs) == (0 if s.rank is None else hits)
        if hits:
            event("load hit")

    def call(self, fn, *args):
        try:
            return fn(*args)
        except RequestError:
            return None

    def pick(self, data):
        return data.draw(st.sampled_from(self.sessions))

    def engine_sessions(self, data):
        engine = data.draw(st.sampled_from(sorted({s.engine.id for s in self.sessions})))
        group = [s for s in self.sessions if s.engine.id == engine]
        return data.draw(st.permutations(group))

    # -- rules
    @initialize(coordinators=st.sets(st.sampled_from(sorted(ENGINES))))
    def attach_everyone(self, coordinators):
        for engine, (kind, ws, model) in sorted(ENGINES.items()):
            self.gen[engine] = 1
            ranks = ([None] if engine in coordinators else []) + list(range(ws))
            for rank in ranks:
                self.sessions.append(self.store.attach(engine, rank, ws, lay(kind, ws, model=model)))

    @rule(engine=st.sampled_from(sorted(ENGINES)), data=st.data())
    def attach(self, engine, data):
        kind, ws, model = ENGINES[engine]
        rank = data.draw(st.integers(-1, ws))         # ws itself is out of range
        res = self.call(self.store.attach, engine, None if rank < 0 else rank, ws, lay(kind, ws, model=model))
        if res is not None:
            if not any(s.engine.id == engine for s in self.sessions):
                self.gen[engine] = self.gen.get(engine, 0) + 1      # a new engine: job ids restart
            self.sessions.append(res)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def detach(self, data):
        s = self.pick(data)
        self.store.detach(s, data.draw(st.sampled_from(["left", "died"])))
        self.sessions.remove(s)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS)
    def store_one(self, data, job, ks):
        self.do_store(self.pick(data), job, ks)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ok=st.booleans())
    def commit_one(self, data, job, ok):
        self.do_commit(self.pick(data), job, ok)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS)
    def store_all(self, data, job, ks):
        """The whole store protocol by every attached session of one engine, in a random order."""
        group = self.engine_sessions(data)
        for s in group:
            self.do_store(s, job, ks)
        for s in group:
            if s.rank is not None and s.rank in s.engine.writers:
                self.do_commit(s, job, data.draw(st.sampled_from([True, True, True, False])))

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS, release=st.booleans())
    def load_all(self, data, job, ks, release):
        group = self.engine_sessions(data)
        for s in group:
            self.do_load(s, job, ks)
        if release:
            for s in group:
                self.call(self.store.release, s, job)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS.filter(bool))
    def roundtrip(self, data, job, ks):
        """Store then load the same keys by one engine (a READY-rich path)."""
        group = self.engine_sessions(data)
        for s in group:
            self.do_store(s, job, ks)
        for s in group:
            if s.rank is not None and s.rank in s.engine.writers:
                self.do_commit(s, job, True)
        for s in group:
            self.do_load(s, job + 6, ks)
        for s in group:
            self.call(self.store.release, s, job + 6)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS)
    def load_one(self, data, job, ks):
        self.do_load(self.pick(data), job, ks)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS)
    def release(self, data, job):
        self.call(self.store.release, self.pick(data), job)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS)
    def abort(self, data, job):
        self.call(self.store.abort, self.pick(data), job)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), ks=KEYLISTS)
    def lookup(self, data, ks):
        assert 0 <= self.store.lookup(self.pick(data), ks) <= len(ks)

    @rule(data=st.data())
    def job_states(self, data):
        if self.sessions:
            states = self.store.job_states(self.pick(data), list(range(12)))
            assert all(x["state"] in ("open", "done", "aborted", "unknown") for x in states)

    @rule(dt=st.sampled_from([1.0, TIMEOUT / 2, TIMEOUT + 1]))
    def expire(self, dt):
        self.clock.advance(dt)
        nxt = self.store.expire()
        assert nxt is None or nxt > self.clock()

    @rule(clean=st.booleans())
    def restart(self, clean):
        if clean:
            self.store.shutdown()
        self.store = reopen(self.view, self.clock)
        assert self.store.recovered["corrupt_discarded"] == 0
        self.sessions = []
        self.jobs = {}
        self.recovered = {(ns.layout, k) for ns in self.store.namespaces.values() for k in ns.index}
        assert self.store.stats()["entries_writing"] == 0

    # -- invariants
    @invariant()
    def consistent(self):
        self.store.verify()
        stats = self.store.stats()
        assert stats["pages_free"] + stats["pages_used"] == stats["pages_total"]
        assert stats["entries_ready"] + stats["entries_writing"] == sum(
            len(ns.index) for ns in self.store.namespaces.values())
        assert stats["entries_pinned"] == sum(
            1 for ns in self.store.namespaces.values() for e in ns.index.values() if e.pins)
        if stats["pages_quarantined"]:
            event("pages quarantined")
        if stats["evictions"]:
            event("evictions")

    @invariant()
    def ready_only_after_every_vote(self):
        """Invariant 1/5: a READY entry was recovered, or some job wrote it and every rank voted."""
        done = set()
        for m in self.jobs.values():
            if len(m["votes"]) >= m["ws"]:
                done |= {(m["layout"], k) for k in m["writes"]}
        for ns in self.store.namespaces.values():
            for k, e in ns.index.items():
                if e.state is EntryState.READY:
                    event("ready entries")
                    assert (ns.layout, k) in done | self.recovered, k


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])

"""kvtierd.index through the store: capacity, eviction by the policy across namespaces, pins,
no-space prefixes, namespaces that never mix, and recovery from the region's tables.

The scenarios drive ``Store`` (the front the server calls) over a region in memory
(``store_env``); every one ends with ``verify()``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.contract.codes import ErrorCode
from kvtierd.contract.region_format import NS_SLOTS
from kvtierd.records import keys_of

from .store_env import (DAMAGES, PAGE, Env, N, P, W, corrupt_env, damage_region, err, keys, lay, pages, per_entry,
                        reopen, slot_of, slot_pages, small)

# ---------------------------------------------------------------------------- capacity
def fill_count(env: Env, kind: str, tp: int) -> int:
    sess = env.engine("e", tp, kind, block_bytes=PAGE)
    ks = keys("k", 200)
    out, _ = env.put(sess, 1, ks)
    n = out.count(W)
    assert list(out) == [W] * n + [N] * (200 - n)   # a prefix
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
    env = small(8, policy="lru")
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
    assert list(out) == [W, W, W]
    assert env.stats()["evictions"] == 3
    gone = {k for k in [b"a2", b"b2", b"a3"]}
    for s, k in [(a[0], b"a1"), (a[0], b"a2"), (a[0], b"a3"), (a[0], b"a4"),
                 (b[0], b"b1"), (b[0], b"b2"), (b[0], b"b3"), (b[0], b"b4")]:
        assert env.has(s, k) == (k not in gone), k
    # a PRESENT key in a store job is touched too
    out, _ = env.put(a, 3, [b"a4"])
    assert list(out) == [P]
    env.put(a, 4, [b"d1"])                          # LRU: b3 b4 a1 b1 c* a4 -> evicts b3
    assert not env.has(b[0], b"b3") and env.has(a[0], b"a4")
    st_.verify()


def test_pinned_entries_survive_eviction_pressure():
    env = small(8, policy="lru")
    st_ = env.store
    a = env.engine("a", 2)
    env.put(a, 1, keys("a", 8))
    hits, _ = st_.load(a[0], 2, keys("a", 3))       # pin a0..a2 (rank 1 has not even loaded yet)
    assert hits == 3
    b = env.engine("b", 1, model="B")
    out, _ = env.put(b, 1, keys("b", 8))
    assert list(out) == [W] * 5 + [N] * 3
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
    assert list(out) == [W] * 3
    assert all(env.has(a[0], k) for k in keys("a", 3))
    assert not any(env.has(b[0], k) for k in keys("b", 3))
    out, _ = env.put(b, 3, keys("b", 5, 11))
    assert list(out) == [W] * 5
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
    assert list(out) == [W, W, N]
    st_.release(a[0], 3)
    out, _ = env.put(b, 2, keys("c", 4))
    assert list(out) == [W] * 4                      # x and y are evictable again
    assert not env.has(a[0], b"x") and not env.has(a[0], b"y")


def test_writing_entries_are_never_evicted():
    env = small(6)
    st_ = env.store
    a = env.engine("a", 2)
    st_.store(a[0], 1, keys("a", 4))                 # WRITING, not voted
    b = env.engine("b", 1, model="B")
    out, _ = env.put(b, 1, keys("b", 4))
    assert list(out) == [W, W, N, N]
    out, _ = env.put(b, 2, keys("c", 2))             # evicts b0, b1, never a WRITING entry
    assert list(out) == [W, W]
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
    assert list(out) == [P, P, P, P, N]
    assert st_.lookup(a[0], keys("r", 4)) == 4
    # with two of the job's keys present, the new key evicts an entry outside the job
    out, _ = env.put(a, 3, [b"r3", b"new", b"r0"])
    assert list(out) == [P, W, P]
    assert env.has(a[0], b"r0") and env.has(a[0], b"r3")
    assert sum(env.has(a[0], k) for k in [b"r1", b"r2"]) == 1
    st_.verify()


def test_present_includes_keys_being_written_by_another_job(env):
    a = env.engine("a", 2)
    b = env.engine("b", 1)                           # same namespace
    st_ = env.store
    st_.store(a[0], 1, [b"x"])
    out, pg = st_.store(b[0], 1, [b"x", b"y"])
    assert list(out) == [P, W] and len(pages(pg)) == 1      # y's one page
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
    assert list(out) == [P, W, W, W, N, P, N]
    assert len(pages(got[0])) == 3                   # n0..n2's one page each
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
    assert env.store.jobs.engines == {} and env.store.attachments.sessions == {}
    s = env.store.attach("big", 0, 1, lay(block_bytes=8 * PAGE))   # exactly the region fits
    out, _ = env.put([s], 1, [b"a", b"b"])
    assert list(out) == [W, N]
    out, _ = env.put([s], 2, [b"b"])
    assert list(out) == [W]                           # evicts a
    env.store.verify()

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
        assert list(out) == [W]
        assert not set(pages(got[0])) & set(pages(ga[0]))
    assert st_.lookup(g[0], [b"k"]) == 1
    _, gl = env.get(g, 1, [b"k"])
    assert gl[0] == ga[0]
    assert len(st_.index.namespaces) == 6
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
    index = env.store.index
    before_a = {k: slot_pages((index, env.store.jobs.engines["a"].ns), k) for k in keys("a", 4)}
    before_b = {k: slot_pages((index, env.store.jobs.engines["b"].ns), k) for k in keys("b", 2)}
    st2 = reopen(env.view)
    # The writers had their pages (w0, w1: rank 0's; w2: rank 0's shard) and may still copy into
    # them: fenced, not free (kvtierd.fence; the unit store's writers cannot be watched).
    assert st2.recovered == {"ready": 6, "writing_discarded": 3, "corrupt_discarded": 0, "pages_fenced": 3}
    st2.verify()
    stats = st2.stats()
    assert stats["entries_ready"] == 6 and stats["entries_writing"] == 0
    assert stats["pages_fenced"] == 3 and stats["fenced_pages"]["restart_recovery"] == 3
    assert stats["pages_used"] == 4 + 2 * 2 + 3 and stats["pages_free"] == 16 - 8 - 3
    assert stats["evictable"] == 6 and stats["entries_pinned"] == 0
    a2 = [st2.attach("a2", r, 2, lay("replicated", 2, model="A")) for r in range(2)]
    b2 = [st2.attach("b2", r, 2, lay("sharded", 2, model="B")) for r in range(2)]
    assert st2.lookup(a2[0], [b"w0"]) == 0 and st2.lookup(b2[0], [b"w2"]) == 0
    assert {k: slot_pages((st2.index, a2[0].engine.ns), k) for k in keys("a", 4)} == before_a
    assert {k: slot_pages((st2.index, b2[0].engine.ns), k) for k in keys("b", 2)} == before_b
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
        before = set(st2.index.keys_of(st2.index.slots_of(s.engine.ns)))
        out, _ = st2.store(s, 10 + i, [f"n{i}".encode()])
        assert list(out) == [W]
        st2.commit(s, 10 + i, True)
        order += sorted(before - set(st2.index.keys_of(st2.index.slots_of(s.engine.ns))))
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
    assert env.store.attachments.sessions == {} and env.store.jobs.engines == {}
    assert int(env.view.header["tick"]) == env.store.index.tick
    env.store.verify()
    st2 = reopen(env.view)
    assert st2.recovered["ready"] == 3 and st2.recovered["writing_discarded"] == 0
    assert st2.index.tick == env.store.index.tick
    st2.verify()
    # ticks keep growing after a restart: new touches are younger than recovered ones
    s = st2.attach("a", 0, 1, lay())
    st2.lookup(s, [b"k1"])
    assert int(st2.index.view.entries["tick"][slot_of(st2.index, s.engine.ns, b"k1")]) > env.store.index.tick - 1


def test_recovered_entries_can_be_evicted_and_reused():
    env = small(4)
    a = env.engine("a", 1)
    env.put(a, 1, keys("k", 4))
    st2 = reopen(env.view)
    s = st2.attach("a", 0, 1, lay())
    out, _ = st2.store(s, 1, keys("n", 4))
    assert list(out) == [W] * 4
    st2.commit(s, 1, True)
    assert st2.lookup(s, keys("k", 4)) == 0 and st2.stats()["evictions"] == 4
    st2.verify()
    st3 = reopen(st2.index.view)
    assert st3.recovered["ready"] == 4
    s3 = st3.attach("a", 0, 1, lay())
    assert st3.lookup(s3, keys("n", 4)) == 4
    st3.verify()


@pytest.mark.parametrize("damage", DAMAGES)
def test_recovery_discards_corrupt_entries(damage):
    env, ia, ib = corrupt_env()
    view = env.view
    lost = set(damage_region(env, ia, ib, damage))
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
    assert W in out and list(out) == sorted(out)    # a prefix of W, then NO_SPACE
    assert st2.stats()["pages_free"] == 0
    st2.verify()
    st3 = reopen(st2.index.view)
    st3.verify()
    assert st3.recovered["corrupt_discarded"] == 0


# ---------------------------------------------------------------------------- index internals
def test_pages_for_a_rank():
    env = small(32)
    rep = env.engine("r", 2, block_bytes=2 * PAGE, model="R")
    shd = env.engine("s", 2, "sharded", block_bytes=2 * PAGE, model="S")
    env.put(rep, 1, keys("k", 2))
    env.put(shd, 1, keys("k", 2))
    index, view = env.store.index, env.view
    nr, ns = rep[0].engine.ns, shd[0].engine.ns
    er, es = index.find(nr, keys("k", 2)), index.find(ns, keys("k", 2))
    chains_r, chains_s = [view.chain_of(e).tolist() for e in er], [view.chain_of(e).tolist() for e in es]
    for rank in (0, 1):                                 # the one copy, for every rank
        assert [pages(p) for p in per_entry(index.pages_of(nr, er, rank), 2)] == chains_r
        assert [pages(p) for p in per_entry(index.pages_of(ns, es, rank), 2)] == [c[2 * rank:2 * rank + 2]
                                                                                  for c in chains_s]
    none = np.zeros(0, np.int32)
    assert index.pages_of(ns, none, 1) == b"" and index.pages_of(nr, none, 0) == b""


def test_full_namespace_table_reuses_an_unused_empty_namespace():
    env = small(8)
    st_ = env.store
    first = env.engine("e0", 1, model="m0")
    env.put(first, 1, [b"k"])                        # m0 holds an entry: its slot is not taken over
    for i in range(1, NS_SLOTS):
        st_.detach(env.engine(f"e{i}", 1, model=f"m{i}")[0])   # empty namespaces nobody uses
    held = env.engine("held", 1, model="m1")          # m1 is used again: not taken over either
    assert len(st_.index.namespaces) == NS_SLOTS
    newcomer = env.engine("new", 1, model="new")
    assert newcomer[0].engine.ns.slot == 2            # the first empty namespace nobody uses: m2's
    assert lay(model="m2") not in st_.index.namespaces and len(st_.index.namespaces) == NS_SLOTS
    assert held[0].engine.ns.slot == 1 and st_.lookup(first[0], [b"k"]) == 1
    for i in range(3, NS_SLOTS):                      # now use every namespace
        env.engine(f"again{i}", 1, model=f"m{i}")
    with err(ErrorCode.NO_SPACE) as info:
        env.engine("one-too-many", 1, model="m-last")
    assert f"all {NS_SLOTS} namespace slots are held by attached engines" in info.value.message
    st_.verify()


def test_verify_catches_a_leaked_page_and_a_stray_policy_member(env):
    sess = env.engine("e", 1)
    env.put(sess, 1, [b"a"])
    index = env.store.index
    taken = index.pages.alloc(1)
    with pytest.raises(AssertionError, match="1 pages leaked"):
        env.store.verify()
    index.pages.free(taken)
    a = index.find(sess[0].engine.ns, [b"a"])
    index.policy.pinned(a)
    with pytest.raises(AssertionError, match="the policy holds other than the READY unheld"):
        env.store.verify()
    index.policy.unpinned(a)


def fingerprints(ks: list[bytes]) -> list[int]:
    """What the policy is told of each key: its fingerprint, Python's hash of its bytes as uint64."""
    return [hash(k) % (1 << 64) for k in ks]


def test_the_policy_hears_keys_chain_and_the_written_part_of_a_cold_tail():
    """make_ready hands the policy the written entries and their keys' fingerprints in order, the
    job's chain flag, and how many of them lie in the cold tail: PRESENT keys in the tail are not
    counted (they were not written), nor NO_SPACE ones; recovery hands it the recovered entries and
    their keys' fingerprints."""
    env = small(8)
    st_ = env.store
    a = env.engine("a", 1)
    env.put(a, 1, [b"k2"])
    heard = []
    policy = st_.index.policy
    real = policy.inserted
    policy.inserted = lambda slots, fps, chain=True, cold=0: (
        heard.append((st_.index.keys_of(slots), np.asarray(fps, np.uint64).tolist(), chain, cold)),
        real(slots, fps, chain, cold))
    st_.store(a[0], 2, [b"k0", b"k1", b"k2", b"k3"], True, 2)     # k2 PRESENT: 1 written key in the tail
    st_.commit(a[0], 2, True)
    st_.store(a[0], 3, keys("x", 9), False, 3)                    # 8 fit (the rest evicted): x8 NO_SPACE
    st_.commit(a[0], 3, True)
    k, x = [b"k0", b"k1", b"k3"], keys("x", 8)
    assert heard == [(k, fingerprints(k), True, 1), (x, fingerprints(x), False, 2)]
    assert env.stats()["policy_refused_keys"] == 3
    st_.verify()
    st_.shutdown()
    back = []
    real_recovered = type(policy).recovered
    type(policy).recovered = lambda self, slots, fps: (
        back.extend(zip(keys_of(env.view, slots), np.asarray(fps, np.uint64).tolist())),
        real_recovered(self, slots, fps))
    try:
        reopen(env.view)
    finally:
        type(policy).recovered = real_recovered
    assert sorted(back) == sorted(zip(x, fingerprints(x)))


def test_stats_count_evictions_by_reason_and_by_segment():
    env = small(8)
    a = env.engine("a", 1)
    env.put(a, 1, keys("a", 8))
    env.store.lookup(a[0], keys("a", 2))                 # used again: promoted at the next walk
    env.put(a, 2, keys("b", 3))                          # evicts 3 for room, from probation
    assert env.store.evict(None, 2).evicted == 2         # the operator takes the next 2
    s = env.stats()
    assert (s["evictions"], s["operator_evictions"]) == (3, 2)
    assert s["policy_evictions"] == {"probation": 5, "protected": 0}
    assert sum(s["policy_segments"].values()) == s["evictable"] == 6
    assert s["policy_extra"]["promoted"] == 2
    env.store.verify()


def test_a_full_namespace_table_takes_over_the_least_recently_used_unused_namespace_with_its_entries():
    # Issue 11 item 8: a client filled all 1,024 slots, each namespace holding an entry, and kept
    # every new model out across restarts.
    env = small(2048)
    st_ = env.store
    for i in range(NS_SLOTS):
        s = env.engine(f"e{i}", 1, model=f"m{i}")
        env.put(s, 1, [b"k%d" % i])
        st_.detach(s[0])                                 # gone, its entry left behind
    env.view.header["tick"] = st_.index.tick
    st_ = reopen(env.view)                               # across a restart too
    old = st_.attach("e7", 0, 1, lay(model="m7"))
    assert st_.lookup(old, [b"k7"]) == 1                 # m7 is used again: the newest now
    st_.detach(old)
    new = st_.attach("new", 0, 1, lay(model="new"))
    assert new.engine.ns.slot == 0                       # m0's: used least recently
    assert lay(model="m0") not in st_.index.namespaces and st_.stats()["entries_ready"] == NS_SLOTS - 1
    st_.detach(new)
    st_.verify()

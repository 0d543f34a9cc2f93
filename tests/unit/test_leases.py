"""kvtierd.leases through the store: a lookup's hits held until a load consumes them, their
release, renewal, expiry, revocation, the end of their session, the caps, and operator eviction.

The scenarios drive ``Store`` over a region in memory (``store_env``); every one ends with
``verify()``, which checks the leases against the entries' lease counts and the policy's set.
"""

from __future__ import annotations

import pytest

from kvtierd.attachments import SessionEnd
from kvtierd.leases import MIN_TTL
from kvtierd.store import Store

from .store_env import TIMEOUT, N, W, keys, make_view, pages, reopen, slot_of, small


def fill(env, engine_sessions, job: int, count: int, prefix: str = "f") -> bytes:
    """Another engine stores ``count`` new keys (evicting what it can for room)."""
    outcomes, _ = env.put(engine_sessions, job, keys(prefix, count))
    return outcomes


def evictable(env, session, ks) -> list[bool]:
    index = env.store.index
    slots = index.find(session.engine.ns, ks)
    assert (slots >= 0).all(), "a key has no entry"
    return [slot in index.policy for slot in slots.tolist()]


# ---------------------------------------------------------------------------- hold and consume
def test_a_leased_prefix_survives_a_region_filled_by_another_engine():
    env = small(8)
    a, other = env.engine("a", 1), env.engine("other", 1, model="other")
    ours = keys("k", 4)
    env.put(a, 1, ours)
    found = env.store.lease(a[0], 7, ours + [b"absent"], ttl=2.0)
    assert (found.hits, found.lease, found.leased, found.ttl) == (4, 7, 4, 2.0)
    assert evictable(env, a[0], ours) == [False] * 4
    outcomes = fill(env, other, 1, 8)              # wants the whole region: gets the 4 unleased pages
    assert outcomes.count(W) == 4 and outcomes.count(N) == 4
    assert all(env.has(a[0], k) for k in ours)
    hits, got = env.store.load(a[0], 2, ours, 7)    # the load consumes the lease: never short
    assert hits == 4 and len(pages(got)) == 4       # an entry is a page
    stats = env.stats()
    assert stats["lease_ends"] == {"consumed": 1} and stats["leases_open"] == 0
    assert stats["entries_leased"] == 0 and stats["entries_pinned"] == 4
    env.store.release(a[0], 2)
    assert evictable(env, a[0], ours) == [True] * 4
    env.store.verify()


def test_without_a_lease_the_same_fill_evicts_the_hits():
    env = small(8)
    a, other = env.engine("a", 1), env.engine("other", 1, model="other")
    ours = keys("k", 4)
    env.put(a, 1, ours)
    assert env.store.lookup(a[0], ours) == 4
    fill(env, other, 1, 8)
    hits, _ = env.store.load(a[0], 2, ours)
    assert hits == 0
    env.store.release(a[0], 2)
    env.store.verify()


def test_the_coordinators_lease_is_consumed_by_the_ranks_load_with_no_evictable_moment(env):
    ranks = env.engine("e", 2)
    coordinator = env.store.attach("e", None, 2, ranks[0].engine.ns.id)
    ks = keys("k", 3)
    env.put(ranks, 1, ks)
    unpinned = []
    policy = env.store.index.policy
    original = policy.unpinned
    policy.unpinned = lambda slots: (unpinned.extend(slots), original(slots))
    assert env.store.lease(coordinator, 1, ks).leased == 3
    hits, _ = env.store.load(ranks[1], 5, ks, 1)    # a rank's request opens the job: pins, then consumes
    assert hits == 3 and unpinned == []              # the entries never re-entered the evictable set
    assert env.store.load(ranks[0], 5, ks, 1)[0] == 3   # joins the job; the lease is gone already
    assert env.stats()["lease_missed_loads"] == 0
    for r in ranks:
        env.store.release(r, 5)
    assert sorted(unpinned) == sorted(env.store.index.find(ranks[0].engine.ns, ks).tolist())
    del policy.unpinned


def test_a_load_naming_a_lease_consumes_all_of_it_and_pins_only_its_own_keys(env):
    a = env.engine("a", 1)
    ks = keys("k", 4)
    env.put(a, 1, ks)
    env.store.lease(a[0], 3, ks)
    hits, _ = env.store.load(a[0], 2, ks[:2], 3)     # vLLM loads fewer than it looked up
    assert hits == 2
    assert evictable(env, a[0], ks) == [False, False, True, True]
    env.store.release(a[0], 2)
    assert env.stats()["lease_ends"] == {"consumed": 1}


def test_a_load_naming_a_lease_that_is_not_live_is_a_plain_load(env):
    a = env.engine("a", 1)
    env.put(a, 1, keys("k", 2))
    assert env.store.load(a[0], 2, keys("k", 2), 99)[0] == 2
    env.store.release(a[0], 2)
    assert env.stats()["lease_missed_loads"] == 1


def test_a_lease_of_another_engine_is_neither_consumed_nor_released(env):
    a, b = env.engine("a", 1), env.engine("b", 1)           # the same namespace
    ks = keys("k", 2)
    env.put(a, 1, ks)
    env.store.lease(a[0], 4, ks)
    assert env.store.unlease(b[0], [4]) == 0
    env.store.load(b[0], 1, ks, 4)
    env.store.release(b[0], 1)
    stats = env.stats()
    assert stats["leases_open"] == 1 and stats["lease_missed_loads"] == 1


def test_two_leases_of_one_entry_hold_it_until_both_end(env):
    a = env.engine("a", 1)
    ks = keys("k", 3)
    env.put(a, 1, ks)
    env.store.lease(a[0], 1, ks)                # two requests sharing a prefix
    env.store.lease(a[0], 2, ks[:2])
    assert env.stats()["entries_leased"] == 3 and env.stats()["leased_keys"] == 5
    assert env.store.unlease(a[0], [1, 5]) == 1
    assert evictable(env, a[0], ks) == [False, False, True]
    assert env.store.unlease(a[0], [2]) == 1
    assert evictable(env, a[0], ks) == [True] * 3
    assert env.stats()["lease_ends"] == {"released": 2}


def test_a_lookup_with_no_hits_holds_nothing(env):
    a = env.engine("a", 1)
    found = env.store.lease(a[0], 1, keys("nothing", 3))
    assert (found.hits, found.lease, found.leased, found.ttl) == (0, None, 0, 0.0)
    assert env.stats()["leases_open"] == 0


# ---------------------------------------------------------------------------- renew, expire
def test_renewal_replaces_the_lease_and_never_lets_a_shared_entry_go(env):
    a = env.engine("a", 1)
    ks = keys("k", 4)
    env.put(a, 1, ks)
    policy = env.store.index.policy
    unpinned, original = [], policy.unpinned
    policy.unpinned = lambda slots: (unpinned.extend(slots), original(slots))
    env.store.lease(a[0], 1, ks[:3], ttl=1.0)
    env.clock.advance(0.8)
    found = env.store.lease(a[0], 1, ks[1:], ttl=1.0)      # the same id: renewed over other keys
    assert found.leased == 3
    assert unpinned == [slot_of(env.store.index, a[0].engine.ns, ks[0])]  # only the key the new lease lacks
    env.clock.advance(0.8)                                  # past the first deadline, not the renewed one
    env.store.expire()
    assert evictable(env, a[0], ks) == [True, False, False, False]
    env.clock.advance(0.3)
    env.store.expire()
    assert evictable(env, a[0], ks) == [True] * 4
    assert env.stats()["lease_ends"] == {"replaced": 1, "expired": 1}
    assert env.stats()["leases_granted"] == 2
    del policy.unpinned


def test_a_renewal_that_finds_nothing_ends_the_lease(env):
    a = env.engine("a", 1)
    env.put(a, 1, keys("k", 2))
    env.store.lease(a[0], 1, keys("k", 2))
    assert env.store.lease(a[0], 1, [b"gone"]).lease is None
    assert env.stats()["leases_open"] == 0 and env.stats()["lease_ends"] == {"replaced": 1}


@pytest.mark.parametrize("asked, granted", [(None, 5.0), (0.0, MIN_TTL), (0.002, MIN_TTL), (3.0, 3.0),
                                            (1e6, 60.0)])
def test_the_ttl_is_the_setting_by_default_and_clamped(env, asked, granted):
    a = env.engine("a", 1)
    env.put(a, 1, [b"k"])
    assert env.store.lease(a[0], 1, [b"k"], asked).ttl == granted
    assert env.store.expire() <= env.clock() + granted       # the loop wakes up for it
    env.clock.advance(granted * 0.99)
    env.store.expire()
    assert env.stats()["leases_open"] == 1
    env.clock.advance(granted * 0.02)
    env.store.expire()
    assert env.stats()["lease_ends"] == {"expired": 1}


def test_many_renewals_leave_the_deadline_heap_bounded(env):
    a = env.engine("a", 1)
    env.put(a, 1, [b"k"])
    for _ in range(5000):
        env.store.lease(a[0], 1, [b"k"], ttl=30.0)
    assert len(env.store.leases._deadlines) <= 2 * 1 + 1024 + 1
    assert env.stats()["leases_open"] == 1


# ---------------------------------------------------------------------------- sessions, restarts
def test_leases_die_with_the_session_that_holds_them(env):
    ranks = env.engine("e", 1)
    coordinator = env.store.attach("e", None, 1, ranks[0].engine.ns.id)
    ks = keys("k", 2)
    env.put(ranks, 1, ks)
    env.store.lease(coordinator, 1, ks)
    env.store.lease(ranks[0], 2, ks)
    env.store.detach(coordinator, SessionEnd.DIED)
    assert env.stats()["lease_ends"] == {"session_ended": 1} and env.stats()["leases_open"] == 1
    assert env.store.leases.of_session(ranks[0]) == (1, 2)
    env.store.detach(ranks[0], SessionEnd.LEFT)
    assert env.stats()["leases_open"] == 0 and env.stats()["entries_leased"] == 0


def test_a_restart_loses_leases_and_keeps_the_entries():
    env = small(16)
    a = env.engine("a", 1)
    ks = keys("k", 3)
    env.put(a, 1, ks)
    env.store.lease(a[0], 1, ks)
    restarted = reopen(env.view, env.clock)
    s = restarted.attach("a", 0, 1, a[0].engine.ns.id)
    stats = restarted.stats()
    assert stats["leases_open"] == 0 and stats["entries_ready"] == 3 and stats["evictable"] == 3
    assert restarted.lease(s, 1, ks).leased == 3          # the client re-issues it
    restarted.verify()


# ---------------------------------------------------------------------------- caps
def test_the_per_engine_cap_leases_the_prefix_that_fits():
    clock_env = small(32)
    store = Store(make_view(32), job_timeout=TIMEOUT, clock=clock_env.clock, max_leased_keys_per_engine=6)
    clock_env.store = store
    a, b = clock_env.engine("a", 1), clock_env.engine("b", 1)
    ks = keys("k", 8)
    clock_env.put(a, 1, ks)
    assert store.lease(a[0], 1, ks).leased == 5             # 5 entries + 1 for the lease
    assert store.lease(a[0], 2, ks).leased == 0             # no room left for engine a
    assert store.lease(a[0], 1, ks[:3]).leased == 3         # a renewal gets its own lease's room back
    assert store.lease(a[0], 2, ks).leased == 1
    assert store.lease(b[0], 1, ks).leased == 5             # another engine has its own
    stats = store.stats()
    assert stats["lease_capped_keys"] == 3 + 8 + 7 + 3
    assert stats["leased_keys"] == 3 + 1 + 5
    store.verify()


def test_the_cap_over_all_engines():
    env = small(32)
    env.store = Store(make_view(32), job_timeout=TIMEOUT, clock=env.clock, max_leased_keys=10)
    a, b = env.engine("a", 1), env.engine("b", 1)
    ks = keys("k", 8)
    env.put(a, 1, ks)
    assert env.store.lease(a[0], 1, ks).leased == 8
    assert env.store.lease(b[0], 1, ks).leased == 0         # 9 of 10 taken: no room for a lease of one
    env.store.unlease(a[0], [1])
    assert env.store.lease(b[0], 1, ks).leased == 8
    env.store.verify()


# ---------------------------------------------------------------------------- operators
def test_evict_and_clear_skip_leased_entries_and_say_so(env):
    a = env.engine("a", 1)
    ks = keys("k", 5)
    env.put(a, 1, ks)
    env.store.lease(a[0], 1, ks[:3])
    done = env.store.evict(None, 10)
    assert (done.evicted, done.skipped_leased, done.revoked_leases) == (2, 3, 0)
    assert env.store.evict(None, 1).skipped_leased == 3     # nothing evictable left
    name = a[0].engine.ns.id.name()
    done = env.store.evict(name, None)                      # clear of our namespace
    assert (done.evicted, done.skipped_leased) == (0, 3)
    assert all(env.has(a[0], k) for k in ks[:3])


def test_evict_reports_no_skipped_leases_while_it_found_what_it_was_asked_for(env):
    a = env.engine("a", 1)
    ks = keys("k", 5)
    env.put(a, 1, ks)
    env.store.lease(a[0], 1, ks[:2])
    done = env.store.evict(None, 2)
    assert (done.evicted, done.skipped_leased) == (2, 0)


def test_a_forced_clear_revokes_the_leases_and_their_load_comes_back_short(env):
    a, b = env.engine("a", 1), env.engine("b", 1, model="other")
    ks = keys("k", 3)
    env.put(a, 1, ks)
    env.put(b, 1, keys("o", 2))
    env.store.lease(a[0], 1, ks)
    env.store.lease(b[0], 1, keys("o", 2))
    done = env.store.evict(a[0].engine.ns.id.name(), None, force=True)
    assert (done.evicted, done.skipped_leased, done.revoked_leases) == (3, 0, 1)
    assert env.store.load(a[0], 2, ks, 1)[0] == 0           # the phase-1 path: the engine recomputes
    env.store.release(a[0], 2)
    stats = env.stats()
    assert stats["lease_ends"] == {"revoked": 1} and stats["lease_missed_loads"] == 1
    assert stats["leases_open"] == 1                        # the other namespace's lease stays
    done = env.store.evict(None, None, force=True)
    assert (done.evicted, done.revoked_leases) == (2, 1)

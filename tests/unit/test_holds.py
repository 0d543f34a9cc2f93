"""kvtierd.holds through the store: what one engine, one namespace and all engines can keep out of
eviction — leases and load pins together — is a share of the region's pages (issue 26 D).

Issue 26 D: an engine that leased every entry of the region and renewed its lease kept every
other engine's stores at WRITE for 0: max_leased_keys_per_engine, an absolute count, is far above
a default region's entries. The stores here run over a region in memory (``store_env``) with the
default shares, 100 pages of one page per entry; every scenario ends with ``verify()``, which
checks the held counts against the leases and the load jobs.
"""

from __future__ import annotations

from kvtierd.contract.codes import StoreOutcome

from .store_env import PAGE, Env, keys, pages

SHARES = (0.25, 0.4, 0.75)         # the settings' defaults: engine, namespace, all engines


def region(pages: int = 100) -> Env:
    return Env(pages, held_shares=SHARES)


def test_an_engine_that_leases_the_whole_region_holds_its_share_and_others_can_store():
    env = region()
    a, b = env.engine("a", 1, model="A"), env.engine("b", 1, model="B")
    ours = keys("a", 100)
    env.put(a, 1, ours)
    found = env.store.lease(a[0], 1, ours)
    assert (found.hits, found.leased) == (100, 25)               # fails soft: its reply says how much
    assert env.store.lease(a[0], 1, ours).leased == 25           # a renewal holds as much again
    stats = env.stats()
    assert stats["held_pages"] == stats["held_pages_top_engine"] == 25
    assert stats["hold_capped_keys"] == {"engine": 150, "namespace": 0, "total": 0}
    assert stats["lease_capped_keys"] == 150
    outcomes, _ = env.put(b, 1, keys("b", 60))                   # evicts what a does not hold
    assert list(outcomes) == [StoreOutcome.WRITE] * 60
    assert all(env.has(a[0], k) for k in ours[:25])              # what a holds stays
    env.store.verify()


def test_a_load_of_leased_keys_is_whole_and_a_load_past_the_share_is_cut():
    env = region()
    a = env.engine("a", 1)
    ks = keys("k", 60)
    env.put(a, 1, ks)
    assert env.store.lease(a[0], 1, ks[:25]).leased == 25
    hits, got = env.store.load(a[0], 2, ks[:25], 1)              # consumes the lease: its pages are room
    assert hits == 25 and len(pages(got)) == 25                  # an entry is a page
    env.store.verify()
    hits, _ = env.store.load(a[0], 3, ks)                        # the pins of job 2 and 3 together: 25
    assert hits == 0
    env.store.release(a[0], 2)
    hits, _ = env.store.load(a[0], 4, ks)
    assert hits == 25
    stats = env.stats()
    assert stats["hold_capped_keys"]["engine"] == 60 + 35 and stats["load_miss_keys"] == 60 + 35
    env.store.release(a[0], 3)
    env.store.release(a[0], 4)
    assert env.stats()["held_pages"] == 0 and env.stats()["entries_pinned"] == 0
    env.store.verify()


def test_the_engines_of_one_namespace_and_all_engines_hold_their_shares_together():
    env = region()
    same = [env.engine(f"s{i}", 1) for i in range(2)]             # one namespace
    ks = keys("k", 100)
    env.put(same[0], 1, ks)
    assert env.store.lease(same[0][0], 1, ks).leased == 25
    assert env.store.lease(same[1][0], 1, ks).leased == 15        # 40 for the namespace
    other = env.engine("o", 1, model="O")
    env.put(other, 1, keys("o", 30))
    assert env.store.lease(other[0], 1, keys("o", 30)).leased == 25
    third = env.engine("t", 1, model="T")
    env.put(third, 1, keys("t", 20))
    assert env.store.lease(third[0], 1, keys("t", 20)).leased == 10   # 75 for all engines
    stats = env.stats()
    assert stats["held_pages"] == 75
    assert stats["hold_capped_keys"] == {"engine": 75 + 5, "namespace": 85, "total": 10}
    assert env.store.unlease(same[0][0], [1]) == 1
    assert env.store.lease(third[0], 1, keys("t", 20)).leased == 20   # renewed once there is room
    env.store.verify()


def test_entries_of_several_pages_count_their_pages():
    env = region()
    a = env.engine("a", 1, block_bytes=3 * PAGE)                  # 3 pages an entry: 33 fit
    ks = keys("k", 30)
    env.put(a, 1, ks)
    assert env.store.lease(a[0], 1, ks).leased == 8               # 24 of its 25 pages
    assert env.stats()["held_pages"] == 24
    env.store.verify()

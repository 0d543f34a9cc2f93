"""kvtierd.policy.slru: probation before protected, promotion, the key memory, prefix chains, admission."""

from __future__ import annotations

from kvtierd.policy.slru import SLRUPolicy


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in ids]


def test_unused_entries_go_before_used_ones():
    p = SLRUPolicy()
    p.inserted([1, 2, 3, 4], keys(1, 2, 3, 4), chain=False)
    p.accessed([2])
    assert list(p.victims()) == [1, 3, 4, 2]        # probation oldest first, then protected
    assert p.stats()["extra"]["promoted"] == 1


def test_a_chain_goes_in_tail_first_and_its_cold_tail_is_first_in_line():
    p = SLRUPolicy()
    p.inserted([10, 11], keys(100, 101), chain=False)
    p.inserted([1, 2, 3, 4], keys(1, 2, 3, 4), chain=True)
    # A chain goes in from its tail (4) to its head (1), behind the older job.
    assert list(p.victims()) == [10, 11, 4, 3, 2, 1]
    # The client expects no reuse of the last two keys: never seen, they go first, the deepest first.
    p.inserted([5, 6, 7], keys(5, 6, 7), chain=True, cold=2)
    assert list(p.victims()) == [7, 6, 10, 11, 4, 3, 2, 1, 5]
    stats = p.stats()
    assert (stats["refused"], stats["admitted"], stats["extra"]["remembered"]) == (2, 7, 0)


def test_a_cold_key_seen_before_is_not_refused():
    p = SLRUPolicy()
    p.inserted([1], keys(1), chain=False)
    p.removed([1])
    p.inserted([2, 3], keys(2, 1), chain=True, cold=1)      # key 1 came back: remembered, protected
    assert list(p.victims()) == [2, 3]
    assert p.stats()["refused"] == 0


def test_not_a_chain_keeps_its_order_and_nothing_is_refused():
    p = SLRUPolicy()
    p.inserted([1, 2, 3], keys(1, 2, 3), chain=False)
    assert list(p.victims()) == [1, 2, 3]
    assert p.stats()["refused"] == 0


def test_a_key_stored_again_after_eviction_is_remembered_into_protected():
    p = SLRUPolicy()
    p.inserted([1, 2], keys(7, 8), chain=False)
    p.removed([1, 2])                                # evicted
    p.inserted([3, 4, 5], keys(9, 7, 10), chain=False)
    assert list(p.victims()) == [3, 5, 4]            # key 7 (slot 4) came back: protected
    assert p.stats()["extra"]["remembered"] == 1


def test_protected_is_capped_and_its_overflow_returns_to_probation_young_end():
    p = SLRUPolicy(protected_share=0.5)
    p.inserted(list(range(8)), keys(*range(8)), chain=False)
    p.accessed([0, 1, 2, 3, 4, 5])                  # marked; the next walk promotes them
    assert p.stats()["segments"]["protected"] == 0
    # Promoted in order of use; at most int(0.5 x 8) = 4 stay protected, so 0 and 1 (the least
    # recently used of them) go back to probation's young end, behind 6 and 7.
    assert list(p.victims()) == [6, 7, 0, 1, 2, 3, 4, 5]
    stats = p.stats()
    assert (stats["segments"]["protected"], stats["segments"]["probation"], stats["extra"]["promoted"]) == (4, 4, 6)


def test_access_order_decides_within_protected():
    p = SLRUPolicy(protected_share=1.0)
    p.inserted([1, 2, 3], keys(1, 2, 3), chain=False)
    p.accessed([3, 1, 2])
    assert list(p.victims()) == [3, 1, 2]           # promoted in the order of use
    p.accessed([3])                                 # protected: moved at once
    assert list(p.victims()) == [1, 2, 3]


def test_a_freed_slot_does_not_pass_its_mark_to_the_next_entry():
    p = SLRUPolicy()
    p.inserted([1, 2], keys(1, 2), chain=False)
    p.accessed([1])                                 # marked
    p.removed([1])                                  # evicted before any walk
    p.inserted([1], keys(3), chain=False)           # the slot holds a new entry
    assert list(p.victims()) == [2, 1]              # neither was used: both in probation
    assert p.stats()["extra"]["promoted"] == 0


def test_pinned_entries_keep_out_until_released_then_come_back_protected():
    p = SLRUPolicy()
    p.inserted([1, 2, 3], keys(1, 2, 3), chain=False)
    p.pinned([2])
    assert 2 not in p and len(p) == 2
    p.accessed([1, 2])                               # a lookup may touch a pinned entry
    assert 2 not in p
    assert list(p.victims()) == [3, 1]
    p.unpinned([2])
    assert list(p.victims()) == [3, 1, 2]
    assert p.stats()["extra"]["pinned"] == 0


def test_removed_pinned_and_unknown_slots_are_forgotten():
    p = SLRUPolicy()
    p.inserted([1, 2], keys(1, 2), chain=False)
    p.pinned([1])
    p.removed([1, 2, 99])
    assert len(p) == 0 and list(p.victims()) == []
    assert p.stats()["extra"]["pinned"] == 0

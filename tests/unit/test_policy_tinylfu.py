"""kvtierd.policy.tinylfu: the window's leavers must out-count probation's next victim."""

from __future__ import annotations

from kvtierd.policy.tinylfu import TinyLFUPolicy


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in ids]


def test_window_leavers_are_admitted_only_if_used_more_than_the_victim_they_would_displace():
    p = TinyLFUPolicy(window_share=0.5)
    p.inserted([1], keys(1), chain=False)          # window limit 0: leaves, nothing to beat
    p.inserted([2], keys(2), chain=False)          # window [2]
    p.accessed([2])
    p.accessed([2])                                # key 2 counted 3 times
    p.inserted([3], keys(3), chain=False)          # window [2, 3] over its 1: 2 leaves, 3 > 1
    assert list(p.victims()) == [1, 2, 3]          # probation [1, 2], window [3]
    assert p.stats()["extra"]["window_won"] == 2            # 1 (nothing to beat) and 2
    p.inserted([4], keys(4), chain=False)          # window [3, 4] (limit 2)
    p.inserted([5], keys(5), chain=False)          # window [3, 4, 5]: 3 leaves, 1 vs 1: loses
    assert list(p.victims()) == [3, 1, 2, 4, 5]    # the loser is first in line
    assert p.stats()["extra"]["window_lost"] == 1


def test_remembered_keys_skip_the_window():
    p = TinyLFUPolicy(window_share=1.0)
    p.inserted([1], keys(7), chain=False)
    p.removed([1])
    p.inserted([2, 3], keys(8, 7), chain=False)    # key 7 seen before: straight to probation
    assert list(p.victims()) == [3, 2]
    assert p.stats()["extra"]["remembered"] == 1


def test_used_in_probation_moves_to_protected():
    p = TinyLFUPolicy(window_share=0.0, protected_share=1.0)
    p.inserted([1], keys(1), chain=False)
    p.inserted([2], keys(2), chain=False)          # 2 vs 1: loses, first in line
    assert list(p.victims()) == [2, 1]
    p.accessed([2])
    assert list(p.victims()) == [1, 2]
    assert p.stats()["segments"]["protected"] == 1

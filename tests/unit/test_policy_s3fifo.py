"""kvtierd.policy.s3fifo: small then main, lazy promotion and reinsertion, the walk's restore."""

from __future__ import annotations

from itertools import islice

from kvtierd.policy.s3fifo import S3FIFOPolicy


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in ids]


def test_an_entry_used_in_small_moves_to_main_when_the_walk_reaches_it():
    p = S3FIFOPolicy(small_share=0.0)               # victims from small while it has any
    p.inserted([1, 2, 3], keys(1, 2, 3), chain=False)
    p.accessed([1])
    assert list(p.victims()) == [2, 3, 1]           # 1 earned main on the way
    assert p.stats()["extra"]["promoted"] == 1
    assert p.stats()["segments"]["main"] == 1


def test_main_gives_used_entries_another_round_per_use():
    p = S3FIFOPolicy()
    p.recovered([1, 2, 3], keys(1, 2, 3))           # recovered entries start in main
    p.accessed([1])
    p.accessed([1])                                 # used twice: two more rounds
    p.accessed([2])
    walk = p.victims()
    assert next(walk) == 3                          # 1 and 2 went round
    assert next(walk) == 2                          # 2 had one use, 1 still has one
    assert next(walk) == 1
    assert list(walk) == []


def test_remembered_keys_skip_small():
    p = S3FIFOPolicy(small_share=0.5)
    p.inserted([1], keys(5), chain=False)
    p.removed([1])
    p.inserted([2, 3], keys(6, 5), chain=False)
    assert p.stats()["segments"]["main"] == 1 and p.stats()["extra"]["remembered"] == 1
    assert 3 in p


def test_what_the_caller_did_not_free_goes_back_in_order():
    p = S3FIFOPolicy(small_share=0.0)
    p.inserted(list(range(6)), keys(*range(6)), chain=False)
    taken = list(islice(p.victims(), 3))
    assert taken == [0, 1, 2]
    assert len(p) == 6 and all(s in p for s in range(6))   # offered, not removed
    p.removed(taken[:1])                            # the caller frees only the first
    assert list(p.victims()) == [1, 2, 3, 4, 5]


def test_removal_while_a_walk_is_suspended_is_not_undone():
    p = S3FIFOPolicy(small_share=0.0)
    p.inserted([1, 2, 3], keys(1, 2, 3), chain=False)
    walk = p.victims()
    assert next(walk) == 1
    p.removed([1])                                  # freed before the walk is closed
    walk.close()
    assert 1 not in p and list(p.victims()) == [2, 3]


def test_a_chain_goes_in_tail_first_and_a_cold_tail_is_first():
    p = S3FIFOPolicy(small_share=0.0)
    p.inserted([1, 2, 3], keys(1, 2, 3), chain=True)
    assert list(p.victims()) == [3, 2, 1]
    assert p.stats()["refused"] == 0
    p.inserted([7, 8, 9], keys(7, 8, 9), chain=True, cold=1)
    assert list(p.victims()) == [9, 3, 2, 1, 8, 7]
    assert p.stats()["refused"] == 1

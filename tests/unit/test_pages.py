"""kvtierd.pages.FreeStack and FreeIds (the pages of the data area, the slots of the entry table): O(1)
alloc/free, never the same id twice; FreeIds (a NumPy array) gives the same ids in the same order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.pages import FreeIds, FreeStack


def test_fresh_region_hands_out_pages_in_order():
    a = FreeStack(10)
    assert (a.free_count, a.used_count, a.total) == (10, 0, 10)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(1) == [3]
    assert a.alloc(2) == [4, 5]
    assert (a.free_count, a.used_count) == (4, 6)
    assert all(type(p) is int for p in a.alloc(4))
    assert a.free_count == 0


def test_alloc_all_then_none_when_short_and_nothing_taken():
    a = FreeStack(5)
    assert a.alloc(6) is None
    assert a.free_count == 5
    got = a.alloc(4)
    assert a.alloc(2) is None
    assert a.free_count == 1          # the failed alloc took nothing
    assert a.alloc(1) == [4]
    assert a.alloc(1) is None
    assert sorted(got) == [0, 1, 2, 3]


def test_free_returns_pages_and_lifo_reuse():
    a = FreeStack(8)
    first = a.alloc(3)
    a.alloc(2)
    a.free(first)
    assert a.free_count == 6
    again = a.alloc(3)
    assert sorted(again) == sorted(first)      # recently freed pages come back first
    assert a.used_count == 5


def test_free_accepts_any_iterable():
    a = FreeStack(4)
    pages = a.alloc(4)
    a.free(iter(pages[:2]))
    a.free(tuple(pages[2:]))
    assert a.free_count == 4
    assert sorted(a.alloc(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("n", [0, -1])
def test_alloc_non_positive_raises(n):
    a = FreeStack(4)
    with pytest.raises(ValueError):
        a.alloc(n)
    assert a.free_count == 4


def test_used_pages_at_construction_are_excluded():
    a = FreeStack(10, used=[0, 2, 3, 9])
    assert (a.free_count, a.used_count) == (6, 4)
    got = a.alloc(6)
    assert got == [1, 4, 5, 6, 7, 8]
    assert a.alloc(1) is None


def test_used_accepts_generators_and_duplicates():
    a = FreeStack(6, used=(p for p in [1, 1, 4]))
    assert a.free_count == 4
    assert sorted(a.alloc(4)) == [0, 2, 3, 5]


def test_empty_allocator():
    a = FreeStack(0)
    assert (a.free_count, a.used_count) == (0, 0)
    assert a.alloc(1) is None


@settings(max_examples=300, deadline=None)
@given(num_pages=st.integers(1, 64), used=st.sets(st.integers(0, 63)),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.integers(0, 1000)), max_size=60))
def test_no_page_handed_out_twice(num_pages, used, ops):
    used = {p for p in used if p < num_pages}
    a = FreeStack(num_pages, used=used)
    held: list[list[int]] = []
    out: set[int] = set()
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            free_before = a.free_count
            got = a.alloc(n)
            if got is None:
                assert n > free_before
                assert a.free_count == free_before
                continue
            assert len(got) == n == len(set(got))
            assert not set(got) & out, "a page was handed out twice"
            assert not set(got) & used, "a recovered page was handed out"
            assert all(0 <= p < num_pages for p in got)
            out |= set(got)
            held.append(got)
        else:
            got = held.pop(pick % len(held))
            a.free(got)
            out -= set(got)
        assert a.used_count == len(out) + len(used)
        assert a.free_count == num_pages - len(out) - len(used)
    # Everything not held is allocatable, exactly once.
    rest = a.alloc(a.free_count) if a.free_count else []
    assert set(rest) == set(range(num_pages)) - out - used


def test_free_ids_is_a_snapshot():
    a = FreeStack(6, used=[2])
    taken = a.alloc(2)
    free = a.free_ids()
    assert sorted(free.tolist()) == sorted(set(range(6)) - {2} - set(taken))
    a.free(taken)
    assert len(free) == 3 and a.free_count == 5


# ---------------------------------------------------------------------------- FreeIds (the array index's)
def test_free_ids_hand_out_in_order_and_reuse_last_freed_first():
    a = FreeIds(10, used=np.array([2, 7]))
    assert (a.free_count, a.used_count) == (8, 2)
    assert a.alloc(3).tolist() == [0, 1, 3]
    assert a.alloc(20) is None and a.free_count == 5
    a.free(np.array([9, 1, 3]))          # freed... (9 was never taken: the caller's bug, not checked)
    assert a.alloc(3).tolist() == [9, 1, 3]      # ...come back in the order given
    with pytest.raises(ValueError):
        a.alloc(0)


def test_free_ids_refuse_more_frees_than_ids():
    a = FreeIds(3)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(np.array([0]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
def test_free_ids_behave_as_free_stack(ops):
    """The same ids in the same order as the list-based stack, under any alloc/free sequence."""
    a, b = FreeIds(24), FreeStack(24)
    held: list[list[int]] = []
    for alloc, n in ops:
        if alloc:
            got_a, got_b = a.alloc(n), b.alloc(n)
            assert (got_a is None) == (got_b is None)
            if got_b is not None:
                assert got_a.tolist() == got_b
                held.append(got_b)
        elif held:
            ids = held.pop(n % len(held))
            a.free(np.asarray(ids))
            b.free(ids)
        assert a.free_ids().tolist() == b.free_ids().tolist()

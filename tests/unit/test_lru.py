"""kvtierd.lru.LRUPolicy: least recently used first; touch, remove, exclusion; never frees."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.lru import LRUPolicy


def drain(policy: LRUPolicy) -> list[int]:
    """Victims in order, removing each (as the store does after freeing it)."""
    order = []
    while (v := policy.choose_victim()) is not None:
        order.append(v)
        policy.remove(v)
    return order


def test_empty():
    p = LRUPolicy()
    assert len(p) == 0
    assert p.choose_victim() is None
    assert p.choose_victim({1, 2}) is None


def test_order_is_insertion_order():
    p = LRUPolicy()
    for s in (5, 3, 9, 1):
        p.add(s)
    assert len(p) == 4
    assert 9 in p and 2 not in p
    assert p.choose_victim() == 5
    assert p.choose_victim() == 5      # choosing does not remove
    assert drain(p) == [5, 3, 9, 1]
    assert len(p) == 0


def test_touch_moves_to_young_end():
    p = LRUPolicy()
    for s in range(5):
        p.add(s)
    p.touch(0)
    p.touch(2)
    assert drain(p) == [1, 3, 4, 0, 2]


def test_touch_of_absent_slot_does_not_add_it():
    p = LRUPolicy()
    p.add(1)
    p.touch(7)          # pinned or WRITING entries are not in the policy; a touch keeps it so
    assert 7 not in p
    assert drain(p) == [1]


def test_add_again_makes_it_youngest():
    p = LRUPolicy()
    for s in (1, 2, 3):
        p.add(s)
    p.add(1)            # e.g. it lost its last pin again
    assert len(p) == 3
    assert drain(p) == [2, 3, 1]


def test_remove():
    p = LRUPolicy()
    for s in (1, 2, 3):
        p.add(s)
    p.remove(1)
    p.remove(42)        # unknown: no error
    p.remove(1)         # twice: no error
    assert 1 not in p
    assert drain(p) == [2, 3]


def test_pin_unpin_cycle_via_remove_and_add():
    p = LRUPolicy()
    for s in (1, 2, 3):
        p.add(s)
    p.remove(1)         # pinned by a load: not evictable
    assert p.choose_victim() == 2
    p.add(1)            # released: evictable again, most recently used
    assert drain(p) == [2, 3, 1]


def test_choose_victim_skips_exclude():
    p = LRUPolicy()
    for s in range(6):
        p.add(s)
    assert p.choose_victim({0}) == 1
    assert p.choose_victim(frozenset({0, 1, 2})) == 3
    assert p.choose_victim(set(range(6))) is None
    assert p.choose_victim({99}) == 0
    assert len(p) == 6   # excluded entries stay


def test_add_oldest_first():
    p = LRUPolicy()
    p.add_oldest_first([7, 3, 5])
    p.add(1)
    assert drain(p) == [7, 3, 5, 1]


def test_add_oldest_first_accepts_generator():
    p = LRUPolicy()
    p.add_oldest_first(s for s in (4, 2))
    assert drain(p) == [4, 2]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "touch", "remove"]), st.integers(0, 15)), max_size=80),
       st.sets(st.integers(0, 15), max_size=5))
def test_matches_reference_model(ops, exclude):
    p = LRUPolicy()
    model: list[int] = []       # oldest first
    for op, s in ops:
        if op == "add":
            if s in model:
                model.remove(s)
            model.append(s)
            p.add(s)
        elif op == "touch":
            if s in model:
                model.remove(s)
                model.append(s)
            p.touch(s)
        else:
            if s in model:
                model.remove(s)
            p.remove(s)
        assert len(p) == len(model)
    expected = next((s for s in model if s not in exclude), None)
    assert p.choose_victim(exclude) == expected
    assert drain(p) == model

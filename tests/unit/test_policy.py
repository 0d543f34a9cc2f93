"""kvtierd.policy: the registry, and kvtierd.policy.lru.LRUPolicy: least recently used first;
access, pin, removal, exclusion; choosing never frees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.policy import DEFAULT, POLICIES, Policy, reference as create
from kvtierd.policy.lru import LRUPolicy


def victim(policy: Policy, exclude=frozenset()) -> int | None:
    return next(policy.victims(exclude), None)


def drain(policy: Policy) -> list[int]:
    """Victims in order, removing each (as the index does after freeing it)."""
    order = []
    while (v := victim(policy)) is not None:
        order.append(v)
        policy.removed([v])
    return order


def test_registry():
    assert set(POLICIES) == {"lru", "slru", "s3fifo", "tinylfu"}
    p = create("lru")
    assert isinstance(p, LRUPolicy) and isinstance(p, Policy) and len(p) == 0
    assert create("lru") is not p                   # a new one each time
    for name in POLICIES:
        policy = create(name)
        assert policy.name == name and policy.segments and len(policy) == 0
        assert set(policy.stats()["segments"]) == set(policy.stats()["evicted"]) == set(policy.segments)
    assert create().name == DEFAULT
    with pytest.raises(ValueError, match="no eviction policy 'mru'; known: lru, s3fifo, slru, tinylfu"):
        create("mru")


def test_empty():
    p = LRUPolicy()
    assert len(p) == 0
    assert victim(p) is None
    assert victim(p, {1, 2}) is None


def test_order_is_insertion_order():
    p = LRUPolicy()
    for s in (5, 3, 9, 1):
        p.inserted([s])
    assert len(p) == 4
    assert 9 in p and 2 not in p
    assert victim(p) == 5
    assert victim(p) == 5      # choosing does not remove
    assert drain(p) == [5, 3, 9, 1]
    assert len(p) == 0


def test_access_moves_to_young_end():
    p = LRUPolicy()
    for s in range(5):
        p.inserted([s])
    p.accessed([0])
    p.accessed([2])
    assert drain(p) == [1, 3, 4, 0, 2]


def test_access_of_absent_slot_does_not_add_it():
    p = LRUPolicy()
    p.inserted([1])
    p.accessed([7])            # pinned or WRITING entries are not in the policy; an access keeps it so
    assert 7 not in p
    assert drain(p) == [1]


def test_insert_again_makes_it_youngest():
    p = LRUPolicy()
    for s in (1, 2, 3):
        p.inserted([s])
    p.inserted([1])            # e.g. it was stored again
    assert len(p) == 3
    assert drain(p) == [2, 3, 1]


def test_removed():
    p = LRUPolicy()
    for s in (1, 2, 3):
        p.inserted([s])
    p.removed([1])
    p.removed([42])            # unknown: no error
    p.removed([1])             # twice: no error
    assert 1 not in p
    assert drain(p) == [2, 3]


def test_pin_unpin_cycle():
    p = LRUPolicy()
    for s in (1, 2, 3):
        p.inserted([s])
    p.pinned([1])              # pinned by a load: not evictable
    assert victim(p) == 2 and 1 not in p
    p.accessed([1])            # a lookup of a pinned entry leaves it out
    assert 1 not in p
    p.unpinned([1])            # released: evictable again, most recently used
    assert drain(p) == [2, 3, 1]


def test_victims_skip_exclude():
    p = LRUPolicy()
    for s in range(6):
        p.inserted([s])
    assert victim(p, {0}) == 1
    assert victim(p, frozenset({0, 1, 2})) == 3
    assert victim(p, set(range(6))) is None
    assert victim(p, {99}) == 0
    assert len(p) == 6         # excluded entries stay
    assert list(p.victims({1, 3})) == [0, 2, 4, 5]


def test_recovered_oldest_first():
    p = LRUPolicy()
    p.recovered([7, 3, 5])
    p.inserted([1])
    assert drain(p) == [7, 3, 5, 1]


def test_recovered_accepts_generator():
    p = LRUPolicy()
    p.recovered(s for s in (4, 2))
    assert drain(p) == [4, 2]


def test_bulk_hooks_keep_the_order_given():
    p = LRUPolicy()
    p.inserted([4, 2, 9, 7], chain=True)    # a store job's keys, in request order
    p.accessed([9, 5, 4])                   # 5 is not in the set (pinned, or WRITING)
    assert 5 not in p and len(p) == 4
    p.pinned([2, 8])
    p.unpinned([8, 2])                      # 8 was never in; unpinning makes it evictable
    assert drain(p) == [7, 9, 4, 8, 2]


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
            p.inserted([s])
        elif op == "touch":
            if s in model:
                model.remove(s)
                model.append(s)
            p.accessed([s])
        else:
            if s in model:
                model.remove(s)
            p.removed([s])
        assert len(p) == len(model)
    expected = next((s for s in model if s not in exclude), None)
    assert victim(p, exclude) == expected
    assert drain(p) == model

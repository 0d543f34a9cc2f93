"""kvtierd.policy.lru: the daemon's LRU (kvtierd/lru.py) behind the hook interface, same choices."""

from __future__ import annotations

import random

from kvtierd.lru import LRUPolicy as DaemonLRU
from kvtierd.policy.lru import LRUPolicy


def test_same_victims_as_the_daemons_lru_under_the_same_events():
    rng = random.Random(3)
    old, new = DaemonLRU(), LRUPolicy()
    evictable: set[int] = set()
    pinned: set[int] = set()
    free = list(range(300))
    old.add_oldest_first([])
    for _ in range(5000):
        r = rng.random()
        if r < 0.3 and free:
            slots = [free.pop() for _ in range(min(len(free), rng.randint(1, 8)))]
            old.add_many(slots)
            new.inserted(slots, [b"k"] * len(slots))
            evictable.update(slots)
        elif r < 0.55 and evictable | pinned:
            slots = rng.sample(sorted(evictable | pinned), min(len(evictable | pinned), 6))
            old.touch_many(slots)
            new.accessed(slots)
        elif r < 0.7 and evictable:
            slots = rng.sample(sorted(evictable), min(len(evictable), 4))
            old.remove_many(slots)
            new.pinned(slots)
            evictable.difference_update(slots)
            pinned.update(slots)
        elif r < 0.85 and pinned:
            slots = rng.sample(sorted(pinned), min(len(pinned), 4))
            old.add_many(slots)
            new.unpinned(slots)
            pinned.difference_update(slots)
            evictable.update(slots)
        elif evictable:
            exclude = set(rng.sample(sorted(evictable), min(len(evictable), 3)))
            victims = [v for v, _ in zip(old.candidates(exclude), range(5))]
            assert victims == [v for v, _ in zip(new.victims(exclude), range(5))]
            old.remove_many(victims)
            new.removed(victims)
            evictable.difference_update(victims)
            free.extend(victims)
        assert list(old.candidates()) == list(new.victims())
        assert len(old) == len(new)


def test_recovered_matches_add_oldest_first():
    old, new = DaemonLRU(), LRUPolicy()
    old.add_oldest_first([5, 2, 8])
    new.recovered([5, 2, 8], [b"a", b"b", b"c"])
    assert list(old.candidates()) == list(new.victims()) == [5, 2, 8]

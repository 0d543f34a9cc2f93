"""Invariants every eviction policy keeps (kvtierd.policy), driven the way the daemon's index drives it.

A model of the index (which entries are WRITING, READY and evictable, pinned and how often)
issues random store jobs (allocate → vote → ``inserted``), lookups (``accessed``), loads
(``pinned``/``unpinned``), operator evictions and partial victim walks, and checks after every step
that the policy holds exactly the evictable entries: it never offers a WRITING, pinned, removed or
never-inserted entry, nor one the caller excluded, and offers each evictable entry once.
"""

from __future__ import annotations

import random
import tracemalloc
from itertools import islice

import pytest

from kvtierd.policy import POLICIES, reference as create

NAMES = sorted(POLICIES)


class CountingSet(frozenset):
    """An ``exclude`` set that counts how many slots a walk looked at."""

    def __new__(cls, items=()):
        self = super().__new__(cls, items)
        self.looked = 0
        return self

    def __contains__(self, slot):
        self.looked += 1
        return super().__contains__(slot)


class Index:
    """The daemon's index, reduced to what the policy sees: slots, their states and pins."""

    def __init__(self, policy, slots: int, rng: random.Random):
        self.policy = policy
        self.rng = rng
        self.free = list(range(slots))
        self.writing: dict[int, list[int]] = {}     # job -> slots allocated, not yet READY
        self.evictable: set[int] = set()
        self.pins: dict[int, int] = {}
        self.next_key = 0
        self.jobs = 0
        self.evicted = 0                            # evictable entries freed (what stats() counts)

    def ready(self) -> list[int]:
        return sorted(self.evictable | set(self.pins))

    def take_victims(self, n: int, exclude: frozenset = frozenset()) -> list[int]:
        looking = CountingSet(exclude)
        victims = list(islice(self.policy.victims(looking), n))
        assert len(set(victims)) == len(victims), "a victim offered twice"
        for v in victims:
            assert v in self.evictable, f"victim {v} is not evictable (WRITING, pinned, freed or never stored)"
            assert v not in exclude, f"victim {v} was excluded"
        # A walk looks at each candidate once: what it offered plus the excluded ones it passed.
        assert looking.looked <= len(victims) + len(exclude)
        return victims

    def store(self, n: int) -> None:
        present = [s for s in self.ready() if self.rng.random() < 0.1]
        need = n - len(self.free)
        if need > 0:
            victims = self.take_victims(need, frozenset(present) & frozenset(self.evictable))
            self.policy.removed(victims)
            self.evicted += len(victims)
            self.evictable.difference_update(victims)
            self.free.extend(victims)
        if present:
            self.policy.accessed(present)
        fit = min(n, len(self.free))
        if fit:
            self.jobs += 1
            self.writing[self.jobs] = [self.free.pop() for _ in range(fit)]

    def vote(self) -> None:
        job = self.rng.choice(list(self.writing))
        slots = self.writing.pop(job)
        keys = [(self.next_key + i).to_bytes(16, "little") for i in range(len(slots))]
        self.next_key += len(slots)
        if self.rng.random() < 0.3:      # a key stored again after it was evicted
            keys[0] = self.rng.randrange(max(1, self.next_key)).to_bytes(16, "little")
            keys = list(dict.fromkeys(keys))
            self.free.extend(slots[len(keys):])
            slots = slots[:len(keys)]
        self.policy.inserted(slots, keys, self.rng.random() < 0.8, self.rng.choice([0, 0, 1, len(slots)]))
        self.evictable.update(slots)

    def abort(self) -> None:
        job = self.rng.choice(list(self.writing))
        slots = self.writing.pop(job)
        self.policy.removed(slots)      # freed WRITING entries: never inserted, ignored
        self.free.extend(slots)

    def lookup(self) -> None:
        ready = self.ready()
        if ready:
            self.policy.accessed(self.rng.sample(ready, min(len(ready), self.rng.randint(1, 12))))

    def pin(self) -> None:
        ready = self.ready()
        chosen = self.rng.sample(ready, min(len(ready), self.rng.randint(1, 6)))
        first = [s for s in chosen if s not in self.pins]
        for s in chosen:
            self.pins[s] = self.pins.get(s, 0) + 1
        self.evictable.difference_update(first)
        if first:
            self.policy.pinned(first)

    def unpin(self) -> None:
        chosen = self.rng.sample(sorted(self.pins), min(len(self.pins), self.rng.randint(1, 6)))
        last = []
        for s in chosen:
            self.pins[s] -= 1
            if not self.pins[s]:
                del self.pins[s]
                last.append(s)
        self.evictable.update(last)
        if last:
            self.policy.unpinned(last)

    def operator_evict(self) -> None:
        victims = self.take_victims(self.rng.randint(1, 4))
        self.policy.removed(victims)
        self.evicted += len(victims)
        self.evictable.difference_update(victims)
        self.free.extend(victims)

    def glance(self) -> None:
        """Look at the first victims without freeing them (choose, then change one's mind)."""
        self.take_victims(self.rng.randint(1, 5))

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.3:
            self.store(self.rng.randint(1, 10))
        elif r < 0.5 and self.writing:
            self.vote()
        elif r < 0.53 and self.writing:
            self.abort()
        elif r < 0.7:
            self.lookup()
        elif r < 0.8 and self.evictable:
            self.pin()
        elif r < 0.9 and self.pins:
            self.unpin()
        elif r < 0.95 and self.evictable:
            self.operator_evict()
        elif self.evictable:
            self.glance()

    def check(self, full: bool) -> None:
        p = self.policy
        assert len(p) == len(self.evictable)
        for s in self.evictable:
            assert s in p
        for s in self.pins:
            assert s not in p, f"pinned entry {s} is evictable"
        for slots in self.writing.values():
            for s in slots:
                assert s not in p, f"WRITING entry {s} is evictable"
        for s in self.free:
            assert s not in p, f"freed entry {s} is evictable"
        stats = p.stats()
        assert sum(stats["segments"].values()) == len(p), "segment sizes do not add up"
        assert sum(stats["evicted"].values()) == self.evicted, "evictions by segment do not add up"
        if full:
            walked = list(p.victims())
            assert sorted(walked) == sorted(self.evictable)
            assert len(p) == len(self.evictable)   # a full walk leaves everything in place


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_only_evictable_entries_are_offered(name, seed):
    rng = random.Random(seed)
    index = Index(create(name), slots=rng.choice([8, 40, 200]), rng=rng)
    for i in range(3000):
        index.step()
        index.check(full=i % 50 == 0)
    index.check(full=True)


@pytest.mark.parametrize("name", NAMES)
def test_exclude_is_respected_even_when_little_else_is_left(name):
    p = create(name)
    p.inserted(list(range(10)), [bytes([i]) * 16 for i in range(10)], chain=True)
    p.accessed([3, 4])
    exclude = frozenset(range(1, 10))
    assert list(p.victims(exclude)) == [0]
    assert list(p.victims(frozenset(range(10)))) == []
    assert sorted(p.victims()) == list(range(10))


@pytest.mark.parametrize("name", NAMES)
def test_empty_policy_offers_nothing(name):
    p = create(name)
    assert len(p) == 0 and 5 not in p
    assert list(p.victims()) == []
    p.removed([1, 2])                        # never inserted: ignored
    p.accessed([])
    p.inserted([], [], chain=True)
    assert len(p) == 0


@pytest.mark.parametrize("name", NAMES)
def test_a_walk_that_is_dropped_changes_nothing_the_next_one_sees(name):
    p = create(name)
    p.inserted(list(range(50)), [i.to_bytes(16, "little") for i in range(50)], chain=False)
    p.accessed(list(range(0, 50, 3)))
    assert sorted(p.victims()) == list(range(50))
    # A walk may move what it passes over (S3-FIFO promotes used entries lazily); once those
    # moves are made, walks agree, and dropping one halfway changes nothing.
    first = list(p.victims())
    walk = p.victims()
    assert next(walk) == first[0]
    del walk                                  # the caller changed its mind
    assert list(p.victims()) == first
    taken = list(islice(p.victims(), 7))      # the daemon's pattern: take some, then free them
    assert taken == first[:7]
    p.removed(taken)
    assert list(p.victims()) == first[7:]


@pytest.mark.parametrize("name", NAMES)
def test_recovered_entries_are_evictable_oldest_first_among_themselves(name):
    p = create(name)
    slots = [7, 3, 9, 1]
    p.recovered(slots, [bytes([s]) * 16 for s in slots])
    assert len(p) == 4
    assert list(p.victims()) == slots


@pytest.mark.parametrize("name", NAMES)
def test_memory_stays_bounded_under_a_long_workload(name):
    """Live entries bounded → the policy's memory stops growing (keys are never seen twice
    here, so a policy that kept anything per key it had seen would grow without bound)."""
    rng = random.Random(7)
    index = Index(create(name), slots=500, rng=rng)
    for _ in range(4000):                     # warm up: reach the cache's steady state
        index.step()
    tracemalloc.start()
    try:
        for _ in range(2000):
            index.step()
        settled, _ = tracemalloc.get_traced_memory()
        for _ in range(12000):
            index.step()
        later, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert later - settled < 64 * 1024, f"{name} grew by {later - settled} bytes"

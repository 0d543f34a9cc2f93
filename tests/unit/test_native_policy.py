"""kvtierd.policy.native: the compiled policies make the same decisions as the Python ones of
kvtierd.policy, victim for victim.

Three ways: the bundled request traces (../shared/data/traces, or $KVTIER_TRACES) replayed through
both at every capacity of the bench, every victim walk compared; random operation sequences of the
daemon's kinds (stores with chains and cold tails, lookups, loads, evictions with exclusions,
walks that free nothing, aborts, operator evictions, restarts), the lists compared after every
step; and the sketch, counter for counter.
"""

from __future__ import annotations

import os
import random
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierbench import traces
from kvtierd._native import Sketch
from kvtierd.policy import POLICIES, reference as create
from kvtierd.policy.native import NATIVE
from kvtierd.policy.sketch import FrequencySketch, fingerprints

NAMES = sorted(POLICIES)
TRACES = Path(os.environ.get("KVTIER_TRACES", Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"))


def fps(keys) -> np.ndarray:
    return fingerprints(keys).view(np.int64)


class Lockstep:
    """The Python policy's hooks outside; each call goes to both policies. A victim walk is
    compared when the caller frees what it took (``removed``), or closes the walk having freed
    nothing (``abandon_walk``)."""

    def __init__(self, name: str, **shares):
        self.old, self.new = create(name), NATIVE[name]()
        if shares:
            self.old, self.new = type(self.old)(**shares), type(self.new)(**shares)
        self.walk: frozenset | None = None
        self.walks = 0

    def __contains__(self, slot):
        return slot in self.old

    def __len__(self):
        return len(self.old)

    def inserted(self, slots, keys, chain=True, cold=0):
        self.old.inserted(slots, keys, chain, cold)
        self.new.inserted(np.asarray(slots, np.int32), fps(keys), chain, cold)

    def accessed(self, slots):
        self.old.accessed(slots)
        self.new.accessed(np.asarray(slots, np.int64))

    def pinned(self, slots):
        self.old.pinned(slots)
        self.new.pinned(slots)

    def unpinned(self, slots):
        self.old.unpinned(slots)
        self.new.unpinned(slots)

    def recovered(self, slots, keys):
        self.old.recovered(slots, keys)
        self.new.recovered(slots, fps(keys))

    def victims(self, exclude=frozenset()):
        self.walk = frozenset(exclude)
        return self.old.victims(exclude)

    def take(self, need: int, exclude=frozenset()) -> list[int]:
        """The daemon's pattern: take ``need`` victims (both policies), the walk closed."""
        old = list(islice(self.old.victims(exclude), need))
        self.compare_walk(old, need, exclude)
        return old

    def compare_walk(self, old: list[int], need: int, exclude) -> None:
        new = np.frombuffer(self.new.victims(need, np.asarray(sorted(exclude), np.int32)), np.int32).tolist()
        assert new == old, f"walk {self.walks}: {new[:12]} != {old[:12]}"
        self.walks += 1

    def removed(self, slots):
        if self.walk is not None:              # the replay's walk, taken with islice
            self.compare_walk(list(slots), len(slots), self.walk)
            self.walk = None
        self.old.removed(slots)
        self.new.removed(slots)

    def stats(self):
        assert self.new.stats() == self.old.stats()
        return self.old.stats()

    def check(self, slots: range) -> None:
        """Same lists, same members, same counts."""
        self.new.verify()
        old = self.old
        lists = [old._order] if hasattr(old, "_order") else list(old._segments)
        for i, segment in enumerate(lists):
            assert np.frombuffer(self.new.order(i), np.int32).tolist() == list(segment), f"list {i}"
        assert len(self.new) == len(old)
        assert [s in self.new for s in slots] == [s in old for s in slots]
        self.stats()


# ---------------------------------------------------------------------------------------- traces
def trace_files() -> list[Path]:
    return sorted(TRACES.glob("*.jsonl")) if TRACES.is_dir() else []


@pytest.mark.skipif(not trace_files(), reason=f"no bundled traces at {TRACES} (set KVTIER_TRACES)")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("path", trace_files(), ids=lambda p: p.name)
def test_bundled_traces_replay_to_the_same_hits(path, name):
    """Every victim of every walk is the same, so the hits are, to the last block (the bench's
    replay, at each of its capacities)."""
    trace = traces.load(path)
    for fraction in traces.DEFAULT_CAPACITIES:
        capacity = traces.capacity(trace, fraction)
        both = Lockstep(name)
        traces.replay(trace, both, capacity)
        both.check(range(capacity))
        assert both.walks > 0


# ---------------------------------------------------------------------------------------- random sequences
class Driver:
    """The daemon's index reduced to what the policies see, driving both policies in lockstep."""

    def __init__(self, both: Lockstep, slots: int, rng: random.Random):
        self.p, self.rng, self.slots = both, rng, slots
        self.free = list(range(slots))
        self.ready: set[int] = set()
        self.pins: dict[int, int] = {}
        self.keys = [f"key-{i}".encode() for i in range(3 * slots)]     # keys come back: the sketch remembers

    def evictable(self) -> list[int]:
        return sorted(s for s in self.ready if not self.pins.get(s))

    def store(self) -> None:
        n = self.rng.randint(1, 6)
        if len(self.free) < n:
            exclude = frozenset(self.rng.sample(self.evictable(), min(2, len(self.evictable()))))
            victims = self.p.take(n - len(self.free), exclude)
            self.p.removed(victims)
            self.ready.difference_update(victims)
            self.free += victims
        new = [self.free.pop() for _ in range(min(n, len(self.free)))]
        if not new:
            return
        if self.rng.random() < 0.1:                      # the job aborts: its slots were never READY
            self.p.removed(new)
            self.free += new
            return
        keys = self.rng.sample(self.keys, len(new))
        self.p.inserted(new, keys, self.rng.random() < 0.8, self.rng.choice([0, 0, 1, 2, len(new) + 1]))
        self.ready.update(new)

    def lookup(self) -> None:
        ready = sorted(self.ready)
        if ready:
            hits = self.rng.sample(ready, self.rng.randint(1, min(5, len(ready))))
            self.p.accessed(hits + hits[:1])             # a repeat inside one job
            if self.rng.random() < 0.5:
                self.load(hits)

    def load(self, hits: list[int]) -> None:
        fresh = [s for s in hits if not self.pins.get(s)]
        for s in hits:
            self.pins[s] = self.pins.get(s, 0) + 1
        self.p.pinned(fresh)
        if self.rng.random() < 0.7:
            self.release(hits)

    def release(self, hits: list[int]) -> None:
        back = []
        for s in hits:
            self.pins[s] -= 1
            if not self.pins[s]:
                back.append(s)
        self.p.unpinned(back)

    def release_all(self) -> None:
        held = [s for s, n in self.pins.items() if n]
        for s in held:
            self.pins[s] = 1
        self.release(held)

    def peek(self) -> None:
        """A walk that frees nothing (the second tier choosing what to demote, then not)."""
        self.p.take(self.rng.randint(1, 8), frozenset(self.rng.sample(self.evictable(), min(1, len(self.evictable())))))

    def operator_evict(self) -> None:
        old = list(self.p.old.victims())
        self.p.compare_walk(old, -1, frozenset())
        gone = old[: self.rng.randint(0, len(old))]
        self.p.removed(gone)
        self.ready.difference_update(gone)
        self.free += gone

    def restart(self) -> None:
        """Fresh policies learn the READY entries, oldest first (a restart; pins die with it)."""
        self.release_all()
        order = sorted(self.ready, key=lambda s: self.rng.random())
        self.p.__init__(type(self.p.old).name)
        self.p.recovered(order, [self.keys[s] for s in order])


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), seed=st.integers(0, 2**32 - 1), slots=st.integers(4, 40),
       steps=st.integers(50, 300))
def test_random_sequences_make_the_same_decisions(name, seed, slots, steps):
    rng = random.Random(seed)
    both = Lockstep(name)
    driver = Driver(both, slots, rng)
    moves = [driver.store] * 5 + [driver.lookup] * 4 + [driver.peek, driver.release_all, driver.operator_evict,
                                                       driver.restart]
    for _ in range(steps):
        rng.choice(moves)()
        both.check(range(slots))


@pytest.mark.parametrize("shares", [{"small_share": 0.0}, {"small_share": 0.5}, {"small_share": 1.0}])
def test_s3fifo_shares(shares):
    rng = random.Random(4)
    both = Lockstep("s3fifo", **shares)
    driver = Driver(both, 24, rng)
    for _ in range(400):
        rng.choice([driver.store, driver.store, driver.lookup, driver.peek])()
        both.check(range(24))


# ---------------------------------------------------------------------------------------- sketch
@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.tuples(st.integers(1, 5000),
                                  st.lists(st.integers(0, 40), min_size=0, max_size=60)), max_size=30))
def test_the_sketch_counts_as_the_python_one(batches):
    old, new = FrequencySketch(), Sketch()
    for entries, ids in batches:
        old.fit(entries)
        new.fit(entries)
        batch = fps([i.to_bytes(4, "little") for i in ids])      # repeats inside a batch count once
        assert new.seen(batch) == (old.seen([i.to_bytes(4, "little") for i in ids]))
        assert new.estimate(batch) == old.estimate(batch.view(np.uint64)).tobytes()
        assert new.table() == old._table.tobytes() and new.width == old.width



@settings(max_examples=40, deadline=None)
@given(entries=st.integers(1, 3000), batches=st.lists(st.lists(st.integers(0, 3000), max_size=700), min_size=1,
                                                       max_size=6))
def test_a_restarts_count_is_the_python_ones(entries, batches):
    """What a restart does (``learn``: a batch counted with no answers asked, into a sketch never
    counted before, one pass of writes) and what follows it leave the Python sketch's counters
    and halvings: the first batch may touch a counter many times and may bring a halving."""
    old, new = FrequencySketch(), Sketch()
    old.fit(entries)
    new.fit(entries)
    for ids in batches:
        batch = fps([i.to_bytes(4, "little") for i in ids])
        old.seen([i.to_bytes(4, "little") for i in ids])
        new.learn(batch)
        assert new.estimate(batch) == old.estimate(batch.view(np.uint64)).tobytes()
    assert new.table() == old._table.tobytes()


@pytest.mark.parametrize("entries", [1, 300, 1000])
def test_the_sketch_halves_lazily_as_the_python_one_eagerly(entries):
    """The compiled sketch applies a halving to a block of counters only when a count or an
    estimate first touches it: however many halvings a block missed, what is read is what the
    eager halvings of the Python sketch left (its table is only looked at once, at the end)."""
    rng = random.Random(entries)
    old, new = FrequencySketch(), Sketch()
    old.fit(entries)
    new.fit(entries)
    counted = 0
    for _ in range(120):
        ids = [rng.randrange(3 * entries + 500) for _ in range(rng.randrange(1, 400))]
        batch = fps([i.to_bytes(4, "little") for i in ids])
        assert new.estimate(batch) == old.estimate(batch.view(np.uint64)).tobytes()
        assert new.seen(batch) == old.seen([i.to_bytes(4, "little") for i in ids])
        counted += len(set(ids))
    assert counted >= 4 * new.width // 4, "too few keys counted for several halvings"
    assert new.table() == old._table.tobytes()

"""What the segmented policies (slru, s3fifo, tinylfu) share: queues of slots, pins, a key memory.

Each evictable entry is in exactly one *segment* (an OrderedDict of slots, oldest first); a
pinned one is in none and sits in ``_pinned`` until it is released. ``removed`` and ``pinned``
pop the slots with C-level passes (one when they all sit in one segment), so no per-slot record
of "which segment" is kept. The segments' total plus the pinned entries (``_tracked``) stands in
for the cache's size: a policy never knows the region's capacity, only what it holds, which is
the capacity once the region is full (the only time eviction happens).

Stores go through ``_place``: it asks the sketch (``kvtierd.policy.sketch``) which keys were seen
before, puts a chain in tail first (so the tail of a job is evicted before its head) and applies
the admission rule shared by all three: of the keys the client expects no reuse of (the store
request's ``cold_tail``), those never seen before go to the old end of the first segment victims
come from — refused in all but name (the copy is made, the block goes first).

Why only on the client's word (docs/policy.md, "Refusal"): phase 1 refused every chain's unseen
last key. On the bundled traces that key is mostly a prompt's *partial* last block, reused 0.7-2 %
of the time, which engines never store; and an engine that stores a long prompt in several jobs
(vLLM stores each scheduling step's new chunks) ends every job with a key the next job extends,
so refusing it cut the chain and fell to 0.82-0.96x LRU in a replay with chunked stores.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import compress, repeat
from operator import not_
from typing import Sequence

from . import Policy, PolicyStats, Slots
from .sketch import FrequencySketch


class SegmentedPolicy(Policy):
    def __init__(self, *segments: "OrderedDict[int, None]", used_into: "OrderedDict[int, None]") -> None:
        self._segments = segments
        self._used_into = used_into             # where a released load's entries go (they were just used)
        self._pinned: set[int] = set()
        self._sketch = FrequencySketch()
        self._counts = {"admitted": 0, "refused": 0, "remembered": 0, "promoted": 0}
        self._evicted = dict.fromkeys(self.segments, 0)

    def __len__(self) -> int:
        return sum(map(len, self._segments))

    def __contains__(self, slot: int) -> bool:
        return any(slot in segment for segment in self._segments)

    def _tracked(self) -> int:
        return len(self) + len(self._pinned)

    def unpinned(self, slots: Slots) -> None:
        """A released load: the entries were just used; they come back at the young end of
        ``used_into`` (slru and tinylfu: protected; s3fifo: main)."""
        self._pinned.difference_update(slots)
        self._used_into.update(zip(slots, repeat(None)))
        self._fit()

    def _fit(self) -> None:
        """Bring the segments back to their shares (a policy that has shares overrides this)."""

    def pinned(self, slots: Slots) -> None:
        self._drop(slots)
        self._pinned.update(slots)

    def removed(self, slots: Slots) -> None:
        before = list(map(len, self._segments))
        self._drop(slots)
        if self._pinned:
            self._pinned.difference_update(slots)
        self._count_evicted(before)

    def _count_evicted(self, before: list[int]) -> None:
        """Count what left each segment since its size was ``before`` (``PolicyStats.evicted``)."""
        evicted = self._evicted
        for name, segment, size in zip(self.segments, self._segments, before):
            if size != len(segment):
                evicted[name] += size - len(segment)

    def _drop(self, slots: Slots) -> None:
        """Take the slots out of their segments. One pass when they are all in the segment of
        the first (a load pins what its lookup just moved together; victims come from one end);
        otherwise, from the first one elsewhere, a pass per segment."""
        rest = slots
        for segment in self._segments:
            if slots and slots[0] in segment:
                rest = iter(slots)
                try:
                    deque(map(segment.pop, rest), 0)
                    return
                except KeyError as exc:
                    rest = [exc.args[0], *rest]
                break
        for segment in self._segments:
            deque(map(segment.pop, rest, repeat(None)), 0)

    def _place(self, slots: Slots, keys: Sequence[bytes], chain: bool, cold: int, known_into: "OrderedDict[int, None]",
               new_into: "OrderedDict[int, None]", refused_into: "OrderedDict[int, None] | None" = None) -> list[bool]:
        """Store ``slots`` at the young ends: keys seen before into ``known_into``, the others into
        ``new_into``; a chain tail first. Of the last ``cold`` keys (the client expects no reuse of
        them), those never seen go to the old end of ``refused_into`` (default ``new_into``), the
        deepest first: the first victims. Returns whether each key (in ``slots`` order) was seen
        before."""
        self._sketch.fit(self._tracked() + len(slots))
        known = self._sketch.seen(keys)
        order = slots[::-1] if chain else slots
        counts = self._counts
        if True in known:
            seen = known[::-1] if chain else known
            remembered = list(compress(order, seen))
            known_into.update(zip(remembered, repeat(None)))
            new_into.update(zip(compress(order, map(not_, seen)), repeat(None)))
            counts["remembered"] += len(remembered)
            counts["admitted"] += len(slots) - len(remembered)
        else:                           # the usual store: no key seen before
            new_into.update(zip(order, repeat(None)))
            counts["admitted"] += len(slots)
        if cold:
            refused = list(compress(slots[-cold:], map(not_, known[-cold:])))
            if refused:
                into = new_into if refused_into is None else refused_into
                if into is not new_into:
                    deque(map(new_into.pop, refused), 0)
                    into.update(zip(refused, repeat(None)))
                deque(map(into.move_to_end, refused, repeat(False)), 0)   # the last one moved is first
                counts["refused"] += len(refused)
                counts["admitted"] -= len(refused)
        return known

    def _remember(self, slots_oldest_first: Slots, keys: Sequence[bytes], into: "OrderedDict[int, None]") -> None:
        """``recovered``: after a restart the sketch learns the keys; the entries go into one
        segment in their recency order (nothing says which were used more than once)."""
        self._sketch.fit(self._tracked() + len(slots_oldest_first))
        self._sketch.seen(keys)
        into.update(zip(slots_oldest_first, repeat(None)))

    def stats(self) -> PolicyStats:
        counts = self._counts
        return {"admitted": counts["admitted"], "refused": counts["refused"],
                "segments": dict(zip(self.segments, map(len, self._segments))), "evicted": dict(self._evicted),
                "extra": {**{k: v for k, v in counts.items() if k not in ("admitted", "refused")},
                          "pinned": len(self._pinned), "sketch_bytes": self._sketch.nbytes}}

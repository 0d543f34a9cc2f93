"""Prefix-aware segmented LRU with a memory of past keys (the measured default; docs/policy.md).

Two LRU segments over the evictable entries:

- *probation*: entries not used since they were stored. Victims come from here first, least
  recently stored first.
- *protected*: entries used again (looked up, loaded, stored again) while cached, and entries
  whose key the policy saw before (stored, evicted, now stored again: the sketch remembers it,
  ``kvtierd.policy.sketch``) — a second chance that plain LRU never gives. At most
  ``PROTECTED_SHARE`` of the tracked entries; the overflow (its least recently used) goes back to
  probation's young end. Victims come from here only when probation is empty.

One-time blocks (most blocks of a real trace) thus pass through probation without flushing the
blocks that are used again — what LRU cannot do (docs/policy.md has the measurements).

Prefix chains (``inserted(..., chain=True)``, the default: each key extends the one before it):

- the keys go into probation tail first, so within a job the tail is evicted before the head (a
  chain whose head is missing is unreachable, its tail is worth nothing);
- admission: the last key of a chain, unless seen before, is placed at probation's old end —
  the first victim, *refused* in all but name. The last block of a request is the one least
  likely to be asked for again (the next request extends the chain past it, or stops earlier).

Counters: ``admitted`` (stored into the segments normally), ``refused`` (placed first in line),
``remembered`` (stored straight into protected because the sketch knew the key), ``promoted``.

Cost: the hooks are C-level passes over the job's slots (``deque(map(...), 0)`` over the
OrderedDicts' methods); ``accessed`` is two passes (probation, then protected) where LRU's is
one; ``inserted`` adds the sketch's vectorised lookup and count. No per-slot state besides the
two OrderedDicts and the pinned set; the sketch is 32 bytes per entry.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain as chained, compress, islice, repeat
from operator import is_, not_
from typing import Iterator, Sequence

from . import Policy, Slots
from .sketch import FrequencySketch, fingerprints

PROTECTED_SHARE = 0.5        # measured: 0.8 loses to LRU at 20 % capacity, 0.2 gains little at 2-5 %
_ABSENT = object()


class SLRUPolicy(Policy):
    name = "slru"

    def __init__(self, protected_share: float = PROTECTED_SHARE) -> None:
        self.protected_share = protected_share
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._pinned: set[int] = set()
        self._sketch = FrequencySketch()
        self._counts = {"admitted": 0, "refused": 0, "remembered": 0, "promoted": 0}

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, slot: int) -> bool:
        return slot in self._probation or slot in self._protected

    def _tracked(self) -> int:
        return len(self._probation) + len(self._protected) + len(self._pinned)

    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True) -> None:
        if not slots:
            return
        self._sketch.fit(self._tracked() + len(slots))
        known = (self._sketch.count(fingerprints(keys)) > 0).tolist()
        order, seen = (slots[::-1], known[::-1]) if chain else (slots, known)
        protected = list(compress(order, seen))
        self._protected.update(zip(protected, repeat(None)))
        self._probation.update(zip(compress(order, map(not_, seen)), repeat(None)))
        counts = self._counts
        counts["remembered"] += len(protected)
        counts["admitted"] += len(slots) - len(protected)
        if chain and not known[-1]:
            self._probation.move_to_end(slots[-1], last=False)
            counts["refused"] += 1
            counts["admitted"] -= 1
        if protected:
            self._fit()

    def accessed(self, slots: Slots) -> None:
        probation, protected = self._probation, self._protected
        if probation:
            promoted = list(compress(slots, map(is_, map(probation.pop, slots, repeat(_ABSENT)), repeat(None))))
            if promoted:
                protected.update(zip(promoted, repeat(None)))
                self._counts["promoted"] += len(promoted)
        try:
            deque(map(protected.move_to_end, slots), 0)
        except KeyError:
            # Some entry is pinned: move the others, again from the first (same final order).
            deque(map(protected.move_to_end, filter(protected.__contains__, slots)), 0)
        self._fit()

    def pinned(self, slots: Slots) -> None:
        deque(map(self._probation.pop, slots, repeat(None)), 0)
        deque(map(self._protected.pop, slots, repeat(None)), 0)
        self._pinned.update(slots)

    def unpinned(self, slots: Slots) -> None:
        """A released load: the entries were just used, so they come back protected."""
        self._pinned.difference_update(slots)
        self._protected.update(zip(slots, repeat(None)))
        self._fit()

    def removed(self, slots: Slots) -> None:
        deque(map(self._probation.pop, slots, repeat(None)), 0)
        deque(map(self._protected.pop, slots, repeat(None)), 0)
        self._pinned.difference_update(slots)

    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes]) -> None:
        """After a restart nothing says which entries were used again: all start in probation,
        in their recency order, and the sketch learns their keys."""
        self._sketch.fit(self._tracked() + len(slots_oldest_first))
        self._sketch.count(fingerprints(keys))
        self._probation.update(zip(slots_oldest_first, repeat(None)))

    def _fit(self) -> None:
        """Move protected's least recently used overflow to probation's young end."""
        protected = self._protected
        over = len(protected) - int(self.protected_share * self._tracked())
        if over > 0:
            moved = list(islice(protected, over))
            deque(map(protected.pop, moved), 0)
            self._probation.update(zip(moved, repeat(None)))

    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]:
        return (slot for slot in chained(self._probation, self._protected) if slot not in exclude)

    def stats(self) -> dict[str, int]:
        return {**self._counts, "probation": len(self._probation), "protected": len(self._protected),
                "pinned": len(self._pinned), "sketch_bytes": self._sketch.nbytes}

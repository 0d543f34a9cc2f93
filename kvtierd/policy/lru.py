"""Least recently used, over the evictable entries of every namespace.

An ordered set (CPython's OrderedDict: a hash table plus a linked list) of the evictable slots,
oldest first. An entry enters at the young end when it becomes READY or loses its last pin, moves
there when it is accessed, and leaves when it is pinned or freed; ``victims`` walks from the old
end. All of it is O(1) per entry, and each hook handles a whole job's slots with C-level loops
(``deque(map(...), 0)`` drives the OrderedDict's own methods without a Python frame per entry):
the daemon's per-request cost for a job of hundreds of keys is mostly per-key work like this.
Keys, chains and cold tails are not used: every stored key is admitted, into the one segment ``lru``.

The recency clock itself (ticks persisted in the entry table, from which a restarted daemon
rebuilds this order) lives in the index.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Iterator, Sequence

from . import Policy, PolicyStats, Slots


class LRUPolicy(Policy):
    name = "lru"
    segments = ("lru",)

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._admitted = 0
        self._evicted = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def inserted(self, slots: Slots, keys: Sequence[bytes] = (), chain: bool = True, cold: int = 0) -> None:
        """Each slot becomes the most recently used, in order (the last one youngest)."""
        self._admitted += len(slots)
        self.unpinned(slots)

    def unpinned(self, slots: Slots) -> None:
        """Back in the set: the most recently used (a load just used it)."""
        order = self._order
        deque(map(order.__setitem__, slots, repeat(None)), 0)
        deque(map(order.move_to_end, slots), 0)

    def accessed(self, slots: Slots) -> None:
        """Each slot in the set moves to the young end, in order (the last one youngest)."""
        order = self._order
        try:
            deque(map(order.move_to_end, slots), 0)
        except KeyError:
            # Some entry is pinned (not in the set): move the others, again from the first
            # (moving an entry to the end twice leaves the same order as once).
            deque(map(order.move_to_end, filter(order.__contains__, slots)), 0)

    def pinned(self, slots: Slots) -> None:
        """Out of the set until unpinned."""
        deque(map(self._order.pop, slots, repeat(None)), 0)

    def removed(self, slots: Slots) -> None:
        before = len(self._order)
        deque(map(self._order.pop, slots, repeat(None)), 0)
        self._evicted += before - len(self._order)

    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes] = ()) -> None:
        deque(map(self._order.__setitem__, slots_oldest_first, repeat(None)), 0)

    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]:
        """Least recently used first, skipping ``exclude`` (the index excludes the present keys of
        the job it is deciding; it accessed them first, so they sit at the young end and the walk
        meets them only when little else is left)."""
        return (slot for slot in self._order if slot not in exclude)

    def stats(self) -> PolicyStats:
        return {"admitted": self._admitted, "refused": 0, "segments": {"lru": len(self._order)},
                "evicted": {"lru": self._evicted}, "extra": {}}

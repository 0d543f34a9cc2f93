"""The eviction policy: least recently used over READY, unpinned entries, across all namespaces.

The policy only tracks and chooses; it never frees (the store frees what it is told to evict).

Algorithm: an ordered set of the *evictable* entries (READY and not pinned by any load), oldest
first. An entry enters it when it becomes READY or loses its last pin, and leaves it when it is
pinned or freed, so WRITING and pinned entries can never be chosen (invariant 2) without any
check at eviction time. ``touch`` moves an entry to the young end. ``candidates`` walks from the
old end. All of it is O(1) per operation (CPython's OrderedDict: a hash table plus a linked list).
The ``*_many`` forms do the same for a whole job's entries with C-level loops (``deque(map(...),
0)`` drives the OrderedDict's own methods without a Python frame per entry): the daemon's
per-request cost for a job of hundreds of keys is mostly per-key work like this.

Entries are named by their entry-table slot (an int). The recency clock itself (ticks persisted
in the entry table so a restarted daemon can rebuild this order) lives in the store.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Iterable, Iterator


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def add(self, slot: int) -> None:
        """The entry became evictable (READY, unpinned): it is the most recently used."""
        self._order[slot] = None
        self._order.move_to_end(slot)

    def add_oldest_first(self, slots: Iterable[int]) -> None:
        """Bulk insert in the given order, oldest first (used when rebuilding after a restart)."""
        deque(map(self._order.__setitem__, slots, repeat(None)), 0)

    def remove(self, slot: int) -> None:
        """The entry is pinned, being freed, or otherwise not evictable any more."""
        self._order.pop(slot, None)

    def touch(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def add_many(self, slots: list[int]) -> None:
        """``add`` each slot, in order (the last one becomes the most recently used)."""
        order = self._order
        deque(map(order.__setitem__, slots, repeat(None)), 0)
        deque(map(order.move_to_end, slots), 0)

    def remove_many(self, slots: list[int]) -> None:
        """``remove`` each slot."""
        deque(map(self._order.pop, slots, repeat(None)), 0)

    def touch_many(self, slots: list[int]) -> None:
        """``touch`` each slot, in order (the last one becomes the most recently used)."""
        order = self._order
        try:
            deque(map(order.move_to_end, slots), 0)
        except KeyError:
            # Some entry is pinned (not in the set): touch the others, again from the first
            # (moving an entry to the end twice leaves the same order as once).
            deque(map(order.move_to_end, filter(order.__contains__, slots)), 0)

    def oldest_first(self) -> list[int]:
        """A snapshot of the evictable entries, least recently used first."""
        return list(self._order)

    def candidates(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]:
        """Evictable entries not in ``exclude``, least recently used first.

        The store takes as many victims as it needs room for, then frees them (which removes them
        here) after the iteration. ``exclude`` holds the present entries of the job being decided;
        the store touches them first, so they sit at the young end and the walk skips them only
        when little else is left.
        """
        return (slot for slot in self._order if slot not in exclude)

    def choose_victim(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> int | None:
        """The least recently used evictable entry not in ``exclude``, or None (the first of
        ``candidates``). Choosing does not remove it."""
        return next(self.candidates(exclude), None)

"""The eviction policy: least recently used over READY, unpinned entries, across all namespaces.

The policy only tracks and chooses; it never frees (the store frees what it is told to evict).

Algorithm: an ordered set of the *evictable* entries (READY and not pinned by any load), oldest
first. An entry enters it when it becomes READY or loses its last pin, and leaves it when it is
pinned or freed, so WRITING and pinned entries can never be chosen (invariant 2) without any
check at eviction time. ``touch`` moves an entry to the young end. ``victims`` walks from the old
end. All of it is O(1) per operation (CPython's OrderedDict: a hash table plus a linked list).

Entries are named by their entry-table slot (an int). The recency clock itself (ticks persisted
in the entry table so a restarted daemon can rebuild this order) lives in the store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


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
        for slot in slots:
            self._order[slot] = None

    def remove(self, slot: int) -> None:
        """The entry is pinned, being freed, or otherwise not evictable any more."""
        self._order.pop(slot, None)

    def touch(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def oldest_first(self) -> list[int]:
        """A snapshot of the evictable entries, least recently used first."""
        return list(self._order)

    def choose_victim(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> int | None:
        """The least recently used evictable entry not in ``exclude``, or None.

        The store frees the victim (which removes it here) and asks again while it needs room.
        ``exclude`` holds the entries of the job being decided; the store touches them first, so
        they sit at the young end and the walk skips them only when little else is left.
        """
        for slot in self._order:
            if slot not in exclude:
                return slot
        return None

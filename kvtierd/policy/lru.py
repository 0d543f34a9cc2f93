"""LRU: least recently used first, over the evictable entries of all namespaces.

The same semantics as the daemon's ``kvtierd/lru.py`` behind the hook interface: an ordered set,
oldest first; ``inserted``/``unpinned``/``accessed`` move entries to the young end in the order
given (the last one is the most recently used), ``pinned``/``removed`` take them out,
``victims`` walks from the old end. O(1) per key (CPython's OrderedDict: a hash table and a
linked list), each hook one C-level pass over the job's slots (``deque(map(...), 0)``).
Keys and chains are not used.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from typing import Iterator, Sequence

from . import Policy, Slots


class LRUPolicy(Policy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, slot: int) -> bool:
        return slot in self._order

    def inserted(self, slots: Slots, keys: Sequence[bytes] = (), chain: bool = True) -> None:
        order = self._order
        deque(map(order.__setitem__, slots, repeat(None)), 0)
        deque(map(order.move_to_end, slots), 0)

    unpinned = inserted

    def accessed(self, slots: Slots) -> None:
        order = self._order
        try:
            deque(map(order.move_to_end, slots), 0)
        except KeyError:
            # Some entry is pinned (not in the set): touch the others, again from the first
            # (moving an entry to the end twice leaves the same order as once).
            deque(map(order.move_to_end, filter(order.__contains__, slots)), 0)

    def removed(self, slots: Slots) -> None:
        deque(map(self._order.pop, slots, repeat(None)), 0)

    pinned = removed

    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes] = ()) -> None:
        deque(map(self._order.__setitem__, slots_oldest_first, repeat(None)), 0)

    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]:
        return (slot for slot in self._order if slot not in exclude)

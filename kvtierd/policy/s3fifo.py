"""Prefix-aware S3-FIFO (Yang et al., SOSP '23): a small FIFO in front of a main FIFO.

- *small* (``SMALL_SHARE`` of the tracked entries): new keys. At its old end an entry used since
  it came in moves to main; one never used is a victim.
- *main*: entries that earned it, and keys the sketch remembers (the paper's ghost FIFO, here
  ``kvtierd.policy.sketch``). At its old end an entry used since it got there is reinserted at
  the young end with its use count lowered by one (counts go up to 2: ``_used``/``_reused``);
  one never used is a victim.

Use counts are two sets (used at least once, twice), updated by ``accessed`` with C-level set
operations; nothing moves on an access, which is what makes FIFO cheap. The moves happen lazily
in ``victims``: the walk moves the entries it passes over, takes each victim off its queue
while the caller looks at it (``_held``: still evictable, still counted), and when the walk ends
puts back at the old ends, in order, those the caller did not free. Chains go in tail first, and the
unseen keys of a cold tail are the first victims (``SegmentedPolicy._place``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat
from operator import is_
from typing import Iterator, Sequence

from . import Slots
from .segments import SegmentedPolicy

SMALL_SHARE = 0.1             # the paper's 10 %


class S3FIFOPolicy(SegmentedPolicy):
    name = "s3fifo"
    segments = ("small", "main")

    def __init__(self, small_share: float = SMALL_SHARE) -> None:
        self.small_share = small_share
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._held: dict[int, OrderedDict[int, None]] = {}   # taken off a queue by a running walk
        self._used: set[int] = set()
        self._reused: set[int] = set()
        super().__init__(self._small, self._main, used_into=self._main)

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + len(self._held)

    def __contains__(self, slot: int) -> bool:
        return slot in self._small or slot in self._main or slot in self._held

    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True, cold: int = 0) -> None:
        if slots:
            self._place(slots, keys, chain, cold, self._main, self._small)

    def accessed(self, slots: Slots) -> None:
        self._reused.update(filter(self._used.__contains__, slots))
        self._used.update(slots)

    def removed(self, slots: Slots) -> None:
        super().removed(slots)
        if self._held:                          # victims the running walk took off their queue
            queues = list(map(self._held.pop, slots, repeat(None)))
            for name, queue in zip(self.segments, self._segments):
                self._evicted[name] += sum(map(is_, queues, repeat(queue)))
        self._used.difference_update(slots)
        self._reused.difference_update(slots)

    def pinned(self, slots: Slots) -> None:
        super().pinned(slots)
        deque(map(self._held.pop, slots, repeat(None)), 0)

    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes]) -> None:
        self._remember(slots_oldest_first, keys, self._main)

    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]:
        small, main, used, reused, held = self._small, self._main, self._used, self._reused, self._held
        taken: list[int] = []
        try:
            while small or main:
                if small and (not main or len(small) >= self.small_share * self._tracked()):
                    slot = small.popitem(last=False)[0]
                    if slot in used:                      # used while in small: it earned main
                        used.discard(slot)
                        reused.discard(slot)
                        main[slot] = None
                        self._counts["promoted"] += 1
                        continue
                    held[slot] = small
                else:
                    slot = main.popitem(last=False)[0]
                    if slot in used:                      # one more round, one use fewer
                        if slot in reused:
                            reused.discard(slot)
                        else:
                            used.discard(slot)
                        main[slot] = None
                        continue
                    held[slot] = main
                taken.append(slot)
                if slot not in exclude:
                    yield slot
        finally:
            for slot in reversed(taken):                  # back at the old ends, in order
                queue = held.pop(slot, None)
                if queue is not None:
                    queue[slot] = None
                    queue.move_to_end(slot, last=False)

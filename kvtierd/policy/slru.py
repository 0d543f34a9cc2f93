"""Prefix-aware segmented LRU with a memory of past keys: the measured default (docs/policy.md).

Two LRU segments over the evictable entries:

- *probation*: entries not used since they were stored. Victims come from here first, least
  recently stored first.
- *protected*: entries used again (looked up, loaded, stored again) while cached, and entries
  whose key the sketch remembers (stored before, evicted, now stored again: a second chance plain
  LRU never gives). At most ``PROTECTED_SHARE`` of the tracked entries; the overflow (its least
  recently used) goes back to probation's young end. Victims come from here when probation is
  empty.

So the blocks seen once (most blocks of a real trace) pass through probation without flushing
the ones that are used again, which is where LRU loses (docs/policy.md has the measurements).
Chains are stored tail first and a chain's unseen last key is the first victim
(``SegmentedPolicy._place``).

Cost: ``accessed`` is LRU's one C-level pass when every entry is protected; from the first one
that is not, a set intersection finds those in probation and the pass goes on over the rest.
``inserted`` adds the sketch's vectorised count. ``victims`` walks the two segments read-only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain as chained, islice, repeat
from typing import Iterator, Sequence

from . import Slots
from .segments import SegmentedPolicy

# Measured (docs/policy.md): 0.8 falls below LRU at 20 % capacity on the conversation trace,
# 0.2 gives up most of the gain at 2-5 %; 0.5 is above LRU at every capacity and slice.
PROTECTED_SHARE = 0.5


class SLRUPolicy(SegmentedPolicy):
    name = "slru"

    def __init__(self, protected_share: float = PROTECTED_SHARE) -> None:
        self.protected_share = protected_share
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        super().__init__(self._probation, self._protected)

    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True) -> None:
        if slots and any(self._place(slots, keys, chain, self._protected, self._probation)):
            self._fit()

    def accessed(self, slots: Slots) -> None:
        protected = self._protected
        rest = iter(slots)
        try:
            deque(map(protected.move_to_end, rest), 0)      # all protected: LRU's one pass
            return
        except KeyError as exc:
            rest = [exc.args[0], *rest]                     # from the first one not protected
        # Those in probation are promoted; pinned ones stay out. The slots before ``rest`` are
        # at the young end already, in order; ``rest`` goes after them, in order.
        promoted = self._probation.keys() & rest
        if promoted:
            deque(map(self._probation.pop, promoted), 0)
            protected.update(zip(promoted, repeat(None)))
            self._counts["promoted"] += len(promoted)
        deque(map(protected.move_to_end, filter(protected.__contains__, rest)), 0)
        if promoted:
            self._fit()

    def unpinned(self, slots: Slots) -> None:
        """A released load: the entries were just used, so they come back protected."""
        self._pinned.difference_update(slots)
        self._protected.update(zip(slots, repeat(None)))
        self._fit()

    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes]) -> None:
        self._remember(slots_oldest_first, keys, self._probation)

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
        return {**super().stats(), "probation": len(self._probation), "protected": len(self._protected)}

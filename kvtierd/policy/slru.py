"""Prefix-aware segmented LRU with a memory of past keys: the measured default (docs/policy.md).

Two LRU segments over the evictable entries:

- *probation*: entries not used since they were stored. Victims come from here first, least
  recently stored first.
- *protected*: entries used again (looked up, loaded, stored again) while cached — promoted when
  the next victim walk starts, or at once for a released load — and entries whose key the sketch
  remembers (stored before, evicted, now stored again: a second chance plain
  LRU never gives). At most ``PROTECTED_SHARE`` of the tracked entries; the overflow (its least
  recently used) goes back to probation's young end. Victims come from here when probation is
  empty.

So the blocks seen once (most blocks of a real trace) pass through probation without flushing
the ones that are used again, which is where LRU loses (docs/policy.md has the measurements).
Chains are stored tail first, and the unseen keys of a cold tail (the store request's
``cold_tail``) are the first victims (``SegmentedPolicy._place``).

Cost: ``accessed`` is LRU's one C-level pass when every entry is protected; from the first one
that is not, the rest not protected are marked (a dict update; the next walk promotes them in
one batch) and the pass goes on over the protected ones. ``inserted`` adds the sketch's
vectorised count. ``victims`` walks the two segments read-only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain as chained, filterfalse, islice, repeat
from typing import Iterator, Sequence

from . import Slots
from .segments import SegmentedPolicy

# Measured (docs/policy.md): 0.7 and above fall to or below LRU at 20 % capacity on the
# conversation trace, 0.3 gives up a third of the gain at 2 %; 0.5 is above LRU in every cell.
PROTECTED_SHARE = 0.5


class SLRUPolicy(SegmentedPolicy):
    name = "slru"
    segments = ("probation", "protected")

    def __init__(self, protected_share: float = PROTECTED_SHARE) -> None:
        self.protected_share = protected_share
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._marked: dict[int, None] = {}      # used since the last walk, in order of use
        super().__init__(self._probation, self._protected, used_into=self._protected)

    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True, cold: int = 0) -> None:
        if slots and any(self._place(slots, keys, chain, cold, self._protected, self._probation)):
            self._fit()

    def accessed(self, slots: Slots) -> None:
        protected = self._protected
        rest = slots
        if slots and slots[0] in protected:     # (a lookup of a job not used before skips the raise)
            rest = iter(slots)
            try:
                deque(map(protected.move_to_end, rest), 0)  # all protected: LRU's one pass
                return
            except KeyError as exc:
                rest = [exc.args[0], *rest]                 # from the first one not protected
        # Entries in probation (or pinned) are only marked here; the next victim walk promotes
        # the marked ones still in probation, all at once (``_promote``). Only the walk tells
        # the segments apart, so promoting earlier would change nothing it sees, and a lookup
        # then costs a dict update instead of three OrderedDict moves per promoted entry.
        self._marked.update(zip(filterfalse(protected.__contains__, rest), repeat(None)))
        deque(map(protected.move_to_end, filter(protected.__contains__, rest)), 0)

    def removed(self, slots: Slots) -> None:
        super().removed(slots)
        if self._marked:                        # a freed slot's mark must not pass to its next entry
            deque(map(self._marked.pop, slots, repeat(None)), 0)

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
        if self._marked:
            self._promote()
        return (slot for slot in chained(self._probation, self._protected) if slot not in exclude)

    def _promote(self) -> None:
        """Probation entries used since the last walk move to protected's young end, in the
        order of their first use; marks on entries elsewhere (protected, pinned, gone) lapse."""
        marked, self._marked = self._marked, {}
        probation = self._probation
        promoted = list(filter(probation.__contains__, marked))
        if promoted:
            deque(map(probation.pop, promoted), 0)
            self._protected.update(zip(promoted, repeat(None)))
            self._counts["promoted"] += len(promoted)
            self._fit()

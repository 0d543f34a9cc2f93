"""Prefix-aware W-TinyLFU (Einziger et al., 2017; Caffeine's policy): a window LRU, then an SLRU
that admits a key only if the frequency sketch says it is used more than what it would displace.

- *window* (``WINDOW_SHARE`` of the tracked entries, LRU): new entries.
- *probation* and *protected* (the main cache, ``PROTECTED_SHARE`` of it protected, LRU each):
  an entry used in probation moves to protected; protected's overflow goes back to probation.
- Admission, when the window overflows: each entry leaving it (a *candidate*) is compared with
  probation's next victim by their counts in the sketch (``kvtierd.policy.sketch``, which
  counts every store and every use). The more frequent one goes to probation's young end, the
  other to its old end, to be evicted next. The store frees, so "evict the loser" becomes
  "put the loser first in line".

Victims: probation from its old end (the losers first), then the window, then protected.
Chains go in tail first, and the unseen keys of a cold tail go straight to probation's old end
(``SegmentedPolicy._place``). Counting every use costs a fingerprint per slot (``_fp``) and a
sketch update per ``accessed``: the most expensive of the policies per looked-up key.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import chain as chained, compress, islice, repeat
from operator import is_, not_
from typing import Iterator, Sequence

import numpy as np

from . import Slots
from .segments import SegmentedPolicy
from .sketch import fingerprints

WINDOW_SHARE = 0.01           # Caffeine's starting window
PROTECTED_SHARE = 0.8         # of the main cache, as in Caffeine
_ABSENT = object()


class TinyLFUPolicy(SegmentedPolicy):
    name = "tinylfu"
    segments = ("window", "probation", "protected")

    def __init__(self, window_share: float = WINDOW_SHARE, protected_share: float = PROTECTED_SHARE) -> None:
        self.window_share = window_share
        self.protected_share = protected_share
        self._window: OrderedDict[int, None] = OrderedDict()
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._fp: dict[int, int] = {}          # slot -> its key's fingerprint (for counting uses)
        super().__init__(self._window, self._probation, self._protected, used_into=self._protected)
        self._counts.update(window_won=0, window_lost=0)

    def _fps(self, slots: Slots) -> np.ndarray:
        return np.fromiter(map(self._fp.__getitem__, slots), np.uint64, len(slots))

    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True, cold: int = 0) -> None:
        if not slots:
            return
        self._fp.update(zip(slots, fingerprints(keys).tolist()))
        # Known keys skip the window (its admission test would pass them: their count is > 0).
        self._place(slots, keys, chain, cold, self._probation, self._window, refused_into=self._probation)
        self._fit()

    def accessed(self, slots: Slots) -> None:
        self._sketch.count(self._fps(slots))
        window, probation, protected = self._window, self._probation, self._protected
        if probation:
            promoted = list(compress(slots, map(is_, map(probation.pop, slots, repeat(_ABSENT)), repeat(None))))
            if promoted:
                protected.update(zip(promoted, repeat(None)))
                self._counts["promoted"] += len(promoted)
        for segment in (window, protected):
            deque(map(segment.move_to_end, filter(segment.__contains__, slots)), 0)
        self._fit()

    def removed(self, slots: Slots) -> None:
        super().removed(slots)
        deque(map(self._fp.pop, slots, repeat(None)), 0)

    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes]) -> None:
        self._fp.update(zip(slots_oldest_first, fingerprints(keys).tolist()))
        self._remember(slots_oldest_first, keys, self._probation)

    def _fit(self) -> None:
        window, probation, protected = self._window, self._probation, self._protected
        tracked = self._tracked()
        over = len(window) - int(self.window_share * tracked)
        if over > 0:
            candidates = list(islice(window, over))
            deque(map(window.pop, candidates), 0)
            rivals = list(islice(probation, over))
            theirs = self._sketch.estimate(self._fps(rivals))
            mine = self._sketch.estimate(self._fps(candidates))
            beats = np.zeros(over, dtype=bool)
            beats[: len(rivals)] = mine[: len(rivals)] > theirs
            beats[len(rivals):] = True                  # nothing to displace: admitted
            won = beats.tolist()
            probation.update(zip(compress(candidates, won), repeat(None)))
            lost = list(compress(candidates, map(not_, won)))
            probation.update(zip(lost, repeat(None)))
            deque(map(probation.move_to_end, reversed(lost), repeat(False)), 0)
            self._counts["window_lost"] += len(lost)
            self._counts["window_won"] += over - len(lost)
        over = len(protected) - int(self.protected_share * (tracked - len(window)))
        if over > 0:
            moved = list(islice(protected, over))
            deque(map(protected.pop, moved), 0)
            probation.update(zip(moved, repeat(None)))

    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]:
        return (slot for slot in chained(self._probation, self._window, self._protected) if slot not in exclude)

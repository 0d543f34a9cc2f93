"""Free stacks: which of a fixed set of ids are free. The index keeps two: the pages of the data
area and the slots of the entry table. No policy, no entries.

The ids are interchangeable (fixed-size pages, fixed-size records: no fragmentation), so the
free set is a LIFO stack: ``alloc(n)`` takes n from the top and ``free`` pushes back, both O(1)
per id and done by slicing in C. LIFO hands recently freed (still faulted-in, cache-warm) pages
out first. A stack never decides what to evict: when ``alloc`` cannot serve, it says so and the
index asks the eviction policy for victims, frees them, and tries again.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class FreeStack:
    def __init__(self, total: int, used: Iterable[int] = ()):
        """All ids in 0..total-1 free except ``used`` (e.g. the pages of recovered entries)."""
        free = np.ones(total, dtype=bool)
        free[np.fromiter(used, dtype=np.int64)] = False
        # Highest id at the bottom so that a fresh region hands out 0, 1, 2, ... in order.
        self._free: list[int] = np.flatnonzero(free)[::-1].tolist()
        self.total = total

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.total - len(self._free)

    def free_ids(self) -> np.ndarray:
        """A snapshot of the free ids (consistency checks)."""
        return np.asarray(self._free, dtype=np.int64)

    def alloc(self, n: int) -> list[int] | None:
        """n ids, or None (and nothing taken) when fewer than n are free."""
        if n <= 0:
            raise ValueError(f"cannot allocate {n} ids")
        if n > len(self._free):
            return None
        ids = self._free[-n:]
        del self._free[-n:]
        ids.reverse()
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Push ids back, last first, so that ``alloc`` hands them out again in the order given:
        a block's run of pages stays in order through eviction and reuse, and its copy stays one
        memcpy instead of one per page (a LIFO push in given order came back reversed)."""
        freed = list(ids)
        freed.reverse()
        self._free.extend(freed)


class FreeIds:
    """``FreeStack``'s LIFO over a NumPy array (no Python int per id): ``alloc`` and ``free`` are a
    slice copy each, and the stack's memory is 4 bytes per id whatever it holds. Same order:
    ``alloc(n)`` hands out the last freed first, and a freed run comes back in the order given."""

    def __init__(self, total: int, used: np.ndarray | None = None):
        free = np.ones(total, dtype=bool)
        if used is not None and len(used):
            free[np.asarray(used, dtype=np.int64)] = False
        ids = np.flatnonzero(free)[::-1].astype(np.int32)   # highest at the bottom: 0, 1, 2, ... first
        self._ids = np.empty(total, dtype=np.int32)
        self._ids[:len(ids)] = ids
        self._top = len(ids)
        self.total = total

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used_count(self) -> int:
        return self.total - self._top

    def free_ids(self) -> np.ndarray:
        """A snapshot of the free ids (consistency checks)."""
        return self._ids[:self._top].astype(np.int64)

    def alloc(self, n: int) -> np.ndarray | None:
        """n ids (int32), or None (and nothing taken) when fewer than n are free."""
        if n <= 0:
            raise ValueError(f"cannot allocate {n} ids")
        if n > self._top:
            return None
        self._top -= n
        return self._ids[self._top:self._top + n][::-1].copy()

    def free(self, ids: np.ndarray) -> None:
        """Push ids back, last first, so that ``alloc`` hands them out again in the order given."""
        n = len(ids)
        if self._top + n > self.total:
            raise ValueError(f"freeing {n} ids onto {self._top} free of {self.total}: an id is freed twice")
        self._ids[self._top:self._top + n] = np.asarray(ids)[::-1]
        self._top += n

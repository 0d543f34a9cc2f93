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

"""The fixed-page allocator: which pages of the data area are free. No policy, no entries.

Pages are interchangeable (fixed size, no fragmentation), so the free set is a LIFO stack of page
indices: ``alloc(n)`` takes n from the top and ``free`` pushes back, both O(1) per page and done
by slicing in C. LIFO hands recently freed (still faulted-in, cache-warm) pages out first.
The allocator never decides what to evict: when ``alloc`` cannot serve, it says so and the
store asks the eviction policy for victims, frees them, and tries again.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int, used: Iterable[int] = ()):
        """All pages free except ``used`` (the pages of entries recovered from the table)."""
        free = np.ones(num_pages, dtype=bool)
        free[np.fromiter(used, dtype=np.int64)] = False
        # Highest index at the bottom so that a fresh region hands out pages 0, 1, 2, ... in order.
        self._free: list[int] = np.flatnonzero(free)[::-1].tolist()
        self.num_pages = num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer than n are free."""
        if n <= 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Push pages back, last first, so that ``alloc`` hands them out again in the order given:
        a block's run of pages stays in order through eviction and reuse, and its copy stays one
        memcpy instead of one per page (a LIFO push in given order came back reversed)."""
        freed = list(pages)
        freed.reverse()
        self._free.extend(freed)

"""Python's cyclic garbage collector, watched: how many collections of each generation ran and how
long each paused the daemon (its one loop serves every request, so a collection is a pause of
all of them). ``kvtierctl stats`` shows it (``gc``) and the eviction bench reads it: with the
entries in arrays (``kvtierd.index``) a full collection walks a few thousand objects, not one
per entry.
"""

from __future__ import annotations

import gc
import time

GENERATIONS = 3


class GcWatch:
    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.pause_total = [0.0] * GENERATIONS
        self.pause_max = [0.0] * GENERATIONS
        self._started: float | None = None
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        g = info.get("generation", GENERATIONS - 1)
        self.collections[g] += 1
        self.pause_total[g] += pause
        self.pause_max[g] = max(self.pause_max[g], pause)

    def snapshot(self) -> dict:
        """Collections, pause seconds (total, longest) per generation since the start, and what
        the collector tracks now (per generation, and frozen: kept out of every collection)."""
        return {"collections": list(self.collections), "pause_seconds_total": list(self.pause_total),
                "pause_seconds_max": list(self.pause_max), "pending": list(gc.get_count()),
                "frozen": gc.get_freeze_count()}

    def close(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

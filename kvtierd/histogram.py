"""A fixed-bucket histogram with no dependencies, filled by the loop thread.

The store and the server record durations here (they must not import prometheus-client); the
metrics collector turns a snapshot into a Prometheus histogram at scrape time.
"""

from __future__ import annotations

import bisect

# Seconds: 10 µs .. 30 s, roughly ×2.5 per step (request latencies are µs, vote waits up to s).
DEFAULT_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    __slots__ = ("buckets", "counts", "total", "count")

    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> dict:
        """Cumulative counts per upper bound (as Prometheus wants them), sum and count."""
        cumulative, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": self.total, "count": self.count}

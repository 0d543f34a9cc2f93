"""kvtierd.policy.sketch: counts, saturation, aging, widening, false positives, size.

Python's hash of bytes is salted per process, so these tests hold for any salt: exact counts
are checked on tables far wider than the keys counted (a collision in all four rows is then a
one-in-billions event), false positives against a bound with a wide margin.
"""

from __future__ import annotations

import numpy as np

from kvtierd.policy import sketch
from kvtierd.policy.sketch import FrequencySketch, fingerprints


def keys(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def test_counts_what_it_was_given():
    s = FrequencySketch()
    s.fit(10_000)
    fps = fingerprints(keys(0, 50))
    for i in range(5):
        s.count(fps[: 10 * (i + 1)])             # keys 0-9 five times, ..., 40-49 once
    assert s.estimate(fps).tolist() == [5] * 10 + [4] * 10 + [3] * 10 + [2] * 10 + [1] * 10
    assert s.estimate(fingerprints(keys(1000, 20))).tolist() == [0] * 20


def test_count_returns_the_estimates_from_before():
    s = FrequencySketch()
    fps = fingerprints(keys(0, 3))
    assert s.count(fps).tolist() == [0, 0, 0]
    assert s.count(fps).tolist() == [1, 1, 1]
    assert s.estimate(fps).tolist() == [2, 2, 2]


def test_counters_saturate_at_fifteen_without_touching_their_neighbours():
    s = FrequencySketch()
    s.fit(10_000)
    hot, cold = fingerprints(keys(0, 1)), fingerprints(keys(1, 40))
    s.count(cold)
    for _ in range(40):
        s.count(hot)
    assert s.estimate(hot).tolist() == [sketch.MAX]
    assert s.estimate(cold).tolist() == [1] * 40


def test_many_keys_of_one_batch_sharing_bytes_are_each_counted():
    s = FrequencySketch()                         # the narrowest table: 512 bytes per row
    fps = fingerprints(keys(0, 200))
    s.count(fps)
    assert (s.estimate(fps) >= 1).all()           # never too low


def test_aging_halves_every_period():
    s = FrequencySketch()
    old = fingerprints(keys(0, 4))
    for _ in range(6):
        s.count(old)                              # 24 counted, count 6 each
    fresh = keys(100, s.period - 24 - 1)
    s.count(fingerprints(fresh))                  # one short of the period
    assert s.estimate(old).min() == 6
    s.count(fingerprints(keys(10_000, 1)))        # the period is reached: halved
    assert s.estimate(old).tolist() == [3, 3, 3, 3]
    assert (s.estimate(fingerprints(fresh)) == 0).mean() > 0.95   # counted once: forgotten


def test_widening_keeps_every_count():
    s = FrequencySketch()
    fps = fingerprints(keys(0, 30))
    for i in range(3):
        s.count(fps[: 10 * (i + 1)])
    before = s.estimate(fps)
    s.fit(5_000)
    assert s.width >= sketch.WIDTH_PER_ENTRY * 5_000
    assert s.estimate(fps).tolist() == before.tolist()


def test_size_follows_the_entries_and_never_shrinks():
    s = FrequencySketch()
    s.fit(1_000)
    width = s.width
    assert sketch.WIDTH_PER_ENTRY * 1_000 <= width < 2 * sketch.WIDTH_PER_ENTRY * 1_000
    assert s.nbytes == sketch.ROWS * width        # a byte per counter
    s.fit(10)
    assert s.width == width


def test_keys_never_seen_rarely_read_as_seen():
    s = FrequencySketch()
    s.fit(4_096)
    rng = np.random.default_rng(0)
    for start in range(0, 3 * s.period, 256):     # fill it through several agings
        s.count(fingerprints(keys(start, 256)))
    never = fingerprints([bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(20_000)])
    assert (s.estimate(never) > 0).mean() < 0.02  # the design figure is ~0.25 %

"""A compact memory of the keys a policy has seen: a count-min sketch of 4-bit counters, with aging.

Slots are reused, so what a policy remembers about keys it no longer holds (did this key come
before? how often?) has to be keyed by the key itself. A ghost list of evicted keys costs a hash
table entry per key (~100 bytes in CPython); this sketch costs 32-64 bytes per tracked entry and
answers for every key seen within the last few turnovers of the cache.

Layout: ``ROWS`` rows of ``width`` 4-bit counters (two per byte, saturating at 15); a key's
counter in row r is at the top bits of ``fingerprint * ODD[r]`` (multiply-shift hashing of
Python's 64-bit ``hash`` of the key, cached on bytes objects). A key's count is the minimum over
its rows: possibly too high (a collision in every row), never too low (two keys of one batch on
the same counter add one, not two: the sketch is a little conservative within a batch).
Every ``period`` counted keys all counters are halved (aging), so a key counted once is forgotten
after one to two periods while a frequent one keeps a count.

Sizing: ``width`` is the power of two >= ``WIDTH_PER_ENTRY`` x the policy's entries (``fit``),
doubling as it grows; doubling copies each counter into the two that the next hash bit chooses
between, so nothing is forgotten. ``period`` is a quarter of the width (4-8 turnovers of the
cache): each row is then at most a quarter full, and a key never seen reads as seen with
probability below (1 - e^-1/4)^4 ≈ 0.25 %. A shorter memory (2-4 turnovers) measured worse at small
capacities, and so did a fuller table (docs/policy.md).

Everything is vectorised over a job's keys (one NumPy pass per step, no Python loop per key).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

ROWS = 4
MAX = 15
WIDTH_PER_ENTRY = 16
MIN_WIDTH_BITS = 10
_ODD = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                dtype=np.uint64)[:ROWS, None]
_ONE = np.uint64(1)


def fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    """The keys' 64-bit hashes as uint64 (one C-level pass)."""
    return np.array(list(map(hash, keys)), dtype=np.int64).view(np.uint64)


class FrequencySketch:
    def __init__(self) -> None:
        self._bits = MIN_WIDTH_BITS
        self._table = np.zeros((ROWS, (1 << self._bits) // 2), dtype=np.uint8)   # two counters a byte
        self._added = 0
        self._row_base = self._bases()

    def _bases(self) -> np.ndarray:
        return (np.arange(ROWS, dtype=np.uint64) * np.uint64(self._table.shape[1]))[:, None]

    @property
    def width(self) -> int:
        return 1 << self._bits

    @property
    def period(self) -> int:
        return self.width // 4

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def fit(self, entries: int) -> None:
        """Widen (never narrow) to at least ``WIDTH_PER_ENTRY`` counters per entry."""
        while WIDTH_PER_ENTRY * entries > self.width:
            low, high = self._table & 15, self._table >> 4
            wide = np.empty((ROWS, self._table.shape[1] * 2), dtype=np.uint8)
            wide[:, 0::2] = low | (low << 4)        # counter 2j -> 4j, 4j+1 (byte 2j)
            wide[:, 1::2] = high | (high << 4)      # counter 2j+1 -> 4j+2, 4j+3 (byte 2j+1)
            self._table = wide
            self._bits += 1
            self._row_base = self._bases()

    def _locate(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte index into the flat table, bit shift of the counter) for each row x key."""
        at = (fps * _ODD) >> np.uint64(64 - self._bits)
        shift = (at.astype(np.uint8) & 1) << 2
        at >>= _ONE
        at += self._row_base
        return at, shift

    def estimate(self, fps: np.ndarray) -> np.ndarray:
        """How often each key was counted (an upper estimate), without counting it."""
        if not len(fps):
            return np.zeros(0, dtype=np.uint8)
        at, shift = self._locate(fps)
        return ((self._table.ravel()[at] >> shift) & 15).min(axis=0)

    def count(self, fps: np.ndarray) -> np.ndarray:
        """Count each key once more; returns the estimates from before."""
        if not len(fps):
            return np.zeros(0, dtype=np.uint8)
        flat = self._table.ravel()
        at, shift = self._locate(fps)
        counters = (flat[at] >> shift) & 15
        grow = counters < MAX
        for nibble in (0, 4):          # low then high counters: two keys may share a byte
            sel = grow & (shift == nibble)
            cells = at[sel]
            flat[cells] = flat[cells] + np.uint8(1 << nibble)
        self._added += len(fps)
        if self._added >= self.period:
            self._table >>= 1
            self._table &= 0x77
            self._added = 0
        return counters.min(axis=0)

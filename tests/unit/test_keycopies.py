"""kvtierd.keycopies: the copies give back, by slot, the keys the records held when they were put —
after the records are rewritten, of any length, as one run or split by length."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.contract.protocol import MAX_KEY_BYTES
from kvtierd.contract.region_format import EntryState
from kvtierd.keycopies import KeyCopies
from kvtierd.records import copy_keys, keys_of

from .test_records import random_view

ROOT = Path(__file__).resolve().parents[2]


def runs_of(keys: list[bytes]) -> list[tuple[int, bytes]]:
    """(length, blob) per distinct length, in the order the lengths first come."""
    runs: dict[int, bytes] = {}
    for key in keys:
        runs[len(key)] = runs.get(len(key), b"") + key
    return list(runs.items())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, MAX_KEY_BYTES), min_size=1, max_size=3),
       rounds=st.integers(1, 4), count=st.integers(0, 30))
def test_the_copies_are_the_keys_the_records_held_when_put(seed, lengths, rounds, count):
    view = random_view(seed, 40)
    copies, held = KeyCopies(view), {}
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        view.entries["key_len"][:] = rng.choice(lengths, 40)
        slots = rng.choice(40, count, replace=False).astype(np.int32)
        keys = keys_of(view, slots)
        assert copies.put(slots) == runs_of(keys)              # given back as the pass copies them
        held.update(zip(slots.tolist(), keys))
        view.entries.view(np.uint8)[:] = rng.integers(0, 256, view.entries.nbytes, dtype=np.uint8)   # reused
        view.entries["key_len"][:] = rng.integers(0, 256, 40)
    asked = rng.choice(sorted(held), min(len(held), 25), replace=True).astype(np.int32) if held else np.zeros(0, np.int32)
    assert copies.runs(asked) == runs_of([held[s] for s in asked.tolist()])
    assert copies.runs(asked.astype(np.int64)) == copies.runs(asked)


@pytest.mark.parametrize("ns", [1, None])
def test_put_ready_copies_the_ready_entries_of_a_namespace_or_of_all(ns, monkeypatch):
    monkeypatch.setattr("kvtierd.keycopies.SCAN_SLOTS", 7)        # several scans
    view = random_view(5, 40)
    view.entries["key_len"] = 36
    view.entries["state"] = np.where(np.arange(40) % 3 == 0, EntryState.READY, EntryState.WRITING)
    view.entries["ns"] = np.arange(40) % 2
    copies = KeyCopies(view)
    copies.put_ready(ns)
    ready = np.array([s for s in range(40) if s % 3 == 0 and (ns is None or s % 2 == ns)], np.int32)
    assert copies.runs(ready) == runs_of(keys_of(view, ready))
    if ns is not None:
        assert copies.runs(np.array([0], np.int32)) == [(0, b"")]    # never put: no key (length 0)


def test_a_slot_without_a_row_or_a_scribbled_key_length_is_refused_and_nothing_is_copied():
    view = random_view(7, 40)
    view.entries["key_len"] = 36
    copies = KeyCopies(view)
    copies.put(np.array([1], np.int32))
    before = copies.rows.tobytes(), copies.lengths.tobytes()
    for bad in ([3, 40], [3, -1]):                                     # past the table
        with pytest.raises(ValueError, match="out of range|no row"):
            copies.put(np.array(bad, np.int32))
        with pytest.raises(ValueError, match="out of range|no row"):
            copies.runs(np.array(bad, np.int32))
    view.entries["key_len"][5] = MAX_KEY_BYTES + 1                    # a scribbled record, after a good one
    with pytest.raises(ValueError, match="key length 65 out of range"):
        copies.put(np.array([3, 5], np.int32))
    assert (copies.rows.tobytes(), copies.lengths.tobytes()) == before
    rows, lengths = np.zeros((10, MAX_KEY_BYTES), np.uint8), np.zeros(10, np.uint8)   # rows for fewer slots
    with pytest.raises(ValueError, match="slot 12 has no row"):
        copy_keys(view, np.array([3, 12], np.int32), rows, lengths)
    assert not rows.any() and not lengths.any()


def test_short_keys_are_copied_within_their_blob():
    """Keys of 1-7 bytes are copied exactly, never as whole words past the blob's end: under
    Python's debug allocator, which checks the bytes after every object when it is freed, a write
    past a blob is a fatal error (0.3.6's gatherer wrote up to 6 bytes past it for keys under 7
    bytes)."""
    script = """
import numpy as np
from kvtierd.keycopies import KeyCopies
from kvtierd.records import copy_keys, keys_of
from tests.unit.test_records import random_view
view = random_view(3, 40)
slots = np.arange(40, dtype=np.int32)
copies = KeyCopies(view)
for length in range(1, 10):
    view.entries["key_len"] = length
    for _ in range(50):
        want = [(length, b"".join(keys_of(view, slots)))]
        assert copies.put(slots) == want and copies.runs(slots[::-1].copy()) == [(length, b"".join(keys_of(view, slots[::-1].copy())))]
"""
    env = {**os.environ, "PYTHONMALLOC": "debug"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

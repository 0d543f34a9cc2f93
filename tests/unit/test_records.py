"""kvtierd.records: the compiled passes over entry records agree with the format's own definitions
(region_format.entry_record_sums in NumPy; Python's hash of each key's bytes)."""

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
from kvtierd.contract.region_format import ENTRY_DTYPE, EntryState, Geometry
from kvtierd.contract.region_sums import entry_record_sums
from kvtierd.contract.region_view import RegionView
from kvtierd.records import count_state, count_state_keys, fill, key_hashes, key_run, key_runs, keys_of, new_records, record_sums, seal_records

ROOT = Path(__file__).resolve().parents[2]


def random_view(seed: int, slots: int) -> RegionView:
    """A table of records of random bytes (whatever a damaged table may hold)."""
    geo = Geometry.for_pages(slots, 4096)
    view = RegionView(bytearray(geo.meta_bytes), None, geo)
    rng = np.random.default_rng(seed)
    view.entries.view(np.uint8)[:] = rng.integers(0, 256, len(view.entries) * ENTRY_DTYPE.itemsize, dtype=np.uint8)
    return view


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), width=st.integers(1, 9), per_slot=st.booleans(), whole=st.booleans())
def test_record_sums_are_the_formats(seed, width, per_slot, whole):
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed + 1)
    slots = rng.choice(40, 25, replace=True).astype(np.int32)          # repeats too
    chains = rng.integers(0, 2**32, (25, width), dtype=np.uint64).astype(np.uint32)
    counts = None if whole else rng.integers(0, width + 1, 25)
    ids = rng.integers(0, 2**63, 25, dtype=np.uint64) if per_slot else int(rng.integers(0, 2**63))
    records = view.entries.view(np.uint8).reshape(40, ENTRY_DTYPE.itemsize)[slots]
    want = entry_record_sums(records, chains, counts, ids)
    assert record_sums(view, slots, chains, counts, ids).tolist() == want.tolist()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), width=st.integers(1, 9), tick=st.integers(0, 2**64 - 1),
       state=st.integers(0, 255))
def test_seal_records_is_the_tick_the_formats_sum_and_the_state(seed, width, tick, state):
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed + 1)
    slots = rng.choice(40, 25, replace=False).astype(np.int32)         # a write's slots are distinct
    chains = rng.integers(0, 2**32, (25, width), dtype=np.uint64).astype(np.uint32)
    identity = int(rng.integers(0, 2**63))
    want = view.entries.copy()
    want["tick"][slots] = tick
    want["record_sum"][slots] = entry_record_sums(want.view(np.uint8).reshape(40, -1)[slots], chains, None, identity)
    want["state"][slots] = state
    assert seal_records(view, slots, chains, identity, tick, state) is None
    assert view.entries.tobytes() == want.tobytes()        # those fields of those records, nothing else


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, MAX_KEY_BYTES), other=st.sampled_from(
    [None, "length", "namespace"]), at=st.integers(0, 24))
def test_seal_records_gathers_the_keys_as_key_run_does(seed, length, other, at):
    """With ``keys`` the pass also gives the records' keys (as sealed) as one run when they are of
    one length and one namespace, None when one record breaks the run; the records end the same."""
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed + 1)
    slots = rng.choice(40, 25, replace=False).astype(np.int32)
    view.entries["key_len"][slots], view.entries["ns"][slots] = length, 3
    if other == "length":
        view.entries["key_len"][slots[at]] = length % MAX_KEY_BYTES + 1
    elif other == "namespace":
        view.entries["ns"][slots[at]] = 4
    chains = rng.integers(0, 2**32, (25, 2), dtype=np.uint64).astype(np.uint32)
    plain = RegionView(bytearray(view.raw), None, view.geometry)
    seal_records(plain, slots, chains, 5, 9, EntryState.READY)
    run = seal_records(view, slots, chains, 5, 9, EntryState.READY, keys=True)
    assert view.entries.tobytes() == plain.entries.tobytes()
    assert run == (None if other else (length, b"".join(keys_of(view, slots)), 3)) == key_run(view, slots)


def test_key_hashes_are_pythons_hash_of_each_key():
    view = random_view(7, 64)
    lengths = view.entries["key_len"]
    lengths[:] = np.arange(64) % (MAX_KEY_BYTES + 3)                  # 0 and too long among them
    slots = np.arange(64, dtype=np.int32)
    got = key_hashes(view, slots).view(np.int64).tolist()
    for slot in range(64):
        n = int(lengths[slot])
        if 1 <= n <= MAX_KEY_BYTES:
            key = bytes(view.entries["key"][slot][:n])
            assert got[slot] == hash(key) and keys_of(view, slots[slot:slot + 1]) == [key]
        else:
            assert got[slot] == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), name=st.sampled_from(["state", "ns", "page_count", "tick", "record_sum"]),
       value=st.integers(0, 2**64 - 1))
def test_fill_writes_one_field_of_each_slot_as_numpy_would(seed, name, value):
    view = random_view(seed, 40)
    want = view.entries.copy()
    slots = np.random.default_rng(seed).choice(40, 25, replace=True).astype(np.int32)
    kind = want.dtype.fields[name][0]
    want[name][slots] = value & ((1 << (8 * kind.itemsize)) - 1)
    fill(view, slots, name, value)
    assert view.entries.tobytes() == want.tobytes()          # that field of those records, nothing else


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), states=st.integers(1, 4), count=st.integers(0, 40))
def test_count_state_counts_as_numpy_would(seed, states, count):
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed)
    view.entries["state"] = rng.integers(0, states, 40)        # few states: many records share each
    slots = rng.choice(40, count, replace=True).astype(np.int32)
    for state in range(states + 1):
        assert count_state(view, slots, state) == int(np.count_nonzero(view.entries["state"][slots] == state))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, MAX_KEY_BYTES), other=st.sampled_from(
    [None, "length", "namespace"]), at=st.integers(0, 24), count=st.integers(0, 25))
def test_count_state_keys_is_count_state_and_key_run_in_one_pass(seed, length, other, at, count):
    """The count as count_state gives it, and the keys as key_run does: one run when they are of
    one length and one namespace, None when one record breaks it (wherever it is) or none is
    given; the records are only read."""
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed + 1)
    view.entries["state"] = rng.integers(0, 3, 40)
    slots = rng.choice(40, count, replace=False).astype(np.int32)
    view.entries["key_len"][slots], view.entries["ns"][slots] = length, 3
    if other == "length" and at < count:
        view.entries["key_len"][slots[at]] = length % MAX_KEY_BYTES + 1
    elif other == "namespace" and at < count:
        view.entries["ns"][slots[at]] = 4
    before = view.entries.tobytes()
    got = count_state_keys(view, slots, 1)
    assert got == (count_state(view, slots, 1), key_run(view, slots))
    broken = other is not None and at < count and count > 1     # one record unlike the others
    assert (got[1] is None) == (broken or not count)
    if got[1] is not None:
        assert got[1] == (int(view.entries["key_len"][slots[0]]), b"".join(keys_of(view, slots)),
                          int(view.entries["ns"][slots[0]]))
    assert view.entries.tobytes() == before


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), width=st.integers(1, 5), tick=st.integers(0, 2**62))
def test_new_records_are_the_template_with_first_page_and_tick(seed, width, tick):
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed + 1)
    slots = rng.choice(40, 20, replace=False).astype(np.int32)
    template = random_view(seed + 2, 1).entries[:1].copy()
    pages = rng.integers(0, 2**32, (20, width), dtype=np.uint64).astype(np.uint32)
    want = view.entries.copy()
    rows = np.repeat(template, 20)
    rows["first_page"], rows["tick"] = pages[:, 0], tick
    want[slots] = rows
    new_records(view, slots, template, pages, tick)
    assert view.entries.tobytes() == want.tobytes()


def test_a_slot_out_of_range_writes_nothing():
    view = random_view(7, 40)
    before = view.entries.tobytes()
    for write in (lambda: fill(view, np.array([3, 40], np.int32), "state", 1),
                  lambda: new_records(view, np.array([3, -1], np.int32), view.entries[:1].copy(),
                                      np.zeros((2, 1), np.uint32), 5)):
        with pytest.raises(ValueError, match="out of range"):
            write()
    assert view.entries.tobytes() == before


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(1, MAX_KEY_BYTES), min_size=1, max_size=3),
       count=st.integers(0, 30))
def test_key_runs_are_the_keys_by_length_in_slot_order(seed, lengths, count):
    """One (length, blob) run per distinct key length (the event log's records) in the order the
    lengths first come, each the keys of that length in the order of ``slots`` (repeats too): the
    keys ``keys_of`` gives, as blobs."""
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed)
    view.entries["key_len"][:] = rng.choice(lengths, 40)
    slots = rng.choice(40, count, replace=True).astype(np.int32)
    keys = keys_of(view, slots)
    want: dict[int, bytes] = {}
    for key in keys:
        want[len(key)] = want.get(len(key), b"") + key
    assert key_runs(view, slots) == list(want.items())
    assert key_runs(view, slots.astype(np.int64)) == key_runs(view, slots)


@pytest.mark.parametrize("bad_at", [0, 3, 5])
@pytest.mark.parametrize("other_length", [False, True])
def test_a_key_length_out_of_range_is_refused_wherever_it_is(bad_at, other_length):
    """A record whose key length byte says more than a key can hold (a scribbled table) is an
    error, not keys read past the key field: as the first record, after others of one length, or
    after the lengths already differ."""
    view = random_view(11, 40)
    view.entries["key_len"][:] = 36
    slots = np.arange(6, dtype=np.int32)
    if other_length:
        view.entries["key_len"][1] = 20
    view.entries["key_len"][bad_at] = MAX_KEY_BYTES + 1
    with pytest.raises(ValueError, match="out of range"):
        key_runs(view, slots)


def test_short_keys_are_gathered_within_their_blob():
    """Keys of 1-7 bytes are copied exactly, never as whole words past the blob's end: under
    Python's debug allocator, which checks the bytes after every object when it is freed, a write
    past a blob is a fatal error (0.3.6 wrote up to 6 bytes past it for keys under 7 bytes)."""
    script = """
import numpy as np
from kvtierd.records import count_state_keys, key_run, keys_of
from tests.unit.test_records import random_view
view = random_view(3, 40)
slots = np.arange(40, dtype=np.int32)
for length in range(1, 9):
    view.entries["key_len"], view.entries["ns"] = length, 3
    for _ in range(50):
        want = (length, b"".join(keys_of(view, slots)), 3)
        assert key_run(view, slots) == want and count_state_keys(view, slots, 1)[1] == want
"""
    env = {**os.environ, "PYTHONMALLOC": "debug"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

"""kvtierd.records: the compiled passes over entry records agree with the format's own definitions
(region_format.entry_record_sums in NumPy; Python's hash of each key's bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.contract.protocol import MAX_KEY_BYTES
from kvtierd.contract.region_format import ENTRY_DTYPE, EntryState, Geometry
from kvtierd.contract.region_sums import entry_record_sums
from kvtierd.contract.region_view import RegionView
from kvtierd.records import count_state, fill, key_hashes, keys_of, new_records, ready_slots, record_sums, seal_records

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


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), start=st.integers(0, 40), stop=st.integers(0, 40))
def test_ready_slots_are_the_ready_entries_of_a_namespace(seed, start, stop):
    view = random_view(seed, 40)
    rng = np.random.default_rng(seed)
    view.entries["state"], view.entries["ns"] = rng.integers(0, 3, 40), rng.integers(0, 3, 40)
    for ns in range(3):
        want = [s for s in range(start, stop) if view.entries["state"][s] == EntryState.READY and view.entries["ns"][s] == ns]
        assert ready_slots(view.entries, ns, start, stop).tolist() == want

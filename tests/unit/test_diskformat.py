"""kvtierd.tier.diskformat without a directory: records and their checksum, slot sizes, names."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.tier.backend import TierRejected
from kvtierd.tier.diskformat import (ALIGN, RECORD, RECORD_VERSION, checksums, hole_records, keyspace_digest,
                                     slot_bytes, whole)
from kvtierd.tier.keys import Keyspace


def records(n: int, seed: int = 0) -> np.ndarray:
    recs = np.frombuffer(np.random.default_rng(seed).integers(0, 256, n * RECORD.itemsize, dtype=np.uint8).tobytes(),
                         RECORD).copy()
    recs["version"] = RECORD_VERSION
    recs["check"] = checksums(recs)
    return recs


def test_a_record_is_80_bytes_and_whole_only_with_its_checksum():
    assert RECORD.itemsize == 80
    recs = records(64)
    assert whole(recs).all()
    recs["version"][3] = 0                       # an empty slot
    assert whole(recs).tolist() == [i != 3 for i in range(64)]
    assert whole(np.zeros(4, RECORD)).tolist() == [False] * 4
    holes = hole_records(2)
    assert whole(holes).all() and (holes["length"] == 0).all()


@given(st.integers(0, RECORD.fields["check"][1] - 1), st.integers(1, 255), st.integers(0, 1 << 16))
def test_any_damaged_byte_makes_a_record_not_whole(offset, flip, seed):
    recs = records(1, seed)
    raw = recs.view(np.uint8)
    raw[offset] ^= flip
    assert not whole(recs)[0]


def test_slot_sizes_round_each_extent_to_the_alignment():
    assert slot_bytes([(0, 3 * 16384 - 123)]) == 3 * 16384
    assert slot_bytes([(0, 16384), (65536, 100)]) == 16384 + ALIGN          # a shard's tail
    assert slot_bytes([(0, 8192), (40960, 8192 - 5)]) == slot_bytes([(0, 16384 - 5)])


def test_keyspace_digests_come_from_names_and_prefixes():
    ks = Keyspace(b"model")
    assert keyspace_digest(ks.prefix) == keyspace_digest(ks.names([b"\x01"])[0]) == bytes.fromhex(ks.prefix[5:29])
    with pytest.raises(TierRejected):
        keyspace_digest("kvt1/abc/def")

"""kvtierd._native's checksums (native/checksum.c): XXH64 against its specification's known
answers and a pure-Python model of the specification, and ``block_sums`` (a run of blocks, each
bound to a head, its key, its length and shards) against the same model."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd import _native

MASK = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                      0x27D4EB2F165667C5)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def _round(acc: int, lane: int) -> int:
    return _rotl((acc + lane * P2) & MASK, 31) * P1 & MASK


def model(data: bytes, seed: int = 0) -> int:
    """XXH64 as its specification (xxHash's doc/xxhash_spec.md) describes it, one step at a time."""
    n, p = len(data), 0
    if n >= 32:
        acc = [(seed + P1 + P2) & MASK, (seed + P2) & MASK, seed, (seed - P1) & MASK]
        while p + 32 <= n:
            acc = [_round(a, struct.unpack_from("<Q", data, p + 8 * j)[0]) for j, a in enumerate(acc)]
            p += 32
        h = (_rotl(acc[0], 1) + _rotl(acc[1], 7) + _rotl(acc[2], 12) + _rotl(acc[3], 18)) & MASK
        for a in acc:
            h = ((h ^ _round(0, a)) * P1 + P4) & MASK
    else:
        h = (seed + P5) & MASK
    h = (h + n) & MASK
    while p + 8 <= n:
        h = (_rotl(h ^ _round(0, struct.unpack_from("<Q", data, p)[0]), 27) * P1 + P4) & MASK
        p += 8
    if p + 4 <= n:
        h = (_rotl(h ^ (struct.unpack_from("<I", data, p)[0] * P1 & MASK), 23) * P2 + P3) & MASK
        p += 4
    for byte in data[p:]:
        h = _rotl(h ^ (byte * P5 & MASK), 11) * P1 & MASK
    h = (h ^ (h >> 33)) * P2 & MASK
    h = (h ^ (h >> 29)) * P3 & MASK
    return h ^ (h >> 32)


# Known answers: the empty input's from the specification's reference implementation, and the
# widely published ones of "a", "abc" and the python-xxhash documentation's sentence.
KNOWN = [(b"", 0, 0xEF46DB3751D8E999), (b"a", 0, 0xD24EC4F1A98C6E5B), (b"abc", 0, 0x44BC2CF5AD770999),
         (b"Nobody inspects the spammish repetition", 0, 0xFBCEA83C8A378BF1)]


@pytest.mark.parametrize("data, seed, want", KNOWN)
def test_known_answers(data, seed, want):
    assert _native.xxh64(data, seed) == want
    assert model(data, seed) == want


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, MASK))
def test_xxh64_is_the_specification_on_every_length_and_seed(data, seed):
    assert _native.xxh64(data, seed) == model(data, seed)


def bound(head: bytes, key: bytes, data: bytes, shards: int) -> int:
    return model(head + struct.pack("<H", len(key)) + key + struct.pack("<QH", len(data), shards) + data)


EXTENTS = st.lists(st.tuples(st.integers(0, 900), st.integers(0, 100)), max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1000, max_size=1000), st.binary(max_size=60),
       st.lists(st.tuples(st.binary(max_size=40), EXTENTS), min_size=1, max_size=6), st.integers(1, 8), st.data())
def test_block_sums_hash_each_chosen_block_bound_to_head_key_length_and_shards(memory, head, items, shards, data):
    keys = [key for key, _ in items]
    blocks = [extents for _, extents in items]
    indices = data.draw(st.lists(st.integers(0, len(items) - 1), max_size=8))
    raw = _native.block_sums(memoryview(memory), head, keys, blocks, indices, shards)
    got = list(struct.unpack(f"<{len(indices)}Q", raw))
    want = [bound(head, keys[i], b"".join(memory[o:o + n] for o, n in blocks[i]), shards) for i in indices]
    assert got == want


def test_block_sums_refuse_extents_outside_the_memory_and_bad_arguments():
    memory = memoryview(bytearray(4096))
    with pytest.raises(ValueError, match="outside the memory's 4096 bytes"):
        _native.block_sums(memory, b"", [b"k"], [[(4000, 97)]], [0], 1)
    with pytest.raises(ValueError, match="outside"):
        _native.block_sums(memory, b"", [b"k"], [[(-1, 1)]], [0], 1)
    with pytest.raises(IndexError):
        _native.block_sums(memory, b"", [b"k"], [[(0, 1)]], [1], 1)
    with pytest.raises(TypeError, match="a key is bytes"):
        _native.block_sums(memory, b"", ["k"], [[(0, 1)]], [0], 1)
    with pytest.raises(TypeError, match="extent"):
        _native.block_sums(memory, b"", [b"k"], [[[0, 1]]], [0], 1)
    with pytest.raises(ValueError, match="shards"):
        _native.block_sums(memory, b"", [b"k"], [[(0, 1)]], [0], 0)
    assert _native.block_sums(memory, b"", [b"k"], [[(4000, 96)]], [0], 1) != _native.block_sums(
        memory, b"", [b"k"], [[(4000, 96)]], [0], 2)


def test_a_block_of_many_extents_grows_the_scratch_and_hashes_them_all():
    memory = bytes(range(256)) * 64
    extents = [(i * 7 % 16000, 13) for i in range(3000)]
    raw = _native.block_sums(memoryview(memory), b"h", [b"k", b"j"], [[(0, 5)], extents], [1, 0], 1)
    assert struct.unpack("<2Q", raw) == (bound(b"h", b"j", b"".join(memory[o:o + n] for o, n in extents), 1),
                                         bound(b"h", b"k", memory[:5], 1))

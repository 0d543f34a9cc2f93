"""kvtierd.tier.seal: what a seal binds (bytes, namespace, key, shards, the sealing key), and the key file."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvtierd.tier import seal
from kvtierd.tier.seal import SEAL_BYTES, SUM_ID, SealKey, Sealer, load_key, pipeline

KEY = SealKey(bytes(range(32)))


@pytest.fixture
def memory():
    data = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8)
    return memoryview(data)


def seal_of(memory, blocks, keys=(b"k",), identity=b"ns", key=KEY, shards=1):
    return Sealer(key, identity).seals(list(keys), memory, blocks, shards)


def test_a_seal_holds_for_its_bytes_and_is_independent_of_how_they_are_split(memory):
    one = seal_of(memory, [[(0, 3000)]]).make(0)
    assert len(one) == SEAL_BYTES and one[:4] == KEY.id
    assert seal_of(memory, [[(0, 1000), (1000, 2000)]]).check(0, one)     # the same bytes in two runs


@pytest.mark.parametrize("what", ["byte", "namespace", "key", "shards", "sealing key"])
def test_a_seal_fails_for_anything_else(memory, what):
    good = seal_of(memory, [[(0, 3000)]]).make(0)
    if what == "byte":
        memory[10] ^= 1
        other = seal_of(memory, [[(0, 3000)]])
    else:
        other = seal_of(memory, [[(0, 3000)]], identity=b"other-ns" if what == "namespace" else b"ns",
                        keys=(b"k2",) if what == "key" else (b"k",), shards=2 if what == "shards" else 1,
                        key=SealKey(b"x" * 32) if what == "sealing key" else KEY)
    assert not other.check(0, good)
    assert other.rejected() == {"mismatch": int(what != "sealing key"), "other_key": int(what == "sealing key")}


def test_the_key_file_is_generated_private_and_read_back(tmp_path):
    path = str(tmp_path / "tier.key")
    with pytest.raises(ValueError, match=f"cannot read the tier key file {path}"):
        load_key(path)
    made = load_key(path, create=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(open(path).read().strip()) == 64
    assert load_key(path, create=True).id == made.id           # an existing file is kept
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=f"open to others \\(mode 0640\\): chmod 600 {path}"):
        load_key(path)
    for text, why in (("zz" * 32, "does not hold hex digits"), ("ab" * 8, "at least 32 bytes, not 8")):
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
        with pytest.raises(ValueError, match=why):
            load_key(path)


def test_memory_of_any_byte_format_is_sealed_alike(memory):
    """The companion's region mapping is a ctypes array (format '<B'); its seals are the bytes' seals."""
    import ctypes
    raw = (ctypes.c_ubyte * len(memory)).from_buffer_copy(memory)
    view = memoryview(raw)
    assert view.format == "<B"
    assert seal_of(view, [[(0, 3000)]]).make(0) == seal_of(memory, [[(0, 3000)]]).make(0)


def test_a_pipeline_cuts_a_batch_into_parts_of_consecutive_blocks():
    """Up to PIPELINE_PARTS parts of at least PART_BYTES, never more blocks than the engine's
    largest call; a small batch is one part."""
    assert pipeline([[(0, 1 << 20)]] * 256, 1024) == [range(i, i + 64) for i in range(0, 256, 64)]
    assert pipeline([[(0, 1 << 20)]] * 256, 48) == [range(i, min(i + 48, 256)) for i in range(0, 256, 48)]
    assert pipeline([[(0, 64 << 10)]] * 256, 1024) == [range(i, i + 64) for i in range(0, 256, 64)]
    assert pipeline([[(0, 4096)]] * 8, 1024) == [range(0, 8)]
    assert pipeline([], 1024) == []


def test_seals_made_and_checked_on_the_threads_keep_each_block_its_own():
    """Blocks hashed in tasks on the seal threads (several tasks: more than TASK_BYTES), and by
    pipeline parts: every seal is its block's, in order; damaged blocks fail alone."""
    data = np.random.default_rng(9).integers(0, 256, 6 << 20, dtype=np.uint8)
    memory = memoryview(data)
    blocks = [[(i * (192 << 10), 192 << 10)] for i in range(32)]          # 6 MiB: several tasks
    keys = [b"k%d" % i for i in range(32)]
    seals = seal_of(memory, blocks, keys=keys)
    serial = [seals.make(i) for i in range(32)]
    assert seals.make_all(range(32)) == serial
    ranges = pipeline(blocks, 1024)
    assert len(ranges) > 1
    parted = list(seals.parts(ranges))
    assert [r for r, _ in parted] == ranges and [s for _, sealed in parted for s in sealed] == serial
    for i in (3, 17, 30):
        data[i * (192 << 10) + 5] ^= 1
    checked = seal_of(memory, blocks, keys=keys)
    assert list(checked.checking(enumerate(serial))) == [i not in (3, 17, 30) for i in range(32)]
    assert checked.rejected() == {"mismatch": 3, "other_key": 0}


def test_a_corrupted_part_fails_alone_and_seals_stay_bound_to_their_blocks_across_parts():
    """A batch sealed by pipeline parts (``parts``, as a put does) and checked part by part
    (``checking``, as a get does while the next part transfers): a part whose bytes changed after
    sealing (a torn transfer) fails, every block of it, while the other parts hold; seals moved
    one part over (each block given the seal of the block at its place in the next part: values
    stored under other keys) fail; so do the right seals checked for another namespace."""
    data = np.random.default_rng(11).integers(0, 256, 16 << 20, dtype=np.uint8)
    memory = memoryview(data)
    blocks = [[(i * (64 << 10), 64 << 10)] for i in range(256)]
    keys = [b"k%d" % i for i in range(256)]
    ranges = pipeline(blocks, 1024)
    assert len(ranges) == 4
    sealed = [s for _, part in seal_of(memory, blocks, keys=keys).parts(ranges) for s in part]
    torn = ranges[2]
    data[torn.start * (64 << 10):torn.stop * (64 << 10):4096] ^= 0xFF      # a byte of each of its pages
    checked = seal_of(memory, blocks, keys=keys)
    held = [ok for part in ranges for ok in list(checked.checking((i, sealed[i]) for i in part))]
    assert held == [i not in torn for i in range(256)]
    assert checked.rejected() == {"mismatch": len(torn), "other_key": 0}
    shifted = seal_of(memory, blocks, keys=keys)
    assert not any(shifted.checking((i, sealed[i + len(ranges[0])]) for i in ranges[0]))
    other = seal_of(memory, blocks, keys=keys, identity=b"other-ns")
    assert not any(other.checking((i, sealed[i]) for i in ranges[0]))


# ------------------------------------------------------------------ the disk tier's checksums
def test_a_checksum_seal_holds_for_its_bytes_however_split_and_fails_for_anything_else(memory):
    one = seal_of(memory, [[(0, 3000)]]).sums([0])[0]
    assert len(one) == SEAL_BYTES and one[:4] == SUM_ID and one[12:] == bytes(20)
    assert seal_of(memory, [[(0, 1000), (1000, 2000)]]).check_sums([0], [one]) == [True]
    variants = {"namespace": dict(identity=b"other-ns"), "key": dict(keys=(b"k2",)), "shards": dict(shards=2)}
    for what, kw in variants.items():
        other = seal_of(memory, [[(0, 3000)]], **kw)
        assert other.check_sums([0], [one]) == [False], what
        assert other.rejected() == {"mismatch": 1, "other_key": 0}
    assert seal_of(memory, [[(0, 2999)]]).check_sums([0], [one]) == [False]           # the byte count
    memory[10] ^= 1
    assert seal_of(memory, [[(0, 3000)]]).check_sums([0], [one]) == [False]           # a byte


def test_a_checksum_is_never_taken_for_a_mac(memory):
    """Invariant 14: a remote tier's values are proven by the MAC. A value planted with a checksum
    seal (anyone can compute one) fails ``check`` as sealed under another key."""
    seals = seal_of(memory, [[(0, 3000)]])
    assert seals.check(0, seals.sums([0])[0]) is False
    assert seals.rejected() == {"mismatch": 0, "other_key": 1}


def test_no_key_has_the_checksums_id(monkeypatch):
    """A key whose id digest would start with four zero bytes takes id 1 (one in 2**32)."""
    class Zeros:
        def __init__(self, data):
            pass

        def digest(self):
            return bytes(32)
    monkeypatch.setattr(seal.hashlib, "sha256", Zeros)
    assert SealKey(bytes(32)).id == (1).to_bytes(4, "big") != SUM_ID

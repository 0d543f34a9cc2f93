"""kvtierd.tier.seal: what a seal binds (bytes, namespace, key, shards, the sealing key), and the key file."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from kvtierd.tier.seal import SEAL_BYTES, SealKey, Sealer, load_key

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

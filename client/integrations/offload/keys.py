"""vLLM's keys as kvtier keys, and their KV-cache group.

vLLM's ``OffloadKey`` (block hash ‖ 4-byte group index, 36 bytes with sha256) is the kvtier key as
is; a key longer than kvtierd's limit is shortened to sha256(hash) ‖ group index (``kvtier_key``).
vLLM 0.33's hash functions make keys of 36 (sha256, sha256_cbor) or 20 bytes (xxhash,
xxhash_cbor), so a kvtier key of a vLLM namespace is an OffloadKey, and ``offload_keys`` turns the
keys of kvtierd's event log back into the OffloadKeys an engine could have produced (its hash
length, its KV-cache groups) without guessing.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

from kvtierd.contract import protocol as P

GROUP_BYTES = 4                        # a key's last bytes: its KV-cache group index


def group_of(key: bytes) -> bytes:
    """The KV-cache group a key belongs to (its last ``GROUP_BYTES``)."""
    return key[-GROUP_BYTES:]


def grouped(keys: Iterable[bytes]) -> list[list]:
    """Keys per KV-cache group, in order."""
    groups: dict[bytes, list] = {}
    for key in keys:
        groups.setdefault(key[-GROUP_BYTES:], []).append(key)
    return list(groups.values())


def kvtier_key(key: bytes) -> bytes:
    """The kvtier key of a vLLM OffloadKey: the key itself when it fits kvtierd's limit, else
    sha256(block hash) ‖ group index (4 bytes), which keeps keys of different groups apart."""
    key = bytes(key)
    if len(key) <= P.MAX_KEY_BYTES:
        return key
    return hashlib.sha256(key[:-GROUP_BYTES]).digest() + key[-GROUP_BYTES:]


def kvtier_keys(keys: Iterable[bytes]) -> list[bytes]:
    """``kvtier_key`` of every key; vLLM's sha256 keys (36 bytes) pass as they are, checked in one
    C-level pass (this runs on the scheduler thread for thousands of keys per request)."""
    keys = list(keys)
    if keys and max(map(len, keys)) > P.MAX_KEY_BYTES:
        return [kvtier_key(k) for k in keys]
    return keys


def offload_keys(key_len: int, blob: bytes, key_bytes: int, num_groups: int) -> list[bytes]:
    """The OffloadKeys, in order, among a blob of ``key_len``-byte kvtier keys (an event record of
    the engine's namespace) that this engine could produce: keys of its length (``key_bytes``)
    whose group index is one of its ``num_groups``. A kvtier key of that length is the OffloadKey
    itself; keys of another length come from engines hashing with another algorithm and name no
    block this engine can ask for."""
    if key_len != key_bytes:
        return []
    rows = np.frombuffer(blob, np.uint8).reshape(-1, key_len)
    keep = rows[:, -GROUP_BYTES:].copy().view(">u4").ravel() < num_groups
    if not keep.all():
        rows = rows[keep]
    return np.frombuffer(rows.tobytes(), np.dtype((np.void, key_len))).tolist()

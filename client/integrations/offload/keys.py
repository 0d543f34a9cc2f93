"""vLLM's keys as kvtier keys, and their KV-cache group.

vLLM's ``OffloadKey`` (block hash ‖ 4-byte group index, 36 bytes with sha256) is the kvtier key as
is; a key longer than kvtierd's limit is shortened to sha256(hash) ‖ group index (``kvtier_key``).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

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

"""vLLM's KV cache events on the wire, written by the daemon: a ``KVEventBatch`` (vLLM 0.33,
vllm/distributed/kv_events.py) as msgpack bytes that vLLM's own msgspec decoder reads, built from
kvtier keys without a Python object per event.

What a kvtier key of a vLLM namespace says: it is vLLM's ``OffloadKey``, the block hash followed
by the KV-cache group index (4 bytes, big-endian). An event names the block as vLLM's events do
(``maybe_convert_block_hash``): the hash's last 8 bytes as an unsigned integer by default
(vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the hash's bytes (``HashForm.BYTES``).

The events say what vLLM's OffloadingConnector says of its CPU tier when self-describing events
are off (its default) — no tokens, no parent, ``block_size`` 0, medium "CPU", the group index —
with one event per KV-cache group of a record's keys where the connector sends one BlockStored
per key: ``BlockStored`` and ``BlockRemoved`` each name a group's hashes in order, and
``AllBlocksCleared``. vLLM's decoder reads either, and a router indexes every hash of the list
either way; one event per group is ~9 bytes a key on the wire instead of ~127, which the
daemon, its ZMQ I/O thread and every subscriber write, copy and read (0.3.2 sent one per key; the
CHANGELOG says how to move). The bytes are msgspec's for the same structs (tests/vllm/
test_kvevents.py compares them; tests/unit/test_kvevents_wire.py compares them with msgpack's
packing of the same maps): a batch's events are written in one compiled pass over its key blobs
(``kvtierd._native.kv_events``), which counts the groups as it goes (the batch's array header
says how many events follow), each hash in msgpack's shortest form: ~2.6 ns a key with the
blobs in cache, where NumPy's fixed-width rows and the Python around them took ~90-250 ns.
"""

from __future__ import annotations

import enum
import struct
from typing import Iterable

import msgpack

from ._native import kv_events
from .contract.events import Kind

MEDIUM = "CPU"
GROUP_BYTES = 4
_pack = msgpack.Packer(use_bin_type=True).pack


class HashForm(str, enum.Enum):
    INT = "int"        # the hash's last 8 bytes as an unsigned int (vLLM's default)
    BYTES = "bytes"    # the hash as it is


def _stored_map(hashes: list, group: int) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": MEDIUM, "lora_name": None, "group_idx": group}


def _removed_map(hashes: list, group: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": group}


# msgspec writes BlockStored (17 fields, most omitted as defaults) under a map16 header; msgpack
# would write a fixmap. The rest of a packed map is the same bytes.
_STORED_HEADER = b"\xde\x00\x09"
_HASH_MARK = b"\xc0"           # placeholder of the hash in the templates below
_GROUP_MARK = b"\x7f"          # placeholder of the group (any fixint)
_STORED, _REMOVED = int(Kind.STORED), int(Kind.REMOVED)    # kinds of a part for kv_events: a record's


def _template(mapping: dict, header: bytes | None = None, array: bool = False) -> tuple[bytes, bytes, bytes]:
    """A packed map cut around its hash placeholder and its group placeholder: (the bytes before
    the hash, between the hash and the group, after the group). ``array``: cut before the hash
    array's header instead (BlockRemoved: the encoder writes the array)."""
    raw = _pack(mapping)
    if header is not None:
        raw = header + raw[1:]
    at_hash, at_group = raw.index(_HASH_MARK, raw.index(b"block_hashes")), raw.rindex(_GROUP_MARK)
    return raw[:at_hash - 1 if array else at_hash], raw[at_hash + 1:at_group], raw[at_group + 1:]


_STORED_TEMPLATE = _template(_stored_map([None], 127), _STORED_HEADER, array=True)
_REMOVED_TEMPLATE = _template(_removed_map([None], 127), array=True)
_ALL_CLEARED = _pack({"type": "AllBlocksCleared"})


class Batch:
    """One KVEventBatch being put together: events appended in order (the blobs as given, no
    copy), their bytes written by ``encode``. How many events it makes is known once encoded (a
    removal makes one per KV-cache group, counted as the bytes are written: a pass over the keys
    the daemon's loop does not make)."""

    def __init__(self, form: HashForm = HashForm.INT):
        self.form = form
        self._parts: list = []            # bytes as they are, or (kind, key length, blob) for kv_events

    def stored(self, key_len: int, blob: bytes) -> None:
        """One BlockStored per key of the blob, in order."""
        self.changes(((_STORED, key_len, blob),))

    def removed(self, key_len: int, blob: bytes) -> None:
        """One BlockRemoved per KV-cache group of the blob's keys (in the order the groups first
        come), with their hashes in order."""
        self.changes(((_REMOVED, key_len, blob),))

    def changes(self, parts: Iterable[tuple[int, int, bytes]]) -> None:
        """``stored`` (kind 0) or ``removed`` (kind 1) of each (kind, key length, blob), in order:
        a read's records in one call (a call per record was most of a flush's Python)."""
        self._parts += [part for part in parts if part[1] > GROUP_BYTES and part[2]]

    def all_cleared(self) -> None:
        self._parts.append(_ALL_CLEARED)

    def __bool__(self) -> bool:
        """Whether it has an event."""
        return bool(self._parts)

    def encode(self, ts: float, dp_rank: int | None = 0) -> tuple[bytes, int]:
        """(the KVEventBatch [ts, [events...], data_parallel_rank], how many events). The daemon's
        stream says data-parallel rank 0, as a vLLM engine without data parallelism does. Most of
        it runs without the GIL."""
        return kv_events(b"\x93\xcb" + struct.pack(">d", ts), self._parts, _pack(dp_rank), self.form is HashForm.INT,
                         _STORED_TEMPLATE, _REMOVED_TEMPLATE)

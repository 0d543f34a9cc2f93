"""vLLM's KV cache events on the wire, written by the daemon: a ``KVEventBatch`` (vLLM 0.33,
vllm/distributed/kv_events.py) as msgpack bytes that vLLM's own msgspec decoder reads, built from
kvtier keys without a Python object per event.

What a kvtier key of a vLLM namespace says: it is vLLM's ``OffloadKey``, the block hash followed
by the KV-cache group index (4 bytes, big-endian). An event names the block as vLLM's events do
(``maybe_convert_block_hash``): the hash's last 8 bytes as an unsigned integer by default
(vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the hash's bytes (``HashForm.BYTES``).

The events are the ones vLLM's OffloadingConnector publishes for its CPU tier when
self-describing events are off (its default): one ``BlockStored`` per key (no tokens, no parent,
``block_size`` 0, medium "CPU", the group index), one ``BlockRemoved`` per group with its hashes,
and ``AllBlocksCleared``. The bytes are msgspec's for the same structs (tests/vllm/
test_kvevents.py compares them; tests/unit/test_kvevents_wire.py compares them with msgpack's
packing of the same maps): a batch's events are written in one compiled pass over its key blobs
(``kvtierd._native.kv_events``), each hash and group in msgpack's shortest form between the fixed
bytes of its map, which come from msgpack here (the templates): ~10 ns per BlockStored, where
NumPy's fixed-width rows and the Python around them took ~90-250 ns (kvtierbench ``events``,
publish ns/key), and short hashes (< 8 bytes, int form) made them fail.
"""

from __future__ import annotations

import enum
import struct

import msgpack

from ._native import kv_events, kv_groups

MEDIUM = "CPU"
GROUP_BYTES = 4
_pack = msgpack.Packer(use_bin_type=True).pack


class HashForm(str, enum.Enum):
    INT = "int"        # the hash's last 8 bytes as an unsigned int (vLLM's default)
    BYTES = "bytes"    # the hash as it is


def _stored_map(block_hash, group: int) -> dict:
    return {"type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": MEDIUM, "lora_name": None, "group_idx": group}


def _removed_map(hashes: list, group: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": group}


# msgspec writes BlockStored (17 fields, most omitted as defaults) under a map16 header; msgpack
# would write a fixmap. The rest of a packed map is the same bytes.
_STORED_HEADER = b"\xde\x00\x09"
_HASH_MARK = b"\xc0"           # placeholder of the hash in the templates below
_GROUP_MARK = b"\x7f"          # placeholder of the group (any fixint)
_STORED, _REMOVED = 0, 1       # kinds of a part for kv_events


def _template(mapping: dict, header: bytes | None = None, array: bool = False) -> tuple[bytes, bytes, bytes]:
    """A packed map cut around its hash placeholder and its group placeholder: (the bytes before
    the hash, between the hash and the group, after the group). ``array``: cut before the hash
    array's header instead (BlockRemoved: the encoder writes the array)."""
    raw = _pack(mapping)
    if header is not None:
        raw = header + raw[1:]
    at_hash, at_group = raw.index(_HASH_MARK, raw.index(b"block_hashes")), raw.rindex(_GROUP_MARK)
    return raw[:at_hash - 1 if array else at_hash], raw[at_hash + 1:at_group], raw[at_group + 1:]


_STORED_TEMPLATE = _template(_stored_map(None, 127), _STORED_HEADER)
_REMOVED_TEMPLATE = _template(_removed_map([None], 127), array=True)
_ALL_CLEARED = _pack({"type": "AllBlocksCleared"})


class Batch:
    """One KVEventBatch being put together: events appended in order, their bytes written once,
    by ``payload``. It keeps the blobs it was given (not the encoded bytes: 36 bytes a vLLM key
    rather than ~127), so that holding it for a replay costs the keys' bytes, and ``payload``
    gives the same bytes again."""

    def __init__(self, form: HashForm = HashForm.INT):
        self.form = form
        self.count = 0                    # events
        self.nbytes = 0                   # bytes it holds (the blobs and packed parts)
        self._parts: list = []            # bytes as they are, or (kind, key length, blob, events) for kv_events

    def stored(self, key_len: int, blob: bytes) -> None:
        """One BlockStored per key of the blob, in order."""
        if key_len > GROUP_BYTES and blob:
            count = len(blob) // key_len
            self._add(count, (_STORED, key_len, blob, count), len(blob))

    def removed(self, key_len: int, blob: bytes) -> None:
        """One BlockRemoved per KV-cache group of the blob's keys (in the order the groups first
        come), with their hashes in order."""
        if key_len > GROUP_BYTES and blob:
            count = kv_groups(blob, key_len)
            self._add(count, (_REMOVED, key_len, blob, count), len(blob))

    def all_cleared(self) -> None:
        self._add(1, _ALL_CLEARED, len(_ALL_CLEARED))

    def _add(self, count: int, part, nbytes: int) -> None:
        self.count += count
        self.nbytes += nbytes
        self._parts.append(part)

    def payload(self, ts: float, dp_rank: int | None = 0) -> bytes:
        """The KVEventBatch [ts, [events...], data_parallel_rank]. The daemon's stream says
        data-parallel rank 0, as a vLLM engine without data parallelism does."""
        head = b"\x93\xcb" + struct.pack(">d", ts) + _array_header(self.count)
        return kv_events(head, self._parts, _pack(dp_rank), self.form is HashForm.INT, _STORED_TEMPLATE,
                         _REMOVED_TEMPLATE)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")

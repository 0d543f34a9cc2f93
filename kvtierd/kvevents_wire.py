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
test_kvevents.py compares them): every event of a batch whose hashes are 8 bytes or more, not
below 2**32, and whose groups are below 128 (every sha256 or xxhash key of a model with fewer
than 128 KV-cache groups, but for about one key in four billion) is a fixed-width row filled by
NumPy; any other batch is packed event by event, with the same result.
"""

from __future__ import annotations

import enum
import struct

import msgpack
import numpy as np

MEDIUM = "CPU"
GROUP_BYTES = 4
_INT_HASH_BYTES = 8
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


def _template(mapping: dict, header: bytes | None = None) -> tuple[bytes, int, int]:
    """A packed map with the hash and group placeholders: (bytes, hash offset, group offset)."""
    raw = _pack(mapping)
    if header is not None:
        raw = header + raw[1:]
    return raw, raw.index(_HASH_MARK, raw.index(b"block_hashes")), raw.rindex(_GROUP_MARK)


def _hash_header(form: HashForm, hash_len: int) -> bytes:
    return b"\xcf" if form is HashForm.INT else b"\xc4" + bytes([hash_len])


class Columns:
    """A blob of keys as NumPy columns: the part of each hash an event names, and the group."""

    def __init__(self, key_len: int, blob: bytes, form: HashForm):
        rows = np.frombuffer(blob, np.uint8).reshape(-1, key_len)
        self.hash_len = key_len - GROUP_BYTES
        self.form = form
        part = rows[:, self.hash_len - _INT_HASH_BYTES:self.hash_len] if form is HashForm.INT else rows[:, :self.hash_len]
        self.hashes = np.ascontiguousarray(part)
        self.groups = rows[:, self.hash_len:].copy().view(">u4").ravel()

    @property
    def fixed_width(self) -> bool:
        """Whether every event's hash and group take the widths the templates have."""
        if self.form is HashForm.INT:
            # msgpack writes an int in its shortest form: 9 bytes only from 2**32 up.
            return self.hash_len >= _INT_HASH_BYTES and bool(self.hashes[:, :4].any(axis=1).all()) \
                and int(self.groups.max()) < 128
        return 0 < self.hash_len < 256 and int(self.groups.max()) < 128

    def hash_values(self) -> list:
        if self.form is HashForm.INT:
            return self.hashes.view(">u8").ravel().tolist()
        return np.frombuffer(self.hashes.tobytes(), np.dtype((np.void, self.hash_len))).tolist()


def stored(key_len: int, blob: bytes, form: HashForm = HashForm.INT) -> tuple[int, bytes]:
    """(events, bytes): one BlockStored per key of the blob, in order."""
    if key_len <= GROUP_BYTES:
        return 0, b""
    cols = Columns(key_len, blob, form)
    n = len(cols.groups)
    if not cols.fixed_width:
        return n, b"".join(_STORED_HEADER + _pack(_stored_map(h, g))[1:]
                           for h, g in zip(cols.hash_values(), cols.groups.tolist()))
    raw, at_hash, at_group = _template(_stored_map(None, 127), _STORED_HEADER)
    head = _hash_header(form, cols.hash_len)
    width = len(raw) - 1 + len(head) + cols.hashes.shape[1]
    out = np.empty((n, width), np.uint8)
    out[:] = np.frombuffer(raw[:at_hash] + head + bytes(cols.hashes.shape[1]) + raw[at_hash + 1:], np.uint8)
    start = at_hash + len(head)
    out[:, start:start + cols.hashes.shape[1]] = cols.hashes
    out[:, at_group - 1 + len(head) + cols.hashes.shape[1]] = cols.groups
    return n, out.tobytes()


def removed(key_len: int, blob: bytes, form: HashForm = HashForm.INT) -> tuple[int, bytes]:
    """(events, bytes): one BlockRemoved per KV-cache group of the blob's keys, with their hashes."""
    if key_len <= GROUP_BYTES:
        return 0, b""
    cols = Columns(key_len, blob, form)
    groups = list(dict.fromkeys(cols.groups.tolist()))
    if not cols.fixed_width:
        values = cols.hash_values()
        by_group = [[h for h, g in zip(values, cols.groups.tolist()) if g == group] for group in groups]
        return len(groups), b"".join(_pack(_removed_map(hashes, group)) for hashes, group in zip(by_group, groups))
    raw, at_hash, at_group = _template(_removed_map([None], 127))
    head = _hash_header(form, cols.hash_len)
    parts = []
    for group in groups:
        rows = cols.hashes[cols.groups == group]
        cells = np.empty((len(rows), len(head) + rows.shape[1]), np.uint8)
        cells[:, :len(head)] = np.frombuffer(head, np.uint8)
        cells[:, len(head):] = rows
        parts += [raw[:at_hash - 1], _array_header(len(rows)), cells.tobytes(), raw[at_hash + 1:at_group],
                  bytes([group]), raw[at_group + 1:]]
    return len(groups), b"".join(parts)


def all_cleared() -> tuple[int, bytes]:
    return 1, _pack({"type": "AllBlocksCleared"})


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def batch(ts: float, events: list[tuple[int, bytes]], dp_rank: int | None = 0) -> bytes:
    """A KVEventBatch [ts, [events...], data_parallel_rank] of the encoded events, in order. The
    daemon's stream says data-parallel rank 0, as a vLLM engine without data parallelism does."""
    count = sum(n for n, _ in events)
    return b"".join([b"\x93\xcb", struct.pack(">d", ts), _array_header(count), *(raw for _, raw in events),
                     _pack(dp_rank)])

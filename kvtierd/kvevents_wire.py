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
import functools
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


@functools.lru_cache(maxsize=1)
def _removed_template() -> tuple[bytes, int, int]:
    return _template(_removed_map([None], 127))


class Columns:
    """A blob of keys seen as NumPy columns without a copy: the part of each hash an event names
    (the last 8 bytes as a big-endian integer, or the whole hash) and the group index."""

    def __init__(self, key_len: int, blob: bytes, form: HashForm):
        n = len(blob) // key_len
        self.blob, self.key_len = blob, key_len
        self.hash_len = key_len - GROUP_BYTES
        self.form = form
        if form is HashForm.INT:
            self.hash_dtype = np.dtype(">u8")
            self.hashes = np.ndarray((n,), ">u8", blob, max(0, self.hash_len - _INT_HASH_BYTES), (key_len,))
        else:
            self.hash_dtype = np.dtype((np.void, self.hash_len))
            self.hashes = np.ndarray((n,), self.hash_dtype, blob, 0, (key_len,))
        self.groups = np.ndarray((n,), ">u4", blob, self.hash_len, (key_len,))
        self.head = _hash_head(form, self.hash_len)

    @property
    def fixed_width(self) -> bool:
        """Whether every event's hash and group take the widths the templates have."""
        if self.form is HashForm.INT:
            # msgpack writes an int in its shortest form: 9 bytes only from 2**32 up, i.e. when
            # the first 4 of the 8 bytes are not all zero.
            n = len(self.groups)
            fits = self.hash_len >= _INT_HASH_BYTES and bool(
                np.ndarray((n,), "<u4", self.blob, self.hash_len - _INT_HASH_BYTES, (self.key_len,)).all())
        else:
            fits = 0 < self.hash_len < 256
        return fits and (not np.count_nonzero(self.groups) or int(self.groups.max()) < 128)

    def hash_values(self) -> list:
        """Each event's hash as Python values (the packing path: no fixed width)."""
        whole = np.ndarray((len(self.groups),), (np.void, self.hash_len), self.blob, 0, (self.key_len,)).tolist()
        if self.form is HashForm.INT:
            return [int.from_bytes(h[-_INT_HASH_BYTES:], "big") for h in whole]
        return whole

    @property
    def row_bytes(self) -> int:
        return len(_stored_row(self.form, self.hash_len)[0]) * len(self.groups)

    def write_rows(self, buf: memoryview, pos: int) -> None:
        """One BlockStored per key as fixed-width rows (``fixed_width``), written into ``buf`` at
        ``pos``: the row's bytes copied in doubling runs, then the hashes and groups put in place."""
        row, layout = _stored_row(self.form, self.hash_len)
        n, width = len(self.groups), len(row)
        region = buf[pos:pos + n * width]
        region[:width] = row
        filled = width
        while filled < len(region):
            step = min(filled, len(region) - filled)
            region[filled:filled + step] = region[:step]
            filled += step
        out = np.frombuffer(buf, layout, count=n, offset=pos)
        out["h"] = self.hashes
        out["g"] = self.groups


@functools.lru_cache(maxsize=16)
def _stored_row(form: HashForm, hash_len: int) -> tuple[bytes, np.dtype]:
    """BlockStored's bytes for a hash of this form and length, and where its hash and group go."""
    raw, at_hash, at_group = _template(_stored_map(None, 127), _STORED_HEADER)
    head = _hash_head(form, hash_len)
    width = _INT_HASH_BYTES if form is HashForm.INT else hash_len
    row = raw[:at_hash] + head + bytes(width) + raw[at_hash + 1:]
    layout = np.dtype({"names": ["h", "g"], "formats": [">u8" if form is HashForm.INT else (np.void, width), "u1"],
                       "offsets": [at_hash + len(head), at_group + len(head) + width - 1], "itemsize": len(row)})
    return row, layout


def _hash_head(form: HashForm, hash_len: int) -> bytes:
    """What precedes a hash on the wire: uint64, or bin8 and the length."""
    return b"\xcf" if form is HashForm.INT else b"\xc4" + bytes([hash_len])


class Batch:
    """One KVEventBatch being put together: events appended in order, their bytes written once,
    into one buffer, by ``payload``. It keeps the blobs it was given (not the encoded bytes), so
    that holding it for a replay costs the keys' bytes, and ``payload`` gives the same bytes again."""

    def __init__(self, form: HashForm = HashForm.INT):
        self.form = form
        self.count = 0                    # events
        self.nbytes = 0                   # bytes it holds (the blobs and packed parts)
        self._parts: list = []            # bytes, or Columns written as fixed-width BlockStored rows

    def stored(self, key_len: int, blob: bytes) -> None:
        """One BlockStored per key of the blob, in order."""
        if key_len <= GROUP_BYTES or not blob:
            return
        cols = Columns(key_len, blob, self.form)
        if cols.fixed_width:
            self._add(len(cols.groups), cols, len(blob))
        else:
            self._add(len(cols.groups), b"".join(_STORED_HEADER + _pack(_stored_map(h, g))[1:]
                                                 for h, g in zip(cols.hash_values(), cols.groups.tolist())))

    def removed(self, key_len: int, blob: bytes) -> None:
        """One BlockRemoved per KV-cache group of the blob's keys, with their hashes."""
        if key_len <= GROUP_BYTES or not blob:
            return
        cols = Columns(key_len, blob, self.form)
        groups = list(dict.fromkeys(cols.groups.tolist()))
        if not cols.fixed_width:
            values = cols.hash_values()
            for group in groups:
                hashes = [h for h, g in zip(values, cols.groups.tolist()) if g == group]
                self._add(1, _pack(_removed_map(hashes, group)))
            return
        raw, at_hash, at_group = _removed_template()
        cell = np.dtype({"names": ["m", "h"], "formats": ["S%d" % len(cols.head), cols.hash_dtype],
                         "offsets": [0, len(cols.head)], "itemsize": len(cols.head) + cols.hash_dtype.itemsize})
        for group in groups:
            hashes = cols.hashes if len(groups) == 1 else cols.hashes[cols.groups == group]
            cells = np.empty(len(hashes), cell)
            cells["m"] = cols.head
            cells["h"] = hashes
            self._add(1, b"".join([raw[:at_hash - 1], _array_header(len(hashes)), cells.tobytes(),
                                   raw[at_hash + 1:at_group], bytes([group]), raw[at_group + 1:]]))

    def all_cleared(self) -> None:
        self._add(1, _pack({"type": "AllBlocksCleared"}))

    def _add(self, count: int, part, nbytes: int | None = None) -> None:
        self.count += count
        self.nbytes += len(part) if nbytes is None else nbytes
        self._parts.append(part)

    def payload(self, ts: float, dp_rank: int | None = 0) -> memoryview:
        """The KVEventBatch [ts, [events...], data_parallel_rank]. The daemon's stream says
        data-parallel rank 0, as a vLLM engine without data parallelism does."""
        head = b"\x93\xcb" + struct.pack(">d", ts) + _array_header(self.count)
        tail = _pack(dp_rank)
        sizes = [part.row_bytes if isinstance(part, Columns) else len(part) for part in self._parts]
        # Every byte is written below: no zero-fill first (it was a fifth of a batch's cost).
        array = np.empty(len(head) + sum(sizes) + len(tail), np.uint8)
        buf = memoryview(array)
        buf[:len(head)] = head
        pos = len(head)
        for part, size in zip(self._parts, sizes):
            if isinstance(part, Columns):
                part.write_rows(buf, pos)
            else:
                buf[pos:pos + size] = part
            pos += size
        buf[pos:] = tail
        return buf


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")

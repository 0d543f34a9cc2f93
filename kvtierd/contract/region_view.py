"""A mapped region's bytes read and written: its tables as NumPy views (``RegionView``), the
namespace records, and the data file's header (``DataHeader``). The layout they follow is
``region_format``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .namespace import NamespaceId, Sharding
from .protocol import MAX_KEY_BYTES
from .region_format import (CHAIN_END, DATA_HEADER_DTYPE, DATA_MAGIC, ENTRY_DTYPE, FENCE_NONE, FORMAT_VERSION,
                            HEADER_BYTES, HEADER_DTYPE, MAGIC, NS_DTYPE, NS_SLOTS, WRITER_DTYPE, WRITER_SLOTS,
                            FormatError, Geometry, read_geometry)
from .region_sums import namespace_record_sums

_SHARDING_CODES = {Sharding.REPLICATED: 0, Sharding.SHARDED: 1}
_SHARDING_OF_CODE = {v: k for k, v in _SHARDING_CODES.items()}
_NS_FIELDS = tuple(dataclasses.fields(NamespaceId))
assert {f.name for f in _NS_FIELDS} <= set(NS_DTYPE.names), "every field of NamespaceId needs its column"


def namespace_record(ns: NamespaceId, flags: int = 0) -> np.void:
    """The namespace table record of ``ns`` (a row of NS_DTYPE, in use, its record_sum set)."""
    rec = np.zeros((), NS_DTYPE)[()]   # a record (np.void), like a row of the table
    rec["in_use"] = 1
    for f in _NS_FIELDS:
        value = getattr(ns, f.name)
        if isinstance(value, Sharding):
            rec[f.name] = _SHARDING_CODES[value]
        else:
            rec[f.name] = value.encode() if isinstance(value, str) else value
    rec["flags"] = flags
    rec["record_sum"] = namespace_record_sums(np.asarray(rec).reshape(1))[0]
    return rec


def namespace_from_record(rec: np.void) -> NamespaceId:
    """The NamespaceId a record holds (KeyError, ValueError, UnicodeDecodeError when damaged)."""
    values = {}
    for f in _NS_FIELDS:
        raw = rec[f.name]
        if f.type == "Sharding":
            values[f.name] = _SHARDING_OF_CODE[int(raw)]
        else:
            values[f.name] = bytes(raw).decode() if f.type == "str" else int(raw)
    return NamespaceId(**values)


class RegionView:
    """NumPy views of a region's parts: the tables of its mapped metadata file and, when given,
    the pages of its mapped data file. Holds no state beyond the views."""

    def __init__(self, meta, data=None, geometry: Geometry | None = None):
        raw = np.frombuffer(meta, dtype=np.uint8)
        if len(raw) < HEADER_BYTES:
            raise FormatError(f"metadata file is {len(raw)} bytes, too short for a kvtierd header")
        self.header = raw[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
        geo = geometry or read_geometry(raw)
        if len(raw) < geo.meta_bytes:
            raise FormatError(f"metadata file is {len(raw)} bytes; its header says {geo.meta_bytes}")
        self.geometry = geo
        self.raw = raw
        self.namespaces = raw[geo.ns_offset:geo.entry_offset].view(NS_DTYPE)
        self.entries = raw[geo.entry_offset:geo.chain_offset].view(ENTRY_DTYPE)
        self.chain = raw[geo.chain_offset:geo.writer_offset].view("<u4")
        self.writers = raw[geo.writer_offset:geo.fence_offset].view(WRITER_DTYPE)
        self.fence = raw[geo.fence_offset:geo.fence_offset + 4 * geo.num_pages].view("<u4")
        self.data_file: np.ndarray | None = None   # the whole data file, when given
        self.data: np.ndarray | None = None        # its data area (page 0 first)
        if data is not None:
            self.attach_data(data)

    def attach_data(self, data) -> None:
        """View the pages of a mapped data file (``data``: its whole buffer)."""
        geo = self.geometry
        whole = np.frombuffer(data, dtype=np.uint8)
        if len(whole) < geo.data_bytes:
            raise FormatError(f"data file is {len(whole)} bytes; the region's header says {geo.data_bytes}")
        self.data_file = whole
        self.data = whole[geo.data_offset:geo.data_bytes]

    def format(self, generation: int, created_unix_ns: int) -> None:
        """Write a fresh, empty region's metadata: header, empty tables (state FREE everywhere)."""
        geo = self.geometry
        self.namespaces[:] = np.zeros((), NS_DTYPE)
        self.entries[:] = np.zeros((), ENTRY_DTYPE)
        self.chain[:] = CHAIN_END
        self.writers[:] = np.zeros((), WRITER_DTYPE)
        self.fence[:] = FENCE_NONE
        h = self.header
        h["magic"] = MAGIC
        h["version"] = FORMAT_VERSION
        h["header_bytes"] = HEADER_BYTES
        h["meta_bytes"] = geo.meta_bytes
        h["page_size"] = geo.page_size
        h["num_pages"] = geo.num_pages
        h["ns_offset"] = geo.ns_offset
        h["ns_slots"] = NS_SLOTS
        h["entry_offset"] = geo.entry_offset
        h["entry_slots"] = geo.entry_slots
        h["chain_offset"] = geo.chain_offset
        h["writer_offset"] = geo.writer_offset
        h["writer_slots"] = WRITER_SLOTS
        h["fence_offset"] = geo.fence_offset
        h["data_offset"] = geo.data_offset
        h["data_bytes"] = geo.data_bytes
        h["generation"] = generation
        h["clean_shutdown"] = 0
        h["max_key_bytes"] = MAX_KEY_BYTES
        h["created_unix_ns"] = created_unix_ns
        h["tick"] = 0

    def clear_entries(self) -> None:
        """Forget every entry and every writer row and page fence (the pages they were about are
        gone: a new data file replaces them); the namespaces stay."""
        self.entries[:] = np.zeros((), ENTRY_DTYPE)
        self.chain[:] = CHAIN_END
        self.writers[:] = np.zeros((), WRITER_DTYPE)
        self.fence[:] = FENCE_NONE

    def entry_key(self, slot: int) -> bytes:
        rec = self.entries[slot]
        return bytes(rec["key"][: rec["key_len"]])

    def chain_of(self, slot: int) -> np.ndarray:
        """The pages of one entry, walking its chain; raises FormatError on a broken chain."""
        rec = self.entries[slot]
        count = int(rec["page_count"])
        pages = np.empty(count, dtype=np.uint32)
        page = int(rec["first_page"])
        for i in range(count):
            if page >= self.geometry.num_pages:
                raise FormatError(f"entry {slot}: chain leaves the data area at link {i}")
            pages[i] = page
            page = int(self.chain[page])
        if page != CHAIN_END:
            raise FormatError(f"entry {slot}: chain longer than its page_count {count}")
        return pages

    def write_chain(self, pages: np.ndarray) -> None:
        """Link ``pages`` in order (vectorised): chain[p_i] = p_{i+1}, chain[p_last] = CHAIN_END.
        A 2-D array links each row as one entry's chain."""
        self.chain[pages[..., :-1]] = pages[..., 1:]
        self.chain[pages[..., -1]] = CHAIN_END



# --- the data file's header --------------------------------------------------------------------
@dataclass(frozen=True)
class DataHeader:
    """What the data file says of itself: the generation and geometry it was made for."""

    generation: int
    page_size: int
    num_pages: int
    data_offset: int
    data_bytes: int

    def to_bytes(self) -> bytes:
        rec = np.zeros(1, DATA_HEADER_DTYPE)
        rec[["magic", "version"]] = (DATA_MAGIC, FORMAT_VERSION)
        for name in ("generation", "page_size", "num_pages", "data_offset", "data_bytes"):
            rec[name] = getattr(self, name)
        return rec.tobytes().ljust(HEADER_BYTES, b"\0")

    @classmethod
    def of(cls, geo: Geometry, generation: int) -> "DataHeader":
        return cls(generation, geo.page_size, geo.num_pages, geo.data_offset, geo.data_bytes)

    @classmethod
    def read(cls, head: bytes | np.ndarray) -> "DataHeader":
        """Parse a data file's first bytes (raises FormatError when they are not a data header of
        this format version)."""
        head = bytes(head[:DATA_HEADER_DTYPE.itemsize])
        if len(head) < DATA_HEADER_DTYPE.itemsize:
            raise FormatError("data file is too short for its header")
        rec = np.frombuffer(head, DATA_HEADER_DTYPE)[0]
        if bytes(rec["magic"]) != DATA_MAGIC:
            if bytes(rec["magic"]).ljust(8, b"\0") == MAGIC:
                raise FormatError(f"a region of format version {int(rec['version'])} (metadata and pages in one "
                                  "file); this kvtierd keeps them in two files")
            raise FormatError("bad magic: not a kvtierd data file")
        if int(rec["version"]) != FORMAT_VERSION:
            raise FormatError(f"data file format version {int(rec['version'])}; this kvtierd reads {FORMAT_VERSION}")
        return cls(int(rec["generation"]), int(rec["page_size"]), int(rec["num_pages"]), int(rec["data_offset"]),
                   int(rec["data_bytes"]))

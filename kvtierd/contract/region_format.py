"""The region file's on-memory format: the one place that defines its bytes.

Both the daemon (which owns and writes the metadata) and the clients (which only read and write
page data) import this module; `kvtierctl` reads a region file offline with it. Judging what a
region's tables hold (what a restart keeps) is ``kvtierd.recovery``.

Byte layout of a region file (all integers little-endian)::

    offset 0              header          one HEADER_DTYPE record, padded to HEADER_BYTES (4 KiB)
    ns_offset             namespace table NS_SLOTS records of NS_DTYPE (512 B each)
    entry_offset          entry table     entry_slots records of ENTRY_DTYPE (128 B each)
    chain_offset          chain table     num_pages uint32: next page of the same entry, or CHAIN_END
    writer_offset         writer table    WRITER_SLOTS records of WRITER_DTYPE (128 B each)
    fence_offset          fence table     num_pages uint32: the writer row that holds the page, or
                                          FENCE_NONE
    data_offset           data area       num_pages pages of page_size bytes; data_offset is a
                                          multiple of DATA_ALIGN (2 MiB) so that pages line up with
                                          huge pages and with cudaHostRegister chunk boundaries

An entry (one cached block of one namespace) owns ``page_count`` pages, not necessarily
contiguous: ``first_page`` and then ``chain[page]`` until CHAIN_END. Its logical bytes are the
concatenation of its pages' bytes (the tail of the last page is unused). In a sharded namespace
the chain holds ``world_size`` equal runs of ``pages_per_shard`` pages, rank r's shard being
run r. There is one entry slot per page because every entry takes at least one page.

Entry ``state`` is written last when an entry becomes READY, and first when it is freed, so a
reader of the table (a restarted daemon, ``kvtierctl check``) never takes a half-written record
for a ready one: invariant 1 ("never serve a torn block") holds across crashes.

The writer and fence tables hold the page fence across the daemon's restarts (invariant 9,
``kvtierd.fence``): a row per writer session (a process that is handed pages to copy into),
saying how a restarted daemon proves that process gone (pid, PID namespace, start time, boot) or
recognises it when it re-attaches (session id and token); and per page the row of the writer
that may still copy into it. A row is written (state last) before any page names it, and every
page naming it is cleared before the row is freed.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import numpy as np
import xxhash

from .namespace import MAX_DTYPE_BYTES, MAX_MODEL_BYTES, NamespaceId, Sharding
from .protocol import MAX_KEY_BYTES

MAGIC = b"KVTIERD\x00"
# 2: the writer and fence tables (the page fence across restarts) before the data area.
FORMAT_VERSION = 2
HEADER_BYTES = 4096
NS_SLOTS = 1024
WRITER_SLOTS = 4096           # writer sessions attached, plus writers gone whose pages are still fenced
DATA_ALIGN = 2 * 1024 * 1024
CHAIN_END = 0xFFFFFFFF
FENCE_NONE = 0xFFFFFFFF       # the page is fenced by no writer
MIN_PAGE_SIZE = 4096
MAX_PAGES = CHAIN_END - 1  # page indices are uint32 and CHAIN_END is reserved


class EntryState(enum.IntEnum):
    FREE = 0
    WRITING = 1   # pages allocated, the writer's copy or some votes are outstanding
    READY = 2     # every rank voted after the copy completed: visible to lookup and load


class WriterState(enum.IntEnum):
    FREE = 0
    ATTACHED = 1  # its session is live
    DETACHED = 2  # its session ended; pages it was handed are still fenced


HEADER_DTYPE = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("header_bytes", "<u4"),
    ("file_bytes", "<u8"),
    ("page_size", "<u8"),
    ("num_pages", "<u8"),
    ("ns_offset", "<u8"),
    ("ns_slots", "<u8"),
    ("entry_offset", "<u8"),
    ("entry_slots", "<u8"),
    ("chain_offset", "<u8"),
    ("data_offset", "<u8"),
    ("generation", "<u8"),      # random id; changes whenever the region is (re)built
    ("clean_shutdown", "<u4"),  # 1 after a clean stop, 0 while a daemon runs or after a crash
    ("max_key_bytes", "<u4"),
    ("created_unix_ns", "<u8"),
    ("tick", "<u8"),            # the daemon's access clock when it last stopped
    ("writer_offset", "<u8"),
    ("writer_slots", "<u8"),
    ("fence_offset", "<u8"),
])

# One NamespaceId per record: a column per field of the identity (namespace_record).
NS_DTYPE = np.dtype([
    ("in_use", "u1"),
    ("sharding", "u1"),         # 0 replicated, 1 sharded
    ("_pad", "<u2"),
    ("world_size", "<u4"),      # part of a sharded namespace's identity; 0 for replicated
    ("block_tokens", "<u4"),
    ("_pad2", "<u4"),
    ("block_bytes", "<u8"),     # bytes one rank holds of one block
    ("model", f"S{MAX_MODEL_BYTES}"),
    ("dtype", f"S{MAX_DTYPE_BYTES}"),
    ("_reserved", "V200"),
])

ENTRY_DTYPE = np.dtype([
    ("state", "u1"),
    ("key_len", "u1"),
    ("ns", "<u2"),              # namespace table slot
    ("page_count", "<u4"),
    ("first_page", "<u4"),
    ("_pad", "<u4"),
    ("length", "<u8"),          # logical bytes of the entry (all shards)
    ("tick", "<u8"),            # last access, on the daemon's access clock
    ("checksum", "<u8"),        # 0 when checksums are off
    ("key", "u1", (MAX_KEY_BYTES,)),
    ("_reserved", "V24"),
])

# One writer session: how a restarted daemon proves its process gone, or knows it again.
WRITER_DTYPE = np.dtype([
    ("state", "u1"),            # WriterState, written last when a row is taken
    ("_pad", "u1"),
    ("rank", "<u2"),
    ("pid", "<u4"),             # in the PID namespace ``pidns``; 0: the daemon could not see the process
    ("pidns", "<u8"),           # inode of the daemon's PID namespace when it recorded ``pid``
    ("start_ticks", "<u8"),     # /proc/<pid>/stat starttime: tells the writer from a later process with its pid
    ("boot", "<u8"),            # 64 bits of the boot id: every writer of another boot is dead
    ("token", "<u8"),           # the session's token: a hello naming (session, token) settles the row
    ("session", "<u8"),
    ("last_seen", "<f8"),       # CLOCK_MONOTONIC seconds of its last proof of life (the grace counts from it)
    ("engine", "S64"),          # the engine id, cut to 64 bytes (diagnostics)
    ("_reserved", "V8"),
])

assert HEADER_DTYPE.itemsize <= HEADER_BYTES
assert NS_DTYPE.itemsize == 512, NS_DTYPE.itemsize
assert ENTRY_DTYPE.itemsize == 128, ENTRY_DTYPE.itemsize
assert WRITER_DTYPE.itemsize == 128, WRITER_DTYPE.itemsize

_SHARDING_CODES = {Sharding.REPLICATED: 0, Sharding.SHARDED: 1}
_SHARDING_OF_CODE = {v: k for k, v in _SHARDING_CODES.items()}
_NS_FIELDS = tuple(dataclasses.fields(NamespaceId))
assert {f.name for f in _NS_FIELDS} <= set(NS_DTYPE.names), "every field of NamespaceId needs its column"


class FormatError(Exception):
    """The bytes are not a kvtierd region of this format version."""


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Geometry:
    """Where everything lives in a region file of a given size and page size."""

    file_bytes: int
    page_size: int
    num_pages: int
    ns_offset: int
    entry_offset: int
    chain_offset: int
    writer_offset: int
    fence_offset: int
    data_offset: int

    @property
    def entry_slots(self) -> int:
        return self.num_pages

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def for_pages(cls, num_pages: int, page_size: int) -> "Geometry":
        ns_offset = HEADER_BYTES
        entry_offset = ns_offset + NS_SLOTS * NS_DTYPE.itemsize
        chain_offset = entry_offset + num_pages * ENTRY_DTYPE.itemsize
        writer_offset = chain_offset + num_pages * 4
        fence_offset = writer_offset + WRITER_SLOTS * WRITER_DTYPE.itemsize
        data_offset = _round_up(fence_offset + num_pages * 4, DATA_ALIGN)
        return cls(data_offset + num_pages * page_size, page_size, num_pages,
                   ns_offset, entry_offset, chain_offset, writer_offset, fence_offset, data_offset)

    @classmethod
    def for_size(cls, size_bytes: int, page_size: int) -> "Geometry":
        """The largest geometry whose file is at most ``size_bytes``."""
        if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
            raise ValueError(f"page size {page_size} must be a power of two >= {MIN_PAGE_SIZE}")
        per_page = page_size + ENTRY_DTYPE.itemsize + 4 + 4       # page, entry record, chain and fence links
        fixed = (HEADER_BYTES + NS_SLOTS * NS_DTYPE.itemsize + WRITER_SLOTS * WRITER_DTYPE.itemsize
                 + DATA_ALIGN)                                       # worst-case padding
        num_pages = max(0, min((size_bytes - fixed) // per_page, MAX_PAGES))
        # That bound assumed the worst-case alignment padding; take the pages the real padding leaves
        # (at most DATA_ALIGN / page_size + 1 more).
        while num_pages < MAX_PAGES and cls.for_pages(num_pages + 1, page_size).file_bytes <= size_bytes:
            num_pages += 1
        if num_pages < 1:
            raise ValueError(f"a region of {size_bytes} bytes cannot hold one {page_size}-byte page "
                             f"plus its {fixed}-byte metadata; raise the size")
        geo = cls.for_pages(num_pages, page_size)
        assert geo.file_bytes <= size_bytes
        return geo

    @classmethod
    def from_header(cls, header: np.void) -> "Geometry":
        geo = cls.for_pages(int(header["num_pages"]), int(header["page_size"]))
        recorded = (int(header["file_bytes"]), int(header["ns_offset"]), int(header["entry_offset"]),
                    int(header["chain_offset"]), int(header["writer_offset"]), int(header["fence_offset"]),
                    int(header["data_offset"]))
        if recorded != (geo.file_bytes, geo.ns_offset, geo.entry_offset, geo.chain_offset, geo.writer_offset,
                        geo.fence_offset, geo.data_offset):
            raise FormatError("header geometry is inconsistent (offsets do not match page count and size)")
        return geo


def namespace_record(ns: NamespaceId) -> np.void:
    """The namespace table record of ``ns`` (a row of NS_DTYPE, in use)."""
    rec = np.zeros((), NS_DTYPE)[()]   # a record (np.void), like a row of the table
    rec["in_use"] = 1
    for f in _NS_FIELDS:
        value = getattr(ns, f.name)
        if isinstance(value, Sharding):
            rec[f.name] = _SHARDING_CODES[value]
        else:
            rec[f.name] = value.encode() if isinstance(value, str) else value
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


def shard_checksum(data: np.ndarray, pages: np.ndarray, page_size: int, nbytes: int) -> int:
    """xxh64 of one shard's logical bytes: the first ``nbytes`` bytes of ``pages`` in order.

    ``data`` is the region's data area as uint8. Writers compute it after their copy; recovery
    and ``kvtierctl check --checksums`` recompute it from the pages.
    """
    h = xxhash.xxh64()
    for i, page in enumerate(pages.tolist()):
        n = min(page_size, nbytes - i * page_size)
        if n <= 0:
            break
        start = page * page_size
        h.update(data[start:start + n])
    return h.intdigest()


def entry_checksum(shard_sums: list[int]) -> int:
    """One entry's checksum from its shards' (rank order); never 0, which means "none"."""
    if len(shard_sums) == 1:
        value = shard_sums[0]
    else:
        value = xxhash.xxh64_intdigest(np.asarray(shard_sums, dtype="<u8").tobytes())
    return value or 1


class RegionView:
    """NumPy views of a mapped region's parts. Holds no state beyond the views."""

    def __init__(self, buffer, geometry: Geometry | None = None):
        raw = np.frombuffer(buffer, dtype=np.uint8)
        if len(raw) < HEADER_BYTES:
            raise FormatError(f"region file is {len(raw)} bytes, too short for a kvtierd header")
        self.header = raw[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
        geo = geometry or read_geometry(raw)
        if len(raw) < geo.file_bytes:
            raise FormatError(f"region file is {len(raw)} bytes; its header says {geo.file_bytes}")
        self.geometry = geo
        self.raw = raw
        self.namespaces = raw[geo.ns_offset:geo.entry_offset].view(NS_DTYPE)
        self.entries = raw[geo.entry_offset:geo.chain_offset].view(ENTRY_DTYPE)
        self.chain = raw[geo.chain_offset:geo.writer_offset].view("<u4")
        self.writers = raw[geo.writer_offset:geo.fence_offset].view(WRITER_DTYPE)
        self.fence = raw[geo.fence_offset:geo.fence_offset + 4 * geo.num_pages].view("<u4")
        self.data = raw[geo.data_offset:geo.file_bytes]

    def format(self, generation: int, created_unix_ns: int) -> None:
        """Write a fresh, empty region: header, empty tables (state FREE everywhere)."""
        geo = self.geometry
        self.namespaces[:] = np.zeros((), NS_DTYPE)
        self.entries["state"] = EntryState.FREE
        self.chain[:] = CHAIN_END
        self.writers[:] = np.zeros((), WRITER_DTYPE)
        self.fence[:] = FENCE_NONE
        h = self.header
        h["magic"] = MAGIC
        h["version"] = FORMAT_VERSION
        h["header_bytes"] = HEADER_BYTES
        h["file_bytes"] = geo.file_bytes
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
        h["generation"] = generation
        h["clean_shutdown"] = 0
        h["max_key_bytes"] = MAX_KEY_BYTES
        h["created_unix_ns"] = created_unix_ns
        h["tick"] = 0

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


def read_geometry(raw: np.ndarray) -> Geometry:
    """Validate a region's header bytes and return its geometry (raises FormatError)."""
    if len(raw) < HEADER_BYTES:
        raise FormatError(f"file of {len(raw)} bytes is too short for a kvtierd header")
    header = raw[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
    if bytes(header["magic"]).ljust(8, b"\0") != MAGIC:
        raise FormatError("bad magic: not a kvtierd region file")
    if int(header["version"]) != FORMAT_VERSION:
        raise FormatError(f"region format version {int(header['version'])}; this kvtierd reads {FORMAT_VERSION}")
    if (int(header["max_key_bytes"]) != MAX_KEY_BYTES or int(header["ns_slots"]) != NS_SLOTS
            or int(header["writer_slots"]) != WRITER_SLOTS):
        raise FormatError("region was written with different table limits")
    try:
        return Geometry.from_header(header)
    except ValueError as exc:
        raise FormatError(str(exc)) from None

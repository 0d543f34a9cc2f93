"""The region's on-memory format: the one place that defines its layout.

Its constants, its records' dtypes and where each table lives (``Geometry``). Reading and writing
those bytes in a mapped region is ``region_view`` (the tables, the namespace records, the data
file's header), their integrity sums ``region_sums``; both the daemon (which owns and writes the
metadata) and the clients (which only read and write page data) import them, and `kvtierctl`
reads a region offline with them. Judging what a region's tables hold (what a restart keeps) is
``kvtierd.recovery``.

A region is two files (all integers little-endian)::

    <name>.meta   mode 0600: the daemon's user alone. Every table the daemon keeps:
        offset 0              header          one HEADER_DTYPE record, padded to HEADER_BYTES (4 KiB)
        ns_offset             namespace table NS_SLOTS records of NS_DTYPE (512 B each)
        entry_offset          entry table     entry_slots records of ENTRY_DTYPE (128 B each)
        chain_offset          chain table     num_pages uint32: next page of the same entry, or CHAIN_END
        writer_offset         writer table    WRITER_SLOTS records of WRITER_DTYPE (128 B each)
        fence_offset          fence table     num_pages uint32: the writer row that holds the page, or
                                              FENCE_NONE
        meta_bytes            (the file's size: the tables' end, rounded up to 4 KiB)

    <name>.region mode 0660, the client group: what clients map, the pages only.
        offset 0              data header     one DATA_HEADER_DTYPE record: magic, generation, geometry
        data_offset           data area       num_pages pages of page_size bytes; data_offset is
                                              DATA_ALIGN (2 MiB) so that pages line up with huge pages
                                              and with cudaHostRegister chunk boundaries
        data_bytes            (the file's size)

Why two files: every member of the client group can write the file it maps (a copy into a page
is a write), so it can also truncate it. Metadata in that file could be edited or truncated under
the daemon by any client (a SIGBUS in the daemon). In a file of its own, no client can touch it;
the daemon touches the data file only at start (prefault, pinning, the checksum check of
recovery) and writes its header with ``pwrite``, so a data file truncated while it serves cannot
kill the daemon. docs/design.md has the alternatives weighed.

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
page naming it is cleared before the row is freed. They are metadata like the others: in the
daemon's file, out of every client's reach.

Records carry their own integrity check (``record_sum``, computed by ``region_sums``): a namespace record's
covers its fields; an entry record's covers every field but ``state`` and ``tick``, its whole
page chain and its namespace's identity, and is zeroed when the entry is freed. So a revived
stale record, an edited page number, chain link, namespace slot or data checksum is caught at
recovery and by ``kvtierctl check`` (it detects damage; it is no signature against someone who
can write the metadata file, i.e. the daemon's user). Only READY records carry a sum: a WRITING
record's is zero, and nothing a restart does with a WRITING record depends on it (its pages are
freed, or stay fenced by the fence table's word alone). Whether a namespace's entries carry data
checksums is a flag of the namespace record (``NS_CHECKSUMS``), not a zero in the entry. Ticks
are validated on their own: below TICK_LIMIT.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from .namespace import MAX_DTYPE_BYTES, MAX_MODEL_BYTES
from .protocol import MAX_KEY_BYTES

MAGIC = b"KVTIERD\x00"           # the metadata file's header
DATA_MAGIC = b"KVTIERDP"          # the data file's header (P: pages)
# 2: metadata and pages in two files; record checksums; the namespace's checksum flag; the writer
#    and fence tables (the page fence across restarts) in the metadata file.
FORMAT_VERSION = 2
HEADER_BYTES = 4096
NS_SLOTS = 1024
WRITER_SLOTS = 4096           # writer sessions attached, plus writers gone whose pages are still fenced
DATA_ALIGN = 2 * 1024 * 1024
CHAIN_END = 0xFFFFFFFF
FENCE_NONE = 0xFFFFFFFF       # the page is fenced by no writer
MIN_PAGE_SIZE = 4096
MAX_PAGES = CHAIN_END - 1  # page indices are uint32 and CHAIN_END is reserved
# Ticks count access events (one per request at most): 2^62 of them is beyond any daemon's life,
# so a record at or above it is damaged, and the clock can never overflow its uint64 column.
TICK_LIMIT = 1 << 62
NS_CHECKSUMS = 1          # namespace flag: every entry of it carries a data checksum


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
    ("meta_bytes", "<u8"),      # this file's size
    ("page_size", "<u8"),
    ("num_pages", "<u8"),
    ("ns_offset", "<u8"),
    ("ns_slots", "<u8"),
    ("entry_offset", "<u8"),
    ("entry_slots", "<u8"),
    ("chain_offset", "<u8"),
    ("data_offset", "<u8"),     # where page 0 starts in the data file
    ("generation", "<u8"),      # random id; changes whenever the region is (re)built
    ("clean_shutdown", "<u4"),  # 1 after a clean stop, 0 while a daemon runs or after a crash
    ("max_key_bytes", "<u4"),
    ("created_unix_ns", "<u8"),
    ("tick", "<u8"),            # the daemon's access clock when it last stopped
    ("data_bytes", "<u8"),      # the data file's size
    ("writer_offset", "<u8"),
    ("writer_slots", "<u8"),
    ("fence_offset", "<u8"),
])

# The data file's first bytes: enough for a client to know it maps the file the daemon announced.
DATA_HEADER_DTYPE = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("_pad", "<u4"),
    ("generation", "<u8"),      # the metadata header's, written by the daemon at start
    ("page_size", "<u8"),
    ("num_pages", "<u8"),
    ("data_offset", "<u8"),
    ("data_bytes", "<u8"),
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
    ("record_sum", "<u8"),      # record_sums over the record (this field zero); never 0 when in use
    ("flags", "<u4"),           # NS_CHECKSUMS
    ("_pad3", "<u4"),
    ("_reserved", "V184"),
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
    ("checksum", "<u8"),        # of the entry's bytes (entry_checksum), when its namespace has NS_CHECKSUMS
    ("key", "u1", (MAX_KEY_BYTES,)),
    ("record_sum", "<u8"),      # entry_record_sums; 0 (never a valid sum) unless READY
    ("_reserved", "V16"),
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


class FormatError(Exception):
    """The bytes are not a kvtierd region of this format version."""


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Geometry:
    """Where everything lives in a region of a given size and page size: the metadata file's
    tables (the metadata area: every table the daemon keeps goes here) and the data file's pages."""

    page_size: int
    num_pages: int
    ns_offset: int
    entry_offset: int
    chain_offset: int
    writer_offset: int
    fence_offset: int
    meta_bytes: int             # the metadata file's size
    data_offset: int            # page 0 in the data file
    data_bytes: int             # the data file's size

    @property
    def entry_slots(self) -> int:
        return self.num_pages

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        """Both files: what the ``size`` setting bounds."""
        return self.meta_bytes + self.data_bytes

    @classmethod
    def for_pages(cls, num_pages: int, page_size: int) -> "Geometry":
        ns_offset = HEADER_BYTES
        entry_offset = ns_offset + NS_SLOTS * NS_DTYPE.itemsize
        chain_offset = entry_offset + num_pages * ENTRY_DTYPE.itemsize
        writer_offset = chain_offset + num_pages * 4
        fence_offset = writer_offset + WRITER_SLOTS * WRITER_DTYPE.itemsize
        meta_bytes = _round_up(fence_offset + num_pages * 4, HEADER_BYTES)
        data_offset = DATA_ALIGN
        return cls(page_size, num_pages, ns_offset, entry_offset, chain_offset, writer_offset, fence_offset,
                   meta_bytes, data_offset, data_offset + num_pages * page_size)

    @classmethod
    def for_size(cls, size_bytes: int, page_size: int) -> "Geometry":
        """The largest geometry whose two files together are at most ``size_bytes``."""
        if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
            raise ValueError(f"page size {page_size} must be a power of two >= {MIN_PAGE_SIZE}")
        per_page = page_size + ENTRY_DTYPE.itemsize + 4 + 4       # page, entry record, chain and fence links
        fixed = (HEADER_BYTES + NS_SLOTS * NS_DTYPE.itemsize + WRITER_SLOTS * WRITER_DTYPE.itemsize
                 + HEADER_BYTES + DATA_ALIGN)                        # worst-case rounding
        num_pages = max(0, min((size_bytes - fixed) // per_page, MAX_PAGES))
        # That bound assumed the worst-case rounding of the metadata file; take the pages the real
        # rounding leaves (a few more at most).
        while num_pages < MAX_PAGES and cls.for_pages(num_pages + 1, page_size).total_bytes <= size_bytes:
            num_pages += 1
        if num_pages < 1:
            raise ValueError(f"a region of {size_bytes} bytes cannot hold one {page_size}-byte page "
                             f"plus its {fixed}-byte metadata; raise the size")
        geo = cls.for_pages(num_pages, page_size)
        assert geo.total_bytes <= size_bytes
        return geo

    @classmethod
    def from_header(cls, header: np.void) -> "Geometry":
        geo = cls.for_pages(int(header["num_pages"]), int(header["page_size"]))
        recorded = (int(header["meta_bytes"]), int(header["ns_offset"]), int(header["entry_offset"]),
                    int(header["chain_offset"]), int(header["writer_offset"]), int(header["fence_offset"]),
                    int(header["data_offset"]), int(header["data_bytes"]))
        if recorded != (geo.meta_bytes, geo.ns_offset, geo.entry_offset, geo.chain_offset, geo.writer_offset,
                        geo.fence_offset, geo.data_offset, geo.data_bytes):
            raise FormatError("header geometry is inconsistent (offsets do not match page count and size)")
        return geo


def read_geometry(raw: np.ndarray) -> Geometry:
    """Validate a metadata file's header bytes and return its geometry (raises FormatError)."""
    if len(raw) < HEADER_BYTES:
        raise FormatError(f"file of {len(raw)} bytes is too short for a kvtierd header")
    header = raw[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0]
    if bytes(header["magic"]).ljust(8, b"\0") != MAGIC:
        raise FormatError("bad magic: not a kvtierd metadata file")
    if int(header["version"]) != FORMAT_VERSION:
        raise FormatError(f"region format version {int(header['version'])}; this kvtierd reads {FORMAT_VERSION}")
    if (int(header["max_key_bytes"]) != MAX_KEY_BYTES or int(header["ns_slots"]) != NS_SLOTS
            or int(header["writer_slots"]) != WRITER_SLOTS):
        raise FormatError("region was written with different table limits")
    try:
        return Geometry.from_header(header)
    except ValueError as exc:
        raise FormatError(str(exc)) from None

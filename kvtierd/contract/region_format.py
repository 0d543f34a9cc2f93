"""The region's on-memory format: the one place that defines its bytes.

Both the daemon (which owns and writes the metadata) and the clients (which only read and write
page data) import this module; `kvtierctl` reads a region offline with it. Judging what a
region's tables hold (what a restart keeps) is ``kvtierd.recovery``.

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

Records carry their own integrity check (``record_sum``, ``record_sums``): a namespace record's
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

import dataclasses
import enum
from dataclasses import dataclass

import numpy as np
import xxhash

from .namespace import MAX_DTYPE_BYTES, MAX_MODEL_BYTES, NamespaceId, Sharding
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


# --- record checksums -----------------------------------------------------------------------
# A sum of one bijective mix per 64-bit word and position (multiply by an odd constant of the
# position, xor-shift, multiply): changing any one word (a byte, a field, a page number) always
# changes the sum; several changes cancel with odds of ~2^-64. It detects damage and stale
# records, for a whole job's records (or a whole table at recovery) in a few NumPy passes (a
# store job's entries: ~10 passes, a few µs); it is no keyed MAC. uint64 arrays wrap silently.
_MIX = np.uint64(0x94D049BB133111EB)
_S32 = np.uint64(32)
_positions = np.zeros(0, dtype=np.uint64)


def _position_constants(end: int) -> np.ndarray:
    """Distinct odd multipliers for word positions 0..end-1 (golden-ratio steps, forced odd)."""
    global _positions
    if len(_positions) < end:
        _positions = (np.arange(1, max(end, 1024) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) \
            | np.uint64(1)
    return _positions[:end]


def _mix_sum(words: np.ndarray) -> np.ndarray:
    """Σ_i mix_i(words[:, i]) mod 2^64 per row of uint64 words, never 0 (0 means "no valid
    record"). ``words`` is overwritten."""
    words *= _position_constants(words.shape[1])
    words ^= words >> _S32
    words *= _MIX
    return np.maximum(words.sum(axis=1, dtype=np.uint64), np.uint64(1))


def _word_mask(dtype: np.dtype, fields: tuple[str, ...]) -> np.ndarray:
    """uint64 words over a record of ``dtype``: all ones but the bytes of ``fields``."""
    mask = np.full(dtype.itemsize, 0xFF, dtype=np.uint8)
    for name in fields:
        field_dtype, offset = dtype.fields[name][:2]
        mask[offset:offset + field_dtype.itemsize] = 0
    return mask.view("<u8")


def _words(records: np.ndarray, mask: np.ndarray, extra: int = 0) -> np.ndarray:
    """The records (structured, or one row of bytes each) as rows of uint64 words ANDed with
    ``mask``, followed by ``extra`` words for the caller to fill."""
    n, width = len(records), len(mask)
    words = np.empty((n, width + extra), dtype=np.uint64)
    np.bitwise_and(np.ascontiguousarray(records).view("<u8").reshape(n, width), mask, out=words[:, :width])
    return words


_NS_SUMMED = _word_mask(NS_DTYPE, ("record_sum",))
_NS_IDENTITY = _word_mask(NS_DTYPE, ("in_use", "record_sum", "flags"))
# An entry record's sum leaves out the bytes that change without the entry changing: state (written
# last, after the sum) and tick (every access).
ENTRY_SUMMED = _word_mask(ENTRY_DTYPE, ("state", "tick", "record_sum"))
_ENTRY_WORDS = len(ENTRY_SUMMED)


def namespace_record_sums(records: np.ndarray) -> np.ndarray:
    """The record_sum of NS_DTYPE records: over every byte but record_sum's."""
    return _mix_sum(_words(records, _NS_SUMMED))


def namespace_identities(records: np.ndarray) -> np.ndarray:
    """A digest of each NS_DTYPE record's identity fields (not in_use, flags, record_sum), which
    every entry's record_sum covers: swapping namespace records moves no entry."""
    return _mix_sum(_words(records, _NS_IDENTITY))


def entry_record_sums(records: np.ndarray, chains: np.ndarray, counts: np.ndarray | None,
                      ns_identities: np.ndarray | int) -> np.ndarray:
    """The record_sum of ENTRY_DTYPE records (or their bytes, one 128-byte row each): every field
    but state, tick and record_sum; the identity of the entry's namespace
    (``namespace_identities``); and the first ``counts[i]`` pages of ``chains[i]`` (a uint32 row
    per record; None: the whole row)."""
    width = chains.shape[1]
    words = _words(records, ENTRY_SUMMED, 1 + width)
    words[:, _ENTRY_WORDS] = ns_identities
    pages = words[:, _ENTRY_WORDS + 1:]
    np.add(chains, 1, out=pages, casting="unsafe")       # + 1: page 0 must count too
    if counts is not None:
        pages[np.arange(width)[None, :] >= np.asarray(counts)[:, None]] = 0   # past the chain: nothing
    return _mix_sum(words)


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

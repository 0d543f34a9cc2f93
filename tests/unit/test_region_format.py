"""kvtierd.contract.region_format: geometry arithmetic, header format/validation, page chains,
namespace records."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.contract import region_format as L
from kvtierd.contract.namespace import NamespaceId, Sharding
from kvtierd.contract.protocol import MAX_KEY_BYTES
from kvtierd.contract.region_format import (CHAIN_END, DATA_ALIGN, ENTRY_DTYPE, HEADER_BYTES, NS_DTYPE, NS_SLOTS,
                                            EntryState, FormatError, Geometry, read_geometry)
from kvtierd.contract.region_sums import entry_record_sums, namespace_identities, namespace_record_sums
from kvtierd.contract.region_view import DataHeader, RegionView, namespace_from_record, namespace_record

MiB = 1 << 20


# --- geometry ---------------------------------------------------------------------------------
def check_geometry(geo: Geometry, size: int, page_size: int) -> None:
    assert geo.page_size == page_size
    assert geo.total_bytes == geo.meta_bytes + geo.data_bytes <= size
    assert geo.ns_offset == HEADER_BYTES
    assert geo.entry_offset == geo.ns_offset + NS_SLOTS * NS_DTYPE.itemsize
    assert geo.chain_offset == geo.entry_offset + geo.num_pages * ENTRY_DTYPE.itemsize
    assert geo.meta_bytes >= geo.chain_offset + 4 * geo.num_pages and geo.meta_bytes % HEADER_BYTES == 0
    assert geo.data_offset == DATA_ALIGN
    assert geo.data_bytes == geo.data_offset + geo.num_pages * page_size
    assert geo.entry_slots == geo.num_pages
    assert geo.capacity_bytes == geo.num_pages * page_size
    # The largest such geometry: one more page would not fit.
    assert Geometry.for_pages(geo.num_pages + 1, page_size).total_bytes > size or geo.num_pages == L.MAX_PAGES


@pytest.mark.parametrize("size,page_size", [(16 * MiB, 65536), (32 * MiB, 4096), (512 * MiB, 65536),
                                            (8 * MiB, 1 << 20), (64 << 30, 2 * MiB), (3 * MiB + 12345, 4096)])
def test_for_size(size, page_size):
    geo = Geometry.for_size(size, page_size)
    assert geo.num_pages >= 1
    check_geometry(geo, size, page_size)


@settings(max_examples=300, deadline=None)
@given(st.integers(3 * MiB, 1 << 40), st.integers(12, 24))
def test_for_size_property(size, shift):
    try:
        geo = Geometry.for_size(size, 1 << shift)
    except ValueError:
        assert size < Geometry.for_pages(1, 1 << shift).total_bytes
        return
    check_geometry(geo, size, 1 << shift)


def test_for_pages_round_trip():
    geo = Geometry.for_size(64 * MiB, 65536)
    assert Geometry.for_pages(geo.num_pages, geo.page_size) == geo


@pytest.mark.parametrize("size", [0, -1, 1, 4096, 2 * MiB, 2 * MiB + 65535])
def test_for_size_too_small(size):
    with pytest.raises(ValueError, match="raise the size"):
        Geometry.for_size(size, 65536)


def test_for_size_smallest():
    geo = Geometry.for_pages(1, 65536)
    assert Geometry.for_size(geo.total_bytes, 65536) == geo
    assert geo.data_bytes == 2 * MiB + 65536
    assert geo.meta_bytes == HEADER_BYTES + 512 * NS_SLOTS + 128 * L.WRITER_SLOTS + HEADER_BYTES


def test_the_metadata_file_holds_every_table_and_the_data_file_only_pages():
    # 16 MiB in 64 KiB pages: 4 KiB header + 512 KiB namespaces + 512 KiB writer rows + 136 B/page
    # of tables (entry record, chain link, fence) in the metadata file; the data file's first 2 MiB
    # hold its header, then the pages.
    geo = Geometry.for_size(16 * MiB, 65536)
    assert geo.num_pages == 207
    assert geo.meta_bytes == 4096 + 512 * 1024 + 512 * 1024 + 207 * 136 + (-(207 * 136) % 4096)
    assert geo.data_bytes == 2 * MiB + 207 * 65536 <= 16 * MiB - geo.meta_bytes


@pytest.mark.parametrize("page_size", [0, 1, 2048, 4095, 4097, 65535, 3 * 4096, -4096])
def test_for_size_bad_page_size(page_size):
    with pytest.raises(ValueError, match="power of two"):
        Geometry.for_size(64 * MiB, page_size)


def test_dtype_sizes():
    assert NS_DTYPE.itemsize == 512
    assert ENTRY_DTYPE.itemsize == 128
    assert L.WRITER_DTYPE.itemsize == 128
    assert L.HEADER_DTYPE.itemsize <= HEADER_BYTES
    assert L.DATA_HEADER_DTYPE.itemsize <= HEADER_BYTES


# --- header ----------------------------------------------------------------------------------
def formatted(size=4 * MiB, page_size=4096, buffer_kind="bytearray"):
    geo = Geometry.for_size(size, page_size)
    buf = bytearray(geo.meta_bytes) if buffer_kind == "bytearray" else np.zeros(geo.meta_bytes, np.uint8)
    view = RegionView(buf, bytearray(geo.data_bytes), geo)
    view.format(generation=1234567, created_unix_ns=99)
    return geo, buf, view


@pytest.mark.parametrize("kind", ["bytearray", "numpy"])
def test_format_then_read_geometry(kind):
    geo, buf, view = formatted(buffer_kind=kind)
    raw = np.frombuffer(buf, np.uint8)
    assert bytes(raw[:8]) == L.MAGIC
    assert read_geometry(raw) == geo
    again = RegionView(buf)              # geometry from the header; no data file
    assert again.geometry == geo and again.data is None
    h = again.header
    assert int(h["generation"]) == 1234567
    assert int(h["created_unix_ns"]) == 99
    assert int(h["clean_shutdown"]) == 0
    assert int(h["version"]) == L.FORMAT_VERSION
    assert int(h["max_key_bytes"]) == MAX_KEY_BYTES
    assert int(h["tick"]) == 0
    assert (again.entries["state"] == EntryState.FREE).all()
    assert (again.chain == CHAIN_END).all()
    assert (again.namespaces["in_use"] == 0).all()
    assert (again.writers["state"] == L.WriterState.FREE).all() and len(again.writers) == L.WRITER_SLOTS
    assert (again.fence == L.FENCE_NONE).all() and len(again.fence) == geo.num_pages
    assert geo.chain_offset < geo.writer_offset < geo.fence_offset < geo.meta_bytes   # the daemon's file
    assert len(again.entries) == geo.entry_slots
    assert len(again.namespaces) == NS_SLOTS
    assert len(view.data) == geo.num_pages * geo.page_size


def test_header_fields_are_little_endian_at_documented_offsets():
    geo, buf, _ = formatted()
    assert int.from_bytes(buf[8:12], "little") == L.FORMAT_VERSION
    assert int.from_bytes(buf[12:16], "little") == HEADER_BYTES
    assert int.from_bytes(buf[16:24], "little") == geo.meta_bytes
    assert int.from_bytes(buf[24:32], "little") == geo.page_size


def test_views_write_through_to_the_buffers():
    geo, buf, view = formatted()
    data = bytearray(geo.data_bytes)
    view = RegionView(buf, data)
    view.header["clean_shutdown"] = 1
    view.data[geo.page_size * 2:geo.page_size * 2 + 4] = [1, 2, 3, 4]
    view.entries[3]["state"] = EntryState.READY
    again = RegionView(buf)
    assert int(again.header["clean_shutdown"]) == 1
    assert bytes(data[geo.data_offset + 2 * geo.page_size:][:4]) == b"\x01\x02\x03\x04"
    assert again.entries["state"][3] == EntryState.READY


def test_format_wipes_previous_tables():
    geo, buf, view = formatted()
    view.entries["state"][:5] = EntryState.READY
    view.entries["record_sum"][:5] = 9
    view.chain[:5] = 1
    view.namespaces["in_use"][0] = 1
    view.writers["state"][:2] = L.WriterState.DETACHED
    view.fence[:5] = 1
    view.format(generation=2, created_unix_ns=3)
    assert (view.entries["state"] == EntryState.FREE).all() and (view.entries["record_sum"] == 0).all()
    assert (view.writers["state"] == L.WriterState.FREE).all() and (view.fence == L.FENCE_NONE).all()
    assert (view.chain == CHAIN_END).all()
    assert (view.namespaces["in_use"] == 0).all()
    assert int(view.header["generation"]) == 2


@pytest.mark.parametrize("magic", [b"\0" * 8, b"KVTIERD\x01", b"kvtierd\x00", b"GGUF\0\0\0\0"])
def test_bad_magic(magic):
    _, buf, _ = formatted()
    buf[:8] = magic
    with pytest.raises(FormatError, match="magic"):
        read_geometry(np.frombuffer(buf, np.uint8))
    with pytest.raises(FormatError):
        RegionView(buf)


@pytest.mark.parametrize("version", [0, 1, 3, 0xFFFFFFFF])
def test_bad_version(version):
    """Version 1 (no writer and fence tables) is refused like any other: Region names --recreate."""
    _, buf, _ = formatted()
    buf[8:12] = version.to_bytes(4, "little")
    with pytest.raises(FormatError, match="version"):
        RegionView(buf)


@pytest.mark.parametrize("field,value", [("max_key_bytes", 32), ("ns_slots", 16), ("writer_slots", 16)])
def test_different_table_limits(field, value):
    _, buf, view = formatted()
    view.header[field] = value
    with pytest.raises(FormatError, match="limits"):
        RegionView(buf)


@pytest.mark.parametrize("field", ["meta_bytes", "ns_offset", "entry_offset", "chain_offset", "writer_offset",
                                   "fence_offset", "data_offset", "data_bytes", "num_pages", "page_size"])
def test_inconsistent_geometry_in_header(field):
    _, buf, view = formatted()
    view.header[field] = int(view.header[field]) + 4096
    with pytest.raises(FormatError):
        RegionView(buf)


@pytest.mark.parametrize("length", [0, 1, 8, 100, HEADER_BYTES - 1])
def test_truncated_below_header(length):
    _, buf, _ = formatted()
    with pytest.raises(FormatError):
        read_geometry(np.frombuffer(bytes(buf[:length]), np.uint8))
    with pytest.raises(FormatError):
        RegionView(bytes(buf[:length]))


def test_truncated_files():
    geo, buf, _ = formatted()
    with pytest.raises(FormatError, match="bytes"):
        RegionView(bytes(buf[:geo.meta_bytes - 1]))
    with pytest.raises(FormatError):
        RegionView(bytearray(geo.meta_bytes - 1), geometry=geo)    # an explicit geometry is checked too
    with pytest.raises(FormatError, match="data file"):
        RegionView(buf, bytearray(geo.data_bytes - 1))


def test_larger_buffers_are_accepted():
    geo, buf, _ = formatted()
    view = RegionView(bytes(buf) + b"\0" * 8192, bytearray(geo.data_bytes + 8192))
    assert view.geometry == geo
    assert len(view.data) == geo.num_pages * geo.page_size


# --- the data file's header ------------------------------------------------------------------------
def test_data_header_round_trip_and_what_it_refuses():
    geo, _, _ = formatted()
    header = DataHeader.of(geo, 42)
    raw = header.to_bytes()
    assert len(raw) == HEADER_BYTES and raw[:8] == L.DATA_MAGIC
    assert DataHeader.read(raw) == header and DataHeader.read(np.frombuffer(raw, np.uint8)) == header
    with pytest.raises(FormatError, match="magic"):
        DataHeader.read(b"\0" * HEADER_BYTES)
    with pytest.raises(FormatError, match="too short"):
        DataHeader.read(raw[:10])
    old = bytearray(HEADER_BYTES)                       # a region of format 1: one file, metadata first
    old[:8], old[8:12] = L.MAGIC, (1).to_bytes(4, "little")
    with pytest.raises(FormatError, match="format version 1"):
        DataHeader.read(bytes(old))


# --- chains ----------------------------------------------------------------------------------
def set_entry(view: RegionView, slot: int, pages: np.ndarray, key: bytes = b"k") -> None:
    rec = view.entries[slot]
    rec["page_count"] = len(pages)
    rec["first_page"] = pages[0]
    rec["key_len"] = len(key)
    rec["key"][:len(key)] = np.frombuffer(key, np.uint8)
    view.write_chain(np.asarray(pages, dtype=np.uint32))


@pytest.mark.parametrize("pages", [[0], [5], [0, 1, 2, 3], [9, 2, 7, 0, 4], list(range(20))[::-1]])
def test_chain_round_trip(pages):
    _, buf, view = formatted()
    set_entry(view, 3, np.array(pages, np.uint32))
    assert view.chain_of(3).tolist() == pages
    assert view.chain_of(3).dtype == np.uint32
    assert RegionView(buf).chain_of(3).tolist() == pages   # persisted in the buffer


def test_several_chains_do_not_interfere():
    geo, _, view = formatted()
    rng = np.random.default_rng(1)
    perm = rng.permutation(geo.num_pages).astype(np.uint32)
    runs = [perm[0:3], perm[3:4], perm[4:11], perm[11:30]]
    for slot, run in enumerate(runs):
        set_entry(view, slot, run, key=bytes([slot]) * (slot + 1))
    for slot, run in enumerate(runs):
        assert np.array_equal(view.chain_of(slot), run)
        assert view.entry_key(slot) == bytes([slot]) * (slot + 1)


def test_entry_key_full_length():
    _, _, view = formatted()
    key = bytes(range(MAX_KEY_BYTES))
    set_entry(view, 0, np.array([1], np.uint32), key)
    assert view.entry_key(0) == key


def test_chain_longer_than_page_count():
    _, _, view = formatted()
    set_entry(view, 0, np.array([1, 2, 3], np.uint32))
    view.entries[0]["page_count"] = 2
    with pytest.raises(FormatError, match="longer"):
        view.chain_of(0)


def test_chain_shorter_than_page_count():
    geo, _, view = formatted()
    set_entry(view, 0, np.array([1, 2, 3], np.uint32))
    view.entries[0]["page_count"] = 4      # the walk meets CHAIN_END, which is outside the data area
    with pytest.raises(FormatError, match="leaves"):
        view.chain_of(0)


def test_chain_leaving_the_data_area():
    geo, _, view = formatted()
    set_entry(view, 0, np.array([1, 2, 3], np.uint32))
    view.chain[2] = geo.num_pages
    with pytest.raises(FormatError):
        view.chain_of(0)
    view.entries[0]["first_page"] = geo.num_pages + 7
    with pytest.raises(FormatError, match="leaves"):
        view.chain_of(0)


def test_chain_cycle_is_broken():
    _, _, view = formatted()
    set_entry(view, 0, np.array([4, 5, 6], np.uint32))
    view.chain[6] = 4                       # cycle back
    with pytest.raises(FormatError):
        view.chain_of(0)


# --- namespace records -------------------------------------------------------------------------
REPL = NamespaceId("deepseek-ai/DeepSeek-V3", "bfloat16", 16, 1_124_352, Sharding.REPLICATED, 0)
SHARD = NamespaceId("meta-llama/Llama-3.1-70B", "float16", 16, 81920, Sharding.SHARDED, 4)


@pytest.mark.parametrize("ns", [REPL, SHARD, NamespaceId("m" * 256, "d" * 32, 1 << 20, 1 << 34,
                                                         Sharding.SHARDED, 64)])
def test_namespace_record_round_trip(ns):
    rec = namespace_record(ns)
    assert rec.dtype == NS_DTYPE
    assert int(rec["in_use"]) == 1
    assert namespace_from_record(rec) == ns
    _, buf, view = formatted()
    view.namespaces[7] = rec
    assert namespace_from_record(RegionView(buf).namespaces[7]) == ns


def test_namespace_record_bytes_at_documented_offsets():
    """The namespace record, byte for byte: the identity's columns never moved (format 1 to 2)."""
    raw = namespace_record(SHARD).tobytes()
    assert len(raw) == 512
    assert raw[0] == 1 and raw[1] == 1                                  # in use, sharded
    assert int.from_bytes(raw[4:8], "little") == 4                      # world size
    assert int.from_bytes(raw[8:12], "little") == 16                    # tokens per block
    assert int.from_bytes(raw[16:24], "little") == 81920                # bytes per block and rank
    assert raw[24:24 + 256].rstrip(b"\0") == b"meta-llama/Llama-3.1-70B"
    assert raw[280:280 + 32].rstrip(b"\0") == b"float16"
    assert namespace_record(REPL).tobytes()[1] == 0                     # replicated


def test_damaged_namespace_record_raises():
    rec = namespace_record(REPL)
    rec["sharding"] = 7
    with pytest.raises(KeyError):
        namespace_from_record(rec)


# --- record checksums ------------------------------------------------------------------------------
def test_a_namespace_record_carries_its_sum_and_its_identity_ignores_use_and_flags():
    rec = namespace_record(SHARD)
    assert int(rec["record_sum"]) == int(namespace_record_sums(np.asarray(rec).reshape(1))[0]) != 0
    flagged = namespace_record(SHARD, L.NS_CHECKSUMS)
    assert int(flagged["flags"]) == L.NS_CHECKSUMS and int(flagged["record_sum"]) != int(rec["record_sum"])
    ids = namespace_identities(np.stack([rec, flagged, namespace_record(REPL)]))
    assert ids[0] == ids[1] != ids[2]


def test_an_entry_record_sum_sees_any_one_field_and_page_but_not_state_or_tick():
    rng = np.random.default_rng(5)
    records = rng.integers(0, 256, (64, ENTRY_DTYPE.itemsize), dtype=np.uint8)
    chains = rng.integers(0, 1 << 20, (64, 3)).astype(np.uint32)
    base = entry_record_sums(records, chains, None, 77)
    assert (base != 0).all()
    summed = [n for n in ENTRY_DTYPE.names if n not in ("state", "tick", "record_sum")]
    for name in ENTRY_DTYPE.names:
        offset = ENTRY_DTYPE.fields[name][1]
        edited = records.copy()
        edited[:, offset] ^= 0x10
        same = entry_record_sums(edited, chains, None, 77) == base
        assert (~same).all() if name in summed else same.all(), name
    for column in range(3):
        edited = chains.copy()
        edited[:, column] ^= 1
        assert (entry_record_sums(records, edited, None, 77) != base).all()
    assert (entry_record_sums(records, chains, None, 78) != base).all()                    # another namespace
    assert (entry_record_sums(records, chains, np.full(64, 2), 77) != base).all()          # a shorter chain
    padded = np.concatenate([chains, np.full((64, 2), L.CHAIN_END, np.uint32)], axis=1)
    assert (entry_record_sums(records, padded, np.full(64, 3), 77) == base).all()          # padding is not read

"""kvtierd.region (create, lock, adopt, refuse, recreate, watch) and kvtierd.contract.mapping (address,
prefault, background populate, pin).

Everything happens in a tmp directory with small regions and pin="off"; no sockets, no processes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvtierd import hugepages
from kvtierd.contract import mapping as mapping_mod
from kvtierd.contract.mapping import Mapping
from kvtierd.contract.paths import DaemonPaths
from kvtierd.contract.region_format import DATA_MAGIC, HEADER_BYTES, MAGIC, FormatError, Geometry
from kvtierd.contract.region_view import DataHeader, RegionView
from kvtierd.region import Region, RegionError, RegionLocked

MiB = 1 << 20
SIZE = 16 * MiB
PAGE = 65536


@pytest.fixture
def rdir(tmp_path):
    return str(tmp_path / "kvtierd")


def open_region(directory, size=SIZE, page=PAGE, **kw) -> Region:
    kw.setdefault("pin", "off")
    kw.setdefault("prefault_threads", 2)
    return Region.open(directory, "test", size, page, **kw)


@pytest.fixture
def region(rdir):
    r = open_region(rdir)
    yield r
    r.close()


def file_bytes(path: str, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


# --- create ----------------------------------------------------------------------------------
def test_create_files_modes_and_geometry(region, rdir):
    paths = DaemonPaths(rdir, "test")
    assert region.paths == paths
    assert paths.region == os.path.join(rdir, "test.region")
    assert paths.meta == os.path.join(rdir, "test.meta")
    assert paths.lock == os.path.join(rdir, "test.lock")
    assert paths.socket == os.path.join(rdir, "test.sock")
    assert stat.S_IMODE(os.stat(rdir).st_mode) == 0o700
    geo = region.geometry
    for path, mode, size in ((paths.meta, 0o600, geo.meta_bytes), (paths.region, 0o660, geo.data_bytes)):
        st = os.stat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode and st.st_size == size, path
    assert geo == Geometry.for_size(SIZE, PAGE) and geo.total_bytes <= SIZE
    assert not region.adopted and not region.data_replaced
    assert region.was_clean
    assert region.pinned == "off"
    assert region.prefault in ("madvise", "touch")
    assert region.gid is None
    assert 0 < region.generation < (1 << 63)
    assert file_bytes(paths.meta, 0, 8) == MAGIC
    assert DataHeader.read(file_bytes(paths.region, 0, HEADER_BYTES)) == DataHeader.of(geo, region.generation)
    assert int(region.view.header["clean_shutdown"]) == 0          # a daemon runs on it now
    with open(paths.lock) as f:
        assert f.read().strip() == str(os.getpid())


def test_existing_directory_is_tightened(tmp_path):
    d = tmp_path / "loose"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    r = open_region(str(d))
    try:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    finally:
        r.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: gives the files to another group")
def test_a_client_group_may_enter_the_directory_and_map_the_pages_but_not_write_the_directory(rdir):
    # Issue 11 item 7: the directory was 2770 (members could rename or remove the sockets, the
    # lock and the region), and a region made without --group kept its group after a restart with it.
    open_region(rdir).close()                              # made without a group
    group = 65534 if os.getgid() != 65534 else 65533
    r = open_region(rdir, group=str(group))
    try:
        assert r.adopted
        st = os.stat(rdir)
        assert stat.S_IMODE(st.st_mode) == 0o2750 and st.st_gid == group
        data, meta = os.stat(r.paths.region), os.stat(r.paths.meta)
        assert (stat.S_IMODE(data.st_mode), data.st_gid) == (0o660, group)
        assert stat.S_IMODE(meta.st_mode) == 0o600
    finally:
        r.close()


def test_the_pages_are_a_shared_mapping_of_the_region_file(region):
    geo = region.geometry
    region.view.data[:5] = np.frombuffer(b"hello", np.uint8)
    region.view.data[geo.page_size * 3 + 7] = 0xAB
    assert file_bytes(region.paths.region, geo.data_offset, 5) == b"hello"
    assert file_bytes(region.paths.region, geo.data_offset + geo.page_size * 3 + 7, 1) == b"\xab"
    assert ctypes.string_at(region.data.address + geo.data_offset, 5) == b"hello"
    region.view.entries["tick"][2] = 99                                  # the tables: the metadata file
    assert int.from_bytes(file_bytes(region.paths.meta, geo.entry_offset + 2 * 128 + 24, 8), "little") == 99


# --- lock ------------------------------------------------------------------------------------
def test_second_open_refuses_while_locked(region, rdir):
    with pytest.raises(RegionLocked) as info:
        open_region(rdir)
    msg = str(info.value)
    assert region.paths.lock in msg
    assert f"pid {os.getpid()}" in msg
    assert isinstance(info.value, RegionError)
    # The refused open changed nothing: the first region still works and keeps its identity.
    assert int(region.view.header["clean_shutdown"]) == 0
    region.view.data[0] = 7
    assert file_bytes(region.paths.region, region.geometry.data_offset, 1) == b"\x07"


def test_other_name_in_same_directory_is_independent(region, rdir):
    other = Region.open(rdir, "other", SIZE, PAGE, pin="off")    # its own lock: no RegionLocked
    try:
        assert other.paths.region != region.paths.region and other.paths.lock != region.paths.lock
        assert not other.adopted
        other.view.data[:3] = [1, 2, 3]
        assert bytes(region.view.data[:3]) == b"\0\0\0"
    finally:
        other.close()


def test_stale_lock_file_from_a_dead_daemon_is_taken(rdir):
    os.makedirs(rdir, mode=0o700)
    with open(os.path.join(rdir, "test.lock"), "w") as f:
        f.write("999999999\n")
    r = open_region(rdir)
    try:
        with open(r.paths.lock) as f:
            assert f.read().strip() == str(os.getpid())
    finally:
        r.close()


# --- adopt -------------------------------------------------------------------------------------
def test_close_then_reopen_adopts_with_data(rdir):
    r = open_region(rdir)
    gen, geo = r.generation, r.geometry
    payload = np.random.default_rng(0).integers(0, 256, 3 * PAGE + 100, dtype=np.uint8)
    r.view.data[PAGE * 5:PAGE * 5 + len(payload)] = payload
    r.view.header["tick"] = 1234
    r.close()
    assert r.view is None
    assert r.meta.address is None and r.data.address is None
    r.close()   # idempotent
    assert file_bytes(r.paths.meta, 0, 8) == MAGIC

    r2 = open_region(rdir)
    try:
        assert r2.adopted and not r2.data_replaced
        assert r2.was_clean
        assert r2.generation == gen
        assert r2.geometry == geo
        assert int(r2.view.header["tick"]) == 1234
        assert int(r2.view.header["clean_shutdown"]) == 0
        assert np.array_equal(r2.view.data[PAGE * 5:PAGE * 5 + len(payload)], payload)
    finally:
        r2.close()


def test_unclean_close_is_reported(rdir):
    r = open_region(rdir)
    gen = r.generation
    r.close(clean=False)
    r2 = open_region(rdir)
    assert r2.adopted and not r2.was_clean
    assert r2.generation == gen
    r2.close()
    r3 = open_region(rdir)     # r2 stopped cleanly
    assert r3.adopted and r3.was_clean
    r3.close()


def test_new_generation_goes_to_both_files(rdir):
    r = open_region(rdir)
    old = r.generation
    new = r.new_generation()
    assert new == r.generation != old
    assert 0 < new < (1 << 63)
    assert DataHeader.read(file_bytes(r.paths.region, 0, HEADER_BYTES)).generation == new
    r.close()
    r2 = open_region(rdir)
    assert r2.generation == new and not r2.data_replaced
    r2.close()


@pytest.mark.parametrize("damage", ["missing", "truncated", "other generation", "garbage"])
def test_an_unusable_region_file_is_replaced_and_the_entries_forgotten(rdir, damage):
    r = open_region(rdir)
    gen, geo, path = r.generation, r.geometry, r.paths.region
    r.view.entries["state"][3] = 2
    r.view.namespaces["in_use"][1] = 1
    r.close()
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncated":
        os.truncate(path, geo.data_bytes - PAGE)
    elif damage == "other generation":
        with open(path, "r+b") as f:
            f.write(DataHeader.of(geo, gen + 1).to_bytes())
    else:
        with open(path, "r+b") as f:
            f.write(b"garbage" * 10)
    r2 = open_region(rdir)                     # no --recreate needed: the metadata is sound
    try:
        assert r2.adopted and r2.data_replaced and r2.generation != gen
        assert (r2.view.entries["state"] == 0).all() and r2.view.namespaces["in_use"][1] == 1
        assert os.stat(path).st_size == geo.data_bytes
        assert DataHeader.read(file_bytes(path, 0, HEADER_BYTES)) == DataHeader.of(geo, r2.generation)
    finally:
        r2.close()


# --- refuse / recreate -------------------------------------------------------------------------
@pytest.mark.parametrize("size,page", [(32 * MiB, PAGE), (SIZE, 4096), (SIZE, 2 * PAGE)])
def test_geometry_mismatch_refused_then_recreated(rdir, size, page):
    r = open_region(rdir)
    gen = r.generation
    r.view.data[:4] = 9
    r.close()
    with pytest.raises(RegionError) as info:
        open_region(rdir, size=size, page=page)
    assert not isinstance(info.value, RegionLocked)
    assert "--recreate" in str(info.value)
    # The refusal released the lock and left the files alone: the old geometry still adopts.
    same = open_region(rdir)
    assert same.adopted and same.generation == gen
    same.close()

    new = open_region(rdir, size=size, page=page, recreate=True)
    try:
        assert not new.adopted
        assert new.generation != gen
        assert new.geometry == Geometry.for_size(size, page)
        assert os.stat(new.paths.region).st_size == new.geometry.data_bytes
        assert os.stat(new.paths.meta).st_size == new.geometry.meta_bytes
        assert stat.S_IMODE(os.stat(new.paths.region).st_mode) == 0o660
        assert bytes(new.view.data[:4]) == b"\0\0\0\0"
    finally:
        new.close()


def test_recreate_of_a_matching_region_adopts(rdir):
    r = open_region(rdir)
    gen = r.generation
    r.close()
    r2 = open_region(rdir, recreate=True)     # recreate only replaces what does not match
    assert r2.adopted and r2.generation == gen
    r2.close()


@pytest.mark.parametrize("which", ["test.meta", "test.region"])
@pytest.mark.parametrize("content", [b"", b"garbage" * 1000, b"\0" * 8192, MAGIC + b"\x01\0\0\0" + b"\0" * 5000])
def test_garbage_file_refused_then_recreated(rdir, which, content):
    # test.region alone with MAGIC and version 1: a region of format 1, metadata and pages in one file.
    os.makedirs(rdir, mode=0o700)
    path = os.path.join(rdir, which)
    with open(path, "wb") as f:
        f.write(content)
    with pytest.raises(RegionError) as info:
        open_region(rdir)
    assert "--recreate" in str(info.value)
    assert path in str(info.value)
    with open(path, "rb") as f:
        assert f.read() == content        # refused: untouched
    r = open_region(rdir, recreate=True)
    try:
        assert not r.adopted
        assert file_bytes(r.paths.meta, 0, 8) == MAGIC and file_bytes(r.paths.region, 0, 8) == DATA_MAGIC
    finally:
        r.close()


def test_region_of_format_version_1_refused_with_the_recreate_hint(rdir):
    """Version 1 kept metadata and pages in one file, without the writer and fence tables:
    adopting it would lose the fence. Refused, named, with the --recreate hint."""
    r = open_region(rdir)
    path = r.paths.region
    r.close()
    os.unlink(r.paths.meta)
    with open(path, "r+b") as f:                 # a region of format 1: one file, the metadata's magic
        f.write(MAGIC + struct.pack("<I", 1))
    with pytest.raises(RegionError) as info:
        open_region(rdir)
    assert "version 1" in str(info.value) and "--recreate" in str(info.value) and path in str(info.value)
    r2 = open_region(rdir, recreate=True)
    try:
        assert not r2.adopted and int(r2.view.header["version"]) == 2
        r2.view.header["version"] = 1            # and a metadata file of another version is refused too
    finally:
        r2.close()
    with pytest.raises(RegionError) as info:
        open_region(rdir)
    assert "version 1" in str(info.value) and "--recreate" in str(info.value) and r2.paths.meta in str(info.value)


def test_truncated_metadata_refused_then_recreated(rdir):
    r = open_region(rdir)
    path = r.paths.meta
    r.close()
    os.truncate(path, r.geometry.meta_bytes - 4096)
    with pytest.raises(RegionError, match="truncated"):
        open_region(rdir)
    r2 = open_region(rdir, recreate=True)
    assert not r2.adopted
    assert os.stat(path).st_size == r2.geometry.meta_bytes
    r2.close()


def test_a_region_file_left_without_its_metadata_is_replaced(rdir):
    r = open_region(rdir)
    gen = r.generation
    r.close()
    os.unlink(r.paths.meta)
    r2 = open_region(rdir)
    assert not r2.adopted and r2.generation != gen
    r2.close()


def test_sparse_adopted_files_are_reserved_again(rdir):
    # Issue 11 item 8: a sparse region on a full filesystem failed its prefault with "Bad address".
    r = open_region(rdir)
    gen = r.generation
    r.close()
    with open(r.paths.region, "r+b") as f:
        f.truncate(0)
        f.truncate(r.geometry.data_bytes)               # same size, no blocks: a hole
        f.write(DataHeader.of(r.geometry, gen).to_bytes())
    assert os.stat(r.paths.region).st_blocks * 512 < r.geometry.data_bytes // 2
    r2 = open_region(rdir)
    assert r2.adopted and not r2.data_replaced
    assert os.stat(r.paths.region).st_blocks * 512 >= r.geometry.data_bytes
    r2.close()


@pytest.mark.parametrize("which", ["test.meta", "test.region"])
def test_region_path_not_a_regular_file(rdir, which):
    if which == "test.region":
        open_region(rdir).close()
        os.unlink(os.path.join(rdir, which))
    os.makedirs(os.path.join(rdir, which))
    with pytest.raises((RegionError, OSError), match="not a regular file|Is a directory"):
        open_region(rdir)


@pytest.mark.parametrize("size,page", [(MiB, PAGE), (SIZE, 1000), (SIZE, 2048)])
def test_bad_size_settings(rdir, size, page):
    with pytest.raises(RegionError, match="size"):
        open_region(rdir, size=size, page=page)
    open_region(rdir).close()     # the lock was released


def test_not_enough_free_space(rdir, monkeypatch):
    real = os.statvfs

    def small(path):
        st = real(path)
        return SimpleNamespace(f_bavail=4, f_frsize=MiB, f_bsize=st.f_bsize, f_blocks=st.f_blocks)

    monkeypatch.setattr(os, "statvfs", small)
    with pytest.raises(RegionError) as info:
        open_region(rdir)
    msg = str(info.value)
    assert "size" in msg and rdir in msg
    assert not os.path.exists(os.path.join(rdir, "test.region"))
    assert not os.path.exists(os.path.join(rdir, "test.meta"))
    monkeypatch.setattr(os, "statvfs", real)
    open_region(rdir).close()      # lock released, nothing left behind


def test_not_enough_space_for_a_recreate_keeps_nothing_half_made(rdir, monkeypatch):
    open_region(rdir).close()
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=0, f_frsize=4096))
    with pytest.raises(RegionError):
        open_region(rdir, size=32 * MiB, recreate=True)
    assert not os.path.exists(os.path.join(rdir, "test.region"))
    assert not os.path.exists(os.path.join(rdir, "test.meta"))


def test_pin_mode_is_checked(rdir):
    with pytest.raises(ValueError):
        open_region(rdir, pin="bogus")
    # The failed open released its lock and left no header-less file behind to trip the next start.
    assert not os.path.exists(os.path.join(rdir, "test.region"))
    assert not os.path.exists(os.path.join(rdir, "test.meta"))
    r = open_region(rdir)
    assert not r.adopted
    r.close()


def test_failure_after_create_leaves_no_file(rdir, monkeypatch):
    def broken(self, mode):
        raise RuntimeError("pin=cuda but no usable CUDA runtime")

    monkeypatch.setattr(Mapping, "pin", broken)
    with pytest.raises(RuntimeError):
        open_region(rdir, pin="cuda")
    assert not os.path.exists(os.path.join(rdir, "test.region"))
    monkeypatch.undo()
    open_region(rdir).close()


def test_failure_while_adopting_keeps_the_files(rdir, monkeypatch):
    r = open_region(rdir)
    gen = r.generation
    r.close()
    monkeypatch.setattr(Mapping, "pin", lambda self, mode: (_ for _ in ()).throw(RuntimeError("no pin")))
    with pytest.raises(RuntimeError):
        open_region(rdir)
    monkeypatch.undo()
    r2 = open_region(rdir)
    assert r2.adopted and r2.generation == gen
    r2.close()


# --- watch ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("which,what", [("region", "region file"), ("meta", "metadata file")])
def test_check_files_reports_removed_replaced_and_back(region, caplog, which, what):
    caplog.set_level(logging.INFO, logger="kvtierd.region")
    path = getattr(region.paths, which)
    size = os.stat(path).st_size
    assert region.check_files() == "ok" and region.problem is None
    os.rename(path, path + ".moved")
    assert region.check_files() == "ok" and region.problem == f"{what} removed"
    with open(path, "wb") as f:                 # another file at the path
        f.truncate(size)
    assert region.check_files() == "ok" and region.problem == f"{what} replaced by another file"
    os.unlink(path)
    os.rename(path + ".moved", path)
    assert region.check_files() == "ok" and region.problem is None
    assert [r.levelname for r in caplog.records if "region files" in r.getMessage() or what in r.getMessage()] \
        == ["ERROR", "ERROR", "INFO"]


def test_check_files_says_stop_when_the_metadata_is_truncated(region, caplog):
    os.truncate(region.paths.meta, region.geometry.meta_bytes - 4096)
    assert region.check_files() == "stop" and region.problem == "metadata file truncated"
    assert region.check_files() == "stop"                                  # still: the daemon must stop
    assert sum("truncated" in r.getMessage() for r in caplog.records) == 1   # said once
    os.truncate(region.paths.meta, region.geometry.meta_bytes)   # so that close() touches nothing past the end


def test_a_truncated_region_file_is_replaced_without_touching_it(region):
    # Issue 11 item 7: truncating the region under the daemon killed it with SIGBUS.
    os.truncate(region.paths.region, 0)
    assert region.check_files() == "replace data" and region.problem == "region file truncated"
    old = region.generation
    new = region.replace_data()
    assert new == region.generation != old and region.problem is None
    assert os.stat(region.paths.region).st_size == region.geometry.data_bytes
    assert DataHeader.read(file_bytes(region.paths.region, 0, HEADER_BYTES)).generation == new
    region.view.data[:3] = [1, 2, 3]                                       # the new file is mapped
    assert file_bytes(region.paths.region, region.geometry.data_offset, 3) == b"\x01\x02\x03"
    assert region.check_files() == "ok"


# --- mapping -------------------------------------------------------------------------------------
@pytest.fixture
def mapped_file(tmp_path):
    path = tmp_path / "m.bin"
    data = np.random.default_rng(3).integers(0, 256, 4 * MiB + 4096, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    m = Mapping.of_file(str(path))
    yield path, data, m
    m.close()


def test_mapping_address_and_buffer(mapped_file):
    path, data, m = mapped_file
    assert m.size == len(data)
    assert isinstance(m.address, int) and m.address % os.sysconf("SC_PAGE_SIZE") == 0
    assert ctypes.string_at(m.address, 64) == data[:64]
    arr = np.frombuffer(m.buffer, np.uint8)
    assert arr.ctypes.data == m.address
    assert arr.tobytes() == data
    arr[100:104] = [1, 2, 3, 4]                    # buffer -> file
    assert file_bytes(str(path), 100, 4) == b"\x01\x02\x03\x04"
    with open(path, "r+b") as f:                   # file -> address
        f.seek(5000)
        f.write(b"xyz")
    assert ctypes.string_at(m.address + 5000, 3) == b"xyz"
    ctypes.memmove(m.address + 7000, b"abc", 3)    # address -> buffer
    assert bytes(arr[7000:7003]) == b"abc"


def test_prefault_keeps_bytes(mapped_file):
    _, data, m = mapped_file
    calls = []
    method = m.prefault(threads=3, progress=lambda done, total: calls.append((done, total)))
    assert method in ("madvise", "touch")
    assert ctypes.string_at(m.address, m.size) == data
    assert calls and calls[-1] == (m.size, m.size)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert m.prefault(start=m.size) == "none"
    assert m.prefault(start=4096, length=8192, threads=1) in ("madvise", "touch")


def test_prefault_falls_back_to_touch(mapped_file, monkeypatch):
    _, data, m = mapped_file

    def no_populate(addr, length, advice):
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(mapping_mod._libc, "madvise", no_populate)
    assert m.prefault(threads=2) == "touch"
    assert ctypes.string_at(m.address, m.size) == data


def test_prefault_error_other_than_einval_raises(mapped_file, monkeypatch):
    _, _, m = mapped_file

    def fails(addr, length, advice):
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr(mapping_mod._libc, "madvise", fails)
    with pytest.raises(OSError):
        m.prefault()


def test_background_populate_finishes_and_reports_progress():
    m = Mapping.anonymous(256 * MiB)
    try:
        calls = []
        task = m.populate_in_background(threads=2, progress=lambda done, total: calls.append((done, total)))
        assert task.wait() and task.finished and not task.cancelled
        assert task.method == "madvise" and calls[-1] == (m.size, m.size)
        assert [c[0] for c in calls] == sorted(c[0] for c in calls)
        assert hugepages.backing(m.address).resident_bytes == m.size     # in this process's page tables
    finally:
        m.close()


def test_close_cancels_a_background_populate_and_joins_it_before_unmapping():
    m = Mapping.anonymous(8 * mapping_mod.PREFAULT_CHUNK_BYTES)
    closer = threading.Thread(target=m.close)
    closing = threading.Event()

    def progress(done: int, total: int) -> None:
        if not closing.is_set():               # the first chunk is done: close the mapping meanwhile
            closer.start()
            closing.set()
            deadline = time.monotonic() + 30
            while not task.cancelled and time.monotonic() < deadline:
                time.sleep(0.001)
            assert m.address is not None       # close() waits for this thread before it unmaps

    task = m.populate_in_background(threads=2, progress=progress)
    assert closing.wait(60)
    closer.join(60)
    assert not closer.is_alive() and m.address is None
    assert task.cancelled and not task.finished and task.done < task.total
    assert not task.wait()                     # cancelled: no error, not finished


def test_background_populate_error_surfaces_in_wait(monkeypatch):
    m = Mapping.anonymous(4 * mapping_mod.PREFAULT_CHUNK_BYTES)
    real = mapping_mod._libc.madvise

    def fails_after_probe(addr, length, advice):
        if length == mapping_mod.OS_PAGE:
            return real(addr, length, advice)
        ctypes.set_errno(errno.ENOMEM)
        return -1

    monkeypatch.setattr(mapping_mod._libc, "madvise", fails_after_probe)
    try:
        task = m.populate_in_background(threads=2)
        with pytest.raises(OSError, match="MADV_POPULATE_WRITE"):
            task.wait()
        assert task.cancelled and not task.finished
    finally:
        monkeypatch.undo()
        m.close()


def test_pin_modes(mapped_file):
    _, _, m = mapped_file
    assert m.pin("off") == "off"
    assert m.pinned == "off"
    with pytest.raises(ValueError, match="bogus"):
        m.pin("bogus")


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version"),
                    reason="a CUDA driver is present: auto would pick cuda")
def test_pin_auto_without_cuda(mapped_file):
    _, data, m = mapped_file
    assert m.pin("auto") in ("mlock", "off")
    assert m.pinned in ("mlock", "off")
    m.close()          # unpins, then unmaps
    assert m.address is None and m.buffer is None


def test_mapping_close_is_idempotent(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(b"\1" * 8192)
    m = Mapping.of_file(str(path))
    m.close()
    m.close()
    assert m.address is None


def test_mapping_of_missing_or_empty_file(tmp_path):
    with pytest.raises(OSError):
        Mapping.of_file(str(tmp_path / "missing"))
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(OSError):
        Mapping.of_file(str(tmp_path / "empty"))


def test_a_client_maps_the_region_file_and_checks_its_header(region):
    # A client maps the pages only, and knows it maps the file the daemon announced by its header.
    m = Mapping.of_file(region.paths.region)
    try:
        assert DataHeader.read(np.frombuffer(m.buffer, np.uint8)[:HEADER_BYTES]) == \
            DataHeader.of(region.geometry, region.generation)
        region.view.data[PAGE:PAGE + 3] = [5, 6, 7]
        at = region.geometry.data_offset + PAGE
        assert bytes(np.frombuffer(m.buffer, np.uint8)[at:at + 3]) == b"\x05\x06\x07"
    finally:
        m.close()
    with pytest.raises(FormatError):
        RegionView(bytearray(100))

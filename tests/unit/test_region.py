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
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvtierd import hugepages
from kvtierd.contract import mapping as mapping_mod
from kvtierd.contract.mapping import Mapping
from kvtierd.contract.paths import DaemonPaths
from kvtierd.contract.region_format import MAGIC, FormatError, Geometry, RegionView
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
    assert paths.lock == os.path.join(rdir, "test.lock")
    assert paths.socket == os.path.join(rdir, "test.sock")
    assert stat.S_IMODE(os.stat(rdir).st_mode) == 0o700
    st = os.stat(paths.region)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_size == region.geometry.file_bytes
    assert region.geometry == Geometry.for_size(SIZE, PAGE)
    assert region.geometry.file_bytes <= SIZE
    assert not region.adopted
    assert region.was_clean
    assert region.pinned == "off"
    assert region.prefault in ("madvise", "touch")
    assert region.gid is None
    assert 0 < region.generation < (1 << 63)
    assert file_bytes(paths.region, 0, 8) == MAGIC
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


def test_region_is_a_shared_mapping_of_the_file(region):
    geo = region.geometry
    region.view.data[:5] = np.frombuffer(b"hello", np.uint8)
    region.view.data[geo.page_size * 3 + 7] = 0xAB
    assert file_bytes(region.paths.region, geo.data_offset, 5) == b"hello"
    assert file_bytes(region.paths.region, geo.data_offset + geo.page_size * 3 + 7, 1) == b"\xab"
    assert ctypes.string_at(region.mapping.address + geo.data_offset, 5) == b"hello"


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
    assert r.mapping.address is None
    r.close()   # idempotent
    assert file_bytes(r.paths.region, 0, 8) == MAGIC

    r2 = open_region(rdir)
    try:
        assert r2.adopted
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


def test_new_generation(rdir):
    r = open_region(rdir)
    old = r.generation
    new = r.new_generation()
    assert new == r.generation != old
    assert 0 < new < (1 << 63)
    r.close()
    r2 = open_region(rdir)
    assert r2.generation == new
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
    # The refusal released the lock and left the file alone: the old geometry still adopts.
    same = open_region(rdir)
    assert same.adopted and same.generation == gen
    same.close()

    new = open_region(rdir, size=size, page=page, recreate=True)
    try:
        assert not new.adopted
        assert new.generation != gen
        assert new.geometry == Geometry.for_size(size, page)
        assert os.stat(new.paths.region).st_size == new.geometry.file_bytes
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


@pytest.mark.parametrize("content", [b"", b"garbage" * 1000, b"\0" * 8192, MAGIC + b"\x07\0\0\0" + b"\0" * 5000])
def test_garbage_file_refused_then_recreated(rdir, content):
    os.makedirs(rdir, mode=0o700)
    path = os.path.join(rdir, "test.region")
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
        assert file_bytes(path, 0, 8) == MAGIC
    finally:
        r.close()


def test_region_of_format_version_1_refused_with_the_recreate_hint(rdir):
    """Version 1 had no writer and fence tables: adopting it would lose the fence. Refused, named."""
    r = open_region(rdir)
    path = r.paths.region
    r.view.header["version"] = 1
    r.close()
    with pytest.raises(RegionError) as info:
        open_region(rdir)
    assert "version 1" in str(info.value) and "--recreate" in str(info.value) and path in str(info.value)
    r2 = open_region(rdir, recreate=True)
    try:
        assert not r2.adopted and int(r2.view.header["version"]) == 2
    finally:
        r2.close()


def test_truncated_region_refused_then_recreated(rdir):
    r = open_region(rdir)
    path = r.paths.region
    r.close()
    os.truncate(path, r.geometry.file_bytes - PAGE)
    with pytest.raises(RegionError, match="truncated"):
        open_region(rdir)
    r2 = open_region(rdir, recreate=True)
    assert not r2.adopted
    assert os.stat(path).st_size == r2.geometry.file_bytes
    r2.close()


def test_region_path_not_a_regular_file(rdir):
    os.makedirs(os.path.join(rdir, "test.region"))
    with pytest.raises(RegionError, match="not a regular file"):
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
    monkeypatch.setattr(os, "statvfs", real)
    open_region(rdir).close()      # lock released, nothing left behind


def test_not_enough_space_for_a_recreate_keeps_nothing_half_made(rdir, monkeypatch):
    open_region(rdir).close()
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_bavail=0, f_frsize=4096))
    with pytest.raises(RegionError):
        open_region(rdir, size=32 * MiB, recreate=True)
    assert not os.path.exists(os.path.join(rdir, "test.region"))


def test_pin_mode_is_checked(rdir):
    with pytest.raises(ValueError):
        open_region(rdir, pin="bogus")
    # The failed open released its lock and left no header-less file behind to trip the next start.
    assert not os.path.exists(os.path.join(rdir, "test.region"))
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


def test_failure_while_adopting_keeps_the_file(rdir, monkeypatch):
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
def test_check_file_reports_removed_replaced_and_back(region, caplog):
    caplog.set_level(logging.INFO, logger="kvtierd.region")
    path = region.paths.region
    assert region.check_file() and region.problem is None
    os.rename(path, path + ".moved")
    assert region.check_file() and region.problem == "removed"
    with open(path, "wb") as f:                 # another file at the path
        f.truncate(region.geometry.file_bytes)
    assert region.check_file() and region.problem == "replaced by another file"
    os.unlink(path)
    os.rename(path + ".moved", path)
    assert region.check_file() and region.problem is None
    assert [r.levelname for r in caplog.records if "region file" in r.getMessage()] == ["ERROR", "ERROR", "INFO"]


def test_check_file_says_stop_when_truncated(region, caplog):
    os.truncate(region.paths.region, region.geometry.file_bytes - PAGE)
    assert not region.check_file() and region.problem == "truncated"
    assert not region.check_file()                                  # still: the daemon must stop
    assert sum("truncated" in r.getMessage() for r in caplog.records) == 1   # said once
    os.truncate(region.paths.region, region.geometry.file_bytes)   # so that close() touches nothing past the end


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


def test_region_view_over_a_client_mapping(region):
    # A client maps the same file and reads the geometry from its header.
    m = Mapping.of_file(region.paths.region)
    try:
        view = RegionView(m.buffer)
        assert view.geometry == region.geometry
        region.view.data[PAGE:PAGE + 3] = [5, 6, 7]
        assert bytes(view.data[PAGE:PAGE + 3]) == b"\x05\x06\x07"
        assert int(view.header["generation"]) == region.generation
        del view
    finally:
        m.close()
    with pytest.raises(FormatError):
        RegionView(bytearray(100))

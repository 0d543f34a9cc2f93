"""kvtierd.hugepages (what a filesystem offers, the plan per setting, what a mapping got) and the
region on each kind of filesystem.

The parsers are checked on mountinfo/smaps texts of the shapes Linux writes; the rest runs on
real filesystems: the test's tmp directory (whatever it is: ext4 here), and tmpfs mounts with
each huge= option, which the tests mount themselves when they run as root (CAP_SYS_ADMIN) and
skip, saying so, otherwise. hugetlbfs runs only where huge pages are already reserved
(vm.nr_hugepages): a test never changes the machine's settings.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from contextlib import ExitStack

import numpy as np
import pytest

from kvtierd import hugepages
from kvtierd.contract.mapping import Mapping
from kvtierd.hugepages import Backing, HugePagesUnavailable, Offer, judge, parse_mountinfo, parse_smaps, plan, size_for
from kvtierd.region import Region, RegionError
from kvtierbench.harness import huge_tmpfs

MiB = 1 << 20
SIZE = 16 * MiB
PAGE = 65536
THP = hugepages.thp_page_size()


def open_region(directory, huge="auto", size=SIZE, **kw) -> Region:
    return Region.open(str(directory), "test", size, PAGE, pin="off", prefault_threads=2, huge=huge, **kw)


# --- mountinfo ----------------------------------------------------------------------------------
MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:25 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=24683652k,huge=within_size,inode64
31 22 0:25 /kvtierd /srv/kv\\040tier rw,relatime - tmpfs tmpfs rw,size=24683652k,huge=within_size,inode64
40 22 0:40 / /dev/hugepages rw,relatime shared:20 - hugetlbfs none rw,pagesize=1024M
"""


def test_mountinfo_finds_the_mount_and_its_superblock_options():
    dev = os.makedev(0, 25)
    shm = parse_mountinfo(MOUNTINFO, dev, "/dev/shm/kvtierd")
    assert (shm.mount_point, shm.fs_type, shm.options["huge"]) == ("/dev/shm", "tmpfs", "within_size")
    # The same superblock bind-mounted elsewhere: the mount point that holds the path wins (escapes undone).
    bound = parse_mountinfo(MOUNTINFO, dev, "/srv/kv tier/x")
    assert bound.mount_point == "/srv/kv tier"
    huge = parse_mountinfo(MOUNTINFO, os.makedev(0, 40), "/dev/hugepages/kvtierd")
    assert (huge.fs_type, huge.options["pagesize"]) == ("hugetlbfs", "1024M")
    assert parse_mountinfo(MOUNTINFO, os.makedev(9, 9), "/x") is None


# --- smaps ----------------------------------------------------------------------------------------
def smaps_record(address: int, **kb: int) -> str:
    head = f"{address:x}-{address + (64 << 20):x} rw-s 00000000 00:19 1234     /dev/shm/kvtierd/kvtierd.region\n"
    fields = {"Size": 65536, "KernelPageSize": 4, "MMUPageSize": 4, "Rss": 0, "AnonHugePages": 0,
              "ShmemPmdMapped": 0, "FilePmdMapped": 0, "Shared_Hugetlb": 0, "Private_Hugetlb": 0, **kb}
    return head + "".join(f"{name}: {value:>8} kB\n" for name, value in fields.items()) + "VmFlags: rd wr sh mr\n"


def test_smaps_reports_thp_hugetlb_and_small_pages():
    other = smaps_record(0x7000_0000_0000, Rss=4)
    thp = smaps_record(0x7F00_0000_0000, Rss=65536, ShmemPmdMapped=65536)
    assert parse_smaps(other + thp, 0x7F00_0000_0000) == Backing("thp", THP, 64 * MiB, 64 * MiB)
    hugetlb = smaps_record(0x7F00_0000_0000, KernelPageSize=2048, MMUPageSize=2048, Shared_Hugetlb=65536)
    assert parse_smaps(hugetlb, 0x7F00_0000_0000) == Backing("hugetlb", 2 * MiB, 64 * MiB, 64 * MiB)
    small = smaps_record(0x7F00_0000_0000, Rss=1024)
    got = parse_smaps(small + other, 0x7F00_0000_0000)
    assert got == Backing("none", hugepages.OS_PAGE, 0, MiB)
    assert "pages" in got.describe()
    with pytest.raises(ValueError):
        parse_smaps(small, 0x1000)


def test_backing_of_a_real_mapping_counts_what_is_resident(tmp_path):
    path = tmp_path / "m.bin"
    path.write_bytes(b"\0" * (4 * MiB))
    m = Mapping.of_file(str(path))
    try:
        assert hugepages.backing(m.address).resident_bytes == 0
        m.prefault(threads=1)
        assert hugepages.backing(m.address).resident_bytes == 4 * MiB
    finally:
        m.close()


# --- plan -----------------------------------------------------------------------------------------
def offer(huge: str, fs: str = "tmpfs", page: int = THP, free: int | None = None) -> Offer:
    return Offer("/dev/shm/kvtierd", "/dev/shm", fs, huge, page if huge != "never" else hugepages.OS_PAGE, free)


@pytest.mark.parametrize("found,setting,advise,populate,expect", [
    (offer("always"), "auto", None, False, "thp"),
    (offer("within_size"), "on", None, False, "thp"),
    (offer("advise"), "auto", True, True, "thp"),         # fallocate would allocate small pages: populate reserves
    (offer("never"), "auto", None, False, "none"),
    (offer("always"), "off", False, True, "none"),
    (offer("advise"), "off", False, True, "none"),
    (offer("never"), "off", False, False, "none"),
    (offer("none", fs="ext4", page=hugepages.OS_PAGE), "auto", None, False, "none"),
    (offer("hugetlbfs", fs="hugetlbfs", page=1 << 30, free=4 << 30), "on", None, False, "hugetlb"),
])
def test_plan_per_setting_and_offer(found, setting, advise, populate, expect):
    p = plan(setting, found)
    assert (p.advise, p.reserve_by_populate, p.expect) == (advise, populate, expect)
    assert p.align == (found.page_size if expect != "none" else hugepages.OS_PAGE)
    assert bool(p.note) == (expect == "none")


@pytest.mark.parametrize("found,command", [
    (offer("never"), "mount -o remount,huge=within_size /dev/shm"),
    (offer("deny"), "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    (offer("none", fs="ext4", page=hugepages.OS_PAGE), "mount -t tmpfs -o huge=within_size"),
])
def test_on_without_huge_pages_refuses_naming_the_fix(found, command):
    with pytest.raises(HugePagesUnavailable) as info:
        plan("on", found)
    msg = str(info.value)
    assert msg.startswith("hugepages=on") and command in msg
    assert "vm.nr_hugepages" in msg and "hugepages=auto" in msg
    assert command in plan("auto", found).note           # auto starts, and its info line says the same


def test_off_refuses_hugetlbfs_and_bad_settings_are_value_errors():
    with pytest.raises(HugePagesUnavailable, match="hugepages=off.*hugetlbfs"):
        plan("off", offer("hugetlbfs", fs="hugetlbfs", page=2 * MiB, free=0))
    with pytest.raises(ValueError, match="auto, on or off"):
        plan("maybe", offer("never"))


def test_size_is_used_in_whole_huge_pages():
    one_gib = plan("auto", offer("hugetlbfs", fs="hugetlbfs", page=1 << 30, free=8 << 30))
    assert size_for((3 << 30) + (512 << 20), one_gib) == 3 << 30
    with pytest.raises(HugePagesUnavailable, match="raise --size"):
        size_for(512 * MiB, one_gib)
    assert size_for(SIZE + 4096, plan("auto", offer("never"))) == SIZE + 4096


def test_judge_what_the_mapping_got():
    thp = plan("on", offer("within_size"))
    assert judge(thp, Backing("thp", THP, 64 * MiB, 64 * MiB), 64 * MiB, adopted=None) is None
    with pytest.raises(HugePagesUnavailable, match="compact_memory"):
        judge(thp, Backing("thp", THP, 32 * MiB, 64 * MiB), 64 * MiB, adopted=None)
    with pytest.raises(HugePagesUnavailable, match="remove /r/x.region"):
        judge(thp, Backing("none", hugepages.OS_PAGE, 0, 64 * MiB), 64 * MiB, adopted="/r/x.region")
    warning = judge(plan("auto", offer("always")), Backing("thp", THP, 32 * MiB, 64 * MiB), 64 * MiB, None)
    assert warning.startswith("hugepages=auto")
    assert judge(plan("auto", offer("never")), Backing("none", hugepages.OS_PAGE, 0, 64 * MiB), 64 * MiB,
                 None) is None


# --- regions on real filesystems ------------------------------------------------------------------
def test_region_in_the_tmp_directory_follows_what_it_offers(tmp_path):
    found = hugepages.offer(str(tmp_path))
    region = open_region(tmp_path / "auto")
    try:
        assert region.backing == hugepages.backing(region.data.address)
        if found.kind == "none":
            assert region.backing.kind in ("none", "thp")     # a disk filesystem may map large folios
    finally:
        region.close()
    if found.kind == "none":
        with pytest.raises(RegionError) as info:
            open_region(tmp_path / "on", huge="on")
        assert "hugepages=on" in str(info.value) and "mount" in str(info.value)
        assert not os.path.exists(tmp_path / "on" / "test.region")
        open_region(tmp_path / "on").close()                   # the refusal released the lock


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(huge_option) → a directory on a fresh tmpfs mounted with it, unmounted after the
    test (skips, saying why, where it cannot mount: without root)."""
    with ExitStack() as mounts:
        def mount(option: str) -> str:
            mount_point = str(tmp_path / f"tmpfs-{option}")
            try:
                mounts.enter_context(huge_tmpfs(mount_point, 64 * MiB, huge=option))
            except OSError as exc:
                pytest.skip(f"needs a tmpfs mounted huge={option}, which only root can mount: {exc}")
            return os.path.join(mount_point, "kvtierd")

        yield mount


@pytest.mark.parametrize("option", ["always", "within_size", "advise"])
def test_region_on_a_huge_tmpfs_gets_huge_pages_and_clients_map_them(tmpfs, option):
    directory = tmpfs(option)
    region = open_region(directory, huge="on")
    try:
        assert region.backing.kind == "thp" and region.backing.page_size == THP
        assert region.backing.huge_bytes == region.data.size == os.stat(region.paths.region).st_size
        assert region.data.size % THP == 0
        st = os.stat(region.paths.region)
        assert st.st_blocks * 512 >= st.st_size          # every page reserved (advise: by populating)
        # A client's mapping of the file maps its huge pages as such, without advice of its own.
        client = Mapping.of_file(region.paths.region)
        try:
            assert client.address % THP == 0
            assert client.populate_in_background(threads=2).wait()
            assert hugepages.backing(client.address).huge_bytes == client.size
            region.view.data[:4] = [1, 2, 3, 4]
            assert ctypes.string_at(client.address + region.geometry.data_offset, 4) == b"\x01\x02\x03\x04"
        finally:
            client.close()
    finally:
        region.close()


def test_off_on_a_huge_tmpfs_gets_small_pages_and_on_then_refuses_the_adopted_file(tmpfs):
    directory = tmpfs("always")
    region = open_region(directory, huge="off")
    assert region.backing.kind == "none" and region.backing.resident_bytes == region.data.size
    region.view.data[:3] = [7, 8, 9]
    region.close()
    with pytest.raises(RegionError, match=f"remove {re.escape(region.paths.region)}"):
        open_region(directory, huge="on")
    adopted = open_region(directory, huge="auto")                # auto adopts it and keeps the data
    try:
        assert adopted.adopted and bytes(adopted.view.data[:3]) == b"\x07\x08\x09"
    finally:
        adopted.close()
    assert os.path.exists(region.paths.region)                   # the refusal kept the cache
    os.unlink(region.paths.region)                                # what the message says to do
    recreated = open_region(directory, huge="on")                 # its metadata kept, its data file new
    try:
        assert recreated.data_replaced and recreated.backing.huge_bytes == recreated.data.size
    finally:
        recreated.close()


def test_on_refuses_a_tmpfs_without_huge_pages_naming_its_mount_point(tmpfs):
    directory = tmpfs("never")
    with pytest.raises(RegionError) as info:
        open_region(directory, huge="on")
    mount_point = os.path.dirname(directory)
    assert f"mount -o remount,huge=within_size {mount_point}" in str(info.value)
    assert not os.path.exists(os.path.join(directory, "test.region"))


def hugetlb_free() -> int:
    size = 2 * MiB
    pool = f"/sys/kernel/mm/hugepages/hugepages-{size >> 10}kB"
    try:
        with open(f"{pool}/free_hugepages") as f, open(f"{pool}/resv_hugepages") as g:
            return (int(f.read()) - int(g.read())) * size
    except OSError:
        return 0


def test_region_on_hugetlbfs(tmp_path):
    if hugetlb_free() < SIZE:
        pytest.skip("no free 2 MiB hugetlb pages reserved on this machine (vm.nr_hugepages); tests never reserve any")
    mount_point = tmp_path / "hugetlbfs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs here (needs root): {mounted.stderr.strip()}")
    try:
        region = open_region(mount_point / "kvtierd", huge="on")
        try:
            assert region.backing.kind == "hugetlb" and region.backing.page_size == 2 * MiB
            assert region.data.size % (2 * MiB) == 0
            region.view.data[:2] = [5, 6]
            assert bytes(np.frombuffer(region.data.buffer, np.uint8)[region.geometry.data_offset:][:2]) == b"\5\6"
        finally:
            region.close()
        with pytest.raises(RegionError, match="hugepages=off"):
            open_region(mount_point / "kvtierd", huge="off")
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_messages_name_real_settings():
    from kvtierd import config
    assert set(config.BY_NAME["hugepages"].choices) == set(hugepages.SETTINGS)
    texts = [plan("auto", offer("never")).note, offer("none", fs="ext4").why_not(), offer("deny").why_not()]
    for flag in {f for text in texts for f in re.findall(r"--([a-z-]+)", text)}:
        assert flag.replace("-", "_") in config.BY_NAME, flag

"""Huge pages for the region: what its filesystem offers, what to do at create, what it got.

Every process that maps the region takes one page fault per page the first time it touches it,
and cudaHostRegister pins it page by page: with 4 KiB pages that is 262,144 faults and pins per
GiB in every client process, with 2 MiB pages 512. Which pages the region has is decided by the
filesystem of its directory and by how the file's pages are first allocated:

- **hugetlbfs**: every page is a huge page of the mount's size (2 MiB, or 1 GiB with
  ``pagesize=1G``), taken from the pool the kernel reserved (``vm.nr_hugepages``). The file's
  length must be a multiple of that size, so the region is sized in whole huge pages.
- **tmpfs** mounted ``huge=always`` or ``huge=within_size``: 2 MiB transparent huge pages (THP)
  whenever the kernel can find 2 MiB of free contiguous memory, small pages otherwise.
- **tmpfs** mounted ``huge=advise``: THP only for pages faulted through a mapping advised
  MADV_HUGEPAGE. ``posix_fallocate`` allocates pages with no mapping, hence small ones; so the
  daemon then reserves the region by populating its advised mapping instead (MADV_POPULATE_WRITE
  reports a lack of space as an error, as fallocate does, never as a SIGBUS).
- **tmpfs** mounted ``huge=never`` (the default, and /dev/shm's on most distributions), or any
  other filesystem: 4 KiB pages.

``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` governs the kernel's internal shmem mount
(memfd, SysV shared memory, shared anonymous mappings), not tmpfs mounts, except for its two
override values: ``deny`` forbids THP on every tmpfs, ``force`` gives it to every tmpfs.

Huge pages in the file reach every client: a client's mapping of an existing huge page is
mapped by one page-table entry at its first fault, whatever its own advice (Linux PMD-maps a
file's huge folio when the mapping is 2 MiB-aligned, which tmpfs and hugetlbfs mappings are).

The ``hugepages`` setting: ``auto`` takes what the filesystem gives (one info line when that is
4 KiB pages, naming how to get huge ones); ``on`` refuses to start without huge pages, naming the
mount command or sysctl that gives them; ``off`` asks a tmpfs for small pages (MADV_NOHUGEPAGE)
and refuses hugetlbfs. What the mapping really got is read from ``/proc/self/smaps`` after the
daemon populated it (``Backing``): the start line, ``kvtierctl status`` and the metrics report it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SETTINGS = ("auto", "on", "off")
OS_PAGE = os.sysconf("SC_PAGE_SIZE")
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"
HUGETLB_SYSFS = "/sys/kernel/mm/hugepages"


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class HugePagesUnavailable(Exception):
    """The ``hugepages`` setting cannot be honoured here; the message says what to change."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def thp_page_size() -> int:
    """The size of a transparent huge page (PMD size), 2 MiB on x86-64."""
    text = _read(f"{THP_SYSFS}/hpage_pmd_size")
    return int(text) if text and text.isdigit() else 2 << 20


def shmem_enabled() -> str:
    """The bracketed value of shmem_enabled ("never" when the kernel has no THP)."""
    text = _read(f"{THP_SYSFS}/shmem_enabled") or "[never]"
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "never")


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo, the fields this module reads."""

    mount_point: str
    fs_type: str
    options: dict[str, str]          # the superblock's options (huge=..., pagesize=..., size=...)


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def parse_mountinfo(text: str, dev: int, path: str) -> Mount | None:
    """The mount holding ``path`` (on device ``dev``): of the lines for that device, the one whose
    mount point is the longest prefix of ``path`` (bind mounts show one device several times)."""
    best: Mount | None = None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[2] != want or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 4:
            continue
        mount_point = _unescape(fields[4])
        options = dict((o.split("=", 1) + [""])[:2] for o in fields[sep + 3].split(","))
        mount = Mount(mount_point, fields[sep + 1], options)
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if best is None or (inside and len(mount_point) > len(best.mount_point)):
            best = mount
    return best


@dataclass(frozen=True)
class Offer:
    """What the filesystem of a directory gives a file's pages."""

    directory: str
    mount_point: str
    fs_type: str              # tmpfs, hugetlbfs, ext4, ...
    huge: str                 # hugetlbfs | always | within_size | advise | never | deny (tmpfs), none (others)
    page_size: int            # the huge page size on offer; OS_PAGE when none
    free_huge_bytes: int | None = None   # hugetlbfs: bytes of huge pages the region can still take

    @property
    def kind(self) -> str:
        """hugetlb | thp (every page asks for one) | advise (pages faulted through an advised
        mapping) | none."""
        if self.huge == "hugetlbfs":
            return "hugetlb"
        return {"always": "thp", "within_size": "thp", "advise": "advise"}.get(self.huge, "none")

    def why_not(self) -> str:
        """Why this filesystem gives no huge pages, and the command that changes it."""
        hugetlbfs = ("or put the region on hugetlbfs: `sysctl -w vm.nr_hugepages=<pages of 2 MiB>` then "
                     "`mount -t hugetlbfs -o pagesize=2M none /dev/hugepages` and --dir /dev/hugepages/kvtierd")
        if self.huge == "deny":
            return ("/sys/kernel/mm/transparent_hugepage/shmem_enabled is 'deny', which forbids huge pages on every "
                    "tmpfs: `echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled`, " + hugetlbfs)
        if self.fs_type == "tmpfs":
            return (f"{self.directory} is on a tmpfs mounted without huge pages ({self.mount_point}, huge=never): "
                    f"`mount -o remount,huge=within_size {self.mount_point}` (and huge=within_size in its "
                    f"/etc/fstab line), " + hugetlbfs)
        return (f"{self.directory} is on {self.fs_type} ({self.mount_point}), which gives no huge pages: choose a "
                "--dir on a tmpfs mounted with huge pages (`mount -t tmpfs -o huge=within_size,size=<bytes> tmpfs "
                "<dir>`), " + hugetlbfs)


def offer(directory: str) -> Offer:
    """What the filesystem of ``directory`` (which must exist) offers."""
    path = os.path.realpath(directory)
    mount = parse_mountinfo(_read("/proc/self/mountinfo") or "", os.stat(path).st_dev, path)
    if mount is None:
        return Offer(directory, "?", "?", "none", OS_PAGE)
    if mount.fs_type == "hugetlbfs":
        vfs = os.statvfs(path)
        size = vfs.f_bsize                     # hugetlbfs reports its huge page size as the block size
        pool = f"{HUGETLB_SYSFS}/hugepages-{size >> 10}kB"
        free = int(_read(f"{pool}/free_hugepages") or 0) - int(_read(f"{pool}/resv_hugepages") or 0)
        free_bytes = max(0, free) * size
        if vfs.f_blocks:                       # the mount's own size= limit
            free_bytes = min(free_bytes, vfs.f_bavail * size)
        return Offer(directory, mount.mount_point, "hugetlbfs", "hugetlbfs", size, free_bytes)
    if mount.fs_type != "tmpfs":
        return Offer(directory, mount.mount_point, mount.fs_type, "none", OS_PAGE)
    huge = mount.options.get("huge", "never")
    override = shmem_enabled()
    if override in ("deny", "force"):
        huge = "deny" if override == "deny" else "always"
    page = thp_page_size() if huge in ("always", "within_size", "advise") else OS_PAGE
    return Offer(directory, mount.mount_point, "tmpfs", huge, page)


@dataclass(frozen=True)
class Plan:
    """How the daemon creates and maps the region for a ``hugepages`` setting and an ``Offer``."""

    setting: str
    offer: Offer
    advise: bool | None       # MADV_HUGEPAGE (True) / MADV_NOHUGEPAGE (False) on the daemon's mapping, or none
    reserve_by_populate: bool  # create the file without posix_fallocate (see below)
    expect: str               # hugetlb | thp | none: what the region's pages should be
    align: int                # the file's length is a multiple of this (hugetlbfs: its page size)
    note: str                 # a line for the log when the region gets small pages on purpose or by lack

    # reserve_by_populate: on a tmpfs that may give THP, posix_fallocate would allocate the file's
    # pages before the mapping's advice decides their size (and without a mapping, huge=advise
    # gives small ones); populating the advised mapping reserves them instead.


def plan(setting: str, found: Offer) -> Plan:
    """The plan for ``setting`` (auto | on | off) on ``found``; raises HugePagesUnavailable when
    it cannot be honoured (on without huge pages, off on hugetlbfs)."""
    if setting not in SETTINGS:
        raise ValueError(f"hugepages={setting!r}: use auto, on or off")
    kind = found.kind
    small = f"{_size(OS_PAGE)} pages"
    if setting == "off":
        if kind == "hugetlb":
            raise HugePagesUnavailable(
                f"hugepages=off, but {found.directory} is on hugetlbfs ({found.mount_point}), where every page is a "
                f"{_size(found.page_size)} huge page: choose a --dir on a tmpfs, or set hugepages=auto")
        return Plan(setting, found, False, kind in ("thp", "advise"), "none", OS_PAGE,
                    f"hugepages=off: the region uses {small}")
    if kind == "none":
        if setting == "on":
            raise HugePagesUnavailable(f"hugepages=on, but {found.why_not()}; or set hugepages=auto to start "
                                       f"with {small}")
        return Plan(setting, found, None, False, "none", OS_PAGE,
                    f"hugepages=auto: the region uses {small}, so every client process takes "
                    f"{(1 << 30) // OS_PAGE:,} page faults per GiB at attach (and CUDA clients pin as many pages). "
                    f"For 2 MiB pages: {found.why_not()}")
    if kind == "hugetlb":
        return Plan(setting, found, None, False, "hugetlb", found.page_size, "")
    advise = kind == "advise"
    return Plan(setting, found, True if advise else None, advise, "thp", found.page_size, "")


def size_for(size: int, p: Plan) -> int:
    """The bytes the region's geometry may use: ``size`` in whole pages of the plan's alignment
    (each of the region's files is then rounded up to that alignment where the filesystem needs
    it: ``kvtierd.region``)."""
    usable = size // p.align * p.align
    if usable < p.align or usable <= 0:
        raise HugePagesUnavailable(f"size {size} is below one {_size(p.align)} huge page of "
                                   f"{p.offer.mount_point}; raise --size")
    return usable


def file_lengths(p: Plan, meta_bytes: int, data_bytes: int) -> tuple[int, int]:
    """(metadata file, data file) lengths of a geometry's bytes: the data file in whole huge pages of
    the plan (hugetlbfs insists on it, and a tmpfs's last huge page is then all region); the metadata
    file too on hugetlbfs, which takes nothing else. The geometry fits the size setting; the rounding
    may add less than one huge page per file (the geometry, hence an adopted region, does not depend
    on the pages the filesystem gives)."""
    meta_align = p.align if p.expect == "hugetlb" else 1
    return -(-meta_bytes // meta_align) * meta_align, -(-data_bytes // p.align) * p.align


def space(p: Plan, directory: str, needed: int) -> tuple[int, str]:
    """Bytes a new region file may take in ``directory``, and the command that makes ``needed`` fit."""
    found = p.offer
    if found.free_huge_bytes is not None:
        pool = f"{HUGETLB_SYSFS}/hugepages-{found.page_size >> 10}kB/nr_hugepages"
        missing = -(-max(0, needed - found.free_huge_bytes) // found.page_size)
        total = int(_read(pool) or 0) + missing
        return found.free_huge_bytes, (f"reserve {missing} more {_size(found.page_size)} huge pages (`echo {total} > "
                                       f"{pool}`; vm.nr_hugepages for 2 MiB ones) or raise the size= of "
                                       f"{found.mount_point}")
    vfs = os.statvfs(directory)
    return vfs.f_bavail * vfs.f_frsize, (f"enlarge the filesystem (for a tmpfs: `mount -o remount,size=<bigger> "
                                         f"{found.mount_point}`)")


@dataclass(frozen=True)
class Backing:
    """What a mapping's pages are in this process, from its /proc/self/smaps record."""

    kind: str                 # hugetlb | thp | none
    page_size: int            # bytes of one of its huge pages; OS_PAGE when none
    huge_bytes: int           # bytes of the mapping mapped by huge pages
    resident_bytes: int       # bytes of the mapping in this process's page tables

    def describe(self) -> str:
        if self.kind == "none":
            return f"{_size(OS_PAGE)} pages"
        return (f"{_size(self.page_size)} {'hugetlb' if self.kind == 'hugetlb' else 'THP'} pages "
                f"({_size(self.huge_bytes)} of {_size(self.resident_bytes)} resident)")


def parse_smaps(text: str, address: int) -> Backing:
    """The Backing of the mapping that starts at ``address`` in an smaps text."""
    fields: dict[str, int] | None = None
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            if fields is not None:
                break
            if int(head.split("-")[0], 16) == address:
                fields = {}
        elif fields is not None and line.endswith(" kB"):
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) << 10
    if fields is None:
        raise ValueError(f"no mapping starts at {address:#x}")
    if fields.get("KernelPageSize", OS_PAGE) > OS_PAGE:       # a hugetlb mapping: Rss leaves it out
        hugetlb = fields.get("Shared_Hugetlb", 0) + fields.get("Private_Hugetlb", 0)
        return Backing("hugetlb", fields["KernelPageSize"], hugetlb, hugetlb)
    huge = fields.get("ShmemPmdMapped", 0) + fields.get("FilePmdMapped", 0) + fields.get("AnonHugePages", 0)
    return Backing("thp" if huge else "none", thp_page_size() if huge else OS_PAGE, huge, fields.get("Rss", 0))


def backing(address: int) -> Backing:
    """The Backing of this process's mapping at ``address`` (read once: it walks the page tables)."""
    with open("/proc/self/smaps") as f:
        return parse_smaps(f.read(), address)


def judge(p: Plan, got: Backing, file_bytes: int, adopted: str | None) -> str | None:
    """Whether the populated mapping has the pages the plan expected (``adopted``: the path of a
    region file that existed before, else None). Raises HugePagesUnavailable for hugepages=on
    when it has not; returns a warning line for auto (None when all is well)."""
    if p.expect == "none" or p.expect == "hugetlb":
        return None                          # hugetlbfs cannot give anything else
    whole = file_bytes // p.align * p.align  # a tail past the last whole huge page may stay small
    if got.huge_bytes >= whole:
        return None
    if adopted and got.huge_bytes == 0:
        # Its pages were allocated when it was created; adopting it cannot change them.
        why = (f"the region file was created with small pages: stop kvtierd, remove {adopted} (its cached blocks "
               "are lost) and start again")
    else:
        why = (f"the kernel found huge pages for only {_size(got.huge_bytes)} of {_size(whole)} "
               "(memory too fragmented: `echo 1 > /proc/sys/vm/compact_memory` before starting, or use hugetlbfs "
               "pages reserved at boot: hugepages=<N> on the kernel command line)")
    if p.setting == "on":
        raise HugePagesUnavailable(f"hugepages=on: {why}; or set hugepages=auto")
    return f"hugepages=auto: {why}"

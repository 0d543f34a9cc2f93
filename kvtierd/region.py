"""The region file's life: directory, lock, create or adopt, prefault, pin, watch, clean close.

Whether its pages are huge is decided when the file is created, after ``kvtierd.hugepages``
(the setting, what the filesystem offers, what the populated mapping got).

This module owns files and memory, not meaning: it knows the header (to validate and to mark
clean shutdown) but nothing of what entries mean; the index rebuilds itself from the tables.
The files are those of ``contract.paths``: the region (mode 0660) and the lock, held with
flock(LOCK_EX) for the daemon's whole life and holding its pid, in a daemon-owned directory
(mode 0770, or 0700 without a client group).

A second daemon on the same directory and name finds the lock held and refuses to start. A
restarted daemon takes the lock, then adopts the existing region only if its header validates
and its geometry matches the configuration; otherwise it refuses (naming the setting to change),
unless told to recreate it. Nothing is ever deleted by pattern: only the exact region path, and
only on an explicit recreate.

While the daemon runs, ``check_file`` tells whether the path still holds the file it mapped: a
removed or replaced file is harmless to attached clients but new ones could not map it; a
truncated one means any access past its new end is a SIGBUS, for the daemon and its clients.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import secrets
import stat
import time

import numpy as np

from . import hugepages
from .contract.mapping import Mapping
from .contract.paths import DaemonPaths
from .contract.region_format import HEADER_BYTES, FormatError, Geometry, RegionView, read_geometry

log = logging.getLogger(__name__)


class RegionError(Exception):
    """The region cannot be opened; the message says what to change."""


class RegionLocked(RegionError):
    """Another live daemon holds the region's lock."""


def _resolve_gid(group: str | None) -> int | None:
    if not group:
        return None
    if group.isdigit():          # a numeric gid: container images often lack the group's name
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise RegionError(f"client group {group!r} does not exist; create it (groupadd {group}) "
                          "or change the 'group' setting") from None


def prepare_directory(directory: str, group: str | None) -> int | None:
    """Create (or check) the daemon's directory; returns the client group's gid, if any."""
    gid = _resolve_gid(group)
    mode = 0o2770 if gid is not None else 0o700
    try:
        os.makedirs(directory, mode=mode, exist_ok=True)
    except OSError as exc:
        raise RegionError(f"cannot create directory {directory}: {exc.strerror}; "
                          "choose another with --dir") from None
    st = os.stat(directory)
    if st.st_uid != os.geteuid():
        raise RegionError(f"directory {directory} belongs to uid {st.st_uid}, not to this daemon's uid "
                          f"{os.geteuid()}; choose another with --dir")
    if gid is not None and st.st_gid != gid:
        os.chown(directory, -1, gid)
    os.chmod(directory, mode)
    return gid


class Region:
    """An open, locked, mapped region. Construct with ``Region.open``."""

    def __init__(self, paths: DaemonPaths, lock_fd: int, mapping: Mapping, view: RegionView,
                 adopted: bool, was_clean: bool, pinned: str, prefault: str, gid: int | None,
                 backing: hugepages.Backing):
        self.paths = paths
        self.gid = gid                  # the client group (owns the socket too), or None
        self.mapping = mapping
        self.view = view
        self.geometry = view.geometry
        self.adopted = adopted          # an existing region was taken over
        self.was_clean = was_clean      # ... and its last daemon stopped cleanly
        self.pinned = pinned            # cuda | mlock | off
        self.prefault = prefault        # madvise | touch
        self.backing = backing          # the pages the daemon's mapping got (read once, after prefault)
        self._lock_fd = lock_fd
        st = os.stat(paths.region)
        self._identity = (st.st_dev, st.st_ino)     # the file mapped, for check_file
        self.problem: str | None = None              # what check_file found last

    @property
    def generation(self) -> int:
        return int(self.view.header["generation"])

    def check_file(self) -> bool:
        """Whether the region path still holds the file mapped, whole; a change is logged once.

        Sets ``problem`` (None, "removed", "replaced by another file" or "truncated"). Returns
        False when the daemon must stop: the file was truncated, so any access past its new end
        would kill the daemon or its clients with SIGBUS.
        """
        path = self.paths.region
        try:
            st = os.stat(path)
        except FileNotFoundError:
            problem = "removed"
        else:
            if (st.st_dev, st.st_ino) != self._identity:
                problem = "replaced by another file"
            elif st.st_size < self.geometry.file_bytes:
                problem = "truncated"
            else:
                problem = None
        if problem == self.problem:
            return problem != "truncated"
        self.problem = problem
        if problem is None:
            log.info("region file %s is back", path)
        elif problem == "truncated":
            log.critical("region file %s was truncated under the daemon (%d < %d bytes); stopping before any "
                         "access past its end kills this daemon or its clients. Restart with --recreate.",
                         path, st.st_size, self.geometry.file_bytes)
            return False
        else:
            log.error("region file %s was %s while the daemon runs: attached clients keep working, new ones "
                      "cannot map it. Restart kvtierd to recreate it (cached blocks are lost).", path, problem)
        return True

    @classmethod
    def open(cls, directory: str, name: str, size_bytes: int, page_size: int, pin: str = "auto",
             group: str | None = None, recreate: bool = False, prefault_threads: int = 4,
             progress=None, huge: str = "auto") -> "Region":
        paths = DaemonPaths(directory, name)
        gid = prepare_directory(directory, group)
        lock_fd = _take_lock(paths, gid)
        try:
            plan = hugepages.plan(huge, hugepages.offer(directory))
            wanted = Geometry.for_size(hugepages.size_for(size_bytes, plan), page_size)
        except hugepages.HugePagesUnavailable as exc:
            os.close(lock_fd)
            raise RegionError(str(exc)) from None
        except ValueError as exc:
            os.close(lock_fd)
            raise RegionError(f"{exc} (settings 'size', 'page_size' and 'hugepages')") from None
        if plan.note:
            log.info("%s", plan.note)
        try:
            adopted = os.path.exists(paths.region) and _adoptable(paths.region, wanted, recreate)
            if not adopted:
                _create_file(paths.region, wanted, gid, plan)
            mapping = Mapping.of_file(paths.region)
        except BaseException:
            os.close(lock_fd)
            raise
        try:
            if plan.advise is not None:
                mapping.advise_huge(plan.advise)
            try:
                method = mapping.prefault(threads=prefault_threads, progress=progress)
            except OSError as exc:
                if adopted or not plan.reserve_by_populate:
                    raise
                # Populating is what reserves the file's pages here (see hugepages.Plan).
                raise RegionError(f"cannot reserve {_gib(mapping.size)} in {directory}: {exc.strerror}; lower "
                                  "--size or free space there") from None
            backing = hugepages.backing(mapping.address)
            try:
                warning = hugepages.judge(plan, backing, mapping.size, paths.region if adopted else None)
            except hugepages.HugePagesUnavailable as exc:
                raise RegionError(str(exc)) from None
            if warning:
                log.warning("%s", warning)
            pinned = mapping.pin(pin)
            view = RegionView(mapping.buffer, wanted)
            if adopted:
                was_clean = bool(view.header["clean_shutdown"])
            else:
                view.format(generation=secrets.randbits(63) or 1, created_unix_ns=time.time_ns())
                was_clean = True
            view.header["clean_shutdown"] = 0   # a daemon runs on it now
        except BaseException:
            mapping.close()
            if not adopted:
                # Never leave a file without a valid header behind: the next start would refuse it.
                os.unlink(paths.region)
            os.close(lock_fd)
            raise
        return cls(paths, lock_fd, mapping, view, adopted, was_clean, pinned, method, gid, backing)

    def new_generation(self) -> int:
        """Give the region a new generation id (its content was rebuilt: clients must remap)."""
        gen = secrets.randbits(63) or 1
        self.view.header["generation"] = gen
        return gen

    def close(self, clean: bool = True) -> None:
        """Unmap and release the lock. ``clean`` records a clean shutdown in the header."""
        if self.mapping.address is None:
            return
        if clean:
            self.view.header["clean_shutdown"] = 1
        self.view = None  # drop NumPy views before the memory goes away
        self.mapping.close()
        os.close(self._lock_fd)


def _take_lock(paths: DaemonPaths, gid: int | None) -> int:
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise RegionLocked(f"another kvtierd (pid {holder}) holds {paths.lock}: it already serves "
                               f"region {paths.region}. Stop it (systemctl stop kvtierd) or start this one "
                               "with a different --name or --dir") from None
        raise
    # The lock is ours: a stale pid from a dead daemon is simply overwritten.
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        # hugetlbfs (a --dir for 2 MiB/1 GiB pages) takes no write(2): the lock holds without its pid.
    if gid is not None:
        os.fchown(fd, -1, gid)
    return fd


def _adoptable(path: str, wanted: Geometry, recreate: bool) -> bool:
    """True if the existing file is a valid region of the wanted geometry; False if it is to be
    recreated; raises RegionError (saying what to do) otherwise."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{path} exists and is not a regular file; remove it or choose another --name")
    try:
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype=np.uint8)
        found = read_geometry(head)
        if st.st_size < found.file_bytes:
            raise FormatError(f"file is {st.st_size} bytes, its header says {found.file_bytes} (truncated)")
    except FormatError as exc:
        if recreate:
            log.warning("recreating %s: %s", path, exc)
            os.unlink(path)
            return False
        raise RegionError(f"{path} is not a usable kvtierd region ({exc}); start with --recreate to "
                          "replace it (its cached blocks are lost)") from None
    if found != wanted:
        if recreate:
            log.warning("recreating %s: geometry changed (%d pages of %d B -> %d pages of %d B)", path,
                        found.num_pages, found.page_size, wanted.num_pages, wanted.page_size)
            os.unlink(path)
            return False
        raise RegionError(f"{path} holds a region of {found.file_bytes} bytes in {found.page_size}-byte pages, "
                          f"but the settings ask for {wanted.file_bytes} bytes in {wanted.page_size}-byte pages; "
                          "set 'size'/'page_size' back, or start with --recreate to replace it (its cached "
                          "blocks are lost)")
    return True


def _create_file(path: str, geo: Geometry, gid: int | None, plan: hugepages.Plan) -> None:
    directory = os.path.dirname(path)
    # Whole huge pages: hugetlbfs insists on it, and a tmpfs's last huge page is then all region.
    length = -(-geo.file_bytes // plan.align) * plan.align
    available, enlarge = hugepages.space(plan, directory, length)
    if available < length:
        raise RegionError(
            f"region needs {_gib(length)} but {directory} has {_gib(available)} free; lower the "
            f"'size' setting (--size) or {enlarge}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o660)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)
        try:
            os.ftruncate(fd, length)
            if not plan.reserve_by_populate:
                # Reserve every page now: on tmpfs a later page fault past the free space is a SIGBUS.
                os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            os.unlink(path)
            raise RegionError(f"cannot reserve {_gib(length)} in {directory}: {exc.strerror}; "
                              "lower --size or free space there") from None
    finally:
        os.close(fd)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"

"""The region's files and their life: directory, lock, create or adopt, prefault, pin, watch, clean close.

Whether the pages clients map are huge is decided when the data file is created, after
``kvtierd.hugepages`` (the setting, what the filesystem offers, what the populated mapping got).

This module owns files and memory, not meaning: it knows the headers (to validate, to mark a clean
shutdown) but nothing of what entries mean; the index rebuilds itself from the tables. The files
are those of ``contract.paths``, in a daemon-owned directory (mode 2750 with a client group: its
members may enter it, not create, rename or remove anything there; 0700 without):

- ``<name>.meta`` (0600): the header and every table (the page fence's writer and fence tables
  too); mapped by the daemon alone.
- ``<name>.region`` (0660, the client group): the pages clients map. The daemon maps it too, but
  touches it only while starting (prefault, pinning, recovery's checksum check) and writes its
  header with ``pwrite``: a member of the group can truncate it (it can write it), and no access
  of the daemon's may then meet a SIGBUS. (hugetlbfs takes no write(2): there the header is
  written through the daemon's mapping, once, while it starts or replaces the file.)
- ``<name>.lock``: flock(LOCK_EX) held for the daemon's whole life, holding its pid.

A second daemon on the same directory and name finds the lock held and refuses to start. A
restarted daemon takes the lock, then adopts the metadata only if its header validates and its
geometry matches the configuration, otherwise refuses (naming the setting to change) unless told
to recreate. A data file that does not match the adopted metadata (missing, truncated, of another
generation) holds nothing usable: a fresh one replaces it, and ``data_replaced`` tells the daemon
to drop every entry. Adopted files get the configured group and modes again. Nothing is ever
deleted by pattern: only the region's exact paths.

While the daemon runs, ``check_files`` tells whether the paths still hold the files it mapped. A
removed or replaced file is reported; a truncated metadata file stops the daemon (only its own
user can do that); a truncated data file is replaced (``replace_data``: a new file, a new
generation), because the cached blocks in it are gone and every client touching it gets SIGBUS.
"""

from __future__ import annotations

import ctypes
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
from .contract.mapping import Mapping, mlock_refusal
from .contract.paths import DaemonPaths
from .contract.region_format import HEADER_BYTES, FormatError, Geometry, read_geometry
from .contract.region_view import DataHeader, RegionView

log = logging.getLogger(__name__)

META_MODE = 0o600       # the daemon's user alone
DATA_MODE = 0o660       # and the client group, which maps it


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
    """Create (or check) the daemon's directory; returns the client group's gid, if any.

    With a group: 2750. Its members enter it and open the socket and the data file; they create
    nothing there, so they get no write permission on it (with it, any of them could rename or
    remove the socket, the lock or the region under the daemon)."""
    gid = _resolve_gid(group)
    mode = 0o2750 if gid is not None else 0o700
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

    def __init__(self, paths: DaemonPaths, lock_fd: int, meta: Mapping, data: Mapping, view: RegionView,
                 adopted: bool, was_clean: bool, data_replaced: bool, pin: str, pinned: str, prefault: str,
                 gid: int | None, prefault_threads: int, plan: hugepages.Plan, backing: hugepages.Backing):
        self.paths = paths
        self.gid = gid                  # the client group (owns the socket and the data file too), or None
        self.meta = meta
        self.data = data
        self.view = view
        self.geometry = view.geometry
        self.adopted = adopted          # existing metadata was taken over
        self.was_clean = was_clean      # ... and its last daemon stopped cleanly
        self.data_replaced = data_replaced   # ... but its data file was not usable: entries must go
        self._pin = pin
        self.pinned = pinned            # cuda | mlock | off
        self.prefault = prefault        # madvise | touch | none (an adopted file the daemon left unpopulated)
        self._prefault_threads = prefault_threads
        self._plan = plan
        self.backing = backing          # the pages the daemon's mapping of the data file got (after prefault)
        self._lock_fd = lock_fd
        self._identity = {path: _identity(path) for path in (paths.meta, paths.region)}
        self.problem: str | None = None              # what check_files found last

    @property
    def generation(self) -> int:
        return int(self.view.header["generation"])

    # ------------------------------------------------------------------ the watch
    def check_files(self) -> str:
        """Whether the paths still hold the files mapped, whole; a change is logged once.

        Sets ``problem`` (None, or "<file> removed | replaced by another file | truncated") and
        returns what the daemon must do: "ok"; "stop" (the metadata file was truncated: its next
        access may be a SIGBUS); "replace data" (the data file was truncated: its blocks are gone,
        clients touching it get SIGBUS; ``replace_data``)."""
        problems = []
        action = "ok"
        for path, size, what in ((self.paths.meta, self.geometry.meta_bytes, "metadata file"),
                                 (self.paths.region, self.geometry.data_bytes, "region file")):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                problems.append(f"{what} removed")
                continue
            if (st.st_dev, st.st_ino) != self._identity[path]:
                problems.append(f"{what} replaced by another file")
            elif st.st_size < size:
                problems.append(f"{what} truncated")
                action = "stop" if path == self.paths.meta else "replace data"
        problem = "; ".join(problems) or None
        if problem != self.problem:
            self.problem = problem
            if problem is None:
                log.info("region files in %s are back", self.paths.directory)
            elif action == "stop":
                log.critical("%s under the daemon: stopping before an access past its end kills it. "
                             "Restart with --recreate.", problem)
            elif action == "ok":
                log.error("%s while the daemon runs: attached clients keep working, new ones cannot map it. "
                          "Restart kvtierd to recreate it (cached blocks are lost).", problem)
        return action

    def replace_data(self) -> int:
        """Put a fresh data file in place of the mapped one, under a new generation; returns it.

        The entries must have been dropped first (their pages were in the old file). The old
        file is unmapped, never read: it may have been truncated. A client still copying into it
        copies into a file nobody maps any more."""
        old = self.data
        old.close()
        generation = secrets.randbits(63) or 1
        tmp = self.paths.region + ".new"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        directory = self.paths.directory
        _, length = hugepages.file_lengths(self._plan, self.geometry.meta_bytes, self.geometry.data_bytes)
        _create_file(tmp, length, DATA_MODE, self.gid, self._plan)
        self.data, _ = _map_data(tmp, self._plan, self._prefault_threads, None, directory)
        _write_data_header(tmp, DataHeader.of(self.geometry, generation), self.data)
        os.replace(tmp, self.paths.region)
        self.backing = hugepages.backing(self.data.address)
        self.pinned = self.data.pin(self._pin)
        self.view.attach_data(self.data.buffer)
        self.view.header["generation"] = generation
        self._identity[self.paths.region] = _identity(self.paths.region)
        self.problem = None
        return generation

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, directory: str, name: str, size_bytes: int, page_size: int, pin: str = "auto",
             group: str | None = None, recreate: bool = False, prefault_threads: int = 4,
             progress=None, huge: str = "auto") -> "Region":
        paths = DaemonPaths(directory, name)
        gid = prepare_directory(directory, group)
        lock_fd = _take_lock(paths, gid)
        try:
            plan, wanted, meta_length, data_length = _plan(directory, size_bytes, page_size, huge, pin)
        except RegionError:
            os.close(lock_fd)
            raise
        created: list[str] = []
        meta = data = None
        try:
            adopted = os.path.exists(paths.meta) and _adoptable(paths.meta, wanted, recreate)
            if not adopted:
                _clear_data_path(paths, recreate)
                _check_space(plan, directory, meta_length + data_length)
                _create_file(paths.meta, meta_length, META_MODE, None, plan, metadata=True)
                created.append(paths.meta)
            else:
                _reserve(paths.meta, meta_length, META_MODE, None, directory)
            meta = Mapping.of_file(paths.meta)
            view = RegionView(meta.buffer, geometry=wanted)
            if adopted:
                was_clean = bool(view.header["clean_shutdown"])
                generation = int(view.header["generation"])
                why = _data_unusable(paths.region, wanted, generation)
            else:
                view.format(generation=secrets.randbits(63) or 1, created_unix_ns=time.time_ns())
                was_clean, generation, why = True, int(view.header["generation"]), "new"
            data_replaced = why is not None
            if data_replaced:
                if adopted:
                    log.warning("region file %s %s: its cached blocks are gone; a fresh one replaces it",
                                paths.region, why)
                    view.clear_entries()        # entries, and the fence's writers and pages: all of that file
                    generation = secrets.randbits(63) or 1
                    view.header["generation"] = generation
                if os.path.lexists(paths.region):
                    os.unlink(paths.region)
                _check_space(plan, directory, data_length)
                _create_file(paths.region, data_length, DATA_MODE, gid, plan)
                created.append(paths.region)
            elif not plan.reserve_by_populate:
                _reserve(paths.region, data_length, DATA_MODE, gid, directory)
            else:                               # populating the advised mapping reserves it (hugepages.Plan)
                _reserve(paths.region, 0, DATA_MODE, gid, directory)
            meta.prefault(threads=1)
            # The daemon copies no block: its own mapping of the data needs page tables only to
            # reserve a new file's pages (populating them), to pin them, or to see which pages a
            # file that may have huge ones got. An adopted file reserved by fallocate, unpinned,
            # of small pages, is mapped as it is (a restart with a 4 GiB region: 0.6 s less here).
            populate = data_replaced or pin != "off" or plan.reserve_by_populate or plan.expect != "none"
            data, method = _map_data(paths.region, plan, prefault_threads, progress, directory, populate)
            if data_replaced:       # after populating: a write first would give the header's chunk small pages
                _write_data_header(paths.region, DataHeader.of(wanted, generation), data)
            backing = hugepages.backing(data.address)
            try:
                warning = hugepages.judge(plan, backing, data.size, None if data_replaced else paths.region)
            except hugepages.HugePagesUnavailable as exc:
                raise RegionError(str(exc)) from None
            if warning:
                log.warning("%s", warning)
            pinned = data.pin(pin)
            view.attach_data(data.buffer)
            view.header["clean_shutdown"] = 0   # a daemon runs on it now
        except BaseException:
            for mapping in (meta, data):
                if mapping is not None:
                    mapping.close()
            for path in created:       # never leave a file without a valid header behind
                if os.path.lexists(path):
                    os.unlink(path)
            os.close(lock_fd)
            raise
        return cls(paths, lock_fd, meta, data, view, adopted, was_clean, adopted and data_replaced, pin, pinned,
                   method, gid, prefault_threads, plan, backing)

    def new_generation(self) -> int:
        """Give the region a new generation id (its content was rebuilt: clients must remap). The
        data file's header follows, written at start (``_write_data_header``)."""
        gen = secrets.randbits(63) or 1
        self.view.header["generation"] = gen
        _write_data_header(self.paths.region, DataHeader.of(self.geometry, gen), self.data)
        return gen

    def close(self, clean: bool = True, remove: bool = False) -> None:
        """Unmap and release the lock. ``clean`` records a clean shutdown in the header; ``remove``
        deletes the region's files (a failed start's fresh region: nothing cached, its size held in
        memory), while the lock is still held."""
        if self.meta.address is None:
            return
        if clean:
            self.view.header["clean_shutdown"] = 1
        self.view = None  # drop NumPy views before the memory goes away
        self.data.close()
        self.meta.close()
        if remove:
            for path in (self.paths.region, self.paths.meta):
                if os.path.lexists(path):
                    os.unlink(path)
        os.close(self._lock_fd)


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _plan(directory: str, size_bytes: int, page_size: int, huge: str,
          pin: str) -> tuple[hugepages.Plan, Geometry, int, int]:
    """What the settings make of a region in ``directory``: the huge-page plan, the geometry and the
    two files' lengths (RegionError, naming the settings, when they cannot be had)."""
    try:
        plan = hugepages.plan(huge, hugepages.offer(directory))
        wanted = Geometry.for_size(hugepages.size_for(size_bytes, plan), page_size)
    except hugepages.HugePagesUnavailable as exc:
        raise RegionError(str(exc)) from None
    except ValueError as exc:
        raise RegionError(f"{exc} (settings 'size', 'page_size' and 'hugepages')") from None
    if plan.note:
        log.info("%s", plan.note)
    meta_length, data_length = hugepages.file_lengths(plan, wanted.meta_bytes, wanted.data_bytes)
    refusal = mlock_refusal(data_length) if pin == "mlock" else None
    if refusal is not None:
        raise RegionError(refusal)
    return plan, wanted, meta_length, data_length


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
    """True if the existing metadata file is valid and of the wanted geometry; False if it is to
    be recreated; raises RegionError (saying what to do) otherwise."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{path} exists and is not a regular file; remove it or choose another --name")
    try:
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype=np.uint8)
        found = read_geometry(head)
        if st.st_size < found.meta_bytes:
            raise FormatError(f"file is {st.st_size} bytes, its header says {found.meta_bytes} (truncated)")
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
        raise RegionError(f"{path} holds a region of {found.num_pages} pages of {found.page_size} bytes, but the "
                          f"settings ask for {wanted.num_pages} pages of {wanted.page_size} bytes; set "
                          "'size'/'page_size' back, or start with --recreate to replace it (its cached blocks are lost)")
    return True


def _data_unusable(path: str, geo: Geometry, generation: int) -> str | None:
    """Why the data file at ``path`` cannot go with adopted metadata of ``generation``, or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_size < geo.data_bytes:
        return f"is {st.st_size} bytes, not {geo.data_bytes} (truncated)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            found = DataHeader.read(os.pread(fd, HEADER_BYTES, 0))
        finally:
            os.close(fd)
    except (OSError, FormatError) as exc:
        return f"is unreadable ({exc})"
    if found != DataHeader.of(geo, generation):
        return "belongs to another region (generation or geometry differs from the metadata's)"
    return None


def _clear_data_path(paths: DaemonPaths, recreate: bool) -> None:
    """Before new metadata is made: a data file of ours left without metadata is useless and goes;
    anything else there (a region of format 1, kept in one file) only with --recreate."""
    if not os.path.lexists(paths.region):
        return
    try:
        with open(paths.region, "rb") as f:
            DataHeader.read(f.read(HEADER_BYTES))
    except (OSError, FormatError) as exc:
        if not recreate:
            raise RegionError(f"{paths.region} is not a usable kvtierd region file ({exc}); start with --recreate "
                              "to replace it (its cached blocks are lost)") from None
        log.warning("recreating %s: %s", paths.region, exc)
    os.unlink(paths.region)


def _check_space(plan: hugepages.Plan, directory: str, nbytes: int) -> None:
    available, enlarge = hugepages.space(plan, directory, nbytes)
    if available < nbytes:
        raise RegionError(f"region needs {_gib(nbytes)} but {directory} has {_gib(available)} free; lower the "
                          f"'size' setting (--size) or {enlarge}")


def _create_file(path: str, length: int, mode: int, gid: int | None, plan: hugepages.Plan,
                 metadata: bool = False) -> None:
    """A new file of ``length`` bytes, owned by ``gid`` with ``mode``, every block reserved (on
    tmpfs a later fault past the free space is a SIGBUS) — but for a data file whose advised
    mapping reserves its pages by populating them (``hugepages.Plan.reserve_by_populate``)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        try:
            os.ftruncate(fd, length)
            if metadata or not plan.reserve_by_populate:
                os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            os.unlink(path)
            raise RegionError(f"cannot reserve {_gib(length)} in {os.path.dirname(path)}: {exc.strerror}; "
                              "lower --size or free space there") from None
    finally:
        os.close(fd)


def _map_data(path: str, plan: hugepages.Plan, threads: int, progress, directory: str,
              populate: bool = True) -> tuple[Mapping, str]:
    """The daemon's mapping of a data file, advised for the plan and populated (unless not
    ``populate``). Returns it and the prefault method (none: not populated)."""
    data = Mapping.of_file(path)
    try:
        if plan.advise is not None:
            data.advise_huge(plan.advise)
        if not populate:
            return data, "none"
        try:
            method = data.prefault(threads=threads, progress=progress)
        except OSError as exc:      # EFAULT: a page that cannot be backed (the space to populate it is not there)
            available, enlarge = hugepages.space(plan, directory, data.size)
            raise RegionError(f"cannot fault in the region ({exc.strerror}): {directory} has {_gib(available)} free "
                              f"for {_gib(data.size)}; lower --size or {enlarge}") from None
    except BaseException:
        data.close()
        raise
    return data, method


def _reserve(path: str, size: int, mode: int, gid: int | None, directory: str) -> None:
    """An adopted file: the configured group and mode again (a region made without --group keeps
    no stale group), and its first ``size`` bytes reserved (a sparse file on a full filesystem
    would fail its prefault with EFAULT, or SIGBUS later)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.fchown(fd, -1, gid if gid is not None else os.getegid())
        os.fchmod(fd, mode)
        try:
            if size and os.fstat(fd).st_blocks * 512 < size:    # not wholly allocated already
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            vfs = os.statvfs(directory)
            raise RegionError(f"cannot reserve the {_gib(size)} of {path} ({exc.strerror}): {directory} has "
                              f"{_gib(vfs.f_bavail * vfs.f_frsize)} free; free space there or lower --size "
                              "(with --recreate)") from None
    finally:
        os.close(fd)


def _write_data_header(path: str, header: DataHeader, mapping: Mapping) -> None:
    """Write the data file's header with pwrite (a truncated file cannot SIGBUS a write(2)); on
    hugetlbfs, which takes no write(2), through ``mapping`` (the daemon's, just populated)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, header.to_bytes(), 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        head = header.to_bytes()
        ctypes.memmove(mapping.address, head, len(head))
    finally:
        os.close(fd)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"

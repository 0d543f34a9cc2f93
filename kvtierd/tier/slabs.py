"""One slot size of the disk tier: its data and record files, the I/O into them, and what is
known of each slot in memory (``diskformat`` has the layout).

Blocks move with ``O_DIRECT`` straight between the region's pages and the data file: the extents
of blocks in consecutive slots are the ``iovec`` of one ``pwritev``/``preadv`` (no staging copy,
no page cache; a run of small blocks is one large I/O). Only
the tail of an extent that does not end on ``ALIGN`` — a shard's last, partly used page — goes
through a small aligned bounce buffer (under 4 KiB per shard, one memcpy), so nothing past the
block's bytes is read from or written into the region. A filesystem that refuses ``O_DIRECT``
(EINVAL at open), or memory not aligned for it, is served with buffered I/O: the page cache's
copy then remains (``direct`` False in ``kvtierctl status``).

The data file grows by preallocated chunks (``posix_fallocate``: no fragmentation, no ENOSPC on
a later write into it); a slot given up to make room for another slot size is punched out
(``FALLOC_FL_PUNCH_HOLE``) and preallocated again before it is reused. The record file grows
first, so every data slot has a record (a new one reads as zeros: empty).

In memory, per slot (numpy arrays): ``index`` (the block's ``digest_index``; 0: empty), ``tick``
(last use: the eviction order), ``ns`` (the namespace's number, ``DiskBackend``), ``busy`` (a
read or write in flight: neither handed out nor evicted) and ``hole`` (maybe not allocated: punched,
or free since before a restart). The caller (``disk.DiskBackend``) holds its lock around them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

from .backend import Block
from .diskformat import ALIGN, RECORD, sync_directory

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_bounce = threading.local()


def _bounce_buffer(n: int) -> memoryview:
    """This thread's aligned scratch of at least ``n`` bytes (page-aligned: an anonymous mapping)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < n:
        buf = _bounce.buf = mmap.mmap(-1, max(n, 16 * ALIGN))
    return memoryview(buf)


def runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """Sorted slot numbers → (first, count) of each run of consecutive ones."""
    if not len(slots):
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots)]))
    return [(int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]


class Slab:
    """The slots of one size ``size`` in ``directory``."""

    def __init__(self, directory: str, size: int, direct: bool, writable: bool):
        self.size = size
        self.directory = directory
        base = os.path.join(directory, f"slots-{size}")
        self.data_path, self.rec_path = base + ".data", base + ".rec"
        created = not os.path.exists(self.data_path)
        mode = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        self.rec_fd = os.open(self.rec_path, mode, 0o600)
        self.data_fd = os.open(self.data_path, mode, 0o600)
        self.direct_fd = None
        if direct:
            try:
                self.direct_fd = os.open(self.data_path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:       # EINVAL: the filesystem has no O_DIRECT
                    raise
        if created:
            sync_directory(directory)
        self.slots = os.fstat(self.data_fd).st_size // size
        self.index = np.zeros(self.slots, np.uint64)
        self.tick = np.zeros(self.slots, np.int64)
        self.ns = np.zeros(self.slots, np.uint32)
        self.busy = np.zeros(self.slots, np.uint16)
        self.hole = np.zeros(self.slots, bool)

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    def close(self) -> None:
        for fd in (self.direct_fd, self.data_fd, self.rec_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None

    # ------------------------------------------------------------------ records
    def load(self) -> np.ndarray:
        """Every slot's record as stored (zeros past the record file's end)."""
        out = np.zeros(self.slots, RECORD)
        raw = out.view(np.uint8)
        got = os.preadv(self.rec_fd, [raw], 0) if len(raw) else 0
        raw[got:] = 0
        return out

    def read_records(self, slots: Sequence[int]) -> np.ndarray:
        """The records of ``slots`` (in their order), one pread per run of consecutive slots."""
        slots = np.asarray(slots, np.int64)
        order = np.argsort(slots, kind="stable")
        ordered = np.zeros(len(slots), RECORD)
        raw = ordered.view(np.uint8)
        at = 0
        for first, count in runs(slots[order]):
            os.preadv(self.rec_fd, [raw[at * RECORD.itemsize:(at + count) * RECORD.itemsize]],
                      first * RECORD.itemsize)
            at += count
        out = np.empty_like(ordered)
        out[order] = ordered
        return out

    def write_records(self, slots: np.ndarray, records: np.ndarray) -> None:
        """Write ``records`` at ``slots`` (sorted), one pwrite per run of consecutive slots."""
        at = 0
        for first, count in runs(slots):
            chunk = records[at:at + count].view(np.uint8)
            if os.pwrite(self.rec_fd, chunk, first * RECORD.itemsize) != chunk.nbytes:
                raise OSError(errno.EIO, "short write of disk tier records")
            at += count

    def sync_records(self) -> None:
        os.fdatasync(self.rec_fd)

    def sync_data(self) -> None:
        os.fdatasync(self.data_fd)

    # ------------------------------------------------------------------ space
    def allocated(self) -> int:
        """Bytes the filesystem allocated to this slab (preallocated extents included)."""
        return (os.fstat(self.data_fd).st_blocks + os.fstat(self.rec_fd).st_blocks) * 512

    def extend(self, count: int) -> None:
        """``count`` more slots, preallocated: records first (zeros: empty), then the data. The
        records' zeros are written, not left sparse or preallocated: a record written later is
        then an overwrite, which an fdatasync of either file need not journal (on ext4, records
        written into newly allocated blocks made each batch's fdatasync of the data 160-220 ms
        instead of a few: the journal commit wrote them out too)."""
        new = self.slots + count
        zeros = bytes(RECORD.itemsize * min(count, 1 << 14))
        for first in range(self.slots, new, 1 << 14):
            chunk = zeros[:RECORD.itemsize * min(1 << 14, new - first)]
            if os.pwrite(self.rec_fd, chunk, first * RECORD.itemsize) != len(chunk):
                raise OSError(errno.ENOSPC, "short write of disk tier records")
        os.posix_fallocate(self.data_fd, self.slots * self.size, count * self.size)
        self.index = np.concatenate((self.index, np.zeros(count, np.uint64)))
        self.tick = np.concatenate((self.tick, np.zeros(count, np.int64)))
        self.ns = np.concatenate((self.ns, np.zeros(count, np.uint32)))
        self.busy = np.concatenate((self.busy, np.zeros(count, np.uint16)))
        self.hole = np.concatenate((self.hole, np.zeros(count, bool)))
        self.slots = new

    def back(self, slots: np.ndarray) -> None:
        """Preallocate slots that may be holes (a no-op where the space is still allocated)."""
        for first, count in runs(np.sort(slots)):
            os.posix_fallocate(self.data_fd, first * self.size, count * self.size)
        self.hole[slots] = False

    def punch(self, slots: np.ndarray) -> bool:
        """Give the slots' space back to the filesystem; False where it cannot punch holes."""
        for first, count in runs(np.sort(slots)):
            if _libc.fallocate(self.data_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, first * self.size,
                               count * self.size) != 0:
                err = ctypes.get_errno()
                if err in (errno.EOPNOTSUPP, errno.ENOSYS):
                    return False
                raise OSError(err, os.strerror(err))
        self.hole[slots] = True
        return True

    # ------------------------------------------------------------------ blocks
    def _iov(self, memory: memoryview, blocks: Sequence[Block]) -> tuple[list, list]:
        """The iovec of ``blocks`` in consecutive slots over ``memory`` (each extent's tail
        through this thread's bounce buffer), and the tails to copy as (region view, bounce view)."""
        tails = sum(1 for block in blocks for _, n in block if n % ALIGN)
        bounce = _bounce_buffer(tails * ALIGN) if tails else None
        iov, copies, t = [], [], 0
        for block in blocks:
            for off, n in block:
                whole = n - n % ALIGN
                if whole:
                    iov.append(memory[off:off + whole])
                if n % ALIGN:
                    b = bounce[t * ALIGN:(t + 1) * ALIGN]
                    copies.append((memory[off + whole:off + n], b))
                    iov.append(b)
                    t += 1
        return iov, copies

    def _fd_for(self, blocks: Sequence[Block]) -> int:
        if self.direct_fd is not None and all(off % ALIGN == 0 for block in blocks for off, _ in block):
            return self.direct_fd
        return self.data_fd

    def write_blocks(self, slot: int, memory: memoryview, blocks: Sequence[Block]) -> None:
        """Write ``blocks`` into slots ``slot``, ``slot + 1``, ...: one ``pwritev`` (per IOV_MAX
        extents), so a run of small blocks is one large I/O."""
        iov, copies = self._iov(memory, blocks)
        for region, bounce in copies:
            bounce[:len(region)] = region
            bounce[len(region):] = bytes(ALIGN - len(region))
        self._vectored(os.pwritev, self._fd_for(blocks), iov, slot * self.size, len(blocks) * self.size)

    def read_blocks(self, slot: int, memory: memoryview, blocks: Sequence[Block]) -> None:
        """Read slots ``slot``, ``slot + 1``, ... into ``blocks``: one ``preadv`` (per IOV_MAX extents)."""
        iov, copies = self._iov(memory, blocks)
        self._vectored(os.preadv, self._fd_for(blocks), iov, slot * self.size, len(blocks) * self.size)
        for region, bounce in copies:
            region[:] = bounce[:len(region)]

    @staticmethod
    def _vectored(call, fd: int, iov: list, offset: int, total: int) -> None:
        done = 0
        for i in range(0, len(iov), IOV_MAX):
            part = iov[i:i + IOV_MAX]
            want = sum(v.nbytes for v in part)
            got = call(fd, part, offset + done)
            if got != want:
                raise OSError(errno.EIO, f"short {call.__name__} of disk tier slots ({got} of {want} bytes)")
            done += got
        if done != total:
            raise OSError(errno.EIO, "disk tier blocks do not fill their slots")

"""Shared file mappings with a known address, and the host-memory pinning of a mapping.

Python's ``mmap`` hides the mapping's address, but both sides need it: the client hands page
addresses to its copier (memmove on the CPU, UVA pointers for the CUDA kernel), and pinning
(``cudaHostRegister``, ``mlock``) takes an address. So regions are mapped here through libc.

Pinning modes (``pin`` setting): ``cuda`` registers the mapping with cudaHostRegister in chunks of
at most 64 GiB on page boundaries, unregistering what was done if a chunk fails; ``mlock`` locks
it; ``auto`` tries cuda when a CUDA device is usable, then mlock when RLIMIT_MEMLOCK allows it,
else leaves the mapping unpinned (and says so in one warning line); ``off`` does nothing.
Pinning is per process: the daemon's pin does not cover a client's mapping.

Page tables are per process too: every process that maps the region takes a fault per page on
first touch. ``prefault`` populates a mapping before returning (the daemon at start);
``populate_in_background`` does it on a few cancellable threads (a client at attach). Which
pages the file has (4 KiB, or huge: a tmpfs mounted ``huge=``, hugetlbfs) is decided where the
file is created; ``advise_huge`` sets the advice that decides it on a tmpfs mounted
``huge=advise`` (kvtierd.hugepages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import resource
import threading
import time

import numpy as np

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

PROT_READ, PROT_WRITE = 1, 2
MAP_SHARED = 1
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
CUDA_REGISTER_CHUNK_BYTES = 64 << 30   # at most this much per cudaHostRegister call (on page boundaries)
PREFAULT_CHUNK_BYTES = 64 << 20        # the smallest span one prefault worker takes at a time
HUGE_PAGE = 2 << 20                    # chunks are multiples of it: no THP is faulted by two threads
OS_PAGE = os.sysconf("SC_PAGE_SIZE")


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class Mapping:
    """A MAP_SHARED read-write mapping of a whole file, with its address."""

    def __init__(self, fd: int, size: int):
        addr = _libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            raise _oserror("mmap")
        self.address: int = addr
        self.size = size
        self.pinned = "off"
        self._unpin = lambda: None
        self._populating: Populate | None = None
        # A ctypes array over the mapping: a writable buffer that NumPy can view without copying.
        self.buffer = (ctypes.c_ubyte * size).from_address(addr)

    @classmethod
    def of_file(cls, path: str) -> "Mapping":
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            return cls(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    @classmethod
    def anonymous(cls, size: int, name: str = "kvtier-scratch") -> "Mapping":
        """A shared mapping of a fresh memory file (memfd: shmem, like /dev/shm) of ``size`` bytes:
        scratch host memory that pins like the region does (benchmarks and GPU tests)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.address is None:
            return
        if self._populating is not None:
            self._populating.cancel()       # its threads must be out of the range before munmap
        self._unpin()
        _libc.munmap(self.address, self.size)
        self.address = None
        self.buffer = None

    def advise_huge(self, huge: bool) -> None:
        """MADV_HUGEPAGE (or MADV_NOHUGEPAGE) on the whole mapping: whether pages this mapping
        faults into a tmpfs file (huge=advise/always/within_size) may be 2 MiB ones."""
        if _libc.madvise(self.address, self.size, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE) != 0:
            raise _oserror("madvise(MADV_HUGEPAGE)" if huge else "madvise(MADV_NOHUGEPAGE)")

    # --- prefault ----------------------------------------------------------------------------
    def prefault(self, start: int = 0, length: int | None = None, threads: int = 4,
                 progress=None) -> str:
        """Fault in [start, start+length) so that the first copy does not pay for page faults.

        Blocks until done (the daemon at start; benches). Returns the method used: madvise, touch
        or none (see ``Populate``). ``progress(done_bytes, total_bytes)`` is called per chunk.
        """
        length = self.size - start if length is None else length
        if length <= 0:
            return "none"
        chunk = max(PREFAULT_CHUNK_BYTES, _round_up(length // (threads * 8) + 1, HUGE_PAGE))
        task = self._populate(start, length, threads, chunk, progress)
        task.wait()
        return task.method

    def populate_in_background(self, threads: int = 2, progress=None) -> "Populate":
        """Fault the whole mapping in on ``threads`` background threads and return at once.

        A client does this at attach, so that its first copies do not take one page fault per
        4 KiB page. Chunks are PREFAULT_CHUNK_BYTES, so ``cancel()`` returns within one chunk per
        thread; ``close()`` cancels it before unmapping, so a populate never touches an address
        after the mapping is gone (or remapped after a daemon restart).
        """
        return self._populate(0, self.size, threads, PREFAULT_CHUNK_BYTES, progress)

    def _populate(self, start: int, length: int, threads: int, chunk: int, progress) -> "Populate":
        # One at a time, and known to close(), which must not unmap under a running one.
        if self._populating is not None:
            self._populating.cancel()
        self._populating = Populate(self, start, length, threads, chunk, progress)
        return self._populating

    # --- pinning -----------------------------------------------------------------------------
    def pin(self, mode: str) -> str:
        """Pin per ``mode`` (auto|cuda|mlock|off); returns what was done: cuda, mlock or off."""
        if mode not in ("auto", "cuda", "mlock", "off"):
            raise ValueError(f"pin mode {mode!r}: use auto, cuda, mlock or off")
        if mode == "off":
            return "off"
        cuda_failure = None
        if mode in ("auto", "cuda"):
            cuda_failure = self._register_cuda()
            if cuda_failure is None:
                return "cuda"
            if mode == "cuda":
                raise RuntimeError(f"pin=cuda: {cuda_failure}; use --pin auto or --pin mlock")
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        # Try even when the limit looks too low: CAP_IPC_LOCK (containers) lifts it in the kernel.
        if _libc.mlock(self.address, self.size) == 0:
            addr, size = self.address, self.size
            self._unpin = lambda: _libc.munlock(addr, size)
            self.pinned = "mlock"
            return "mlock"
        if mode == "mlock":
            raise RuntimeError(f"mlock of {self.size} bytes failed (RLIMIT_MEMLOCK soft limit {soft}); "
                               "raise it (LimitMEMLOCK=infinity in the unit, ulimit -l unlimited) or use --pin auto")
        log.warning("region of %d bytes left unpinned: %s, and RLIMIT_MEMLOCK=%s is too low to mlock it; "
                    "raise the memlock limit (ulimit -l unlimited / LimitMEMLOCK=infinity) to pin it",
                    self.size, cuda_failure, "unlimited" if soft == resource.RLIM_INFINITY else soft)
        return "off"

    def pin_cuda(self, required: bool) -> bool:
        """A client's pinning: register this process's mapping with CUDA (portable + mapped).

        Pinning is per process, so every client that copies with a GPU registers its own mapping;
        the copy kernel reads it through UVA. Returns True when registered (``close()``
        unregisters it). Without a usable CUDA runtime: raise if ``required``, else return False
        quietly (a CPU-only client needs no pinning). When registration fails: raise if
        ``required``, else log one warning line and return False; the mapping stays usable
        unpinned (copies then go through the torch copier, staged by the driver).
        """
        failure = self._register_cuda()
        if failure is None:
            return True
        if required:
            raise RuntimeError(f"pin='cuda': {failure}")
        if failure != NO_CUDA:
            log.warning("region mapping of %d bytes left unpinned in this process (%s); device copies fall back "
                        "to the slower staged path", self.size, failure)
        return False

    def _register_cuda(self) -> str | None:
        """cudaHostRegister the whole mapping; None on success, else why not (nothing left registered)."""
        cudart = CudaRuntime.load()
        if cudart is None:
            return NO_CUDA
        try:
            self._unpin = cudart.register(self.address, self.size)
        except Exception as exc:
            return f"cudaHostRegister failed: {exc}"
        self.pinned = "cuda"
        return None


NO_CUDA = "no usable CUDA runtime/device"


class Populate:
    """Faulting [start, start+length) of a mapping in, on ``threads`` threads, one chunk at a time.

    MADV_POPULATE_WRITE per chunk (Linux >= 5.14); on kernels without it, each OS page is touched
    (one byte read and written back, so a region's data stays). Chunks are handed out in address
    order, so a fresh region's first pages (the allocator's first) are populated first.
    ``cancel()`` stops the threads after their current chunk and joins them; ``wait()`` joins
    them and raises the first error. ``progress(done_bytes, total_bytes)`` is called per chunk,
    under a lock, with ``done_bytes`` increasing.
    """

    def __init__(self, mapping: Mapping, start: int, length: int, threads: int, chunk: int, progress=None):
        self.total = length
        self.done = 0
        self.error: BaseException | None = None
        self._address = mapping.address
        self._progress = progress
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        chunk = _round_up(chunk, HUGE_PAGE)
        self._spans = iter([(s, min(chunk, start + length - s)) for s in range(start, start + length, chunk)])
        supported = length > 0 and _libc.madvise(self._address + start, OS_PAGE, MADV_POPULATE_WRITE) == 0
        if length > 0 and not supported and ctypes.get_errno() != errno.EINVAL:
            raise _oserror("madvise(MADV_POPULATE_WRITE)")
        self.method = "none" if length <= 0 else "madvise" if supported else "touch"
        self._threads = [threading.Thread(target=self._work, name="kvtier-populate", daemon=True)
                         for _ in range(max(1, threads) if length > 0 else 0)]
        for t in self._threads:
            t.start()

    def _populate(self, offset: int, n: int) -> None:
        if self.method == "madvise":
            if _libc.madvise(self._address + offset, n, MADV_POPULATE_WRITE) != 0:
                raise _oserror("madvise(MADV_POPULATE_WRITE)")
        else:
            view = (ctypes.c_ubyte * n).from_address(self._address + offset)
            every_page = np.frombuffer(view, dtype=np.uint8)[::OS_PAGE]
            np.bitwise_or(every_page, 0, out=every_page)

    def _work(self) -> None:
        while not self._cancel.is_set():
            with self._lock:
                span = next(self._spans, None)
            if span is None:
                return
            try:
                self._populate(*span)
                with self._lock:
                    self.done += span[1]
                    if self._progress:
                        self._progress(self.done, self.total)
            except BaseException as exc:
                self.error = self.error or exc
                self._cancel.set()
                return

    @property
    def finished(self) -> bool:
        """Every byte populated."""
        return self.done == self.total

    @property
    def cancelled(self) -> bool:
        """cancel() was called (or a chunk failed): no new chunk starts."""
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Join the threads (for at most ``timeout`` seconds); raise the first error. Returns
        whether every byte was populated (False after a cancel or on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise self.error
        return self.finished

    def cancel(self) -> None:
        """Stop after the chunks in progress and join the threads (an error is dropped)."""
        self._cancel.set()
        for t in self._threads:
            t.join()


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class CudaRuntime:
    """The few CUDA runtime calls pinning needs, through whichever binding is installed."""

    HOST_REGISTER_PORTABLE = 1
    HOST_REGISTER_MAPPED = 2

    def __init__(self, register_fn, unregister_fn):
        self._register = register_fn
        self._unregister = unregister_fn

    @classmethod
    def load(cls) -> "CudaRuntime | None":
        """CuPy's runtime if a device is visible, else torch's; None when CUDA is unusable."""
        if not os.path.exists("/proc/driver/nvidia/version") and not os.path.exists("/dev/nvidiactl"):
            return None   # no NVIDIA driver: skip importing CuPy/torch just to learn that
        try:
            import cupy  # noqa: F401  (either cupy-cuda12x or cupy-cuda13x provides it)
            from cupy.cuda import runtime
            if runtime.getDeviceCount() > 0:
                return cls(runtime.hostRegister, runtime.hostUnregister)
        except Exception:
            pass
        try:
            import torch
            if torch.cuda.is_available():
                rt = torch.cuda.cudart()

                def reg(ptr, size, flags):
                    if int(rt.cudaHostRegister(ptr, size, flags)) != 0:
                        raise RuntimeError("cudaHostRegister failed")

                def unreg(ptr):
                    rt.cudaHostUnregister(ptr)
                return cls(reg, unreg)
        except Exception:
            pass
        return None

    def register(self, address: int, size: int):
        """Register [address, address+size) in ≤64 GiB chunks; roll back on failure.

        Returns a function that unregisters every chunk.
        """
        done: list[int] = []
        flags = self.HOST_REGISTER_PORTABLE | self.HOST_REGISTER_MAPPED
        try:
            for off in range(0, size, CUDA_REGISTER_CHUNK_BYTES):
                self._register(address + off, min(CUDA_REGISTER_CHUNK_BYTES, size - off), flags)
                done.append(address + off)
        except Exception:
            for ptr in done:
                self._unregister(ptr)
            raise

        def unregister() -> None:
            for ptr in done:
                self._unregister(ptr)
        return unregister


CAP_IPC_LOCK = 14


def mlock_refusal(nbytes: int) -> str | None:
    """Why ``mlock`` of ``nbytes`` would fail for the memlock limit, known before any memory is
    touched (pin=mlock is then refused at once, not after the prefault); None when it may succeed.
    CAP_IPC_LOCK (a container's IPC_LOCK, root) lifts the limit in the kernel."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return None
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        if caps >> CAP_IPC_LOCK & 1:
            return None
    except (OSError, StopIteration, ValueError):
        pass
    return (f"pin=mlock: the region's {nbytes} bytes exceed the memlock limit (RLIMIT_MEMLOCK soft limit {soft}); "
            "raise it (LimitMEMLOCK=infinity in the unit, ulimit -l unlimited, IPC_LOCK in a container) or use "
            "pin=auto")

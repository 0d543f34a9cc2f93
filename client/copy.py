"""Copiers: move a job's bytes between the KV cache and the region, asynchronously.

This module owns the ``Copier`` interface, its handles and the CPU copier. Every copier takes
``Descriptors`` (flat src/dst/nbytes address arrays, see kvcache.py) and returns a
``CopyHandle`` at once; ``handle.done()`` polls, ``handle.wait()`` blocks and raises if the copy
failed. Copies submitted to one copier complete in submission order. The client votes (commit)
or releases only after ``done()`` is true: a copy's completion is observed, never assumed
(invariant 1).

``CPUCopier`` serves KV caches in host memory (CPU-only inference engines, and the test suite):
one worker thread runs memmove over the coalesced descriptors; the GIL is released inside each
memmove, so the inference engine's own thread keeps running while bytes move.

KV caches on a CUDA device use a device copier (kvtier.cuda, kvtier.torch_copy; kvtier.select
picks one). This module holds what they share: ``EventCopyHandle`` (completion through a CUDA
event), ``AddressRanges`` (the memory a copier may touch, checked before anything is queued),
``stream_handle`` and ``storage_ranges``. A device copier that cannot run here raises
``CopierUnavailable``.
"""

from __future__ import annotations

import ctypes
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

import numpy as np

from kvtierd.contract.errors import KvtierError

from .kvcache import Descriptors


class CopierUnavailable(KvtierError):
    """The named copier cannot run here (missing CuPy, no CUDA device, unpinned region…)."""


class CopyHandle:
    """Completion of one submitted copy: a Future of a worker thread, or None (nothing to copy).

    Device copiers return ``EventCopyHandle``, which has the same three methods.
    """

    def __init__(self, future: Future | None = None):
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy completed; raise its error if it failed (FutureTimeout on timeout)."""
        if self._future is not None:
            self._future.result(timeout)

    def error(self) -> BaseException | None:
        """The failure of a completed copy, or None."""
        return None if self._future is None else self._future.exception()


class EventCopyHandle(CopyHandle):
    """Completion of a device copy, observed through a CUDA event recorded after it.

    ``query()`` returns whether the event completed and raises if the device reported an error
    (a faulting kernel surfaces here); ``synchronize()`` blocks until it completed. A device
    error counts as completion with a failure, so the client votes "not ok" instead of hanging.
    """

    # Polling interval bounds for wait(timeout): short first (most copies finish in
    # milliseconds), growing so that a long wait does not spin a core.
    _POLL_MIN_S, _POLL_MAX_S = 50e-6, 2e-3

    def __init__(self, query: Callable[[], bool], synchronize: Callable[[], None]):
        super().__init__()
        self._query = query
        self._synchronize = synchronize
        self._finished = False
        self._error: BaseException | None = None

    def _settle(self, error: BaseException | None) -> None:
        self._finished, self._error = True, error
        self._query = self._synchronize = None   # drop the event: nothing else needs it

    def done(self) -> bool:
        if not self._finished:
            try:
                if self._query():
                    self._settle(None)
            except Exception as exc:
                self._settle(exc)
        return self._finished

    def wait(self, timeout: float | None = None) -> None:
        if not self._finished:
            if timeout is None:
                try:
                    self._synchronize()
                    self._settle(None)
                except Exception as exc:
                    self._settle(exc)
            else:
                # CUDA events have no timed wait: poll with a growing interval up to the deadline.
                deadline = time.monotonic() + timeout
                pause = self._POLL_MIN_S
                while not self.done():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise FutureTimeout(f"device copy still running after {timeout}s")
                    time.sleep(min(pause, left))
                    pause = min(pause * 2, self._POLL_MAX_S)
        if self._error is not None:
            raise self._error

    def error(self) -> BaseException | None:
        return self._error if self.done() else None


class Copier(ABC):
    name: str

    @abstractmethod
    def submit(self, desc: Descriptors) -> CopyHandle:
        """Start copying; return without waiting for the bytes to move."""

    def close(self) -> None:
        """Finish outstanding copies and release resources."""


def run_memmove(desc: Descriptors) -> int:
    """Copy every descriptor with memmove; returns the bytes copied."""
    memmove = ctypes.memmove
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.nbytes.tolist()):
        memmove(d, s, n)
    return desc.total_bytes


class CPUCopier(Copier):
    name = "cpu"

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-copy")

    def submit(self, desc: Descriptors) -> CopyHandle:
        if len(desc) == 0:
            return CopyHandle()
        return CopyHandle(self._pool.submit(run_memmove, desc))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def stream_handle(stream) -> int:
    """The raw cudaStream_t of a torch.cuda.Stream, a CuPy stream, or an int handle."""
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr"):        # torch, CuPy
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise TypeError(f"not a CUDA stream: {stream!r} (pass a torch.cuda.Stream, a cupy Stream or a cudaStream_t)")


class AddressRanges:
    """The memory a device copier may touch: disjoint [base, base+size) ranges, sorted by base.

    A device copier dereferences raw addresses; a wrong one makes the kernel fault, which poisons the
    whole process's CUDA context (the inference engine's too). Copiers therefore check every
    descriptor against the ranges they were given (the KV-cache storages and the region mapping)
    before queuing anything: one vectorised search per side, microseconds per thousand pieces.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        sizes: dict[int, int] = {}
        for base, size in ranges:
            if size > 0:
                sizes[base] = max(size, sizes.get(base, 0))    # layers often share one storage
        order = sorted(sizes)
        self.base = np.asarray(order, dtype=np.uint64)
        self.end = self.base + np.asarray([sizes[b] for b in order], dtype=np.uint64)
        if len(order) > 1 and np.any(self.base[1:] < self.end[:-1]):
            raise ValueError("copy ranges overlap: the KV-cache storages and the region must be distinct memory")

    def resolve(self, addresses: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Range index and offset of each address; ValueError if [address, address+n) leaves every range."""
        if len(self.base) == 0:
            raise ValueError("no memory was registered for copies")
        index = np.searchsorted(self.base, addresses, side="right") - 1
        clipped = np.maximum(index, 0)
        inside = (index >= 0) & (addresses + nbytes <= self.end[clipped])
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise ValueError(f"copy descriptor {i}: [{int(addresses[i]):#x}, +{int(nbytes[i])}) lies outside the "
                             "registered KV-cache tensors and the region")
        return index, (addresses - self.base[clipped]).astype(np.int64)

    def check(self, desc: Descriptors) -> None:
        self.resolve(desc.src, desc.nbytes)
        self.resolve(desc.dst, desc.nbytes)


def storage_ranges(tensors: Sequence) -> list[tuple[int, int]]:
    """(address, bytes) of the whole storage behind each tensor."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]

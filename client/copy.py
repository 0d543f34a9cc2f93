"""Copy engines: move a job's bytes between the KV cache and the region, asynchronously.

Every engine takes ``Descriptors`` (flat src/dst/nbytes address arrays, see kvcache.py) and
returns a ``CopyHandle`` at once; ``handle.done()`` polls, ``handle.wait()`` blocks and raises
if the copy failed. Copies submitted to one engine complete in submission order. The client
votes (commit) or releases only after ``done()`` is true: a copy's completion is observed, never
assumed (invariant 1).

``CPUCopyEngine`` serves KV caches in host memory (CPU-only engines, and the test suite): one
worker thread runs memmove over the coalesced descriptors; the GIL is released inside each
memmove, so the engine's own thread keeps running while bytes move.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

from .kvcache import Descriptors


class CopyHandle:
    """Completion of one submitted copy."""

    def __init__(self, future: Future | None = None):
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy completed; raise its error if it failed."""
        if self._future is not None:
            self._future.result(timeout)

    def error(self) -> BaseException | None:
        """The failure of a completed copy, or None."""
        return None if self._future is None else self._future.exception()


class CopyEngine(ABC):
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


class CPUCopyEngine(CopyEngine):
    name = "cpu"

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-copy")

    def submit(self, desc: Descriptors) -> CopyHandle:
        if len(desc) == 0:
            return CopyHandle()
        return CopyHandle(self._pool.submit(run_memmove, desc))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def select_engine(name: str, device) -> CopyEngine:
    """The copy engine for KV caches on ``device`` (a torch.device); ``name`` may force one."""
    if name not in ("auto", "cpu"):
        raise ValueError(f"copy engine {name!r} is not available; this build has: auto, cpu")
    if device.type != "cpu":
        raise ValueError(f"KV caches on {device} need a device copy engine; this build copies CPU tensors only")
    return CPUCopyEngine()

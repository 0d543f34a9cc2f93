"""The CUDA kernel copier: one launch of csrc/kvtier_copy.cu per job, through CuPy.

Contract (see the header of csrc/kvtier_copy.cu for the kernel's own):

- ``CudaKernelCopier(device, kv_tensors, host_spans, stream)`` serves KV caches on one CUDA
  device. Every descriptor must lie inside the storage of one of ``kv_tensors`` or inside one of
  ``host_spans`` (checked at submit: a stray address would fault the kernel and poison the
  process's CUDA context), and the host spans must be registered
  in *this* process with cudaHostRegister(portable | mapped), with the host pointer usable as
  the device pointer (UVA). The constructor checks this and raises ``CopierUnavailable``
  otherwise, because the kernel dereferences host pointers directly and would fault on
  pageable memory. It also raises it when CuPy is missing or no CUDA device is usable.
- ``submit(desc)`` returns at once. It splits pieces larger than ``SPLIT_CHUNK_BYTES`` (so one
  big piece does not serialise on one warp), uploads the (src, dst, nbytes) table to the device
  from a pinned staging buffer, makes the copier's private non-blocking stream wait for the
  work queued so far on the compute stream (so a store reads what the model wrote, and a load
  does not overwrite blocks that queued kernels still read), launches the kernel once, and
  records a completion event. ``handle.done()`` is that event's query, ``wait()`` its
  synchronize: the client votes or reports a load done only once the event completed.
- Jobs run in submission order (one stream). The staging buffers of a job live until its event
  completed. Submit from one thread at a time (the client's), as with every copier.

The kernel source is compiled at run time by NVRTC (cupy.RawModule) for the device's
architecture; CuPy keeps the binary in its on-disk kernel cache (~/.cupy/kernel_cache, or
$CUPY_CACHE_DIR), so only the first process on a machine pays the compilation. CuPy is imported
lazily: without it this module still imports (``split_descriptors`` is plain NumPy).
"""

from __future__ import annotations

import collections
import importlib.resources
import logging
from typing import Sequence

import numpy as np

from kvtierd.contract.mapping import CUDA_REGISTER_CHUNK_BYTES

from .copy import AddressRanges, Copier, CopierUnavailable, CopyHandle, EventCopyHandle, storage_ranges, stream_handle
from .kvcache import Descriptors

log = logging.getLogger(__name__)

KERNEL_FILE = "kvtier_copy.cu"
KERNEL_NAME = "kvtier_batched_copy"
# Largest piece one warp copies. A multiple of 16 (splitting keeps each piece's alignment);
# equal to the default region page, so typical pieces (≤ one page) are never split, while a
# coalesced multi-megabyte run spreads over many warps.
SPLIT_CHUNK_BYTES = 64 << 10
THREADS_PER_BLOCK = 256
# Grid cap: enough blocks to fill every SM (2048 resident threads per SM on sm_80/sm_90); more
# would only queue behind them, and the kernel's grid-stride loop covers any descriptor count.
BLOCKS_PER_SM = 2048 // THREADS_PER_BLOCK


def kernel_source() -> str:
    """The text of csrc/kvtier_copy.cu, shipped as the package data of ``kvtier.csrc``."""
    return importlib.resources.files("kvtier.csrc").joinpath(KERNEL_FILE).read_text()


def split_descriptors(desc: Descriptors, chunk: int = SPLIT_CHUNK_BYTES) -> Descriptors:
    """The same copy with every piece cut into pieces of at most ``chunk`` bytes (vectorised).

    Zero-byte pieces disappear. ``chunk`` must be a multiple of 16 so that each cut piece keeps
    the alignment class of its parent (the kernel picks its word size from the addresses).
    """
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"chunk must be a positive multiple of 16, got {chunk}")
    if len(desc) == 0 or int(desc.nbytes.max()) <= chunk:
        return desc
    c = np.uint64(chunk)
    counts = ((desc.nbytes + c - np.uint64(1)) // c).astype(np.int64)
    owner = np.repeat(np.arange(len(desc)), counts)
    first = np.cumsum(counts) - counts                     # index of each parent's first piece
    offset = (np.arange(int(counts.sum()), dtype=np.int64) - first[owner]).astype(np.uint64) * c
    return Descriptors(desc.src[owner] + offset, desc.dst[owner] + offset,
                       np.minimum(desc.nbytes[owner] - offset, c))


def _import_cupy():
    try:
        import cupy
        import cupyx
    except ImportError as exc:
        raise CopierUnavailable(f"the 'cuda' copier needs CuPy ({exc}); install cupy-cuda12x or "
                                "cupy-cuda13x to match the CUDA driver, or use copier='torch'") from None
    return cupy, cupyx


# Compiled kernels by device index: RawModule loads its binary into the current device's context.
_kernels: dict[int, object] = {}


def _kernel(cupy, index: int):
    if index not in _kernels:
        module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
        _kernels[index] = module.get_function(KERNEL_NAME)
    return _kernels[index]


class CudaKernelCopier(Copier):
    name = "cuda"

    def __init__(self, device, kv_tensors: Sequence, host_spans: Sequence[tuple[int, int]], stream=None):
        cupy, cupyx = _import_cupy()
        self._cupy, self._cupyx = cupy, cupyx
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise CopierUnavailable(f"CuPy finds no usable CUDA driver/device: {exc}") from None
        index = device.index if device.index is not None else _current_device()
        if not 0 <= index < count:
            raise CopierUnavailable(f"{device} is not a CUDA device CuPy can see ({count} visible)")
        self._index = index
        self._device = cupy.cuda.Device(index)
        self._compute = None if stream is None else stream_handle(stream)
        self._ranges = AddressRanges(storage_ranges(kv_tensors) + list(host_spans))
        with self._device:
            self._check_host_spans(host_spans)
            try:
                self._fn = _kernel(cupy, index)
            except Exception as exc:   # NVRTC missing or failing: the torch copier can still serve
                raise CopierUnavailable(f"compiling {KERNEL_FILE} with NVRTC failed: {exc}") from exc
            self._max_blocks = self._device.attributes["MultiProcessorCount"] * BLOCKS_PER_SM
            self._stream = cupy.cuda.Stream(non_blocking=True)
            # Re-recorded at each submit; cudaStreamWaitEvent captures the event's state at the
            # call, so one event serves every job.
            self._ordering = cupy.cuda.Event(disable_timing=True)
        # (completion event, pinned staging table, device table) of jobs not yet known complete.
        self._inflight: collections.deque = collections.deque()

    def _check_host_spans(self, host_spans: Sequence[tuple[int, int]]) -> None:
        runtime = self._cupy.cuda.runtime
        for address, size in host_spans:
            # Registration is chunked, all or nothing per chunk: one probe per chunk sees them all.
            probes = list(range(address, address + size, CUDA_REGISTER_CHUNK_BYTES)) + [address + size - 1]
            for ptr in probes:
                try:
                    attrs = runtime.pointerGetAttributes(ptr)
                    ok = attrs.type == runtime.memoryTypeHost and attrs.devicePointer == ptr
                except runtime.CUDARuntimeError:
                    ok = False
                if not ok:
                    raise CopierUnavailable(
                        f"host memory at {ptr:#x} is not registered (pinned + mapped, with the host pointer valid "
                        f"on cuda:{self._index}); the kernel reads the region directly and needs that. "
                        "Pinning failed or is off in this process; the torch copier can copy unpinned memory")

    def _compute_stream(self) -> int:
        if self._compute is not None:
            return self._compute
        import torch
        return torch.cuda.current_stream(self._index).cuda_stream

    def _reap(self) -> None:
        """Free the staging tables of completed jobs (in order: one stream completes in order)."""
        while self._inflight:
            try:
                if not self._inflight[0][0].done:
                    return
            except self._cupy.cuda.runtime.CUDARuntimeError:
                pass    # the device failed: the job's handle reports it; its buffers are dead anyway
            self._inflight.popleft()

    def submit(self, desc: Descriptors) -> CopyHandle:
        if len(desc) == 0:
            return CopyHandle()
        self._ranges.check(desc)
        self._reap()
        cupy = self._cupy
        work = split_descriptors(desc)
        n = len(work)
        runtime = cupy.cuda.runtime
        with self._device:
            staging = self._cupyx.empty_pinned((3, n), dtype=np.uint64)
            staging[0], staging[1], staging[2] = work.src, work.dst, work.nbytes
            with self._stream:   # current stream for the allocation (CuPy's pool is stream-aware) and launch
                table = cupy.empty((3, n), dtype=cupy.uint64)
                table.set(staging, stream=self._stream)
                # The table upload above may overlap the model's kernels; the copy waits for them.
                # Raw runtime calls: the compute stream is not CuPy's, and this works on every CuPy.
                runtime.eventRecord(self._ordering.ptr, self._compute_stream())
                runtime.streamWaitEvent(self._stream.ptr, self._ordering.ptr, 0)
                blocks = min(-(-n // (THREADS_PER_BLOCK // 32)), self._max_blocks)
                self._fn((blocks,), (THREADS_PER_BLOCK,), (table[0], table[1], table[2], np.uint64(n)))
                done = cupy.cuda.Event(block=True, disable_timing=True)
                done.record(self._stream)
        self._inflight.append((done, staging, table))
        return EventCopyHandle(lambda: done.done, done.synchronize)

    def close(self) -> None:
        """Wait for every submitted copy, then drop the staging buffers."""
        try:
            with self._device:
                self._stream.synchronize()
        except self._cupy.cuda.runtime.CUDARuntimeError as exc:
            # A device fault was already reported to the job that caused it; closing must go on
            # so that the client can still unmap and unregister the region.
            log.warning("kvtier cuda copier: device error while closing: %s", exc)
        self._inflight.clear()


def _current_device() -> int:
    import torch
    return torch.cuda.current_device()

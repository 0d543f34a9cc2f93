"""Choosing the copy engine for a KV cache: ``select_engine(name, device, ...)``.

KV caches in host memory get ``CPUCopyEngine`` (kvtier.copy). KV caches on a CUDA device get one
of two device engines:

- ``cuda`` (kvtier.cuda): csrc/kvtier_copy.cu compiled through CuPy/NVRTC, one kernel launch
  per job reading and writing the UVA-mapped pinned region directly. Needs CuPy and a region
  this process registered with cudaHostRegister (pinned + mapped).
- ``torch`` (kvtier.torch_engine): one non_blocking ``copy_`` per descriptor. Needs only a CUDA
  build of torch, and works with an unpinned region too (then each copy is staged, slower).

Both order their copies after the engine's compute stream and complete through a CUDA event
(``EventCopyHandle``). ``auto`` takes ``cuda`` when it is usable, else ``torch`` (one warning
line says why); an explicitly named engine that cannot run raises ``CopyEngineUnavailable``.

The choice lives apart from kvtier.copy because it imports the device engines, which import
kvtier.copy for the interface they implement.
"""

from __future__ import annotations

import logging
from typing import Sequence

from .copy import CopyEngine, CopyEngineUnavailable, CPUCopyEngine
from .cuda import CudaKernelEngine
from .torch_engine import TorchCopyEngine

log = logging.getLogger(__name__)

ENGINES = ("auto", "cpu", "cuda", "torch")


def select_engine(name: str, device, *, kv_tensors: Sequence = (), host_spans: Sequence[tuple[int, int]] = (),
                  stream=None) -> CopyEngine:
    """The copy engine for KV caches on ``device`` (a torch.device).

    ``name`` is ``auto`` or forces ``cpu``, ``cuda`` or ``torch``. Device engines also need
    ``host_spans``, the (address, size) ranges of host memory that descriptors may reference (the
    client's mapping of the region), and the registered ``kv_tensors``: descriptors may touch
    nothing else.
    ``stream`` is the engine's compute stream (torch.cuda.Stream, cupy Stream or a raw
    cudaStream_t); copies start only after the work queued on it at submit time. None means
    ``torch.cuda.current_stream(device)`` as of each submit.
    """
    if name not in ENGINES:
        raise ValueError(f"copy engine {name!r} is unknown; choose one of: {', '.join(ENGINES)}")
    if device.type == "cpu":
        if name not in ("auto", "cpu"):
            raise ValueError(f"copy engine {name!r} moves data between a CUDA device and the host; "
                             "KV caches in host memory use the 'cpu' engine")
        return CPUCopyEngine()
    if device.type != "cuda":
        raise ValueError(f"KV caches on {device} are not supported; kvtier copies CPU and CUDA tensors")
    if name == "cpu":
        raise ValueError(f"copy engine 'cpu' cannot reach KV caches on {device}; use auto, cuda or torch")
    if not host_spans:
        raise ValueError("device copy engines need host_spans: the (address, size) of this process's region mapping")

    if name == "torch":
        return TorchCopyEngine(device, kv_tensors, host_spans, stream)
    if name == "cuda":
        return CudaKernelEngine(device, kv_tensors, host_spans, stream)
    try:
        return CudaKernelEngine(device, kv_tensors, host_spans, stream)
    except CopyEngineUnavailable as kernel_missing:
        try:
            engine = TorchCopyEngine(device, kv_tensors, host_spans, stream)
        except CopyEngineUnavailable as torch_missing:
            raise CopyEngineUnavailable(f"no copy engine can serve KV caches on {device}: "
                                        f"cuda: {kernel_missing}; torch: {torch_missing}") from None
        log.warning("kvtier copy engine: torch fallback (one copy_ per piece) because the kernel engine "
                    "is unavailable: %s", kernel_missing)
        return engine

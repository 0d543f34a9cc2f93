"""Choosing the copier for a KV cache: ``select_copier(name, device, ...)``.

KV caches in host memory get ``CPUCopier`` (kvtier.copy). KV caches on a CUDA device get one
of two device copiers:

- ``cuda`` (kvtier.cuda): csrc/kvtier_copy.cu compiled through CuPy/NVRTC, one kernel launch
  per job reading and writing the UVA-mapped pinned region directly. Needs CuPy and a region
  this process registered with cudaHostRegister (pinned + mapped).
- ``torch`` (kvtier.torch_copy): one non_blocking ``copy_`` per descriptor. Needs only a CUDA
  build of torch, and works with an unpinned region too (then each copy is staged, slower).

Both order their copies after the inference engine's compute stream and complete through a CUDA
event (``EventCopyHandle``). ``auto`` takes ``cuda`` when it is usable, else ``torch`` (one
warning line says why); an explicitly named copier that cannot run raises ``CopierUnavailable``.

The choice lives apart from kvtier.copy because it imports the device copiers, which import
kvtier.copy for the interface they implement.
"""

from __future__ import annotations

import logging
from typing import Sequence

from .copy import Copier, CopierUnavailable, CPUCopier
from .cuda import CudaKernelCopier
from .torch_copy import TorchCopier

log = logging.getLogger(__name__)

COPIERS = ("auto", "cpu", "cuda", "torch")


def select_copier(name: str, device, *, kv_tensors: Sequence = (), host_spans: Sequence[tuple[int, int]] = (),
                  stream=None) -> Copier:
    """The copier for KV caches on ``device`` (a torch.device).

    ``name`` is ``auto`` or forces ``cpu``, ``cuda`` or ``torch``. Device copiers also need
    ``host_spans``, the (address, size) ranges of host memory that descriptors may reference (the
    client's mapping of the region), and the registered ``kv_tensors``: descriptors may touch
    nothing else.
    ``stream`` is the inference engine's compute stream (torch.cuda.Stream, cupy Stream or a raw
    cudaStream_t); copies start only after the work queued on it at submit time. None means
    ``torch.cuda.current_stream(device)`` as of each submit.
    """
    if name not in COPIERS:
        raise ValueError(f"copier {name!r} is unknown; choose one of: {', '.join(COPIERS)}")
    if device.type == "cpu":
        if name not in ("auto", "cpu"):
            raise ValueError(f"copier {name!r} moves data between a CUDA device and the host; "
                             "KV caches in host memory use the 'cpu' copier")
        return CPUCopier()
    if device.type != "cuda":
        raise ValueError(f"KV caches on {device} are not supported; kvtier copies CPU and CUDA tensors")
    if name == "cpu":
        raise ValueError(f"copier 'cpu' cannot reach KV caches on {device}; use auto, cuda or torch")
    if not host_spans:
        raise ValueError("device copiers need host_spans: the (address, size) of this process's region mapping")

    if name == "torch":
        return TorchCopier(device, kv_tensors, host_spans, stream)
    if name == "cuda":
        return CudaKernelCopier(device, kv_tensors, host_spans, stream)
    try:
        return CudaKernelCopier(device, kv_tensors, host_spans, stream)
    except CopierUnavailable as kernel_missing:
        try:
            copier = TorchCopier(device, kv_tensors, host_spans, stream)
        except CopierUnavailable as torch_missing:
            raise CopierUnavailable(f"no copier can serve KV caches on {device}: "
                                    f"cuda: {kernel_missing}; torch: {torch_missing}") from None
        log.warning("kvtier copier: torch fallback (one copy_ per piece) because the kernel copier "
                    "is unavailable: %s", kernel_missing)
        return copier

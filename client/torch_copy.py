"""The torch fallback copier: one non_blocking ``copy_`` per descriptor, on a private stream.

Used when CuPy (hence the kernel copier) is unavailable, or when the region could not be pinned
in this process (the kernel copier needs mapped pinned memory; cudaMemcpy does not).

Contract:

- ``TorchCopier(device, kv_tensors, host_spans, stream)``: every descriptor's source and
  destination range must lie inside one *span*: the storage of one of ``kv_tensors`` (the
  registered KV cache, on ``device``) or one of ``host_spans`` ((address, size) of host memory:
  the client's mapping of the region). Torch cannot wrap an arbitrary address as a tensor
  cheaply, so each span is viewed once as a flat uint8 tensor, and a descriptor becomes
  ``(span, offset)`` pairs by a vectorised search over the spans' base addresses
  (``SpanTable``, an ``AddressRanges`` with views). A descriptor outside every span is a
  ``ValueError`` at submit, before anything is queued.
- ``submit(desc)`` makes the copier's stream wait for the compute stream (given, or torch's
  current stream at submit time), queues ``dst[o:o+n].copy_(src[o:o+n], non_blocking=True)`` per
  descriptor on the copier's stream, and records a completion event: ``handle.done()`` is the
  event's query, ``wait()`` its synchronize.

Limits: each piece is its own cudaMemcpyAsync plus Python overhead (several µs), so a job of
thousands of pieces costs tens of milliseconds of host time and small pieces do not reach the
link's bandwidth; bench/gpu_bench.py measures it against the kernel copier. When the host span
is not pinned, the driver stages every copy and cudaMemcpyAsync returns only once the copy
is done (correct, slower, and it blocks the submitting thread).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from .copy import AddressRanges, Copier, CopierUnavailable, CopyHandle, EventCopyHandle, stream_handle
from .kvcache import Descriptors


def storage_view(tensor):
    """A flat uint8 tensor over the whole storage behind ``tensor`` (same device, no copy)."""
    import torch
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def host_view(address: int, size: int):
    """A flat uint8 CPU tensor over host memory [address, address+size) (no copy).

    The caller keeps the memory mapped while the view is in use (the client closes the copier
    before it unmaps the region).
    """
    import torch
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


class SpanTable(AddressRanges):
    """Address ranges with a flat uint8 tensor over each, so (range, offset) pairs become slices."""

    def __init__(self, views: Sequence):
        unique = {}
        for v in views:
            if v.numel():
                unique.setdefault(v.data_ptr(), v)   # layers often share one storage: keep one view
        super().__init__([(base, v.numel()) for base, v in unique.items()])
        self.views = [unique[b] for b in self.base.tolist()]

    @classmethod
    def for_copier(cls, kv_tensors: Sequence, host_spans: Sequence[tuple[int, int]]) -> "SpanTable":
        return cls([storage_view(t) for t in kv_tensors] + [host_view(a, n) for a, n in host_spans])

    def plan(self, desc: Descriptors) -> tuple[list, list, list, list, list]:
        """Descriptors as Python lists (src span, src offset, dst span, dst offset, nbytes), validated."""
        s, so = self.resolve(desc.src, desc.nbytes)
        d, do = self.resolve(desc.dst, desc.nbytes)
        return s.tolist(), so.tolist(), d.tolist(), do.tolist(), desc.nbytes.astype(np.int64).tolist()

    def copy(self, plan: tuple[list, list, list, list, list]) -> None:
        """Queue one non_blocking copy_ per planned descriptor (on the current stream for CUDA views)."""
        views = self.views
        for s, so, d, do, n in zip(*plan):
            views[d][do:do + n].copy_(views[s][so:so + n], non_blocking=True)


class TorchCopier(Copier):
    name = "torch"

    def __init__(self, device, kv_tensors: Sequence, host_spans: Sequence[tuple[int, int]], stream=None):
        import torch
        if not torch.cuda.is_available():
            raise CopierUnavailable(f"the 'torch' copier needs a CUDA build of torch and a visible device "
                                    f"(this torch is {torch.__version__}, torch.cuda.is_available() is False)")
        if not kv_tensors:
            raise ValueError("the 'torch' copier needs the registered KV-cache tensors (kv_tensors)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        self._spans = SpanTable.for_copier(kv_tensors, host_spans)
        self._stream = torch.cuda.Stream(self._device)     # torch's pool streams are non-blocking
        if stream is None or isinstance(stream, torch.cuda.Stream):
            self._compute = stream
        else:
            self._compute = torch.cuda.ExternalStream(stream_handle(stream), device=self._device)

    def submit(self, desc: Descriptors) -> CopyHandle:
        import torch
        if len(desc) == 0:
            return CopyHandle()
        plan = self._spans.plan(desc)
        compute = self._compute if self._compute is not None else torch.cuda.current_stream(self._device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            self._spans.copy(plan)
        done = torch.cuda.Event(blocking=True)
        done.record(self._stream)
        return EventCopyHandle(done.query, done.synchronize)

    def close(self) -> None:
        """Wait for every submitted copy; the span views go with the copier."""
        self._stream.synchronize()

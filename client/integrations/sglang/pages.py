"""SGLang's host pool as kvtier sees it: one kvtier block per SGLang page.

SGLang stores KV in L3 one *page* (``page_size`` tokens, all layers) per key. Its generic path
moves a page as ``host_pool.get_data_page(index).flatten()``, so that flat order is the page's
byte format; this module describes the same bytes in place, for the zero-copy path:

- ``get_data_page(0, flat=False)`` is page 0 as a strided view of the pool's buffer, and
  ``get_data_page(page_size, ...)`` tells how far apart pages are. Together they give every
  page as the same strided view at a fixed step, whatever the pool's layout.
- The view's innermost dimensions that are contiguous form a *row*; the outer dimensions are
  enumerated once, here, into row tensors ``[num_pages, row]`` (one per layer and K/V for MHA
  ``layer_first``; one per K/V, or one in all, for the page-major layouts). Concatenating one
  page's rows in order gives exactly its flat page, so the v1 and the generic path store the
  same bytes, and the kvtier client turns a batch of pages into copy descriptors by NumPy
  broadcasting (``kvtier.kvcache``) with no loop per page or layer.

A page's bytes are in its layout's own order (SGLang's L3 format is raw), so the namespace names
that order (``ORDERS``): ``layer_first`` and ``page_first_direct`` share one ("2LTHD": K/V,
layer, token, head, dim) and can share cached pages; ``page_first`` ("2TLHD") and ``page_head``
("2HTLD") each have their own. Layouts not listed (``page_unified``, split-KV MLA pools) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Byte order of one page per (pool kind, layout): K/V (2), Layer, Token, Head, Dim / latent (D).
ORDERS = {
    ("mha", "layer_first"): "2LTHD", ("mha", "page_first_direct"): "2LTHD",
    ("mha", "page_first"): "2TLHD", ("mha", "page_head"): "2HTLD",
    ("mla", "layer_first"): "LTD", ("mla", "page_first_direct"): "LTD", ("mla", "page_first"): "TLD",
}


@dataclass
class HostPages:
    """The pages of one SGLang host KV pool, described for kvtier."""

    kind: str                     # "mha" | "mla"
    layout: str                   # the pool's layout name
    order: str                    # the page's byte order (ORDERS)
    page_size: int                # tokens per page
    num_pages: int
    dtype: str                    # e.g. "bfloat16"
    rows: list                    # tensors [num_pages, row elements], rows contiguous
    page_bytes: int               # bytes of one page (all rows)

    @classmethod
    def of(cls, pool) -> "HostPages":
        """Describe ``pool`` (an SGLang ``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``)."""
        kind = "mla" if "MLA" in type(pool).__name__ else "mha"
        layout = getattr(pool, "layout", None)
        order = ORDERS.get((kind, layout))
        if order is None:
            supported = sorted({lay for k, lay in ORDERS if k == kind})
            raise ValueError(f"kvtier stores SGLang {kind.upper()} host pools with --hicache-mem-layout "
                             f"{' or '.join(supported)}; this pool ({type(pool).__name__}) has layout {layout!r}")
        if getattr(pool, "dcp_size", 1) != 1:
            raise ValueError("kvtier does not store decode-context-parallel (DCP) host pools")
        page_size = int(pool.page_size)
        num_pages = int(pool.size) // page_size
        first = pool.get_data_page(0, flat=False)
        elem = first.element_size()
        step = 0
        if num_pages > 1:
            step_bytes = pool.get_data_page(page_size, flat=False).data_ptr() - first.data_ptr()
            if step_bytes <= 0 or step_bytes % elem:
                raise ValueError(f"SGLang host pool pages are {step_bytes} bytes apart; kvtier cannot address them")
            step = step_bytes // elem
        shape, stride = list(first.shape), list(first.stride())
        run, k = 1, len(shape)               # the innermost contiguous dimensions form one row
        while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == run):
            run *= shape[k - 1]
            k -= 1
        offsets = np.zeros(1, dtype=np.int64)    # element offset of each row inside page 0
        for n, s in zip(shape[:k], stride[:k]):
            offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).ravel()
        base = first.storage_offset()
        rows = [torch.as_strided(first, (num_pages, run), (step, 1), base + int(o)) for o in offsets]
        page_bytes = run * elem * len(rows)
        if page_bytes != first.numel() * elem:
            raise ValueError("SGLang host pool page view does not decompose into rows; kvtier cannot address it")
        return cls(kind, layout, order, page_size, num_pages, str(first.dtype).removeprefix("torch."), rows,
                   page_bytes)

    def page_ids(self, host_indices: torch.Tensor, pages: int) -> np.ndarray:
        """The pool pages of a batch: ``host_indices`` holds ``pages * page_size`` token slots and
        page i starts at ``host_indices[i * page_size]`` (SGLang's v1 contract)."""
        if host_indices.numel() != pages * self.page_size:
            raise ValueError(f"{host_indices.numel()} host indices for {pages} pages of {self.page_size} tokens")
        starts = host_indices.reshape(-1)[:: self.page_size].to("cpu", torch.int64).numpy()
        if pages and ((starts % self.page_size).any() or starts.min() < 0
                      or starts.max() >= self.num_pages * self.page_size):
            raise ValueError("host indices do not start pages of the host pool")
        return starts // self.page_size

"""An engine's paged KV cache as kvtier sees it, and the copy descriptors of a job.

Registration takes the per-layer tensors of one rank's KV cache, each shaped
``[num_blocks, ...]`` (dimension 0 is the block id; any row stride is allowed, each row must be
contiguous). A block's *logical bytes* are its rows in layer order::

    block b = tensors[0][b] bytes ‖ tensors[1][b] bytes ‖ … ‖ tensors[L-1][b] bytes

The cross-layer layout (one tensor ``[num_blocks, layers, …]``) is the special case L = 1. In the
region, an entry's shard is the same logical bytes laid over its pages in order: logical offset
``o`` lives in page ``pages[o // page_size]`` at ``o % page_size``.

Descriptors: the cut points where a piece of a block changes layer row or page are the same for
every block (``PieceTemplate``, computed once at registration). A job of K blocks then becomes
K × pieces ``(src, dst, nbytes)`` address triples by NumPy broadcasting — no Python loop per
block or piece — and adjacent pieces that happen to be contiguous on both sides are merged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PieceTemplate:
    """The pieces of one block: where each starts in its layer row and in the entry's pages."""

    layer: np.ndarray          # int64 [P]: which registered tensor
    row_offset: np.ndarray     # uint64 [P]: byte offset inside that tensor's block row
    page_index: np.ndarray     # int64 [P]: index into the entry's page list
    page_offset: np.ndarray    # uint64 [P]: byte offset inside that page
    nbytes: np.ndarray         # uint64 [P]

    @classmethod
    def build(cls, row_bytes: Sequence[int], page_size: int) -> "PieceTemplate":
        starts = np.concatenate([[0], np.cumsum(row_bytes, dtype=np.int64)])
        block_bytes = int(starts[-1])
        cuts = np.union1d(starts, np.arange(0, block_bytes, page_size, dtype=np.int64))
        cuts = cuts[cuts <= block_bytes]
        if cuts[-1] != block_bytes:
            cuts = np.append(cuts, block_bytes)
        begin, end = cuts[:-1], cuts[1:]
        layer = np.searchsorted(starts, begin, side="right") - 1
        return cls(layer=layer, row_offset=(begin - starts[layer]).astype(np.uint64),
                   page_index=begin // page_size, page_offset=(begin % page_size).astype(np.uint64),
                   nbytes=(end - begin).astype(np.uint64))

    def __len__(self) -> int:
        return len(self.nbytes)


@dataclass
class Descriptors:
    """Flat copy instructions: copy nbytes[i] bytes from address src[i] to address dst[i]."""

    src: np.ndarray    # uint64
    dst: np.ndarray    # uint64
    nbytes: np.ndarray  # uint64

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def coalesced(self) -> "Descriptors":
        """Merge runs of descriptors that continue each other on both sides (vectorised)."""
        if len(self) < 2:
            return self
        cont = (self.src[:-1] + self.nbytes[:-1] == self.src[1:]) & (self.dst[:-1] + self.nbytes[:-1] == self.dst[1:])
        heads = np.flatnonzero(np.concatenate([[True], ~cont]))
        return Descriptors(self.src[heads], self.dst[heads], np.add.reduceat(self.nbytes, heads))

    @classmethod
    def empty(cls) -> "Descriptors":
        z = np.zeros(0, dtype=np.uint64)
        return cls(z, z, z)


class KVCacheLayout:
    """Addresses and geometry of one rank's registered KV-cache tensors."""

    def __init__(self, tensors: Sequence, page_size: int):
        if not tensors:
            raise ValueError("register at least one KV-cache tensor")
        num_blocks = {int(t.shape[0]) for t in tensors}
        if len(num_blocks) != 1:
            raise ValueError(f"KV-cache tensors disagree on the number of blocks (dimension 0): {sorted(num_blocks)}")
        self.num_blocks = num_blocks.pop()
        self.device = tensors[0].device
        rows, strides, bases = [], [], []
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise ValueError(f"KV-cache tensor {i} is on {t.device}, tensor 0 on {self.device}")
            if self.num_blocks > 0 and not t[0].is_contiguous():
                raise ValueError(f"KV-cache tensor {i}: a block's row (tensor[b]) must be contiguous")
            rows.append(t[0].numel() * t.element_size())
            strides.append(t.stride(0) * t.element_size())
            bases.append(t.data_ptr())
        self.tensors = list(tensors)        # keep them alive while registered
        self.row_bytes = np.asarray(rows, dtype=np.uint64)
        self.row_stride = np.asarray(strides, dtype=np.uint64)
        self.base = np.asarray(bases, dtype=np.uint64)
        self.block_bytes = int(self.row_bytes.sum())
        self.page_size = page_size
        self.template = PieceTemplate.build(rows, page_size)

    def _check_blocks(self, block_ids: np.ndarray) -> None:
        if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}); got {block_ids.min()}..{block_ids.max()}")

    def descriptors(self, block_ids: Sequence[int], pages: np.ndarray, region_data: int,
                    to_region: bool) -> Descriptors:
        """Copy descriptors between KV-cache blocks ``block_ids`` and their entries' pages.

        ``pages`` is [K, pages_per_shard] page indices (K = len(block_ids)); ``region_data`` is
        the address of page 0 in this process. ``to_region`` picks the direction (store) or
        its reverse (load).
        """
        blocks = np.asarray(block_ids, dtype=np.int64)
        self._check_blocks(blocks)
        if len(blocks) == 0:
            return Descriptors.empty()
        t = self.template
        pages = np.asarray(pages, dtype=np.uint64).reshape(len(blocks), -1)
        kv = (self.base[t.layer] + t.row_offset)[None, :] + blocks.astype(np.uint64)[:, None] * self.row_stride[t.layer][None, :]
        region = np.uint64(region_data) + pages[:, t.page_index] * np.uint64(self.page_size) + t.page_offset[None, :]
        nbytes = np.broadcast_to(t.nbytes, kv.shape).ravel()
        src, dst = (kv, region) if to_region else (region, kv)
        return Descriptors(src.ravel(), dst.ravel(), nbytes.copy()).coalesced()

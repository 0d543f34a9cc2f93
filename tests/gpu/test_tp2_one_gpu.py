"""TP=2 on one GPU with a real daemon: only rank 0 copies D2H, both ranks load rank 0's bytes.

Rank 1's KV cache holds different bytes from rank 0's (a replicated layout where rank 1 is
"wrong" makes any rank-1 write visible). Both ranks store the same job; the daemon must count one
block's bytes written per block (invariant 3), and a load on either rank must bring back rank 0's
bytes into other blocks, through each process's own mapping and pinning of the region.
"""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
import torch

from .cuda_ranks import CudaRank, GpuCacheSpec, all_call

pytestmark = [pytest.mark.cuda, pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}-{i}".encode()).digest() + b"\0\0\0\0" for i in range(n)]


def test_tp2_one_gpu_only_rank0_writes(start_daemon):
    daemon = start_daemon(root="/dev/shm")    # tmpfs, so that every rank can pin its mapping
    spec = GpuCacheSpec()
    n = 8
    ranks = [CudaRank(daemon.socket, "gpu-tp2", rank, 2, spec, seed) for rank, seed in [(0, 1), (1, 999)]]
    try:
        info = [r.result() for r in ranks]
        assert [i["writer"] for i in info] == [True, False]
        for i in info:
            # The kernel copier whenever it can run: CuPy present and the region pinned in that process.
            can_use_kernel = importlib.util.find_spec("cupy") is not None and i["pinned"] == "cuda"
            assert i["copier"] == ("cuda" if can_use_kernel else "torch"), info

        src, dst = list(range(n)), list(range(16, 16 + n))
        rank0, rank1 = all_call(ranks, "hashes", block_ids=src)
        assert all(a != b for a, b in zip(rank0, rank1))

        keys = keys_for("gpu-tp2", n)
        for result in all_call(ranks, "store", job=1, keys=keys, block_ids=src):
            assert result["ok"], result
        stats = daemon.stats()
        assert stats["bytes_written"] == n * spec.block_bytes      # one copy, not TP copies
        assert stats["entries_ready"] == n

        for result in all_call(ranks, "load", job=2, keys=keys, block_ids=dst):
            assert result["hits"] == n and result["ok"], result
        for r, loaded in enumerate(all_call(ranks, "hashes", block_ids=dst)):
            assert loaded == rank0, f"rank {r} loaded other bytes than rank 0 stored"
        stats = daemon.stats()
        assert stats["entries_pinned"] == 0 and stats["open_jobs"] == 0
    finally:
        for r in ranks:
            r.stop()

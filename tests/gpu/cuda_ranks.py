"""TP rank processes whose KV cache lives on the GPU, for the TP=2-on-one-GPU test and the one-copy
TP=N section of bench/gpu_bench.py.

Each ``CudaRank`` is a spawned process (a fresh CUDA context, its own mapping and pinning of
the region, its own pid, as in a real engine) holding per-layer MLA-like tensors
[num_blocks, block_tokens, 576] bf16 on its device (cuda:0 unless told) and a ``kvtier.Client``
with the default copy copier selection. The caller drives it over a pipe; every command answers
("ok", value) or ("error", text). A store reports the seconds from its submit to its completion,
as the rank saw them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from tests.procs import ChildProcess, all_call, error_info, serve  # noqa: F401  (all_call: re-exported)


@dataclass(frozen=True)
class GpuCacheSpec:
    layers: int = 4
    num_blocks: int = 32
    block_tokens: int = 64
    width: int = 576

    @property
    def block_bytes(self) -> int:
        return self.layers * self.block_tokens * self.width * 2     # bf16

    def layout(self, model: str) -> dict:
        return {"model": model, "dtype": "bfloat16", "block_tokens": self.block_tokens,
                "block_bytes": self.block_bytes, "sharding": "replicated"}


def _worker(conn, socket: str, engine: str, rank: int, world_size: int, spec: GpuCacheSpec, seed: int,
            device: int) -> None:
    import torch

    from kvtier import Client, NamespaceId

    try:
        torch.cuda.set_device(device)
        gen = torch.Generator().manual_seed(seed)
        shape = (spec.num_blocks, spec.block_tokens, spec.width * 2)
        kv = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(f"cuda:{device}").view(torch.bfloat16)
              for _ in range(spec.layers)]
        client = Client(socket, engine_id=engine, rank=rank, world_size=world_size,
                        namespace=NamespaceId(**spec.layout("gpu-tp2")), timeout=30)
        client.register_kv_caches(kv)
    except Exception as exc:
        conn.send(("error", error_info(exc)))
        return

    def hashes(block_ids):
        return [hashlib.sha256(torch.cat([t[b].reshape(-1).view(torch.uint8) for t in kv]).cpu().numpy().tobytes())
                .hexdigest() for b in block_ids]

    def store(job, keys, block_ids):
        began = time.perf_counter()
        client.store(job, keys, block_ids)
        (result,) = client.wait([job], timeout=60)
        return {"ok": result.ok, "error": repr(result.error) if result.error else None,
                "seconds": time.perf_counter() - began}

    def load(job, keys, block_ids):
        hits = client.load(job, keys, block_ids)
        (result,) = client.wait([job], timeout=60)
        return {"hits": hits, "ok": result.ok, "error": repr(result.error) if result.error else None}

    commands = {"hashes": hashes, "store": store, "load": load}
    conn.send(("ok", {"writer": client.is_writer, "copier": client.copier.name, "pinned": client.pinned}))
    serve(conn, commands, close=client.close)


class CudaRank(ChildProcess):
    def __init__(self, socket: str, engine: str, rank: int, world_size: int, spec: GpuCacheSpec, seed: int,
                 device: int = 0):
        super().__init__(_worker, socket, engine, rank, world_size, spec, seed, device)

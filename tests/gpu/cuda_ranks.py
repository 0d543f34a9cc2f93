"""TP rank processes whose KV cache lives on the GPU, for the TP=2-on-one-GPU test.

Each ``CudaRank`` is a spawned process (a fresh CUDA context, its own mapping and pinning of
the region, its own pid, as in a real engine) holding per-layer MLA-like tensors
[num_blocks, block_tokens, 576] bf16 on cuda:0 and a ``kvtier.Client`` with the default copy
engine selection. The test drives it over a pipe; every command answers ("ok", value) or
("error", text).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import traceback
from dataclasses import dataclass
from typing import Any

CTX = mp.get_context("spawn")


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
                "block_bytes": self.block_bytes, "kind": "replicated"}


def _worker(conn, socket: str, engine: str, rank: int, world_size: int, spec: GpuCacheSpec, seed: int) -> None:
    import torch

    from kvtier import Client, Layout

    try:
        torch.cuda.set_device(0)
        gen = torch.Generator().manual_seed(seed)
        shape = (spec.num_blocks, spec.block_tokens, spec.width * 2)
        kv = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to("cuda:0").view(torch.bfloat16)
              for _ in range(spec.layers)]
        client = Client(socket, engine_id=engine, rank=rank, world_size=world_size,
                        layout=Layout(**spec.layout("gpu-tp2")), timeout=30)
        client.register_kv_caches(kv)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return

    def hashes(block_ids):
        return [hashlib.sha256(torch.cat([t[b].reshape(-1).view(torch.uint8) for t in kv]).cpu().numpy().tobytes())
                .hexdigest() for b in block_ids]

    def store(job, keys, block_ids):
        client.store(job, keys, block_ids)
        (result,) = client.wait([job], timeout=60)
        return {"ok": result.ok, "error": repr(result.error) if result.error else None}

    def load(job, keys, block_ids):
        hits = client.load(job, keys, block_ids)
        (result,) = client.wait([job], timeout=60)
        return {"hits": hits, "ok": result.ok, "error": repr(result.error) if result.error else None}

    commands = {"hashes": hashes, "store": store, "load": load}
    conn.send(("ok", {"writer": client.is_writer, "engine": client.engine.name, "pinned": client.pinned}))
    try:
        while True:
            try:
                name, kwargs = conn.recv()
            except EOFError:
                return
            if name == "exit":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", commands[name](**kwargs)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        client.close()


class CudaRank:
    def __init__(self, socket: str, engine: str, rank: int, world_size: int, spec: GpuCacheSpec, seed: int):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_worker, args=(child, socket, engine, rank, world_size, spec, seed),
                                daemon=True)
        self.proc.start()
        child.close()

    def result(self, timeout: float = 120) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("rank process did not answer")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"rank process failed:\n{value}")
        return value

    def send(self, name: str, **kwargs: Any) -> None:
        self.conn.send((name, kwargs))

    def call(self, name: str, **kwargs: Any) -> Any:
        self.send(name, **kwargs)
        return self.result()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("exit")
                self.conn.poll(30)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def all_call(ranks: list[CudaRank], name: str, **kwargs: Any) -> list:
    """The same command to every rank at once (TP ranks run concurrently), then gather."""
    for r in ranks:
        r.send(name, **kwargs)
    return [r.result() for r in ranks]

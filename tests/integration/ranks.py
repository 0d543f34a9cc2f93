"""Rank processes for integration tests: one real OS process per TP rank.

Each ``RankProcess`` is a spawned Python process holding a CPU "KV cache" (per-layer torch
tensors) and a ``kvtier.Client``; the test drives it over a pipe with small commands. Spawned
(not forked) so each rank is a clean process with its own ZMQ context, its own region mapping
and its own pid, as in a real engine; the daemon watches each through a pidfd.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass
from typing import Any

CTX = mp.get_context("spawn")


@dataclass
class CacheSpec:
    """Shape of one rank's KV cache: ``layers`` tensors of [num_blocks, *row_shape]."""

    layers: int = 3
    num_blocks: int = 16
    row_shape: tuple = (16, 576)
    dtype: str = "bfloat16"

    def block_bytes(self) -> int:
        import math
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}[self.dtype]
        return self.layers * math.prod(self.row_shape) * itemsize


def _worker(conn) -> None:  # runs in the child
    import torch

    from kvtier import Client, Layout

    state: dict[str, Any] = {}

    def fill(block_ids, seed):
        gen = torch.Generator().manual_seed(seed)
        for t in state["kv"]:
            for b in block_ids:
                raw = torch.randint(0, 256, (t[b].numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
                t[b].view(torch.uint8).view(-1).copy_(raw)

    def block_hashes(block_ids):
        out = []
        for b in block_ids:
            h = hashlib.sha256()
            for t in state["kv"]:
                h.update(t[b].contiguous().view(torch.uint8).numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def connect(socket, engine, rank, world_size, spec, layout, seed):
        dtype = getattr(torch, spec.dtype)
        state["kv"] = [torch.zeros((spec.num_blocks, *spec.row_shape), dtype=dtype) for _ in range(spec.layers)]
        fill(range(spec.num_blocks), seed)
        state["client"] = Client(socket, engine_id=engine, rank=rank, world_size=world_size,
                                 layout=Layout(**layout), timeout=20)
        state["client"].register_kv_caches(state["kv"])
        return {"writer": state["client"].is_writer, "pid": os.getpid()}

    def store(job, keys, block_ids):
        decision = state["client"].store(job, keys, block_ids)
        (result,) = state["client"].wait([job], timeout=60)
        return {"outcomes": [int(o) for o in decision.outcomes], "ok": result.ok,
                "error": repr(result.error) if result.error else None}

    def load(job, keys, block_ids):
        hits = state["client"].load(job, keys, block_ids)
        (result,) = state["client"].wait([job], timeout=60)
        return {"hits": hits, "ok": result.ok, "error": repr(result.error) if result.error else None}

    def close():
        client = state.pop("client", None)
        if client is not None:
            client.close()
        return None

    commands = {
        "connect": connect, "store": store, "load": load, "close": close,
        "fill": lambda block_ids, seed: fill(block_ids, seed),
        "hashes": block_hashes,
        "lookup": lambda keys: state["client"].lookup(keys),
        "stats": lambda: state["client"].stats(),
    }
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:
            return
        if name == "exit":
            close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[name](**kwargs)))
        except Exception as exc:
            conn.send(("error", {"type": type(exc).__name__, "message": str(exc),
                                 "traceback": traceback.format_exc()}))


class RankError(Exception):
    def __init__(self, info: dict):
        super().__init__(f"{info['type']}: {info['message']}")
        self.type = info["type"]
        self.info = info


class RankProcess:
    def __init__(self) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def send(self, name: str, **kwargs: Any) -> None:
        self.conn.send((name, kwargs))

    def result(self, timeout: float = 90) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("rank process did not answer")
        status, value = self.conn.recv()
        if status == "error":
            raise RankError(value)
        return value

    def call(self, name: str, timeout: float = 90, **kwargs: Any) -> Any:
        self.send(name, **kwargs)
        return self.result(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("exit")
                self.conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def all_call(ranks: list[RankProcess], name: str, per_rank: list[dict] | None = None, **kwargs: Any) -> list:
    """Send the same command to every rank at once (they run concurrently), then gather."""
    for i, r in enumerate(ranks):
        r.send(name, **{**kwargs, **(per_rank[i] if per_rank else {})})
    return [r.result() for r in ranks]

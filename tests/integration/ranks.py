"""Rank processes for integration tests: one real OS process per TP rank.

Each ``RankProcess`` is a spawned Python process holding a CPU "KV cache" (per-layer torch
tensors) and a ``kvtier.Client``; the test drives it over a pipe with small commands. Spawned
(not forked) so each rank is a clean process with its own ZMQ context, its own region mapping
and its own pid, as in a real engine; the daemon watches each through a pidfd.

Commands (``rank.call(name, **kwargs)``):

- ``connect``, ``close``, ``fill``, ``hashes``, ``lookup``, ``lookup_detail``, ``stats``: set-up and
  queries.
- ``store`` / ``load``: a whole job on this rank (request, copy, vote/release), its result; a
  load may name a lease of the engine (``lease``).
- ``store_hold`` / ``load_hold``: send the request and start the copy, but do not vote or
  release yet; ``finish(jobs)`` does that later (``Client.wait``) and returns the results. A
  rank that is SIGKILLed in between dies holding its pages (writer) or its pins (loader).
- ``store_partial_then_hang``: the writer's request, then only a prefix (``fraction``) of the
  job's bytes copied into its pages by hand, then the process blocks forever without voting:
  the test SIGKILLs it "mid-copy". After this command the process answers nothing more.
- ``job_status``, ``raw`` (any protocol op on this rank's session, its reply or typed error).
- ``fill_keys`` / ``verify_keys``: blocks whose bytes are derived from their keys
  (``key_content``), so that a block holding another key's bytes (foreign) or a mix (torn)
  cannot pass.
- ``gate``: the next copy this rank submits waits until ``open_gate`` (a D2H copy queued behind
  the model's compute): the store request is answered and the pages are handed out, the bytes
  land later, through the client's own copier path (``open_gate(wait=True)``: they landed, no
  vote yet).

Errors come back as ``RankError`` whose ``type`` is the client's exception class name
(``JobAborted``, ``ShuttingDown``, ``DaemonUnavailable``, ...).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tests.procs import ChildError, ChildProcess, all_call, serve  # noqa: F401  (all_call: re-exported)


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


def hits_and_pending(reply) -> dict:
    """What the second tier's tests compare of a lookup: its hits and the keys being promoted."""
    return {"hits": reply.hits, "pending": reply.pending}

def key_content(key: bytes, nbytes: int) -> bytes:
    """The bytes of the block stored under ``key``: a pure function of the key."""
    import numpy as np
    seed = int.from_bytes(hashlib.sha256(b"content/" + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class GatedCopier:
    """Wraps a rank's copier: once armed, the next copy submitted waits until the gate opens."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.armed = False
        self.gate = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gated-copy")

    def submit(self, desc):
        from kvtier.copy import CopyHandle, run_memmove
        if not self.armed:
            return self.inner.submit(desc)
        self.armed = False
        gate = self.gate
        return CopyHandle(self._pool.submit(lambda: (gate.wait(), run_memmove(desc))[1]))

    def close(self) -> None:
        self.gate.set()
        self._pool.shutdown(wait=True)
        self.inner.close()


def _worker(conn) -> None:  # runs in the child
    import torch

    from kvtier import Client, NamespaceId

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

    def connect(socket, engine, rank, world_size, spec, layout, seed, timeout=20.0):
        dtype = getattr(torch, spec.dtype)
        state["kv"] = [torch.zeros((spec.num_blocks, *spec.row_shape), dtype=dtype) for _ in range(spec.layers)]
        fill(range(spec.num_blocks), seed)
        state["client"] = Client(socket, engine_id=engine, rank=rank, world_size=world_size,
                                 namespace=NamespaceId(**layout), timeout=timeout)
        state["client"].register_kv_caches(state["kv"])
        info = state["client"].info
        return {"writer": state["client"].is_writer, "pid": os.getpid(), "watched": info.watched,
                "session": info.session, "token": info.token}

    def store(job, keys, block_ids):
        decision = state["client"].store(job, keys, block_ids)
        (result,) = state["client"].wait([job], timeout=60)
        return {"outcomes": [int(o) for o in decision.outcomes], "ok": result.ok,
                "error": repr(result.error) if result.error else None}

    def load(job, keys, block_ids, lease=None):
        hits = state["client"].load(job, keys, block_ids, lease=lease)
        (result,) = state["client"].wait([job], timeout=60)
        return {"hits": hits, "ok": result.ok, "error": repr(result.error) if result.error else None}

    def close():
        client = state.pop("client", None)
        if client is not None:
            client.close()
        return None

    def result_dict(result):
        return {"job": result.job, "kind": result.kind, "ok": result.ok, "hits": result.hits,
                "error": repr(result.error) if result.error else None,
                "error_type": type(result.error).__name__ if result.error else None}

    def store_hold(job, keys, block_ids):
        decision = state["client"].store(job, keys, block_ids)
        return {"outcomes": [int(o) for o in decision.outcomes]}

    def load_hold(job, keys, block_ids, lease=None):
        return {"hits": state["client"].load(job, keys, block_ids, lease=lease)}

    def finish(jobs, timeout=60):
        return [result_dict(r) for r in state["client"].wait(jobs, timeout=timeout)]

    def store_partial_then_hang(job, keys, block_ids, fraction=0.5):
        """The writer's store request, then only ``fraction`` of the job's bytes copied into the
        pages the daemon handed out, then hang (the test kills this process)."""
        import ctypes

        import numpy as np

        from kvtierd.contract import protocol as P
        from kvtierd.contract.codes import StoreOutcome

        client = state["client"]
        reply = client.channel.call("store", job=job, keys=list(keys))
        outcomes = np.frombuffer(reply["outcomes"], dtype=np.uint8)
        write = np.flatnonzero(outcomes == StoreOutcome.WRITE)
        pages = np.frombuffer(reply["pages"], dtype=P.PAGES_DTYPE).reshape(len(write), client.pages_per_shard)
        desc = client.kv.descriptors(np.asarray(block_ids)[write], pages, client.region_data, to_region=True)
        budget = int(desc.total_bytes * fraction)
        copied = 0
        for src, dst, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.nbytes.tolist()):
            n = min(n, budget - copied)
            if n <= 0:
                break
            ctypes.memmove(dst, src, n)
            copied += n
        state["hang"] = True
        return {"outcomes": outcomes.tolist(), "copied_bytes": copied, "total_bytes": desc.total_bytes}

    def raw(op, **fields):
        reply = dict(state["client"].channel.call(op, **fields))
        return {k: v for k, v in reply.items() if k not in ("pages",)}

    def block_bytes(b):
        return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in state["kv"])

    def fill_keys(keys, block_ids):
        for key, b in zip(keys, block_ids):
            data = key_content(key, len(block_bytes(b)))
            at = 0
            for t in state["kv"]:
                flat = t[b].view(torch.uint8).view(-1)
                flat.copy_(torch.frombuffer(bytearray(data[at:at + flat.numel()]), dtype=torch.uint8))
                at += flat.numel()

    def verify_keys(keys, block_ids):
        """Per block: True when it holds exactly its key's bytes."""
        return [block_bytes(b) == key_content(key, len(block_bytes(b))) for key, b in zip(keys, block_ids)]

    def gate():
        client = state["client"]
        if not isinstance(client.copier, GatedCopier):
            client.copier = GatedCopier(client.copier)
        client.copier.gate.clear()
        client.copier.armed = True

    def open_gate(wait=False):
        """Let the held copy run; ``wait``: until its bytes landed (it does not vote yet)."""
        client = state["client"]
        if isinstance(client.copier, GatedCopier):
            client.copier.gate.set()
        if wait:
            for pending in list(client._pending.values()):
                pending.handle.wait(60)

    commands = {
        "connect": connect, "store": store, "load": load, "close": close,
        "fill": lambda block_ids, seed: fill(block_ids, seed),
        "hashes": block_hashes,
        "lookup": lambda keys: state["client"].lookup(keys),
        "lookup_detail": lambda keys: hits_and_pending(state["client"].lookup_detail(keys)),
        "stats": lambda: state["client"].stats().to_wire(),
        "store_hold": store_hold, "load_hold": load_hold, "finish": finish,
        "store_partial_then_hang": store_partial_then_hang,
        "job_status": lambda jobs: state["client"].job_status(jobs),
        "raw": lambda op, fields=None: raw(op, **(fields or {})),
        "fill_keys": fill_keys, "verify_keys": verify_keys, "gate": gate, "open_gate": open_gate,
    }
    def park() -> None:
        while state.get("hang"):       # store_partial_then_hang: wait here to be killed
            time.sleep(3600)

    serve(conn, commands, close=close, after=park)


RankError = ChildError


class RankProcess(ChildProcess):
    def __init__(self) -> None:
        super().__init__(_worker, timeout=90)

"""A well-behaved engine whose every block's bytes are a function of its model and key.

``KeyedEngine`` is a spawned process holding a TP=1 ``kvtier.Client`` and a small CPU KV cache
(NumPy arrays seen through torch). ``round(keys)`` is what an engine does for one prompt: look up
the keys, load the hits into clobbered blocks and compare every loaded block with the bytes its
model and key define (``content``: another model's block under the same key is a wrong block),
then store the keys that missed. A load that is not ok (the daemon
aborted the job, or restarted) is a miss, never a wrong block; a wrong block is a loaded block of
an ok job whose bytes are not its key's. The counters come back with every round.

Used by the hostile tests and the hostile soak: whatever an attacker does, ``wrong`` stays 0.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from tests.procs import ChildProcess, serve

BLOCK_BYTES = 16384
LAYERS = 2
BLOCKS = 32


def content(model: str, key: bytes, nbytes: int = BLOCK_BYTES):
    import numpy as np
    seed = int.from_bytes(hashlib.sha256(model.encode() + b"/" + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}/{i}".encode()).digest() + b"\0\0\0\0" for i in range(n)]


def namespace(model: str = "keyed", block_bytes: int = BLOCK_BYTES) -> dict:
    return {"model": model, "dtype": "uint8", "block_tokens": 16, "block_bytes": block_bytes,
            "sharding": "replicated"}


def _worker(conn) -> None:
    import numpy as np
    import torch

    from kvtier import Client, NamespaceId

    state: dict[str, Any] = {"jobs": 0}
    totals: Counter = Counter()
    arrays: list = []

    def connect(socket: str, engine: str, model: str = "keyed", timeout: float = 20.0, secret: bytes | None = None,
                reconnect_timeout: float = 60.0, block_bytes: int = BLOCK_BYTES) -> dict:
        kwargs = {} if secret is None else {"engine_secret": secret}
        state.update(model=model, block_bytes=block_bytes, row=block_bytes // LAYERS)
        arrays[:] = [np.zeros((BLOCKS, block_bytes // LAYERS), dtype=np.uint8) for _ in range(LAYERS)]
        state["client"] = Client(socket, engine_id=engine, rank=0, world_size=1,
                                 namespace=NamespaceId(**namespace(model, block_bytes)), pin="off", copier="cpu",
                                 timeout=timeout, reconnect_timeout=reconnect_timeout, **kwargs)
        state["client"].register_kv_caches([torch.from_numpy(a) for a in arrays])
        return {"session": state["client"].session}

    def expected(key: bytes) -> "np.ndarray":
        return content(state["model"], key, state["block_bytes"])

    def block(b: int) -> "np.ndarray":
        return np.concatenate([a[b] for a in arrays])

    def put(b: int, key: bytes) -> None:
        data, row = expected(key), state["row"]
        for i, a in enumerate(arrays):
            a[b] = data[i * row:(i + 1) * row]

    def next_job() -> int:
        state["jobs"] += 1
        return state["jobs"]

    def one_round(keys: list[bytes]) -> dict:
        """lookup → load and verify the hits → store the misses; the counters so far."""
        from kvtier import KvtierError
        client = state["client"]
        n = len(keys)
        assert n <= BLOCKS // 2
        out: Counter = Counter()
        try:
            hits = client.lookup(keys)
            dst = list(range(BLOCKS // 2, BLOCKS // 2 + n))
            for b in dst:
                for a in arrays:
                    a[b] = 0xA5                          # a load that copied nothing cannot pass
            job = next_job()
            loaded = client.load(job, keys, dst)
            (result,) = client.wait([job], timeout=60)
            if result.ok:
                for i in range(loaded):
                    if np.array_equal(block(dst[i]), expected(keys[i])):
                        out["verified"] += 1
                    else:
                        out["wrong"] += 1
            else:
                out["loads_not_ok"] += 1
            out["lookup_hits"] += hits
            missing = keys[loaded:]
            if missing:
                src = list(range(len(missing)))
                for b, key in zip(src, missing):
                    put(b, key)
                job = next_job()
                client.store(job, missing, src)
                (result,) = client.wait([job], timeout=60)
                out["stored" if result.ok else "stores_not_ok"] += len(missing)
        except KvtierError as exc:               # the daemon restarted or refused: a miss, reported
            out["errors"] += 1
            out[f"error:{type(exc).__name__}"] += 1
        out["rounds"] += 1
        totals.update(out)
        return dict(totals)

    def close() -> None:
        client = state.pop("client", None)
        if client is not None:
            client.close()

    serve(conn, {"connect": connect, "round": one_round, "totals": lambda: dict(totals), "close": close},
          close=close)


class KeyedEngine(ChildProcess):
    def __init__(self) -> None:
        super().__init__(_worker, timeout=120)

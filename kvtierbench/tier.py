"""Benchmark section ``tier``: each second-tier engine's own raw put/get against kvtierd's tier path.

The floor for issue 16's goal ("promote and demote throughput >= 0.8x the engine's own raw
put/get of the same blocks in the same run"). Per engine (a real one on loopback, started and
stopped here) and block size S, N blocks of S bytes, fresh keys every repetition, median of
``reps`` after a warm-up:

``raw``      the engine's own client at its best, from one contiguous buffer:
             Mooncake ``batch_put_from``/``batch_get_into`` (its zero-copy API, registered memory);
             Redis Cluster through redis-py's ``RedisCluster`` pipeline (SET of each block, GET of
             each block copied into its place, as a KV library must)
``backend``  ``kvtierd.tier`` backend + guard in this process, blocks in fixed pages of a region
``link``     the whole phase-1 path the daemon will use: TierLink → companion process → backend,
             reading and writing a region file the companion maps (phase 2's demote and promote add
             the daemon's index work on top of this)

Ratios are blocks/s of backend and link against raw, per direction. Run it alone with
``python -m kvtierbench.tier [--quick] [--json]``; ``section(quick)`` returns the same
``{"rows", "ratios", "targets", "notes"}`` shape as the ``kvtierctl bench`` sections, so it can
join them once kvtierbench/ is a package (issue 12).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from kvtierd.tier.backend import open_backend, page_extents
from kvtierd.tier.engines import EngineUnavailable, MooncakeCluster, RedisCluster
from kvtierd.tier.guard import Guard
from kvtierd.tier.keys import Keyspace
from kvtierd.tier.link import TierLink

MiB = 1 << 20
PAGE = 64 << 10                  # the daemon's default page size


@dataclass(frozen=True)
class Plan:
    blocks: int
    block_sizes: tuple[int, ...]
    reps: int


FULL = Plan(blocks=256, block_sizes=(64 << 10, MiB), reps=5)
QUICK = Plan(blocks=32, block_sizes=(256 << 10,), reps=2)


def say(message: str) -> None:
    print(f"[bench tier] {message}", file=sys.stderr, flush=True)


class Region:
    """A region file in /dev/shm: the blocks' pages, mapped here and by the companion."""

    def __init__(self, pages: int):
        self.dir = tempfile.mkdtemp(prefix="kvtbench-tier-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK)
                                    else None)
        self.path = os.path.join(self.dir, "bench.region")
        self.size = pages * PAGE
        with open(self.path, "wb") as f:
            f.truncate(self.size)
        fd = os.open(self.path, os.O_RDWR)
        self.map = mmap.mmap(fd, self.size)
        os.close(fd)
        self.array = np.frombuffer(self.map, np.uint8)
        self.array[:] = np.random.default_rng(1).integers(0, 256, self.size, dtype=np.uint8)

    def close(self) -> None:
        del self.array
        try:
            self.map.close()
        except BufferError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _check(ok, what: str) -> None:
    if not all(ok):
        raise RuntimeError(f"{what}: {len(ok) - sum(ok)} of {len(ok)} blocks failed")


# ------------------------------------------------------------------------------------------ raw
def raw_mooncake(backend, region: Region, n: int, size: int, keys: list[str]) -> tuple[float, float]:
    """Mooncake's own zero-copy batch API from/into one contiguous registered buffer."""
    store = backend.store
    base = backend.base
    ptrs = [base + i * size for i in range(n)]
    sizes = [size] * n
    put = timed(lambda: _check([c == 0 for c in store.batch_put_from(keys, ptrs, sizes, backend.config)], "raw put"))
    dst = [base + (n + i) * size for i in range(n)]
    get = timed(lambda: _check([c == size for c in store.batch_get_into(keys, dst, sizes)], "raw get"))
    return put, get


def raw_redis(client, region: Region, n: int, size: int, keys: list[str]) -> tuple[float, float]:
    """redis-py's cluster pipeline: one SET per block, then one GET per block copied into place."""
    view = memoryview(region.map)

    def put():
        pipe = client.pipeline(transaction=False)
        for i, k in enumerate(keys):
            pipe.set(k, view[i * size:(i + 1) * size])
        _check([r is True for r in pipe.execute()], "raw put")

    def get():
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        values = pipe.execute()
        _check([v is not None and len(v) == size for v in values], "raw get")
        base = ctypes.addressof(ctypes.c_char.from_buffer(region.map))
        for i, v in enumerate(values):
            ctypes.memmove(base + (n + i) * size, v, size)

    return timed(put), timed(get)


# ------------------------------------------------------------------------------------------ ours
def block_pages(n: int, size: int, first_block: int) -> np.ndarray:
    per = -(-size // PAGE)
    return np.arange(first_block * per, (first_block + n) * per).reshape(n, per)


def via_backend(guard: Guard, n: int, size: int, keys: list[str]) -> tuple[float, float]:
    src = page_extents(block_pages(n, size, 0), PAGE, size)
    dst = page_extents(block_pages(n, size, n), PAGE, size)
    put = timed(lambda: _check(guard.call("put", keys, src, timeout=120), "backend put"))
    get = timed(lambda: _check(guard.call("get", keys, dst, timeout=120), "backend get"))
    return put, get


def link_call(link: TierLink, op: str, **fields) -> dict:
    ctx = object()
    link.submit(op, ctx, **fields)
    deadline = time.monotonic() + 300
    while True:
        for o in link.collect():
            if o.context is ctx and o.final:
                if not o.ok:
                    raise RuntimeError(f"link {op}: {o.error}")
                return o.result
        if time.monotonic() > deadline:
            raise RuntimeError(f"link {op}: no answer")
        time.sleep(0.0005)


def via_link(link: TierLink, n: int, size: int, keys: list[bytes], ns: bytes) -> tuple[float, float]:
    src = block_pages(n, size, 0).astype("<u4").tobytes()
    dst = block_pages(n, size, n).astype("<u4").tobytes()
    out = {}
    put = timed(lambda: out.update(put=link_call(link, "put", ns=ns, keys=keys, pages=src, length=size)))
    get = timed(lambda: out.update(get=link_call(link, "get", ns=ns, keys=keys, pages=dst, length=size)))
    _check(list(out["put"]["done"]), "link put")
    _check(list(out["get"]["done"]), "link get")
    return put, get


# ------------------------------------------------------------------------------------------ run
def engine_rows(kind: str, plan: Plan) -> tuple[list[dict], str]:
    n = plan.blocks
    biggest = max(plan.block_sizes)
    if kind == "mooncake":
        engine = MooncakeCluster(segment_bytes=max(512 * MiB, 4 * n * biggest))
    else:
        engine = RedisCluster(maxmemory=f"{max(512, 4 * n * biggest // MiB)}mb")
    rows = []
    region = Region(2 * n * -(-biggest // PAGE))
    link = None
    try:
        engine.start()
        settings = {"master": engine.address} if kind == "mooncake" else {"nodes": engine.address}
        backend = open_backend(kind, **settings, timeout=30.0)
        backend.attach(memoryview(region.map))
        guard = Guard(backend, timeout=120)
        if kind == "mooncake":
            raw_client = backend
            version = backend.info()["version"]
        else:
            import redis
            from redis.cluster import ClusterNode, RedisCluster as PyCluster
            raw_client = PyCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in
                                                  (a.split(":") for a in engine.address.split(","))],
                                   socket_timeout=120)
            version = f"{engine.version()} (redis-py {redis.__version__}, hiredis " \
                      f"{'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'})"
        link = TierLink(f"ipc://{region.dir}/tier.sock", region.path, 0, region.size, PAGE, kind,
                        {**settings, "timeout": 30.0}, timeout=30.0, data_timeout=120.0,
                        log_path=os.path.join(region.dir, "tier.log"))
        link.start()
        deadline = time.monotonic() + 60
        while link.state != "ready":
            link.collect()
            if link.state in ("failed", "down") or time.monotonic() > deadline:
                raise RuntimeError(f"the tier companion did not start: {link.status()}")
            time.sleep(0.01)
        raw = raw_mooncake if kind == "mooncake" else raw_redis
        for size in plan.block_sizes:
            times = {"raw": [], "backend": [], "link": []}
            for rep in range(plan.reps + 1):
                ks = Keyspace(b"bench|%d|%d" % (size, rep))
                keys = [b"block-%06d" % i for i in range(n)]
                names = ks.names(keys)
                times["raw"].append(raw(raw_client, region, n, size, [k + "/raw" for k in names]))
                times["backend"].append(via_backend(guard, n, size, [k + "/be" for k in names]))
                times["link"].append(via_link(link, n, size, keys, ks.identity))
                guard.call("clear", ks.prefix, timeout=60)
            row = {"engine": kind, "blocks": n, "block_bytes": size}
            for name, runs in times.items():
                put, get = np.median(np.array(runs[1:]), axis=0)
                row[f"{name}_put_blocks_per_s"] = n / put
                row[f"{name}_get_blocks_per_s"] = n / get
                row[f"{name}_put_gb_per_s"] = n * size / put / 1e9
                row[f"{name}_get_gb_per_s"] = n * size / get / 1e9
            for name in ("backend", "link"):
                for d in ("put", "get"):
                    row[f"{name}_{d}_vs_raw"] = row[f"{name}_{d}_blocks_per_s"] / row[f"raw_{d}_blocks_per_s"]
            rows.append(row)
            say(f"{kind} {n} x {size >> 10} KiB: raw put {row['raw_put_gb_per_s']:.2f} get "
                f"{row['raw_get_gb_per_s']:.2f} GB/s; link put x{row['link_put_vs_raw']:.2f} get "
                f"x{row['link_get_vs_raw']:.2f} of raw")
        guard.close()
        if kind == "redis":
            raw_client.close()
        return rows, version
    finally:
        if link is not None:
            link.stop()
        engine.stop()
        region.close()


def section(quick: bool = False, engines: tuple[str, ...] = ("mooncake", "redis")) -> dict:
    plan = QUICK if quick else FULL
    rows, notes, skipped = [], [], {}
    for kind in engines:
        try:
            got, version = engine_rows(kind, plan)
        except (EngineUnavailable, ImportError) as exc:
            skipped[kind] = str(exc)
            say(f"{kind} skipped: {exc}")
            continue
        rows += got
        notes.append(f"{kind} {version} on 127.0.0.1")
    ratios = {f"{r['engine']}_{r['blocks']}x{r['block_bytes'] >> 10}KiB_{name}_{d}_vs_raw": r[f"{name}_{d}_vs_raw"]
              for r in rows for name in ("backend", "link") for d in ("put", "get")}
    targets = [{"what": f"{kind} tier path vs the engine's raw {d} (worst block size; phase 2 measures demote/promote)",
                "value": min(r[f"link_{d}_vs_raw"] for r in rows if r["engine"] == kind), "goal": 0.8,
                "better": "higher"}
               for kind in {r["engine"] for r in rows} for d in ("put", "get")]
    notes.append("raw: Mooncake batch_put_from/batch_get_into on one registered buffer; Redis: redis-py cluster "
                 "pipeline, GET values copied into place. backend: kvtierd.tier in-process; link: through the "
                 "companion process. Fresh keys every repetition; median of the repetitions after a warm-up.")
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtierbench.tier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke test)")
    parser.add_argument("--engine", action="append", choices=("mooncake", "redis"), help="only these engines")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    result = section(args.quick, tuple(args.engine or ("mooncake", "redis")))
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'engine':9} {'blocks':>6} {'KiB':>6}  {'path':8} {'put GB/s':>9} {'get GB/s':>9} {'put/raw':>8} "
          f"{'get/raw':>8}")
    for r in result["rows"]:
        for name in ("raw", "backend", "link"):
            ratio = ("" if name == "raw" else f"{r[f'{name}_put_vs_raw']:8.2f} {r[f'{name}_get_vs_raw']:8.2f}")
            print(f"{r['engine']:9} {r['blocks']:6} {r['block_bytes'] >> 10:6}  {name:8} "
                  f"{r[f'{name}_put_gb_per_s']:9.2f} {r[f'{name}_get_gb_per_s']:9.2f} {ratio}")
    for note in result["notes"]:
        print(f"note: {note}")
    for kind, why in result["skipped"].items():
        print(f"skipped {kind}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

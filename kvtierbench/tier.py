"""``tier``: demote and promote through two daemons sharing a second tier, against the same
engine's own raw put/get of the same blocks in the same run; and the lookup-miss latency the
tier check adds, against a local lookup of the same keys.

Per engine (a real one on loopback, started and stopped here: ``kvtierbench.tierservers``) and block
size S, N blocks per repetition, median of ``reps`` after a warm-up, fresh keys every time, the
raw floor and the daemons taking turns at going first:

``raw``      the engine's own client at its best, from one contiguous buffer in this process:
             Mooncake ``batch_put_from``/``batch_get_into`` (its zero-copy API, registered memory);
             Redis Cluster through redis-py's ``RedisCluster`` pipeline (SET of each block, GET of
             each block copied into its place, as a KV library must)
``demote``   node A (a kvtierd whose region holds exactly 2N blocks, ``tier_low_watermark`` 0.5)
             demotes its N blocks X in one put, timed by the daemon itself
             (``kvtierbench.tiernode.demote_x``, which says how X are made its only victims);
             then the engine is asked whether it holds all of X
``promote``  node B (another kvtierd on the same engine) is asked for X: timed from the first
             lookup (pending N) to the lookup that finds all N READY (asked every 0.5 ms): the
             existence check, the pages, the get into them, READY. B then loads X and every block
             is checked (its index is in its first bytes)

Lookup latency, on a third node with 4 KiB one-page blocks: a lookup of K fresh keys the tier
does not hold (the daemon answers at once, pending K, and sends the existence check after the
reply) against a lookup of the same K keys once they are stored locally; p50 of
``lookup_batches`` of each, interleaved, each after the same short pause. "answered" is how long
until a lookup no longer reports them pending (the check's round trip through the companion and
the engine; every tenth batch), for information.

Both nodes run the daemon as shipped (a tier companion process each), sealing with one key (as a
fleet's nodes do). The disk backend ("disk") is node-local: one node demotes and promotes, against
O_DIRECT on the same filesystem (``kvtierbench.disktier``). Run it alone with ``kvtierctl bench
--only tier`` or ``python -m kvtierbench.tier [--quick] [--engine E]``.
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

import numpy as np

from kvtierd.tier.backend import Owner, open_backend
from kvtierd.tier.keys import Keyspace, identity

from . import disktier
from .tiernode import demote_x, promote_x
from .harness import (DATA_PAGE, FULL, QUICK, BlockBench, Context, MiB, bench_daemon, bench_namespace, make_keys, pct,
                      region_size, say, target)
from .tierservers import MooncakeCluster, RedisCluster, ServerUnavailable

ENGINES = ("mooncake", "redis", "disk")
OWNER = Owner("kvtierbench", "")          # the raw floors' own clients: no directory to claim
LOOKUP_PAGE = 4096
# A pause before each timed lookup, as between an engine's scheduler steps. Timed right after
# a burst of lookups polling for the tier's answer, a 1-key miss took 574 us against 194 us after
# a pause (Mooncake; the companion's engine threads still busy on this 2-CPU machine).
IDLE = 0.003


class Buffer:
    """The raw floor's memory: 2N blocks of S in the bench's directory (/dev/shm unless --workdir
    moves it), mapped here (registered with Mooncake)."""

    def __init__(self, size: int, base: str):
        self.dir = tempfile.mkdtemp(prefix="raw-", dir=base)
        path = os.path.join(self.dir, "raw")
        with open(path, "wb") as f:
            f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(fd, size)
        os.close(fd)
        np.frombuffer(self.map, np.uint8)[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)

    def close(self) -> None:
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
class RawMooncake:
    """Mooncake's own zero-copy batch API from/into one contiguous registered buffer."""

    def __init__(self, engine, buffer: Buffer):
        self.backend = open_backend("mooncake", engine.address, timeout=30.0)
        self.backend.attach(memoryview(buffer.map), OWNER)

    def put_get(self, n: int, size: int, keys: list[str]) -> tuple[float, float]:
        store, base, config = self.backend.store, self.backend.base, self.backend.config
        sizes = [size] * n
        src = [base + i * size for i in range(n)]
        put = timed(lambda: _check([c == 0 for c in store.batch_put_from(keys, src, sizes, config)], "raw put"))
        dst = [base + (n + i) * size for i in range(n)]
        get = timed(lambda: _check([c == size for c in store.batch_get_into(keys, dst, sizes)], "raw get"))
        return put, get

    def clear(self, prefix: str) -> None:
        self.backend.clear(prefix)

    def holds(self, keys: list[str]) -> int:
        """How many of ``keys`` the engine holds (one existence check, off the timed path)."""
        return sum(self.backend.exists(keys))

    def close(self) -> None:
        self.backend.close()


class RawRedis:
    """redis-py's cluster pipeline: one SET per block, then one GET per block copied into place."""

    def __init__(self, engine, buffer: Buffer):
        from redis.cluster import ClusterNode, RedisCluster as PyCluster
        self.buffer = buffer
        self.client = PyCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in
                                               (a.split(":") for a in engine.address.split(","))], socket_timeout=120)
        self.cleaner = open_backend("redis", engine.address, timeout=30.0)   # SCAN + UNLINK per primary

    def put_get(self, n: int, size: int, keys: list[str]) -> tuple[float, float]:
        view = memoryview(self.buffer.map)

        def put():
            pipe = self.client.pipeline(transaction=False)
            for i, k in enumerate(keys):
                pipe.set(k, view[i * size:(i + 1) * size])
            _check([r is True for r in pipe.execute()], "raw put")

        def get():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            values = pipe.execute()
            _check([v is not None and len(v) == size for v in values], "raw get")
            base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer.map))
            for i, v in enumerate(values):
                ctypes.memmove(base + (n + i) * size, v, size)

        return timed(put), timed(get)

    def clear(self, prefix: str) -> None:
        self.cleaner.clear(prefix)

    def holds(self, keys: list[str]) -> int:
        return sum(self.cleaner.exists(keys))

    def close(self) -> None:
        self.client.close()
        self.cleaner.close()


def engine_version(kind: str, engine) -> str:
    if kind == "mooncake":
        from importlib.metadata import version
        return f"mooncake-transfer-engine-non-cuda {version('mooncake-transfer-engine-non-cuda')}"
    import redis
    return f"redis-server {engine.version()} (raw floor: redis-py {redis.__version__}, hiredis " \
           f"{'yes' if redis.utils.HIREDIS_AVAILABLE else 'no'})"


# ------------------------------------------------------------------------------------------ nodes
def tier_flags(ctx: Context, kind: str, engine, *more: str) -> tuple[str, ...]:
    return ("--tier-backend", kind, "--tier-address", engine.address, "--tier-data-timeout", "120",
            "--tier-kill-after", "60", "--tier-timeout", "5", "--tier-key-file", key_file(ctx), *more)


def key_file(ctx: Context) -> str:
    """The key every node of the run seals with (generated once, mode 0600)."""
    path = ctx.path("tier.key")
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
    return path


def start_node(ctx: Context, name: str, kind: str, engine, pages: int, page_size: int, *more: str):
    daemon = bench_daemon(ctx.path(name), region_size(pages, page_size), page_size,
                          *tier_flags(ctx, kind, engine, *more))
    daemon.start()
    deadline = time.monotonic() + 120
    while daemon.stats()["tier"]["state"] != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tier companion of {name} did not start: {daemon.stats()['tier']}")
        time.sleep(0.05)
    return daemon


def demote_promote(a, b, bench_a: BlockBench, bench_b: BlockBench, n: int, seed: int, ns_name: str,
                   raw, keyspace: Keyspace) -> tuple[float, float]:
    """One repetition: X demoted from A (timed), then promoted into B (timed) and checked."""
    b.call("clear", admin=True, namespace=ns_name)            # B's region empty too
    x, ids, demote = demote_x(a, bench_a, n, seed, ns_name)
    held = raw.holds(keyspace.names(x))
    if held != n:
        raise RuntimeError(f"node A demoted {n} blocks but the tier holds {held} of the {n} of X")
    return demote, promote_x(b, bench_b, x, ids)["promote"]


def lookup_latency(ctx: Context, kind: str, engine, batches: int, sizes: tuple[int, ...]) -> list[dict]:
    from kvtier import Client
    pages = (batches + 2) * sum(sizes) + 64
    node = start_node(ctx, f"{kind}-lookup", kind, engine, pages, LOOKUP_PAGE, "--no-tier-demote")
    client = Client(node.socket, engine_id="bench-lookup", rank=0, world_size=1,
                    namespace=bench_namespace("tier-lookup", LOOKUP_PAGE), copier="cpu", pin="off", timeout=60)
    rows = []
    try:
        jobs = iter(range(1, 1 << 62))
        for k in sizes:
            miss, local, answered = [], [], []
            for i in range(batches + 2):                    # two warm-ups
                keys = make_keys(9_000_000 + 1000 * k + i, k)
                time.sleep(IDLE)
                t0 = time.perf_counter()
                reply = client.lookup_detail(keys)
                t1 = time.perf_counter()
                if (reply.hits, reply.pending) != (0, k):
                    raise RuntimeError(f"a lookup of {k} fresh keys answered {reply}")
                if i % 10 == 0:                            # now and then: when the tier's answer is known
                    while client.lookup_detail(keys).pending:
                        time.sleep(0.0001)
                    answered.append(time.perf_counter() - t0)
                job = next(jobs)
                client.channel.call("store", job=job, keys=keys)
                client.channel.call("commit", job=job, ok=True)
                time.sleep(IDLE)
                t3 = time.perf_counter()
                if client.lookup_detail(keys).hits != k:
                    raise RuntimeError("the stored keys are not hits")
                t4 = time.perf_counter()
                if i >= 2:
                    miss.append(t1 - t0)
                    local.append(t4 - t3)
            miss_us, local_us = np.array(miss) * 1e6, np.array(local) * 1e6
            row = {"engine": kind, "keys": k, "miss_p50_us": pct(miss_us, 50), "miss_p99_us": pct(miss_us, 99),
                   "local_p50_us": pct(local_us, 50), "local_p99_us": pct(local_us, 99),
                   "answered_p50_us": pct(np.array(answered) * 1e6, 50)}
            row["miss_vs_local"] = row["miss_p50_us"] / row["local_p50_us"]
            rows.append(row)
            say(f"tier {kind} lookup of {k} keys: miss p50 {row['miss_p50_us']:.0f} us, local "
                f"{row['local_p50_us']:.0f} us (x{row['miss_vs_local']:.2f}); tier answered in "
                f"{row['answered_p50_us']:.0f} us")
    finally:
        client.close()
        node.stop()
        shutil.rmtree(node.dir, ignore_errors=True)
    return rows


def engine_rows(ctx: Context, kind: str) -> tuple[list[dict], list[dict], str]:
    plan = ctx.plan
    n, biggest = plan.tier_blocks, max(plan.tier_block_sizes)
    segment = max(512 * MiB, 4 * n * biggest)
    engine = (MooncakeCluster(segment_bytes=segment) if kind == "mooncake"
              else RedisCluster(maxmemory=f"{segment // MiB}mb"))
    buffer = Buffer(2 * n * biggest, ctx.workdir)
    raw = None
    rows = []
    try:
        engine.start()
        raw = (RawMooncake if kind == "mooncake" else RawRedis)(engine, buffer)
        for size in plan.tier_block_sizes:
            per = -(-size // DATA_PAGE)
            name = f"tier-{kind}-{size}"
            a = start_node(ctx, f"{name}-a", kind, engine, 2 * n * per, DATA_PAGE, "--tier-low-watermark", "0.5")
            b = start_node(ctx, f"{name}-b", kind, engine, 4 * n * per, DATA_PAGE)
            bench_a, bench_b = BlockBench(a, size, n, name), BlockBench(b, size, n, name)
            ns_id = bench_namespace(name, size)
            ns_name, keyspace = ns_id.name(), Keyspace(identity(ns_id))
            try:
                times = {"raw": [], "tier": []}
                for rep in range(plan.tier_reps + 1):
                    seed = 1_000_000 * (rep + 1) + size
                    ks = Keyspace(b"bench-raw|%d|%d" % (size, rep))

                    def floor():
                        times["raw"].append(raw.put_get(n, size, ks.names(make_keys(seed + 7, n))))
                        raw.clear(ks.prefix)

                    def ours():
                        times["tier"].append(demote_promote(a, b, bench_a, bench_b, n, seed, ns_name, raw, keyspace))
                    # Taking turns at going first: on a shared machine, the first of the two after
                    # a pause measured slower, whichever it was.
                    for step in ((floor, ours) if rep % 2 else (ours, floor)):
                        step()
                (put, get), (demote, promote) = (np.median(np.array(times[k][1:]), axis=0) for k in ("raw", "tier"))
                row = {"engine": kind, "blocks": n, "block_bytes": size,
                       "raw_put_blocks_per_s": n / put, "raw_get_blocks_per_s": n / get,
                       "demote_blocks_per_s": n / demote, "promote_blocks_per_s": n / promote,
                       "raw_put_gbps": n * size / put / 1e9, "raw_get_gbps": n * size / get / 1e9,
                       "demote_gbps": n * size / demote / 1e9, "promote_gbps": n * size / promote / 1e9,
                       "demote_vs_raw_put": put / demote, "promote_vs_raw_get": get / promote}
                rows.append(row)
                say(f"tier {kind} {n} x {size >> 10} KiB: raw put {row['raw_put_gbps']:.2f} get "
                    f"{row['raw_get_gbps']:.2f} GB/s; demote x{row['demote_vs_raw_put']:.2f}, promote "
                    f"x{row['promote_vs_raw_get']:.2f} of raw")
            finally:
                bench_a.close()
                bench_b.close()
                for node in (a, b):
                    node.stop()
                    shutil.rmtree(node.dir, ignore_errors=True)
        lookups = lookup_latency(ctx, kind, engine, plan.tier_lookup_batches, plan.tier_lookup_keys)
        return rows, lookups, engine_version(kind, engine)
    finally:
        if raw is not None:
            raw.close()
        engine.stop()
        buffer.close()


def run(ctx: Context, engines: tuple[str, ...] = ENGINES) -> dict:
    rows, lookups, notes, skipped, restart = [], [], [], [], []
    for kind in engines:
        try:
            if kind == "disk":
                got, restart, version = disktier.rows(ctx)
                rows += got
                notes.append(version)
                continue
            got, lat, version = engine_rows(ctx, kind)
        except (ServerUnavailable, ImportError) as exc:
            skipped.append(f"{kind}: {exc}")
            say(f"tier: {kind} skipped: {exc}")
            continue
        rows += got
        lookups += lat
        notes.append(f"{kind}: {version}, on 127.0.0.1")
    if not rows:
        return {"skipped": "; ".join(skipped)}
    ratios = {f"{r['engine']}_{r['blocks']}x{r['block_bytes'] >> 10}KiB_{what}": r[what]
              for r in rows for what in ("demote_vs_raw_put", "promote_vs_raw_get")}
    ratios.update({f"{r['engine']}_lookup_{r['keys']}_miss_vs_local": r["miss_vs_local"] for r in lookups})
    targets = []
    disk = [r for r in rows if r["engine"] == "disk"]
    if disk:
        ratios.update({f"disk_{r['blocks']}x{r['block_bytes'] >> 10}KiB_{what}": r[what] for r in disk
                       for what in ("lookup_pending_vs_local", "lookup1_pending_vs_local")})
        ratios["disk_restart_first_block_ready_s"] = restart[0]["first_block_ready_s"]
        targets += disktier.targets(disk, restart)
    for kind in dict.fromkeys(r["engine"] for r in rows if r["engine"] != "disk"):
        mine = [r for r in rows if r["engine"] == kind]
        targets += [target(f"tier {kind}: demote vs the engine's raw put, blocks/s (worst block size)",
                           min(r["demote_vs_raw_put"] for r in mine), 0.8, "higher"),
                    target(f"tier {kind}: promote vs the engine's raw get, blocks/s (worst block size)",
                           min(r["promote_vs_raw_get"] for r in mine), 0.8, "higher")]
        targets.append(target(f"tier {kind}: lookup-miss p50 vs a local lookup of the same keys (worst key count)",
                              max(r["miss_vs_local"] for r in lookups if r["engine"] == kind), 2, "lower"))
    notes += [f"skipped {s}" for s in skipped]
    if len(disk) < len(rows):
        notes.append("raw: the engine's own client in this process (Mooncake batch_put_from/batch_get_into on one "
                     "registered buffer; Redis: redis-py cluster pipeline, GET values copied into place). demote: node "
                     "A's daemon writes its N blocks X to the tier in one put once a store takes its last free pages, "
                     "X its only READY blocks then (the put's round trip, timed by the daemon; the engine then holds "
                     "all of X); promote: node B, first lookup to all N READY (existence check, allocation, get into "
                     "the region, READY), then loaded and checked. Both through each daemon's tier companion. Fresh "
                     "keys every repetition; median of the repetitions after a warm-up")
    if disk:
        notes.append("disk: one node demotes N blocks X to its disk tier and promotes them back, against the same "
                     "blocks written and read with O_DIRECT in the same directory (the faster of one stream and "
                     f"{disktier.IO_THREADS}), from and into the region's pages the promote filled (raw_anon: from "
                     "and into a buffer of the bench's own); lookups of keys held only on disk against the same keys READY; a "
                     "restart on a directory of R blocks to the first disk block READY (kvtierbench/disktier.py)")
    return {"rows": rows, "more": {"lookup": lookups, "disk lookup": disk, "disk restart": restart}, "ratios": ratios,
            "targets": targets, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtierbench.tier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke test)")
    parser.add_argument("--engine", action="append", choices=ENGINES, help="only these engines")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    from .harness import workdir_base
    from .report import format_results
    workdir = tempfile.mkdtemp(prefix="kvtbench-", dir=workdir_base())
    ctx = Context(QUICK if args.quick else FULL, workdir)
    started = time.perf_counter()
    try:
        section = run(ctx, tuple(args.engine or ENGINES))
    finally:
        ctx.close()
        shutil.rmtree(workdir, ignore_errors=True)
    from .harness import machine
    result = {"machine": {**machine(), "loadavg_end": list(os.getloadavg())}, "quick": args.quick,
              "seconds": time.perf_counter() - started, "sections": {"tier": section}}
    print(json.dumps(result, indent=1) if args.json else format_results(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

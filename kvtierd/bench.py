"""``kvtierctl bench``: kvtierd against the floors of this machine and against Redis, in one run.

Every figure is reported as a ratio to a floor or a peer measured in the same run on the same
machine, so results from different machines compare by their ratios, and a loaded machine
(``machine.loadavg`` in the output) shows as noise on both sides rather than as a regression.

Sections (``--only`` picks some; each starts its own daemon in a fresh directory):

``control``   lookup, store and load jobs of B keys from C client processes (TP=1 rank sessions,
              one-page blocks): p50/p99 latency of a job and keys/s. A store job is the ``store``
              request and the writer's ``commit``; a load job the ``load`` request and the
              ``release`` (the copies are the data plane's). Floor: a ZMQ ROUTER echo server in
              its own process that decodes the same request frames and answers with reply frames
              of the same size (a daemon doing no work), driven by the same client code. The two
              sides alternate in short slices, so that both see the same machine.
``data``      the CPU data plane: store then load of K blocks of S bytes through the client (CPU
              copier, block ids in random order as an engine's are, its region mapping
              prefaulted as a running engine's is), GB/s against one-thread memcpy of the same
              bytes into and back out of a prefaulted shared mapping; plus the round trip of a
              ping after the daemon idled, which the job's requests pay after each copy.
``capacity``  TP = 1, 2, 4, 8 ranks on one region: blocks it holds and bytes the ranks' copiers
              wrote (D2H) per stored block, replicated (one copy, rank 0 writes) against sharded
              with the same bytes per rank (each rank its own copy: what per-rank offloading does).
``eviction``  stores/s into a full region of N one-page entries (every stored key evicts one)
              against stores/s into the same region while it still has room.
``recovery``  restart of a daemon whose region holds N entries: process start to socket ready
              (median of 3), and the store's recovery (``Store(view)``) alone; against a start on
              a fresh region of the same size and the bare interpreter start with the daemon's
              imports.
``redis``     a real redis-server on loopback (started and stopped here) storing and loading the
              same blocks, the way KV-cache libraries use Redis as a remote tier: each job both as
              one pipelined MSET/MGET and as one SET/GET per block, Redis credited with the faster
              per direction; blocks/s against kvtierd's. Skipped when redis-server or the redis
              Python client is not installed.

The region lives in a fresh directory under /dev/shm (its production home: a disk-backed /tmp
would measure page-cache writeback) and the whole directory is removed at the end. Daemons run
with ``--pin off`` and no metrics endpoint.

``--quick`` runs every section at toy sizes (a CI smoke test: it proves the bench runs, its
figures mean little). The full run (``bench/run_all.py``) takes minutes and needs ~10 GiB of
memory for the largest data-plane jobs (larger ones are skipped when memory is short).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from .launcher import DaemonProcess

SECTIONS = ("control", "data", "capacity", "eviction", "recovery", "redis")
KEY_BYTES = 36                     # a vLLM key: 32-byte block hash + 4-byte group index
MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """Sizes of one run."""

    control_region: int                   # control: region size in bytes
    batches: tuple[int, ...]              # control: keys per job
    clients: tuple[int, ...]              # control: client processes
    duration: float                       # control: seconds per (op, B, C) point and side
    block_sizes: tuple[int, ...]          # data/redis: bytes per block
    blocks_per_job: tuple[int, ...]       # data: blocks per job
    reps: int                             # data/redis: measured repetitions (after one warm-up)
    tp: tuple[int, ...]                   # capacity: world sizes
    budget: int                           # capacity: region size in bytes
    capacity_block: int                   # capacity: bytes per block and rank
    entries: int                          # eviction/recovery: one-page entries in the region
    eviction_batches: tuple[int, ...]     # eviction: keys per store job
    redis_blocks: int                     # redis: blocks per job


FULL = Plan(control_region=256 * MiB, batches=(1, 16, 256, 1024), clients=(1, 4, 16), duration=0.5,
            block_sizes=(MiB, 4 * MiB), blocks_per_job=(64, 256, 1024), reps=5, tp=(1, 2, 4, 8), budget=256 * MiB,
            capacity_block=256 << 10, entries=1_000_000, eviction_batches=(1, 1024), redis_blocks=64)
QUICK = Plan(control_region=64 * MiB, batches=(1, 256, 1024), clients=(1, 4), duration=0.1, block_sizes=(MiB,),
             blocks_per_job=(64,), reps=2, tp=(1, 2, 4, 8), budget=16 * MiB, capacity_block=256 << 10,
             entries=20_000, eviction_batches=(1024,), redis_blocks=16)

CONTROL_PAGE = 4096                # control/eviction/recovery: 4 KiB pages, one-page blocks
DATA_PAGE = 64 << 10               # data/capacity/redis: the default page size


# ----------------------------------------------------------------------------------------------- helpers
def say(message: str) -> None:
    """Progress goes to stderr, so that ``--json`` output on stdout stays clean."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def make_keys(seed: int, n: int) -> list[bytes]:
    """n distinct random 36-byte keys, built without a Python loop per key."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, KEY_BYTES), dtype=np.uint8)
    return raw.view(f"V{KEY_BYTES}").ravel().tolist()


class KeyStream:
    """Fresh keys, B at a time: a random 28-byte prefix and a counter (vectorised)."""

    def __init__(self, seed: int, batch: int):
        self.raw = np.random.default_rng(seed).integers(0, 256, size=(batch, KEY_BYTES), dtype=np.uint8)
        self.counter = self.raw[:, KEY_BYTES - 8:].view("<u8")      # [batch, 1], a view into raw
        self.counter[:, 0] = np.arange(batch, dtype=np.uint64)
        self.batch = batch

    def next(self) -> list[bytes]:
        self.counter += np.uint64(self.batch)
        return self.raw.view(f"V{KEY_BYTES}").ravel().tolist()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "kernel": platform.release(), "loadavg_start": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        info["mem_total"], info["mem_available"] = mem["MemTotal"], mem["MemAvailable"]
    except (OSError, StopIteration, KeyError, ValueError):
        pass
    return info


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def target(name: str, value: float, goal: float, better: str) -> dict:
    """A target of the issue: ``value`` against ``goal`` (better: "higher" or "lower")."""
    met = value >= goal if better == "higher" else value <= goal
    return {"name": name, "value": value, "goal": f"{'>=' if better == 'higher' else '<='} {goal:g}",
            "met": bool(met)}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


class Daemon(DaemonProcess):
    """A kvtierd started for the bench in ``directory``, unpinned and without metrics;
    ``start()`` returns the seconds from process start to serving."""

    def __init__(self, directory: str, size: int, page_size: int, job_timeout: float = 120.0):
        os.makedirs(directory, exist_ok=True)
        super().__init__(directory, "--size", str(size), "--page-size", str(page_size), "--pin", "off",
                         "--metrics-address", "off", "--job-timeout", str(job_timeout), "--log-level", "info")
        self.call_timeout = 60.0

    def start(self, timeout: float = 300.0) -> float:
        return super().start(timeout)


def region_size(pages: int, page_size: int) -> int:
    """The --size that gives exactly ``pages`` pages of ``page_size``."""
    from .layout import Geometry
    return Geometry.for_pages(pages, page_size).file_bytes


def bench_layout(name: str, block_bytes: int, kind: str = "replicated"):
    from kvtier import Layout
    return Layout(model=f"bench-{name}", dtype="uint8", block_tokens=16, block_bytes=block_bytes, kind=kind)


class Context:
    """What sections share: the plan, the work directory, and the full region of eviction/recovery."""

    def __init__(self, plan: Plan, workdir: str):
        self.plan = plan
        self.workdir = workdir
        self.big: Daemon | None = None           # the N-entry region (eviction, then recovery)
        self.big_fresh_start: float | None = None

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def close(self) -> None:
        if self.big is not None:
            self.big.stop()


# ----------------------------------------------------------------------------------------------- control plane
OPS = ("lookup", "store", "load")
SLICES = 5                         # each (op, B, C) point alternates kvtierd and echo this many times


def echo_reply(msg: dict) -> dict:
    """What a daemon doing no work answers: a reply of kvtierd's size for the request.

    Lookup → {hits}; store → {outcomes: B bytes, pages: 4·B bytes}; load → {hits, pages: 4·B};
    anything else (commit, release, hello, ping) → {} (one-page blocks: one uint32 page per key).
    """
    op, n = msg["op"], len(msg.get("keys", ()))
    if op == "lookup":
        reply = {"hits": n}
    elif op == "store":
        reply = {"outcomes": bytes(n), "pages": bytes(4 * n)}
    elif op == "load":
        reply = {"hits": n, "pages": bytes(4 * n)}
    else:
        reply = {}
    reply.update(rid=msg["rid"], ok=True)
    return reply


def echo_server(path: str) -> None:
    """The floor of the control plane: the daemon's own loop shape (a zmq.Poller draining bursts
    of up to 256 requests), decoding each request and answering ``echo_reply``."""
    import msgpack
    import zmq
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        poller.poll(1000)
        for _ in range(256):
            try:
                ident, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = msgpack.unpackb(frame, raw=False)
            sock.send_multipart([ident, msgpack.packb(echo_reply(msg), use_bin_type=True)])


def _control_worker(conn, wid: int, kvt_socket: str, echo_socket: str) -> None:
    """One client process: a TP=1 rank session on kvtierd and a channel to the echo server.

    Commands from the parent: ("prepare", B) stores this worker's B lookup/load keys;
    ("run", side, op, B, duration, start_at) runs jobs back to back until the deadline and
    returns (jobs, elapsed, latencies); ("stop",).
    """
    from kvtier import Client
    from kvtier.session import Channel
    client = Client(kvt_socket, engine_id=f"bench-control-{wid}", rank=0, world_size=1,
                    layout=bench_layout("control", CONTROL_PAGE), copier="cpu", pin="off", timeout=60)
    channels = {"kvtierd": client.channel, "echo": Channel(echo_socket, timeout=60)}
    job_ids = iter(range(1, 1 << 62))
    keys: list[bytes] = []
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        if cmd[0] == "prepare":
            keys = make_keys(1000 + wid, cmd[1])
            job = next(job_ids)
            client.channel.call("store", job=job, keys=keys)
            client.channel.call("commit", job=job, ok=True)
            conn.send("ok")
            continue
        _, side, op, batch, duration, start_at = cmd
        call = channels[side].call
        fresh = KeyStream(wid * 7919 + batch + int(start_at * 1000) % 100003, batch)
        lat = []
        time.sleep(max(0.0, start_at - time.time()))   # all clients start together
        t_start = time.perf_counter()
        deadline = t_start + duration
        while True:
            job = next(job_ids)
            if op == "lookup":
                t0 = time.perf_counter()
                call("lookup", keys=keys)
            elif op == "store":
                new = fresh.next()
                t0 = time.perf_counter()
                call("store", job=job, keys=new)
                call("commit", job=job, ok=True)
            else:
                t0 = time.perf_counter()
                call("load", job=job, keys=keys)
                call("release", job=job)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            if t1 >= deadline:
                break
        conn.send((len(lat), t1 - t_start, np.asarray(lat)))
    client.close()
    channels["echo"].close()


def control(ctx: Context) -> dict:
    plan = ctx.plan
    spawn = mp.get_context("spawn")
    daemon = Daemon(ctx.path("control"), plan.control_region, CONTROL_PAGE)
    daemon.start()
    echo_path = ctx.path("echo.sock")
    echo = spawn.Process(target=echo_server, args=(echo_path,), daemon=True)
    echo.start()
    while not os.path.exists(echo_path):
        time.sleep(0.01)
    workers = []
    try:
        say(f"control: starting {max(plan.clients)} client processes")
        for wid in range(max(plan.clients)):
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=_control_worker, args=(child, wid, daemon.socket, echo_path), daemon=True)
            proc.start()
            workers.append((proc, parent))
        for _, conn in workers:
            if conn.recv() != "ready":
                raise RuntimeError("a control-plane client failed to start")
        rows = []
        for clients in plan.clients:
            active = workers[:clients]
            for op in OPS:
                for batch in plan.batches:
                    if op != "store":
                        for _, conn in active:
                            conn.send(("prepare", batch))
                        for _, conn in active:
                            conn.recv()
                    # The two sides alternate in short slices, so that both see the same machine
                    # (other load comes and goes; a ratio of two distant measurements would not).
                    runs: dict[str, list] = {"kvtierd": [], "echo": []}
                    for _ in range(SLICES):
                        for side in runs:
                            start_at = time.time() + 0.02
                            for _, conn in active:
                                conn.send(("run", side, op, batch, plan.duration / SLICES, start_at))
                            runs[side] += [conn.recv() for _, conn in active]
                    side_results = {}
                    for side, results in runs.items():
                        lat = np.concatenate([r[2] for r in results])
                        jobs = sum(r[0] for r in results)
                        elapsed = sum(max(r[1] for r in results[i:i + clients])
                                      for i in range(0, len(results), clients))
                        side_results[side] = {"p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6,
                                              "keys_per_s": jobs * batch / elapsed, "jobs": jobs}
                    k, e = side_results["kvtierd"], side_results["echo"]
                    row = {"op": op, "keys": batch, "clients": clients,
                           **{f"kvtierd_{n}": v for n, v in k.items()}, **{f"echo_{n}": v for n, v in e.items()},
                           "p50_ratio": ratio(k["p50_us"], e["p50_us"]), "p99_ratio": ratio(k["p99_us"], e["p99_us"]),
                           "throughput_ratio": ratio(k["keys_per_s"], e["keys_per_s"])}
                    rows.append(row)
                    say(f"control: {op:6} B={batch:<5} C={clients:<3} p50 {k['p50_us']:8.1f} us "
                        f"(echo {e['p50_us']:7.1f}, x{row['p50_ratio']:.2f})  {k['keys_per_s']:12,.0f} keys/s")
    finally:
        for proc, conn in workers:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc, _ in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        echo.kill()
        echo.join(5)
        daemon.stop()
    ratios = {f"{r['op']}_B{r['keys']}_C{r['clients']}_p50_vs_echo": r["p50_ratio"] for r in rows}
    by = {(r["op"], r["keys"], r["clients"]): r for r in rows}
    targets = []
    if ("lookup", 256, 1) in by:
        targets.append(target("lookup of 256 keys, p50 vs echo of the same frames (1 client)",
                              by[("lookup", 256, 1)]["p50_ratio"], 1.3, "lower"))
    four = [r for r in rows if r["op"] == "lookup" and r["clients"] == 4]
    if four:
        best = max(four, key=lambda r: r["kvtierd_keys_per_s"])
        targets.append(target(f"lookup keys/s with 4 clients (B={best['keys']})", best["kvtierd_keys_per_s"],
                              3_000_000, "higher"))
    notes = [f"{os.cpu_count()} CPUs: with C client processes and the daemon, C+1 busy processes share them; "
             "C >= CPUs oversubscribes the machine (the daemon then waits for a core too)."]
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes}


# ----------------------------------------------------------------------------------------------- data plane
def _memmove(dst: int, src: int, n: int) -> float:
    t0 = time.perf_counter()
    ctypes.memmove(dst, src, n)
    return time.perf_counter() - t0


class BlockBench:
    """One rank (TP=1, CPU copier) storing and loading K blocks of S bytes, timed end to end:
    the job's requests, the copy and the commit/release, as an engine sees them."""

    def __init__(self, daemon: Daemon, block: int, num_blocks: int, name: str):
        import torch

        from kvtier import Client
        self.block = block
        self.kv = torch.empty((num_blocks, block), dtype=torch.uint8)
        rows = self.kv.numpy()
        rows[:] = 0x5A                                  # faults the KV cache in
        rows[:, :8] = np.arange(num_blocks, dtype="<u8")[:, None].view(np.uint8)
        self.client = Client(daemon.socket, engine_id=f"bench-{name}", rank=0, world_size=1,
                             layout=bench_layout(name, block), copier="cpu", pin="off", timeout=120)
        self.client.register_kv_caches([self.kv])
        # A running engine has touched every page of its mapping long ago (or pinned it, which
        # populates it); without this, every job would pay first-touch page faults on pages it
        # had not used yet, which the floor's prefaulted mapping does not.
        self.client.mapping.prefault(threads=1)
        self.jobs = iter(range(1, 1 << 62))
        self.seed = 0

    def store_load(self, ids: np.ndarray) -> tuple[float, float]:
        """Store blocks ``ids`` under fresh keys, then load them back into the same blocks (whose
        first row bytes are cleared in between, so that a load that copied nothing fails)."""
        self.seed += 1
        keys = make_keys(self.seed * 1_000_003 + len(ids), len(ids))
        job = next(self.jobs)
        t0 = time.perf_counter()
        decision = self.client.store(job, keys, ids)
        (stored,) = self.client.wait([job])
        t1 = time.perf_counter()
        if not stored.ok or decision.written != len(ids):
            raise RuntimeError(f"bench store job failed: {stored}, {decision.written} of {len(ids)} written")
        rows = self.kv.numpy()
        rows[ids, :8] = 0
        job = next(self.jobs)
        t2 = time.perf_counter()
        hits = self.client.load(job, keys, ids)
        (loaded,) = self.client.wait([job])
        t3 = time.perf_counter()
        if not loaded.ok or hits != len(ids):
            raise RuntimeError(f"bench load job failed: {loaded}, {hits} of {len(ids)} hits")
        if not np.array_equal(rows[ids, :8].view("<u8").ravel(), ids.astype("<u8")):
            raise RuntimeError("bench load returned wrong bytes")
        return t1 - t0, t3 - t2

    def close(self) -> None:
        self.client.close()


def idle_round_trips(daemon: Daemon, samples: int, gaps: tuple[float, ...] = (0.0, 0.005, 0.02)) -> dict:
    """p50 µs of a ping round trip after both sides sat idle for each gap. A job's requests
    after its copy (commit, release, the next job's store) pay this: where waking an idle
    process is slow (a VM's idle vCPU), it bounds small jobs, not the daemon's work."""
    from kvtier.session import Channel
    channel = Channel(daemon.socket, timeout=10)
    out = {}
    try:
        for gap in gaps:
            lat = []
            for _ in range(samples):
                time.sleep(gap)
                t0 = time.perf_counter()
                channel.call("ping")
                lat.append(time.perf_counter() - t0)
            out[f"{gap * 1e3:g} ms"] = pct(np.asarray(lat), 50) * 1e6
    finally:
        channel.close()
    return out


def _floor_mapping(path: str, size: int):
    """A prefaulted shared mapping of ``size`` bytes in a tmpfs file (the memcpy floor's target)."""
    from .mapping import Mapping
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    mapping = Mapping.of_file(path)
    mapping.prefault(threads=1)
    return mapping


def data(ctx: Context) -> dict:
    plan = ctx.plan
    rows, notes, idle = [], [], {}
    rng = np.random.default_rng(6)
    for block in plan.block_sizes:
        fitting = [k for k in plan.blocks_per_job if 3 * k * block <= 0.8 * mem_available()]
        for k in sorted(set(plan.blocks_per_job) - set(fitting)):
            notes.append(f"{k} x {block // MiB} MiB skipped: needs {3 * k * block / (1 << 30):.1f} GiB of memory "
                         "(region, KV cache, floor mapping)")
        if not fitting:
            continue
        most = max(fitting)
        pages = most * (block // DATA_PAGE)
        daemon = Daemon(ctx.path(f"data-{block}"), region_size(pages, DATA_PAGE), DATA_PAGE)
        daemon.start()
        bench = BlockBench(daemon, block, most, f"data-{block}")
        floor = _floor_mapping(ctx.path(f"floor-{block}"), most * block)
        try:
            if block == plan.block_sizes[0]:
                idle = idle_round_trips(daemon, 10 if plan is QUICK else 40)
                say("data: ping round trip after an idle gap: "
                    + ", ".join(f"{gap} {us:.0f} us" for gap, us in idle.items()))
            for k in fitting:
                src = bench.kv.data_ptr()
                runs, floors = [], []
                for rep in range(plan.reps + 1):          # the first round warms both sides up
                    ids = rng.permutation(most)[:k]
                    runs.append(bench.store_load(ids))
                    floors.append((_memmove(floor.address, src, k * block), _memmove(src, floor.address, k * block)))
                runs, floors = np.asarray(runs[1:]), np.asarray(floors[1:])
                t_store, t_load = np.median(runs[:, 0]), np.median(runs[:, 1])
                f_store, f_load = np.median(floors[:, 0]), np.median(floors[:, 1])
                nbytes = k * block
                row = {"block_bytes": block, "blocks": k, "bytes": nbytes,
                       "store_gbps": nbytes / t_store / 1e9, "load_gbps": nbytes / t_load / 1e9,
                       "store_load_gbps": 2 * nbytes / (t_store + t_load) / 1e9,
                       "memcpy_in_gbps": nbytes / f_store / 1e9, "memcpy_out_gbps": nbytes / f_load / 1e9,
                       "memcpy_gbps": 2 * nbytes / (f_store + f_load) / 1e9}
                row["ratio"] = row["store_load_gbps"] / row["memcpy_gbps"]
                rows.append(row)
                say(f"data: {k:5} x {block // MiB} MiB  store {row['store_gbps']:6.2f}  load {row['load_gbps']:6.2f}  "
                    f"store+load {row['store_load_gbps']:6.2f} GB/s  memcpy {row['memcpy_gbps']:6.2f} GB/s  "
                    f"x{row['ratio']:.2f}")
        finally:
            floor.close()
            os.unlink(ctx.path(f"floor-{block}"))
            bench.close()
            daemon.stop()
            shutil.rmtree(daemon.dir, ignore_errors=True)
    ratios = {f"store_load_{r['blocks']}x{r['block_bytes'] // MiB}MiB_vs_memcpy": r["ratio"] for r in rows}
    targets = [target("CPU store+load vs memcpy (worst configuration)", min(r["ratio"] for r in rows), 0.8,
                      "higher")] if rows else []
    notes.append("a store job is 2 round trips (store, commit) and a load job 2 (load, release), each after the "
                 "daemon idled through a copy; ping round trip after an idle gap here: "
                 + ", ".join(f"{gap}: {us:.0f} us" for gap, us in idle.items()))
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "idle_rtt_us": idle}


# ----------------------------------------------------------------------------------------------- capacity
class _CountingCopier:
    """Wraps a rank's copier to count the bytes it was asked to copy."""

    def __init__(self, copier):
        self.copier, self.name, self.bytes = copier, copier.name, 0

    def submit(self, desc):
        self.bytes += desc.total_bytes
        return self.copier.submit(desc)

    def close(self) -> None:
        self.copier.close()


def _capacity_case(daemon: Daemon, world: int, kind: str, block: int, stored_goal: int, case: int) -> dict:
    import torch

    from kvtier import Client
    per_job = 16
    kv = torch.full((per_job, block), 0x33, dtype=torch.uint8)
    ranks = []
    try:
        for r in range(world):
            c = Client(daemon.socket, engine_id=f"bench-cap-{case}", rank=r, world_size=world,
                       layout=bench_layout("capacity", block, kind), copier="cpu", pin="off", timeout=120)
            ranks.append(c)
            c.register_kv_caches([kv])
            c.copier = _CountingCopier(c.copier)
        ids = np.arange(per_job)
        before = daemon.stats()
        job, keys = 0, []
        while True:
            job += 1
            keys = make_keys(case * 1_000_003 + job, per_job)
            for c in ranks:            # rank 0 opens the job; the others vote (or write, sharded)
                c.store(job, keys, ids)
            for c in ranks:
                (res,) = c.wait([job])
                if not res.ok:
                    raise RuntimeError(f"capacity store job failed: {res}")
            if job * per_job >= stored_goal:
                break
        d2h = sum(c.copier.bytes for c in ranks)
        after = daemon.stats()
        job += 1
        loaded = []
        for c in ranks:               # every rank loads the last job's blocks from the one copy
            c.copier.bytes = 0
            loaded.append(c.load(job, keys, ids))
        for c in ranks:
            (res,) = c.wait([job])
            if not res.ok:
                raise RuntimeError(f"capacity load job failed: {res}")
        h2d = [c.copier.bytes for c in ranks]
        written = after["store_written_keys"] - before["store_written_keys"]
        return {"tp": world, "kind": kind, "blocks_held": after["entries_ready"], "blocks_stored": written,
                "d2h_bytes_per_block": d2h / written, "d2h_per_block_vs_block": d2h / written / block,
                "daemon_bytes_written_per_block": (after["bytes_written"] - before["bytes_written"]) / written,
                "h2d_bytes_per_rank_per_block": max(h2d) / max(1, min(loaded))}
    finally:
        for c in ranks:
            c.close()


def capacity(ctx: Context) -> dict:
    plan = ctx.plan
    block = plan.capacity_block
    daemon = Daemon(ctx.path("capacity"), plan.budget, DATA_PAGE)
    daemon.start()
    rows, case = [], 0
    try:
        pages = daemon.stats()["pages_total"]
        for world in plan.tp:
            for kind in ("replicated", "sharded"):
                case += 1
                daemon.call("clear", admin=True)
                # Store twice what the replicated layout can hold, so that both layouts end full.
                rows.append(_capacity_case(daemon, world, kind, block, 2 * pages // (block // DATA_PAGE), case))
            rep, sh = rows[-2], rows[-1]
            rep["capacity_vs_sharded"] = rep["blocks_held"] / sh["blocks_held"]
            rep["d2h_vs_sharded"] = rep["d2h_bytes_per_block"] / sh["d2h_bytes_per_block"]
            say(f"capacity: TP={world}  replicated holds {rep['blocks_held']} blocks, sharded {sh['blocks_held']} "
                f"(x{rep['capacity_vs_sharded']:.2f}); D2H bytes/block {rep['d2h_per_block_vs_block']:.2f}x block "
                f"vs {sh['d2h_per_block_vs_block']:.2f}x")
    finally:
        daemon.stop()
        shutil.rmtree(daemon.dir, ignore_errors=True)
    reps = [r for r in rows if r["kind"] == "replicated"]
    ratios = {f"tp{r['tp']}_capacity_vs_sharded": r["capacity_vs_sharded"] for r in reps}
    ratios.update({f"tp{r['tp']}_d2h_per_block_vs_block": r["d2h_per_block_vs_block"] for r in reps})
    targets = [target("capacity at TP=N vs sharded, over N (worst TP)",
                      min(r["capacity_vs_sharded"] / r["tp"] for r in reps), 0.99, "higher"),
               target("D2H bytes per stored block vs block bytes (worst TP)",
                      max(r["d2h_per_block_vs_block"] for r in reps), 1.0, "lower")]
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": [
        f"budget {plan.budget // MiB} MiB of {DATA_PAGE >> 10} KiB pages, {block >> 10} KiB per block and rank; "
        "sharded with the same bytes per rank is what per-rank offloading of an MLA model stores"]}


# ----------------------------------------------------------------------------------------------- eviction
class RankChannel:
    """A TP=1 rank session used at the protocol level: store + commit without copying (the
    control-plane cost of a store job; the data plane measures copies)."""

    def __init__(self, daemon: Daemon, engine: str):
        from kvtier import Client
        self.client = Client(daemon.socket, engine_id=engine, rank=0, world_size=1,
                             layout=bench_layout("entries", CONTROL_PAGE), copier="cpu", pin="off", timeout=300)
        self.jobs = iter(range(1, 1 << 62))

    def store(self, keys: list[bytes]) -> bytes:
        job = next(self.jobs)
        outcomes = self.client.channel.call("store", job=job, keys=keys)["outcomes"]
        self.client.channel.call("commit", job=job, ok=True)
        return outcomes

    def close(self) -> None:
        self.client.close()


def big_region(ctx: Context) -> Daemon:
    """The region of N one-page entries, filled (shared by eviction and recovery)."""
    if ctx.big is None:
        n = ctx.plan.entries
        daemon = Daemon(ctx.path("big"), region_size(n, CONTROL_PAGE), CONTROL_PAGE)
        say(f"starting a daemon on a fresh region of {n:,} pages")
        ctx.big_fresh_start = daemon.start()
        ctx.big = daemon
        rank = RankChannel(daemon, "bench-fill")
        try:
            fill(rank, n, 1, 8192)
        finally:
            rank.close()
    return ctx.big


def fill(rank: RankChannel, n: int, seed: int, batch: int) -> None:
    """Store n fresh keys in jobs of ``batch``."""
    stream = KeyStream(seed, batch)
    for _ in range(n // batch):
        rank.store(stream.next())
    if n % batch:
        rank.store(stream.next()[: n % batch])


def timed_stores(rank: RankChannel, batch: int, seed: int, duration: float,
                 max_keys: int | None = None) -> tuple[int, float, np.ndarray]:
    """Store fresh keys in jobs of ``batch`` for about ``duration`` seconds (or until ``max_keys``
    were stored): (keys, seconds, latency of each job)."""
    stream = KeyStream(seed, batch)
    lat = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration and (max_keys is None or (len(lat) + 1) * batch <= max_keys):
        keys = stream.next()
        t1 = time.perf_counter()
        rank.store(keys)
        lat.append(time.perf_counter() - t1)
    return len(lat) * batch, time.perf_counter() - t0, np.asarray(lat)


def eviction(ctx: Context) -> dict:
    plan = ctx.plan
    n = plan.entries
    duration = max(0.2, 10 * plan.duration)
    daemon = big_region(ctx)
    rank = RankChannel(daemon, "bench-evict")
    rows = []
    try:
        for batch in plan.eviction_batches:
            daemon.call("clear", admin=True)
            # Room: the first keys go into an empty region (no eviction). Stay under half of it.
            s0 = daemon.stats()
            room_keys, room_s, _ = timed_stores(rank, batch, 10 + batch, duration, max_keys=n // 2)
            s1 = daemon.stats()
            if s1["evictions"] != s0["evictions"]:
                raise RuntimeError("eviction bench: the 'room' phase evicted; the region is too small")
            fill(rank, s1["pages_free"], 20 + batch, 8192)
            s2 = daemon.stats()
            full_keys, full_s, lat = timed_stores(rank, batch, 30 + batch, duration)
            s3 = daemon.stats()
            evicted = s3["evictions"] - s2["evictions"]
            row = {"keys_per_job": batch, "entries": s3["entries_ready"], "room_stores_per_s": room_keys / room_s,
                   "full_stores_per_s": full_keys / full_s, "evictions_per_store": evicted / full_keys,
                   "job_p50_us": pct(lat, 50) * 1e6, "job_p99_us": pct(lat, 99) * 1e6, "job_max_us": lat.max() * 1e6}
            row["ratio"] = row["full_stores_per_s"] / row["room_stores_per_s"]
            rows.append(row)
            say(f"eviction: B={batch:<5} {row['full_stores_per_s']:12,.0f} stores/s with every store evicting "
                f"({row['entries']:,} entries), {row['room_stores_per_s']:12,.0f} with room (x{row['ratio']:.2f})")
    finally:
        rank.close()
    # Leave the region full of N entries for recovery.
    fill_rank = RankChannel(daemon, "bench-refill")
    try:
        fill(fill_rank, daemon.stats()["pages_free"], 99, 8192)
    finally:
        fill_rank.close()
    ratios = {f"B{r['keys_per_job']}_full_vs_room": r["ratio"] for r in rows}
    return {"rows": rows, "ratios": ratios, "targets": [], "notes": [
        f"{n:,} one-page ({CONTROL_PAGE >> 10} KiB) entries; a store job is the store request and the commit, "
        "without copies; every stored key of the 'full' phase evicts one entry",
        "job max: a full pass of Python's cyclic garbage collector in the daemon walks every live entry (~0.1-0.25 s "
        "per million); it runs after every ~25% growth of the long-lived heap, so it shows in the maximum, not in "
        "p99"]}


# ----------------------------------------------------------------------------------------------- recovery
def _time_store_recovery(region: str) -> dict:
    """Open the stopped daemon's region and time the store's recovery alone (scan + index build)."""
    from .layout import RegionView, scan
    from .mapping import Mapping
    from .store import Store
    mapping = Mapping.of_file(region)
    try:
        view = RegionView(mapping.buffer)
        t0 = time.perf_counter()
        found = scan(view)
        t1 = time.perf_counter()
        entries = len(found.ready)
        del found
        t2 = time.perf_counter()
        store = Store(view)
        t3 = time.perf_counter()
        recovered = store.recovered["ready"]
        del store, view
    finally:
        mapping.close()
    return {"scan_s": t1 - t0, "store_recovery_s": t3 - t2, "scanned": entries, "recovered": recovered}


def recovery(ctx: Context) -> dict:
    n = ctx.plan.entries
    daemon = big_region(ctx)
    held = daemon.stats()["entries_ready"]
    daemon.stop()
    ctx.big = None
    try:
        alone = _time_store_recovery(daemon.region)
        say(f"recovery: scan {alone['scan_s']:.3f} s, Store(view) {alone['store_recovery_s']:.3f} s "
            f"for {alone['recovered']:,} entries")
        # A restart is one sample of a few seconds: the median of several rides out other load.
        restarts, started_in = [], []
        for _ in range(1 if ctx.plan is QUICK else 3):
            restarts.append(daemon.start())
            stats = daemon.stats()
            started_in.append(next(float(part.split("=")[1].rstrip('s"')) for line in daemon.log().splitlines()[::-1]
                                   if "ready:" in line for part in line.split() if part.startswith("started_in=")))
            daemon.stop()
        restart = float(np.median(restarts))
    finally:
        daemon.stop()
        shutil.rmtree(daemon.dir, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kvtierd.daemon, kvtierd.cli"], check=True)
    interpreter = time.perf_counter() - t0
    say(f"recovery: restart with {stats['entries_ready']:,} entries ready in {restart:.2f} s "
        f"(fresh start of the same size {ctx.big_fresh_start:.2f} s, interpreter + imports {interpreter:.2f} s)")
    row = {"entries": n, "held_before": held, "recovered": stats["entries_ready"], "restart_s": restart,
           "restarts_s": restarts, "daemon_started_in_s": float(np.median(started_in)),
           "fresh_start_s": ctx.big_fresh_start, "interpreter_s": interpreter, **alone}
    ratios = {"restart_vs_fresh_start": restart / ctx.big_fresh_start, "restart_vs_interpreter": restart / interpreter,
              "restart_vs_2s_target": restart / 2.0}
    targets = [target(f"restart to ready with {n:,} entries (s)", restart, 2.0, "lower")]
    return {"rows": [row], "ratios": ratios, "targets": targets, "notes": [
        "restart_s: from process start to the socket answering (median of the restarts_s); daemon_started_in_s: "
        "the daemon's own count (region open + prefault + Store recovery + socket); store_recovery_s: "
        "Store(view) alone, in this process"]}


# ----------------------------------------------------------------------------------------------- redis
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory: str):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.port = _free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", directory, "--logfile", os.path.join(directory, "redis.log"), "--protected-mode", "yes",
             "--client-query-buffer-limit", "1gb", "--proto-max-bulk-len", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def client(self):
        import redis
        r = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=120)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                return r
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _redis_store(r, kv_rows: np.ndarray, ids: np.ndarray, keys: list[bytes], batched: bool) -> float:
    """Store the blocks with values straight from the KV cache's memory: one MSET (batched) or
    one SET per block. Returns seconds."""
    t0 = time.perf_counter()
    if batched:
        r.mset({k: memoryview(kv_rows[b]) for k, b in zip(keys, ids.tolist())})
    else:
        for k, b in zip(keys, ids.tolist()):
            r.set(k, memoryview(kv_rows[b]))
    return time.perf_counter() - t0


def _redis_load(r, kv_rows: np.ndarray, ids: np.ndarray, keys: list[bytes], batched: bool) -> float:
    """Load the blocks back into their KV-cache rows: one MGET (batched) or one GET per block,
    each value copied into its block as a KV library must. Returns seconds."""
    kv_rows[ids, :8] = 0
    t0 = time.perf_counter()
    values = r.mget(keys) if batched else [r.get(k) for k in keys]
    for b, v in zip(ids.tolist(), values):
        ctypes.memmove(kv_rows[b].ctypes.data, v, len(v))
    elapsed = time.perf_counter() - t0
    if not np.array_equal(kv_rows[ids, :8].view("<u8").ravel(), ids.astype("<u8")):
        raise RuntimeError("redis returned wrong bytes")
    return elapsed


def redis_peer(ctx: Context) -> dict:
    plan = ctx.plan
    if shutil.which("redis-server") is None:
        return {"skipped": "redis-server is not installed (Debian: apt-get install redis-server)"}
    try:
        import redis
        redis_version = redis.__version__
        hiredis = redis.utils.HIREDIS_AVAILABLE
    except ImportError:
        return {"skipped": "the redis Python client is not installed (pip install 'kvtierd[bench]')"}
    k = plan.redis_blocks
    rng = np.random.default_rng(7)
    rows = []
    server = RedisServer(ctx.path("redis"))
    try:
        r = server.client()
        for block in plan.block_sizes:
            daemon = Daemon(ctx.path(f"peer-{block}"), region_size(k * block // DATA_PAGE, DATA_PAGE), DATA_PAGE)
            daemon.start()
            bench = BlockBench(daemon, block, k, f"peer-{block}")
            try:
                kvt, red = [], {True: [], False: []}
                for rep in range(plan.reps + 1):
                    ids = rng.permutation(k)
                    kvt.append(bench.store_load(ids))
                    for batched, runs in red.items():
                        keys = make_keys(500 + 2 * rep + batched, k)
                        runs.append((_redis_store(r, bench.kv.numpy(), ids, keys, batched),
                                     _redis_load(r, bench.kv.numpy(), ids, keys, batched)))
                        r.delete(*keys)
                kvt = np.median(kvt[1:], axis=0)
                mset, single = np.median(red[True][1:], axis=0), np.median(red[False][1:], axis=0)
                # Redis at its best: the faster of the two patterns, per direction.
                best = np.minimum(mset, single)
                row = {"block_bytes": block, "blocks": k,
                       "redis_store_pattern": "MSET" if mset[0] <= single[0] else "SET",
                       "redis_load_pattern": "MGET" if mset[1] <= single[1] else "GET",
                       "redis_mset_blocks_per_s": k / mset[0], "redis_set_blocks_per_s": k / single[0],
                       "redis_mget_blocks_per_s": k / mset[1], "redis_get_blocks_per_s": k / single[1]}
                for name, (ts, tl) in (("kvtierd", kvt), ("redis", best)):
                    row.update({f"{name}_store_blocks_per_s": k / ts, f"{name}_load_blocks_per_s": k / tl,
                                f"{name}_blocks_per_s": 2 * k / (ts + tl)})
                row["ratio"] = row["kvtierd_blocks_per_s"] / row["redis_blocks_per_s"]
                row["ratio_vs_mset_mget"] = row["kvtierd_blocks_per_s"] / (2 * k / mset.sum())
                rows.append(row)
                say(f"redis: {k} x {block // MiB} MiB  kvtierd {row['kvtierd_blocks_per_s']:9,.0f} blocks/s  "
                    f"redis {row['redis_blocks_per_s']:9,.0f} blocks/s  x{row['ratio']:.1f}")
            finally:
                bench.close()
                daemon.stop()
                shutil.rmtree(daemon.dir, ignore_errors=True)
        version = r.info("server")["redis_version"]
        r.close()
    finally:
        server.stop()
    ratios = {f"{r_['blocks']}x{r_['block_bytes'] // MiB}MiB_vs_redis": r_["ratio"] for r_ in rows}
    ratios.update({f"{r_['blocks']}x{r_['block_bytes'] // MiB}MiB_vs_redis_mset_mget": r_["ratio_vs_mset_mget"]
                   for r_ in rows})
    targets = [target("kvtierd vs Redis at its best, blocks/s store+load (worst block size)",
                      min(x["ratio"] for x in rows), 10, "higher")]
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": [
        f"redis-server {version} on 127.0.0.1 (no persistence), redis-py {redis_version} client "
        f"({'hiredis' if hiredis else 'pure-Python'} parser); each job is timed both as one MSET/MGET and as one "
        "SET/GET per block, and Redis is credited with the faster per direction; blocks/s counts a block stored "
        "and loaded as two"]}


# ----------------------------------------------------------------------------------------------- run
RUNNERS: dict[str, Callable[[Context], dict]] = {
    "control": control, "data": data, "capacity": capacity, "eviction": eviction, "recovery": recovery,
    "redis": redis_peer,
}


def workdir_base() -> str:
    """/dev/shm when it is there (the region's production home), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def run(sections: tuple[str, ...] = SECTIONS, quick: bool = False, base: str | None = None) -> dict:
    """Run ``sections`` and return the results: machine, plan, and per section rows, ratios,
    targets and notes (or ``skipped`` with a reason)."""
    plan = QUICK if quick else FULL
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    workdir = tempfile.mkdtemp(prefix="kvtbench-", dir=base or workdir_base())
    ctx = Context(plan, workdir)
    result: dict[str, Any] = {"machine": machine(), "quick": quick, "plan": asdict(plan), "workdir": workdir,
                              "sections": {}}
    started = time.perf_counter()
    try:
        for name in SECTIONS:
            if name in sections:
                say(f"--- {name}")
                t0 = time.perf_counter()
                section = RUNNERS[name](ctx)
                section["seconds"] = time.perf_counter() - t0
                result["sections"][name] = section
    finally:
        ctx.close()
        shutil.rmtree(workdir, ignore_errors=True)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------------------------- formatting
COLUMNS: dict[str, list[tuple[str, str, str]]] = {   # section → (header, row key, format)
    "control": [("op", "op", "{}"), ("B", "keys", "{}"), ("C", "clients", "{}"),
                ("p50 us", "kvtierd_p50_us", "{:.1f}"), ("p99 us", "kvtierd_p99_us", "{:.1f}"),
                ("keys/s", "kvtierd_keys_per_s", "{:,.0f}"), ("echo p50", "echo_p50_us", "{:.1f}"),
                ("echo p99", "echo_p99_us", "{:.1f}"), ("echo keys/s", "echo_keys_per_s", "{:,.0f}"),
                ("p50 x", "p50_ratio", "{:.2f}"), ("keys/s x", "throughput_ratio", "{:.2f}")],
    "data": [("blocks", "blocks", "{}"), ("block MiB", "block_bytes", "MiB"), ("store GB/s", "store_gbps", "{:.2f}"),
             ("load GB/s", "load_gbps", "{:.2f}"), ("store+load", "store_load_gbps", "{:.2f}"),
             ("memcpy", "memcpy_gbps", "{:.2f}"), ("x memcpy", "ratio", "{:.2f}")],
    "capacity": [("TP", "tp", "{}"), ("layout", "kind", "{}"), ("blocks held", "blocks_held", "{}"),
                 ("D2H B/block", "d2h_bytes_per_block", "{:,.0f}"), ("x block", "d2h_per_block_vs_block", "{:.2f}"),
                 ("H2D B/rank/block", "h2d_bytes_per_rank_per_block", "{:,.0f}"),
                 ("held x sharded", "capacity_vs_sharded", "{:.2f}")],
    "eviction": [("B", "keys_per_job", "{}"), ("entries", "entries", "{:,}"),
                 ("stores/s full", "full_stores_per_s", "{:,.0f}"), ("stores/s room", "room_stores_per_s", "{:,.0f}"),
                 ("evictions/store", "evictions_per_store", "{:.2f}"), ("job p50 us", "job_p50_us", "{:,.0f}"),
                 ("job p99 us", "job_p99_us", "{:,.0f}"), ("job max us", "job_max_us", "{:,.0f}"),
                 ("x room", "ratio", "{:.2f}")],
    "recovery": [("entries", "recovered", "{:,}"), ("restart s", "restart_s", "{:.2f}"),
                 ("daemon s", "daemon_started_in_s", "{:.2f}"), ("Store() s", "store_recovery_s", "{:.2f}"),
                 ("scan s", "scan_s", "{:.2f}"), ("fresh start s", "fresh_start_s", "{:.2f}"),
                 ("interpreter s", "interpreter_s", "{:.2f}")],
    "redis": [("blocks", "blocks", "{}"), ("block MiB", "block_bytes", "MiB"),
              ("kvtierd blocks/s", "kvtierd_blocks_per_s", "{:,.0f}"),
              ("redis blocks/s", "redis_blocks_per_s", "{:,.0f}"),
              ("kvt store", "kvtierd_store_blocks_per_s", "{:,.0f}"),
              ("redis store", "redis_store_blocks_per_s", "{:,.0f}"),
              ("kvt load", "kvtierd_load_blocks_per_s", "{:,.0f}"),
              ("redis load", "redis_load_blocks_per_s", "{:,.0f}"),
              ("x redis", "ratio", "{:.1f}"), ("x MSET/MGET", "ratio_vs_mset_mget", "{:.1f}")],
}


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "MiB":
        return f"{value / MiB:g}"
    return fmt.format(value)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    cells = [[_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, (h, _, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return lines


def format_results(result: dict) -> str:
    m = result["machine"]
    lines = [f"kvtierctl bench{' --quick' if result['quick'] else ''}: {m.get('cpu', '?')}, {m['cpus']} CPUs, "
             f"{m.get('mem_total', 0) / (1 << 30):.1f} GiB, Python {m['python']}, load average "
             f"{m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}, {result['seconds']:.1f} s"]
    targets = []
    for name, section in result["sections"].items():
        lines += ["", f"== {name}"]
        if "skipped" in section:
            lines.append(f"skipped: {section['skipped']}")
            continue
        lines += table(section["rows"], COLUMNS[name])
        lines += [f"note: {n}" for n in section["notes"]]
        targets += section["targets"]
    if targets:
        lines += ["", "== targets"]
        for t in targets:
            lines.append(f"{'MET   ' if t['met'] else 'MISSED'} {t['name']}: {t['value']:,.3g} (goal {t['goal']})")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="toy sizes, a few seconds a section (CI smoke test)")
    parser.add_argument("--only", action="append", metavar="SECTION",
                        help=f"run only this section (repeatable, or comma-separated): {', '.join(SECTIONS)}")
    parser.add_argument("--out", metavar="DIR", help="also write bench.json and bench.txt into DIR")
    parser.add_argument("--workdir", metavar="DIR",
                        help="where the bench's temporary directory goes (default /dev/shm, else the temp dir)")


def fetch(args) -> dict:
    """kvtierctl bench: run the selected sections; write --out files."""
    sections = tuple(s for item in (args.only or [",".join(SECTIONS)]) for s in item.split(",") if s)
    result = run(sections, quick=args.quick, base=args.workdir)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        with open(os.path.join(args.out, "bench.txt"), "w") as f:
            f.write(format_results(result) + "\n")
    return result

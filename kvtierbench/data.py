"""``data``: the CPU data plane, store then load of K blocks of S bytes through the client, against
one-thread memcpy of the same bytes; and a ping's round trip after the daemon idled."""

from __future__ import annotations

import ctypes
import os
import shutil
import time

import numpy as np

from kvtierd.contract.channel import Channel
from kvtierd.contract.mapping import Mapping

from .harness import (DATA_PAGE, QUICK, BlockBench, Context, MiB, bench_daemon, mem_available, pct, region_size, say,
                      target)
from .launcher import DaemonProcess


def _memmove(dst: int, src: int, n: int) -> float:
    t0 = time.perf_counter()
    ctypes.memmove(dst, src, n)
    return time.perf_counter() - t0


def idle_round_trips(daemon: DaemonProcess, samples: int, gaps: tuple[float, ...] = (0.0, 0.005, 0.02)) -> dict:
    """p50 µs of a ping round trip after both sides sat idle for each gap. A job's requests
    after its copy (commit, release, the next job's store) pay this: where waking an idle
    process is slow (a VM's idle vCPU), it bounds small jobs, not the daemon's work."""
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    mapping = Mapping.of_file(path)
    mapping.prefault(threads=1)
    return mapping


def run(ctx: Context) -> dict:
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
        daemon = bench_daemon(ctx.path(f"data-{block}"), region_size(pages, DATA_PAGE), DATA_PAGE)
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

"""``control``: lookup, store and load jobs of B keys from C client processes against a ZMQ echo
of the same frames (the floor: a daemon doing no work), the two sides alternating in slices."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

from kvtierd.contract.channel import Channel

from .echo import echo_server
from .harness import (CONTROL_PAGE, Context, KeyStream, bench_daemon, bench_namespace, make_keys, pct, ratio, say,
                      stop_processes, target)

OPS = ("lookup", "store", "load")
SLICES = 5                         # each (op, B, C) point alternates kvtierd and echo this many times


def _control_worker(conn, wid: int, kvt_socket: str, echo_socket: str) -> None:
    """One client process: a TP=1 rank session on kvtierd and a channel to the echo server.

    Commands from the parent: ("prepare", B) stores this worker's B lookup/load keys;
    ("run", side, op, B, duration, start_at) runs jobs back to back until the deadline and
    returns (jobs, elapsed, latencies); ("stop",).
    """
    from kvtier import Client
    client = Client(kvt_socket, engine_id=f"bench-control-{wid}", rank=0, world_size=1,
                    namespace=bench_namespace("control", CONTROL_PAGE), copier="cpu", pin="off", timeout=60)
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


def run(ctx: Context) -> dict:
    plan = ctx.plan
    spawn = mp.get_context("spawn")
    daemon = bench_daemon(ctx.path("control"), plan.control_region, CONTROL_PAGE)
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
        stop_processes(workers, ("stop",), 10)
        echo.kill()
        echo.join(5)
        daemon.stop()
    ratios = {f"{r['op']}_B{r['keys']}_C{r['clients']}_p50_vs_echo": r["p50_ratio"] for r in rows}
    by = {(r["op"], r["keys"], r["clients"]): r for r in rows}
    targets = []
    # Issue 22's goals: the daemon's work per request near the floor of decoding and encoding the
    # same frames (one client), and its keys/s with four.
    for (op, keys, goal), what in zip([("lookup", 256, 1.3), ("lookup", 1024, 1.5), ("store", 1024, 3.0),
                                       ("load", 1024, 2.0)],
                                      ["lookup", "lookup", "store+commit", "load+release"]):
        if (op, keys, 1) in by:
            targets.append(target(f"{what} of {keys} keys, p50 vs echo of the same frames (1 client)",
                                  by[(op, keys, 1)]["p50_ratio"], goal, "lower"))
    if ("lookup", 1024, 4) in by:
        targets.append(target("lookup keys/s with 4 clients (B=1024) vs the echo's", by[("lookup", 1024, 4)]
                              ["throughput_ratio"], 0.5, "higher"))
    notes = [f"{os.cpu_count()} CPUs: with C client processes and the daemon, C+1 busy processes share them; "
             "C >= CPUs oversubscribes the machine (the daemon then waits for a core too)."]
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes}

"""``restart``: kvtierd restarted under running engines — planned (SIGTERM, then a new daemon, as
``systemctl restart`` and an upgrade do) and after a crash (SIGKILL) — and the time from the new
daemon serving to every engine attached again.

Each engine is a process with what an engine's kvtier integration holds: a link thread with its
coordinator session (``kvtier.integrations.offload.link``, the scheduler side of the vLLM
plugin; ``kvtier_retry_s`` 600 s, so that only its watch of the socket path can bring it back in
time) and a TP=1 rank session (``kvtier.Client``), which an engine calls once its link is up
again (the first transfer after the restart). Per round the bench stops the daemon, starts a new
one on the same region and pings it in a tight loop: its first answer is "serving". Each engine
reports when its link was up again (polled every millisecond) and when its rank's first lookup
was answered (the rank re-attached on the way), on the machine's monotonic clock.

Floor: a fresh coordinator ``Client`` made the moment the daemon serves (a client that knew when
to attach): attach time after serving. Target: every engine attached again within 100 ms of the
daemon serving, the worst round of each kind.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import signal
import statistics
import time

from kvtier.reach import socket_identity
from kvtierd.contract.channel import Channel

from .harness import (CONTROL_PAGE, QUICK, Context, bench_daemon, bench_namespace, make_keys, ratio, region_size,
                      say, stop_processes, target)

KINDS = {"planned (SIGTERM)": signal.SIGTERM, "crash (SIGKILL)": signal.SIGKILL}
GOAL_MS = 100.0


def _engine(conn, eid: int, socket: str) -> None:
    """One engine process: a link (coordinator) and a rank session; per round, the times it was
    up again (see the module docstring)."""
    import logging

    from kvtier import Client
    from kvtier.integrations.offload.link import Link

    logging.getLogger("vllm.kvtier").setLevel(logging.ERROR)    # its "kvtierd unreachable" lines, every round
    namespace = bench_namespace("restart", CONTROL_PAGE)
    engine = f"bench-restart-{eid}"
    link = Link(functools.partial(Client, socket, engine_id=engine, rank=None, world_size=1, namespace=namespace,
                                  timeout=5.0, reconnect_timeout=0.0),
                socket, retry_s=600.0, what=f"coordinator of {engine}", first_wait_s=30.0)
    rank = Client(socket, engine_id=engine, rank=0, world_size=1, namespace=namespace, copier="cpu", pin="off",
                  timeout=5.0, reconnect_timeout=30.0, populate_threads=0)
    keys = make_keys(eid, 16)
    conn.send(link.up)
    try:
        while conn.recv() == "round":
            while link.up:                        # the daemon is being stopped
                time.sleep(0.001)
            conn.send("down")
            while not link.up:
                time.sleep(0.001)
            linked = time.monotonic()
            rank.lookup(keys)                     # the engine's first call: its rank re-attaches on the way
            conn.send((linked, time.monotonic()))
    finally:
        link.close()
        rank.close()


def _serving(socket: str, old: tuple | None, timeout: float = 120.0) -> float:
    """The monotonic time of the new daemon's first answer: once a socket other than ``old`` (the
    stopped daemon's) is at the path, a ping on it (answered as soon as the daemon serves; a ping
    into a stale socket would wait for ZMQ's 100 ms reconnect timer instead)."""
    deadline = time.monotonic() + timeout
    while socket_identity(socket) in (None, old):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no kvtierd bound {socket} within {timeout}s")
        time.sleep(0.0002)
    channel = Channel(socket, timeout=timeout)
    try:
        channel.call("ping")
        return time.monotonic()
    finally:
        channel.close()


def _fresh_attach_ms(socket: str, serving: float) -> float:
    """A new coordinator attaching the moment the daemon serves: ms from serving to attached."""
    from kvtier import Client
    client = Client(socket, engine_id="bench-restart-fresh", rank=None, world_size=1,
                    namespace=bench_namespace("restart", CONTROL_PAGE), timeout=5.0)
    attached = time.monotonic()
    client.close()
    return (attached - serving) * 1000


def _round(daemon, engines, sig: int) -> dict:
    """Stop the daemon with ``sig``, start it again; every engine's times, in ms after serving."""
    for _, conn in engines:
        conn.send("round")
    old = socket_identity(daemon.socket)
    stopped = time.monotonic()
    daemon.stop(sig)
    for _, conn in engines:
        if conn.recv() != "down":
            raise RuntimeError("an engine of the restart bench failed")
    daemon.launch()
    serving = _serving(daemon.socket, old)
    fresh = _fresh_attach_ms(daemon.socket, serving)
    times = [conn.recv() for _, conn in engines]
    return {"down_s": serving - stopped, "fresh_ms": fresh,
            "links_ms": max(t[0] for t in times) * 1000 - serving * 1000,
            "ranks_ms": max(t[1] for t in times) * 1000 - serving * 1000}


def run(ctx: Context) -> dict:
    quick = ctx.plan is QUICK
    n_engines, rounds = (2, 1) if quick else (8, 5)
    spawn = mp.get_context("spawn")
    daemon = bench_daemon(ctx.path("restart"), region_size(4096, CONTROL_PAGE), CONTROL_PAGE)
    daemon.start()
    engines = []
    try:
        say(f"restart: {n_engines} engine processes (link + rank each), {rounds} restarts of each kind")
        for eid in range(n_engines):
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=_engine, args=(child, eid, daemon.socket), daemon=True)
            proc.start()
            engines.append((proc, parent))
        if not all(conn.recv() for _, conn in engines):
            raise RuntimeError("an engine of the restart bench did not attach")
        results = {kind: [_round(daemon, engines, sig) for _ in range(rounds)] for kind, sig in KINDS.items()}
    finally:
        stop_processes(engines, "stop", 30)
        daemon.stop()
    rows, ratios, targets = [], {}, []
    for kind, runs in results.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        worst = max(max(r["links_ms"], r["ranks_ms"]) for r in runs)
        rows.append({"restart": kind, "engines": n_engines, "rounds": rounds, "down_s": med["down_s"],
                     "links_ms": med["links_ms"], "ranks_ms": med["ranks_ms"], "fresh_attach_ms": med["fresh_ms"],
                     "worst_ms": worst, "rounds_ms": [[r["links_ms"], r["ranks_ms"]] for r in runs]})
        say(f"restart: {kind}: every link up {med['links_ms']:.1f} ms and every rank attached {med['ranks_ms']:.1f} "
            f"ms after serving (median of {rounds}; worst {worst:.1f} ms); a fresh client {med['fresh_ms']:.1f} ms")
        tag = "planned" if kind.startswith("planned") else "crash"
        ratios[f"{tag}_all_attached_vs_fresh_attach"] = ratio(max(med["links_ms"], med["ranks_ms"]), med["fresh_ms"])
        targets.append(target(f"{tag} restart: {n_engines} engines attached again after serving, worst round (ms)",
                              worst, GOAL_MS, "lower"))
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": [
        "links_ms: from the new daemon's first answer to the last engine's link up again; ranks_ms: to the last "
        "engine's rank lookup answered (it re-attached first); medians over the rounds, worst_ms the worst of "
        "either in any round; fresh_attach_ms: a new coordinator attaching the moment the daemon serves (floor); "
        "down_s: from the stop to the new daemon serving"]}

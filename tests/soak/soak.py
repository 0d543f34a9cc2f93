"""Bounded soak: 4 engines x TP=4 (16 client processes), two namespaces, constant eviction.

    python tests/soak/soak.py --duration 300            # the long soak (make soak)
    python tests/soak/soak.py --duration 6              # what CI runs (tests/soak/test_soak_short.py)
    python tests/soak/soak.py --rounds 200 --json out.json

Starts its own kvtierd (a private directory under /tmp, removed afterwards) with a region far
smaller than the working set, then one spawned process per rank. Engines 0..E/2-1 are
replicated (MLA-like: one namespace, rank 0 writes one copy), engines E/2..E-1 sharded (GQA-like:
another namespace, every rank writes its shard). Engines of one namespace share entries.

Keys are content-addressed: the bytes of a block (of rank r's shard, for sharded layouts) are a
pure function of its key (a NumPy generator seeded from sha256(key[, r])), so any engine can
verify any block, whichever engine stored it. Each rank keeps its own key -> hash map.

Every round of an engine (all its ranks draw the same round from the same seed) is: lookup the
prompt's block keys, load them (the daemon's decision fixes the hits for every rank) into
clobbered destination blocks and check each loaded block's hash, then fill and store the keys
that missed. Ranks of an engine stay within ``--max-lag`` rounds of each other (as TP ranks run
in lockstep); the run ends at the same round on every rank of an engine.

Checks (exit 1 when any fails): 0 client errors (exceptions, jobs not ok), 0 torn reads (a
loaded block whose hash is not its key's), 0 daemon error replies, 0 aborted jobs, no pins /
WRITING entries / fenced pages / open jobs / sessions once all clients closed, ``kvtierctl
check`` ok, evictions > 0 (the pressure was real), loads verified > 0, a clean SIGTERM stop
(exit 0), no traceback in the daemon log, and the daemon's RSS flat after warm-up (below).

Why that bound: after warm-up the region is prefaulted and full, the index holds at most one
entry per page, and each job's structures go when it finishes — except two things that are
bounded but grow for a while: the daemon keeps a finished job referenced from its deadline heap
until the job's deadline passes (so memory follows job rate x job_timeout, ~3 KiB per job; the
default warm-up, max(20 % of the run, job_timeout + 5 s), lets that reach its plateau), and it
remembers each finished job id as a tombstone (at most max_tombstones in all, ~0.3 KiB each). So:
final VmRSS <= warm-up VmRSS + max(--rss-slack-mib, --rss-slack-pct % of warm-up) + 320 B per
tombstone added after warm-up (at most max_tombstones). A leak of anything per job or per
request (tens of thousands of them) breaks it; the bounded growth does not. Defaults: 32 MiB, 20 %.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

from kvtierbench.launcher import DaemonProcess
from kvtierd.config import BY_NAME

# Workers are forked from a fork server that imported torch once (16 interpreters importing torch
# one by one would take most of a short run); each is still its own process with its own pid,
# ZMQ context, session and region mapping, created after the fork.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["numpy", "torch", "kvtier"])
TOMBSTONE_BYTES = 320              # measured: ~200 B of Python objects per tombstone + malloc overhead
MAX_TOMBSTONES = BY_NAME["max_tombstones"].default_value()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------- workload
def key_of(ns: str, doc: int, i: int) -> bytes:
    """Block i of document doc: a vLLM-style key (32-byte hash + 4-byte group)."""
    return hashlib.sha256(f"{ns}/{doc}/{i}".encode()).digest() + b"\0\0\0\0"


def content(key: bytes, shard: int, nbytes: int):
    import numpy as np
    seed = int.from_bytes(hashlib.sha256(key + shard.to_bytes(2, "little")).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def round_plan(engine: int, rnd: int, docs: int, max_len: int) -> tuple[int, int]:
    """(document, prompt length in blocks) of an engine's round: the same on all its ranks."""
    rng = random.Random(engine * 1_000_003 + rnd)
    doc = min(int(rng.paretovariate(1.1)) - 1, docs - 1)        # heavy head: popular prefixes hit
    doc = (doc * 7919 + (rng.randrange(docs) if rng.random() < 0.3 else 0)) % docs
    return doc, rng.randint(max(1, max_len // 4), max_len)


# ---------------------------------------------------------------------------------- worker
def worker(cfg: dict, engine: int, rank: int, shared: dict, results) -> None:
    """One rank process: connect, run rounds until its engine's stop round, report counters."""
    out = Counter()
    errors: list[str] = []
    client = None
    try:
        import numpy as np
        import torch
        from kvtier import Client, NamespaceId

        tp, layers, nb = cfg["tp"], cfg["layers"], cfg["num_blocks"]
        sharded = engine >= cfg["engines"] // 2
        ns = "soak-gqa" if sharded else "soak-mla"
        block_bytes = cfg["shard_bytes"] if sharded else cfg["replicated_bytes"]
        row = block_bytes // layers
        arrays = [np.zeros((nb, row), dtype=np.uint8) for _ in range(layers)]
        kv = [torch.from_numpy(a) for a in arrays]
        layout = NamespaceId(ns, "uint8", 16, block_bytes, "sharded" if sharded else "replicated")
        client = Client(cfg["socket"], engine_id=f"engine-{engine}", rank=rank, world_size=tp, namespace=layout,
                        pin="off", timeout=60)
        client.register_kv_caches(kv)
        shard = rank if sharded else 0
        expected: dict[bytes, bytes] = {}          # key -> blake2b of this rank's bytes of it

        def expect(key: bytes) -> bytes:
            h = expected.get(key)
            if h is None:
                h = expected[key] = hashlib.blake2b(content(key, shard, block_bytes).tobytes(), digest_size=16).digest()
            return h

        def block_hash(b: int) -> bytes:
            h = hashlib.blake2b(digest_size=16)
            for a in arrays:
                h.update(a[b].tobytes())
            return h.digest()

        def fill(b: int, key: bytes) -> None:
            data = content(key, shard, block_bytes)
            for i, a in enumerate(arrays):
                a[b] = data[i * row:(i + 1) * row]

        half = nb // 2
        lock, progress, stop, rounds_at = (shared["lock"][engine], shared["progress"][engine],
                                           shared["stop"][engine], shared["rounds"][engine])
        results.put(("ready", engine, rank))
        shared["go"].wait(120)
        rnd = 0
        while True:
            with lock:
                if stop.value >= 0 and rnd >= stop.value:
                    break
                progress.value = max(progress.value, rnd)
                rounds_at[rank] = rnd
            # Stay within max_lag rounds of the slowest rank of this engine (TP lockstep).
            waited = time.monotonic()
            while rnd - min(rounds_at[:tp]) > cfg["max_lag"]:
                if time.monotonic() - waited > 120:
                    raise RuntimeError(f"rank waited 120 s for its engine's slowest rank at round {rnd}")
                time.sleep(0.002)

            doc, n = round_plan(engine, rnd, cfg["docs"], min(cfg["max_len"], half))
            keys = [key_of(ns, doc, i) for i in range(n)]
            out["lookup_hits"] += client.lookup(keys)
            out["lookups"] += 1

            dst = list(range(half, half + n))
            for a in arrays:
                a[half:half + n] = 0xEE                           # a load that copies nothing fails the check
            hits = client.load(2 * rnd, keys, dst)
            (res,) = client.wait([2 * rnd], timeout=120)
            out["load_jobs"] += 1
            if not res.ok:
                out["errors"] += 1
                errors.append(f"load job {2 * rnd}: {res.error!r}")
            else:
                for i in range(hits):
                    if block_hash(dst[i]) != expect(keys[i]):
                        out["torn"] += 1
                        errors.append(f"torn read: engine {engine} rank {rank} key {keys[i].hex()[:16]}")
                    else:
                        out["loads_verified"] += 1
            out["load_hit_keys"] += hits
            out["load_miss_keys"] += n - hits

            todo = keys[hits:]
            if todo:
                src = list(range(len(todo)))
                for b, key in zip(src, todo):
                    fill(b, key)
                decision = client.store(2 * rnd + 1, todo, src)
                (res,) = client.wait([2 * rnd + 1], timeout=120)
                out["store_jobs"] += 1
                for o in decision.outcomes:
                    out[f"store_{o.name.lower()}"] += 1
                if not res.ok:
                    out["errors"] += 1
                    errors.append(f"store job {2 * rnd + 1}: {res.error!r}")
            rnd += 1
        out["rounds"] = rnd
        with lock:
            rounds_at[rank] = 1 << 30                               # finished: nobody waits for it
    except BaseException as exc:
        out["errors"] += 1
        errors.append(f"engine {engine} rank {rank}: {exc!r}\n{traceback.format_exc()}")
        with shared["lock"][engine]:
            shared["rounds"][engine][rank] = 1 << 30
    finally:
        if client is not None:
            try:
                client.close()
            except BaseException as exc:
                out["errors"] += 1
                errors.append(f"close: {exc!r}")
        results.put(("done", engine, rank, dict(out), errors[:5]))


# ---------------------------------------------------------------------------------- daemon
def start_daemon(args) -> DaemonProcess:
    """The soak's daemon, in a fresh directory under /tmp, serving."""
    daemon = DaemonProcess(tempfile.mkdtemp(prefix="kvt-soak-", dir="/tmp"), "--size", args.size,
                           "--page-size", args.page_size, "--pin", "off", "--job-timeout", str(args.job_timeout),
                           "--log-level", "info", "--metrics-address", "off")
    daemon.start()
    return daemon


def check(daemon: DaemonProcess) -> dict:
    """``kvtierctl check --json`` of the daemon's region."""
    ctl = os.path.join(os.path.dirname(sys.executable), "kvtierctl")
    cmd = [ctl] if os.path.exists(ctl) else [sys.executable, "-c", "from kvtierd.cli import ctl_main; ctl_main()"]
    out = subprocess.run([*cmd, "--dir", daemon.dir, "check", "--json"], check=False, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    try:
        return json.loads(out.stdout)
    except ValueError:
        return {"ok": False, "stdout": out.stdout, "stderr": out.stderr}


# ---------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--duration", type=float, help="seconds of load after start-up (default 30)")
    mode.add_argument("--rounds", type=int, help="rounds per engine instead of a duration")
    p.add_argument("--engines", type=int, default=4, help="engines (half replicated, half sharded)")
    p.add_argument("--tp", type=int, default=4, help="ranks per engine")
    p.add_argument("--size", default="24MiB", help="region size (keep it far below the working set)")
    p.add_argument("--page-size", default="16KiB")
    p.add_argument("--replicated-bytes", type=int, default=32 << 10, help="block bytes, replicated layout")
    p.add_argument("--shard-bytes", type=int, default=16 << 10, help="block bytes per rank, sharded layout")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=32, help="KV-cache blocks per rank")
    p.add_argument("--docs", type=int, default=400, help="distinct prompts per namespace")
    p.add_argument("--max-len", type=int, default=16, help="blocks per prompt, at most")
    p.add_argument("--max-lag", type=int, default=4, help="rounds a rank may run ahead of its engine's slowest")
    p.add_argument("--job-timeout", type=float, default=30.0, help="the daemon's job timeout (its default: 30)")
    p.add_argument("--warmup", type=float, help="seconds before the warm-up RSS sample (default: max(20%% of the "
                   "run, job timeout + 5 s), at most half the run)")
    p.add_argument("--rss-slack-mib", type=float, default=32.0)
    p.add_argument("--rss-slack-pct", type=float, default=20.0)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--keep-dir", action="store_true", help="keep the daemon's directory (region, log)")
    args = p.parse_args(argv)
    if args.duration is None and args.rounds is None:
        args.duration = 30.0
    if args.engines < 2 or args.engines % 2:
        p.error("--engines must be even (half replicated, half sharded)")
    return args


def run(args) -> tuple[dict, list[str]]:
    daemon = start_daemon(args)
    failures: list[str] = []
    procs: list = []
    figures: dict = {}
    try:
        stats0 = daemon.call("stats")
        E, tp = args.engines, args.tp
        shared = {
            "lock": [CTX.Lock() for _ in range(E)],
            "progress": [CTX.Value("q", -1, lock=False) for _ in range(E)],
            "stop": [CTX.Value("q", args.rounds if args.rounds else -1, lock=False) for _ in range(E)],
            "rounds": [CTX.Array("q", [0] * tp, lock=False) for _ in range(E)],
            "go": CTX.Event(),
        }
        cfg = {"socket": daemon.socket, "tp": tp, "engines": E, "layers": args.layers, "num_blocks": args.num_blocks,
               "replicated_bytes": args.replicated_bytes, "shard_bytes": args.shard_bytes, "docs": args.docs,
               "max_len": args.max_len, "max_lag": args.max_lag}
        results = CTX.Queue()
        spawn_started = time.monotonic()
        for e in range(E):
            for r in range(tp):
                p = CTX.Process(target=worker, args=(cfg, e, r, shared, results), daemon=True)
                p.start()
                procs.append(p)
        done: dict[tuple[int, int], tuple[dict, list]] = {}
        ready = 0
        while ready < len(procs):
            msg = results.get(timeout=180)
            if msg[0] == "ready":
                ready += 1
            else:                                     # a worker failed before it was ready
                done[(msg[1], msg[2])] = (msg[3], msg[4])
                ready += 1
        rss_start = daemon.rss()
        started = time.monotonic()
        startup = started - spawn_started
        shared["go"].set()
        samples: list[tuple[float, float, int]] = []     # (seconds, VmRSS MiB, jobs done)
        next_sample = 0.0

        def progress() -> int:
            return min(v.value for v in shared["progress"])

        warmup = args.warmup
        if warmup is None and args.duration:
            warmup = min(max(0.2 * args.duration, args.job_timeout + 5), 0.5 * args.duration)
        rss_warm = None
        stopped = False
        peak = 0
        while len(done) < len(procs):
            now = time.monotonic() - started
            if rss_warm is None and ((warmup is not None and now >= warmup)
                                     or (args.rounds and progress() >= max(1, args.rounds // 5))):
                rss_warm, warm_at, warm_stats = daemon.rss(), now, daemon.call("stats")
            if not stopped and args.duration and now >= args.duration:
                for e in range(E):                     # every rank of engine e ends after the same round
                    with shared["lock"][e]:
                        shared["stop"][e].value = shared["progress"][e].value + 1
                stopped = True
            if daemon.proc.poll() is not None:
                failures.append(f"kvtierd exited with {daemon.proc.returncode} during the soak")
                break
            rss_now = daemon.rss()["VmRSS"]
            peak = max(peak, rss_now)
            if now >= next_sample:
                st = daemon.call("stats")
                samples.append((round(now, 1), mib(rss_now), st["store_jobs_done"] + st["load_jobs_done"]))
                next_sample = now + max(1.0, (args.duration or 60) / 10)
            if now > (args.duration or 0) + 600:
                failures.append("workers did not finish within 600 s of the end of the run")
                break
            try:
                msg = results.get(timeout=0.5)
            except Exception:
                continue
            if msg[0] == "done":
                done[(msg[1], msg[2])] = (msg[3], msg[4])
        elapsed = time.monotonic() - started
        for p in procs:
            p.join(30)
        if rss_warm is None:
            rss_warm, warm_at, warm_stats = rss_start, 0.0, stats0
        rss_end = daemon.rss()

        # ----------------------------------------------------------------- figures
        total = Counter()
        worker_errors: list[str] = []
        for (e, r), (out, errs) in sorted(done.items()):
            total.update(out)
            worker_errors.extend(errs)
        engine_jobs = Counter()        # per engine, counted once (rank 0)
        for (e, r), (out, _) in done.items():
            if r == 0:
                engine_jobs.update({k: out.get(k, 0) for k in ("load_jobs", "store_jobs", "load_hit_keys",
                                                              "load_miss_keys", "rounds", "lookup_hits")})
        stats = wait_stats(daemon)
        check_result = check(daemon)
        figures = {
            "engines": E, "tp": tp, "client_processes": len(procs), "namespaces": stats["namespaces"],
            "seconds": round(elapsed, 1), "rounds": engine_jobs["rounds"],
            "jobs": engine_jobs["load_jobs"] + engine_jobs["store_jobs"],
            "load_jobs": engine_jobs["load_jobs"], "store_jobs": engine_jobs["store_jobs"],
            "keys_per_s": round((stats["store_written_keys"] + stats["store_present_keys"] + stats["load_hit_keys"]
                                 + stats["load_miss_keys"]) / max(elapsed, 1e-9), 1),
            "load_hit_rate": round(engine_jobs["load_hit_keys"] / max(1, engine_jobs["load_hit_keys"]
                                                                     + engine_jobs["load_miss_keys"]), 3),
            "loads_verified": total["loads_verified"], "torn_reads": total["torn"], "errors": total["errors"],
            "daemon_errors": stats["errors"], "evictions": stats["evictions"],
            "store_written_keys": stats["store_written_keys"], "store_no_space_keys": stats["store_no_space_keys"],
            "aborted_jobs": stats["aborted_jobs"],
            "leaked_pins": stats["entries_pinned"], "writing_left": stats["entries_writing"],
            "fenced_left": stats["pages_fenced"], "open_jobs_left": stats["open_jobs"],
            "sessions_left": stats["sessions"],
            "entries_ready": stats["entries_ready"], "pages_total": stats["pages_total"],
            "rss_start_mib": mib(rss_start["VmRSS"]), "rss_warm_mib": mib(rss_warm["VmRSS"]),
            "rss_end_mib": mib(rss_end["VmRSS"]), "rss_peak_mib": mib(max(peak, rss_end["VmRSS"])),
            "rss_anon_warm_mib": mib(rss_warm.get("RssAnon", 0)), "rss_anon_end_mib": mib(rss_end.get("RssAnon", 0)),
            "warmup_at_s": round(warm_at, 1), "startup_s": round(startup, 1),
            "rss_samples_s_mib_jobs": samples,
            "jobs_after_warmup": (stats["store_jobs_done"] + stats["load_jobs_done"]
                                  - warm_stats["store_jobs_done"] - warm_stats["load_jobs_done"]),
            "check_ok": bool(check_result.get("ok")),
        }
        slack = max(args.rss_slack_mib * (1 << 20), rss_warm["VmRSS"] * args.rss_slack_pct / 100)
        slack += TOMBSTONE_BYTES * min(figures["jobs_after_warmup"], MAX_TOMBSTONES)
        figures["rss_bound_mib"] = mib(rss_warm["VmRSS"] + slack)

        # ----------------------------------------------------------------- checks
        if len(done) != len(procs):
            failures.append(f"only {len(done)} of {len(procs)} workers reported")
        if total["errors"]:
            failures.append(f"{total['errors']} client errors: {worker_errors[:5]}")
        if total["torn"]:
            failures.append(f"{total['torn']} torn reads")
        if stats["errors"]:
            failures.append(f"daemon error replies: {stats['errors']}")
        if stats["aborted_jobs"]:
            failures.append(f"aborted jobs: {stats['aborted_jobs']}")
        for name in ("leaked_pins", "writing_left", "fenced_left", "open_jobs_left", "sessions_left"):
            if figures[name]:
                failures.append(f"{name} = {figures[name]} after all clients closed")
        if not figures["check_ok"]:
            failures.append(f"kvtierctl check: {check_result}")
        if figures["loads_verified"] == 0:
            failures.append("no loaded block was verified (no hits at all)")
        if figures["evictions"] == 0:
            failures.append("no evictions: the region was not under pressure")
        if rss_end["VmRSS"] > rss_warm["VmRSS"] + slack:
            failures.append(f"daemon RSS grew from {mib(rss_warm['VmRSS'])} MiB at warm-up to "
                            f"{mib(rss_end['VmRSS'])} MiB (bound {figures['rss_bound_mib']} MiB)")
        code = daemon.stop()
        figures["daemon_exit"] = code
        if code != 0:
            failures.append(f"kvtierd exited with {code} on SIGTERM")
        log = daemon.log()
        if "Traceback" in log or "internal error" in log:
            failures.append("the daemon log holds a traceback / internal error")
    except BaseException as exc:
        failures.append(f"soak driver failed: {exc!r}\n{traceback.format_exc()}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        daemon.stop(signal.SIGKILL)
        if not args.keep_dir:
            daemon.cleanup()
    return figures, failures


def wait_stats(daemon, timeout: float = 30.0) -> dict:
    """Stats once the daemon has ended every session (clients closed or noticed dead)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = daemon.call("stats")
        if stats["sessions"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def mib(n: int) -> float:
    return round(n / (1 << 20), 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    figures, failures = run(args)
    from tests.soak.report import finish    # the repository root is on sys.path by now (__main__)
    return finish("kvtierd soak", figures, failures, args.json)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())

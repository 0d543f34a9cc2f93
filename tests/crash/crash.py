"""Randomised crash test: engines store and load while a driver kills and freezes everything.

    python tests/crash/crash.py --duration 60              # make crash (also with --pidns)
    python tests/crash/crash.py --duration 12              # what CI runs (tests/crash/test_crash_short.py)
    python tests/crash/crash.py --duration 60 --pidns --seed 7 --json out.json

Several engines (one spawned client process each, TP=1, one replicated namespace, so they load
each other's blocks) run rounds against one kvtierd whose region is far smaller than their
working set (constant eviction: pages are reused all the time). Their copies are slowed down by a
random delay (a D2H copy queued behind the model's compute), so kills land while copies are in
flight. Meanwhile the driver, at random moments (``--seed``), does one of:

- SIGKILL the daemon and start it again;
- SIGTERM the daemon (a short drain) and start it again;
- SIGKILL a client process and start a new one for its engine;
- SIGSTOP a client process for 0.5-3 job timeouts (past the heartbeat timeout too), then SIGCONT.

Every block's bytes are a pure function of its key, and every block a load returns with ok=True
is compared with its key's bytes: a block holding another key's bytes (foreign) or a mix (torn)
counts as bad. With ``--pidns`` the daemon runs in a PID namespace of its own, so it cannot see
any client's process (as across pods): liveness is heartbeats, and the fence of a client killed
there ends only with the grace period (``--fence-grace``, longer than the longest freeze).

Checks (exit 1 when any fails): 0 bad blocks; loads verified > 0; the daemon was killed and
restarted at least once; at the end, once every client closed, no session is left and no page is
fenced (the fenced pages came back); ``kvtierctl check`` ok; the final SIGTERM exits 0; no
traceback or internal error in the daemon's log. Client errors (a stopping or restarting daemon,
aborted jobs) are expected and counted, not failures: an engine treats them as misses.
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from kvtierbench.launcher import DaemonProcess, in_own_pid_namespace  # noqa: E402

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["numpy", "torch", "kvtier"])

# Per-worker counters in shared memory: a SIGKILLed worker loses nothing it counted.
COUNTERS = ("rounds", "loads_verified", "bad_blocks", "bad_bytes", "load_jobs_ok", "load_jobs_failed",
            "store_jobs_ok", "store_jobs_failed", "client_errors", "connects")
C = {name: i for i, name in enumerate(COUNTERS)}


# ---------------------------------------------------------------------------------- workload
def key_of(doc: int, i: int) -> bytes:
    return hashlib.sha256(f"crash/{doc}/{i}".encode()).digest() + b"\0\0\0\0"


def content(key: bytes, nbytes: int):
    import numpy as np
    seed = int.from_bytes(hashlib.sha256(b"content/" + key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def worker(cfg: dict, slot: int, counters, stop) -> None:
    """One engine (TP=1) until ``stop``; an unexpected exception is written to ``<dir>/worker-*.err``."""
    try:
        engine(cfg, slot, counters, stop)
    except BaseException:
        with open(os.path.join(cfg["dir"], f"worker-{slot}-{os.getpid()}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def engine(cfg: dict, slot: int, counters, stop) -> None:
    """Rounds of lookup, load and verify, store the misses."""
    import numpy as np
    import torch

    import kvtier.rank
    from kvtier import Client, KvtierError, NamespaceId
    from kvtier.copy import Copier, CopyHandle, run_memmove

    base = slot * len(COUNTERS)

    def count(name: str, n: int = 1) -> None:
        counters[base + C[name]] += n

    rng = random.Random(cfg["seed"] * 7919 + slot * 104729 + os.getpid())

    class SlowCopier(Copier):
        """Each copy starts after a random delay: a D2H copy queued behind the model's compute."""

        def __init__(self, inner):
            from concurrent.futures import ThreadPoolExecutor
            self.inner, self.name = inner, inner.name
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow-copy")

        def submit(self, desc):
            delay = rng.uniform(0, cfg["max_copy_delay"])
            return CopyHandle(self._pool.submit(lambda: (time.sleep(delay), run_memmove(desc))[1]))

        def close(self) -> None:
            self._pool.shutdown(wait=True)
            self.inner.close()

    select = kvtier.rank.select_copier
    kvtier.rank.select_copier = lambda *a, **k: SlowCopier(select(*a, **k))

    layers, nb, block = cfg["layers"], cfg["num_blocks"], cfg["block_bytes"]
    row = block // layers
    arrays = [np.zeros((nb, row), dtype=np.uint8) for _ in range(layers)]
    kv = [torch.from_numpy(a) for a in arrays]
    namespace = NamespaceId("crash-model", "uint8", 16, block)
    digests: dict[bytes, bytes] = {}

    def digest(key: bytes) -> bytes:
        d = digests.get(key)
        if d is None:
            d = digests[key] = hashlib.blake2b(content(key, block).tobytes(), digest_size=16).digest()
        return d

    def block_bytes(b: int) -> bytes:
        return b"".join(a[b].tobytes() for a in arrays)

    client = None
    while client is None and not stop.value:
        try:
            client = Client(cfg["socket"], engine_id=f"crash-{slot}", rank=0, world_size=1, namespace=namespace,
                            pin="off", timeout=5, reconnect_timeout=120)
            client.register_kv_caches(kv)
            count("connects")
        except KvtierError:
            client = None
            count("client_errors")
            time.sleep(0.2)
    half = nb // 2
    job = 0
    while not stop.value:
        doc = rng.randrange(cfg["docs"])
        keys = [key_of(doc, i) for i in range(rng.randint(1, min(cfg["max_len"], half)))]
        try:
            client.lookup(keys)
            dst = list(range(half, half + len(keys)))
            for a in arrays:
                a[half:half + len(keys)] = 0xEE          # a load that copies nothing cannot pass
            job += 1
            hits = client.load(job, keys, dst)
            (res,) = client.wait([job], timeout=300)
            if res.ok:
                count("load_jobs_ok")
                for i in range(hits):
                    got = block_bytes(dst[i])
                    if hashlib.blake2b(got, digest_size=16).digest() == digest(keys[i]):
                        count("loads_verified")
                    else:
                        count("bad_blocks")
                        want = content(keys[i], block).tobytes()
                        count("bad_bytes", sum(x != y for x, y in zip(got, want)))
            else:
                count("load_jobs_failed")
            todo = keys[hits:]
            if todo:
                for b, key in enumerate(todo):
                    data = content(key, block)
                    for i, a in enumerate(arrays):
                        a[b] = data[i * row:(i + 1) * row]
                job += 1
                client.store(job, todo, list(range(len(todo))))
                (res,) = client.wait([job], timeout=300)
                count("store_jobs_ok" if res.ok else "store_jobs_failed")
            count("rounds")
        except KvtierError:
            count("client_errors")
            time.sleep(0.05)
    if client is not None:                  # None: stopped before it could connect
        try:
            client.close()
        except KvtierError:
            count("client_errors")


# ---------------------------------------------------------------------------------- daemon
def new_daemon(args) -> DaemonProcess:
    return DaemonProcess(tempfile.mkdtemp(prefix="kvt-crash-", dir="/tmp"), "--size", args.size, "--page-size",
                         args.page_size, "--pin", "off", "--job-timeout", str(args.job_timeout), "--heartbeat-timeout",
                         str(args.heartbeat_timeout), "--fence-grace", str(args.fence_grace), "--drain-timeout",
                         str(args.drain_timeout), "--log-level", "info", "--metrics-address", "off",
                         wrapper=in_own_pid_namespace() if args.pidns else (), start_timeout=60)


def check(daemon: DaemonProcess) -> dict:
    ctl = os.path.join(os.path.dirname(sys.executable), "kvtierctl")
    cmd = [ctl] if os.path.exists(ctl) else [sys.executable, "-c", "from kvtierd.cli import ctl_main; ctl_main()"]
    out = subprocess.run([*cmd, "--dir", daemon.dir, "check", "--json"], check=False, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    try:
        return json.loads(out.stdout)
    except ValueError:
        return {"ok": False, "stdout": out.stdout, "stderr": out.stderr}


def admin_stats(daemon: DaemonProcess) -> dict | None:
    try:
        return daemon.call("stats", admin=True, timeout=2)
    except Exception:
        return None


# ---------------------------------------------------------------------------------- driver
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of kills and freezes")
    p.add_argument("--engines", type=int, default=4, help="client processes (one TP=1 engine each)")
    p.add_argument("--seed", type=int, help="random seed of the driver and the workload (default: random)")
    p.add_argument("--pidns", action="store_true", help="run the daemon in its own PID namespace (clients unwatchable)")
    p.add_argument("--size", default="8MiB", help="region size (far below the working set)")
    p.add_argument("--page-size", default="16KiB")
    p.add_argument("--block-bytes", type=int, default=16 << 10)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=64, help="KV-cache blocks per client")
    p.add_argument("--docs", type=int, default=150, help="distinct prompts")
    p.add_argument("--max-len", type=int, default=24, help="blocks per prompt, at most")
    p.add_argument("--max-copy-delay", type=float, default=0.15, help="seconds a copy may wait before it starts")
    p.add_argument("--job-timeout", type=float, default=2.0)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--drain-timeout", type=float, default=1.0)
    p.add_argument("--fence-grace", type=float, help="default: 600, or 20 with --pidns (> the longest freeze)")
    p.add_argument("--json", help="also write the totals to this file")
    p.add_argument("--keep-dir", action="store_true", help="keep the daemon's directory (region, log)")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if args.fence_grace is None:
        args.fence_grace = 20.0 if args.pidns else 600.0
    if args.fence_grace <= 3 * args.job_timeout:
        p.error("--fence-grace must exceed the longest freeze (3 job timeouts): that is its residual risk")
    return args


class Run:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.daemon = new_daemon(args)
        self.totals: Counter = Counter()
        self.released: Counter = Counter()        # fence releases by cause, summed over daemon lives
        self.life_released: dict = {}
        self.max_fenced = 0
        self.fenced_reasons: Counter = Counter()  # max pages fenced seen, by reason
        self.failures: list[str] = []
        n = args.engines
        self.counters = CTX.Array("q", [0] * (n * len(COUNTERS)), lock=False)
        self.stop = CTX.Value("b", 0, lock=False)
        self.procs: list = [None] * n
        self.stopped: dict[int, float] = {}       # slot → when to SIGCONT it
        self.cfg = {"socket": self.daemon.socket, "dir": self.daemon.dir, "seed": args.seed, "layers": args.layers,
                    "num_blocks": args.num_blocks, "block_bytes": args.block_bytes, "docs": args.docs,
                    "max_len": args.max_len, "max_copy_delay": args.max_copy_delay}

    def spawn(self, slot: int) -> None:
        proc = CTX.Process(target=worker, args=(self.cfg, slot, self.counters, self.stop), daemon=True)
        proc.start()
        self.procs[slot] = proc

    def sample(self) -> None:
        s = admin_stats(self.daemon)
        if s is None:
            return
        self.life_released = s["fence_released_pages"]
        self.max_fenced = max(self.max_fenced, s["pages_fenced"])
        for reason, pages in s["fenced_pages"].items():
            self.fenced_reasons[reason] = max(self.fenced_reasons[reason], pages)

    def end_life(self) -> None:
        self.released.update(self.life_released)
        self.life_released = {}

    # -- actions
    def kill_daemon(self) -> None:
        self.sample()
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.proc.wait(30)
        self.end_life()
        self.totals["daemon_sigkills"] += 1
        self.restart_daemon()

    def term_daemon(self) -> None:
        self.sample()
        self.daemon.send_signal(signal.SIGTERM)
        try:
            code = self.daemon.proc.wait(self.args.drain_timeout + 30)
        except subprocess.TimeoutExpired:
            self.failures.append("the daemon did not stop within drain_timeout + 30 s of SIGTERM")
            self.daemon.send_signal(signal.SIGKILL)
            code = self.daemon.proc.wait(30)
        if code != 0:
            self.failures.append(f"the daemon exited with {code} on SIGTERM")
        self.end_life()
        self.totals["daemon_sigterms"] += 1
        self.restart_daemon()

    def restart_daemon(self) -> None:
        self.daemon.start()
        self.totals["daemon_restarts"] += 1

    def kill_client(self) -> None:
        slot = self.rng.randrange(len(self.procs))
        proc = self.procs[slot]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        self.stopped.pop(slot, None)
        self.totals["client_sigkills"] += 1
        self.spawn(slot)

    def freeze_client(self) -> None:
        running = [s for s in range(len(self.procs)) if s not in self.stopped]
        if not running:
            return
        slot = self.rng.choice(running)
        os.kill(self.procs[slot].pid, signal.SIGSTOP)
        self.stopped[slot] = time.monotonic() + self.rng.uniform(0.5, 3.0) * self.args.job_timeout
        self.totals["client_sigstops"] += 1

    def thaw(self, everyone: bool = False) -> None:
        now = time.monotonic()
        for slot, at in list(self.stopped.items()):
            if everyone or now >= at:
                os.kill(self.procs[slot].pid, signal.SIGCONT)
                del self.stopped[slot]

    # -- the run
    def run(self) -> dict:
        args = self.args
        self.daemon.start()
        for slot in range(args.engines):
            self.spawn(slot)
        deadline = time.monotonic() + 180
        while sum(self.counters[s * len(COUNTERS) + C["connects"]] for s in range(args.engines)) < args.engines:
            if time.monotonic() > deadline:
                raise RuntimeError("the clients did not connect within 180 s")
            time.sleep(0.1)
        started = time.monotonic()
        actions = [(self.kill_daemon, 2), (self.term_daemon, 2), (self.kill_client, 2), (self.freeze_client, 3)]
        next_action = started + self.rng.uniform(0.3, 1.2)
        while time.monotonic() - started < args.duration:
            self.thaw()
            if time.monotonic() >= next_action:
                action = self.rng.choices([a for a, _ in actions], weights=[w for _, w in actions])[0]
                action()
                next_action = time.monotonic() + self.rng.uniform(0.3, 1.2)
            self.sample()
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        # Wind down: thaw everyone, let every client close, then the daemon must settle.
        self.thaw(everyone=True)
        self.stop.value = 1
        for slot, proc in enumerate(self.procs):
            proc.join(120)
            if proc.is_alive():
                self.failures.append(f"client {slot} did not finish within 120 s of the end")
                proc.kill()
        for name in sorted(os.listdir(self.daemon.dir)):
            if name.startswith("worker-") and name.endswith(".err"):
                with open(os.path.join(self.daemon.dir, name)) as f:
                    self.failures.append(f"a client failed ({name}):\n{f.read()}")
        settle = time.monotonic() + 30 + (args.fence_grace if args.pidns else 0)
        final = admin_stats(self.daemon)
        while final is None or final["sessions"] or final["pages_fenced"]:
            if time.monotonic() > settle:
                left = final and {k: final[k] for k in ("sessions", "pages_fenced", "fenced_pages")}
                self.failures.append(f"not settled after every client closed: {left}")
                break
            time.sleep(0.2)
            final = admin_stats(self.daemon)
        self.sample()
        self.end_life()
        check_result = check(self.daemon)
        code = self.daemon.stop()
        log = self.daemon.log()
        per_worker = Counter()
        for slot in range(args.engines):
            for name in COUNTERS:
                per_worker[name] += self.counters[slot * len(COUNTERS) + C[name]]
        totals = {
            "seconds": round(elapsed, 1), "seed": args.seed, "pidns": args.pidns, "engines": args.engines,
            "daemon_sigkills": self.totals["daemon_sigkills"], "daemon_sigterms": self.totals["daemon_sigterms"],
            "daemon_restarts": self.totals["daemon_restarts"], "client_sigkills": self.totals["client_sigkills"],
            "client_sigstops": self.totals["client_sigstops"],
            "kills": self.totals["daemon_sigkills"] + self.totals["daemon_sigterms"] + self.totals["client_sigkills"],
            "rounds": per_worker["rounds"], "loads_verified": per_worker["loads_verified"],
            "foreign_or_torn_blocks": per_worker["bad_blocks"], "foreign_or_torn_bytes": per_worker["bad_bytes"],
            "load_jobs_ok": per_worker["load_jobs_ok"], "load_jobs_failed": per_worker["load_jobs_failed"],
            "store_jobs_ok": per_worker["store_jobs_ok"], "store_jobs_failed": per_worker["store_jobs_failed"],
            "client_errors": per_worker["client_errors"], "client_connects": per_worker["connects"],
            "max_pages_fenced": self.max_fenced, "max_fenced_by_reason": dict(self.fenced_reasons),
            "fence_released_pages": dict(self.released),
            "final_sessions": final and final["sessions"], "final_pages_fenced": final and final["pages_fenced"],
            "check_ok": bool(check_result.get("ok")), "daemon_exit": code,
        }
        if totals["foreign_or_torn_blocks"]:
            self.failures.append(f"{totals['foreign_or_torn_blocks']} loaded blocks held foreign or torn bytes")
        if totals["loads_verified"] == 0:
            self.failures.append("no loaded block was verified")
        if totals["daemon_restarts"] == 0 and args.duration >= 5:
            self.failures.append("the daemon was never restarted")
        if not totals["check_ok"]:
            self.failures.append(f"kvtierctl check: {check_result}")
        if code != 0:
            self.failures.append(f"the final SIGTERM exited with {code}")
        if "Traceback" in log or "internal error" in log:
            self.failures.append("the daemon's log holds a traceback or an internal error")
        return totals

    def cleanup(self) -> None:
        self.stop.value = 1
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.kill()
                proc.join(10)
        self.daemon.stop(signal.SIGKILL)
        if not self.args.keep_dir:
            self.daemon.cleanup()


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args)
    totals: dict = {}
    try:
        totals = run.run()
    except BaseException as exc:
        run.failures.append(f"the crash driver failed: {exc!r}\n{traceback.format_exc()}")
    finally:
        run.cleanup()
    width = max((len(k) for k in totals), default=0)
    print("kvtierd crash test" + (" (daemon in its own PID namespace)" if args.pidns else ""))
    for k, v in totals.items():
        print(f"  {k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"totals": totals, "failures": run.failures}, f, indent=1)
    if run.failures:
        print("FAILED:")
        for failure in run.failures:
            print(f"  - {failure}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

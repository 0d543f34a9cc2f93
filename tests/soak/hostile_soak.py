"""Hostile soak: good engines verify every block they load while an attacker cycles through issue 11's attacks.

    python tests/soak/hostile_soak.py --duration 75          # make soak-hostile
    python tests/soak/hostile_soak.py --duration 12          # what CI runs (test_hostile_soak_short.py)

Starts its own kvtierd (a private directory under /tmp, removed afterwards), ``--engines`` good
engines (tests/keyed.py: one process each, a TP=1 kvtier.Client, every block's bytes a function of
its model and key; two share a namespace, so they load each other's blocks; they attach with an
engine secret) and one attacker process that runs tests/attacks.py's attacks one after the other
until the time is up: a frame nested 1,000 deep and a 4 MB op (item 1); 300 idle connections (2);
hellos claiming pid 1 then vanishing, pid 2^31, a session flood (3); 100 never-released
8,192-key load jobs and a 10-part message of 8 MiB frames (4); hellos borrowing a good engine's
identity (5: a coordinator session this driver holds with the engine secret); 200 namespaces left behind, and /metrics scraped 200 times (8);
issue 26's: 1,100 idle connections from 5 processes while 8 watched sessions disconnect (C), a
writer storing 50 jobs again after its commit (A), a process looping "hello as a writer, store a
key, close" 300 times (B: 256 rows, the rest refused; its rows go when it exits), an engine
leasing every page of the region for 3 s (D); and, last of a cycle, the region file truncated
(7) — after which the attacker waits until the daemon replaced it. (Issue 26 F, EMFILE taken for
a writer's death, is a unit test: the soak cannot run the daemon out of descriptors on purpose.)

A truncated region file is the one attack the daemon cannot shield its clients from: an engine
touching its pages at that moment dies of SIGBUS (docs/reliability.md, Security). The soak counts
those engines and starts new ones; a load that was in flight is a miss, never a wrong block.

Every second the driver samples the daemon's RSS and open descriptors. Checks (exit 1 when any
fails): the daemon alive throughout and stopping cleanly (exit 0, no traceback, no INTERNAL error
reply); 0 wrong blocks; loads verified > 0; every attack answered as it must be (an attack that
saw an answer it must not raises, and is reported); descriptors at most ``--max-fds`` (the
1,100 connections of issue 26 C and 256 writer rows' pidfds of B are held on purpose) and, once the
attacks stopped, at most ``--max-fds-idle``; RSS at most the first sample + ``--rss-slack-mib``, and
not growing (the second half's peak within ``--rss-growth-mib`` of the first half's).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from kvtierbench.launcher import DaemonProcess  # noqa: E402
from tests.keyed import KeyedEngine, keys_of, namespace  # noqa: E402
from tests import attacks  # noqa: E402
from tests.procs import ChildError  # noqa: E402
from tests.soak.report import finish  # noqa: E402
from kvtierd.sessions import DISCONNECT_GRACE  # noqa: E402

CTX = mp.get_context("spawn")
SECRET = b"hostile-soak-engine-secret"
# (engine id, model, block bytes): the first two share a namespace and load each other's blocks.
ENGINES = [("good-0", "soak-shared", 16384), ("good-1", "soak-shared", 16384), ("good-2", "soak-other", 32768)]


# ---------------------------------------------------------------------------------- attacker
def attacker(socket: str, region: str, admin: str, metrics: str, victim: tuple[str, dict], stop, conn) -> None:
    """Cycle through the attacks until ``stop`` is set; report per-attack counts and misbehaviours."""
    sys.path.insert(0, ROOT)
    from kvtierd.contract.channel import Channel
    from kvtierd.sessions import DISCONNECT_GRACE
    from tests import attacks

    def generation() -> int:
        channel = Channel(admin, timeout=10)
        try:
            return channel.call("stats")["generation"]
        finally:
            channel.close()

    def borrow() -> dict:
        # The binding of an engine's sessions lasts while the engine has one: attack only then.
        channel = Channel(admin, timeout=10)
        try:
            attached = any(c["engine"] == victim[0] for c in channel.call("clients")["clients"])
        finally:
            channel.close()
        if not attached:
            return {"victim_absent": 1}
        return attacks.borrow_identity(socket, victim[0], 1, victim[1])

    def truncate() -> dict:
        before = generation()
        os.truncate(region, 4096)
        deadline = time.monotonic() + 30
        while generation() == before:
            if time.monotonic() > deadline:
                raise AssertionError("the daemon did not replace the truncated region file within 30 s")
            time.sleep(0.1)
        return {"replaced": True}

    crowded_fds: list[int] = []

    def crowded_disconnects() -> dict:
        # The daemon's descriptors while the connections are held: past 1,024, or the attack missed.
        channel = Channel(admin, timeout=10)
        try:
            pid = channel.call("stats")["daemon_pid"]
        finally:
            channel.close()
        out = attacks.crowded_disconnects(socket, 1100, peers=5, sessions=8,
                                          during=lambda: len(os.listdir(f"/proc/{pid}/fd")))
        crowded_fds.append(out["during"])
        assert out["during"] > 1100 and out["watched"] == 8, out
        return out

    def writer_rows_flood() -> dict:
        # Its own process, so that its rows (watched: held while it lives) go when it exits.
        with attacks.in_child("writer_rows_flood", socket, 300) as out:
            assert (out["attached"], out["limit"]) == (256, 44), out
        return out

    cycle = [
        ("nested_op", lambda: attacks.nested_op(socket, 1000)),
        ("huge_op", lambda: attacks.huge_op(socket)),
        ("idle_connections", lambda: attacks.idle_connections(socket, 300)),
        ("hello_pid1_and_vanish", lambda: attacks.hello_and_vanish(socket, 300, pid=1, ns=attacks.other_pidns())),
        ("pid_out_of_range", lambda: attacks.pid_out_of_range(socket)),
        ("session_flood", lambda: attacks.session_flood(socket, 150)),
        # Sessions of closed connections end DISCONNECT_GRACE later; until then they count against
        # this attacker's max_sessions_per_peer, and the next attacks need sessions.
        ("settle", lambda: time.sleep(DISCONNECT_GRACE + 0.6)),
        ("open_jobs_flood", lambda: attacks.open_jobs_flood(socket, 100)),
        ("many_parts", lambda: attacks.many_parts(socket, parts=10)),
        ("borrow_identity", borrow),
        ("fill_namespaces", lambda: attacks.fill_namespaces(socket, 200, prefix=f"squat{time.monotonic_ns()}")),
        ("scrape_loop", lambda: [attacks.scrape(metrics) for _ in range(200)] and {}),
        ("crowded_disconnects", crowded_disconnects),
        ("store_after_commit", lambda: attacks.store_after_commit(socket, 50)),
        ("writer_rows_flood", writer_rows_flood),
        ("lease_the_region", lambda: attacks.lease_the_region(socket, 3.0)),
        ("truncate_region", truncate),
    ]
    done: Counter = Counter()
    misbehaved: list[str] = []
    cycles = 0
    try:
        while not stop.is_set():
            for name, attack in cycle:
                if stop.is_set():
                    break
                try:
                    attack()
                    done[name] += 1
                except AssertionError as exc:
                    misbehaved.append(f"{name}: {exc}"[:500])
                except Exception as exc:          # the attack itself broke: report it, go on
                    misbehaved.append(f"{name}: {type(exc).__name__}: {exc}"[:500])
            cycles += 1
        conn.send({"attacks": dict(done), "cycles": cycles, "misbehaved": misbehaved, "crowded_fds": crowded_fds})
    except BaseException as exc:
        conn.send({"attacks": dict(done), "cycles": cycles, "crowded_fds": crowded_fds,
                   "misbehaved": misbehaved + [f"attacker failed: {exc!r}\n{traceback.format_exc()}"]})


# ---------------------------------------------------------------------------------- driver
def sample(daemon: DaemonProcess) -> tuple[float, int]:
    return daemon.rss()["VmRSS"] / (1 << 20), len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def run(args) -> tuple[dict, list[str]]:
    failures: list[str] = []
    figures: dict = {}
    daemon = DaemonProcess(tempfile.mkdtemp(prefix="kvt-hostile-"), "--size", args.size, "--page-size", "16KiB",
                           "--pin", "off", "--metrics-address", "127.0.0.1:0", "--region-check-interval", "0.5",
                           "--log-level", "info", start_timeout=60.0)
    engines: dict[int, KeyedEngine] = {}
    totals: dict[int, Counter] = {}
    attacker_proc = None
    try:
        daemon.start()
        stats0 = daemon.stats()

        def start_engine(i: int) -> None:
            engine_id, model, block = ENGINES[i]
            e = KeyedEngine()
            engines[i] = e
            deadline = time.monotonic() + 60
            while True:
                try:
                    e.call("connect", socket=daemon.socket, engine=engine_id, model=model, block_bytes=block,
                           secret=SECRET, timeout=30.0, reconnect_timeout=60.0)
                    return
                except ChildError as exc:
                    # Between a truncation and its replacement the client refuses the file (it is not
                    # the one announced), and the dead engine's session ends when the daemon sees
                    # its death: start again a moment later.
                    retry = "not the one kvtierd announced" in str(exc) or "is already attached" in str(exc)
                    if not retry or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

        for i in range(len(ENGINES)):
            start_engine(i)
            totals[i] = Counter()
        stop, (parent, child) = CTX.Event(), CTX.Pipe()
        # The attacker borrows the identity of an engine attached with a secret: a coordinator
        # session this driver holds (it copies nothing, so a truncation cannot kill it), attached
        # again whenever the daemon ended it (a replaced region ends every session).
        victim = ("soak-victim", namespace("soak-shared", 16384))
        victim_session = {"raw": None}

        def keep_victim_attached() -> None:
            raw = victim_session["raw"]
            if raw is not None and raw.ask({"op": "ping", "rid": 9})["attached"]:
                return
            if raw is not None:
                raw.close()
            raw = victim_session["raw"] = attacks.Raw(daemon.socket)
            assert raw.ask(attacks.hello(engine=victim[0], rank=None, namespace=victim[1], secret=SECRET,
                                         pid=os.getpid(), pidns=attacks.pidns()))["ok"]

        keep_victim_attached()
        attacker_proc = CTX.Process(target=attacker, args=(daemon.socket, daemon.region, daemon.admin_socket,
                                                           stats0["metrics_address"], victim, stop, child),
                                    daemon=True)
        attacker_proc.start()
        child.close()
        samples: list[tuple[float, float, int]] = []
        killed = 0
        started = time.monotonic()
        next_sample = 0.0
        rnd = 0
        while time.monotonic() - started < args.duration:
            now = time.monotonic() - started
            if daemon.proc.poll() is not None:
                failures.append(f"kvtierd exited with {daemon.proc.returncode} during the soak")
                break
            if now >= next_sample:
                rss, fds = sample(daemon)
                samples.append((round(now, 1), round(rss, 1), fds))
                next_sample = now + 1.0
            keep_victim_attached()
            # One round on every engine at once: keys drawn from a small set, so most rounds hit.
            for i, e in engines.items():
                e.send("round", keys=keys_of(f"{ENGINES[i][1]}/{(rnd * 7 + i) % 24}", 8))
            for i in list(engines):
                try:
                    totals[i] = Counter(engines[i].result(timeout=120))
                except (EOFError, OSError, TimeoutError):
                    # A truncated region file: an engine touching its pages got SIGBUS. Its counts
                    # up to its last round stay; a new engine takes its place.
                    killed += 1
                    engines[i].stop()
                    previous = totals.pop(i)
                    start_engine(i)
                    totals[i] = Counter()
                    totals[("dead", killed)] = previous
            rnd += 1
        stop.set()
        if not parent.poll(120):
            failures.append("the attacker did not report")
            report = {"attacks": {}, "cycles": 0, "misbehaved": [], "crowded_fds": []}
        else:
            report = parent.recv()
        attacker_proc.join(30)
        elapsed = time.monotonic() - started
        time.sleep(2 * DISCONNECT_GRACE)         # the attacker's last sessions end with their connections
        fds_idle = sample(daemon)[1]
        total = Counter()
        for counts in totals.values():
            total.update(counts)
        stats = daemon.stats()
        rss = [r for _, r, _ in samples]
        fds = [f for _, _, f in samples]
        half = len(rss) // 2
        figures = {
            "seconds": round(elapsed, 1), "engines": len(ENGINES), "engine_rounds": total["rounds"],
            "loads_verified": total["verified"], "wrong_blocks": total["wrong"],
            "loads_not_ok": total["loads_not_ok"], "engine_errors": total["errors"],
            "engines_killed_by_truncation": killed,
            "attack_cycles": report["cycles"], "attacks": report["attacks"],
            "misbehaved": report["misbehaved"],
            "rss_mib_first": rss[0] if rss else None, "rss_mib_min": min(rss, default=None),
            "rss_mib_max": max(rss, default=None), "fds_min": min(fds, default=None), "fds_max": max(fds, default=None),
            "fds_idle": fds_idle, "fds_crowded": report.get("crowded_fds", []),
            "samples": len(samples),
            "daemon_errors": stats["errors"], "connections_refused": stats["connections_refused"],
            "generation_changes": stats["generation"] != stats0["generation"],
        }
        if total["wrong"]:
            failures.append(f"{total['wrong']} wrong blocks")
        if not total["verified"]:
            failures.append("no loaded block was verified")
        if report["misbehaved"]:
            failures.append(f"attacks answered as they must not be: {report['misbehaved'][:5]}")
        if stats["errors"].get("INTERNAL"):
            failures.append(f"{stats['errors']['INTERNAL']} INTERNAL error replies")
        if fds and max(fds) > args.max_fds:
            failures.append(f"the daemon held {max(fds)} descriptors (bound {args.max_fds})")
        if fds_idle > args.max_fds_idle:
            failures.append(f"the daemon held {fds_idle} descriptors once the attacks stopped (bound {args.max_fds_idle})")
        if rss and max(rss) > rss[0] + args.rss_slack_mib:
            failures.append(f"daemon RSS reached {max(rss)} MiB from {rss[0]} (slack {args.rss_slack_mib})")
        if half and max(rss[half:]) > max(rss[:half]) + args.rss_growth_mib:
            failures.append(f"daemon RSS grows: peak {max(rss[:half])} MiB in the first half, {max(rss[half:])} after")
        for e in engines.values():
            e.stop()
        engines.clear()
        victim_session["raw"].close()
        code = daemon.stop()
        figures["daemon_exit"] = code
        if code != 0:
            failures.append(f"kvtierd exited with {code} on SIGTERM")
        if "Traceback" in daemon.log():
            failures.append("the daemon log holds a traceback")
    except BaseException as exc:
        failures.append(f"hostile soak driver failed: {exc!r}\n{traceback.format_exc()}")
    finally:
        if attacker_proc is not None and attacker_proc.is_alive():
            attacker_proc.kill()
        for e in engines.values():
            e.stop()
        daemon.stop(signal.SIGKILL)
        if not args.keep_dir:
            daemon.cleanup()
    return figures, failures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=75.0, help="seconds of attack (default 75)")
    p.add_argument("--size", default="64MiB", help="region size")
    p.add_argument("--max-fds", type=int, default=2048, help="bound on the daemon's open descriptors (issue 26 C "
                   "holds 1,100 connections on purpose)")
    p.add_argument("--max-fds-idle", type=int, default=512, help="bound on them once the attacks stopped")
    p.add_argument("--rss-slack-mib", type=float, default=512.0, help="bound on RSS above the first sample")
    p.add_argument("--rss-growth-mib", type=float, default=96.0, help="bound on the second half's RSS peak over the first's")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--keep-dir", action="store_true", help="keep the daemon's directory (region, log)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    figures, failures = run(args)
    summary = (f"daemon alive: {'yes' if figures.get('daemon_exit') == 0 else 'NO'}; RSS {figures.get('rss_mib_min')}"
               f"..{figures.get('rss_mib_max')} MiB; fds {figures.get('fds_min')}..{figures.get('fds_max')}; "
               f"wrong blocks: {figures.get('wrong_blocks')}")
    return finish("kvtierd hostile soak", figures, failures, args.json, summary)

if __name__ == "__main__":
    sys.exit(main())

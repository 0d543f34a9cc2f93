"""``recovery``: restart of a daemon whose region holds N entries (process start to socket ready),
and the store's recovery alone, against a start on a fresh region and the bare interpreter."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import time

import numpy as np

import kvtierd
from kvtierd.contract.mapping import Mapping
from kvtierd.contract.region_view import RegionView
from kvtierd.recovery import scan
from kvtierd.store import Store

from .harness import QUICK, Context, big_region, say, target

RESTART_GOAL = 1.0        # seconds, process start to serving, with a million entries (issue 22)


def _time_store_recovery(metadata: str) -> dict:
    """Open the stopped daemon's region metadata and time the store's recovery alone (scan + index build)."""
    mapping = Mapping.of_file(metadata)
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


def _byte_compile() -> None:
    """The daemon's modules byte-compiled, as an install leaves them (pip compiles what it installs).
    An editable install run under PYTHONDONTWRITEBYTECODE (this machine sets it) has no .pyc at
    all: every start compiles its ~70 modules again, ~0.13 s of a restart (cProfile)."""
    compileall.compile_dir(os.path.dirname(kvtierd.__file__), quiet=1)


def run(ctx: Context) -> dict:
    n = ctx.plan.entries
    _byte_compile()
    daemon = big_region(ctx)
    held = daemon.stats()["entries_ready"]
    daemon.stop()
    ctx.big = None
    try:
        alone = _time_store_recovery(daemon.paths.meta)
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
              "restart_vs_target": restart / RESTART_GOAL}
    targets = [target(f"restart to ready with {n:,} entries (s)", restart, RESTART_GOAL, "lower")]
    return {"rows": [row], "ratios": ratios, "targets": targets, "notes": [
        "restart_s: from process start to the socket answering (median of the restarts_s); daemon_started_in_s: "
        "the daemon's own count (region open + prefault + Store recovery + socket); store_recovery_s: "
        "Store(view) alone, in this process; the daemon's modules byte-compiled first, as an install leaves them"]}

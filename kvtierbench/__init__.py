"""kvtierbench: ``kvtierctl bench``, kvtierd against the floors of this machine and against Redis, in one run.

Every figure is reported as a ratio to a floor or a peer measured in the same run on the same
machine, so results from different machines compare by their ratios, and a loaded machine
(``machine.loadavg`` in the output) shows as noise on both sides rather than as a regression.

Sections (``--only`` picks some; each starts its own daemon in a fresh directory), one module
each; ``harness`` holds what they share, ``report`` the tables:

``control``   lookup, store and load jobs of B keys from C client processes (TP=1 rank sessions,
              one-page blocks): p50/p99 latency of a job and keys/s. A store job is the ``store``
              request and the writer's ``commit``; a load job the ``load`` request and the
              ``release`` (the copies are the data plane's). Floor: a ZMQ ROUTER echo server in
              its own process that decodes the same request frames and answers with reply frames
              of the same size (a daemon doing no work), driven by the same client code. The two
              sides alternate in short slices, so that both see the same machine.
``data``      the CPU data plane: store then load of K blocks of S bytes through the client (CPU
              copier, block ids in random order as an engine's are, its region mapping populated
              by the client at attach, waited for), GB/s against one-thread memcpy of the same
              bytes into and back out of a prefaulted shared mapping; plus the round trip of a
              ping after the daemon idled, which the job's requests pay after each copy.
``capacity``  TP = 1, 2, 4, 8 ranks on one region: blocks it holds and bytes the ranks' copiers wrote
              (D2H) per stored block, replicated (one copy, rank 0 writes) against sharded
              with the same bytes per rank (each rank its own copy: what per-rank offloading does).
``eviction``  stores/s into a full region of N one-page entries (every stored key evicts one)
              against stores/s into the same region while it still has room.
``recovery``  restart of a daemon whose region holds N entries: process start to socket ready
              (median of 3), and the store's recovery (``Store(view)``) alone; against a start on
              a fresh region of the same size and the bare interpreter start with the daemon's
              imports.
``restart``   kvtierd restarted under 8 engines (a link thread with its coordinator session and a rank
              session each), planned (SIGTERM, then a new daemon) and after a crash (SIGKILL): ms
              from the new daemon serving to every engine attached again, against a fresh client
              attaching the moment it serves (``kvtierbench.restart``).
``redis``     a real redis-server on loopback (started and stopped here) storing and loading the
              same blocks, the way KV-cache libraries use Redis as a remote tier: each job both as
              one pipelined MSET/MGET and as one SET/GET per block, Redis credited with the faster
              per direction; blocks/s against kvtierd's. Skipped when redis-server or the redis
              Python client is not installed.
``attach``    a client's attach + populate of its region mapping per GiB, and its first (cold) store
              jobs against warm ones of the same size, with and without the populate, for 4 KiB and
              2 MiB pages (a huge tmpfs the bench mounts itself when run as root and its directory
              gives no huge pages; it says so, and unmounts it).
``policy``    the eviction policies: a Mooncake-format request trace (``--trace FILE``; without
              one a generated chat-shaped trace) replayed through a daemon per policy and
              capacity (``--capacity``), the prefix hit rate against Belady's offline optimum from
              the same file and against LRU's; and the daemon's CPU per key with each policy
              against LRU's, in the same run (``kvtierbench.policy``).
``nodes``     an engine whose TP group spans two nodes (a TP=16 engine over two daemons, ranks 0-7 and
              8-15) against a TP=8 engine on one: a request trace (``--trace``, ``--capacity``, as for
              ``policy``; default capacity 0.1) replayed as the vLLM plugin plays it, the hit rate of each, their ratio, and
              the share of node A's hits missing on node B, also under pressure on node B alone
              (``kvtierbench.nodes``).
``tier``      the second tier: two daemons sharing a real engine on loopback (Mooncake Store,
              Redis Cluster; each started and stopped here, skipped when not installed): node A
              demotes N blocks, node B promotes them, blocks/s against the engine's own raw
              put/get of the same blocks; and a lookup-miss (the tier check) against a local
              lookup of the same keys (``kvtierbench.tier``).
``events``    the event log and the daemon's KV events stream in isolation (no daemon yet): CPU per
              key of appending and publishing a job's keys against one msgpack map per key, the
              append-to-subscriber latency, and 200,000 blocks/s sustained with memory flat
              (``kvtierbench.events``).

The region lives in a fresh directory under /dev/shm (its production home: a disk-backed /tmp
would measure page-cache writeback) and the whole directory is removed at the end. Daemons run
with ``--pin off`` and no metrics endpoint.

``--quick`` runs every section at toy sizes (a CI smoke test: it proves the bench runs, its
figures mean little). The full run (``bench/run_all.py``) takes minutes and needs ~10 GiB of
memory for the largest data-plane jobs (larger ones are skipped when memory is short).
"""

from __future__ import annotations

import json
import os
from importlib import import_module
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Any

from . import report
from .harness import FULL, QUICK, Context, machine, say, workdir_base

# In the order they run (eviction fills the region that recovery then restarts); each module is
# imported when it runs (so ``python -m kvtierbench.traces`` runs a module not imported before).
SECTIONS = ("control", "data", "capacity", "eviction", "recovery", "restart", "redis", "attach", "policy", "nodes",
            "tier", "events")


def run(sections: tuple[str, ...] = tuple(SECTIONS), quick: bool = False, base: str | None = None,
        traces: tuple[str, ...] = (), capacities: tuple[float, ...] = (), policies: tuple[str, ...] = (),
        job_keys: int | None = None) -> dict:
    """Run ``sections`` and return the results: machine, plan, and per section rows, ratios,
    targets and notes (or ``skipped`` with a reason). ``traces``, ``capacities``, ``policies``
    and ``job_keys`` are the policy section's options (``kvtierbench.policy``)."""
    plan = QUICK if quick else FULL
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    # A trace is read (and a bad one refused, naming its line) before any section runs.
    loaded = tuple(map(import_module(f"{__name__}.traces").load, traces)) if {"policy", "nodes"} & set(sections) else ()
    workdir = tempfile.mkdtemp(prefix="kvtbench-", dir=base or workdir_base())
    ctx = Context(plan, workdir, loaded, tuple(capacities), tuple(policies), job_keys)
    result: dict[str, Any] = {"machine": machine(), "quick": quick, "plan": asdict(plan), "workdir": workdir,
                              "sections": {}}
    started = time.perf_counter()
    try:
        for name in SECTIONS:
            if name in sections:
                say(f"--- {name}")
                t0 = time.perf_counter()
                section = import_module(f"{__name__}.{name}").run(ctx)
                section["seconds"] = time.perf_counter() - t0
                result["sections"][name] = section
    finally:
        ctx.close()
        shutil.rmtree(workdir, ignore_errors=True)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------------------------- kvtierctl bench
def add_arguments(parser) -> None:
    parser.add_argument("section", nargs="*", help=f"run only these sections (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="toy sizes, a few seconds a section (CI smoke test)")
    parser.add_argument("--only", action="append", metavar="SECTION",
                        help=f"run only this section (repeatable, or comma-separated): {', '.join(SECTIONS)}")
    parser.add_argument("--trace", action="append", default=[], metavar="FILE",
                        help="policy, nodes: a Mooncake-format JSON-lines trace to replay (repeatable; default: a "
                             "generated chat-shaped trace)")
    parser.add_argument("--capacity", metavar="F,F,...",
                        help="policy, nodes: region sizes as fractions of the trace's distinct blocks "
                             f"(default {','.join(map(str, FULL.capacities))}; nodes: "
                             f"{','.join(map(str, FULL.node_capacities))})")
    parser.add_argument("--policies", metavar="NAME,...",
                        help="policy: the policies to replay (default: every one; lru always, as the reference)")
    parser.add_argument("--job-keys", type=int, metavar="N",
                        help="policy: store a request's missing blocks in jobs of at most N keys (default: one job)")
    parser.add_argument("--out", metavar="DIR", help="also write bench.json and bench.txt into DIR")
    parser.add_argument("--workdir", metavar="DIR",
                        help="where the bench's temporary directory goes (default /dev/shm, else the temp dir)")


def fetch(args) -> dict:
    """kvtierctl bench: run the selected sections; write --out files."""
    chosen = [*args.section, *(args.only or [])] or [",".join(SECTIONS)]
    sections = tuple(s for item in chosen for s in item.split(",") if s)
    try:
        capacities = tuple(float(c) for c in args.capacity.split(",")) if args.capacity else ()
    except ValueError:
        raise ValueError(f"--capacity {args.capacity!r}: give fractions, e.g. 0.02,0.05,0.1,0.2") from None
    if any(not 0 < c <= 1 for c in capacities):
        raise ValueError(f"--capacity {args.capacity!r}: each fraction must be in (0, 1]")
    from kvtierd.policy import POLICIES
    policies = tuple(p for p in (args.policies or "").split(",") if p)
    if set(policies) - set(POLICIES):
        raise ValueError(f"--policies: no policy {', '.join(sorted(set(policies) - set(POLICIES)))}; "
                         f"known: {', '.join(POLICIES)}")
    result = run(sections, quick=args.quick, base=args.workdir, traces=tuple(args.trace), capacities=capacities,
                 policies=policies, job_keys=args.job_keys)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        with open(os.path.join(args.out, "bench.txt"), "w") as f:
            f.write(report.format_results(result) + "\n")
    return result

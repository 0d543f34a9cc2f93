"""The full benchmark run, and docs/benchmarks.md with its tables and plots, in one command.

    python bench/run_all.py --trace FILE ...    # full `kvtierctl bench` (minutes), then the docs
    python bench/run_all.py --from FILE         # the docs from a saved result, without running
    python bench/run_all.py --only attach       # rerun some sections into the saved result, then the docs
    python bench/run_all.py --only nodes --trace FILE --capacity 0.1   # ... with traces and capacities
    python bench/run_all.py --quick             # toy sizes: checks the pipeline in seconds

``--trace`` (repeatable) gives the policy section its Mooncake-format traces (``make bench-docs``
passes every file of ../shared/data/traces/); without one it replays a generated trace.
Writes docs/bench/results.json (the run), docs/img/bench-*.png (matplotlib) and
docs/benchmarks.md. The before/after table compares with docs/bench/baseline.json, the same
bench run on the code before the optimisations of issue 6 (see "Optimisations" in the page for
how it was made). Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kvtierbench  # noqa: E402
from kvtierbench.control import OPS  # noqa: E402
from kvtierbench.report import COLUMNS, cell  # noqa: E402

DOCS = os.path.join(ROOT, "docs")
RESULTS = os.path.join(DOCS, "bench", "results.json")
BASELINE = os.path.join(DOCS, "bench", "baseline.json")
IMG = os.path.join(DOCS, "img")
MiB = 1 << 20


# ----------------------------------------------------------------------------------------------- plots
def plots(result: dict) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt
    os.makedirs(IMG, exist_ok=True)
    made = []
    sections = result["sections"]

    control = sections.get("control", {}).get("rows", [])
    if control:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
        for ax, op in zip(axes, OPS):
            rows = sorted((r for r in control if r["op"] == op and r["clients"] == 1), key=lambda r: r["keys"])
            ks = [r["keys"] for r in rows]
            ax.plot(ks, [r["kvtierd_p50_us"] for r in rows], "o-", label="kvtierd p50")
            ax.plot(ks, [r["kvtierd_p99_us"] for r in rows], "o:", label="kvtierd p99")
            ax.plot(ks, [r["echo_p50_us"] for r in rows], "s-", label="echo p50")
            ax.set(xscale="log", yscale="log", xlabel="keys per job (B)", title=f"{op} job, 1 client")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("latency (µs)")
        axes[0].legend()
        fig.tight_layout()
        made.append(_save(fig, "bench-latency-vs-batch.png"))

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
        batch = max(r["keys"] for r in control)
        for ax, op in zip(axes, OPS):
            rows = sorted((r for r in control if r["op"] == op and r["keys"] == batch), key=lambda r: r["clients"])
            cs = [r["clients"] for r in rows]
            ax.plot(cs, [r["kvtierd_keys_per_s"] for r in rows], "o-", label="kvtierd")
            ax.plot(cs, [r["echo_keys_per_s"] for r in rows], "s-", label="echo (transport floor)")
            ax.set(xscale="log", yscale="log", xlabel="client processes", title=f"{op}, B={batch}")
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("keys/s")
        axes[0].legend()
        fig.tight_layout()
        made.append(_save(fig, "bench-throughput-vs-clients.png"))

    data = sections.get("data", {}).get("rows", [])
    if data:
        fig, ax = plt.subplots(figsize=(7, 4))
        for block in sorted({r["block_bytes"] for r in data}):
            rows = sorted((r for r in data if r["block_bytes"] == block), key=lambda r: r["blocks"])
            ks = [r["blocks"] for r in rows]
            line, = ax.plot(ks, [r["store_load_gbps"] for r in rows], "o-", label=f"kvtierd, {block // MiB} MiB blocks")
            ax.plot(ks, [r["memcpy_gbps"] for r in rows], "s--", color=line.get_color(),
                    label=f"memcpy, same bytes ({block // MiB} MiB)")
        ax.set(xscale="log", xlabel="blocks per job", ylabel="GB/s (store + load)",
               title="CPU data plane: store then load, against one-thread memcpy")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(_save(fig, "bench-gbps-vs-block.png"))

    replay = sections.get("policy", {}).get("rows", [])
    if replay:
        names = list(dict.fromkeys(r["trace"] for r in replay))
        fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2), squeeze=False)
        for ax, name in zip(axes[0], names):
            rows = [r for r in replay if r["trace"] == name]
            caps = sorted({r["capacity"] for r in rows})
            best = {r["capacity"]: r["belady"] for r in rows}
            ax.plot(caps, [best[c] for c in caps], "k--", marker="s", label="Belady (offline optimum)")
            for policy in dict.fromkeys(r["policy"] for r in rows):
                mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["capacity"])
                ax.plot([r["capacity"] for r in mine], [r["hit_rate"] for r in mine], "o-", label=policy)
            ax.set(xscale="log", xlabel="capacity (share of the trace's distinct blocks)", ylabel="prefix hit rate",
                   title=name)
            ax.set_xticks(caps, [f"{c:.0%}" for c in caps])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(_save(fig, "bench-policy-hit-rate.png"))
    plt.close("all")
    return made


def _save(fig, name: str) -> str:
    path = os.path.join(IMG, name)
    fig.savefig(path, dpi=110)
    return os.path.relpath(path, DOCS)


# ----------------------------------------------------------------------------------------------- markdown
def md_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(key), fmt) for _, key, fmt in columns) + " |" for r in rows]
    return "\n".join(lines)


def machine_text(result: dict) -> str:
    m = result["machine"]
    lines = [f"- CPU: {m.get('cpu', '?')}, {m['cpus']} CPUs (`nproc`); {m.get('lscpu') or _lscpu()}",
             f"- memory: {m.get('mem_total', 0) / (1 << 30):.1f} GiB (`free`), /dev/shm tmpfs",
             f"- kernel {m['kernel']}, Python {m['python']}",
             f"- load average during the run: {m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at "
             "the end (other sessions share this machine; the bench interleaves each kvtierd measurement with its "
             "floor so that both see the same load)"]
    return "\n".join(lines)


def _lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.machine()
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    keep = ("Thread(s) per core", "Core(s) per socket", "Hypervisor vendor", "L2 cache", "L3 cache")
    return ", ".join(f"{k.lower()}: {info[k].strip()}" for k in keep if k in info)


def targets_text(result: dict) -> str:
    rows = [t for s in result["sections"].values() for t in s.get("targets", [])]
    lines = ["| target | measured | goal | |", "|---|---:|---:|---|"]
    for t in rows:
        lines.append(f"| {t['name']} | {t['value']:,.3g} | {t['goal']} | {'met' if t['met'] else '**missed**'} |")
    return "\n".join(lines)


def section_text(name: str, section: dict) -> str:
    if "skipped" in section:
        return f"Skipped: {section['skipped']}."
    parts = []
    if "run" in section:            # rerun on its own (--only) into a saved full run
        m = section["run"]["machine"]
        parts.append(f"Measured in a run of its own (`bench/run_all.py --only {name}`, {section['run']['date']}) on "
                     f"{m.get('cpu', '?')}, {m['cpus']} CPUs, {m.get('lscpu', '')}: load average "
                     f"{m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end.")
    rows = section["rows"]
    if name == "control":
        for clients in sorted({r["clients"] for r in rows}):
            parts.append(f"**{clients} client process{'es' if clients > 1 else ''}**\n\n"
                         + md_table([r for r in rows if r["clients"] == clients], COLUMNS[name]))
    elif name == "policy":
        parts += policy_tables(section)
    else:
        parts.append(md_table(rows, COLUMNS[name]))
        for title, more in section.get("more", {}).items():
            if more:
                parts.append(f"**{title}**\n\n" + md_table(more, COLUMNS[f"{name} {title}"]))
    parts += [f"- {n}" for n in section["notes"]]
    return "\n\n".join(parts)


def policy_tables(section: dict) -> list[str]:
    """Per trace: capacity, Belady, then each policy's hit rate (x Belady, x LRU); then the cost."""
    rows = section["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    parts = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == trace]
        lines = [f"**{trace}** ({mine[0]['references']:,} block references): prefix hit rate (x Belady, x LRU)", "",
                 "| capacity | blocks | Belady | " + " | ".join(policies) + " |",
                 "|---:|---:|---:|" + "---:|" * len(policies)]
        for cap in sorted({r["capacity"] for r in mine}):
            at = {r["policy"]: r for r in mine if r["capacity"] == cap}
            first = next(iter(at.values()))
            cells = []
            for p in policies:
                r = at[p]
                cell = f"{r['hit_rate']:.3f} ({r['x_belady']:.2f}"
                cells.append(cell + (")" if p == "lru" else f", {r['x_lru']:.2f}x)"))
            lines.append(f"| {cap:.0%} | {first['blocks']:,} | {first['belady']:.3f} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    cost = section.get("more", {}).get("cost", [])
    if cost:
        lines = ["**Daemon CPU per key** (least over the slices; x LRU)", "",
                 "| op | B | " + " | ".join(policies) + " |", "|---|---:|" + "---:|" * len(policies)]
        for op, b in dict.fromkeys((r["op"], r["keys"]) for r in cost):
            at = {r["policy"]: r for r in cost if (r["op"], r["keys"]) == (op, b)}
            lines.append(f"| {op} | {b} | " + " | ".join(
                f"{at[p]['cpu_ns_per_key']:,.0f} ns ({at[p]['x_lru']:.2f}x)" for p in policies) + " |")
        parts.append("\n".join(lines))
    return parts


# The figures the optimisations moved: (label, section, row filter, value key, format).
COMPARED = [
    *[(f"{op} B={b}, 1 client: p50 / echo p50", "control", {"op": op, "keys": b, "clients": 1}, "p50_ratio", "{:.2f}")
      for op in OPS for b in (256, 1024)],
    *[(f"{op} B={b}, 1 client: p50 µs", "control", {"op": op, "keys": b, "clients": 1}, "kvtierd_p50_us", "{:,.0f}")
      for op in OPS for b in (256, 1024)],
    *[(f"{op} B=1024, 4 clients: keys/s", "control", {"op": op, "keys": 1024, "clients": 4}, "kvtierd_keys_per_s",
       "{:,.0f}") for op in OPS],
    ("eviction B=1024, region full: stores/s", "eviction", {"keys_per_job": 1024}, "full_stores_per_s", "{:,.0f}"),
    ("recovery: restart to ready, s", "recovery", {}, "restart_s", "{:.2f}"),
    ("recovery: Store(view) alone, s", "recovery", {}, "store_recovery_s", "{:.2f}"),
    ("recovery: scan alone, s", "recovery", {}, "scan_s", "{:.2f}"),
    *[(f"data {k} x 1 MiB: store+load / memcpy", "data", {"blocks": k, "block_bytes": MiB}, "ratio", "{:.2f}")
      for k in (64, 256, 1024)],
]


def comparison(before: dict, after: dict) -> str:
    def value(result: dict, section: str, match: dict, key: str):
        rows = result["sections"].get(section, {}).get("rows", [])
        return next((r[key] for r in rows if all(r.get(k) == v for k, v in match.items())), None)

    lines = ["| figure | before | after |", "|---|---:|---:|"]
    for label, section, match, key, fmt in COMPARED:
        b, a = value(before, section, match, key), value(after, section, match, key)
        if a is not None:
            lines.append(f"| {label} | {'-' if b is None else fmt.format(b)} | {fmt.format(a)} |")
    return "\n".join(lines)


def page(result: dict, images: list[str], before: dict | None) -> str:
    s = result["sections"]
    out = [HEADER, "## The machine", machine_text(result),
           f"The run took {result['seconds'] / 60:.1f} minutes ({'--quick' if result['quick'] else 'full plan'}).",
           "## Targets", targets_text(result), MISSES]
    titles = {"control": "Control plane", "data": "CPU data plane", "capacity": "Capacity and traffic",
              "eviction": "Eviction under pressure", "recovery": "Recovery",
              "restart": "Restart under running engines", "redis": "Peer: Redis",
              "attach": "Client attach and first touch (4 KiB vs 2 MiB pages)",
              "policy": "Eviction policy: hit rate against Belady, cost against LRU",
              "nodes": "Engines that span nodes",
              "tier": "Second tier: demote and promote against the engine's raw put/get (the disk: raw O_DIRECT), "
                      "the lookup-miss check, the disk tier's restart",
              "events": "KV events: the daemon's stream on against off, commit to subscriber, the log in isolation"}
    plots_for = {"control": ["bench-latency-vs-batch.png", "bench-throughput-vs-clients.png"],
                 "data": ["bench-gbps-vs-block.png"], "policy": ["bench-policy-hit-rate.png"]}
    for name in kvtierbench.SECTIONS:
        if name not in s:
            continue
        out.append(f"## {titles[name]}")
        out.append(INTROS[name])
        out.append(section_text(name, s[name]))
        for img in plots_for.get(name, []):
            rel = f"img/{img}"
            if rel in images:
                out.append(f"![{img}]({rel})")
    out.append(OPTIMISATIONS)
    if before is not None:
        out.append(comparison(before, result))
    out.append(GPU)
    return "\n\n".join(out) + "\n"


HEADER = """# Benchmarks

Generated by `make bench-docs` (`python bench/run_all.py`) from a full `kvtierctl bench` run; do not
edit by hand. Every figure is a ratio to a floor or a peer measured **in the same run on the same
machine**, so the ratios carry over to other machines better than the absolute numbers do.

```
kvtierctl bench                       # every section, full sizes (minutes); tables on stdout
kvtierctl bench --quick               # toy sizes, every section (CI: tests/integration/test_bench_smoke.py)
kvtierctl bench --only control,data   # some sections
kvtierctl bench --json --out DIR      # JSON on stdout; DIR/bench.json and DIR/bench.txt
kvtierctl bench policy --trace FILE   # the eviction policies on a request trace (Mooncake format)
make bench-docs                       # full run + this page and its plots (python bench/run_all.py)
```

The bench starts its own daemons (`--pin off`, no metrics endpoint) in a fresh directory under
/dev/shm and removes it at the end; the redis section starts and stops its own `redis-server`
on 127.0.0.1. `make bench-docs` gives the policy section the request traces of
../shared/data/traces. The docstrings of `kvtierbench/` (the package and one module per section) have the exact
method of each section."""

MISSES = """### Where a target is missed, and why

Every explanation below comes with the measurement that shows it; they hold for this machine
kind (2 vCPUs of a KVM guest), and the table above says which targets this particular run met.
A run while other sessions keep both CPUs busy (see the load average above) misses more of the
latency, throughput and restart targets than a quiet one: the run before issue 14's, at a load
average of 0.4-1.6, met the 4-client lookup throughput (4.7e6 keys/s) and the restart (1.45 s)
that this one, at 3-4, missed.

- **Lookup of 256 keys, p50 against the echo.** Missed narrowly in this page's run (1.32x: daemon
  113 µs, echo 86) and in the run before it (1.32x), met in four runs of `kvtierctl bench --only
  control` on the same code that day (1.24-1.30x) and in 0.3.4's page (1.26x). kvtierd 0.3.5's
  daemon is not slower here: a 0.3.4 daemon, a 0.3.5 daemon and one with glibc's default heap,
  interleaved in 16 rounds of 1,500 lookups, answered in 101-105 µs (p50) each. Since 0.3.0 the
  index is compiled (issue 22), since 0.3.1 a job's records are written in compiled passes, since
  0.3.2 every request but hello is decoded by one compiled pass, replies go out in two plain sends
  and the loop tends its timers once per 5 ms while requests stream in; 0.3.3 polls the client
  socket alone while requests stream in, and 0.3.4 keeps that poll waiting through the last
  millisecond of each 5 ms turn (rounded down, 14-20% of B=1 lookups took the loop's whole turn;
  now ~2%). The margin is thin and the figure moves with the machine's load: under load the gap
  grows (a B=1 lookup 49-52 µs against the echo's 45 when quiet, 78-94 against 66 under other
  benches), a few µs of CPU amplified by waiting for a core (each request passes through four
  threads on 2 shared vCPUs). What the daemon adds hot, in-process, receive to reply sent, is
  ~1.1-1.5 µs at B=1 and ~6 µs at B=256, mostly per key: the decoder's siphash (~9 ns a key) and
  distinctness check, a bytes object per key (~3 µs per 256 keys), then the table probe; at the
  socket the daemon's CPU per request (20.8 µs against the echo's 16.4, `perf stat -t`, fewer
  syscalls than the echo) is user-space Python at ~3x its hot figure (cache misses). A
  store+commit of 1,024 keys is spread over some fifteen compiled passes, each mostly cache
  misses over a large table.
- **CPU store+load against memcpy, small jobs.** The copy itself runs near memcpy speed (the CPU
  copier moves a block per `memmove` on a worker thread; timed alone it matches one-thread
  memcpy within noise, and a 1 GiB job's copy reaches 0.85-0.93x). What small jobs pay is four
  round trips per store+load (store, commit, load, release), each after the daemon sat idle
  through a copy: on this KVM guest a ping after a 5-20 ms idle gap costs 0.15-0.5 ms (it varies
  from run to run) instead of ~0.1 ms (the ping figures in the data section's note, measured in the
  same run), up to ~1.5 ms per store+load pair against ~7 ms of memcpy for 64 MiB. Jobs of 256 blocks and more amortise
  it. The round trips are the protocol's safety (a block is READY only after the writer's
  commit, invariant 1), so they stay.
- **Restart with a million entries.** Met since 0.3.2 (0.57 s in this page's run). 0.3.1 judged
  every READY record in one compiled walk; 0.3.2 judges the records against each other (shared
  pages, duplicate keys, oldest first) in a second one, allocates its columns in huge pages,
  reads the state column once and lets the policy's sketch learn a restart's keys in one pass: the
  daemon's own part went from ~0.46 to ~0.26 s of CPU (median thread time, in-process). Interpreter
  and imports are 0.2-0.4 s of what is left; with pinning (cuda, mlock) the pin's own populate of
  the region adds its time.
- **Ten times Redis.** Redis is credited with its faster pattern per direction (one SET/GET per
  block beats a single MSET/MGET of the whole job by up to 4x for MiB-sized values). At its best it
  moves ~2-3 GB/s over loopback (each block crosses the socket, and on load is copied again into
  the KV cache), while kvtierd is bounded by one memcpy per block (~15-20 GB/s here). The ceiling
  is therefore memcpy / Redis ≈ 6-8x on this machine before any per-job overhead. Against the
  MSET/MGET pattern alone (the "x MSET/MGET" column) the ratio is above 10x.
- **Hit rate against Belady (slru at 10 % and 5 % capacity).** Belady knows which blocks come back;
  on the conversation trace a block seen once comes back with probability 0.23, its first reuse
  comes after 451 requests or more half the time (16.6 new blocks arrive per request), and none of
  what the daemon sees — whether the request continued a cached prefix, how deep the block is,
  how large the job — sorts the blocks that will from those that will not in the same direction on
  both traces. Catching more first reuses needs more room than there is; 0.8x Belady at 10 % would
  need all later reuses plus more first reuses than LRU gets with the whole cache. slru is still
  at or above LRU in every cell (1.04-1.60x). docs/policy.md has the analysis and what was tried.
- **slru's CPU per key against LRU's.** Met since 0.3.0 (1.05x at worst, goal 1.1 in issue 22):
  the policies and their sketch are compiled, and the sketch's halving is applied a block at a
  time when first touched instead of in one pass (which paused a full region's loop ~30 ms).
- **Second tier, Mooncake, 64 KiB blocks.** Not explained yet: the cause of this miss has not
  been measured. What has been measured is its spread: over six full runs of `bench/run_all.py
  --only tier` on this machine, demote ranged 0.60-1.11x the raw put and promote 0.48-0.67x the
  raw get at 64 KiB (1 MiB blocks: 0.84-0.98x and 0.67-1.16x), while Redis Cluster, through the
  same companion and daemon paths, stays above 1x. Each demote or promote batch pays the
  daemon-companion hop and the companion's own batch call against the raw client's one call on
  one registered buffer; which of these costs the difference at small blocks is open. Since
  seals (issue 26 G), every value also moves a 32-byte seal as a second buffer (the multi-buffer
  API for every block), and the companion hashes every block: the before/after figures are in
  the second tier's section.
- **Disk tier, demote and promote.** In an in-process profile the tier's O_DIRECT writes and reads
  run at the raw floor's speed once its slots were written once (0.55-0.66 GB/s against
  0.58-0.68 for 1 MiB blocks); the rest is CPU: each block's seal (hashed by the I/O threads
  between their I/Os), the daemon's and the companion's per-batch work (the lookup, the existence
  check, the promote job, two fdatasyncs per demote), on two CPUs that also run the bench's rank.
  Over runs at load averages from 1 to 8.5, demote measured 0.73-1.07x and promote 0.58-1.00x the
  raw floor. A first pass over new slots is slower again on ext4 (docs/tier.md, Known limits).
  Since then blocks in consecutive slots move as one I/O of up to 1 MiB in `io_threads`
  sequential streams, and the seals are hashed and checked on the seal threads while blocks move
  (docs/tier.md, "Writes, crashes and reboots"). Measured only at load averages of 7 to 13.5
  (the machine shared with other sessions' suites and benches), which is not comparable with the
  load-1 figures above: the code before that change (03dce7f) and after it, alternating, `python
  -m kvtierbench.tier --engine disk` — before: demote 0.63, 0.63x and promote 0.35, 0.75x at
  64 KiB, 0.55, 0.58x and 0.50, 0.49x at 1 MiB; after: 0.60, 1.21x and 0.89, 1.16x at 64 KiB,
  0.80, 0.97x and 0.78, 0.62x at 1 MiB. After is ahead at 1 MiB in every pair, but runs of the same
  code differ by up to 2x at this load. A quiet run of 0.3.0 (load average 1.0 to 1.6,
  2026-12-05): demote 0.84x (64 KiB) and 0.72x (1 MiB), promote 0.63x and 0.54x against the bench's
  own buffer (a raw O_DIRECT read of 1 MiB blocks at 3.98 GB/s); the disk-only lookups (1.68x) and
  the restart with 1,000,000 blocks (1.03 s) within their targets (at load 7-13.5 they had measured 2.68x and 4.7-7.3 s: the load, not the code).
  Profiled again (issue 24): a promote of 256 x 1 MiB is the companion's get (the existence
  check's round trip is 2-3 ms, the reply to READY ~1 ms); in it, the reads in 4 streams with the
  seal checks beside them. Two things were not the tier's: (1) the floor read into a buffer of
  the bench's own, and an O_DIRECT read here runs at 0.8 or 2.8 GB/s by which memory it lands in
  (the same parts of a buffer every time: the VM's memory); consecutive promotes alternated
  between two halves of the region at ~110 and ~280 ms, and a floor read into the very pages the
  promote filled alternates the same way (92-134 against 156-271 ms), so the floor now reads into
  those pages; (2) a lookup of 256 keys being promoted cost the daemon 2.0-3.5 ms (enum lookups
  per key in the pending count), asked every 0.5 ms by the bench as an engine asks every step:
  now ~90 us. What remains is the seals: with the checks left out (an experiment, not a setting)
  promote measured 0.92x the same-pages floor, with them ~0.7x — keyed BLAKE3 runs 3.5 GiB/s on
  one core here (AVX2, no AVX-512): 75-115 ms of CPU per 256 MiB, on 2 CPUs shared with the
  daemon, the bench's rank and other sessions. In-process (no daemon, no rank) get and put run at
  the floor: 85-95 ms against a raw read of 81-94 ms, 256-275 against a raw write of 264-273 ms
  (slots written before). Alternating `python -m kvtierbench.tier --engine disk`, main (be72398)
  and this change, at load averages of 2.4-5.7 (2026-12-05) — before: demote 0.45, 0.56, 0.67x
  (64 KiB) and 0.64, 0.60, 0.65x (1 MiB), promote 0.36, 0.44, 0.52x and 0.38, 0.35, 0.32x; after:
  demote 0.82, 0.75, 0.84x and 0.77, 0.77, 0.77x, promote 0.68, 0.67, 0.56x and 0.49, 0.68, 0.51x
  (against the bench's own buffer as before: 0.99, 0.47, 0.75x and 1.14, 0.79, 0.30x). Still missed; meeting 0.8 on 2 shared CPUs needs a cheaper seal
  check (a MAC faster than BLAKE3 here is not in the environment, and a checksum that is not a MAC
  would give up what seals promise: docs/tier.md, "Seals"). This page's run (0.3.1, load ~1):
  demote 0.87x (64 KiB) and 0.86x (1 MiB), met; promote 0.72x and 0.85x against the same-pages
  floor (0.73x and 0.46x against the bench's own buffer): 64 KiB still missed. Since then the
  disk tier checks its blocks with a compiled checksum (XXH64) instead of the MAC, its directory
  being private to the daemon's user (docs/tier.md, "Seals"). Alternating `python -m
  kvtierbench.tier --engine disk`, main (4b57952, MAC) and this change, 12 runs each at load averages of 2.3-8.4 from other sessions (2026-12-05; medians, ranges): demote
  0.69x (0.54-0.88) against 0.86x (0.73-1.05) at 64 KiB and 0.76x (0.58-0.88) against 0.89x
  (0.72-0.98) at 1 MiB; promote 0.73x (0.42-1.74) against 0.78x (0.49-1.14) at 64 KiB and 0.67x
  (0.45-0.94) against 0.80x (0.62-1.01) at 1 MiB. In the 11 pairs that both finished, the checksum
  was ahead in 11 (demote, 64 KiB), 9 (promote, 64 KiB), 10 and 9 (1 MiB). The checksum itself:
  9.4 GB/s over 64 KiB blocks in 1 MiB runs on one core, against keyed BLAKE3's 3.1 GB/s. Promote
  at 64 KiB stays under 0.8x at this load (its 16 MiB move in ~10-30 ms, so the lookup's and
  promote job's fixed round trips weigh most there); a run on a quiet machine decides: with 0.3.2's
  cheaper request loop too, this page's run (load ~4.6) measured demote 0.92x and 0.89x, promote
  0.80x and 0.95x, all met, and three more runs of `python -m kvtierbench.tier --engine disk` at
  load 1.8-2: promote 0.87, 0.89, 0.80x at 64 KiB, demote 0.81, 0.91, 0.86x.
- **Second tier with seals.** Every block is hashed on demote and on promote: the cost is in the
  second tier's section ("What seals cost"). Mooncake's 64 KiB miss predates seals and grew
  with them; hashing one part of a batch while another part transfers did not bring it back
  (load 7-10; in this page's run, load ~1, Mooncake measured 0.33x demote and 0.36x promote at
  64 KiB, Redis 0.67x and 0.60x)."""

INTROS = {
    "control": """Jobs of B keys from C client processes (TP=1 rank sessions, one-page blocks), each side
interleaved in 5 slices with a ZMQ ROUTER **echo** server (its own process) that decodes the same
request frames and answers same-sized replies: the transport and msgpack floor, a daemon doing no
work. A store job is `store` + `commit`, a load job `load` + `release` (two round trips each; the
copies are the data plane's). With 2 CPUs, 4 and 16 client processes oversubscribe the machine
(the daemon waits for a core too): that is expected, and is why those rows are mostly a measure
of the scheduler.""",
    "data": """Store then load of K blocks through the client library with the CPU copier (block ids in
random order, as an engine's are), timed end to end (requests, copy, commit/release), against
one-thread `memcpy` of the same bytes into and back out of a prefaulted shared mapping.""",
    "capacity": """TP = N ranks attach to one region of a fixed budget and store more blocks than fit (so it ends
full). Replicated (MLA: one copy, rank 0 writes, all ranks load it) against sharded with the same
bytes per rank (every rank its own copy: what per-rank offloading does). D2H bytes are counted by
wrapping each rank's copier, i.e. the bytes actually copied into the region.""",
    "eviction": """A region of N one-page entries, filled; then every stored key evicts the least recently used
entry. Against the same store jobs into the same region while it still had room.""",
    "recovery": """The daemon holding N entries is stopped (SIGTERM) and started again: process start to the socket
answering a ping. `Store()` is the store's recovery alone (scan of the tables + index build),
timed in the bench process on the stopped daemon's region.""",
    "restart": """kvtierd restarted under 8 running engines, planned (SIGTERM, then a new daemon on the same
region, as `systemctl restart` and an upgrade do) and after a crash (SIGKILL). Each engine is a
process with a link thread and its coordinator session (the vLLM plugin's scheduler side, with
`kvtier_retry_s` 600 s, so only its watch of the socket path can bring it back in time) and a TP=1
rank session, which the engine calls once its link is up again. "Serving" is the moment the new
daemon's socket appears (it binds it only once it serves; a ping checks it); "links up" and "ranks attached" are
when the last engine's link was up again and its rank's first lookup answered (it re-attached on
the way), medians over the rounds; "worst" the worst of either in any round. Floor: a fresh
client attaching the moment the daemon serves.""",
    "redis": """A real `redis-server` (Debian package) on loopback, no persistence, driven by redis-py, stores and
loads the same blocks from the same KV-cache memory as kvtierd's client does.""",
    "attach": """What a client pays to start using the region. Attach + populate: `Client(...)` (hello, mapping the
region, and the background populate of the whole mapping on the client's 2 threads, waited for),
seconds per GiB of mapping. Cold vs warm: the same client stores, in turns, a job into pages it
never wrote (cold) and, after evicting its oldest entries, a job of the same size into pages it
wrote before (warm); "cold x warm" is the median over those pairs of the warm job's time over
the cold one's (1.0: the first touch costs nothing). With the populate (what a client does now)
and without it (`populate_threads=0`, what every client paid before: one page fault per page on
the copy's path). 4 KiB pages: a region created with `hugepages=off`; 2 MiB pages:
`hugepages=on`, on a tmpfs the bench mounts itself (`huge=always`) when its directory gives none
and it runs as root.""",
    "tier": """Two daemons ("nodes") share one real engine on loopback, each through its tier companion
(docs/tier.md): node A's region holds exactly 2N blocks with `tier_low_watermark` 0.5, so once a
store takes its last free pages it demotes its N blocks X in one put (timed by the daemon: the
put's round trip; the store is committed only after A took them, so that X are its only READY
blocks, and the engine is then asked whether it holds all of X); node B is then asked for them
and promotes them (timed from the first lookup, which reports them pending, to the lookup that
finds them all READY: existence check, allocation, get into the region), and loads them, every
block checked. Against the engine's own client moving the same N blocks of S from one registered
buffer in the bench process (Mooncake `batch_put_from`/`batch_get_into`; Redis Cluster through
redis-py's pipeline), the two taking turns at going first. The lookup table: a lookup of K keys
the tier does not hold on a third node (the daemon replies at once, pending K, and sends the
existence check after the reply) against a lookup of the same keys once they are stored there;
"tier answered" is when a lookup no longer reports them pending. Both nodes seal every block with
one key and check every promoted block's seal (docs/tier.md, "Seals").

**The disk backend** (`kvtierbench/disktier.py`; the directory under `$KVTIERBENCH_DISK_DIR`, else
the temporary directory: the note says which filesystem): one node (a disk tier is one node's)
demotes its N blocks X as node A above and promotes them back (the store's blocks evicted locally
first, so nothing else is written meanwhile), against the same N blocks of S written with O_DIRECT
into a preallocated file in the same directory and one fdatasync, then read back, as one stream
and as `io_threads` (4) streams, the faster of the two per direction — from and into the very
pages of the region the promote just filled (X pinned by a load job; the read lands the bytes the
write took, checked). On this VM an O_DIRECT read's speed depends on which memory it lands in
(0.8 GB/s into one part of a 1 GiB buffer, 2.8 into another, the same parts every time; writes
do not vary), so a floor read into other memory than the region's measured that memory: the
floor in one page-aligned buffer of the bench's own is kept as `raw_anon_*` in the JSON, taking
turns with the node at going first. "disk lookup": the first lookup of X while it is held only on disk (pending N)
against a lookup of the same keys READY, and one key at a time (p50 over the N keys). "disk
restart": a directory holding 1,000,000 blocks (64-byte blocks, a 4 KiB slot each; the slots a
sparse file, the records written as the tier writes them and dropped from the page cache), a fresh
daemon on it: from its launch to serving from its region, to the companion ready (the index
loaded), and to the first of those blocks READY on a lookup.

**What seals cost** (issue 26 G): the same bench for Mooncake and Redis on the code before seals
(486885d) and after (this section's code), alternating, two full runs each (`python -m
kvtierbench.tier --engine mooncake --engine redis`), on this 2-CPU machine at a load average of
about 1; demote and promote as multiples of the raw put and get, each run's figure:

| engine | block | demote before | demote after | promote before | promote after |
|---|---:|---:|---:|---:|---:|
| mooncake | 64 KiB | 0.81, 0.74 | 0.41, 0.50 | 0.54, 0.69 | 0.25, 0.34 |
| mooncake | 1 MiB | 0.99, 0.90 | 0.65, 0.63 | 0.89, 0.85 | 0.58, 0.63 |
| redis | 64 KiB | 1.03, 1.24 | 0.59, 0.66 | 0.77, 0.87 | 0.56, 0.48 |
| redis | 1 MiB | 1.82, 1.32 | 1.01, 1.12 | 1.94, 1.86 | 1.35, 1.31 |

Every block is hashed once on demote and once on promote (keyed BLAKE3, 1.5-2.6 GiB/s on one
thread here, on a pool of as many threads as CPUs), on the companion's CPU, which the loopback
engine's own transfers share on this machine (with TCP on loopback a transfer is CPU work too):
256 MiB of 1 MiB blocks take about 65-130 ms to hash on two CPUs against 135 ms for Mooncake's
raw get of them. Mooncake also moves every block as two buffers (the block and its seal) where
one contiguous block was one.

Since then a batch moves in up to 4 *pipeline parts* of at least 4 MiB (`seal.pipeline`): a put
hashes the next part's seals while a part transfers, a get checks the last part's seals while the
next part transfers (the seal threads hash tasks of about 1 MiB of blocks: one task per 64 KiB
block cost more than it saved). Measured with `bench/run_all.py --only tier`, twice, at load
averages of 7.2 to 10.1 (other sessions' test suites and benches on this 2-CPU machine; `uptime`
before and after each run: 7.23 → 9.61, 8.08 → 9.37), so not comparable with the load-1 "after"
column above, each run's figure:

| engine | block | demote | promote |
|---|---|---:|---:|
| mooncake | 64 KiB | 0.30, 0.58 | 0.23, 0.49 |
| mooncake | 1 MiB | 0.54, 0.56 | 0.48, 0.46 |
| redis | 64 KiB | 1.35, 1.10 | 0.56, 1.02 |
| redis | 1 MiB | 1.37, 0.89 | 1.85, 1.43 |

Redis is at or above the load-1 "after" figures in every cell but one even at this load, and at
or above 0.8x in all but one (promote at 64 KiB in the first run); Mooncake is not, and its
misses stand. With TCP on loopback both engines' transfers are CPU work on the same two CPUs as
the hashing, so the overlap has little idle time to hide in here; with RDMA it would have more.""",
    "events": """Through real daemons (`kvtierbench/eventsd.py`): store jobs of B = 256 and 1,024 fresh
keys (store + commit from one rank session; the region full, so every store also evicts B) on two
daemons publishing their KV events streams (`kv_events_endpoint`) to a subscriber process, against
two daemons without it, the four warmed up (2.5 s of stores each, untimed) and then taking turns
in slices of 1.5 s (four rounds, each daemon first in one; the median slice of each side), in
three sets of fresh daemons (the ratio: the median of the three sets'); the time from
a commit's return to the subscriber holding the batch that names the job's last key (jobs of 256
every 5 ms); 200,000 blocks/s offered in jobs of 1,024 to the publishing daemon (its event log
8 MiB, full within the first third), its anonymous memory (RssAnon: the region is a shared
mapping) a third of the way in and at the end. The
subscriber shares the machine's CPUs with the daemons: through the throughput slices it reads
every batch off its socket without decoding it (as a router's socket read; what a router does
with the events is its own cost), and from the latency run on it decodes each batch's last event
and skips the others undecoded. In isolation (`kvtierbench/events.py`: the event log and the publisher in the bench
process, one subscriber process): CPU per key of appending a store job's keys to the log and of
publishing them, against msgpack packing the same events (their hashes converted in Python);
append to subscriber with a flush after each append; 200,000 blocks/s with this process's memory.
Each throughput slice also measures the daemon's CPU a job (all its threads): what the stream costs
a daemon with no idle time, which keys/s in a one-client ping-pong does not say. Since 0.3.8 the
stream's work runs after the replies (the keys are read then, from copies: docs/events.md, Cost),
and keys/s on / off can exceed 1: a daemon that works on after its reply takes the next request
without sleeping first, where an idle one pays a wake-up (a daemon without the stream, made to
spin 30 µs after every reply, stored 1.08x the keys/s of one that did not).""",
    "policy": """`kvtierctl bench policy --trace FILE`: each Mooncake-format trace replayed, per policy and
capacity, through a fresh daemon (`--policy NAME`, `PYTHONHASHSEED` fixed) whose region holds
exactly that many one-page blocks: per request a lookup, a load of the hit prefix, a store of the
rest (`cold_tail` 1 when the prompt's last block is partial). Capacity is a share of the trace's
distinct blocks; Belady is the offline optimum of prefix hits at that capacity, computed from the
same file. Then each policy's daemon, with a full region, under lookups, loads and stores of B
keys, the policies taking turns: the daemon's CPU per key against LRU's. docs/policy.md has the
method, the held-out variations and why `slru` is the default.""",
    "nodes": """`kvtierctl bench --only nodes --trace FILE --capacity F`: an MLA engine whose TP group spans two
nodes (TP=16: its coordinator and ranks 0-7 on node A's kvtierd, ranks 8-15 on node B's, each
session naming its node's ranks) against a TP=8 engine on one node, each Mooncake-format trace
replayed as the vLLM plugin plays it (docs/vllm.md, "Several nodes"): the coordinator looks up
and leases on node A, every node's ranks load the hit prefix from their own kvtierd (node A's
under the lease), the engine keeps the prefix every rank loaded and computes the rest, then
stores what follows node A's hits on both nodes (each node's lowest rank writes, the others
vote). Each daemon's region holds the given share of the trace's distinct blocks (one page per
block). "Pressure on B": another engine on node B only stores that many fresh blocks per block of
each request, so node B evicts what node A keeps; "A's hits missing on B": the share of node A's
hits that node B's ranks could not load (recomputed). The goal: the two-node hit rate equals the
one-node rate when nothing evicts on one node only.""",
}

OPTIMISATIONS = """## Optimisations (issue 6)

Each was found with py-spy (sampling the live daemon), cProfile/line_profiler of `Server.handle` and
`Store(view)` in-process, and checked against the unit and integration suites.

1. **Key validation** (`protocol._check_keys`): a per-key Python loop became C-level passes
   (`b"".join` as the bytes check, one `set(map(len, …))`, `set()` for duplicates); the loop
   only runs on a failing list, to name the first bad key as before.
2. **READY prefix** (`Store._ready_prefix`, lookup and load): one `map(index.get)` and the states
   as one byte string; the prefix length is `len - len(lstrip(READY))`.
3. **Touch** (`LRUPolicy.touch_many`, `Store._touch`): `deque(map(OrderedDict.move_to_end, …))`
   instead of a Python call per key; ticks written with one NumPy scatter.
4. **Store decision** (`Store._decide_store`, `_make_room`, `_new_entries`): the room a job needs is
   made in one pass over LRU candidates, its pages allocated at once, and its entry records built
   in one structured array and written through a byte view of the table (NumPy scatters whole
   structured records ~100x slower than the same bytes). Same outcomes and victims as before.
5. **Votes, evictions, pins** (`Store._vote`, `_free_entries`, `_unpin`): table columns written
   with one scatter per job; `LRUPolicy.add_many`/`remove_many`.
6. **Page order through reuse** (`PageAllocator.free`): freed pages were pushed so that the LIFO
   stack handed a block's run back reversed, and every other job after an eviction copied a 1 MiB
   block as 16 separate 64 KiB pieces; they now come back in order (one `memmove` per block).
7. **Recovery scan** (`recovery.scan`): the per-entry Python judgement became NumPy over all records;
   only records that share a page or a key fingerprint with another are judged one by one (in
   the old order, so results are identical). `Store` builds its objects with `map`/`zip`, and
   turns the cyclic GC off while it does (its passes over the growing heap were ~40% of it).

Before/after, the same bench on the same machine (before: the code at commit 37f250e with this
bench added; `docs/bench/baseline.json`):"""

GPU = """## GPU figures

The GPU benchmarks live in `bench/gpu_bench.py` (issue 4): store (D2H) and load (H2D) bandwidth
of the device copiers (the CUDA kernel of csrc/ and the torch fallback) against one
contiguous `cudaMemcpyAsync` of the same bytes into the same pinned region (the link's ceiling),
for DeepSeek-V3 MLA and a Llama-70B-like GQA shard; and cudaHostRegister of a client's mapping per
GiB with 4 KiB vs 2 MiB pages, unpopulated and populated first (issue 15). They were **not run**
for this page: no GPU device was lent to this task, so there are no GPU figures here. `make
gpu-check OUT=dir` runs them with the GPU tests in one command ([cuda.md](cuda.md), "The GPU
check"); its `gpu_bench/gpu_bench.md` is the table that belongs here."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", metavar="FILE", help="make the docs from this bench.json")
    ap.add_argument("--quick", action="store_true", help="toy sizes (checks the pipeline)")
    ap.add_argument("--only", metavar="SECTIONS",
                    help="run only these sections (comma-separated) and put them into the saved docs/bench/results.json")
    ap.add_argument("--trace", action="append", default=[], metavar="FILE",
                    help="a Mooncake-format trace for the policy and nodes sections (repeatable)")
    ap.add_argument("--capacity", metavar="F,F,...",
                    help="policy, nodes: region sizes as fractions of the trace's distinct blocks (kvtierctl bench)")
    args = ap.parse_args()
    capacities = tuple(map(float, args.capacity.split(","))) if args.capacity else ()
    if args.source:
        with open(args.source) as f:
            result = json.load(f)
    elif args.only:
        with open(RESULTS) as f:
            result = json.load(f)
        fresh = kvtierbench.run(tuple(args.only.split(",")), quick=args.quick, traces=tuple(args.trace),
                                capacities=capacities)
        fresh["machine"]["lscpu"] = _lscpu()
        for name, section in fresh["sections"].items():
            section["run"] = {"machine": fresh["machine"], "date": time.strftime("%Y-%m-%d")}
            result["sections"][name] = section
        with open(RESULTS, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    else:
        result = kvtierbench.run(quick=args.quick, traces=tuple(args.trace), capacities=capacities)
        result["machine"]["lscpu"] = _lscpu()       # the run's machine, whenever the page is made
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    before = None
    if os.path.exists(BASELINE):
        with open(BASELINE) as f:
            before = json.load(f)
    images = plots(result)
    with open(os.path.join(DOCS, "benchmarks.md"), "w") as f:
        f.write(page(result, images, before))
    print(kvtierbench.report.format_results(result))
    print(f"\nwrote docs/benchmarks.md and {', '.join(images)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

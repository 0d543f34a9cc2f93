"""``attach``: what a client pays to start using the region, with 4 KiB and with 2 MiB pages.

For each page backing, a daemon serves a region of ``reps`` store jobs of K blocks of S bytes,
and this process (one TP=1 rank, CPU copier):

- attaches ``reps`` times (hello, mapping, and the background populate of the whole mapping
  on the client's 2 threads, waited for): seconds per GiB of mapping, median;
- then, as one client, stores in turns a job into pages it never wrote (cold: fresh pages of the
  region) and, after evicting its K oldest entries (admin ``evict``; the allocator hands the
  freed pages out first), a job of the same size into pages it wrote before (warm): median job
  time each, store request to commit, as an engine sees them, and the median over the pairs of
  warm time / cold time. Once with the client's background populate
  (waited for before the first job, as an engine's model load outlasts it) and once without it
  (``populate_threads=0``: what a client paid before it populated, one fault per page on the
  copy's path).

Backings: 4 KiB pages are a region created with ``hugepages=off`` in the bench's directory;
2 MiB pages a region created with ``hugepages=on``, in the bench's directory when its
filesystem gives huge pages, else on a tmpfs the bench mounts itself (``huge=always``) when it
runs as root, and unmounts at the end (a note says so). When neither works the 2 MiB rows are
left out and a note says why. Each row records the pages the daemon's mapping got and the huge
bytes of the client's own mapping (/proc/self/smaps), so a row never claims pages it did not get.

Targets: a cold store >= 0.8x as fast as a warm one (with the populate, worst backing); with
2 MiB pages, attach + populate per GiB <= 0.25x the 4 KiB figure.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from contextlib import ExitStack

import numpy as np

from kvtierd import hugepages

from .harness import (DATA_PAGE, Context, MiB, bench_daemon, bench_namespace, huge_tmpfs, make_keys, ratio, region_size,
                      say, target)

POPULATE_THREADS = 2          # the client's default


def _client(daemon, block: int, populate_threads: int):
    from kvtier import Client
    return Client(daemon.socket, engine_id="bench-attach", rank=0, world_size=1,
                  namespace=bench_namespace("attach", block), copier="cpu", pin="off", timeout=120,
                  populate_threads=populate_threads)


def attach_seconds(daemon, block: int, reps: int) -> tuple[float, int, int]:
    """Median seconds of attach + populate, the mapping's bytes, and the huge bytes it got."""
    times, huge, size = [], 0, 0
    for _ in range(reps):
        t0 = time.perf_counter()
        client = _client(daemon, block, POPULATE_THREADS)
        try:
            client.populating.wait()
            times.append(time.perf_counter() - t0)
            size = client.mapping.size
            huge = hugepages.backing(client.mapping.address).huge_bytes
        finally:
            client.close()
    return statistics.median(times), size, huge


def cold_warm(daemon, plan, populate_threads: int) -> tuple[float, float, float]:
    """Median seconds of a cold and of a warm store job (K blocks of S bytes), and the median of
    warm / cold over the pairs. Taken in turns, so that both see the same machine: a job into
    fresh pages (cold), then the K least recently used entries evicted (all written by this
    client) and a job into the pages they freed, which the allocator hands out first (warm). The
    region holds exactly the ``reps`` cold jobs."""
    import torch
    k, block = plan.attach_blocks, plan.attach_block
    kv = torch.empty((k, block), dtype=torch.uint8)
    kv.numpy()[:] = 0x5A                             # fault the KV cache in: only the region is cold
    daemon.call("clear", admin=True)
    client = _client(daemon, block, populate_threads)
    jobs = iter(range(1, 1 << 62))

    def store(seed: int) -> float:
        job = next(jobs)
        t0 = time.perf_counter()
        decision = client.store(job, make_keys(seed, k), np.arange(k))
        (result,) = client.wait([job])
        seconds = time.perf_counter() - t0
        if not result.ok or decision.written != k:
            raise RuntimeError(f"bench store job failed: {result}, {decision.written} of {k} written")
        return seconds

    cold, warm = [], []
    try:
        client.register_kv_caches([kv])
        if client.populating is not None:
            client.populating.wait()
        for i in range(plan.attach_reps):
            free = daemon.stats()["pages_free"]
            cold.append(store(1000 + i))
            if daemon.stats()["pages_free"] != free - k * client.pages_per_shard:
                raise RuntimeError("bench attach: a cold job did not take fresh pages")
            daemon.call("evict", admin=True, count=k)
            warm.append(store(2000 + i))
    finally:
        client.close()
    return statistics.median(cold), statistics.median(warm), statistics.median(w / c for w, c in zip(warm, cold))


def backings(ctx: Context, region: int, stack: ExitStack, notes: list[str]) -> list[tuple[str, str, str]]:
    """(label, directory, hugepages setting) of each backing this machine offers."""
    out = []
    found = hugepages.offer(ctx.workdir)
    if found.kind != "hugetlb":
        out.append(("4 KiB", ctx.path("attach-4k"), "off"))
    else:
        notes.append(f"4 KiB rows left out: {ctx.workdir} is on hugetlbfs")
    if found.kind != "none":
        out.append((f"{found.page_size // MiB} MiB", ctx.path("attach-huge"), "on"))
        return out
    mount_point = ctx.path("huge-tmpfs")
    try:
        stack.enter_context(huge_tmpfs(mount_point, region + 64 * MiB))
    except OSError as exc:
        notes.append(f"2 MiB rows left out: {found.why_not()} (the bench mounts a huge tmpfs itself only as root: "
                     f"{exc})")
        return out
    notes.append(f"2 MiB rows: the bench mounted a tmpfs with huge=always at {mount_point} (its directory does not "
                 f"give huge pages: {found.fs_type} huge={found.huge}) and unmounted it at the end")
    out.append(("2 MiB", os.path.join(mount_point, "attach-2m"), "on"))
    return out


def run(ctx: Context) -> dict:
    plan = ctx.plan
    job_bytes = plan.attach_blocks * plan.attach_block
    pages = plan.attach_reps * job_bytes // DATA_PAGE
    region = region_size(pages, DATA_PAGE)
    rows, notes = [], []
    with ExitStack() as stack:
        for label, directory, setting in backings(ctx, region, stack, notes):
            # With huge pages the daemon takes --size in whole huge pages, rounded down
            # (hugepages.size_for): rounded up here, the region holds the reps' jobs (and < 2 MiB more).
            size = region if setting == "off" else -(-region // (2 * MiB)) * (2 * MiB)
            daemon = bench_daemon(directory, size, DATA_PAGE, "--hugepages", setting)
            try:
                start_s = daemon.start()
                stats = daemon.stats()
                attach_s, mapped, client_huge = attach_seconds(daemon, plan.attach_block, plan.attach_reps)
                for populate in (POPULATE_THREADS, 0):
                    cold, warm, warm_vs_cold = cold_warm(daemon, plan, populate)
                    row = {"pages": label, "populate": "background" if populate else "none",
                           "daemon_hugepages": stats["hugepages"], "daemon_huge_bytes": stats["huge_bytes"],
                           "client_huge_bytes": client_huge, "region_bytes": mapped, "daemon_start_s": start_s,
                           "attach_populate_s_per_gib": attach_s * (1 << 30) / mapped if populate else None,
                           "job_bytes": job_bytes, "cold_ms": cold * 1e3, "warm_ms": warm * 1e3,
                           "cold_vs_warm": warm_vs_cold}
                    rows.append(row)
                    say(f"attach: {label:>6} populate {row['populate']:>10}: daemon {stats['hugepages']} "
                        f"({stats['huge_bytes'] // MiB} MiB huge), client {client_huge // MiB} MiB huge, "
                        + (f"attach+populate {row['attach_populate_s_per_gib']:.4f} s/GiB, " if populate else "")
                        + f"cold {row['cold_ms']:.2f} ms, warm {row['warm_ms']:.2f} ms, x{row['cold_vs_warm']:.2f}")
            finally:
                daemon.stop()
                shutil.rmtree(daemon.dir, ignore_errors=True)
    populated = [r for r in rows if r["populate"] == "background"]
    ratios = {f"cold_vs_warm_{r['pages'].replace(' ', '')}_{r['populate']}": r["cold_vs_warm"] for r in rows}
    targets = []
    if populated:
        targets.append(target("cold store vs warm store, with the client's populate (worst backing)",
                              min(r["cold_vs_warm"] for r in populated), 0.8, "higher"))
    by_pages = {r["pages"]: r["attach_populate_s_per_gib"] for r in populated}
    if "4 KiB" in by_pages and len(by_pages) > 1:
        huge = next(label for label in by_pages if label != "4 KiB")
        key = f"attach_populate_{huge.replace(' ', '')}_vs_4KiB"
        ratios[key] = ratio(by_pages[huge], by_pages["4 KiB"])
        targets.append(target(f"attach + populate per GiB, {huge} pages vs 4 KiB", ratios[key], 0.25, "lower"))
    notes.append(f"{plan.attach_reps} cold and {plan.attach_reps} warm store jobs of {plan.attach_blocks} x "
                 f"{plan.attach_block // MiB} MiB per row (medians), region of {region / MiB:.0f} MiB in "
                 f"{DATA_PAGE >> 10} KiB kvtierd pages; cold x warm = the median over the (cold, warm) pairs of the warm "
                 "job's time / the cold job's (jobs taken in turns, so a pair sees the same load); the client "
                 f"populates on {POPULATE_THREADS} threads")
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes}

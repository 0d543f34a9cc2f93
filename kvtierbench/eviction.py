"""``eviction``: stores/s into a full region of N one-page entries (every stored key evicts one),
against stores/s into the same region while it still has room; the latency of each job (p99 and
the longest: a pause of the daemon's loop shows there), the daemon's garbage collections during
the full phase (its ``gc`` stats, when it reports them), and its memory per entry (the growth of
its resident memory while it stored the N entries, over N)."""

from __future__ import annotations

import gc
import time

import numpy as np

from .harness import CONTROL_PAGE, Context, KeyStream, RankChannel, big_region, fill, pct, say, target

def timed_stores(rank: RankChannel, batch: int, seed: int, duration: float,
                 max_keys: int | None = None) -> tuple[int, float, np.ndarray]:
    """Store fresh keys in jobs of ``batch`` for about ``duration`` seconds (or until ``max_keys``
    were stored): (keys, seconds, latency of each job)."""
    stream = KeyStream(seed, batch)
    lat = []
    # The bench's own collector stays off while it times: its pauses are not the daemon's (a
    # full pass over the bench process's objects took 10-30 ms here).
    collecting = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration and (max_keys is None or (len(lat) + 1) * batch <= max_keys):
            keys = stream.next()
            t1 = time.perf_counter()
            rank.store(keys)
            lat.append(time.perf_counter() - t1)
    finally:
        if collecting:
            gc.enable()
    return len(lat) * batch, time.perf_counter() - t0, np.asarray(lat)


def run(ctx: Context) -> dict:
    plan = ctx.plan
    n = plan.entries
    duration = max(0.2, 10 * plan.duration)
    daemon = big_region(ctx)
    rank = RankChannel(daemon, "bench-evict")
    rows = []
    try:
        for batch in plan.eviction_batches:
            daemon.call("clear", admin=True)
            # Room: the first keys go into an empty region (no eviction). Stay under half of it.
            s0 = daemon.stats()
            room_keys, room_s, room_lat = timed_stores(rank, batch, 10 + batch, duration, max_keys=n // 2)
            s1 = daemon.stats()
            if s1["evictions"] != s0["evictions"]:
                raise RuntimeError("eviction bench: the 'room' phase evicted; the region is too small")
            fill(rank, s1["pages_free"], 20 + batch, 8192)
            s2 = daemon.stats()
            full_keys, full_s, lat = timed_stores(rank, batch, 30 + batch, duration)
            s3 = daemon.stats()
            evicted = s3["evictions"] - s2["evictions"]
            row = {"keys_per_job": batch, "entries": s3["entries_ready"], "room_stores_per_s": room_keys / room_s,
                   "full_stores_per_s": full_keys / full_s, "evictions_per_store": evicted / full_keys,
                   "job_p50_us": pct(lat, 50) * 1e6, "job_p99_us": pct(lat, 99) * 1e6, "job_max_us": lat.max() * 1e6,
                   "room_job_p99_us": pct(room_lat, 99) * 1e6, **_gc_during(s2, s3),
                   "daemon_max_us": _longest_handled(s2, s3, ("store", "commit")) * 1e6}
            row["ratio"] = row["full_stores_per_s"] / row["room_stores_per_s"]
            row["p99_vs_room"] = row["job_p99_us"] / row["room_job_p99_us"]
            rows.append(row)
            say(f"eviction: B={batch:<5} {row['full_stores_per_s']:12,.0f} stores/s with every store evicting "
                f"({row['entries']:,} entries), {row['room_stores_per_s']:12,.0f} with room (x{row['ratio']:.2f})")
    finally:
        rank.close()
    # Leave the region full of N entries for recovery.
    fill_rank = RankChannel(daemon, "bench-refill")
    try:
        fill(fill_rank, daemon.stats()["pages_free"], 99, 8192)
    finally:
        fill_rank.close()
    ratios = {f"B{r['keys_per_job']}_full_vs_room": r["ratio"] for r in rows}
    targets = []
    for r in rows:
        if r["keys_per_job"] == max(plan.eviction_batches):
            targets += [target(f"eviction: longest store job of {r['keys_per_job']} keys, full region of {n:,} (ms)",
                               r["job_max_us"] / 1e3, 20, "lower"),
                        target(f"eviction: store job p99 full vs with room (B={r['keys_per_job']})", r["p99_vs_room"],
                               2, "lower")]
    more = {}
    per_entry = _memory_per_entry(ctx.big_memory)
    if per_entry:
        more["memory"] = [per_entry]
        targets.append(target(f"daemon memory per entry, storing {per_entry['entries']:,} one-page entries (bytes)",
                              per_entry["rss_per_entry"], MEMORY_GOAL, "lower"))
    return {"rows": rows, "more": more, "ratios": ratios, "targets": targets, "notes": [
        f"{n:,} one-page ({CONTROL_PAGE >> 10} KiB) entries; a store job is the store request and the commit, "
        "without copies; every stored key of the 'full' phase evicts one entry",
        "daemon max: the slowest of the daemon's own store and commit handling in the full phase, as the upper "
        "bound of its latency bucket (the job max adds the sockets and two processes' scheduling on the cores)",
        "gc: the daemon's collections of each generation during the full phase and the longest pause among them "
        "(its gc stats); memory: the growth of the daemon's resident memory (VmRSS, and RssAnon: its heap) while "
        "it stored the region's entries, over the entries"]}


# Half of the 390 bytes per entry the Entry-object index took (issue 22), measured the same way.
MEMORY_GOAL = 195


def _longest_handled(before: dict, after: dict, ops: tuple[str, ...]) -> float:
    """The upper bound of the slowest latency bucket that the daemon's handling of ``ops`` reached
    between two stats (its own ``latency`` histograms: decoding to reply, without the sockets and
    the scheduling of two processes on the machine's cores), in seconds."""
    slowest = 0.0
    for op in ops:
        was, now = before["latency"].get(op, {}), after["latency"].get(op, {})
        new = now.get("count", 0) - was.get("count", 0)
        old = dict(map(tuple, was.get("buckets", [])))
        # cumulative counts: the first bound under which every new observation falls
        covering = [bound for bound, count in now.get("buckets", []) if new and count - old.get(bound, 0) == new]
        slowest = max([slowest, *covering[:1]])
    return slowest


def _gc_during(before: dict, after: dict) -> dict:
    """The daemon's collections per generation between two stats, and the longest pause (what a
    job could have waited); nothing when the daemon does not report its collector."""
    if "gc" not in before or "gc" not in after:
        return {}
    done = [b - a for a, b in zip(before["gc"]["collections"], after["gc"]["collections"])]
    return {"gc_collections": done, "gc_full_collections": done[-1],
            "gc_pause_max_us": max(after["gc"]["pause_seconds_max"]) * 1e6 if any(done) else 0.0}


def _memory_per_entry(mem: dict | None) -> dict | None:
    if not mem or not mem["entries"]:
        return None
    n, before, after = mem["entries"], mem["before"], mem["after"]
    return {"entries": n, "rss_growth": after["VmRSS"] - before["VmRSS"],
            "rss_per_entry": (after["VmRSS"] - before["VmRSS"]) / n,
            "anon_per_entry": (after["RssAnon"] - before["RssAnon"]) / n}

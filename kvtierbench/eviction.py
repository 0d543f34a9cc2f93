"""``eviction``: stores/s into a full region of N one-page entries (every stored key evicts one),
against stores/s into the same region while it still has room."""

from __future__ import annotations

import time

import numpy as np

from .harness import CONTROL_PAGE, Context, KeyStream, RankChannel, big_region, fill, pct, say

def timed_stores(rank: RankChannel, batch: int, seed: int, duration: float,
                 max_keys: int | None = None) -> tuple[int, float, np.ndarray]:
    """Store fresh keys in jobs of ``batch`` for about ``duration`` seconds (or until ``max_keys``
    were stored): (keys, seconds, latency of each job)."""
    stream = KeyStream(seed, batch)
    lat = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration and (max_keys is None or (len(lat) + 1) * batch <= max_keys):
        keys = stream.next()
        t1 = time.perf_counter()
        rank.store(keys)
        lat.append(time.perf_counter() - t1)
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
            room_keys, room_s, _ = timed_stores(rank, batch, 10 + batch, duration, max_keys=n // 2)
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
                   "job_p50_us": pct(lat, 50) * 1e6, "job_p99_us": pct(lat, 99) * 1e6, "job_max_us": lat.max() * 1e6}
            row["ratio"] = row["full_stores_per_s"] / row["room_stores_per_s"]
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
    return {"rows": rows, "ratios": ratios, "targets": [], "notes": [
        f"{n:,} one-page ({CONTROL_PAGE >> 10} KiB) entries; a store job is the store request and the commit, "
        "without copies; every stored key of the 'full' phase evicts one entry",
        "job max: a full pass of Python's cyclic garbage collector in the daemon walks every live entry (~0.1-0.25 s "
        "per million); it runs after every ~25% growth of the long-lived heap, so it shows in the maximum, not in "
        "p99"]}

"""What the tier benches (``kvtierbench.tier``, ``kvtierbench.disktier``) do with a node: demote N
blocks X through it, timed by the daemon itself, and wait on its tier counters.

``demote_x``: node A's region holds exactly 2N blocks with ``tier_low_watermark`` 0.5; it holds N
blocks X; a store of N more takes its last free pages, so the daemon demotes its N first victims
at once, in one put. The store is committed only once A has taken them: X are then its only READY
blocks, so its victims are X whatever order the policy gives them (committed earlier, the store's
own blocks are victims too, and slru ranks a block whose key its sketch remembers — a false
positive does that to a fresh key — after them). The demote is timed by the daemon: its put's
round trip through the companion (``kvtierd_tier_call_seconds{op="put"}``), read once A counts
all N demoted (asking for stats every few milliseconds would compete for the CPU with what it
measures).
"""

from __future__ import annotations

import time

import numpy as np

from .harness import BlockBench, make_keys


def wait_counter(daemon, name: str, value: int, timeout: float = 300.0) -> dict:
    """Poll the daemon's tier counter until it reaches ``value``; returns the tier's stats then."""
    deadline = time.monotonic() + timeout
    while (tier := daemon.stats()["tier"])[name] < value:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} stayed below {value}: {tier}")
        time.sleep(0.005)
    return tier


def call_seconds(tier: dict, op: str) -> float:
    hist = tier["call_seconds"].get(op)
    return hist["sum"] if hist else 0.0


def taken(daemon, since: int, n: int, timeout: float = 60.0) -> None:
    """Wait until the daemon has taken ``n`` blocks for demotion (in its put, or done) since its
    ``demoted_blocks`` was ``since``. Its loop does that at its next turn, so the first ask
    nearly always finds them."""
    deadline = time.monotonic() + timeout
    while (tier := daemon.stats()["tier"])["demoting_blocks"] + tier["demoted_blocks"] - since < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"node A did not take {n} blocks to demote: {tier}")
        time.sleep(0.001)


def demote_x(a, bench: BlockBench, n: int, seed: int, ns_name: str) -> tuple[list[bytes], np.ndarray, float]:
    """X (N fresh keys) stored on node A and demoted in one put: (X, their block ids, the put's
    seconds as the daemon timed it). A's region and the namespace in the tier are cleared first."""
    a.call("clear", admin=True, namespace=ns_name)
    ids = np.arange(n)
    x, trigger = make_keys(seed, n), make_keys(seed + 1, n)
    job = next(bench.jobs)
    bench.client.store(job, x, ids)
    (done,) = bench.client.wait([job])
    if not done.ok:
        raise RuntimeError(f"store of X on node A failed: {done}")
    before = a.stats()["tier"]
    job = next(bench.jobs)                      # takes the last free pages: no copy, only the allocation
    bench.client.channel.call("store", job=job, keys=trigger)
    taken(a, before["demoted_blocks"], n)       # committed only once A has taken X (module docstring)
    bench.client.channel.call("commit", job=job, ok=True)
    after = wait_counter(a, "demoted_blocks", before["demoted_blocks"] + n)
    dropped = sum(after["demote_dropped_blocks"].values())
    if dropped:
        raise RuntimeError(f"node A dropped {dropped} blocks instead of demoting them")
    return x, ids, call_seconds(after, "put") - call_seconds(before, "put")


def timed_lookup(bench: BlockBench, keys: list[bytes], pause: float = 0.0):
    """(the reply, its seconds) of one lookup, after ``pause`` (as between scheduler steps)."""
    if pause:
        time.sleep(pause)
    t0 = time.perf_counter()
    reply = bench.client.lookup_detail(keys)
    return reply, time.perf_counter() - t0


def promote_x(node, bench: BlockBench, x: list[bytes], ids: np.ndarray, pause: float = 0.0) -> dict:
    """X (held only in the tier) looked up on ``node`` until all N are READY, then loaded into
    ``ids`` and checked (each block's first 8 bytes are its index): ``promote`` (the first lookup,
    which reports them pending, to the one that finds them READY), ``pending`` (that first
    lookup's own seconds) and ``local`` (one more lookup, of N hits)."""
    n = len(x)
    rows = bench.kv.numpy()
    rows[:, :8] = 0xFF
    first, pending = timed_lookup(bench, x, pause)
    t0 = time.perf_counter() - pending
    if (first.hits, first.pending) != (0, n):
        raise RuntimeError(f"the first lookup of X answered {first}, not 0 hits and {n} pending")
    while bench.client.lookup_detail(x).hits < n:
        time.sleep(0.0005)
        if time.perf_counter() - t0 > 300:
            raise RuntimeError(f"X was not promoted: {node.stats()['tier']}")
    promote = time.perf_counter() - t0
    ready, local = timed_lookup(bench, x, pause)
    job = next(bench.jobs)
    hits = bench.client.load(job, x, ids)
    (loaded,) = bench.client.wait([job])
    if ready.hits != n or not loaded.ok or hits != n or \
            not np.array_equal(rows[:, :8].view("<u8").ravel(), ids.astype("<u8")):
        raise RuntimeError("the node loaded other bytes than were demoted")
    return {"promote": promote, "pending": pending, "local": local}

"""``policy``: the eviction policies through a real daemon — the hit rate of a replayed request
trace against Belady's offline optimum, and the daemon's CPU per key against LRU's.

**Replay.** Each Mooncake-format trace given (``--trace FILE``, any number; without one, a
generated chat-shaped trace, ``traces.generate``) is replayed, for each policy and each capacity
(a fraction of the trace's distinct blocks), through a fresh daemon (``--policy NAME``) whose
region holds exactly that many one-page blocks. One rank session (TP=1, no copies: the policy,
not the copy, is under test) plays the requests in timestamp order, as an engine would: a lookup
of the request's blocks (keys: each hash id's 8 bytes, little-endian, padded to 16), a load
(+ release) of the hit prefix, a store (+ commit) of the rest — in jobs of at most ``--job-keys``
keys when given (an engine storing a long prompt over several scheduling steps) — with
``cold_tail`` 1 when the request's last block is partial (its ``input_length`` says so). The hit
rate is the lookups' hits over the block references. The daemons run with ``PYTHONHASHSEED`` fixed
(``HASH_SEED``): the sketch of the segmented policies hashes keys with Python's salted ``hash``,
so without it their hit rates move in the third decimal from run to run. Belady's reference is
computed from the same file in this process (``traces.belady``), so every rate is also a ratio to
it and to LRU's rate at the same capacity.

**Cost.** For each policy, a daemon whose region of ``Plan.cost_entries`` one-page entries is full
(every stored key evicts one) serves jobs of B keys: stores of fresh keys (a chain each), and
lookups and loads (+ release) of a recently stored job's keys. The daemon's CPU time (all its
threads, ``/proc/PID/task/*/schedstat``, nanoseconds) per key is the figure; the policies take
turns in short slices so that all see the same machine, and the figure is the least over the
slices: other work on the machine only ever adds to a slice's CPU time (cache and scheduler
interference), so the least-disturbed slice is the best estimate of the cost itself.
This is the whole control-plane cost per key (decoding, the index, the reply), of which the
policy's hooks are a part: the ratio is what the policy adds to it.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque

from kvtierd.contract import protocol as P
from kvtierd.contract.namespace import NamespaceId
from kvtierd.policy import DEFAULT, POLICIES

from . import traces
from .harness import HOLD_ALL, Context, KeyStream, bench_namespace, cpu_ns, ratio, region_size, say, target
from .launcher import DaemonProcess

HASH_SEED = "0"
MIN_REGION = 8 << 20                # the daemon's smallest --size
COST_OPS = ("lookup", "load", "store")


def _daemon(directory: str, policy: str, pages: int, page_size: int) -> DaemonProcess:
    os.makedirs(directory, exist_ok=True)
    return DaemonProcess(directory, "--size", str(region_size(pages, page_size)), "--page-size", str(page_size),
                         "--pin", "off", "--metrics-address", "off", "--policy", policy, "--log-level", "warning",
                         "--prefault-threads", "1", *HOLD_ALL, env={"PYTHONHASHSEED": HASH_SEED}, start_timeout=120.0,
                         call_timeout=60.0)


def replay_daemon(directory: str, policy: str, blocks: int) -> tuple[DaemonProcess, NamespaceId]:
    """A daemon (not started) whose region holds exactly ``blocks`` one-page blocks, and the
    namespace of such blocks: the page is the smallest (from 4 KiB) the daemon's smallest region
    allows."""
    page = 4096
    while region_size(blocks, page) < MIN_REGION:
        page *= 2
    namespace = NamespaceId(model="bench-policy", dtype="uint8", block_tokens=traces.BLOCK_TOKENS, block_bytes=page,
                            sharding="replicated")
    return _daemon(directory, policy, blocks, page), namespace


class _Rank:
    """One TP=1 rank session talking the protocol without copies."""

    def __init__(self, daemon: DaemonProcess, namespace: NamespaceId):
        from kvtier import Client
        self.client = Client(daemon.socket, engine_id="bench-policy", rank=0, world_size=1, namespace=namespace,
                             copier="cpu", pin="off", timeout=120)
        self.call = self.client.channel.call
        self.jobs = iter(range(1, 1 << 62))

    def lookup(self, keys: list[bytes]) -> int:
        hits = 0
        for start in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            part = keys[start:start + P.MAX_KEYS_PER_REQUEST]
            n = self.call("lookup", keys=part)["hits"]
            hits += n
            if n < len(part):
                break
        return hits

    def load(self, keys: list[bytes]) -> None:
        for start in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            job = next(self.jobs)
            self.call("load", job=job, keys=keys[start:start + P.MAX_KEYS_PER_REQUEST])
            self.call("release", job=job)

    def store(self, keys: list[bytes], cold_tail: int = 0) -> None:
        job = next(self.jobs)
        self.call("store", job=job, keys=keys, **({"cold_tail": cold_tail} if cold_tail else {}))
        self.call("commit", job=job, ok=True)

    def close(self) -> None:
        self.client.close()


def replay_through(daemon: DaemonProcess, trace: traces.Trace, namespace: NamespaceId,
                   job_keys: int | None = None) -> dict:
    """Play ``trace`` through ``daemon`` (module docstring): hits, references, the daemon's CPU."""
    rank = _Rank(daemon, namespace)
    keys = {i: traces.key_of(i) for ids in trace.requests for i in ids}
    part = min(job_keys or P.MAX_KEYS_PER_REQUEST, P.MAX_KEYS_PER_REQUEST)
    hits = 0
    try:
        cpu0, t0 = cpu_ns(daemon.proc.pid), time.perf_counter()
        for ids, cold in zip(trace.requests, trace.cold_tails()):
            request = list(map(keys.__getitem__, ids))
            n = rank.lookup(request)
            hits += n
            if n:
                rank.load(request[:n])
            for start in range(n, len(request), part):
                last = start + part >= len(request)
                rank.store(request[start:start + part], cold if last else 0)
        cpu, seconds = cpu_ns(daemon.proc.pid) - cpu0, time.perf_counter() - t0
    finally:
        rank.close()
    return {"hits": hits, "references": trace.references, "cpu_ns": cpu, "seconds": seconds}


def _replay_rows(ctx: Context, trace: traces.Trace, policies: list[str]) -> list[dict]:
    rows = []
    for fraction in ctx.capacities:
        cap = traces.capacity(trace, fraction)
        best = traces.belady(trace, cap).hit_rate
        cells = []
        for name in policies:
            daemon, namespace = replay_daemon(ctx.path(f"policy-{name}-{cap}"), name, cap)
            daemon.start()
            try:
                run = replay_through(daemon, trace, namespace, ctx.job_keys)
                stats = daemon.stats()
            finally:
                daemon.cleanup()
            if stats["pages_total"] != cap:
                raise RuntimeError(f"policy bench: the region holds {stats['pages_total']} blocks, not {cap}")
            rate = run["hits"] / run["references"] if run["references"] else 0.0
            cells.append({"trace": trace.name, "capacity": fraction, "blocks": cap, "policy": name, "hit_rate": rate,
                          "belady": best, "x_belady": ratio(rate, best), "hits": run["hits"],
                          "references": run["references"], "evictions": stats["evictions"],
                          "admitted": stats["policy_admitted_keys"], "refused": stats["policy_refused_keys"],
                          "evicted_by_segment": stats["policy_evictions"],
                          "cpu_ns_per_ref": run["cpu_ns"] / max(run["references"], 1), "seconds": run["seconds"]})
            say(f"policy: {trace.name} at {fraction:g} ({cap} blocks) {name:8} hit rate {rate:.3f} "
                f"(Belady {best:.3f}, x{ratio(rate, best):.2f}) in {run['seconds']:.1f} s")
        lru = next((c for c in cells if c["policy"] == "lru"), None)
        for c in cells:
            c["x_lru"] = ratio(c["hit_rate"], lru["hit_rate"]) if lru else None
            c["cpu_x_lru"] = ratio(c["cpu_ns_per_ref"], lru["cpu_ns_per_ref"]) if lru else None
        rows += cells
    return rows


# ----------------------------------------------------------------------------------------------- cost
class _CostDriver:
    """One policy's daemon with a full region and a rank storing, looking up and loading."""

    def __init__(self, ctx: Context, policy: str, entries: int, seed: int):
        self.daemon = _daemon(ctx.path(f"cost-{policy}"), policy, entries, 4096)
        self.daemon.start()
        self.rank = _Rank(self.daemon, bench_namespace("policy-cost", 4096))
        self.rng = random.Random(seed)
        self.streams: dict[int, KeyStream] = {}
        self.recent: deque = deque(maxlen=max(1, entries // 1024))   # jobs stored lately: still cached
        fill = KeyStream(seed, 1024)
        for _ in range(entries // 1024 + 1):       # full: from here on every stored key evicts one
            keys = fill.next()
            self.rank.store(keys)
            self.recent.append(keys)

    def run(self, op: str, batch: int, duration: float) -> tuple[int, int]:
        """Jobs of ``batch`` keys for ``duration`` seconds: (keys, daemon CPU ns)."""
        stream = self.streams.setdefault(batch, KeyStream(self.rng.randrange(1 << 30), batch))
        done = 0
        cpu0 = cpu_ns(self.daemon.proc.pid)
        deadline = time.perf_counter() + duration
        while time.perf_counter() < deadline:
            if op == "store":
                keys = stream.next()
                self.rank.store(keys)
                self.recent.append(keys)
            else:
                keys = self.rng.choice(self.recent)[:batch]
                if op == "lookup":
                    self.rank.lookup(keys)
                else:
                    self.rank.load(keys)
            done += len(keys)
        return done, cpu_ns(self.daemon.proc.pid) - cpu0

    def close(self) -> None:
        self.rank.close()
        self.daemon.cleanup()


def _cost_rows(ctx: Context, policies: list[str]) -> list[dict]:
    plan = ctx.plan
    duration = max(0.05, plan.duration / 2)
    drivers = {}
    try:
        for name in policies:
            drivers[name] = _CostDriver(ctx, name, plan.cost_entries, seed=7)
        rows = []
        for op in COST_OPS:
            for batch in plan.cost_batches:
                # Per slice, each policy in turn: ns per key.
                per_key: dict[str, list[float]] = {name: [] for name in policies}
                for _ in range(plan.cost_slices):
                    for name, driver in drivers.items():
                        keys, cpu = driver.run(op, batch, duration)
                        per_key[name].append(cpu / max(keys, 1))
                for name in policies:
                    least = min(per_key[name])
                    rows.append({"op": op, "keys": batch, "policy": name, "cpu_ns_per_key": least,
                                 "x_lru": ratio(least, min(per_key["lru"])) if "lru" in per_key else None})
                say(f"policy cost: {op:6} B={batch:<4} " + ", ".join(
                    f"{r['policy']} {r['cpu_ns_per_key']:,.0f} ns/key (x{r['x_lru']:.2f})" for r in rows[-len(policies):]))
    finally:
        for driver in drivers.values():
            driver.close()
    return rows


# ----------------------------------------------------------------------------------------------- section
def run(ctx: Context) -> dict:
    policies = list(ctx.policies or POLICIES)
    if "lru" not in policies:
        policies.insert(0, "lru")              # every ratio is to LRU's figure of the same run
    loaded = list(ctx.traces) or [traces.generate(ctx.plan.generated_requests)]
    rows = [row for trace in loaded for row in _replay_rows(ctx, trace, policies)]
    cost = _cost_rows(ctx, policies)
    ratios, targets = {}, []
    default = [r for r in rows if r["policy"] == DEFAULT]
    for r in default:
        ratios[f"{r['trace']}@{r['capacity']:g}_x_belady"] = r["x_belady"]
        if r["x_lru"] is not None:
            ratios[f"{r['trace']}@{r['capacity']:g}_x_lru"] = r["x_lru"]
    if DEFAULT != "lru" and default:
        worst = min(default, key=lambda r: r["x_lru"])
        targets.append(target(f"{DEFAULT} hit rate vs LRU's, worst cell ({worst['trace']} at {worst['capacity']:g})",
                              worst["x_lru"], 1.0, "higher"))
    for trace in loaded:
        for fraction, goal in ((0.1, 0.8), (0.05, 0.6)):
            cell = next((r for r in default if r["trace"] == trace.name and r["capacity"] == fraction), None)
            if cell is not None:
                targets.append(target(f"{DEFAULT} hit rate vs Belady at {fraction:.0%} capacity ({trace.name})",
                                      cell["x_belady"], goal, "higher"))
    own = [r for r in cost if r["policy"] == DEFAULT]
    for r in own:
        ratios[f"cost_{r['op']}_B{r['keys']}_x_lru"] = r["x_lru"]
    if DEFAULT != "lru" and own:
        worst = max(own, key=lambda r: r["x_lru"])
        targets.append(target(f"{DEFAULT} daemon CPU per key vs LRU's, worst job ({worst['op']}, B={worst['keys']})",
                              worst["x_lru"], 1.2, "lower"))
    notes = [f"default policy: {DEFAULT}; daemons run with PYTHONHASHSEED={HASH_SEED}",
             "hit rate: lookup hits / block references, each request a lookup, a load of the hit prefix, a store "
             f"of the rest{f' in jobs of at most {ctx.job_keys} keys' if ctx.job_keys else ''}; Belady: the offline "
             "optimum of prefix hits at the same capacity (kvtierbench.traces.belady)",
             f"cost: a full region of {ctx.plan.cost_entries:,} one-page entries per policy, the policies taking turns "
             "in slices; daemon CPU (all threads) per key"]
    return {"rows": rows, "more": {"cost": cost}, "ratios": ratios, "targets": targets, "notes": notes}

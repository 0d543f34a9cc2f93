"""``nodes``: an engine whose TP group spans two nodes against one on a single node — the prefix hit
rate of a replayed request trace, and how often a block the scheduler's node hits is missing on
the other node.

**Setups**, per trace and capacity (each daemon's region holds that many one-page blocks, a
fraction of the trace's distinct blocks; MLA: a replicated namespace, one copy per node):

- *one node*: a TP=8 engine, its coordinator and 8 rank sessions on one daemon;
- *two nodes*: a TP=16 engine, its coordinator and ranks 0-7 on node A's daemon, ranks 8-15 on
  node B's, each session naming its node's ranks;
- *two nodes, pressure on B*: the same, and another engine (another model, TP=1) on node B only
  stores ``--pressure`` × the request's blocks of fresh keys after each request: node B evicts
  what node A keeps.

**A request**, as the vLLM plugin plays it (docs/vllm.md, "Several nodes"): the coordinator
looks up the request's keys on its own node and leases the hits (``hit_a``); the load job (of
those keys) runs on every node — node A's ranks consume the lease, node B's ranks pin what node B
holds of them (``hit_b``, a prefix) — so the engine keeps the blocks every rank loaded
(min(hit_a, hit_b): on one node, ``hit_a``) and computes the rest; then the store job of the keys
past ``hit_a`` (what vLLM offers: it does not store again the blocks it recomputed after a short
load) runs on every node, each node's lowest rank writing and the others voting. No copies (one
page per block; the hit rate, not the copy, is under test): the protocol as the plugin sends it.

Figures: the hit rate (blocks every rank loaded / block references) of each setup, the two-node
rate against the one-node rate of the same trace and capacity (the goal: 1.00 when nothing
evicts on one node only), and the share of node A's hits missing on node B.
"""

from __future__ import annotations

import itertools

from kvtierd.contract import protocol as P
from kvtierd.contract.namespace import NamespaceId

from . import traces
from .harness import Context, ratio, say, target
from .policy import replay_daemon

PER_NODE = 8
PRESSURE = (0.25, 1.0)              # node B's extra fresh blocks per request, × the request's blocks


class _Node:
    """One daemon's sessions of the engine: its ranks (and the coordinator, on the scheduler's node)."""

    def __init__(self, daemon, namespace: NamespaceId, engine: str, ranks: range, world: int, coordinator: bool):
        from kvtier import Client
        common = dict(engine_id=engine, world_size=world, namespace=namespace, node_ranks=ranks, timeout=120)
        self.ranks = [Client(daemon.socket, rank=r, copier="cpu", pin="off", populate_threads=0, **common)
                      for r in ranks]
        self.coordinator = Client(daemon.socket, rank=None, **common) if coordinator else None

    def lookup(self, keys: list[bytes], lease: int) -> int:
        hits = 0
        for begin in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            part = keys[begin:begin + P.MAX_KEYS_PER_REQUEST]
            n = self.coordinator.channel.call("lookup", keys=part, lease=lease + begin, ttl_ms=60_000)["hits"]
            hits += n
            if n < len(part):
                break
        return hits

    def load(self, job: int, keys: list[bytes], lease: int | None) -> int:
        """Every rank's load request and release; returns the blocks the job pinned here."""
        hits = 0
        for begin in range(0, len(keys), P.MAX_KEYS_PER_REQUEST):
            part = keys[begin:begin + P.MAX_KEYS_PER_REQUEST]
            extra = {} if lease is None else {"lease": lease + begin}
            got = [r.channel.call("load", job=job + begin, keys=part, **extra)["hits"] for r in self.ranks]
            for r in self.ranks:
                r.channel.call("release", job=job + begin)
            hits += got[0]
            if got[0] < len(part):
                break
        return hits

    def store(self, job: int, keys: list[bytes], cold: int) -> None:
        """Every rank's store request (the writer's commits after its "copy"; the others vote)."""
        hints = {"cold_tail": cold} if cold else {}
        for r in self.ranks:
            r.channel.call("store", job=job, keys=keys, **hints)
            if r.is_writer:
                r.channel.call("commit", job=job, ok=True)

    def close(self) -> None:
        for client in [*self.ranks, *([self.coordinator] if self.coordinator else [])]:
            client.close()


def _replay(ctx: Context, trace: traces.Trace, blocks: int, nodes: int, pressure: float) -> dict:
    """One setup (module docstring): hits every rank loaded, node A's hits, and node B's misses of them."""
    started = []
    try:
        daemons = []
        for n in range(nodes):
            daemon, namespace = replay_daemon(ctx.path(f"nodes-{nodes}-{pressure:g}-{blocks}-{n}"), "slru", blocks)
            daemon.start()
            started.append(daemon)
            daemons.append(daemon)
        world = PER_NODE * nodes
        sides = [_Node(d, namespace, "bench-nodes", range(n * PER_NODE, (n + 1) * PER_NODE), world, coordinator=n == 0)
                 for n, d in enumerate(daemons)]
        filler = None
        if pressure:
            from kvtier import Client
            filler = Client(daemons[-1].socket, engine_id="bench-filler", rank=0, world_size=1, copier="cpu",
                            pin="off", populate_threads=0, timeout=120,
                            namespace=NamespaceId("bench-other-model", namespace.dtype, namespace.block_tokens,
                                                  namespace.block_bytes))
        fresh = itertools.count(1 << 40)
        ids = itertools.count(1, P.MAX_KEYS_PER_REQUEST + 1)
        totals = {"hits": 0, "hits_a": 0, "missing_on_b": 0, "references": trace.references}
        for request, cold in zip(trace.requests, trace.cold_tails()):
            keys = list(map(traces.key_of, request))
            lease = next(ids)
            hit_a = sides[0].lookup(keys, lease)
            loaded = hit_a
            if hit_a:
                job = next(ids)
                for n, side in enumerate(sides):
                    got = side.load(job, keys[:hit_a], lease if n == 0 else None)
                    loaded = min(loaded, got)
            totals["hits"] += loaded
            totals["hits_a"] += hit_a
            totals["missing_on_b"] += hit_a - loaded
            for begin in range(hit_a, len(keys), P.MAX_KEYS_PER_REQUEST):
                part, job = keys[begin:begin + P.MAX_KEYS_PER_REQUEST], next(ids)
                last = begin + P.MAX_KEYS_PER_REQUEST >= len(keys)
                for side in sides:
                    side.store(job, part, cold if last else 0)
            if filler is not None:
                extra = [next(fresh).to_bytes(8, "little").ljust(traces.KEY_BYTES, b"\0")
                         for _ in range(round(pressure * len(keys)))]
                for begin in range(0, len(extra), P.MAX_KEYS_PER_REQUEST):
                    job = next(ids)
                    filler.channel.call("store", job=job, keys=extra[begin:begin + P.MAX_KEYS_PER_REQUEST])
                    filler.channel.call("commit", job=job, ok=True)
        stats = [d.stats() for d in daemons]
        if any(s["open_jobs"] or s["entries_writing"] for s in stats):
            raise RuntimeError(f"nodes bench: jobs left open or entries WRITING: {stats}")
        totals["evictions"] = [s["evictions"] for s in stats]
        for side in sides:
            side.close()
        if filler is not None:
            filler.close()
        return totals
    finally:
        for daemon in started:
            daemon.cleanup()


def _rows(ctx: Context, trace: traces.Trace) -> list[dict]:
    rows = []
    for fraction in ctx.node_capacities:
        blocks = traces.capacity(trace, fraction)
        base = None
        for nodes, pressure in ((1, 0.0), (2, 0.0), *((2, p) for p in PRESSURE)):
            run = _replay(ctx, trace, blocks, nodes, pressure)
            rate = run["hits"] / run["references"]
            base = base if base is not None else rate
            row = {"trace": trace.name, "capacity": fraction, "blocks": blocks,
                   "setup": "one node, TP=8" if nodes == 1 else "two nodes, TP=16",
                   "pressure": pressure, "hit_rate": rate, "x_one_node": ratio(rate, base),
                   "missing_on_b": run["missing_on_b"] / run["hits_a"] if nodes == 2 and run["hits_a"] else None,
                   "evictions": run["evictions"]}
            rows.append(row)
            say(f"nodes: {trace.name} at {fraction:g} ({blocks} blocks) {row['setup']}, pressure {pressure:g}: "
                f"hit rate {rate:.3f} (x{row['x_one_node']:.3f} one node), node A's hits missing on B: "
                f"{row['missing_on_b'] if row['missing_on_b'] is not None else '-'}")
    return rows


def run(ctx: Context) -> dict:
    loaded = list(ctx.traces) or [traces.generate(ctx.plan.generated_requests)]
    rows = [row for trace in loaded for row in _rows(ctx, trace)]
    ratios, targets = {}, []
    for row in rows:
        if row["setup"].startswith("two") and not row["pressure"]:
            ratios[f"{row['trace']}@{row['capacity']:g}_two_nodes_x_one_node"] = row["x_one_node"]
            targets.append(target(f"two-node hit rate vs one node's ({row['trace']} at {row['capacity']:g}), "
                                  "nothing evicted on one node only", row["x_one_node"], 1.0, "higher"))
    notes = ["hit rate: blocks every rank loaded / block references; two nodes: the coordinator looks up and leases on "
             "node A, every node's ranks load from their own daemon, the engine keeps the prefix all of them loaded",
             "missing on B: share of node A's hits that node B did not hold (recomputed); pressure: node B alone also "
             "stores that many fresh blocks of another model per request block"]
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes}

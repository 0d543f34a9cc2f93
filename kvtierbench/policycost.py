"""Per-key CPU cost of each policy's hooks, in-process, with the daemon's job sizes.

A policy holding ``entries`` evictable entries (a full cache: every store evicts as many as it
adds) is driven with jobs of ``batch`` keys, as the daemon's index drives it:

- lookup: ``accessed`` of the slots of an earlier store job that are still cached (a request's
  hit prefix: what one job stored, in its order), the job drawn uniformly;
- load: ``pinned`` then ``unpinned`` of them;
- store: ``victims`` for ``batch`` slots, ``removed`` of those, ``inserted`` of ``batch`` new keys.

Each round times every policy once per operation, in turn (so that all of them see the same
machine load), with the thread's CPU time; the figure is the median over rounds, in ns per key,
and its ratio to LRU's.

``trace_cost`` measures the same on a trace: the hook calls of a replay (``kvtierbench.traces``)
are recorded, then played again on a fresh policy and timed, minus the loop's own cost; the
figure is ns of policy CPU per block reference of the trace (the same denominator for every
policy, whatever its hits). Job sizes and the mix of segments are then the trace's own.

Either way it is the policy's own share of a request: the daemon's per-key work (decoding,
validating, the index, the tick stamps) comes on top and is the same for all policies.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from itertools import islice
from typing import Callable, Sequence

OPS = ("lookup", "load", "store")


class _Driver:
    """One policy with a full cache of ``entries`` slots, stored in jobs of ``batch``."""

    def __init__(self, factory: Callable[[], object], entries: int, batch: int, seed: int):
        self.policy = factory()
        self.batch = batch
        self.rng = random.Random(seed)
        self.next_key = 0
        self.jobs = [list(range(start, min(start + batch, entries))) for start in range(0, entries, batch)]
        for job in self.jobs:
            self.policy.inserted(job, self._keys(len(job)), chain=True)

    def _keys(self, n: int) -> list[bytes]:
        first, self.next_key = self.next_key, self.next_key + n
        return [i.to_bytes(16, "little") for i in range(first, first + n)]

    def prepare(self, op: str):
        if op == "store":
            return self._keys(self.batch)
        while True:
            job = self.rng.choice(self.jobs)
            cached = [slot for slot in job if slot in self.policy]
            if cached:
                return cached

    def run(self, op: str, arg) -> int:
        """Runs one job; returns its number of keys."""
        p = self.policy
        if op == "lookup":
            p.accessed(arg)
        elif op == "load":
            p.pinned(arg)
            p.unpinned(arg)
        else:
            victims = []
            for slot in p.victims(frozenset()):
                victims.append(slot)
                if len(victims) == self.batch:
                    break
            p.removed(victims)
            p.inserted(victims, arg, chain=True)
            self.jobs.append(victims)
            if len(self.jobs) > 4 * len(p) // self.batch:
                del self.jobs[: len(self.jobs) // 2]
            return len(victims)
        return len(arg)


def measure(factories: dict[str, Callable[[], object]], entries: int = 100_000, batch: int = 256,
            rounds: int = 200, seed: int = 1) -> dict[str, dict[str, float]]:
    """ns per key per operation, median over ``rounds`` (module docstring)."""
    drivers = {name: _Driver(f, entries, batch, seed) for name, f in factories.items()}
    samples: dict[str, dict[str, list[float]]] = {n: {op: [] for op in OPS} for n in factories}
    clock = time.thread_time_ns
    for _ in range(rounds):
        for op in OPS:
            for name, d in drivers.items():
                arg = d.prepare(op)
                t0 = clock()
                keys = d.run(op, arg)
                samples[name][op].append((clock() - t0) / keys)
    return {n: {op: statistics.median(v) for op, v in ops.items()} for n, ops in samples.items()}


class _Recorder:
    """Passes the hooks through to a policy and logs them (victims: the exclude set and how many
    the caller took, logged when the walk is closed, before the caller frees them)."""

    def __init__(self, policy):
        self.policy, self.log = policy, []

    def __getattr__(self, hook):
        method = getattr(self.policy, hook)
        if hook not in ("inserted", "accessed", "pinned", "unpinned", "removed"):
            return method

        def logged(*args, **kw):
            self.log.append((hook, [list(a) if isinstance(a, list) else a for a in args], kw))
            return method(*args, **kw)
        return logged

    def __contains__(self, slot):
        return slot in self.policy

    def victims(self, exclude=frozenset()):
        taken = 0
        try:
            for slot in self.policy.victims(exclude):
                taken += 1
                yield slot
        finally:
            self.log.append(("victims", [exclude, taken], {}))


class _Null:
    def __getattr__(self, hook):
        return lambda *a, **kw: None

    def victims(self, exclude=frozenset()):
        return iter(())


def _play(policy, log) -> int:
    clock = time.thread_time_ns
    t0 = clock()
    for hook, args, kw in log:
        if hook == "victims":
            list(islice(policy.victims(args[0]), args[1]))
        else:
            getattr(policy, hook)(*args, **kw)
    return clock() - t0


def trace_cost(trace, factory: Callable[[], object], capacity: int, repeats: int = 3) -> float:
    """ns of policy CPU per block reference, replaying ``trace`` at ``capacity`` blocks."""
    from .traces import replay
    recorder = _Recorder(factory())
    replay(trace, recorder, capacity)
    spent = min(_play(factory(), recorder.log) for _ in range(repeats))
    loop = min(_play(_Null(), recorder.log) for _ in range(repeats))
    return max(0, spent - loop) / trace.references


def main(argv: Sequence[str] | None = None) -> int:
    from functools import partial

    from kvtierd.policy import POLICIES, reference
    from .traces import TraceError, capacity, load
    known = {name: partial(reference, name) for name in POLICIES}
    ap = argparse.ArgumentParser(prog="python -m kvtierbench.policycost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--trace", action="append", default=[], help="also time a replay of this trace")
    ap.add_argument("--capacity", default="0.05,0.2", help="for --trace: fractions of its distinct blocks")
    args = ap.parse_args(argv)
    result = measure(known, args.entries, args.batch, args.rounds)
    base = result["lru"]
    print(f"ns per key, {args.entries} entries, jobs of {args.batch} keys, median of {args.rounds} rounds")
    print(f"{'policy':>8} " + " ".join(f"{op:>8} {'x lru':>6}" for op in OPS))
    for name, ops in result.items():
        print(f"{name:>8} " + " ".join(f"{ops[op]:>8.0f} {ops[op] / base[op]:>6.2f}" for op in OPS))
    for path in args.trace:
        try:
            trace = load(path)
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for fraction in map(float, args.capacity.split(",")):
            cap = capacity(trace, fraction)
            costs = {name: trace_cost(trace, f, cap) for name, f in known.items()}
            print(f"{trace.name} at {fraction:g} ({cap} blocks), ns per block reference: " +
                  ", ".join(f"{n} {c:.0f} ({c / costs['lru']:.2f}x)" for n, c in costs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

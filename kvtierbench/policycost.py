"""Per-key CPU cost of each policy's hooks, in-process, with the daemon's job sizes.

A policy holding ``entries`` evictable entries (a full cache: every store evicts as many as it
adds) is driven with jobs of ``batch`` keys, as the daemon's index drives it:

- lookup: ``accessed`` of ``batch`` cached slots (a request's hit prefix);
- load: ``pinned`` then ``unpinned`` of them;
- store: ``victims`` for ``batch`` slots, ``removed`` of those, ``inserted`` of ``batch`` new keys.

Each round times every policy once per operation, in turn (so that all of them see the same
machine load), with the thread's CPU time; the figure is the median over rounds, in ns per key,
and its ratio to LRU's. It is the policy's own share of a request: the daemon's per-key work
(decoding, validating, the index, the tick stamps) comes on top and is the same for all.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Callable, Sequence

OPS = ("lookup", "load", "store")


class _Driver:
    """One policy with a full cache of ``entries`` slots and its key for each slot."""

    def __init__(self, factory: Callable[[], object], entries: int, batch: int, seed: int):
        self.policy = factory()
        self.batch = batch
        self.rng = random.Random(seed)
        self.next_key = 0
        self.slots = list(range(entries))
        for start in range(0, entries, batch):
            chunk = self.slots[start:start + batch]
            self.policy.inserted(chunk, self._keys(len(chunk)), chain=True)

    def _keys(self, n: int) -> list[bytes]:
        first, self.next_key = self.next_key, self.next_key + n
        return [i.to_bytes(16, "little") for i in range(first, first + n)]

    def prepare(self, op: str):
        if op == "store":
            return self._keys(self.batch)
        return self.rng.sample(self.slots, self.batch)

    def run(self, op: str, arg) -> None:
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
                d.run(op, arg)
                samples[name][op].append((clock() - t0) / batch)
    return {n: {op: statistics.median(v) for op, v in ops.items()} for n, ops in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    from kvtierd.policy import policies
    known = policies()
    ap = argparse.ArgumentParser(prog="python -m kvtierbench.policycost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    result = measure(known, args.entries, args.batch, args.rounds)
    base = result["lru"]
    print(f"ns per key, {args.entries} entries, jobs of {args.batch} keys, median of {args.rounds} rounds")
    print(f"{'policy':>8} " + " ".join(f"{op:>8} {'x lru':>6}" for op in OPS))
    for name, ops in result.items():
        print(f"{name:>8} " + " ".join(f"{ops[op]:>8.0f} {ops[op] / base[op]:>6.2f}" for op in OPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())

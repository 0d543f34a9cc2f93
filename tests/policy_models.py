"""Plain re-implementations of the LRU and SLRU policies, written from their docstrings, and a
generator of small chat-shaped Mooncake traces: the independent side of the replay tests (the
in-process replay in tests/unit/test_policy_traces.py, the replay through a daemon in
tests/integration/test_policy_bench.py)."""

from __future__ import annotations

import random


def row(t, ids, n=None):
    r = {"timestamp": t, "hash_ids": ids}
    if n is not None:
        r["input_length"] = n
    return r


class ListLRU:
    """LRU as a list, oldest first, driven by the same events (the daemon's, module docstring of
    kvtierbench.traces)."""

    def __init__(self):
        self.order: list[int] = []

    def touch(self, slots):
        for s in slots:
            if s in self.order:
                self.order.remove(s)
                self.order.append(s)

    inserted = lambda self, slots, keys, chain=True, cold=0: self.order.extend(slots)
    accessed = touch
    unpinned = lambda self, slots: self.order.extend(slots)

    def pinned(self, slots):
        self.order = [s for s in self.order if s not in slots]

    removed = pinned

    def victims(self, exclude=frozenset()):
        return iter([s for s in self.order if s not in exclude])

    def __contains__(self, s):
        return s in self.order

    def stats(self):
        return {}


class ListSLRU:
    """SLRU as two lists, written from kvtierd/policy/slru.py's docstring: probation then
    protected; an entry used in probation is promoted when the next walk starts (in order of
    first use), a released load at once; a remembered key goes protected; protected keeps at most
    int(share x tracked), its oldest overflow going to probation's young end; a chain goes in
    tail first; the never-seen keys among the last ``cold`` go first in line, the deepest first."""

    def __init__(self, share):
        self.share, self.p, self.q, self.pins, self.seen, self.marked = share, [], [], set(), set(), []

    def fit(self):
        while len(self.q) > int(self.share * (len(self.p) + len(self.q) + len(self.pins))):
            self.p.append(self.q.pop(0))

    def inserted(self, slots, keys, chain=True, cold=0):
        known = [k in self.seen for k in keys]
        self.seen.update(keys)
        pairs = list(zip(slots, known))
        for s, k in (reversed(pairs) if chain else pairs):
            (self.q if k else self.p).append(s)
        for s, k in pairs[len(pairs) - cold:] if cold else ():
            if not k:
                self.p.remove(s)
                self.p.insert(0, s)
        self.fit()

    def accessed(self, slots):
        for s in slots:
            if s in self.q:
                self.q.remove(s)
                self.q.append(s)
            elif s not in self.marked:
                self.marked.append(s)

    def pinned(self, slots):
        self.p = [s for s in self.p if s not in slots]
        self.q = [s for s in self.q if s not in slots]
        self.pins.update(slots)

    def unpinned(self, slots):
        self.pins.difference_update(slots)
        self.q.extend(slots)
        self.fit()

    def removed(self, slots):
        self.pinned(slots)
        self.pins.difference_update(slots)
        self.marked = [s for s in self.marked if s not in slots]

    def victims(self, exclude=frozenset()):
        promoted = [s for s in self.marked if s in self.p]
        self.marked = []
        if promoted:
            self.p = [s for s in self.p if s not in promoted]
            self.q.extend(promoted)
            self.fit()
        return iter([s for s in self.p + self.q if s not in exclude])

    def __contains__(self, s):
        return s in self.p or s in self.q

    def stats(self):
        return {}


def conversations(seed: int, requests: int) -> list[dict]:
    """A Mooncake-format trace with the shape of a chat service: a shared system prompt, some
    conversations that come back with their history as the prefix, one-time requests."""
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 30))
    system = [0]
    talks: list[list[int]] = []
    rows = []
    for t in range(requests):
        if talks and rng.random() < 0.5:
            talk = rng.choice(talks)
        else:
            talk = list(system)
            talks.append(talk)
        talk.extend(next(next_id) for _ in range(rng.randint(1, 3)))
        ids = list(talk) + [next(next_id)]       # the partial last block: never seen again
        rows.append(row(t * 1000, ids, 512 * len(ids) - 100))
    return rows

"""Request traces in the Mooncake format, replayed against an eviction policy and against Belady.

A trace is a JSON-lines file, one request per line: ``timestamp`` (ms), ``hash_ids`` (the
prompt's blocks in order, each id standing for the hash of the whole prefix up to and including
that block: equal ids = equal prefix), and optionally ``input_length``/``output_length`` (tokens).
``load`` accepts any such file: it checks every line and names the first bad one, including ids
that break the prefix meaning (one id after two different parents, or repeated in a request).

**Replay.** Requests run in timestamp order (file order among equal stamps). A request *hits*
the longest run of its leading blocks that is cached; then every one of its blocks is stored or
touched. The prefix hit rate is hits / block references. Capacity is a number of blocks, usually
a fraction of the trace's distinct blocks (``capacity``).

``replay`` drives a policy object (``kvtierd.policy``) through the hook sequence the daemon's
index gives it for the same requests, with one block per entry slot:

1. lookup of the request's keys: the leading cached ones are the hits → ``accessed(hits)``;
2. load of the hits (pin, copy, release) → ``pinned(hits)``, ``unpinned(hits)``;
3. store job of the remaining keys: those already cached → ``accessed(present)``; room for the
   others from ``victims(exclude=present)`` (the index frees them → ``removed``); the new entries
   become READY → ``inserted(new, keys, chain=True, cold)``. When the job does not fit even after
   evicting everything evictable, the keys past the room are not stored (the daemon's NO_SPACE).
   The job says ``cold_tail`` 1 when the request's last block is partial (``Trace.cold_tails``):
   what a client that knows its blocks' token counts can tell the daemon. ``job_keys`` splits
   the store into jobs of at most that many keys (an engine storing a long prompt step by step).

**Belady reference** (``belady``): the offline optimum for *prefix* hits. After each request the
cache may keep any set of at most ``capacity`` blocks drawn from what it held and the request's
blocks; it keeps the blocks whose next use is nearest (MIN with bypass: a block whose next use is
farther than everything cached is not kept). Ties (a block and its descendants are next used by
the same request) evict the deepest first. Since a block's prefix is referenced whenever the
block is, a parent's next use is never later than its child's, so this cache is always closed
under prefixes: every cached block's prefix is cached, every block hit is a prefix hit, and the
block-hit optimum (which bounds prefix hits from above) is reached with prefix hits. It is
therefore the best any policy can do — including one that refuses blocks (admission); a policy
that must keep every stored block gets at most the same.

``python -m kvtierbench.traces FILE...`` prints each policy's hit rate beside Belady's as a
Markdown table (docs/policy.md has the method and the results).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Sequence

import numpy as np

BLOCK_TOKENS = 512            # the Mooncake traces' block size (tokens per hash id)
KEY_BYTES = 16                # replay key length: the id's 8 bytes, little-endian, zero-padded
DEFAULT_CAPACITIES = (0.02, 0.05, 0.1, 0.2)


class TraceError(ValueError):
    """The file is not a usable Mooncake-format trace; the message names the file and line."""


@dataclass
class Trace:
    name: str
    requests: list[list[int]]                 # hash ids per request, in replay order
    input_lengths: list[int] | None = None    # tokens per request, when every line gives them

    @property
    def references(self) -> int:
        return sum(map(len, self.requests))

    @property
    def distinct(self) -> int:
        return len(set().union(*self.requests)) if self.requests else 0

    def slice(self, start: int, stop: int, label: str | None = None) -> "Trace":
        """Requests [start, stop) of the replay order."""
        lengths = self.input_lengths[start:stop] if self.input_lengths is not None else None
        return Trace(label or f"{self.name}[{start}:{stop}]", self.requests[start:stop], lengths)

    def cold_tails(self, block_tokens: int = BLOCK_TOKENS) -> list[int]:
        """Per request, the ``cold_tail`` its store job carries: 1 when its last block is partial
        (``input_length`` not a multiple of ``block_tokens``: a block no longer prompt extends,
        which only an identical prompt reuses), else 0; all 0 without ``input_length``."""
        if self.input_lengths is None:
            return [0] * len(self.requests)
        return [int(bool(ids) and n % block_tokens != 0) for ids, n in zip(self.requests, self.input_lengths)]

    def full_blocks(self, block_tokens: int = BLOCK_TOKENS) -> "Trace":
        """The trace without each prompt's partial last block (``input_length`` not a multiple
        of ``block_tokens``): engines store full blocks only."""
        if self.input_lengths is None:
            raise TraceError(f"{self.name}: full_blocks needs input_length on every line")
        requests = [ids[: n // block_tokens] if n % block_tokens else ids
                    for ids, n in zip(self.requests, self.input_lengths)]
        return Trace(f"{self.name} full blocks", requests,
                     [n - n % block_tokens for n in self.input_lengths])


def load(path: str | Path) -> Trace:
    """Read and check a Mooncake-format trace (see the module docstring)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    stamps, requests, lengths = [], [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg}); a trace has one JSON object per line") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: a request is a JSON object, got {type(row).__name__}")
        for name in ("timestamp", "hash_ids"):
            if name not in row:
                raise TraceError(f"{where}: no {name!r}; every request needs 'timestamp' and 'hash_ids'")
        stamp, ids = row["timestamp"], row["hash_ids"]
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
            raise TraceError(f"{where}: 'timestamp' must be a number (ms), got {stamp!r}")
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < 1 << 64 for i in ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers in [0, 2**64)")
        n = row.get("input_length")
        if n is not None and (type(n) is not int or n < 0):
            raise TraceError(f"{where}: 'input_length' must be a non-negative integer, got {n!r}")
        stamps.append(stamp)
        requests.append(ids)
        lengths.append(n)
    if not requests:
        raise TraceError(f"{path}: no requests (a trace has one JSON object per line)")
    _check_prefixes(path, requests)
    order = sorted(range(len(requests)), key=stamps.__getitem__)     # stable: file order on ties
    known = None if None in lengths else [lengths[i] for i in order]
    return Trace(path.name, [requests[i] for i in order], known)


def _check_prefixes(path: Path, requests: list[list[int]]) -> None:
    """Each id must stand for one prefix: always the same parent id (none at position 0)."""
    parent: dict[int, int] = {}
    for lineno, ids in enumerate(requests, 1):
        before = -1
        for i in ids:
            if parent.setdefault(i, before) != before:
                seen = parent[i]
                raise TraceError(
                    f"{path}: request {lineno} (non-empty line order) has id {i} after "
                    f"{'the start' if before < 0 else before}, an earlier one after "
                    f"{'the start' if seen < 0 else seen}; hash_ids must stand for whole prefixes "
                    f"(equal id = equal prefix)")
            before = i


def generate(requests: int, seed: int = 0, block_tokens: int = BLOCK_TOKENS) -> Trace:
    """A chat-service-shaped trace, for runs given no trace file: a few shared system prompts;
    conversations that come back with their history (earlier prompt, answer, new message) as the
    prefix, most within a few hundred requests, some much later; one-time requests; every prompt
    ending in a partial block."""
    rng = random.Random(seed)
    ids = iter(range(1, 1 << 62))
    systems = [[next(ids) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    talks: list[list[int]] = []
    out: list[list[int]] = []
    lengths: list[int] = []
    for _ in range(requests):
        r = rng.random()
        if talks and r < 0.45:                              # a conversation comes back
            back = min(len(talks), int(rng.expovariate(1 / 150)) + 1)
            talk = talks[-back]
        else:
            talk = list(rng.choice(systems)) if r < 0.9 else []
            talks.append(talk)
        talk.extend(next(ids) for _ in range(rng.randint(1, 12)))
        out.append(talk + [next(ids)])                      # the partial last block: this prompt's own
        lengths.append(len(out[-1]) * block_tokens - rng.randint(1, block_tokens - 1))
    return Trace(f"generated chat trace ({requests} requests, seed {seed})", out, lengths)


def capacity(trace: Trace, fraction: float) -> int:
    """``fraction`` of the trace's distinct blocks, in blocks (at least 1)."""
    return max(1, int(fraction * trace.distinct))


def key_of(hash_id: int) -> bytes:
    return hash_id.to_bytes(8, "little").ljust(KEY_BYTES, b"\0")


@dataclass
class Result:
    hits: int
    references: int
    evictions: int = 0
    not_stored: int = 0                      # keys past the room (the daemon's NO_SPACE)
    stats: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.references if self.references else 0.0


def _next_use(requests: list[list[int]]) -> list[list[int]]:
    """For every block reference, the index of the next request that references the same id
    (``len(requests)`` when none)."""
    never = len(requests)
    counts = np.fromiter(map(len, requests), np.int64, len(requests))
    if counts.sum() == 0:
        return [[] for _ in requests]
    ids = np.fromiter((i for ids in requests for i in ids), np.uint64, int(counts.sum()))
    req = np.repeat(np.arange(len(requests)), counts)
    order = np.argsort(ids, kind="stable")
    sorted_ids, sorted_req = ids[order], req[order]
    nxt = np.full(len(ids), never, np.int64)
    same = sorted_ids[1:] == sorted_ids[:-1]
    nxt[order[:-1][same]] = sorted_req[1:][same]
    bounds = np.cumsum(counts)[:-1]
    return [part.tolist() for part in np.split(nxt, bounds)]


def belady(trace: Trace, capacity: int, bypass: bool = True) -> Result:
    """Prefix hits of the offline optimum at ``capacity`` blocks (module docstring).

    ``bypass=False`` is the weaker demand-paging variant (every block of a request is cached
    after it — as much of it as fits — evicting the farthest-used others), kept to show what
    admission is worth.
    """
    hits = refs = 0
    cached: dict[int, tuple[int, int]] = {}             # id -> (next use, depth)
    heap: list[tuple[int, int, int]] = []               # (-next use, -depth, id); stale ones skipped
    for ids, uses in zip(trace.requests, _next_use(trace.requests)):
        n = 0
        for i in ids:
            if i not in cached:
                break
            n += 1
        hits += n
        refs += len(ids)
        for depth, (i, use) in enumerate(zip(ids, uses)):
            cached[i] = (use, depth)
            heapq.heappush(heap, (-use, -depth, i))
        held = () if bypass else set(ids)
        skipped = []
        while len(cached) > capacity and heap:
            use, depth, i = heapq.heappop(heap)
            if cached.get(i) != (-use, -depth):
                continue
            if i in held:
                skipped.append((use, depth, i))
                continue
            del cached[i]
        for item in skipped:      # a request longer than the cache: not all of it stays
            if len(cached) <= capacity:
                heapq.heappush(heap, item)
            else:
                del cached[item[2]]
    return Result(hits, refs)


def replay(trace: Trace, policy, capacity: int, check: bool = False, job_keys: int | None = None) -> Result:
    """Prefix hits of ``policy`` at ``capacity`` blocks, driven like the daemon's index drives it
    (module docstring). ``job_keys``: store a request's missing keys in jobs of at most this many
    (as an engine stores a long prompt over several scheduling steps); ``check`` asserts the
    policy's answers are admissible (tests)."""
    keys = {i: key_of(i) for ids in trace.requests for i in ids}
    index: dict[bytes, int] = {}
    key_at: list[bytes | None] = [None] * capacity
    free = list(range(capacity - 1, -1, -1))
    hits = refs = evictions = not_stored = 0
    for ids, cold in zip(trace.requests, trace.cold_tails()):
        request = list(map(keys.__getitem__, ids))
        found = list(map(index.get, request))
        n = found.index(None) if None in found else len(found)
        hits += n
        refs += len(request)
        if n:
            hit = found[:n]
            policy.accessed(hit)           # lookup
            policy.pinned(hit)             # load: pinned while the ranks copy, then released
            policy.unpinned(hit)
        part = job_keys or max(len(request), 1)
        for start in range(n, len(request), part):
            job = request[start:start + part]
            found = list(map(index.get, job))
            present = [s for s in found if s is not None]
            if present:
                policy.accessed(present)   # the store job's keys that are cached already
            new = [k for k, s in zip(job, found) if s is None]
            need = len(new) - len(free)
            if need > 0:
                exclude = set(present)
                victims = list(islice(policy.victims(exclude), need))
                if check:
                    assert len(set(victims)) == len(victims), "a victim was chosen twice"
                    assert all(v in policy and v not in exclude and key_at[v] is not None for v in victims), \
                        "a victim that is not evictable, excluded, or not cached"
                policy.removed(victims)
                for v in victims:
                    del index[key_at[v]]
                    key_at[v] = None
                free.extend(victims)
                evictions += len(victims)
            fit = min(len(new), len(free))
            not_stored += len(new) - fit
            if fit:
                slots = free[-fit:][::-1]
                del free[-fit:]
                stored = new[:fit]
                index.update(zip(stored, slots))
                for slot, key in zip(slots, stored):
                    key_at[slot] = key
                # The request's cold tail is in its last job; the policy hears of the written keys
                # among it (the daemon counts them the same way).
                tail = set(job[-cold:]) if cold and start + part >= len(request) else ()
                policy.inserted(slots, stored, True, sum(map(tail.__contains__, stored)) if tail else 0)
    return Result(hits, refs, evictions, not_stored, policy.stats())


def main(argv: Sequence[str] | None = None) -> int:
    from kvtierd.policy import POLICIES, reference
    known = list(POLICIES)
    ap = argparse.ArgumentParser(prog="python -m kvtierbench.traces",
                                 description="Prefix hit rate of each policy vs Belady, replayed in-process; "
                                             "prints a Markdown table.")
    ap.add_argument("trace", nargs="+", help="Mooncake-format JSON-lines file(s)")
    ap.add_argument("--capacity", default=",".join(map(str, DEFAULT_CAPACITIES)),
                    help="fractions of the distinct blocks, comma-separated")
    ap.add_argument("--policy", default=",".join(known), help=f"comma-separated, of {', '.join(known)}")
    ap.add_argument("--slice", help="START:STOP: replay only these requests (replay order)")
    ap.add_argument("--full-blocks", action="store_true", help="drop each prompt's partial last block")
    ap.add_argument("--job-keys", type=int, help="store a request's missing keys in jobs of at most this many")
    args = ap.parse_args(argv)
    names = args.policy.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown policy {', '.join(unknown)}; known: {', '.join(known)}")
    fractions = [float(c) for c in args.capacity.split(",")]
    print("| trace | capacity | blocks | Belady | " + " | ".join(names) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(names))
    for path in args.trace:
        try:
            trace = load(path)
            if args.slice:
                a, _, b = args.slice.partition(":")
                trace = trace.slice(int(a or 0), int(b) if b else len(trace.requests))
            if args.full_blocks:
                trace = trace.full_blocks()
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for fraction in fractions:
            cap = capacity(trace, fraction)
            best = belady(trace, cap).hit_rate
            rates = {name: replay(trace, reference(name), cap, job_keys=args.job_keys).hit_rate for name in names}
            cells = []
            for name in names:
                rate = rates[name]
                cell = f"{rate:.3f} ({rate / best if best else 0:.2f}"
                if "lru" in rates and name != "lru":
                    cell += f", {rate / rates['lru'] if rates['lru'] else 0:.2f}x LRU"
                cells.append(cell + ")")
            print(f"| {trace.name} | {fraction:g} | {cap} | {best:.3f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvtierbench.traces: reading Mooncake-format traces, the Belady reference, the policy replay.

Every hit count asserted here is computed independently of the code under test: by hand for a
tiny trace (worked in the comments), by exhaustive search for Belady on small random traces, and
by plain list-based re-implementations of LRU and SLRU (tests/policy_models.py) on generated
traces.
"""

from __future__ import annotations

import json
import random
from itertools import combinations
from pathlib import Path

import pytest

from kvtierbench import traces
from kvtierbench.traces import Trace, TraceError, belady, capacity, load, replay
from kvtierd.policy import POLICIES, reference as create
from kvtierd.policy.lru import LRUPolicy
from kvtierd.policy.slru import SLRUPolicy

from ..policy_models import ListLRU, ListSLRU, conversations, row


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------- reading
def test_load_orders_by_timestamp_stably_and_keeps_lengths(tmp_path):
    f = write(tmp_path / "t.jsonl", [row(5, [0, 1], 1000), row(1, [0, 2], 600), "", row(5, [3], 10)])
    t = load(f)
    assert t.requests == [[0, 2], [0, 1], [3]]
    assert t.input_lengths == [600, 1000, 10]
    assert (t.references, t.distinct) == (5, 4)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "a request is a JSON object"),
    (json.dumps({"hash_ids": [1]}), "no 'timestamp'"),
    (json.dumps({"timestamp": 1}), "no 'hash_ids'"),
    (json.dumps({"timestamp": "soon", "hash_ids": [1]}), "'timestamp' must be a number"),
    (json.dumps({"timestamp": True, "hash_ids": [1]}), "'timestamp' must be a number"),
    (json.dumps({"timestamp": 1, "hash_ids": [1, -2]}), "integers in [0, 2**64)"),
    (json.dumps({"timestamp": 1, "hash_ids": [1.5]}), "integers in [0, 2**64)"),
    (json.dumps({"timestamp": 1, "hash_ids": "1,2"}), "integers in [0, 2**64)"),
    (json.dumps({"timestamp": 1, "hash_ids": [1], "input_length": -3}), "'input_length' must be"),
])
def test_a_bad_line_is_named(tmp_path, line, message):
    f = write(tmp_path / "bad.jsonl", [row(0, [9]), line])
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: .*" + message.replace("[", r"\[").replace("*", r"\*")
                       .replace("(", r"\(").replace(")", r"\)")):
        load(f)


@pytest.mark.parametrize("rows, what", [
    ([row(0, [1, 2]), row(1, [3, 2])], "id 2 after 3, an earlier one after 1"),
    ([row(0, [1, 2]), row(1, [2])], "id 2 after the start, an earlier one after 1"),
    ([row(0, [1, 2, 1])], "id 1 after 2, an earlier one after the start"),
])
def test_ids_that_do_not_stand_for_one_prefix_are_refused(tmp_path, rows, what):
    with pytest.raises(TraceError, match=what):
        load(write(tmp_path / "t.jsonl", rows))


def test_missing_and_empty_files_are_refused(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load(write(tmp_path / "empty.jsonl", ["", "  "]))


def test_slices_full_blocks_and_capacity(tmp_path):
    t = load(write(tmp_path / "t.jsonl", [row(0, [0, 1, 2], 1100), row(1, [0, 1], 1024), row(2, [5], 3)]))
    full = t.full_blocks()
    assert full.requests == [[0, 1], [0, 1], []]     # 1100 and 3 tokens end in a partial block
    assert (t.cold_tails(), full.cold_tails()) == ([1, 0, 1], [0, 0, 0])
    assert t.slice(1, 3).requests == [[0, 1], [5]]
    assert capacity(t, 0.5) == 2 and capacity(t, 0.0001) == 1
    no_lengths = Trace("x", [[1]])
    with pytest.raises(TraceError, match="input_length"):
        no_lengths.full_blocks()


# ---------------------------------------------------------------------------- a tiny hand-worked trace
# Capacity 3 blocks. A two-block prefix [1, 2] comes back every few requests; one-time requests
# come in between.
#
# LRU. r1 stores 1, 2. r2 hits 1, 2 (2 hits). r3 stores 5, r4 evicts 1 (the oldest) for 6.
# r5: 1 is gone, so 0 hits, although 2 is cached; the store touches 2 then evicts 5 for 1. r6
# evicts 6 for 7, r7 evicts 2 for 8. r8 hits 1 only (1 hit). Total 3.
#
# SLRU (protected share 0.5: int(0.5 x 3) = 1 protected entry); every request ends in a partial
# block (its store says cold_tail 1). r1: probation [2, 1] (the chain goes in tail first; 2 is
# its cold last key: first in line). r2 hits 2: the lookup marks them,
# the load's release promotes both and the overflow (1, the older) goes back: probation [1],
# protected [2]. r3: probation [5, 1] (5 refused: first in line). r4 evicts 5:
# probation [6, 1]. r5 hits 1, 2 (2 hits): 1 promoted then demoted again, 2 stays protected.
# r6 evicts 6, r7 evicts 7. r8 hits 2. Total 6.
#
# Belady keeps 1 and 2 throughout: 2 + 2 + 2 = 6 hits. References: 12.
TINY = [[1, 2], [1, 2], [5], [6], [1, 2], [7], [8], [1, 2]]


def test_tiny_trace_by_hand():
    t = Trace("tiny", TINY, [512 * len(ids) - 1 for ids in TINY])
    assert t.references == 12 and t.cold_tails() == [1] * len(TINY)
    assert replay(t, LRUPolicy(), 3, check=True).hits == 3
    assert replay(t, SLRUPolicy(0.5), 3, check=True).hits == 6
    assert belady(t, 3).hits == 6


# ---------------------------------------------------------------------------- Belady vs exhaustive search
def prefix_hits(ids, cache) -> int:
    n = 0
    for i in ids:
        if i not in cache:
            break
        n += 1
    return n


def optimum(requests, cap) -> int:
    """The most prefix hits over every choice of what to keep after each request."""
    best = {frozenset(): 0}
    for ids in requests:
        nxt: dict[frozenset, int] = {}
        for cache, hits in best.items():
            total = hits + prefix_hits(ids, cache)
            pool = sorted(cache | set(ids))
            for k in range(min(cap, len(pool)) + 1):
                for keep in combinations(pool, k):
                    key = frozenset(keep)
                    if nxt.get(key, -1) < total:
                        nxt[key] = total
        best = nxt
    return max(best.values())


def random_tree_trace(rng: random.Random, requests: int, max_blocks: int) -> list[list[int]]:
    child: dict[tuple[int, int], int] = {}
    out = []
    while len(out) < requests:
        ids, parent = [], -1
        for _ in range(rng.randint(1, 3)):
            key = (parent, rng.randrange(2))
            if key not in child:
                if len(child) == max_blocks:
                    break
                child[key] = len(child)
            parent = child[key]
            ids.append(parent)
        if ids:
            out.append(ids)
    return out


@pytest.mark.parametrize("seed", range(25))
def test_belady_is_the_optimum_of_prefix_hits(seed):
    rng = random.Random(seed)
    requests = random_tree_trace(rng, rng.randint(3, 7), max_blocks=7)
    t = Trace("random", requests)
    for cap in range(1, min(4, t.distinct) + 1):
        best = optimum(requests, cap)
        assert belady(t, cap).hits == best
        assert belady(t, cap, bypass=False).hits <= best
        for name in POLICIES:                      # nothing online does better
            assert replay(t, create(name), cap, check=True).hits <= best


# ---------------------------------------------------------------------------- replay vs plain re-implementations
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("variant", ["partial last blocks", "full blocks", "jobs of 2 keys"])
def test_replay_matches_plain_lru_and_slru(tmp_path, seed, variant):
    t = load(write(tmp_path / "talks.jsonl", conversations(seed, 35)))
    job_keys = 2 if variant == "jobs of 2 keys" else None
    if variant == "full blocks":
        t = t.full_blocks()
    assert t.cold_tails() == [int(variant != "full blocks")] * len(t.requests)
    for cap in (4, 8, 16):
        assert replay(t, LRUPolicy(), cap, check=True, job_keys=job_keys).hits == \
            replay(t, ListLRU(), cap, job_keys=job_keys).hits
        slru = replay(t, SLRUPolicy(0.5), cap, check=True, job_keys=job_keys)
        assert slru.hits == replay(t, ListSLRU(0.5), cap, job_keys=job_keys).hits
        # ListSLRU remembers every key: the same as the sketch until it first ages (256 keys)
        assert slru.stats["admitted"] + slru.stats["refused"] + slru.stats["extra"]["remembered"] < 256


def test_replay_stores_no_more_than_fits(tmp_path):
    t = Trace("long", [list(range(10)), list(range(10))])
    r = replay(t, LRUPolicy(), 4, check=True)
    # r1 stores 0-3 (6 keys do not fit). r2 hits 0-3; its store job of 4-9 may evict them (the
    # daemon excludes only the job's own keys) and stores 4-7 (2 do not fit).
    assert (r.hits, r.not_stored) == (4, 8)


def test_command_line_prints_the_table(tmp_path, capsys):
    f = write(tmp_path / "talks.jsonl", conversations(0, 30))
    assert traces.main([str(f), "--capacity", "0.2", "--policy", "lru,slru"]) == 0
    out = capsys.readouterr().out
    assert "| talks.jsonl | 0.2 |" in out and "Belady" in out and "x LRU" in out
    assert traces.main([str(tmp_path / "missing.jsonl")]) == 2

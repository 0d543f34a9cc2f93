"""The eviction policies through a real daemon: a trace replayed by ``kvtierbench.policy`` (the
code of ``kvtierctl bench policy``) gets exactly the hits that plain re-implementations of LRU
and SLRU (tests/policy_models.py) get on the same requests, replayed in-process;
``kvtierctl bench policy --trace FILE`` prints the hit rates beside Belady's for a file it has
never seen; the client's store hints reach the policy, and kvtierctl stats shows what it did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtierbench import traces
from kvtierbench.policy import replay_through, replay_daemon

from ..policy_models import ListLRU, ListSLRU, conversations

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BIN = os.path.dirname(sys.executable)


def write_trace(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("policy, model, job_keys", [("lru", ListLRU, None), ("slru", lambda: ListSLRU(0.5), None),
                                                     ("slru", lambda: ListSLRU(0.5), 2)])
def test_hits_through_a_daemon_equal_a_plain_model(tmp_path, policy, model, job_keys):
    # 35 requests of a chat-shaped trace, every prompt ending in a partial block (cold_tail 1);
    # fewer than 256 keys are stored, so the sketch has not aged yet and remembers what the
    # plain SLRU remembers (every key it saw).
    trace = traces.load(write_trace(tmp_path / "talks.jsonl", conversations(3, 35)))
    assert traces.replay(trace, ListLRU(), 4).hits < traces.replay(trace, ListLRU(), 16).hits
    for blocks in (4, 8, 16):
        expected = traces.replay(trace, model(), blocks, job_keys=job_keys).hits
        daemon, namespace = replay_daemon(str(tmp_path / f"{policy}-{blocks}"), policy, blocks)
        try:
            daemon.start()
            run = replay_through(daemon, trace, namespace, job_keys)
            stats = daemon.stats()
        finally:
            daemon.cleanup()
        assert (run["hits"], run["references"]) == (expected, trace.references), blocks
        assert stats["policy"] == policy and stats["pages_total"] == blocks
        assert stats["evictions"] > 0 and sum(stats["policy_evictions"].values()) == stats["evictions"]
        if policy == "slru":
            assert stats["policy_refused_keys"] > 0        # the partial last blocks: placed first in line


def test_kvtierctl_bench_policy_on_a_trace_it_has_never_seen(tmp_path):
    path = write_trace(tmp_path / "unseen.jsonl", conversations(11, 60))
    out = subprocess.run([os.path.join(BIN, "kvtierctl"), "bench", "policy", "--quick", "--trace", path,
                          "--capacity", "0.1,0.3", "--policies", "slru", "--json"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-4000:]
    section = json.loads(out.stdout)["sections"]["policy"]
    trace = traces.load(path)
    rows = {(r["policy"], r["capacity"]): r for r in section["rows"]}
    assert set(rows) == {(p, c) for p in ("lru", "slru") for c in (0.1, 0.3)}   # LRU always: the reference
    for (policy, fraction), r in rows.items():
        blocks = traces.capacity(trace, fraction)
        assert r["trace"] == "unseen.jsonl" and r["blocks"] == blocks and r["references"] == trace.references
        assert r["belady"] == traces.belady(trace, blocks).hit_rate
        assert 0 < r["hit_rate"] <= r["belady"] and r["x_belady"] == r["hit_rate"] / r["belady"]
        if policy == "lru":
            assert r["hits"] == traces.replay(trace, ListLRU(), blocks).hits
        assert r["x_lru"] == r["hit_rate"] / rows[("lru", fraction)]["hit_rate"]
    assert {(r["op"], r["policy"]) for r in section["more"]["cost"]} == {
        (op, p) for op in ("lookup", "load", "store") for p in ("lru", "slru")}
    names = [t["name"] for t in section["targets"]]
    assert any("vs Belady at 10% capacity (unseen.jsonl)" in n for n in names)
    assert any("vs LRU's, worst cell" in n for n in names) and any("CPU per key" in n for n in names)


def test_a_bad_trace_is_refused_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "hash_ids": [1, 2]}\n{"timestamp": 2}\n')
    out = subprocess.run([os.path.join(BIN, "kvtierctl"), "bench", "policy", "--trace", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "bad.jsonl:2: no 'hash_ids'" in out.stderr, out.stderr
    assert "[bench]" not in out.stderr                     # refused before any section started


def test_client_store_hints_reach_the_policy_and_stats_show_them(start_daemon):
    import torch

    from kvtier import Client, NamespaceId
    daemon = start_daemon(size="12MiB")
    kv = torch.zeros((8, 4096), dtype=torch.uint8)
    ns = NamespaceId(model="hints", dtype="uint8", block_tokens=16, block_bytes=4096)
    with Client(daemon.socket, engine_id="hints", rank=0, world_size=1, namespace=ns, copier="cpu",
                pin="off") as client:
        client.register_kv_caches([kv])
        client.store(1, [b"a%d" % i for i in range(4)], list(range(4)), cold_tail=1)
        client.store(2, [b"b%d" % i for i in range(4)], list(range(4, 8)), chain=False)
        assert all(r.ok for r in client.wait([1, 2]))
        assert client.lookup([b"a0", b"a1"]) == 2
    stats = daemon.stats()
    assert (stats["policy"], stats["policy_admitted_keys"], stats["policy_refused_keys"]) == ("slru", 7, 1)
    text = subprocess.run([os.path.join(BIN, "kvtierctl"), "--socket", daemon.socket, "stats"], capture_output=True,
                          text=True, timeout=30).stdout
    assert "lookup_hit_rate" in text and "1.000 of 2 keys" in text
    assert "policy_segments" in text and "probation=8" in text

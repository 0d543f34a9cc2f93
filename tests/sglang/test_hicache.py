"""SGLang 0.5.23's HiCache against a real kvtierd, through SGLang's own tree and controller.

Every SGLang scheduler process (TP rank, or "instance") is a child process built by
tests/sglang/harness.py: ``create_tree_cache`` → ``UnifiedRadixCache`` + ``HybridCacheController``
→ the ``dynamic`` storage factory → ``KvtierStorage``. Pages go L1 (device pool) → L2 (host pool)
→ L3 (kvtierd) and back, and the bytes that arrive are compared with what the fake model wrote
for those tokens. Needs CUDA for real: the L1↔L2 copy (``sgl_kernel``'s ``transfer_kv_direct``,
replaced by a torch index copy here) — see test_gpu_hicache.py.
"""

from __future__ import annotations

import importlib.util
import signal
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: `make test-sglang` builds .venv-sglang", allow_module_level=True)

from tests.procs import all_call  # noqa: E402
from tests.sglang.harness import RankProcess, RankSpec  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PAGE = 4
PROMPT = list(range(1000, 1032))             # 8 pages
SHARED = PROMPT[:16] + list(range(2000, 2016))   # shares its first 4 pages with PROMPT


@pytest.fixture
def ranks():
    """Factory: ranks(*specs) → ready RankProcess per spec (started together); all stopped after."""
    started: list[RankProcess] = []

    def start(*specs: RankSpec) -> list[RankProcess]:
        procs = [RankProcess(spec) for spec in specs]
        started.extend(procs)
        return [p.ready() for p in procs]

    yield start
    for p in started:
        p.stop()


def pages(tokens) -> int:
    return len(tokens) // PAGE


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("writer_v1, reader_v1", [(True, False), (False, True)], ids=["v1-then-generic",
                                                                                       "generic-then-v1"])
def test_l1_l2_l3_l2_l1_round_trip_and_a_second_instance_hits(daemon, ranks, kind, writer_v1, reader_v1):
    """One instance stores two prompts (sharing a prefix) through write-through and backup, drops
    them from L1 and L2, and gets them back from kvtierd byte for byte; a second instance (another
    engine, the other storage path) hits what the first stored."""
    (a,) = ranks(RankSpec(kind, daemon.socket, engine_id="instance-a", interface_v1=writer_v1))
    a.call("write", tokens=PROMPT)
    a.call("write", tokens=SHARED)
    stats = daemon.stats()
    assert stats["store_written_keys"] == pages(PROMPT) + pages(SHARED) - 4     # the shared prefix once
    info = a.call("backend_info")
    assert info["sharding"] == ("replicated" if kind == "mla" else "sharded")
    assert stats["namespace_list"][0]["name"].startswith(info["namespace"])

    a.call("evict_all")
    assert a.call("fetch", tokens=PROMPT) == {"host_hit": 32, "device": 32, "correct": 32, "correct_own": 32}
    # SHARED's first 16 tokens are back on the device; the other 16 come from kvtierd.
    assert a.call("fetch", tokens=SHARED) == {"host_hit": 16, "device": 32, "correct": 32, "correct_own": 32}
    assert daemon.stats()["load_hit_keys"] == pages(PROMPT) + 4

    (b,) = ranks(RankSpec(kind, daemon.socket, engine_id="instance-b", interface_v1=reader_v1))
    assert b.call("backend_info")["namespace"] == info["namespace"]
    got = b.call("fetch", tokens=SHARED)
    assert (got["host_hit"], got["correct"]) == (len(SHARED), len(SHARED))
    assert daemon.stats()["engines"] == 2


def test_tp2_mla_writes_one_copy_and_both_ranks_load_rank0s_bytes(daemon, ranks):
    """MLA at TP=2, one process per rank: SGLang backs up on its storage writer (rank 0) only;
    kvtierd keeps one copy, becomes ready on rank 0's commit, and rank 1 — whose own KV differs
    (variant 1) — loads rank 0's bytes."""
    r0, r1 = ranks(*[RankSpec("mla", daemon.socket, tp_rank=r, tp_size=2, variant=r) for r in (0, 1)])
    infos = [r0.call("backend_info"), r1.call("backend_info")]
    assert [i["writer"] for i in infos] == [True, False]
    assert infos[0]["namespace"] == infos[1]["namespace"] and infos[0]["sharding"] == "replicated"
    assert infos[0]["engine"] != infos[1]["engine"] and infos[0]["world_size"] == 1

    all_call([r0, r1], "write", tokens=PROMPT)
    stats = daemon.stats()
    n = pages(PROMPT)
    assert stats["store_written_keys"] == n
    assert stats["bytes_written"] == n * infos[0]["block_bytes"]            # one copy, not two
    assert stats["requests"]["store"] == 1 and stats["requests"]["commit"] == 1   # rank 1 never stored

    all_call([r0, r1], "evict_all")
    got0, got1 = all_call([r0, r1], "fetch", tokens=PROMPT)
    assert got0["host_hit"] == got1["host_hit"] == len(PROMPT)
    assert got0["correct"] == len(PROMPT)
    assert got1["correct"] == len(PROMPT) and got1["correct_own"] == 0     # rank 0's bytes, not its own


def test_tp2_mha_is_sharded_and_ready_only_when_both_ranks_voted(daemon, ranks):
    """MHA at TP=2: each rank stores its own heads under the same SGLang keys in one sharded
    kvtier engine; a page is visible only after both ranks' stores; each rank gets its shard back."""
    r0, r1 = ranks(*[RankSpec("mha", daemon.socket, tp_rank=r, tp_size=2, variant=r) for r in (0, 1)])
    infos = [r0.call("backend_info"), r1.call("backend_info")]
    assert infos[0]["engine"] == infos[1]["engine"] and [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 and i["sharding"] == "sharded" and i["writer"] for i in infos)

    r0.call("write", tokens=PROMPT)
    assert r0.call("lookup", tokens=PROMPT) == 0                  # rank 1 has not stored its shard yet
    r1.call("write", tokens=PROMPT)
    assert all_call([r0, r1], "lookup", tokens=PROMPT) == [pages(PROMPT)] * 2
    stats = daemon.stats()
    assert stats["bytes_written"] == pages(PROMPT) * infos[0]["block_bytes"] * 2
    assert stats["namespace_list"][0]["name"].endswith("sharded/tp2")

    all_call([r0, r1], "evict_all")
    got = all_call([r0, r1], "fetch", tokens=PROMPT)
    assert [g["host_hit"] for g in got] == [len(PROMPT)] * 2
    assert [g["correct_own"] for g in got] == [len(PROMPT)] * 2   # each rank its own heads
    assert got[1]["correct"] < len(PROMPT)                        # (rank 1's heads differ from rank 0's)


def test_kvtierd_restarted_mid_run(start_daemon, ranks):
    """kvtierd killed and restarted under a running instance: pages stored before survive, the
    backend re-attaches by itself, and while kvtierd is away SGLang's calls come back as misses
    and failed backups within the bounded timeout instead of raising or hanging."""
    daemon = start_daemon()
    (a,) = ranks(RankSpec("mha", daemon.socket, engine_id="restarts", extra={"kvtier_timeout_s": 1,
                                                                             "kvtier_retry_s": 0.5}))
    a.call("write", tokens=PROMPT)

    daemon.stop(signal.SIGKILL)                    # gone without a word: the socket file stays
    daemon.start()
    a.call("write", tokens=SHARED)                 # the first request finds the new daemon
    assert daemon.stats()["store_written_keys"] == pages(SHARED) - 4

    daemon.stop(signal.SIGKILL)
    other = list(range(5000, 5016))
    down = a.call("timed", method="write", tokens=other)
    assert down["seconds"] < 20                    # bounded: ~3 × kvtier_timeout_s, not a hang
    a.call("evict_all")
    miss = a.call("timed", method="fetch", tokens=PROMPT)
    assert miss["result"]["host_hit"] == 0 and miss["seconds"] < 20

    daemon.start()
    time.sleep(0.6)                                # kvtier_retry_s: then kvtierd is asked again
    assert a.call("fetch", tokens=PROMPT) == {"host_hit": 32, "device": 32, "correct": 32, "correct_own": 32}
    assert a.call("fetch", tokens=SHARED) == {"host_hit": 16, "device": 32, "correct": 32, "correct_own": 32}
    assert a.call("lookup", tokens=other) == 0     # what was offered while kvtierd was away is not cached


def test_a_planned_restart_is_invisible_beyond_its_own_duration(start_daemon, ranks):
    """kvtierd restarted as systemctl restart does (SIGTERM, then start) under a running instance:
    a backup while it is down fails quietly, and once it serves again the pages stored before come
    back byte for byte, nothing recomputed; what was offered meanwhile is not cached."""
    daemon = start_daemon()
    spec = RankSpec("mha", daemon.socket, engine_id="planned", extra={"kvtier_timeout_s": 1, "kvtier_retry_s": 600})
    (a,) = ranks(spec)
    a.call("write", tokens=PROMPT)
    assert daemon.stop(signal.SIGTERM) == 0
    other = list(range(6000, 6016))
    a.call("write", tokens=other)                  # kvtierd is down: the backup fails, nothing raises
    a.call("evict_all")
    daemon.start()
    assert a.call("fetch", tokens=PROMPT) == {"host_hit": 32, "device": 32, "correct": 32, "correct_own": 32}
    assert a.call("lookup", tokens=other) == 0


def test_an_instance_that_found_kvtierd_restarting_attaches_as_soon_as_it_serves(start_daemon, ranks):
    """An instance that starts while kvtierd restarts cannot attach; with kvtier_retry_s at 600 s
    it still attaches as soon as kvtierd serves again (its socket reappears), and hits what
    another instance stored before the restart."""
    daemon = start_daemon()
    extra = {"kvtier_timeout_s": 1, "kvtier_retry_s": 600}
    (a,) = ranks(RankSpec("mha", daemon.socket, engine_id="before", extra=extra))
    a.call("write", tokens=PROMPT)
    assert daemon.stop(signal.SIGTERM) == 0
    (b,) = ranks(RankSpec("mha", daemon.socket, engine_id="during", extra=extra))
    assert b.call("lookup", tokens=PROMPT) == 0    # kvtierd is down: a miss at once
    daemon.start()
    got = b.call("fetch", tokens=PROMPT)
    assert (got["host_hit"], got["correct"]) == (len(PROMPT), len(PROMPT))

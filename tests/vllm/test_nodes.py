"""An engine whose TP group spans nodes, through vLLM 0.33's real Scheduler and worker connector:
vLLM's ``mp`` executor with ``--nnodes 2`` (each rank's config says its node), the scheduler and
ranks 0-1 on node A's kvtierd, ranks 2-3 on node B's (two daemons on one machine stand for two
nodes). harness.py says what is real and what stands in.

- the topology the plugin reads from vLLM's config: two ranks per node, each session naming its
  node's ranks; the MLA gate holds across nodes where vLLM's own (single-node ``mp``) does not;
  ``external_launcher`` refused; a world on more nodes than the config says refused, naming
  ``kvtier_ranks_per_node``;
- an MLA engine caches one copy per node (ranks 0 and 2 write) and every rank loads it byte-exact,
  node B's ranks from node B's kvtierd, without the lease (it lives on node A);
- blocks evicted on node B only, in the request's load window: node A's ranks load every block,
  node B's the prefix B holds, and vLLM recomputes from exactly the first block B lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

from vllm.config import ParallelConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvtier.integrations.vllm import topology  # noqa: E402

from .harness import BLOCK_TOKENS, EngineRecipe, all_call, build, running, serve_twice  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(6 * BLOCK_TOKENS + 5)]     # 6 full blocks + 5 tokens
FULL = len(PROMPT) // BLOCK_TOKENS


def two_nodes(start_daemon) -> list:
    return [start_daemon(page_size="4KiB"), start_daemon(page_size="4KiB")]


def recipe(nodes, engine_id: str) -> EngineRecipe:
    return EngineRecipe("tiny-mla", 4, nodes[0].socket, engine_id, node_sockets=tuple(d.socket for d in nodes))


def settled(daemon) -> dict:
    stats = daemon.stats()
    assert (stats["open_jobs"], stats["entries_writing"], stats["entries_pinned"]) == (0, 0, 0), stats
    return stats


def test_the_topology_comes_from_vllms_parallel_config():
    plan = EngineRecipe("tiny-mla", 4, "/a", "topo", node_sockets=("/a", "/b"))
    for rank in range(4):
        vllm_config, kv_cache_config = build(plan, rank)
        placed = topology.from_vllm_config(vllm_config, kv_cache_config)
        assert (placed.ranks_per_node, placed.nodes, placed.replicated) == (2, 2, True)
        assert placed.node_ranks(rank) == ((0, 1) if rank < 2 else (2, 3))
    assert placed.node_ranks(0) == (0, 1)                       # the scheduler's: rank 0's node
    assert placed.with_ranks_per_node(4).node_ranks(3) == (0, 1, 2, 3)
    gqa, kv = build(EngineRecipe("tiny-llama", 4, "/a", "topo", node_sockets=("/a", "/b")), 2)
    assert topology.from_vllm_config(gqa, kv).replicated is False
    with pytest.raises(ValueError, match="do not divide"):
        placed.with_ranks_per_node(3)


def test_external_launcher_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))
    parallel = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="external_launcher"):
        topology.from_vllm_config(SimpleNamespace(parallel_config=parallel), None)


def test_a_world_on_more_nodes_than_the_config_says_is_refused_naming_the_setting():
    one_node = topology.Topology(16, 16, True)                  # e.g. Ray: vLLM's config says one node
    with pytest.raises(ValueError, match="kvtier_ranks_per_node"):
        one_node.check_nodes(2)
    one_node.check_nodes(1)
    one_node.check_nodes(None)                                  # unknown: nothing to check
    one_node.with_ranks_per_node(8).check_nodes(2)


def test_an_mla_engine_on_two_nodes_caches_one_copy_per_node(start_daemon):
    nodes = two_nodes(start_daemon)
    with running(recipe(nodes, "mla-2n")) as (engine, ranks):
        infos = all_call(ranks, "info")
        assert [i["writer"] for i in infos] == [True, False, True, False]            # each node's lowest rank
        assert all(i["sharding"] == "replicated" and i["replicated_gate"] is False for i in infos)
        request, right_bytes = serve_twice(engine, ranks, PROMPT)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        assert engine.first_computed["again"] == FULL * BLOCK_TOKENS                  # nothing recomputed
    block_bytes = infos[0]["block_bytes"]
    for daemon in nodes:
        stats = settled(daemon)
        assert stats["bytes_written"] == FULL * block_bytes                         # one copy per node
        assert stats["load_hit_keys"] == FULL and stats["load_miss_keys"] == 0
    assert nodes[0].stats()["lease_ends"]["consumed"] >= 1
    assert nodes[1].stats()["lease_missed_loads"] == 0          # node B's ranks never named node A's lease


def test_blocks_evicted_on_node_b_only_are_recomputed_from_the_first_missing_one(start_daemon):
    nodes = two_nodes(start_daemon)
    evict_on_b = [os.path.join(os.path.dirname(sys.executable), "kvtierctl"), "--dir", nodes[1].dir, "evict",
                  "--count", "2"]
    with running(recipe(nodes, "mla-2n-evict")) as (engine, ranks):
        request, right_bytes = serve_twice(engine, ranks, PROMPT,
                                           lambda: subprocess.run(evict_on_b, check=True, capture_output=True))
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        loaded = engine.first_computed["again"] // BLOCK_TOKENS
    a, b = settled(nodes[0]), settled(nodes[1])
    assert a["load_hit_keys"] == FULL                           # node A's ranks loaded every block
    assert b["operator_evictions"] == 2 and b["load_hit_keys"] == FULL - 2
    assert loaded == FULL - 2                                   # vLLM computed exactly what B lacked

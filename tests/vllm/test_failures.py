"""Loads that fail after vLLM's lookup said HIT: never an AssertionError, never wrong bytes.

Through vLLM 0.33's real Scheduler and worker connector (``KvtierOffloadingConnector``) and a real
kvtierd: between a request's lookup (HIT) and its load, its blocks are taken away — another
engine fills the region, ``kvtierctl clear``, or part of them is evicted. The workers report
what did not arrive; vLLM recomputes it (``kv_load_failure_policy`` "recompute") or ends that
one request with an error ("fail"), and the engine serves on. Without leases (phase 2) this
window stays open; these tests pin down that it is harmless.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvtier import Client, NamespaceId  # noqa: E402

from .harness import BLOCK_TOKENS, EngineRecipe, holds, running, serve_twice  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = [(11 * i + 5) % 250 + 3 for i in range(5 * BLOCK_TOKENS + 7)]    # 5 full blocks + 7 tokens
FULL = len(PROMPT) // BLOCK_TOKENS
OTHER = [(13 * i + 1) % 250 + 3 for i in range(3 * BLOCK_TOKENS + 1)]


def kvtierctl(daemon, *args: str) -> None:
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvtierctl"), "--dir", daemon.dir, *args],
                   check=True, capture_output=True)


def serves_on(engine, ranks) -> bool:
    """The engine still serves: another request runs to its end with the right bytes."""
    request, blocks = engine.serve("after", OTHER)
    return request.status == RequestStatus.FINISHED_LENGTH_CAPPED and holds(ranks, blocks, OTHER)


def fill_region(daemon, block_bytes: int) -> None:
    """Another engine (another model) opens stores for as many blocks as the region holds: every
    evictable block of ours is evicted to make room."""
    stats = daemon.stats()
    capacity = stats["pages_total"] // -(-block_bytes // stats["page_size"])
    other = Client(daemon.socket, engine_id="filler", rank=None, world_size=1,
                   namespace=NamespaceId("another-model", "bfloat16", BLOCK_TOKENS, block_bytes, "sharded"))
    try:
        for job, begin in enumerate(range(0, capacity, 4096), start=1):
            other.open_store(job, [b"fill%09d" % i for i in range(begin, min(capacity, begin + 4096))])
    finally:
        other.close()            # its jobs are aborted with its session, after our load failed


@pytest.mark.parametrize("window", ["another engine fills the region", "kvtierctl clear"])
def test_blocks_gone_before_the_load_are_recomputed(start_daemon, window):
    daemon = start_daemon(page_size="4KiB", size="8MiB")
    with running(EngineRecipe("tiny-llama", 1, daemon.socket, "race")) as (engine, ranks):
        block_bytes = engine.manager.namespace.block_bytes
        action = ((lambda: fill_region(daemon, block_bytes)) if window.startswith("another")
                  else (lambda: kvtierctl(daemon, "clear", "--all")))
        request, right_bytes = serve_twice(engine, ranks, PROMPT, action)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        assert engine.first_computed["again"] == 0              # nothing arrived: all recomputed
        assert engine.manager.stats.load_failures == 1
        assert serves_on(engine, ranks)
    assert daemon.stats()["load_hit_keys"] == 0


def test_a_partly_evicted_prefix_loads_what_is_left_and_recomputes_the_rest(start_daemon):
    # LRU: the tail is evicted by touching the head and evicting the least recently used rest; the
    # default policy (slru) chooses other victims here, by design (tests/unit/test_policy_slru.py).
    daemon = start_daemon("--policy", "lru", page_size="4KiB")
    kept = 2
    with running(EngineRecipe("tiny-llama", 1, daemon.socket, "partial")) as (engine, ranks):
        manager = engine.manager

        def evict_the_tail():
            # The lookup touched the prefix in order, so its head is least recently used: touch the
            # head again, then evict the LRU rest.
            keys = [make_offload_key(h, 0) for h in engine.scheduler.requests["again"].block_hashes[:FULL]]
            toucher = Client(daemon.socket, engine_id="toucher", rank=None, world_size=1, namespace=manager.namespace)
            try:
                touched = toucher.lookup(keys[:kept])
            finally:
                toucher.close()
            kvtierctl(daemon, "evict", "--count", str(FULL - kept))
            assert touched == kept

        request, right_bytes = serve_twice(engine, ranks, PROMPT, evict_the_tail)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        assert engine.first_computed["again"] == kept * BLOCK_TOKENS     # the rest was recomputed
        assert serves_on(engine, ranks)
    assert daemon.stats()["load_hit_keys"] == kept


def test_under_the_fail_policy_only_that_request_ends_with_an_error(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "fail", failure_policy="fail")
    with running(recipe) as (engine, ranks):
        request, _ = serve_twice(engine, ranks, PROMPT, lambda: kvtierctl(daemon, "clear", "--all"))
        assert request.status == RequestStatus.FINISHED_ERROR
        assert serves_on(engine, ranks)


def test_under_python_O_a_failed_load_is_still_recomputed_or_stops_the_engine(start_daemon):
    """vLLM's worker only *asserts* that a transfer succeeded; under -O that check is gone. The
    connector path recomputes correctly; the plain spec path stops with kvtier's own error."""
    daemon = start_daemon(page_size="4KiB")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-O", "-m", "tests.vllm.optimized_run", daemon.socket, daemon.dir],
                         cwd=root, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["optimize"] == 1 and result["rank_optimize"] == [1]
    assert result["connector"] == {"status": "FINISHED_LENGTH_CAPPED", "right_bytes": True, "first_computed": 0}
    assert result["plain"] == "LoadFailed"

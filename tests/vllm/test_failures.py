"""Between vLLM's lookup (HIT) and the load: leases keep the blocks; what still fails is never an
AssertionError, never wrong bytes.

Through vLLM 0.33's real Scheduler and worker connector (``KvtierOffloadingConnector``) and a real
kvtierd. In a request's load window another engine fills the region, ``kvtierctl clear`` or
``evict`` runs, or kvtierd restarts: the blocks the lookup leased load in full, with the right
bytes (invariant 10). Where blocks are truly gone — a forced clear revokes the lease, or a block
was never leased (past kvtierd's caps) — the workers report what did not arrive; vLLM recomputes it
(``kv_load_failure_policy`` "recompute") or ends that one request with an error ("fail"), and the
engine serves on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

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


def restart_daemon(daemon) -> None:
    """kvtierd SIGKILLed and started again on the same region (its READY blocks survive)."""
    daemon.stop(signal.SIGKILL)
    daemon.start()


@pytest.mark.parametrize("window", ["another engine fills the region", "kvtierctl clear", "kvtierctl evict",
                                    "kvtierd restarts"])
def test_looked_up_blocks_load_in_full_whatever_happens_before_the_load(start_daemon, window):
    daemon = start_daemon(page_size="4KiB", size="8MiB")
    with running(EngineRecipe("tiny-llama", 1, daemon.socket, "race")) as (engine, ranks):
        block_bytes = engine.manager.namespace.block_bytes
        action = {"another engine fills the region": lambda: fill_region(daemon, block_bytes),
                  "kvtierctl clear": lambda: kvtierctl(daemon, "clear", "--all"),
                  "kvtierctl evict": lambda: kvtierctl(daemon, "evict", "--count", "1000"),
                  "kvtierd restarts": lambda: restart_daemon(daemon)}[window]
        request, right_bytes = serve_twice(engine, ranks, PROMPT, action)
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        assert engine.first_computed["again"] == FULL * BLOCK_TOKENS      # every block loaded, none recomputed
        assert engine.manager.stats.load_failures == 0 and engine.manager.stats.leased_loads == 1
        assert serves_on(engine, ranks)
    stats = daemon.stats()
    assert stats["load_hit_keys"] == FULL and stats["load_miss_keys"] == 0
    if window != "kvtierd restarts":           # the restarted daemon's counters start at its restart
        assert stats["lease_ends"]["consumed"] >= 1 and stats["lease_missed_loads"] == 0


def test_a_forced_clear_revokes_the_lease_and_the_request_is_recomputed(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    with running(EngineRecipe("tiny-llama", 1, daemon.socket, "forced")) as (engine, ranks):
        request, right_bytes = serve_twice(engine, ranks, PROMPT,
                                           lambda: kvtierctl(daemon, "clear", "--all", "--force"))
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        assert engine.first_computed["again"] == 0              # nothing arrived: all recomputed
        assert engine.manager.stats.load_failures == 1
        assert serves_on(engine, ranks)
    stats = daemon.stats()
    assert stats["load_hit_keys"] == 0 and stats["lease_ends"]["revoked"] == 1


def test_blocks_past_the_lease_cap_may_be_evicted_and_only_they_are_recomputed(start_daemon):
    kept = 2
    # The engine's leases may hold kept + 1 (a lease counts its entries plus one): the tail of the
    # hit is not leased, and kvtierctl evict takes exactly it (the leased head is not evictable).
    daemon = start_daemon("--max-leased-keys-per-engine", str(kept + 1), page_size="4KiB")
    with running(EngineRecipe("tiny-llama", 1, daemon.socket, "partial")) as (engine, ranks):
        request, right_bytes = serve_twice(engine, ranks, PROMPT,
                                           lambda: kvtierctl(daemon, "evict", "--count", str(FULL)))
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and right_bytes
        assert engine.first_computed["again"] == kept * BLOCK_TOKENS     # the rest was recomputed
        assert serves_on(engine, ranks)
    stats = daemon.stats()
    assert stats["load_hit_keys"] == kept and stats["lease_capped_keys"] >= FULL - kept


def test_under_the_fail_policy_only_that_request_ends_with_an_error(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "fail", failure_policy="fail")
    with running(recipe) as (engine, ranks):
        request, _ = serve_twice(engine, ranks, PROMPT, lambda: kvtierctl(daemon, "clear", "--all", "--force"))
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

"""vLLM 0.33's own Scheduler and OffloadingConnector, with kvtierd as the offloading tier.

A first request's KV blocks are stored through the plugin; after ``reset_prefix_cache()`` and
zeroing the KV cache, a second request with the same prompt loads them back from kvtierd, and the
bytes must match. With two ranks of an MLA engine (vLLM's replicated gate on), only rank 0 copies
and both ranks load rank 0's bytes. See harness.py for what is real and what stands in.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

from .harness import BLOCK_TOKENS, Engine, EngineRecipe, RankProcess, all_call  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = [(3 * i + 11) % 250 + 3 for i in range(4 * BLOCK_TOKENS + 5)]   # 4 full blocks + 5 tokens
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS


def block_tokens(index: int) -> tuple[int, ...]:
    return tuple(PROMPT[index * BLOCK_TOKENS:(index + 1) * BLOCK_TOKENS])


def run_store_then_load(daemon, model: str, tp: int, engine_id: str, rank_variant: bool = False, **recipe_fields):
    """Request 1 computes and stores; reset + zero; request 2 loads. Returns what the test checks."""
    recipe = EngineRecipe(model=model, tp=tp, socket=daemon.socket, engine_id=engine_id, **recipe_fields)
    ranks = [RankProcess(recipe, r, rank_variant) for r in range(tp)]
    engine = None
    try:
        for r in ranks:
            r.ready()
        info = all_call(ranks, "info")
        engine = Engine(recipe, ranks)

        engine.add_request("first", PROMPT)
        blocks_first = None
        while engine.scheduler.requests:
            engine.step()
            if "first" in engine.scheduler.requests:
                blocks_first = engine.scheduler.kv_cache_manager.get_block_ids("first")[0][:FULL_BLOCKS]
        engine.run()
        stored = daemon.stats()
        written = all_call(ranks, "digests", block_ids=blocks_first)

        engine.forget_prefix_cache()
        all_call(ranks, "zero")
        zeroed = all_call(ranks, "digests", block_ids=blocks_first)

        engine.add_request("second", PROMPT)
        blocks_second = None
        while engine.scheduler.requests:
            if "second" in engine.scheduler.requests and engine.scheduler.kv_cache_manager.get_block_ids("second")[0]:
                blocks_second = engine.scheduler.kv_cache_manager.get_block_ids("second")[0][:FULL_BLOCKS]
            engine.step()
        engine.run()
        loaded = all_call(ranks, "digests", block_ids=blocks_second)
        expected = [ranks[0].call("expected", token_ids=block_tokens(i)) for i in range(FULL_BLOCKS)]
        return {"info": info, "stored": stored, "after": daemon.stats(), "written": written, "zeroed": zeroed,
                "loaded": loaded, "expected": expected, "first_computed": dict(engine.first_computed),
                "blocks_first": blocks_first, "blocks_second": blocks_second}
    finally:
        if engine is not None:
            engine.shutdown()
        for r in ranks:
            r.stop()


@pytest.mark.parametrize("connector", ["KvtierOffloadingConnector", "OffloadingConnector"])
def test_blocks_stored_by_the_first_request_load_into_the_second(start_daemon, connector):
    daemon = start_daemon(page_size="4KiB")
    # Also through vLLM's own OffloadingConnector (the plain spec path), which still works.
    out = run_store_then_load(daemon, "tiny-llama", tp=1, engine_id="tp1", connector=connector)
    (info,) = out["info"]
    assert info["connector"] == connector
    assert info["sharding"] == "sharded" and not info["replicated_gate"] and info["writer"]
    block_bytes = info["block_bytes"]

    # The first request's full prompt blocks went to kvtierd through the plugin.
    stored = out["stored"]
    assert stored["store_written_keys"] == FULL_BLOCKS
    assert stored["bytes_written"] == FULL_BLOCKS * block_bytes
    assert stored["entries_ready"] == FULL_BLOCKS and stored["open_jobs"] == 0
    assert out["written"][0] == out["expected"], "the fake model did not write what the test expects"
    assert all(d != w for d, w in zip(out["zeroed"][0], out["written"][0]))

    # The second request found them in kvtierd, not in vLLM's (reset) prefix cache, and did not
    # compute them: its first forward started after the loaded blocks.
    assert out["first_computed"]["first"] == 0
    assert out["first_computed"]["second"] == FULL_BLOCKS * BLOCK_TOKENS
    after = out["after"]
    assert after["load_hit_keys"] == FULL_BLOCKS and after["load_jobs_done"] == 1
    assert after["entries_pinned"] == 0 and after["open_jobs"] == 0

    # Byte for byte what the first request wrote, in (possibly other) blocks that had been zeroed.
    assert out["loaded"][0] == out["written"][0] == out["expected"]


def test_tp2_mla_only_rank0_writes_and_both_ranks_load_its_bytes(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    # rank_variant: rank 1's "model" writes other bytes than rank 0's, so whatever rank 1 ends up
    # holding after the load can only have come from rank 0's single copy.
    out = run_store_then_load(daemon, "tiny-mla", tp=2, engine_id="tp2-mla", rank_variant=True)
    rank0, rank1 = out["info"]
    assert rank0["replicated_gate"] and rank0["sharding"] == "replicated"
    assert rank0["writer"] and not rank1["writer"]
    assert rank0["namespace"] == rank1["namespace"] and "replicated" in rank0["namespace"]
    block_bytes = rank0["block_bytes"]

    stored = out["stored"]
    assert stored["store_written_keys"] == FULL_BLOCKS
    assert stored["bytes_written"] == FULL_BLOCKS * block_bytes           # one copy, not TP copies
    assert stored["bytes_saved_dedup"] == FULL_BLOCKS * block_bytes * (2 - 1)
    written0, written1 = out["written"]
    assert written0 == out["expected"] and written1 != written0

    after = out["after"]
    assert after["load_hit_keys"] == FULL_BLOCKS and after["load_jobs_done"] == 1
    assert after["bytes_written"] == stored["bytes_written"]              # loads wrote nothing
    assert out["first_computed"]["second"] == FULL_BLOCKS * BLOCK_TOKENS
    loaded0, loaded1 = out["loaded"]
    assert loaded0 == written0 and loaded1 == written0, "both ranks must hold rank 0's bytes"

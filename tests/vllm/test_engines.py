"""Engines sharing one kvtierd, and engines that must not share, through vLLM 0.33's real
Scheduler and worker connector (harness.py says what is real and what stands in).

- two engines (two engine ids) of one model: the second loads what the first stored;
- a TP=4 and a TP=2 engine of one MLA model: the replicated namespace does not depend on TP;
- the weights changed under the same model path: no hit; the same weights again: hits;
- kvtierd killed under a running engine: the engine keeps serving (misses, nothing stored), and
  once kvtierd is back its requests hit again;
- kvtierd restarted as systemctl restart does (SIGTERM, start): the engine attaches again as soon
  as it serves and its next request loads what it stored before, nothing recomputed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from .harness import BLOCK_TOKENS, MODELS, EngineRecipe, all_call, holds, running  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = [(5 * i + 7) % 250 + 3 for i in range(5 * BLOCK_TOKENS + 3)]     # 5 full blocks + 3 tokens
FULL = len(PROMPT) // BLOCK_TOKENS


def loaded_all(engine, request_id: str) -> bool:
    """The request's first forward started after every full block: they all came from kvtierd."""
    return engine.first_computed[request_id] == FULL * BLOCK_TOKENS


def test_a_second_engine_loads_what_the_first_stored(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    first = EngineRecipe("tiny-llama", 1, daemon.socket, "engine-one")
    with running(first) as (engine, ranks):
        engine.serve("a", PROMPT)
        assert engine.first_computed["a"] == 0
        namespace = all_call(ranks, "info")[0]["namespace"]
    stored = daemon.stats()
    assert stored["entries_ready"] == FULL

    second = EngineRecipe("tiny-llama", 1, daemon.socket, "engine-two")
    with running(second) as (engine, ranks):
        assert all_call(ranks, "info")[0]["namespace"] == namespace
        request, blocks = engine.serve("b", PROMPT)
        assert loaded_all(engine, "b") and holds(ranks, blocks, PROMPT)
        # One batched lookup for the request, not one per block (the second engine's only lookup).
        assert engine.manager.stats.batches == 1
    after = daemon.stats()
    assert after["load_hit_keys"] == FULL and after["bytes_written"] == stored["bytes_written"]


def test_tp4_and_tp2_engines_of_one_mla_model_share_its_replicated_namespace(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    wide = EngineRecipe("tiny-mla", 4, daemon.socket, "mla-tp4")
    with running(wide) as (engine, ranks):
        infos = all_call(ranks, "info")
        assert all(i["sharding"] == "replicated" for i in infos)
        assert [i["writer"] for i in infos] == [True] + [False] * 3
        namespace = infos[0]["namespace"]
        engine.serve("wide", PROMPT)
    stored = daemon.stats()

    # rank_variant: the TP=2 engine's rank 1 would compute other bytes; what it holds after the
    # load can only be the TP=4 engine's single copy.
    narrow = EngineRecipe("tiny-mla", 2, daemon.socket, "mla-tp2")
    with running(narrow, rank_variant=True) as (engine, ranks):
        assert [i["namespace"] for i in all_call(ranks, "info")] == [namespace] * 2
        request, blocks = engine.serve("narrow", PROMPT)
        assert loaded_all(engine, "narrow") and holds(ranks, blocks, PROMPT)
    after = daemon.stats()
    assert after["load_hit_keys"] == FULL and after["bytes_written"] == stored["bytes_written"]
    assert stored["bytes_saved_dedup"] == FULL * (stored["bytes_written"] // FULL) * 3


def write_weights(directory: str, fill: int) -> None:
    """A one-tensor model.safetensors whose values are all ``fill`` (same header every time)."""
    data = bytes([fill]) * (256 * 64 * 2)
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [256, 64],
                                                       "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


def kvtierctl(daemon, *args: str) -> dict:
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "kvtierctl"), "--dir", daemon.dir, *args,
                          "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_other_weights_under_the_same_path_do_not_hit_and_the_same_weights_do(start_daemon, tmp_path):
    daemon = start_daemon(page_size="4KiB")
    model = tmp_path / "tiny-llama"
    model.mkdir()
    shutil.copy(MODELS / "tiny-llama" / "config.json", model)

    def serve(engine_id: str, fill: int) -> tuple[str, bool]:
        write_weights(str(model), fill)
        with running(EngineRecipe(str(model), 1, daemon.socket, engine_id)) as (engine, ranks):
            namespace = all_call(ranks, "info")[0]["namespace"]
            request, blocks = engine.serve("r", PROMPT)
            assert holds(ranks, blocks, PROMPT)
            return namespace, loaded_all(engine, "r")

    v1, hit = serve("v1", fill=1)
    assert not hit and v1.startswith("tiny-llama@")
    v2, hit = serve("v2", fill=2)                     # a fine-tune saved over the same file: same header
    assert not hit and v2 != v1
    again, hit = serve("v1-again", fill=1)            # the first weights back: their blocks are found
    assert hit and again == v1
    names = {ns["name"] for ns in kvtierctl(daemon, "namespaces")}
    assert {v1, v2} <= names, names


def test_the_engine_serves_while_kvtierd_is_away_and_hits_resume_when_it_is_back(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "away", extra={"kvtier_retry_s": 0.5,
                                                                         "kvtier_timeout_s": 2})
    with running(recipe) as (engine, ranks):
        engine.serve("before", PROMPT)
        engine.forget_prefix_cache()
        request, blocks = engine.serve("stored", PROMPT)
        assert loaded_all(engine, "stored")

        daemon.stop(signal.SIGKILL)
        for i in range(6):                            # every request computes; nothing fails
            engine.forget_prefix_cache()
            request, blocks = engine.serve(f"away{i}", PROMPT)
            assert engine.first_computed[f"away{i}"] == 0
            assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and holds(ranks, blocks, PROMPT)
        assert engine.manager.stats.stores_skipped > 0

        daemon.start()                                # the same region: its READY blocks are recovered
        deadline = time.monotonic() + 120
        attempt = 0
        while True:
            engine.forget_prefix_cache()
            request, blocks = engine.serve(f"back{attempt}", PROMPT)
            if loaded_all(engine, f"back{attempt}"):
                break
            assert time.monotonic() < deadline, "hits did not resume"
            attempt += 1
            time.sleep(0.1)
        assert holds(ranks, blocks, PROMPT)


def test_a_planned_restart_is_invisible_beyond_its_own_duration(start_daemon):
    """SIGTERM (what systemctl restart and an upgrade send), then a new kvtierd on the same region:
    the engine attaches again as soon as it serves — with kvtier_retry_s at 600 s, it does not
    wait for it — and the same prompt then loads every block it stored before (none recomputed),
    with the right bytes. A request served while kvtierd was down computes and does not fail."""
    daemon = start_daemon(page_size="4KiB")
    recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "planned", extra={"kvtier_retry_s": 600,
                                                                            "kvtier_timeout_s": 2})
    with running(recipe) as (engine, ranks):
        engine.serve("stored", PROMPT)
        assert daemon.stop(signal.SIGTERM) == 0                  # drained and stopped cleanly
        engine.forget_prefix_cache()
        request, blocks = engine.serve("meanwhile", PROMPT)      # kvtierd is down: computed, nothing fails
        assert engine.first_computed["meanwhile"] == 0
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and holds(ranks, blocks, PROMPT)

        daemon.start()
        deadline = time.monotonic() + 60                          # a bound for the test, not a target
        while not engine.manager.link.up:
            assert time.monotonic() < deadline, "the engine did not attach again"
            time.sleep(0.01)
        engine.forget_prefix_cache()
        all_call(ranks, "zero")
        request, blocks = engine.serve("again", PROMPT)
        assert loaded_all(engine, "again") and engine.manager.stats.load_failures == 0
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and holds(ranks, blocks, PROMPT)
    assert daemon.stats()["load_hit_keys"] == FULL

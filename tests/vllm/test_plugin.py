"""The plugin's own contracts: version check, settings, keys, namespaces, and its manager and
worker against a real kvtierd (vLLM's types, no Scheduler)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvtier import NamespaceId  # noqa: E402
from kvtier.integrations import vllm as plugin  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierOffloadingManager  # noqa: E402
from kvtier.integrations.vllm.settings import KvtierSettings, kvtier_key, namespace_layout  # noqa: E402
from kvtier.integrations.vllm.worker import KvtierOffloadingWorker  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CTX = ReqContext(req_id="r")


def offload_config(**overrides) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(rank=0, world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=3072, enable_kv_cache_events=False,
        extra_config={"kvtier_socket": "/nonexistent/kvtierd.sock"}, engine_id="e1",
        model=OffloadingModelConfig(name="deepseek-ai/DeepSeek-V3", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel,
        replicated_layout=True, kv_cache_layout="LBHNC")
    return replace(config, **overrides)


def keys(prefix: str, n: int, group: int = 0) -> list[bytes]:
    import hashlib
    return [make_offload_key(hashlib.sha256(f"{prefix}{i}".encode()).digest(), group) for i in range(n)]


# ------------------------------------------------------------------------------ pure functions
def test_version_check_names_the_supported_versions(monkeypatch):
    monkeypatch.delenv(plugin.ALLOW_UNSUPPORTED_ENV, raising=False)
    assert plugin.check_vllm_version("0.33.0") == "0.33.0"
    assert plugin.check_vllm_version("0.33.4.dev12+g1234") == "0.33.4.dev12+g1234"
    for bad in ("0.32.1", "0.34.0", "1.0.0", "not-a-version"):
        with pytest.raises(plugin.UnsupportedVllmVersion, match=r"supports vLLM 0\.33\.x \(tested with 0\.33\.0\)"):
            plugin.check_vllm_version(bad)
    monkeypatch.setenv(plugin.ALLOW_UNSUPPORTED_ENV, "1")
    assert plugin.check_vllm_version("0.34.0") == "0.34.0"


def test_importing_kvtier_does_not_import_vllm():
    code = "import sys, kvtier, kvtier.integrations; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_settings_are_checked():
    s = KvtierSettings.from_extra_config({"kvtier_socket": "/s", "kvtier_timeout_s": "2.5",
                                          "spec_name": "KvtierOffloadingSpec"})
    assert (s.socket, s.timeout_s, s.retry_s, s.layout, s.copier, s.namespace) == ("/s", 2.5, 10.0, "auto",
                                                                                   "auto", None)
    for extra, match in [({"kvtier_sockett": "/s"}, "unknown .*kvtier_sockett"),
                         ({"kvtier_layout": "replicated"}, "kvtier_layout must be 'auto' or 'sharded'"),
                         ({"kvtier_timeout_s": 0}, "kvtier_timeout_s must be > 0"),
                         ({"kvtier_retry_s": "soon"}, "kvtier_retry_s must be a number"),
                         ({"kvtier_copier": "dma"}, "kvtier_copier must be one of auto, cpu, cuda, torch"),
                         ({"kvtier_namespace": 7}, "kvtier_namespace must be a string")]:
        with pytest.raises(ValueError, match=match):
            KvtierSettings.from_extra_config(extra)


def test_keys_fit_kvtierd_and_keep_groups_apart():
    (k,) = keys("a", 1)
    assert kvtier_key(k) == k and len(k) == 36
    long0, long1 = (make_offload_key(b"x" * 80, g) for g in (0, 1))
    short0, short1 = kvtier_key(long0), kvtier_key(long1)
    assert len(short0) == 36 and short0 != short1 and short0[-4:] == long0[-4:]


def test_namespace_follows_vllms_replicated_gate():
    settings = KvtierSettings(socket="/s")
    replicated = namespace_layout(offload_config(), settings)
    assert replicated == NamespaceId("deepseek-ai/DeepSeek-V3|LBHNC", "bfloat16", 16, 3072, "replicated")
    assert namespace_layout(offload_config(replicated_layout=False), settings).sharding == "sharded"
    forced = namespace_layout(offload_config(), replace(settings, layout="sharded", namespace="dsv3"))
    assert (forced.sharding, forced.model) == ("sharded", "dsv3|LBHNC")
    long = namespace_layout(offload_config(model=OffloadingModelConfig(name="m" * 400, dtype="fp8")), settings)
    assert len(long.model.encode()) <= 256


@pytest.mark.parametrize("overrides, match", [
    ({"cache": OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2)}, "blocks_per_chunk=2"),
    ({"canonical_layout": True}, "canonical_layout"),
    ({"worker_kv_bytes_per_block": 0}, "no KV bytes per block"),
])
def test_unsupported_configurations_fail_at_start(overrides, match):
    with pytest.raises(ValueError, match=match):
        namespace_layout(offload_config(**overrides), KvtierSettings(socket="/s"))


def test_pipeline_parallel_is_refused():
    config = offload_config()
    config = replace(config, parallel=replace(config.parallel, pp_size=2, world_size=4))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        namespace_layout(config, KvtierSettings(socket="/s"))


def test_spec_keeps_vllms_replicated_flag_off_so_every_rank_votes():
    spec = plugin.KvtierOffloadingSpec(offload_config())
    assert spec.layout.sharding == "replicated" and spec.replicated_layout is False
    assert spec.engine_id == "vllm-e1"


# ------------------------------------------------------------------------------ against kvtierd
BLOCK = 3072
NUM_BLOCKS = 16


def kv_caches(seed: int) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """Two layers' pages [num_blocks, 1536] (int8), as vLLM's worker hands them to a spec."""
    gen = torch.Generator().manual_seed(seed)
    pages = [torch.randint(-128, 127, (NUM_BLOCKS, BLOCK // 2), generator=gen, dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(p, BLOCK // 2) for p in pages],
                             group_data_refs=[[CanonicalKVCacheRef(0, BLOCK // 2), CanonicalKVCacheRef(1, BLOCK // 2)]]), pages


def block_bytes(pages, block_id: int) -> bytes:
    return b"".join(p[block_id].numpy().tobytes() for p in pages)


def gpu(ids) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(ids), group_sizes=[len(ids)], block_indices=[0])


def drain(worker, job_ids: set[int]) -> dict:
    worker.wait(job_ids)
    return {r.job_id: r for r in worker.get_finished()}


@pytest.fixture
def tier(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    settings = KvtierSettings(socket=daemon.socket, timeout_s=5)
    layout = NamespaceId("unit", "bfloat16", 16, BLOCK, "sharded")
    made = []

    def manager(timeout_s: float = 5.0, **kw):
        m = KvtierOffloadingManager(replace(settings, timeout_s=timeout_s), "unit-engine", 1, layout, **kw)
        made.append(m)
        return m

    def worker(seed: int = 1):
        caches, pages = kv_caches(seed)
        w = KvtierOffloadingWorker(settings, "unit-engine", 0, 1, layout, caches)
        made.append(w)
        return w, pages

    yield daemon, manager, worker
    for thing in reversed(made):
        thing.shutdown()


def test_store_then_load_through_manager_and_worker(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager()
    worker, pages = make_worker()
    ks = keys("s", 5)
    assert all(manager.lookup(k, CTX) is LookupResult.MISS for k in ks)

    out = manager.prepare_store(ks, CTX)
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert manager.lookup(ks[0], CTX) is LookupResult.HIT_PENDING      # our own store is in flight
    worker.submit_store(10, gpu([3, 4, 5, 6, 7]), out.store_spec)
    (result,) = drain(worker, {10}).values()
    assert (result.job_id, result.success, result.transfer_size) == (10, True, 5 * BLOCK)
    manager.complete_store(ks, CTX)
    assert [manager.lookup(k, CTX) for k in ks] == [LookupResult.HIT] * 5

    # Already there: nothing to store, and no job left behind.
    again = manager.prepare_store(ks[:3], CTX)
    assert again is not None and again.keys_to_store == []
    # Partly there: only the new keys are stored.
    more = keys("t", 2)
    mixed = manager.prepare_store([ks[0], more[0], ks[1], more[1]], CTX)
    assert mixed.keys_to_store == more

    expected = [block_bytes(pages, b) for b in (3, 4, 5, 6, 7)]
    spec = manager.prepare_load(ks, CTX)
    worker.submit_load(11, spec, gpu([8, 9, 10, 11, 12]))
    (loaded,) = drain(worker, {11}).values()
    assert loaded.success and loaded.transfer_size == 5 * BLOCK
    manager.complete_load(ks, CTX)
    assert [block_bytes(pages, b) for b in (8, 9, 10, 11, 12)] == expected
    stats = daemon.stats()
    assert stats["entries_pinned"] == 0 and stats["load_jobs_done"] == 1 and stats["bytes_written"] == 5 * BLOCK


def test_a_load_missing_blocks_is_reported_failed(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager()
    worker, pages = make_worker()
    ready = keys("p", 2)
    out = manager.prepare_store(ready, CTX)
    worker.submit_store(1, gpu([0, 1]), out.store_spec)
    drain(worker, {1})
    untouched = block_bytes(pages, 6)
    spec = manager.prepare_load(ready + keys("missing", 1), CTX)      # the last key is not cached
    assert [p.hits for p in spec.parts] == [2]
    worker.submit_load(2, spec, gpu([4, 5, 6]))
    (result,) = drain(worker, {2}).values()
    assert result.success is False and result.transfer_size == 0     # vLLM must not use block 6
    assert block_bytes(pages, 4) == block_bytes(pages, 0) and block_bytes(pages, 5) == block_bytes(pages, 1)
    assert block_bytes(pages, 6) == untouched
    assert daemon.stats()["entries_pinned"] == 0


def test_nothing_fits_returns_none(tier):
    daemon, make_manager, _ = tier
    manager = make_manager()
    stats = daemon.stats()
    capacity = stats["pages_total"] // -(-BLOCK // stats["page_size"])      # pages per block: ceil
    # Open (never completed) store jobs hold their pages: they cannot be evicted.
    taken = manager.prepare_store(keys("fill", capacity), CTX)
    assert len(taken.keys_to_store) == capacity
    assert manager.prepare_store(keys("more", 3), CTX) is None
    assert daemon.stats()["store_no_space_keys"] == 3


def test_large_transfers_are_split_into_several_kvtier_jobs(tier, monkeypatch):
    _, make_manager, make_worker = tier
    monkeypatch.setattr("kvtier.integrations.vllm.manager.PART_KEYS", 3)
    manager = make_manager()
    worker, pages = make_worker()
    ks = keys("big", 8)
    out = manager.prepare_store(ks, CTX)
    assert [len(p.keys) for p in out.store_spec.parts] == [3, 3, 2]
    worker.submit_store(1, gpu(range(8)), out.store_spec)
    assert drain(worker, {1})[1].success
    spec = manager.prepare_load(ks, CTX)
    worker.submit_load(2, spec, gpu(range(8, 16)))
    assert drain(worker, {2})[2].success
    assert [block_bytes(pages, 8 + i) for i in range(8)] == [block_bytes(pages, i) for i in range(8)]


def test_manager_serves_misses_while_kvtierd_is_away_and_reattaches(tier):
    daemon, make_manager, make_worker = tier
    now = [0.0]
    manager = make_manager(clock=lambda: now[0], timeout_s=1.0)
    worker, _ = make_worker()
    ks = keys("r", 2)
    out = manager.prepare_store(ks, CTX)
    worker.submit_store(1, gpu([0, 1]), out.store_spec)
    drain(worker, {1})
    manager.complete_store(ks, CTX)
    assert manager.lookup(ks[0], CTX) is LookupResult.HIT

    daemon.stop()
    assert manager.lookup(ks[0], CTX) is LookupResult.MISS       # no answer: a miss, not an error
    assert manager.prepare_store(keys("x", 1), CTX) is None
    daemon.start()                                               # same region: READY entries recovered
    assert manager.lookup(ks[0], CTX) is LookupResult.MISS       # still backing off
    now[0] += manager.settings.retry_s
    assert manager.lookup(ks[0], CTX) is LookupResult.HIT        # re-attached, the block survived


def test_the_documented_serve_line_loads_this_plugin():
    import json
    import re
    import shlex
    from pathlib import Path

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    command = re.search(r"```sh\n(vllm serve .*?)\n```", doc, re.S).group(1).replace("\\\n", " ")
    argv = shlex.split(command)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is plugin.KvtierOffloadingSpec
    assert KvtierSettings.from_extra_config(extra).socket == extra["kvtier_socket"]
    for key in KvtierSettings.KEYS:
        assert f"`{key}`" in doc, f"docs/vllm.md does not describe {key}"

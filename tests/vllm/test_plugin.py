"""The plugin's own contracts: version check, settings, keys, namespaces, and its manager and
worker against a real kvtierd (vLLM's types, no Scheduler)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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
    ScheduleEndContext,
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
from kvtier.integrations.vllm.identity import ModelIdentity  # noqa: E402
from kvtier.integrations.vllm.manager import KvtierOffloadingManager  # noqa: E402
from kvtier.integrations.offload.keys import kvtier_key, kvtier_keys, offload_keys  # noqa: E402
from kvtier.integrations.vllm.settings import KvtierSettings, namespace_id, offload_key_bytes  # noqa: E402
from kvtier.integrations.vllm.transfer import JobPart, KvtierLoadStoreSpec  # noqa: E402
from kvtier.integrations.vllm.worker import KvtierOffloadingWorker, LoadFailed  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


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
                                          "kvtier_lookup_wait_ms": 0, "spec_name": "KvtierOffloadingSpec"})
    assert (s.socket, s.timeout_s, s.retry_s, s.sharding, s.copier, s.namespace, s.lookup_wait_ms) == (
        "/s", 2.5, 10.0, "auto", "auto", None, 0.0)
    for extra, match in [({"kvtier_sockett": "/s"}, "unknown .*kvtier_sockett"),
                         ({"kvtier_sharding": "replicated"}, "kvtier_sharding must be 'auto' or 'sharded'"),
                         ({"kvtier_layout": "sharded"},              # the old name: no alias
                          r"unknown .*\['kvtier_layout'\]; kvtier's keys are \[.*'kvtier_sharding'"),
                         ({"kvtier_timeout_s": 0}, "kvtier_timeout_s must be > 0"),
                         ({"kvtier_retry_s": "soon"}, "kvtier_retry_s must be a number"),
                         ({"kvtier_lookup_wait_ms": -1}, "kvtier_lookup_wait_ms must be >= 0"),
                         ({"kvtier_copier": "dma"}, "kvtier_copier must be one of auto, cpu, cuda, torch"),
                         ({"kvtier_namespace": 7}, "kvtier_namespace must be a non-empty string"),
                         ({"kvtier_ranks_per_node": 0}, "kvtier_ranks_per_node must be > 0"),
                         ({"kvtier_ranks_per_node": 2.5}, "kvtier_ranks_per_node must be a whole number")]:
        with pytest.raises(ValueError, match=match):
            KvtierSettings.from_extra_config(extra)


def test_keys_fit_kvtierd_and_keep_groups_apart():
    (k,) = keys("a", 1)
    assert kvtier_key(k) == k and len(k) == 36
    long0, long1 = (make_offload_key(b"x" * 80, g) for g in (0, 1))
    short0, short1 = kvtier_key(long0), kvtier_key(long1)
    assert len(short0) == 36 and short0 != short1 and short0[-4:] == long0[-4:]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_kvtier_keys_map_back_to_the_offload_keys_of_every_group(algo):
    """Every vLLM 0.33 hash function makes keys kvtier keeps whole: the keys of an event record
    come back as the very OffloadKeys (block hash and group index), in order; keys of another
    length or of a group the engine does not have are not its."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx

    hash_fn = get_hash_fn_by_name(algo)
    hashes = [hash_fn((i, "block")) for i in range(50)]
    ours = [make_offload_key(h, g) for h in hashes for g in range(3)]
    nbytes = offload_key_bytes(algo)
    assert {len(k) for k in ours} == {nbytes}
    blob = b"".join(kvtier_keys(ours))
    assert offload_keys(nbytes, blob, nbytes, 3) == ours
    back = offload_keys(nbytes, blob, nbytes, 2)
    assert back == [k for k in ours if k[-4:] != b"\0\0\0\2"]
    assert [(get_offload_block_hash(k), get_offload_group_idx(k)) for k in back[:2]] == [(hashes[0], 0), (hashes[0], 1)]
    other = 20 if nbytes == 36 else 36
    assert offload_keys(other, bytes(other * 4), nbytes, 3) == []


MODEL = ModelIdentity("DeepSeek-V3", "0123456789abcdef", weights_read=True, complete=True)


def test_namespace_follows_the_replicated_gate():
    settings = KvtierSettings(socket="/s")
    replicated = namespace_id(offload_config(), settings, MODEL, True)
    assert replicated == NamespaceId("DeepSeek-V3@0123456789abcdef|LBHNC", "bfloat16", 16, 3072, "replicated")
    assert namespace_id(offload_config(), settings, MODEL, False).sharding == "sharded"
    # kvtier_namespace replaces name and fingerprint.
    forced = namespace_id(offload_config(), replace(settings, sharding="sharded", namespace="dsv3"), None, True)
    assert (forced.sharding, forced.model) == ("sharded", "dsv3|LBHNC")
    long = namespace_id(offload_config(), settings, replace(MODEL, name="m" * 400), True)
    assert len(long.model.encode()) <= 256 and long.model.endswith("@0123456789abcdef|LBHNC")


@pytest.mark.parametrize("overrides, match", [
    ({"cache": OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2)}, "blocks_per_chunk=2"),
    ({"canonical_layout": True}, "canonical_layout"),
    ({"worker_kv_bytes_per_block": 0}, "no KV bytes per block"),
])
def test_unsupported_configurations_fail_at_start(overrides, match):
    with pytest.raises(ValueError, match=match):
        namespace_id(offload_config(**overrides), KvtierSettings(socket="/s"), MODEL, True)


def test_pipeline_parallel_is_refused():
    config = offload_config()
    config = replace(config, parallel=replace(config.parallel, pp_size=2, world_size=4))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        namespace_id(config, KvtierSettings(socket="/s"), MODEL, False)


def test_spec_keeps_vllms_replicated_flag_off_so_every_rank_votes():
    spec = plugin.KvtierOffloadingSpec(offload_config())
    assert spec.namespace.sharding == "replicated" and spec.replicated_layout is False
    assert spec.engine_id == "vllm-e1"
    # Built by vLLM's plain OffloadingConnector: cannot report failed loads, fingerprints the name only.
    assert spec.reports_failures is False and spec.model.complete is False
    assert spec.namespace.model.startswith("DeepSeek-V3@")


def test_kvtier_sharding_is_honoured_at_start_and_the_old_kvtier_layout_refused():
    extra = {"kvtier_socket": "/nonexistent/kvtierd.sock"}
    spec = plugin.KvtierOffloadingSpec(offload_config(extra_config={**extra, "kvtier_sharding": "sharded"}))
    assert spec.namespace.sharding == "sharded"
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['kvtier_layout'\]"):
        plugin.KvtierOffloadingSpec(offload_config(extra_config={**extra, "kvtier_layout": "sharded"}))


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


def request(manager, ks: list[bytes], req_id: str = "r") -> ReqContext:
    """A new request whose keys vLLM recorded (as its scheduler does before the first lookup)."""
    ctx = ReqContext(req_id=req_id)
    manager.on_new_request(ctx)
    for i, k in enumerate(ks):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    return ctx


def prefix_lookup(manager, ks: list[bytes], ctx: ReqContext) -> list[LookupResult]:
    """vLLM's prefix scan of one step: ask key after key until a MISS, then end the step."""
    out = []
    for k in ks:
        out.append(manager.lookup(k, ctx))
        if out[-1] is LookupResult.MISS:
            break
    manager.on_schedule_end(ScheduleEndContext((), ()))
    return out


@pytest.fixture
def tier(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    settings = KvtierSettings(socket=daemon.socket, timeout_s=5)
    namespace = NamespaceId("unit", "bfloat16", 16, BLOCK, "sharded")
    made = []

    def manager(num_groups: int = 1, **changes):
        # Answers are awaited without a practical bound (the tests assert on behaviour, also on a
        # loaded machine); the tests of late answers set kvtier_lookup_wait_ms themselves.
        changes.setdefault("lookup_wait_ms", 60_000)
        m = KvtierOffloadingManager(replace(settings, **changes), "unit-engine", 1, namespace, num_groups=num_groups)
        made.append(m)
        return m

    def worker(seed: int = 1, reports_failures: bool = True, **changes):
        caches, pages = kv_caches(seed)
        w = KvtierOffloadingWorker(replace(settings, **changes), "unit-engine", 0, 1, namespace, caches,
                                   reports_failures=reports_failures)
        made.append(w)
        return w, pages

    yield daemon, manager, worker
    for thing in reversed(made):
        thing.shutdown()


def store(manager, worker, ks: list[bytes], job: int, block_ids) -> None:
    ctx = request(manager, ks, f"store-{job}")
    out = manager.prepare_store(ks, ctx)
    assert out is not None and out.keys_to_store == ks
    worker.submit_store(job, gpu(block_ids), out.store_spec)
    assert drain(worker, {job})[job].success
    manager.complete_store(ks, ctx)


def test_store_then_load_through_manager_and_worker(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager()
    worker, pages = make_worker()
    ks = keys("s", 5)
    assert prefix_lookup(manager, ks, request(manager, ks, "cold")) == [LookupResult.MISS]

    ctx = request(manager, ks, "first")
    out = manager.prepare_store(ks, ctx)
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert manager.lookup(ks[0], ctx) is LookupResult.HIT_PENDING      # our own store is in flight
    worker.submit_store(10, gpu([3, 4, 5, 6, 7]), out.store_spec)
    (result,) = drain(worker, {10}).values()
    assert (result.job_id, result.success, result.transfer_size) == (10, True, 5 * BLOCK)
    manager.complete_store(ks, ctx)
    ctx = request(manager, ks, "second")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 5

    # Offered again (already there) and partly new: kvtierd decides, the worker copies only the new.
    more = keys("t", 2)
    offer = [ks[0], more[0], ks[1], more[1]]
    mixed = manager.prepare_store(offer, ctx)
    assert mixed.keys_to_store == offer
    worker.submit_store(12, gpu([13, 14, 15, 0]), mixed.store_spec)
    assert drain(worker, {12})[12].transfer_size == 2 * BLOCK
    manager.complete_store(offer, ctx)
    assert daemon.stats()["store_written_keys"] == 7 and daemon.stats()["store_present_keys"] >= 2

    expected = [block_bytes(pages, b) for b in (3, 4, 5, 6, 7)]
    spec = manager.prepare_load(ks, ctx)
    worker.submit_load(11, spec, gpu([8, 9, 10, 11, 12]))
    (loaded,) = drain(worker, {11}).values()
    assert loaded.success and loaded.transfer_size == 5 * BLOCK
    assert worker.take_load_outcomes() == [(11, None)]
    manager.complete_load(ks, ctx)
    assert [block_bytes(pages, b) for b in (8, 9, 10, 11, 12)] == expected
    stats = daemon.stats()
    assert stats["entries_pinned"] == 0 and stats["load_jobs_done"] == 1 and stats["bytes_written"] == 7 * BLOCK


def test_one_batched_lookup_answers_every_lookup_of_a_request(tier):
    _, make_manager, make_worker = tier
    manager = make_manager()
    worker, _ = make_worker()
    ks = keys("b", 12)
    store(manager, worker, ks[:9], 1, range(9))
    before = manager.link.requests
    ctx = request(manager, ks, "big")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 9 + [LookupResult.MISS]
    for _ in range(5):                                   # waiting for GPU blocks: asked again each step
        assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 9 + [LookupResult.MISS]
    assert manager.link.requests - before == 1 and manager.stats.batches == 1
    # vLLM's GPU prefix cache held the first 4 blocks: its scan starts later, same answer.
    assert prefix_lookup(manager, ks[4:], ctx) == [LookupResult.HIT] * 5 + [LookupResult.MISS]
    assert manager.link.requests - before == 1


def test_each_kv_cache_group_is_a_prefix_of_its_own(tier):
    _, make_manager, make_worker = tier
    worker, _ = make_worker()
    full, window = keys("g", 6, group=0), keys("g", 6, group=1)
    store(make_manager(), worker, full + window[:3], 1, range(9))

    def request_of_both(manager, req_id):
        ctx = ReqContext(req_id=req_id)
        manager.on_new_request(ctx)
        for group in (full, window):                   # vLLM records them group after group
            for i, k in enumerate(group):
                ctx.set_offload_key_position(k, (i + 1) * 16)
        return ctx

    manager = make_manager(num_groups=2)
    before = manager.link.requests
    ctx = request_of_both(manager, "hybrid")
    assert prefix_lookup(manager, full, ctx) == [LookupResult.HIT] * 6
    assert prefix_lookup(manager, window, ctx) == [LookupResult.HIT] * 3 + [LookupResult.MISS]
    assert manager.stats.batches == 1 and manager.link.requests - before == 2     # one request per group

    # A late answer: RETRY for the first key of *each* group (a group answered MISS first would
    # make vLLM drop the request's whole hit), MISS after it.
    late = make_manager(num_groups=2, lookup_wait_ms=0)
    ctx = request_of_both(late, "late")
    assert [late.lookup(k, ctx) for k in (full[0], full[1], window[0], window[1])] == [
        LookupResult.RETRY, LookupResult.MISS, LookupResult.RETRY, LookupResult.MISS]


def test_the_public_path_collects_retried_keys_into_one_batch(tier):
    _, make_manager, make_worker = tier
    manager = make_manager()
    worker, _ = make_worker()
    ks = keys("p", 8)
    store(manager, worker, ks[:5], 1, range(5))
    manager.use_key_positions = False                   # as on a vLLM series not checked for the private dict
    before = manager.link.requests
    ctx = request(manager, ks, "pub")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.RETRY] * 8    # vLLM shows every key
    settled(manager)                                     # the batch sent at on_schedule_end is answered
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 5 + [LookupResult.MISS]
    assert manager.link.requests - before == 1


def test_a_late_answer_defers_the_request_to_the_next_step(tier):
    _, make_manager, make_worker = tier
    worker, _ = make_worker()
    ks = keys("l", 6)
    store(make_manager(), worker, ks, 1, range(6))
    manager = make_manager(lookup_wait_ms=0)            # never wait: the answer is always "late"
    ctx = request(manager, ks, "late")
    # RETRY once, then MISS: vLLM defers the request after two lookups instead of scanning on.
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.RETRY, LookupResult.MISS]
    settled(manager)
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 6


def test_a_load_missing_blocks_is_reported_to_the_connector(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager()
    worker, pages = make_worker()
    ready = keys("p", 2)
    store(manager, worker, ready, 1, [0, 1])
    untouched = block_bytes(pages, 6)
    ctx = request(manager, ready + keys("missing", 1), "partial")
    spec = manager.prepare_load(ready + keys("missing", 1), ctx)      # the last key is not cached
    worker.submit_load(2, spec, gpu([4, 5, 6]))
    (result,) = drain(worker, {2}).values()
    # vLLM's worker would stop the engine on success=False: the failure goes to the connector.
    assert result.success is True and result.transfer_size == 0
    assert worker.take_load_outcomes() == [(2, 2)]                     # blocks from index 2 on are not valid
    assert block_bytes(pages, 4) == block_bytes(pages, 0) and block_bytes(pages, 5) == block_bytes(pages, 1)
    assert block_bytes(pages, 6) == untouched
    assert daemon.stats()["entries_pinned"] == 0


def test_on_the_plain_spec_path_a_failed_load_stops_the_engine_even_under_python_O(tier):
    _, make_manager, make_worker = tier
    manager = make_manager()
    worker, _ = make_worker(reports_failures=False)
    ctx = request(manager, keys("gone", 2), "plain")
    spec = manager.prepare_load(keys("gone", 2), ctx)
    worker.submit_load(3, spec, gpu([4, 5]))
    with pytest.raises(LoadFailed, match="KvtierOffloadingConnector"):     # not vLLM's assert, gone under -O
        drain(worker, {3})


def settled(manager) -> None:
    """Wait until the link thread has served everything queued before (it serves in order)."""
    manager.link.submit(lambda client: None).result(30)


def test_a_full_region_is_not_offered_again(tier):
    daemon, make_manager, _ = tier
    manager = make_manager()
    stats = daemon.stats()
    capacity = stats["pages_total"] // -(-BLOCK // stats["page_size"])      # pages per block: ceil
    # Open (never completed) store jobs hold their pages: they cannot be evicted.
    fill = keys("fill", capacity)
    assert manager.prepare_store(fill, request(manager, fill, "fill")).keys_to_store == fill
    more = keys("more", 3)
    assert manager.prepare_store(more, request(manager, more, "more")).keys_to_store == more
    settled(manager)
    assert daemon.stats()["store_no_space_keys"] == 3
    # No room for any key: the next offers are "not stored" (vLLM does not offer them again),
    # without a request to kvtierd.
    requests = manager.link.requests
    for i in range(5):
        again = keys(f"again{i}", 3)
        assert manager.prepare_store(again, request(manager, again, f"again{i}")).keys_to_store == []
    settled(manager)
    assert manager.link.requests == requests and daemon.stats()["store_no_space_keys"] == 3


def small_parts(monkeypatch, keys_per_part: int) -> None:
    """kvtier jobs and lookups of at most ``keys_per_part`` keys (PART_KEYS where the manager's
    bookkeeping uses it)."""
    for module in ("jobs", "lookups"):
        monkeypatch.setattr(f"kvtier.integrations.offload.{module}.PART_KEYS", keys_per_part)


def test_large_transfers_are_split_into_several_kvtier_jobs(tier, monkeypatch):
    _, make_manager, make_worker = tier
    small_parts(monkeypatch, 3)
    manager = make_manager()
    worker, pages = make_worker()
    ks = keys("big", 8)
    out = manager.prepare_store(ks, request(manager, ks, "w"))
    assert [len(p.keys) for p in out.store_spec.parts] == [3, 3, 2]
    settled(manager)
    worker.submit_store(1, gpu(range(8)), out.store_spec)
    assert drain(worker, {1})[1].success
    manager.complete_store(ks, request(manager, ks, "w2"))
    ctx = request(manager, ks, "r")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 8     # three lookups, one batch
    spec = manager.prepare_load(ks, ctx)
    worker.submit_load(2, spec, gpu(range(8, 16)))
    assert drain(worker, {2})[2].success and worker.take_load_outcomes() == [(2, None)]
    assert [block_bytes(pages, 8 + i) for i in range(8)] == [block_bytes(pages, i) for i in range(8)]


def fill_region(daemon) -> None:
    """Another engine (another namespace) stores as many blocks as the region holds and commits
    them: every evictable block goes."""
    from kvtier import Client
    stats = daemon.stats()
    filler = Client(daemon.socket, engine_id="filler", rank=0, world_size=1,
                    namespace=NamespaceId("another-model", "bfloat16", 16, BLOCK, "sharded"))
    try:
        filler.register_kv_caches(kv_caches(9)[1])
        count = stats["pages_total"] // -(-BLOCK // stats["page_size"])
        for job, begin in enumerate(range(0, count, NUM_BLOCKS), start=1):
            ks = keys(f"fill{job}-", min(NUM_BLOCKS, count - begin))
            filler.store(job, ks, list(range(len(ks))))
            filler.wait([job])
    finally:
        filler.close()


def test_the_batched_lookup_leases_its_hits_and_the_load_consumes_the_lease(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager()
    worker, pages = make_worker()
    ks = keys("lease", 6)
    store(manager, worker, ks[:4], 1, range(4))
    ctx = request(manager, ks, "leased")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
    stats = daemon.stats()
    assert stats["leases_open"] == 1 and stats["entries_leased"] == 4 and stats["evictable"] == 0
    fill_region(daemon)                                  # between lookup and load: nothing of ours goes
    expected = [block_bytes(pages, b) for b in range(4)]
    spec = manager.prepare_load(ks[:4], ctx)
    assert [part.lease for part in spec.parts] == [1]
    worker.submit_load(5, spec, gpu([8, 9, 10, 11]))
    assert drain(worker, {5})[5].success and worker.take_load_outcomes() == [(5, None)]
    assert [block_bytes(pages, b) for b in (8, 9, 10, 11)] == expected
    settled(manager)
    stats = daemon.stats()
    assert stats["lease_ends"] == {"consumed": 1} and stats["lease_missed_loads"] == 0
    assert manager.stats.leased_loads == 1


def test_leases_of_a_load_split_into_jobs_follow_the_lookups_parts(tier, monkeypatch):
    daemon, make_manager, make_worker = tier
    small_parts(monkeypatch, 3)
    manager = make_manager()
    worker, pages = make_worker()
    ks = keys("parts", 8)
    store(manager, worker, ks, 1, range(8))
    ctx = request(manager, ks, "parts")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 8      # three lookups, three leases
    assert daemon.stats()["leases_open"] == 3
    spec = manager.prepare_load(ks[1:7], ctx)                              # vLLM loads part of the hit
    assert [(len(p.keys), p.lease) for p in spec.parts] == [(2, 1), (3, 2), (1, 3)]
    worker.submit_load(2, spec, gpu(range(8, 14)))
    assert drain(worker, {2})[2].success and worker.take_load_outcomes() == [(2, None)]
    assert [block_bytes(pages, 8 + i) for i in range(6)] == [block_bytes(pages, 1 + i) for i in range(6)]
    settled(manager)
    assert daemon.stats()["lease_ends"] == {"consumed": 3} and daemon.stats()["leases_open"] == 0


def test_a_waiting_request_has_its_lease_renewed_without_waiting(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager(lease_ttl_s=0.4)
    worker, _ = make_worker()
    ks = keys("renew", 3)
    store(manager, worker, ks, 1, range(3))
    ctx = request(manager, ks, "waits")
    ended = time.monotonic() + 2.0
    while time.monotonic() < ended:                      # waiting for GPU blocks: looked up every step
        assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 3
        time.sleep(0.02)
    settled(manager)
    stats = daemon.stats()
    assert manager.stats.batches == 1 + manager.stats.renewals and manager.stats.renewals >= 3
    assert stats["leases_open"] == 1 and "expired" not in stats["lease_ends"]
    assert stats["lease_ends"]["replaced"] == stats["leases_granted"] - 1
    manager.on_request_finished(ctx)                      # finished without a load: released
    settled(manager)
    assert daemon.stats()["leases_open"] == 0 and daemon.stats()["lease_ends"]["released"] == 1


def test_reset_cache_releases_the_leases_and_leases_can_be_off(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager()
    worker, _ = make_worker()
    ks = keys("reset", 2)
    store(manager, worker, ks, 1, range(2))
    assert prefix_lookup(manager, ks, request(manager, ks, "a")) == [LookupResult.HIT] * 2
    assert prefix_lookup(manager, ks, request(manager, ks, "b")) == [LookupResult.HIT] * 2
    assert daemon.stats()["leases_open"] == 2
    manager.reset_cache()
    settled(manager)
    assert daemon.stats()["leases_open"] == 0
    off = make_manager(lease_ttl_s=0)
    ctx = request(off, ks, "off")
    assert prefix_lookup(off, ks, ctx) == [LookupResult.HIT] * 2
    assert daemon.stats()["leases_open"] == 0 and off.prepare_load(ks, ctx).parts[0].lease is None


def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_hung_kvtierd_costs_the_scheduler_one_wait(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager(timeout_s=30.0, lookup_wait_ms=200)
    worker, _ = make_worker()
    ks = keys("h", 3)
    store(manager, worker, ks, 1, range(3))
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        assert prefix_lookup(manager, ks, request(manager, ks, "first")) == [LookupResult.RETRY, LookupResult.MISS]
        for i in range(5):          # no more waiting: deferred at once, and misses once it stays silent
            assert prefix_lookup(manager, ks, request(manager, ks, f"next{i}"))[0] in (LookupResult.RETRY,
                                                                                       LookupResult.MISS)
        until(lambda: prefix_lookup(manager, ks, request(manager, ks, "later")) == [LookupResult.MISS])
        assert manager.stats.late == 1
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    until(lambda: prefix_lookup(manager, ks, request(manager, ks, "resumed")) == [LookupResult.HIT] * 3)


def test_manager_serves_misses_while_kvtierd_is_away_and_reattaches(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager(timeout_s=1.0, retry_s=0.2)
    worker, _ = make_worker()
    ks = keys("r", 2)
    store(manager, worker, ks, 1, [0, 1])
    assert prefix_lookup(manager, ks, request(manager, ks, "before")) == [LookupResult.HIT] * 2

    daemon.stop(signal.SIGKILL)
    until(lambda: not manager.link.up)          # the link thread sees the connection drop by itself
    requests = manager.link.requests
    for i in range(20):           # kvtierd away: misses and "not stored", without a single request
        assert prefix_lookup(manager, ks, request(manager, ks, f"away{i}")) == [LookupResult.MISS]
        assert manager.prepare_store(keys("x", 1), request(manager, ks, f"s{i}")).keys_to_store == []
    assert manager.link.requests == requests
    daemon.start()                                               # same region: READY entries recovered
    until(lambda: prefix_lookup(manager, ks, request(manager, ks, "again")) == [LookupResult.HIT] * 2)
    # "before" never finished: its lease was re-issued when the link re-attached; "again" leased anew.
    assert daemon.stats()["leases_open"] == 2


def test_an_answer_from_before_a_restart_is_asked_again_and_leased_anew(tier):
    daemon, make_manager, make_worker = tier
    manager = make_manager(timeout_s=1.0, retry_s=0.2)
    worker, pages = make_worker()
    ks = keys("epoch", 3)
    store(manager, worker, ks, 1, range(3))
    ctx = request(manager, ks, "across")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 3
    daemon.stop(signal.SIGKILL)
    until(lambda: not manager.link.up)
    daemon.start()
    until(lambda: manager.link.up)
    assert daemon.stats()["leases_open"] == 1                    # the link's client leased it again
    batches = manager.stats.batches
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 3
    assert manager.stats.batches == batches + 1                  # not answered from the old session's verdict
    fill_region(daemon)
    spec = manager.prepare_load(ks, ctx)
    worker.submit_load(4, spec, gpu([8, 9, 10]))
    assert drain(worker, {4})[4].success and worker.take_load_outcomes() == [(4, None)]
    assert [block_bytes(pages, b) for b in (8, 9, 10)] == [block_bytes(pages, b) for b in range(3)]


def test_after_a_planned_restart_manager_and_worker_attach_again_without_waiting_retry_s(tier):
    """kvtierd stopped with SIGTERM (systemctl restart) and started again: the link thread and a
    worker that found it away (its store during the outage) attach again as soon as it serves —
    kvtier_retry_s is 600 s here — and the blocks stored before load in full."""
    daemon, make_manager, make_worker = tier
    manager = make_manager(timeout_s=1.0, retry_s=600)
    worker, pages = make_worker(timeout_s=1.0, retry_s=600)
    ks = keys("planned", 3)
    store(manager, worker, ks, 1, range(3))
    assert daemon.stop(signal.SIGTERM) == 0
    until(lambda: not manager.link.up)
    away = KvtierLoadStoreSpec([JobPart(1000, tuple(keys("away", 1)))])   # prepared just before the stop
    worker.submit_store(2, gpu([5]), away)
    assert drain(worker, {2})[2].success                  # not cached; the engine does not see it
    daemon.start()                                        # the same region: its READY blocks are recovered
    until(lambda: manager.link.up, timeout=60)
    ctx = request(manager, ks, "after")
    assert prefix_lookup(manager, ks, ctx) == [LookupResult.HIT] * 3
    worker.submit_load(3, manager.prepare_load(ks, ctx), gpu([8, 9, 10]))
    assert drain(worker, {3})[3].success and worker.take_load_outcomes() == [(3, None)]
    assert [block_bytes(pages, b) for b in (8, 9, 10)] == [block_bytes(pages, b) for b in range(3)]


def test_blocks_kvtierd_promotes_from_its_second_tier_are_hit_pending_then_hits(start_daemon):
    """kvtierd with a second tier (a real Redis Cluster) demotes the blocks as its region fills and
    evicts them; a new request's lookups are HIT_PENDING while kvtierd promotes them (vLLM defers
    the request and asks again next step), then HIT, and the load is exact."""
    from kvtierbench.tierservers import RedisCluster, ServerUnavailable
    try:
        engine = RedisCluster()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    try:
        engine.start()
        daemon = start_daemon("--tier-backend", "redis", "--tier-address", engine.address,
                              "--tier-low-watermark", "0.5", size="8MiB")
        until(lambda: daemon.stats()["tier"]["state"] == "ready")
        settings = KvtierSettings(socket=daemon.socket, timeout_s=5, lookup_wait_ms=60_000)
        layout = NamespaceId("unit", "bfloat16", 16, BLOCK, "sharded")
        manager = KvtierOffloadingManager(settings, "tier-engine", 1, layout)
        caches, pages = kv_caches(7)
        worker = KvtierOffloadingWorker(settings, "tier-engine", 0, 1, layout, caches)
        try:
            ks = keys("tier", 4)
            store(manager, worker, ks, 1, range(4))
            for job in range(2, 2 + daemon.stats()["pages_total"] // NUM_BLOCKS + 1):   # more than the region
                store(manager, worker, keys(f"fill{job}", NUM_BLOCKS), job, range(NUM_BLOCKS))
                until(lambda: daemon.stats()["tier"]["demoting_blocks"] == 0)
            tier = daemon.stats()["tier"]
            # A fill job may need room before the demoter took every block ahead of it: those go
            # undemoted, counted "pressure" (docs/operations.md; CI saw 5 under load). The four
            # blocks the request needs are checked by its lookups and load below.
            dropped = tier["demote_dropped_blocks"]
            assert tier["demoted_blocks"] >= 4 and dropped["busy"] == dropped["down"] == dropped["failed"] == 0, tier
            ctx = request(manager, ks, "promoted")
            steps = [prefix_lookup(manager, ks, ctx)]
            assert steps[0] == [LookupResult.HIT_PENDING] * 4          # deferred, not computed
            until(lambda: steps.append(prefix_lookup(manager, ks, ctx)) or steps[-1] == [LookupResult.HIT] * 4)
            assert all(step in ([LookupResult.HIT_PENDING] * 4, [LookupResult.HIT] * 4) for step in steps)
            expected = [block_bytes(pages, b) for b in range(4)]
            spec = manager.prepare_load(ks, ctx)
            worker.submit_load(2, spec, gpu([8, 9, 10, 11]))
            assert drain(worker, {2})[2].success
            assert [block_bytes(pages, b) for b in (8, 9, 10, 11)] == expected
            assert daemon.stats()["tier"]["promoted_blocks"] == 4
        finally:
            worker.shutdown()
            manager.shutdown()
    finally:
        engine.stop()


def test_the_documented_serve_line_loads_this_plugin():
    import json
    import re
    import shlex
    from pathlib import Path

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    command = re.search(r"```sh\n(vllm serve .*?)\n```", doc, re.S).group(1).replace("\\\n", " ")
    argv = shlex.split(command)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert KVConnectorFactory.get_connector_class(KVTransferConfig(**config)) is plugin.KvtierOffloadingConnector
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is plugin.KvtierOffloadingSpec
    assert KvtierSettings.from_extra_config(extra).socket == extra["kvtier_socket"]
    for key in KvtierSettings.KEYS:
        assert f"`{key}`" in doc, f"docs/vllm.md does not describe {key}"

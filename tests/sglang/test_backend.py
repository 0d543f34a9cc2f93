"""The backend's own contracts, on SGLang's real host pools: settings, keys, the page geometry of
every host layout, namespace and fingerprint, refusals, and behaviour without kvtierd; then every
host layout through SGLang's controller threads (L2 ↔ L3) against a real kvtierd.

SGLang runs in this process for the first part (its trees are built by tests/sglang/harness.py
with a socket nobody listens on, so the backend starts "down"), and in child processes for the
second.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: `make test-sglang` builds .venv-sglang", allow_module_level=True)

from tests.sglang.harness import Rank, RankProcess, RankSpec, token_bytes  # noqa: E402

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402

from kvtier.integrations import sglang as integration  # noqa: E402
from kvtier.integrations.sglang.identity import identify  # noqa: E402
from kvtier.integrations.sglang.pages import HostPages  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

NOWHERE = "/nonexistent/kvtierd.sock"
LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
           ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct")]


def io_backend(layout: str) -> dict:
    return {"hicache_io_backend": "kernel"} if layout in ("page_first", "page_head") else {}


@pytest.fixture
def tree():
    """Factory: tree(RankSpec) → an in-process Rank; detached after the test."""
    built: list[Rank] = []

    def build(spec: RankSpec) -> Rank:
        rank = Rank(spec)
        built.append(rank)
        return rank

    yield build
    for rank in built:
        rank.close()


# ------------------------------------------------------------------------------ pure functions
def test_version_check_names_the_supported_version(monkeypatch):
    monkeypatch.delenv(integration.ALLOW_UNSUPPORTED_ENV, raising=False)
    assert integration.check_sglang_version("0.5.23") == "0.5.23"
    for bad in ("0.5.22", "0.5.24", "0.6.0"):
        with pytest.raises(integration.UnsupportedSglangVersion, match=r"supports SGLang 0\.5\.23"):
            integration.check_sglang_version(bad)
    monkeypatch.setenv(integration.ALLOW_UNSUPPORTED_ENV, "1")
    assert integration.check_sglang_version("0.6.0") == "0.6.0"


def test_settings_are_checked():
    s = integration.KvtierSettings.from_extra_config({"kvtier_socket": "/s", "kvtier_timeout_s": "2.5",
                                                      "interface_v1": 1, "module_path": "x"})
    assert (s.socket, s.timeout_s, s.retry_s, s.interface_v1, s.namespace, s.engine_id) == \
        ("/s", 2.5, 10.0, True, None, None)
    assert s.lease_ttl_s == 5.0
    assert integration.KvtierSettings.from_extra_config({"kvtier_lease_ttl_s": 0}).lease_ttl_s == 0
    for extra, match in [({"kvtier_sockett": "/s"}, "unknown .*kvtier_sockett"),
                         ({"kvtier_timeout_s": 0}, "kvtier_timeout_s must be > 0"),
                         ({"kvtier_lease_ttl_s": -1}, "kvtier_lease_ttl_s must be >= 0"),
                         ({"kvtier_retry_s": "soon"}, "kvtier_retry_s must be a number"),
                         ({"kvtier_namespace": 7}, "kvtier_namespace must be a non-empty string")]:
        with pytest.raises(ValueError, match=match):
            integration.KvtierSettings.from_extra_config(extra)


def test_keys_are_sglangs_sha256_bytes_and_other_strings_never_collide_with_them():
    digest = "ab" * 32
    assert integration.kvtier_key(digest) == bytes.fromhex(digest)
    other = integration.kvtier_key("not-a-hash")
    assert len(other) == 33 and other != integration.kvtier_key("not-a-hash2")


# ------------------------------------------------------------------------------ host pool geometry
@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_rows_of_a_page_are_sglangs_flat_page(tree, kind, layout):
    """For every host layout, a page's rows concatenated are exactly ``get_data_page(...).flatten()``
    (the generic path's bytes), so the zero-copy and the generic path store the same bytes."""
    rank = tree(RankSpec(kind, NOWHERE, layout=layout, server=io_backend(layout)))
    host = rank.host
    for buffer in (host.kv_buffer,):
        buffer.view(torch.uint8).copy_(torch.randint(0, 256, buffer.view(torch.uint8).shape, dtype=torch.uint8))
    pages = HostPages.of(host)
    assert pages.order == integration.pages.ORDERS[(kind, layout)]
    assert pages.page_bytes == host.get_data_page(0).numel() * host.get_data_page(0).element_size()
    for p in (0, 1, pages.num_pages - 1):
        flat = host.get_data_page(p * pages.page_size).reshape(-1).view(torch.uint8)
        rows = torch.cat([row[p].reshape(-1).view(torch.uint8) for row in pages.rows])
        assert torch.equal(rows, flat)
    ids = pages.page_ids(torch.arange(3 * pages.page_size, 6 * pages.page_size), 3)
    assert ids.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="do not start pages"):
        pages.page_ids(torch.arange(1, 1 + pages.page_size), 1)


# ------------------------------------------------------------------------------ identity
def _model_dir(path, weights: bytes) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3}')
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(weights)
    return str(path)


def test_namespace_fingerprints_the_weights(tree, tmp_path):
    """Same weights: same namespace; other bytes in the same files: another namespace; with
    kvtier_namespace the operator vouches for the weights and the paths stop mattering (the
    weights digest itself: tests/unit/test_fingerprint.py)."""
    weights = os.urandom(300_000)
    first = _model_dir(tmp_path / "m", weights)
    copy = _model_dir(tmp_path / "copy", weights)
    spec = RankSpec("mha", NOWHERE, server={"model_path": first})
    ns = tree(spec).backend.identity.namespace.model
    assert ns.startswith(f"{first}|sglang-mha-2LTHD|")
    assert tree(spec).backend.identity.namespace.model == ns                      # deterministic
    assert tree(RankSpec("mha", NOWHERE, server={"model_path": copy})).backend.identity.namespace.model != ns

    tuned = bytearray(weights)
    tuned[150_000:150_010] = os.urandom(10)                                   # a fine-tune saved over it
    _model_dir(tmp_path / "m", bytes(tuned))
    assert tree(spec).backend.identity.namespace.model != ns
    fp8 = RankSpec("mha", NOWHERE, server={"model_path": first, "quantization": "fp8"})
    assert tree(fp8).backend.identity.namespace.model != tree(spec).backend.identity.namespace.model

    named = [tree(RankSpec("mha", NOWHERE, extra={"kvtier_namespace": "llama-3-8b"}, server={"model_path": p}))
             for p in (first, copy)]
    assert named[0].backend.identity.namespace.model == named[1].backend.identity.namespace.model
    assert named[0].backend.identity.namespace.model.startswith("llama-3-8b|")


def test_mla_ranks_are_engines_of_their_own_in_one_replicated_namespace(tree):
    idents = [tree(RankSpec("mla", NOWHERE, tp_rank=r, tp_size=4, engine_id="e")).backend.identity
              for r in (0, 3)]
    assert [(i.engine_id, i.rank, i.world_size) for i in idents] == [("e-tp0", 0, 1), ("e-tp3", 0, 1)]
    assert idents[0].namespace == idents[1].namespace and idents[0].namespace.sharding == "replicated"
    mha = tree(RankSpec("mha", NOWHERE, tp_rank=1, tp_size=2, engine_id="e")).backend.identity
    assert (mha.engine_id, mha.rank, mha.world_size, mha.namespace.sharding) == ("e", 1, 2, "sharded")


def test_unsupported_topologies_are_refused(tree):
    pages = HostPages.of(tree(RankSpec("mha", NOWHERE)).host)
    settings = integration.KvtierSettings(socket=NOWHERE)
    base = dict(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=False, model_name=None)
    for overrides, match in [({"attn_cp_size": 2}, "context parallelism"),
                             ({"should_split_heads": True, "tp_lcm_size": 4}, "tp_lcm_size")]:
        with pytest.raises(ValueError, match=match):
            identify(HiCacheStorageConfig(**{**base, **overrides}), pages, settings)
    mla_dcp = HiCacheStorageConfig(**{**base, "is_mla_model": True, "dcp_size": 2, "dcp_rank": 0,
                                      "logical_page_size": 4})
    with pytest.raises(ValueError, match="DCP"):
        identify(mla_dcp, pages, settings)


def storage_config(tp_rank: int, tp_size: int, mla: bool = False, **more) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name=None, **more)


@pytest.mark.parametrize("rank,size,placement,dp_rank,node", [
    (5, 8, {"nnodes": 2, "tp_size": 8, "pp_size": 1}, 0, (4, 5, 6, 7)),       # TP=8 over two nodes
    (0, 16, {"nnodes": 4, "tp_size": 16, "pp_size": 1}, 0, (0, 1, 2, 3)),
    (5, 8, {"nnodes": 1, "tp_size": 8, "pp_size": 1}, 0, None),               # one node
    (5, 8, {"nnodes": 2, "tp_size": 8, "pp_size": 2}, 0, None),               # a PP stage per node
    (1, 4, {"nnodes": 2, "tp_size": 8, "pp_size": 1}, 1, None),               # an attention DP group on one node
    (1, 8, {"nnodes": 4, "tp_size": 16, "pp_size": 1}, 1, (0, 1, 2, 3)),      # ... spanning two nodes
])
def test_an_mha_world_spanning_nodes_names_its_nodes_ranks(tree, rank, size, placement, dp_rank, node):
    pages = HostPages.of(tree(RankSpec("mha", NOWHERE)).host)
    settings = integration.KvtierSettings(socket=NOWHERE)
    ident = identify(storage_config(rank, size, dp_rank=dp_rank), pages, settings, placement)
    assert ident.node_ranks == node and (ident.rank, ident.world_size) == (rank, size)


def test_mla_across_nodes_is_refused_because_sglang_backs_it_up_from_rank_0_alone(tree):
    pages = HostPages.of(tree(RankSpec("mla", NOWHERE)).host)
    settings = integration.KvtierSettings(socket=NOWHERE)
    # What the refusal rests on, in SGLang's own code: of a TP=16 MLA group on two nodes only rank
    # 0 backs pages up (the controller skips the backup elsewhere), so node B's kvtierd would never
    # receive one, and SGLang's prefetch takes the least of all ranks' hits.
    assert [storage_config(r, 16, mla=True).is_storage_writer for r in range(16)] == [True] + [False] * 15
    with pytest.raises(ValueError, match="from TP rank 0 alone"):
        identify(storage_config(8, 16, mla=True), pages, settings, {"nnodes": 2, "tp_size": 16, "pp_size": 1})
    one_node = identify(storage_config(3, 8, mla=True), pages, settings, {"nnodes": 2, "tp_size": 8, "pp_size": 2})
    assert one_node.node_ranks is None and one_node.world_size == 1       # each TP group on one node: fine


# ------------------------------------------------------------------------------ without kvtierd
def test_without_kvtierd_every_call_is_a_miss_at_once(tree):
    rank = tree(RankSpec("mha", NOWHERE))
    backend = rank.backend
    keys = rank.page_keys(list(range(16)))
    host = rank.host.alloc(16)
    started = time.monotonic()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, host) == [False] * 4
    assert backend.batch_get_v1(keys, host) == [False] * 4
    assert backend.exists(keys[0]) is False
    assert time.monotonic() - started < 5
    with pytest.raises(NotImplementedError, match="interface_v1"):
        backend.batch_get(keys, [rank.host.get_dummy_flat_data_page() for _ in keys])
    for method, args in (("batch_exists_v2", (keys,)), ("batch_get_v2", ([],)), ("batch_set_v2", ([],))):
        with pytest.raises(NotImplementedError, match="sidecar"):
            getattr(backend, method)(*args)
    assert backend.clear() is False and backend.get_stats() is None


def test_generic_path_without_kvtierd_returns_none_and_false(tree):
    rank = tree(RankSpec("mla", NOWHERE, interface_v1=False))
    keys = rank.page_keys(list(range(8)))
    pages = [rank.host.get_dummy_flat_data_page() for _ in keys]
    assert rank.backend.batch_get(keys, pages) == [None, None]
    assert rank.backend.batch_set(keys, pages) is False
    assert rank.backend.get(keys[0], pages[0]) is None and rank.backend.set(keys[0], pages[0]) is False
    with pytest.raises(NotImplementedError, match="interface_v1"):
        rank.backend.batch_set_v1(keys, rank.host.alloc(8))


# ------------------------------------------------------------------------------ every layout, L2 <-> L3
@pytest.mark.integration
@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_every_host_layout_through_sglangs_controller_threads(daemon, kind, layout):
    """Host pages → SGLang's backup thread → kvtierd; then SGLang's prefetch (hit query, io-aux
    reads) into other host pages of another instance (the generic path): same bytes."""
    procs = []
    try:
        for engine, v1 in (("writer", True), ("reader", False)):
            procs.append(RankProcess(RankSpec(kind, daemon.socket, engine_id=engine, layout=layout, interface_v1=v1,
                                              server=io_backend(layout))))
        writer, reader = (p.ready() for p in procs)
        tokens = list(range(300, 332))
        assert writer.call("store_pages", tokens=tokens) == 32
        assert daemon.stats()["store_written_keys"] == 8
        got = reader.call("fetch_pages", tokens=tokens)
        assert got == {"hit": 32, "fetched": 32, "correct_pages": 8}
    finally:
        for p in procs:
            p.stop()


def fill_region(daemon, block_bytes: int):
    """Another engine opens stores for as many blocks as the region has pages: every evictable page
    goes (its jobs stay open, holding their pages, until the returned client closes)."""
    from kvtier import Client, NamespaceId
    filler = Client(daemon.socket, engine_id="filler", rank=None, world_size=1,
                    namespace=NamespaceId("another-model", "bfloat16", 4, block_bytes, "sharded"))
    pages = daemon.stats()["pages_total"]
    for job, begin in enumerate(range(0, pages, 4096), start=1):
        filler.open_store(job, [b"fill%09d" % i for i in range(begin, min(pages, begin + 4096))])
    return filler


@pytest.mark.integration
@pytest.mark.parametrize("leases", [True, False], ids=["leased", "no-lease"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_batch_exists_leases_its_hits_for_the_read_that_follows(daemon, leases, v1):
    """Between SGLang's hit query (batch_exists, prefetch thread) and its reads (batch_get, io-aux
    thread) another engine fills the region: the leased pages all arrive, with their bytes; without
    the lease (kvtier_lease_ttl_s 0) they are gone."""
    procs = []
    filler = None
    try:
        extra = {} if leases else {"kvtier_lease_ttl_s": 0}
        for engine, interface_v1 in (("writer", True), ("reader", v1)):
            procs.append(RankProcess(RankSpec("mha", daemon.socket, engine_id=engine, interface_v1=interface_v1,
                                              extra=extra)))
        writer, reader = (p.ready() for p in procs)
        tokens = list(range(500, 532))
        assert writer.call("store_pages", tokens=tokens) == 32
        assert reader.call("prefetch_query", tokens=tokens) == 32
        stats = daemon.stats()
        assert (stats["leases_open"], stats["entries_leased"]) == ((1, 8) if leases else (0, 0))
        filler = fill_region(daemon, reader.call("backend_info")["block_bytes"])
        got = reader.call("prefetch_read")
        if leases:
            assert got == {"fetched": 32, "correct_pages": 8}
            stats = daemon.stats()
            assert stats["lease_ends"] == {"consumed": 1} and stats["lease_missed_loads"] == 0
        else:
            assert got["fetched"] == 0
    finally:
        if filler is not None:
            filler.close()
        for p in procs:
            p.stop()


def test_token_bytes_differ_by_rank_variant():
    assert token_bytes((1, 2), 0, 0, 0, 64) != token_bytes((1, 2), 0, 0, 1, 64)


def test_the_documented_launch_line_loads_this_backend_through_sglangs_factory():
    """docs/sglang.md's extra config, parsed by SGLang's own parser, makes SGLang's dynamic factory
    build a KvtierStorage with the documented settings."""
    import re
    from pathlib import Path

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    line = re.search(r"--hicache-storage-backend dynamic \\\n\s*--hicache-storage-backend-extra-config '([^']*)'",
                     doc).group(1)
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(line)
    config = HiCacheStorageConfig(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name=None, extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(backend, integration.KvtierStorage)
    assert backend.settings.socket == "/dev/shm/kvtierd/kvtierd.sock" and backend.settings.interface_v1

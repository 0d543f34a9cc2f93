"""The plugin's settings, and how vLLM's keys, namespaces and engine ids map onto kvtierd's.

- **Settings.** ``KvtierSettings`` reads and checks the ``kvtier_*`` keys of
  ``kv_connector_extra_config`` (docs/vllm.md describes each); a misspelt ``kvtier_*`` key is an
  error, not ignored.
- **Keys.** vLLM's ``OffloadKey`` is the kvtier key as is, shortened past kvtierd's limit
  (``kvtier.integrations.offload.keys``); ``offload_key_bytes`` is an engine's key length, which
  its KV events need unshortened, from its ``prefix_caching_hash_algo`` (``engine_hash_algo``: announced
  by ``KvtierOffloadingConnector``, which has the VllmConfig that vLLM does not hand a spec).
- **Namespaces.** ``namespace_id`` builds the engine's ``NamespaceId`` (model, KV dtype, tokens
  per block, bytes per block per rank, sharding). The model part is ``<model name>@<fingerprint>``
  (``identity``: what determines the KV bytes, weights included) with vLLM's KV-cache memory
  layout appended; ``kvtier_namespace`` replaces name and fingerprint (for people who know their
  weights are identical). The namespace is *replicated* exactly when the KV is the same on every
  rank (``topology.replicated_kv``: vLLM's own gate without its single-node ``mp`` terms: pure MLA,
  TP > 1, no PP/PCP/DCP) and ``kvtier_sharding`` is ``auto``, else *sharded*; a replicated one
  keeps one copy per node, which the node's lowest rank writes. ``namespace_id`` refuses, at
  start-up and naming the setting, the configurations the plugin does not support (the package
  docstring lists them).
- **Nodes.** ``kvtier_ranks_per_node`` overrides how many of vLLM's ranks run on each node
  (``topology``).
- **Engine ids.** All sessions of one vLLM engine attach as one kvtier engine: ``vllm-<engine_id>``
  (one per DP rank), or the id the ``kvtier_engine_id`` setting names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from vllm.v1.kv_offload.config import OffloadingConfig

from kvtierd.contract import protocol as P
from kvtierd.contract.namespace import MAX_DTYPE_BYTES, MAX_MODEL_BYTES, NamespaceId, Sharding

from ...select import COPIERS
from ..common import read_settings, shorten
from ..offload.keys import GROUP_BYTES
from .handoff import Handoff
from .identity import ModelIdentity


@dataclass(frozen=True)
class KvtierSettings:
    """The ``kvtier_*`` settings of ``kv_connector_extra_config`` (docs/vllm.md describes each)."""

    socket: str                      # kvtierd's IPC socket
    namespace: str | None = None     # overrides the model part of the namespace
    sharding: str = "auto"           # auto: vLLM's replicated gate decides; sharded: never replicated
    timeout_s: float = 5.0           # bound on one request to kvtierd
    retry_s: float = 10.0            # after kvtierd was unreachable, wait this long before reconnecting
    lookup_wait_ms: float = 10.0     # longest the scheduler waits for a batched lookup's answer
    lease_ttl_s: float = 5.0         # how long kvtierd holds a lookup's hits for the load (0: no leases)
    copier: str = "auto"             # how the workers copy (kvtier.select.COPIERS: auto, cpu, cuda, torch)
    engine_id: str | None = None     # kvtier engine id; default vllm-<vLLM engine_id>
    ranks_per_node: int | None = None  # vLLM's ranks on each node; default from vLLM's config (topology)

    KEYS = {"kvtier_socket": "socket", "kvtier_namespace": "namespace", "kvtier_sharding": "sharding",
            "kvtier_timeout_s": "timeout_s", "kvtier_retry_s": "retry_s", "kvtier_copier": "copier",
            "kvtier_engine_id": "engine_id", "kvtier_lookup_wait_ms": "lookup_wait_ms",
            "kvtier_lease_ttl_s": "lease_ttl_s", "kvtier_ranks_per_node": "ranks_per_node"}
    NUMBERS = {"timeout_s": ("seconds", False), "retry_s": ("seconds", False),   # (unit, may be 0)
               "lookup_wait_ms": ("milliseconds", True), "lease_ttl_s": ("seconds", True),
               "ranks_per_node": ("ranks", False)}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "KvtierSettings":
        """Read and check the settings; a ``kvtier_*`` key that is not a setting is an error."""
        values = read_settings(extra, cls.KEYS, cls.NUMBERS, where="kv_connector_extra_config")
        if values.get("sharding", "auto") not in ("auto", "sharded"):
            raise ValueError(f"kvtier_sharding must be 'auto' or 'sharded', got {values['sharding']!r}")
        if values.get("copier", "auto") not in COPIERS:
            raise ValueError(f"kvtier_copier must be one of {', '.join(COPIERS)}, got {values['copier']!r}")
        if "ranks_per_node" in values:
            if values["ranks_per_node"] != int(values["ranks_per_node"]):
                raise ValueError(f"kvtier_ranks_per_node must be a whole number, got {values['ranks_per_node']:g}")
            values["ranks_per_node"] = int(values["ranks_per_node"])
        return cls(**values)


logger = logging.getLogger("vllm.kvtier")

_HASH_ALGO: Handoff[str] = Handoff("kvtier_hash_algo")
announce_hash_algo = _HASH_ALGO.announce


def engine_hash_algo() -> str:
    """The engine's ``prefix_caching_hash_algo``: announced (``announce_hash_algo``), else vLLM's
    default, sha256, which the plain spec path (no VllmConfig) can only assume."""
    announced = _HASH_ALGO.announced()
    if announced is None:
        logger.info("kvtier: KV events assume prefix_caching_hash_algo sha256 (vLLM's default): the plain "
                    "OffloadingConnector path cannot see the engine's; KvtierOffloadingConnector can")
        return "sha256"
    return announced


def offload_key_bytes(hash_algo: str) -> int:
    """The length of an engine's OffloadKeys: its block hash (``prefix_caching_hash_algo``) and
    the group index. Raises ValueError when kvtier would shorten them (``kvtier_key``): such keys
    cannot be mapped back to block hashes, so their KV events cannot be published."""
    from vllm.utils.hashing import get_hash_fn_by_name
    nbytes = len(get_hash_fn_by_name(hash_algo)(b"")) + GROUP_BYTES
    if nbytes > P.MAX_KEY_BYTES:
        raise ValueError(f"prefix_caching_hash_algo {hash_algo!r} makes {nbytes}-byte keys, which kvtier shortens: "
                         "their KV events cannot name vLLM's block hashes; use sha256")
    return nbytes


def namespace_id(config: OffloadingConfig, settings: KvtierSettings, model: ModelIdentity | None,
                 replicated_kv: bool) -> NamespaceId:
    """The kvtier namespace of an engine, from vLLM's offloading config and the model's identity.

    The model part is ``<name>@<fingerprint>|<vLLM KV-cache layout>``, or ``kvtier_namespace`` in
    place of name and fingerprint. Replicated exactly when the KV is the same on every rank
    (``replicated_kv``: ``topology.Topology.replicated``) and the settings do not force sharded.
    ``model`` may be None only with ``kvtier_namespace`` set. Raises ValueError for
    configurations the plugin does not support.
    """
    if config.worker_kv_bytes_per_block <= 0:
        raise ValueError("vLLM reports no KV bytes per block for offloading (e.g. HiSparse host blocks); "
                         "kvtierd cannot offload this model")
    if config.cache.blocks_per_chunk != 1:
        raise ValueError(f"kvtier offloads one vLLM block per key; blocks_per_chunk="
                         f"{config.cache.blocks_per_chunk} (set by 'block_size'/'blocks_per_chunk' in "
                         "kv_connector_extra_config) is not supported: drop that setting")
    if config.parallel.pp_size != 1:
        raise ValueError(f"pipeline parallelism (pp_size={config.parallel.pp_size}) is not supported: the "
                         "stages hold different layers, and a kvtier namespace has one block size for all ranks")
    if config.canonical_layout:
        raise ValueError("kv_connector_extra_config canonical_layout is not supported by kvtier; drop it")
    tokens = {g.tokens_per_block for g in config.groups}
    if len(tokens) != 1:
        raise ValueError(f"KV-cache groups with different block sizes {sorted(tokens)} are not supported")
    replicated = replicated_kv and settings.sharding == "auto"
    tail = f"|{config.kv_cache_layout}" if config.kv_cache_layout else ""
    if settings.namespace:
        name = settings.namespace
    else:
        name, tail = model.name, f"@{model.fingerprint}{tail}"
    return NamespaceId(model=shorten(name, MAX_MODEL_BYTES - len(tail.encode())) + tail,
                       dtype=shorten(config.model.dtype, MAX_DTYPE_BYTES), block_tokens=tokens.pop(),
                       block_bytes=config.worker_kv_bytes_per_block,
                       sharding=Sharding.REPLICATED if replicated else Sharding.SHARDED)


def kvtier_engine_id(config: OffloadingConfig, settings: KvtierSettings) -> str:
    """The engine id kvtierd sees for this vLLM engine: ``kvtier_engine_id``, else vllm-<engine_id>."""
    return settings.engine_id or shorten(f"vllm-{config.engine_id}", P.MAX_STR_BYTES)

"""Who an SGLang scheduler process is to kvtierd: its namespace and its kvtier engine.

**Namespace.** ``NamespaceId(model, dtype, page_size tokens, page bytes per rank, sharding)`` where
``model`` is ``<name>|sglang-<mha|mla>-<page byte order>[-pp<r>of<n>]|<fingerprint>``:

- ``name``: ``--served-model-name``, else the model path (or ``kvtier_namespace``);
- the page byte order of the host layout (pages.ORDERS) and, with pipeline parallelism, the stage
  (stages hold different layers);
- ``fingerprint`` (kvtier.integrations.fingerprint): model path, revision, the weights digest
  (``fingerprint.local_weights_digest``: safetensors headers and samples of every tensor, the
  checkpoint's config, index and quantization files), weight dtype, quantization (and its KV
  scales file), load format, model overrides, KV-cache dtype, page size, page order. With
  ``kvtier_namespace`` set, the operator vouches for the weights: the fingerprint keeps only the
  KV format (KV dtype, page size, page order), so engines serving the same weights from different
  paths share.

``sharding``: *replicated* for rank-replicated KV (MLA, where SGLang's ``is_mla_model`` is set),
*sharded* otherwise (each TP rank holds its heads; kvtierd keys the namespace by TP size too).

**Engines.** Sharded (MHA): the TP ranks of one SGLang instance are the ranks of one kvtier
engine (world size = TP size); every rank writes its shard and a page becomes visible only when
every rank voted. Replicated (MLA): SGLang 0.5.23 calls ``set`` on the storage writer rank only
(``HiCacheStorageConfig.is_storage_writer``, TP rank 0) and skips backup on the others, so a
vote of every rank can never come. Each TP rank is therefore a kvtier engine of its own (world
size 1) in the one replicated namespace: the writer's commit alone makes a page ready, after its
copy from its own host pool completed; the other ranks only look up and load (docs/sglang.md
explains why this is safe).

The default engine id is ``sglang-<pid of the parent process>``: SGLang starts the TP scheduler
processes of one instance from one parent, so they agree on it without talking, and two
instances on a node differ. ``-dp<r>`` (attention data parallelism), ``-pp<r>`` (pipeline
stage) and, for replicated namespaces, ``-tp<r>`` are appended.

**Several nodes** (``--nnodes`` > 1, a TP group split over nodes: SGLang places TP ranks
``[n·L, (n+1)·L)`` on node n, L = tp_size / nodes per TP group): each node's TP ranks attach to
that node's kvtierd, naming them (``node_ranks``), so its daemon counts their votes only and its
entries hold their shards (MHA). The parent process differs per node, so the default engine id
does too, which is harmless: each daemon sees only its node's ranks. MLA is refused there:
SGLang backs MLA pages up from TP rank 0 alone, so the other nodes' kvtierd would never receive
a page, and SGLang takes the least of the TP ranks' prefetch hits, so no prefetch would ever hit.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvtierd.contract.namespace import MAX_DTYPE_BYTES, MAX_MODEL_BYTES, NamespaceId, Sharding
from kvtierd.contract.protocol import MAX_STR_BYTES

from ..common import shorten
from ..fingerprint import fingerprint, local_weights_digest
from .pages import HostPages
from .settings import KvtierSettings

logger = logging.getLogger("sglang.kvtier")


MLA_ACROSS_NODES_REFUSED = (
    "kvtier does not store an MLA model whose TP group spans nodes (--nnodes {nnodes}): SGLang 0.5.23 backs "
    "MLA pages up from TP rank 0 alone (HiCacheStorageConfig.is_storage_writer), so the kvtierd of every other "
    "node would never receive a page, and SGLang takes the least of the TP ranks' prefetch hits, so no "
    "prefetch would ever hit. Use a storage backend that spans nodes, or keep each TP group on one node")


@dataclass(frozen=True)
class Identity:
    namespace: NamespaceId
    engine_id: str
    rank: int
    world_size: int
    fingerprint_parts: dict
    node_ranks: tuple[int, ...] | None = None   # the TP ranks on this node, when the TP group spans nodes


def _file_digest(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


MODEL_FIELDS = ("model_path", "revision", "dtype", "quantization", "quantization_param_path", "kv_cache_dtype",
                "load_format", "json_model_override_args")
PLACEMENT_FIELDS = ("nnodes", "tp_size", "pp_size")   # how SGLang spreads an instance over nodes


def node_ranks(config, args: dict) -> tuple[int, ...] | None:
    """The ranks of this storage world (SGLang's ``config.tp_size``: the attention TP group) that
    run on this process's node, when the world spans nodes; None when it is all on one node.

    SGLang (``_calculate_rank_ranges``) gives each node ``tp_size / nodes per TP group`` consecutive
    global TP ranks; a rank of attention group ``dp_rank`` is global rank dp_rank·tp_size + rank."""
    nnodes = int(args.get("nnodes") or 1)
    per_tp_group = max(nnodes // int(args.get("pp_size") or config.pp_size), 1)
    if per_tp_group == 1:
        return None
    per_node = int(args.get("tp_size") or config.tp_size) // per_tp_group
    first = getattr(config, "dp_rank", 0) * config.tp_size
    node = (first + config.tp_rank) // per_node
    ranks = tuple(r for r in range(config.tp_size) if (first + r) // per_node == node)
    return None if len(ranks) == config.tp_size else ranks


def server_args() -> dict:
    """The server arguments in effect that bear on the KV bytes (SGLang's config bags, i.e. the
    resolved values); empty outside an SGLang server."""
    out: dict[str, Any] = {}
    try:
        from sglang.srt.runtime_context import get_model, get_parallel, get_serving
    except ImportError:
        return out
    for bag, names in ((get_model, MODEL_FIELDS), (get_serving, ("served_model_name",)),
                       (get_parallel, PLACEMENT_FIELDS)):
        for name in names:
            try:
                out[name] = getattr(bag(), name)
            except Exception:            # not published in this process (e.g. outside a server)
                pass
    return out


def fingerprint_parts(args: dict, pages: HostPages, settings: KvtierSettings) -> dict:
    """What determines the KV bytes, from SGLang's server arguments and host pool."""
    parts: dict[str, Any] = {"kv_dtype": pages.dtype, "kv_cache_dtype": args.get("kv_cache_dtype"),
                             "page_size": pages.page_size, "page_order": pages.order, "kind": pages.kind}
    if settings.namespace is not None:
        return parts
    model_path, revision = args.get("model_path"), args.get("revision")
    digest = local_weights_digest(model_path, revision) if model_path else None
    if digest is None:
        logger.warning("kvtier: no weight file of %r found on this node to fingerprint its weights; the namespace "
                       "keys on its path and revision only", model_path)
    parts.update({name: args.get(name) for name in MODEL_FIELDS}, weights=digest,
                 kv_scales=_file_digest(args.get("quantization_param_path")))
    return parts


def identify(config, pages: HostPages, settings: KvtierSettings, args: dict | None = None) -> Identity:
    """The namespace and engine of this scheduler process (``config``: SGLang's HiCacheStorageConfig).

    Raises ValueError for topologies kvtier does not store (docs/sglang.md, "Not supported").
    """
    if getattr(config, "dcp_size", 1) > 1:
        raise ValueError("kvtier does not support decode context parallelism (DCP) with HiCache storage")
    if getattr(config, "attn_cp_size", 1) > 1:
        raise ValueError("kvtier does not support attention context parallelism with HiCache storage: "
                         "its ranks hold disjoint slices of every page")
    if getattr(config, "should_split_heads", False):
        raise ValueError("kvtier does not support tp_lcm_size head splitting (heterogeneous TP); drop tp_lcm_size")
    args = args or {}
    replicated = bool(config.is_mla_model)
    on_node = node_ranks(config, args)
    if replicated and on_node is not None:
        raise ValueError(MLA_ACROSS_NODES_REFUSED.format(nnodes=args.get("nnodes")))
    parts = fingerprint_parts(args, pages, settings)
    name = settings.namespace or args.get("served_model_name") or config.model_name or args.get("model_path") \
        or "unknown-model"
    tag = f"sglang-{pages.kind}-{pages.order}"
    if config.pp_size > 1:
        tag += f"-pp{config.pp_rank}of{config.pp_size}"
    model = f"{shorten(name, 160)}|{tag}|{fingerprint(parts)}"
    namespace = NamespaceId(model=shorten(model, MAX_MODEL_BYTES), dtype=shorten(pages.dtype, MAX_DTYPE_BYTES),
                            block_tokens=pages.page_size, block_bytes=pages.page_bytes,
                            sharding=Sharding.REPLICATED if replicated else Sharding.SHARDED)
    engine = settings.engine_id or f"sglang-{os.getppid()}"
    if getattr(config, "dp_rank", 0):
        engine += f"-dp{config.dp_rank}"
    if config.pp_size > 1:
        engine += f"-pp{config.pp_rank}"
    if replicated:
        engine += f"-tp{config.tp_rank}"
        rank, world = 0, 1
    else:
        rank, world = config.tp_rank, config.tp_size
    return Identity(namespace, shorten(engine, MAX_STR_BYTES), rank, world, parts, on_node)

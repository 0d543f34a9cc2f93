"""Where a vLLM engine's ranks run, as kvtierd needs to know it: which ranks share a node (and
so a kvtierd), and whether the KV is the same on every rank (one copy per node).

**Node ranks.** Each node runs its own kvtierd, and each daemon counts the votes of the ranks
attached to it; so every session names the ranks of its node (``node_ranks``), a contiguous block
of ``ranks_per_node`` ranks — how vLLM places them: its ``mp`` executor starts ranks
``[n·L, (n+1)·L)`` on node n (L = ``ParallelConfig.local_world_size``, from ``--nnodes``), and its
Ray executor numbers workers node by node, the driver's node first. The scheduler runs on the
node of rank 0 (``mp``: node 0; Ray: the driver, which must be a node with GPUs of the engine),
so its coordinator session names rank 0's block. ``kvtier_ranks_per_node`` overrides L; Ray needs
it when it spreads an engine over nodes (vLLM's config says one node there: ``--nnodes`` is for
``mp``), and a worker that finds vLLM's world on more nodes than that says refuses to start,
naming the setting, rather than wait for votes that can never come.

**Replicated.** vLLM's own gate (``OffloadingConfig.replicated_layout``: pure MLA, TP > 1, no
PP/PCP/DCP) also asks for the single-node ``mp`` executor, because vLLM's CPU tier shares one
``/dev/shm`` mapping between the ranks of the node. kvtierd keeps a copy per node and serves any
executor, so the plugin's gate is vLLM's without those two terms (``replicated_kv``).

**Not supported**, refused at start-up: the ``external_launcher`` executor. Each of its processes
runs a scheduler of its own, and vLLM needs them to schedule alike; their lookups of kvtierd
would be their own, and a block that becomes ready between two processes' lookups would make
them schedule differently.

``KvtierOffloadingConnector`` derives the topology from the whole VllmConfig and hands it to the
spec it builds (``announce``); the plain spec path sees only vLLM's OffloadingConfig: vLLM's gate
as is, and ``kvtier_ranks_per_node`` or one node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .handoff import Handoff

logger = logging.getLogger("vllm.kvtier")

EXTERNAL_LAUNCHER_REFUSED = (
    "kvtier does not support vLLM's external_launcher executor: every process runs a scheduler of its own, "
    "which would look kvtierd up on its own, and a block that becomes ready between two processes' lookups "
    "would make them schedule differently (vLLM needs them to agree). Use the mp executor (--nnodes for "
    "several nodes) or Ray")


@dataclass(frozen=True)
class Topology:
    """An engine's placement, as kvtierd needs it (module docstring)."""

    world_size: int
    ranks_per_node: int          # ranks of the world on one node: a contiguous block each
    replicated: bool             # the offloaded KV is the same on every rank: one copy per node

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide vLLM's world of {self.world_size} "
                             "ranks (kvtier_ranks_per_node: the GPUs of the engine on each node)")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s node (the scheduler's: rank 0's)."""
        first = rank - rank % self.ranks_per_node
        return tuple(range(first, first + self.ranks_per_node))

    def with_ranks_per_node(self, ranks_per_node: int | None) -> "Topology":
        """The same, with ``kvtier_ranks_per_node`` (when set) for the ranks per node."""
        if ranks_per_node is None:
            return self
        return Topology(self.world_size, ranks_per_node, self.replicated)

    def check_nodes(self, node_count: int | None) -> None:
        """At a worker: refuse a world that vLLM spread over more nodes (``node_count``, None when
        unknown) than this topology has, naming the setting that fixes it."""
        if node_count is not None and node_count > self.nodes:
            raise ValueError(f"vLLM's {self.world_size} ranks run on {node_count} nodes, and kvtier would take "
                             f"{self.ranks_per_node} of them per node ({self.nodes} node(s)): each node's kvtierd "
                             "would wait for votes of ranks that never reach it. Set kv_connector_extra_config "
                             "kvtier_ranks_per_node to the engine's GPUs per node (vLLM's Ray executor says one node "
                             "whatever the placement)")


def replicated_kv(vllm_config, kv_cache_config) -> bool:
    """vLLM's ``replicated_layout`` gate (vllm/distributed/kv_transfer/kv_connector/v1/offloading/
    config.py) without its two placement terms, the ``mp`` executor and one node: pure MLA at
    TP > 1 whose every rank holds the same KV (``kv_tp_replicas``), no other parallel axis."""
    parallel = vllm_config.parallel_config
    return bool(vllm_config.model_config.use_mla
                and parallel.tensor_parallel_size > 1
                and kv_cache_config.kv_tp_replicas == parallel.tensor_parallel_size
                and parallel.pipeline_parallel_size == 1
                and parallel.prefill_context_parallel_size == 1
                and parallel.decode_context_parallel_size == 1
                and parallel.world_size == parallel.tensor_parallel_size)


def from_vllm_config(vllm_config, kv_cache_config) -> Topology:
    """The topology of the engine a VllmConfig describes (the connector's path)."""
    parallel = vllm_config.parallel_config
    if parallel.distributed_executor_backend == "external_launcher":
        raise ValueError(EXTERNAL_LAUNCHER_REFUSED)
    return Topology(parallel.world_size, parallel.local_world_size, replicated_kv(vllm_config, kv_cache_config))


def from_offloading_config(config) -> Topology:
    """What the plain spec path can know: vLLM's gate, and one node."""
    return Topology(config.parallel.world_size, config.parallel.world_size, config.replicated_layout)


def vllm_node_count() -> int | None:
    """How many nodes vLLM found its world on (a worker after vLLM's distributed set-up), else None."""
    try:
        from vllm.distributed.parallel_state import get_node_count
        return get_node_count()
    except (ImportError, AssertionError):      # not set up: a process without vLLM's distributed world
        return None


# ------------------------------------------------------------------------------ handing it to the spec
_TOPOLOGY: Handoff[Topology] = Handoff("kvtier_topology")
announce = _TOPOLOGY.announce
announced = _TOPOLOGY.announced

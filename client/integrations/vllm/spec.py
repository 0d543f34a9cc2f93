"""The spec vLLM's OffloadingConnector loads: ``KvtierOffloadingSpec``, which builds the manager
(scheduler side) and the worker (each TP rank), each attached to its node's kvtierd with the
ranks of its node (``topology``).

It is built by ``KvtierOffloadingConnector`` (the recommended path: the connector hands it the
model's identity from the whole VllmConfig and reports failed loads to vLLM), or by vLLM's own
OffloadingConnector through ``spec_name`` (the plain path: it fingerprints what the model name
points to, and a failed load stops the engine; it says so at start-up).
"""

from __future__ import annotations

import functools
import logging

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from . import identity, topology
from .manager import KvtierOffloadingManager
from ..offload.events import EventFeed
from .settings import KvtierSettings, engine_hash_algo, kvtier_engine_id, namespace_id, offload_key_bytes
from .worker import KvtierOffloadingWorker

logger = logging.getLogger("vllm.kvtier")

PLAIN_PATH_WARNING = (
    "kvtier is loaded through vLLM's plain OffloadingConnector (spec_name KvtierOffloadingSpec): vLLM 0.33 "
    "gives an offloading spec no way to report a failed load, so a load that cannot complete (blocks evicted "
    "or cleared since lookup, kvtierd restarted) stops the engine, and the namespace's fingerprint cannot "
    "cover revision, quantization or hf_overrides. Use "
    '"kv_connector": "KvtierOffloadingConnector", "kv_connector_module_path": "kvtier.integrations.vllm" '
    'with "kv_load_failure_policy": "recompute" (docs/vllm.md)')


class KvtierOffloadingSpec(OffloadingSpec):
    """The entry point vLLM's ``OffloadingSpecFactory`` loads (``spec_name`` "KvtierOffloadingSpec",
    ``spec_module_path`` "kvtier.integrations.vllm"). Built once in the scheduler process and once
    in every worker; connects lazily (``get_manager`` / ``get_worker``)."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.settings = KvtierSettings.from_extra_config(self.extra_config)
        resolve = identity.announced()
        self.reports_failures = resolve is not None      # built by KvtierOffloadingConnector
        if resolve is None:
            _warn_plain_path()
            resolve = functools.partial(identity.from_offloading_config, config)
        self.model = None if self.settings.namespace else resolve()
        placed = topology.announced() or topology.from_offloading_config(config)
        self.topology = placed.with_ranks_per_node(self.settings.ranks_per_node)
        self.namespace = namespace_id(config, self.settings, self.model, self.topology.replicated)
        self.engine_id = kvtier_engine_id(config, self.settings)
        # Deliberately False even for the replicated namespace: see the package docstring.
        self.replicated_layout = False
        # KV events (vLLM's --kv-events-config): the namespace's event log, announced by this engine.
        self.events_key_bytes = offload_key_bytes(engine_hash_algo()) if self.kv_events_config.enable_kv_cache_events \
            else None
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            groups = len(self.config.groups)
            events = None if self.events_key_bytes is None else EventFeed(self.events_key_bytes, groups)
            self._manager = KvtierOffloadingManager(self.settings, self.engine_id, self.config.parallel.world_size,
                                                    self.namespace, num_groups=groups, events=events,
                                                    node_ranks=self.topology.node_ranks(0))
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            parallel = self.config.parallel
            if parallel.data_parallel_size == 1:    # vLLM counts the nodes of all DP replicas together
                self.topology.check_nodes(topology.vllm_node_count())
            self._worker = KvtierOffloadingWorker(self.settings, self.engine_id, parallel.rank, parallel.world_size,
                                                  self.namespace, kv_caches, reports_failures=self.reports_failures,
                                                  node_ranks=self.topology.node_ranks(parallel.rank))
        return self._worker


@functools.cache
def _warn_plain_path() -> None:
    logger.warning("kvtier: %s", PLAIN_PATH_WARNING)

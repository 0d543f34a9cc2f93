"""``KvtierOffloadingConnector``: vLLM's OffloadingConnector with kvtier's spec, a model identity
and a topology (``topology``: which ranks share a node) from the whole VllmConfig, and failed
loads reported the way vLLM's scheduler recovers from.

vLLM 0.33's offloading worker asserts that every transfer succeeded, and its spec API has no
way to report a failure; the connector API has two (``KVConnectorBase_V1``), which the
OffloadingConnector does not use. This subclass does:

- **Worker role.** ``KvtierOffloadingWorker`` reports every load successful to vLLM and hands
  the failures here (the index of the first block not loaded). With one KV-cache group they go
  out as ``get_block_ids_with_load_errors`` (the load's GPU blocks from that index on; vLLM keeps
  the valid prefix and recomputes the rest, for async and sync loads alike); with several groups,
  whose block ids vLLM cannot map back to requests, as ``failed_recving`` (the whole request).
  ``sync_load_budget_bytes`` with several groups is refused: a failed sync load would have no
  report vLLM accepts.
- **Scheduler role.** ``update_connector_output`` tells the manager which requests' loads failed,
  so that it answers MISS for them: vLLM recomputes such a request (``kv_load_failure_policy``
  "recompute") rather than being offered the same failing load again, which otherwise leaves it
  waiting for good. Under "fail" (vLLM's default) the request ends with finish reason ``error``
  and the engine goes on.

Load it with ``"kv_connector": "KvtierOffloadingConnector", "kv_connector_module_path":
"kvtier.integrations.vllm"`` and the usual ``spec_name``/``spec_module_path`` (docs/vllm.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from . import identity, topology
from .manager import KvtierOffloadingManager
from .settings import announce_hash_algo
from .spec import KvtierOffloadingSpec

logger = logging.getLogger("vllm.kvtier")


class KvtierOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector for kvtier (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        with identity.announce(functools.partial(identity.from_vllm_config, vllm_config)), \
                topology.announce(topology.from_vllm_config(vllm_config, kv_cache_config)), \
                announce_hash_algo(vllm_config.cache_config.prefix_caching_hash_algo):
            super().__init__(vllm_config, role, kv_cache_config)
        ours = (isinstance(self.connector_scheduler.manager, KvtierOffloadingManager) if role == KVConnectorRole.SCHEDULER
                else isinstance(self.connector_worker.spec, KvtierOffloadingSpec))
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        if not ours:
            raise ValueError("KvtierOffloadingConnector needs kv_connector_extra_config spec_name "
                             "'KvtierOffloadingSpec' and spec_module_path 'kvtier.integrations.vllm'; it got "
                             f"spec_name {extra.get('spec_name')!r}")
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1
        if not self._single_group and int(extra.get("sync_load_budget_bytes", 0)) > 0:
            raise ValueError("sync_load_budget_bytes is not supported by kvtier with several KV-cache groups: vLLM "
                             "accepts no report of a failed synchronous load there; drop the setting")
        self._world_size = vllm_config.parallel_config.world_size
        # worker: vLLM load job -> (request id, or None for a sync load; its GPU block ids)
        self._loads: dict[int, tuple[str | None, Any]] = {}
        self._load_errors: set[int] = set()
        # scheduler: vLLM load job -> [request id, its GPU block ids, worker reports still due]
        self._loading: dict[int, list] = {}
        if role == KVConnectorRole.SCHEDULER:
            policy = vllm_config.kv_transfer_config.kv_load_failure_policy
            if policy == "recompute":
                logger.info("kvtier: a load that fails is recomputed (kv_load_failure_policy recompute)")
            else:
                logger.warning("kvtier: kv_load_failure_policy is %r: a load from kvtierd that fails (blocks evicted "
                               "or cleared since lookup, kvtierd restarted) ends its request with an error; "
                               "\"recompute\" computes it instead (docs/vllm.md)", policy)

    # --- worker role
    def start_load_kv(self, forward_context, **kwargs) -> None:
        for job_id, job in self._connector_metadata.load_jobs.items():
            self._loads[job_id] = (None if job.sync else job.req_id, job.dst_spec.block_ids)
        super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        for job_id, first_bad in self.connector_worker.worker.take_load_outcomes():
            req_id, block_ids = self._loads.pop(job_id, (None, ()))
            if first_bad is None:
                continue
            if self._single_group:
                self._load_errors.update(int(b) for b in block_ids[first_bad:])
            elif req_id is not None:            # an async load: vLLM fails or recomputes the request
                results.failed_recving.add(req_id)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- scheduler role
    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        for job_id, job in meta.load_jobs.items():
            self._loading[job_id] = [job.req_id, set(job.dst_spec.block_ids.tolist()), self._world_size]
        return meta

    def update_connector_output(self, connector_output) -> None:
        failed = set(connector_output.failed_recving or ())
        invalid = connector_output.invalid_block_ids
        if invalid:
            failed.update(req_id for req_id, blocks, _ in self._loading.values() if not blocks.isdisjoint(invalid))
        manager = self.connector_scheduler.manager
        if failed and isinstance(manager, KvtierOffloadingManager):
            manager.loads_failed(failed)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, OffloadingWorkerMetadata):
            for job_id, count in meta.completed_jobs.items():
                loading = self._loading.get(job_id)
                if loading is not None:
                    loading[2] -= count
                    if loading[2] <= 0:
                        del self._loading[job_id]
        super().update_connector_output(connector_output)

"""The worker side: vLLM's ``OffloadingWorker`` as a kvtierd rank session (one per TP rank).

Each worker's ``KvtierOffloadingWorker`` is the *rank* session of its TP rank in the vLLM
engine's kvtier engine (world size = vLLM's world size). It registers the rank's KV cache with
kvtier (``block_views``: the byte ranges that make up one vLLM block) and carries out the kvtier
jobs the manager opened (kvtier.integrations.vllm.transfer). A block becomes loadable only when
every rank voted on its store; a load's pins drop when every rank released it. The class
docstring gives the contract per vLLM method.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtierd.contract import protocol as P
from kvtierd.contract.errors import KvtierError
from kvtierd.contract.namespace import NamespaceId

from ...api import Client
from .settings import KvtierSettings
from .transfer import KvtierLoadStoreSpec

# A child of vLLM's logger, so that these lines go where vLLM's own go.
logger = logging.getLogger("vllm.kvtier")


def block_views(kv_caches: CanonicalKVCaches, block_bytes: int) -> list:
    """The per-range tensors ``[num_blocks, nbytes]`` (int8) whose rows, concatenated, are one
    vLLM block's bytes as kvtier stores them; they add up to ``block_bytes``.

    Every offloaded group must use the same byte ranges (one group, or vLLM's hybrid allocator
    where groups share the tensors); each range is a reference's un-padded page, or the tensor's
    padded page when that is what vLLM counts in ``worker_kv_bytes_per_block``.
    """
    groups = kv_caches.group_data_refs
    if not groups or not groups[0]:
        raise ValueError("vLLM registered no KV-cache references to offload")
    signature = [(ref.tensor_idx, ref.page_size_bytes) for ref in groups[0]]
    for g, refs in enumerate(groups[1:], start=1):
        if [(ref.tensor_idx, ref.page_size_bytes) for ref in refs] != signature:
            raise ValueError(f"KV-cache group {g} uses other byte ranges than group 0; kvtier supports models "
                             "whose offloaded groups share their KV-cache tensors")
    ranges = signature
    if sum(n for _, n in ranges) != block_bytes:
        tensors = list(dict.fromkeys(i for i, _ in signature))
        ranges = [(i, kv_caches.tensors[i].page_size_bytes) for i in tensors]
        if sum(n for _, n in ranges) != block_bytes:
            raise ValueError(f"cannot find vLLM's {block_bytes} bytes per block in the registered KV cache "
                             f"(references: {signature})")
    views = []
    for index, nbytes in ranges:
        tensor = kv_caches.tensors[index].tensor
        if tensor.dim() != 2:
            tensor = tensor.reshape(tensor.shape[0], -1)
        views.append(tensor[:, :nbytes])
    return views


@dataclass
class _Transfer:
    kind: str                                  # "store" | "load"
    started: float
    remaining: set = field(default_factory=set)  # kvtier jobs not finished yet
    ok: bool = True
    nbytes: int = 0
    why: str = ""


class KvtierOffloadingWorker(OffloadingWorker):
    """vLLM's OffloadingWorker backed by a kvtierd rank session (one per TP rank).

    - ``submit_store(job, gpu_spec, kvtier_spec)``: this rank's store request of each kvtier job
      (one round trip to kvtierd; the copy runs in the background). Writer ranks copy the blocks
      kvtierd decided to write and vote after the copy completed; non-writers' request is their
      vote. Never waits for a copy.
    - ``submit_load(job, kvtier_spec, gpu_spec)``: this rank's load request (one round trip); the
      copy runs in the background and the job's pins are released after it completed.
      ``expedited`` loads share the queue (kvtier copies complete in submission order).
    - ``get_finished()``: vLLM transfer ids whose kvtier jobs all finished on this rank. A store
      kvtierd could not complete (aborted, copy failed, kvtierd gone) is reported successful —
      the block is simply not cached — and logged; a load that did not bring every block is
      reported failed (vLLM 0.33 stops on it rather than compute from unverified blocks).
    - ``wait(jobs)``: blocks until those transfers' copies completed and were voted/released.
    """

    def __init__(self, settings: KvtierSettings, engine_id: str, rank: int, world_size: int, layout: NamespaceId,
                 kv_caches: CanonicalKVCaches, connect: Callable[..., Client] = Client):
        self.layout = layout
        self.rank = rank
        self._views = block_views(kv_caches, layout.block_bytes)
        self._client = connect(settings.socket, engine_id=engine_id, rank=rank, world_size=world_size,
                               namespace=layout, copier=settings.copier, timeout=settings.timeout_s,
                               reconnect_timeout=settings.timeout_s)
        try:
            self._client.register_kv_caches(self._views)
        except BaseException:
            self._client.close()
            raise
        self._owner: dict[int, int] = {}              # kvtier job -> vLLM transfer job
        self._transfers: dict[int, _Transfer] = {}    # vLLM transfer job -> its state
        self._finished: list[TransferResult] = []
        logger.info("kvtier: rank %d of engine %s attached (%s, writer=%s, %d KV ranges, %d bytes/block)",
                    rank, engine_id, self._client.info.namespace, self._client.is_writer,
                    len(self._views), layout.block_bytes)

    @property
    def client(self) -> Client:
        return self._client

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvtierLoadStoreSpec), f"not a kvtier spec: {dst_spec!r}"
        transfer = self._begin(job_id, "store")
        block_ids = np.asarray(src_spec.block_ids, dtype=np.int64)
        if len(block_ids) != dst_spec.num_blocks:
            self._fail(transfer, f"{len(block_ids)} GPU blocks for {dst_spec.num_blocks} keys")
        else:
            offset = 0
            for part in dst_spec.parts:
                ids = block_ids[offset: offset + len(part.select)]
                offset += len(part.select)
                full = np.full(len(part.keys), ids[0] if len(ids) else 0, dtype=np.int64)
                full[part.select] = ids
                try:
                    decision = self._client.store(part.job, list(part.keys), full)
                except KvtierError as exc:
                    self._fail(transfer, f"store job {part.job}: {exc}")
                    continue
                self._track(job_id, transfer, part.job)
                written = np.flatnonzero(np.asarray(decision.outcomes) == P.StoreOutcome.WRITE)
                if not np.array_equal(written, part.select):
                    self._fail(transfer, f"store job {part.job}: kvtierd's decision differs from the scheduler's")
                elif self._client.is_writer:
                    transfer.nbytes += len(ids) * self.layout.block_bytes
        self._settle(job_id)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, KvtierLoadStoreSpec), f"not a kvtier spec: {src_spec!r}"
        transfer = self._begin(job_id, "load")
        block_ids = np.asarray(dst_spec.block_ids, dtype=np.int64)
        if len(block_ids) != src_spec.num_blocks:
            self._fail(transfer, f"{len(block_ids)} GPU blocks for {src_spec.num_blocks} keys")
        else:
            offset = 0
            for part in src_spec.parts:
                ids = block_ids[offset: offset + len(part.keys)]
                offset += len(part.keys)
                if part.job < 0:
                    self._fail(transfer, "the scheduler could not open the load in kvtierd")
                    continue
                try:
                    hits = self._client.load(part.job, list(part.keys), ids)
                except KvtierError as exc:
                    self._fail(transfer, f"load job {part.job}: {exc}")
                    continue
                self._track(job_id, transfer, part.job)
                transfer.nbytes += hits * self.layout.block_bytes
                if hits < len(part.keys):
                    self._fail(transfer, f"load job {part.job}: {hits} of {len(part.keys)} blocks were cached")
        self._settle(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        for result in self._client.poll():
            self._part_done(result)
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        parts = [p for j in job_ids if j in self._transfers for p in self._transfers[j].remaining]
        if parts:
            for result in self._client.wait(parts):
                self._part_done(result)

    def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # --- bookkeeping
    def _begin(self, job_id: int, kind: str) -> _Transfer:
        if job_id in self._transfers:
            raise KvtierError(f"vLLM transfer job {job_id} is already in flight on rank {self.rank}")
        transfer = _Transfer(kind, time.perf_counter())
        self._transfers[job_id] = transfer
        return transfer

    def _track(self, job_id: int, transfer: _Transfer, part_job: int) -> None:
        transfer.remaining.add(part_job)
        self._owner[part_job] = job_id

    @staticmethod
    def _fail(transfer: _Transfer, why: str) -> None:
        transfer.ok = False
        transfer.why = transfer.why or why

    def _part_done(self, result) -> None:
        job_id = self._owner.pop(result.job, None)
        if job_id is None:
            return
        transfer = self._transfers[job_id]
        transfer.remaining.discard(result.job)
        if not result.ok:
            self._fail(transfer, f"{result.kind} job {result.job}: {result.error}")
        self._settle(job_id)

    def _settle(self, job_id: int) -> None:
        transfer = self._transfers[job_id]
        if transfer.remaining:
            return
        del self._transfers[job_id]
        success = transfer.ok or transfer.kind == "store"
        if not transfer.ok:
            if transfer.kind == "store":
                logger.warning("kvtier: rank %d: store %d not cached (%s)", self.rank, job_id, transfer.why)
            else:
                logger.error("kvtier: rank %d: load %d failed (%s); its blocks are not valid", self.rank, job_id,
                             transfer.why)
        self._finished.append(TransferResult(job_id=job_id, success=success,
                                             transfer_size=transfer.nbytes if transfer.ok else 0,
                                             transfer_time=time.perf_counter() - transfer.started))

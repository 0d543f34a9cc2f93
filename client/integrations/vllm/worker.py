"""The worker side: vLLM's ``OffloadingWorker`` as a kvtierd rank session (one per TP rank).

Each worker's ``KvtierOffloadingWorker`` is the *rank* session of its TP rank in the vLLM
engine's kvtier engine (world size = vLLM's world size). It registers the rank's KV cache with
kvtier (``block_views``: the byte ranges that make up one vLLM block) and carries out the kvtier
jobs the manager opened (kvtier.integrations.vllm.transfer). A block becomes loadable only when
every rank voted on its store; a load's pins drop when every rank released it. The class
docstring gives the contract per vLLM method.

Its calls to kvtierd run on vLLM's model-runner thread, so they are bounded: each by
``kvtier_timeout_s`` (and the client's re-attach by as long again), and after kvtierd did not
answer the worker asks nothing more until a daemon serves its socket anew (a restart: noticed at
the next transfer) or ``kvtier_retry_s`` passed (``kvtier.reach.Away``); meanwhile stores are not
cached and loads fail and are reported.
"""

from __future__ import annotations

import functools
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

from kvtierd.contract.errors import KvtierError
from kvtierd.contract.namespace import NamespaceId

from ...reach import AWAY_ERRORS, Away
from ...session import Client
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


class LoadFailed(KvtierError):
    """A load did not bring every block, on the plain spec path, which cannot report it to vLLM."""


@dataclass
class _Transfer:
    kind: str                                  # "store" | "load"
    started: float
    remaining: set = field(default_factory=set)  # kvtier jobs not finished yet
    ok: bool = True
    nbytes: int = 0
    why: str = ""
    first_bad: int | None = None               # load: index of the first block not loaded


class KvtierOffloadingWorker(OffloadingWorker):
    """vLLM's OffloadingWorker backed by a kvtierd rank session (one per TP rank).

    - ``submit_store(job, gpu_spec, kvtier_spec)``: this rank's store request of each kvtier job
      (one round trip to kvtierd; the copy runs in the background). Writer ranks copy the blocks
      kvtierd decided to write (not those it has already or has no room for) and vote after the
      copy completed; non-writers' request is their vote. Never waits for a copy.
    - ``submit_load(job, kvtier_spec, gpu_spec)``: this rank's load request (one round trip); the
      copy runs in the background and the job's pins are released after it completed.
      ``expedited`` loads share the queue (kvtier copies complete in submission order).
    - ``get_finished()``: vLLM transfer ids whose kvtier jobs all finished on this rank. A store
      kvtierd could not complete (aborted, copy failed, kvtierd gone) is reported successful —
      the block is simply not cached — and logged. A load that did not bring every block is
      reported *successful* to vLLM, whose 0.33 worker stops the engine on a failed transfer,
      and handed to ``KvtierOffloadingConnector`` through ``take_load_outcomes`` (the index of
      the first block not loaded), which reports it the way vLLM's scheduler recovers from.
      Built by the plain spec path (``reports_failures`` False), which has no such way, it
      raises ``LoadFailed`` instead: the engine stops rather than compute from blocks it does
      not hold, with or without ``python -O``.
    - ``wait(jobs)``: blocks until those transfers' copies completed and were voted/released.
    """

    def __init__(self, settings: KvtierSettings, engine_id: str, rank: int, world_size: int, namespace: NamespaceId,
                 kv_caches: CanonicalKVCaches, connect: Callable[..., Client] = Client,
                 reports_failures: bool = False, clock: Callable[[], float] = time.monotonic):
        self.namespace = namespace
        self.rank = rank
        self.reports_failures = reports_failures
        self._views = block_views(kv_caches, namespace.block_bytes)
        self._connect = functools.partial(connect, settings.socket, engine_id=engine_id, rank=rank,
                                          world_size=world_size, namespace=namespace, copier=settings.copier,
                                          timeout=settings.timeout_s, reconnect_timeout=settings.timeout_s)
        self._away = Away(settings.socket, settings.retry_s, f"rank {rank} of engine {engine_id}",
                          "its stores are not cached and its loads fail (reported to vLLM)", logger, clock)
        self._client: Client | None = None
        self._owner: dict[int, tuple[int, int]] = {}    # kvtier job -> (vLLM transfer job, its first block)
        self._transfers: dict[int, _Transfer] = {}      # vLLM transfer job -> its state
        self._finished: list[TransferResult] = []
        self._load_outcomes: list[tuple[int, int | None]] = []
        self.engine_id = engine_id
        self._connected()             # attach now if kvtierd serves; else at a later transfer

    @property
    def client(self) -> Client | None:
        return self._client

    def _attach(self) -> None:
        client = self._connect()
        try:
            client.register_kv_caches(self._views)
        except BaseException:
            client.close()
            raise
        self._client = client
        logger.info("kvtier: rank %d of engine %s attached (%s, writer=%s, %d KV ranges, %d bytes/block)",
                    self.rank, self.engine_id, client.info.namespace, client.is_writer, len(self._views),
                    self.namespace.block_bytes)

    def _connected(self) -> Client | None:
        """The session, attaching if needed; None while kvtierd is away (``kvtier.reach.Away``)."""
        if not self._away.due():
            return None
        if self._client is None:
            tried = self._away.look()
            try:
                self._attach()
            except AWAY_ERRORS as exc:
                self._away.lost(exc, tried)
                return None
            self._away.back()
        return self._client

    def _reached(self, failure: KvtierError | None) -> bool:
        """After one request of a transfer: True (go on) unless it found kvtierd away."""
        if isinstance(failure, AWAY_ERRORS):
            self._away.lost(failure)
            return False
        if failure is None and self._away.down:
            self._away.back()
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        transfer = self._begin(job_id, "store")
        block_ids = np.asarray(src_spec.block_ids, dtype=np.int64)
        client = self._connected()
        if not isinstance(dst_spec, KvtierLoadStoreSpec) or len(block_ids) != dst_spec.num_blocks:
            self._fail(transfer, f"{len(block_ids)} GPU blocks for {dst_spec!r}")
        elif client is None:
            self._fail(transfer, "kvtierd unreachable")
        else:
            offset = 0
            for part in dst_spec.parts:
                first, offset = offset, offset + len(part.keys)
                try:
                    decision = client.store(part.job, list(part.keys), block_ids[first:offset])
                except KvtierError as exc:
                    self._fail(transfer, f"store job {part.job}: {exc}")
                    if not self._reached(exc):
                        break
                    continue
                self._reached(None)
                self._track(job_id, transfer, part.job, first)
                if client.is_writer:
                    transfer.nbytes += decision.written * self.namespace.block_bytes
        self._settle(job_id)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        transfer = self._begin(job_id, "load")
        block_ids = np.asarray(dst_spec.block_ids, dtype=np.int64)
        client = self._connected()
        if not isinstance(src_spec, KvtierLoadStoreSpec) or len(block_ids) != src_spec.num_blocks:
            self._fail(transfer, f"{len(block_ids)} GPU blocks for {src_spec!r}", 0)
        elif client is None:
            self._fail(transfer, "kvtierd unreachable", 0)
        else:
            offset = 0
            for part in src_spec.parts:
                first, offset = offset, offset + len(part.keys)
                try:
                    hits = client.load(part.job, list(part.keys), block_ids[first:offset], lease=part.lease)
                except KvtierError as exc:
                    self._fail(transfer, f"load job {part.job}: {exc}", first)
                    if not self._reached(exc):
                        break
                    continue
                self._reached(None)
                self._track(job_id, transfer, part.job, first)
                transfer.nbytes += hits * self.namespace.block_bytes
                if hits < len(part.keys):
                    self._fail(transfer, f"load job {part.job}: {hits} of {len(part.keys)} blocks were cached",
                               first + hits)
        self._settle(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        if self._client is not None and self._owner:
            for result in self._client.poll():
                self._part_done(result)
        finished, self._finished = self._finished, []
        return finished

    def take_load_outcomes(self) -> list[tuple[int, int | None]]:
        """(vLLM load job, index of its first block not loaded, or None) of every load finished
        since the last call (``KvtierOffloadingConnector`` reports the failures to vLLM)."""
        outcomes, self._load_outcomes = self._load_outcomes, []
        return outcomes

    def wait(self, job_ids: set[int]) -> None:
        parts = [p for j in job_ids if j in self._transfers for p in self._transfers[j].remaining]
        if parts and self._client is not None:
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

    def _track(self, job_id: int, transfer: _Transfer, part_job: int, first_block: int) -> None:
        transfer.remaining.add(part_job)
        self._owner[part_job] = (job_id, first_block)

    @staticmethod
    def _fail(transfer: _Transfer, why: str, first_bad: int | None = None) -> None:
        transfer.ok = False
        transfer.why = transfer.why or why
        if first_bad is not None:
            transfer.first_bad = first_bad if transfer.first_bad is None else min(transfer.first_bad, first_bad)

    def _part_done(self, result) -> None:
        job_id, first_block = self._owner.pop(result.job, (None, 0))
        if job_id is None:
            return
        transfer = self._transfers[job_id]
        transfer.remaining.discard(result.job)
        if not result.ok:      # aborted, copy failed, kvtierd gone: none of this part's blocks counts
            self._fail(transfer, f"{result.kind} job {result.job}: {result.error}", first_block)
        self._settle(job_id)

    def _settle(self, job_id: int) -> None:
        transfer = self._transfers[job_id]
        if transfer.remaining:
            return
        del self._transfers[job_id]
        if transfer.kind == "load":
            if not transfer.ok and not self.reports_failures:
                raise LoadFailed(f"kvtier: rank {self.rank}: load {job_id} failed ({transfer.why}) and vLLM's "
                                 "OffloadingConnector has no way to recompute it, so the engine stops rather than "
                                 "compute from blocks it does not hold. Load the plugin as kv_connector "
                                 "KvtierOffloadingConnector (kv_connector_module_path kvtier.integrations.vllm), "
                                 "which recomputes or fails only that request (docs/vllm.md)")
            if not transfer.ok:
                logger.warning("kvtier: rank %d: load %d brought blocks [0, %d) only (%s); reported to vLLM",
                               self.rank, job_id, transfer.first_bad, transfer.why)
            self._load_outcomes.append((job_id, None if transfer.ok else transfer.first_bad))
        elif not transfer.ok:
            logger.warning("kvtier: rank %d: store %d not cached (%s)", self.rank, job_id, transfer.why)
        self._finished.append(TransferResult(job_id=job_id, success=True,
                                             transfer_size=transfer.nbytes if transfer.ok else 0,
                                             transfer_time=time.perf_counter() - transfer.started))

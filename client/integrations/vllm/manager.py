"""The scheduler side: vLLM's ``OffloadingManager`` as a kvtierd coordinator session.

The scheduler process's ``KvtierOffloadingManager`` is the *coordinator* session (rank None) of
the vLLM engine's kvtier engine: it looks up keys and opens the kvtier jobs that the workers'
rank sessions then carry out (kvtier.integrations.vllm.transfer says how their ids travel). Its
class docstring gives the contract per vLLM method.

When kvtierd stays unreachable (no answer within ``kvtier_timeout_s``, and no re-attach within as
long again), the manager answers MISS and stores nothing — the engine keeps serving without the
tier — and tries to attach again every ``kvtier_retry_s``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Iterable

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtierd.contract import protocol as P
from kvtierd.contract.errors import KvtierError
from kvtierd.contract.namespace import NamespaceId

from ...api import Client
from .settings import KvtierSettings, kvtier_key
from .transfer import JobPart, KvtierLoadStoreSpec

# A child of vLLM's logger, so that these lines go where vLLM's own go.
logger = logging.getLogger("vllm.kvtier")

# Keys per kvtier job: a vLLM transfer with more keys is split into several kvtier jobs.
PART_KEYS = min(4096, P.MAX_KEYS_PER_REQUEST)


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's OffloadingManager backed by a kvtierd coordinator session (scheduler process).

    Contract, per vLLM method:

    - ``lookup(key)``: HIT when kvtierd has the key ready (and touches it), HIT_PENDING while a
      store of the key that this manager prepared has not completed, else MISS (also when kvtierd
      is unreachable).
    - ``prepare_store(keys)``: opens kvtier store jobs; returns the keys kvtierd decided to write
      with a ``KvtierLoadStoreSpec``; ``None`` when no key fits (kvtierd has no room) or kvtierd is
      unreachable; an empty output when every key is already present. ``evicted_keys`` is always
      empty: kvtierd evicts on its own, across engines, and does not report which keys.
    - ``prepare_load(keys)``: opens kvtier load jobs, which pin the ready prefix until every rank
      released. A key evicted between ``lookup`` and ``prepare_load`` (only possible when another
      engine filled the whole region in that window) makes the workers report the load as failed.
    - ``complete_store``/``complete_load``: local bookkeeping only (the ranks voted / released);
      a failed store's jobs are aborted.
    - ``reset_cache``: forgets this engine's in-flight bookkeeping; it does not clear kvtierd,
      whose cache is shared with other engines and outlives this one (use kvtierctl for that).
    - No KV events are emitted: kvtierd's evictions are not reported back, so a router could not
      be told when a block disappears.

    Single-threaded (the scheduler thread), so ``lock`` is the default no-op context.
    """

    def __init__(self, settings: KvtierSettings, engine_id: str, world_size: int, layout: NamespaceId,
                 connect: Callable[..., Client] = Client, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.engine_id = engine_id
        self.world_size = world_size
        self.layout = layout
        self._connect = connect
        self._clock = clock
        self._client: Client | None = None
        self._down_until = 0.0
        self._next_job = 1
        self._writing: dict[OffloadKey, int] = {}     # key -> kvtier store job, until complete_store
        self._connected()

    # --- connection
    def _connected(self) -> Client | None:
        if self._client is None and self._clock() >= self._down_until:
            try:
                self._client = self._connect(self.settings.socket, engine_id=self.engine_id, rank=None,
                                             world_size=self.world_size, namespace=self.layout,
                                             timeout=self.settings.timeout_s,
                                             reconnect_timeout=self.settings.timeout_s)
                logger.info("kvtier: coordinator of engine %s attached to kvtierd at %s, namespace %s",
                            self.engine_id, self.settings.socket, self._client.info.namespace)
            except KvtierError as exc:
                self._down(exc, "cannot attach")
        return self._client

    def _down(self, exc: BaseException, what: str) -> None:
        logger.warning("kvtier: %s (%s); serving without kvtierd for %gs", what, exc, self.settings.retry_s)
        client, self._client = self._client, None
        self._down_until = self._clock() + self.settings.retry_s
        if client is not None:
            client.close()

    def _new_job(self) -> int:
        job = self._next_job
        self._next_job += 1
        return job

    # --- OffloadingManager
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._writing:
            return LookupResult.HIT_PENDING
        client = self._connected()
        if client is None:
            return LookupResult.MISS
        try:
            return LookupResult.HIT if client.lookup([kvtier_key(key)]) else LookupResult.MISS
        except KvtierError as exc:
            self._down(exc, "lookup failed")
            return LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        client = self._connected()
        if client is None or not keys:
            return
        try:
            for start in range(0, len(keys), PART_KEYS):
                client.lookup([kvtier_key(k) for k in list(keys)[start:start + PART_KEYS]])
        except KvtierError as exc:
            self._down(exc, "touch failed")

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(dict.fromkeys(keys))            # kvtierd refuses duplicate keys in one job
        client = self._connected()
        if client is None:
            return None
        tkeys = [kvtier_key(k) for k in keys]
        parts: list[JobPart] = []
        chosen: list[int] = []
        no_space = False
        try:
            for start in range(0, len(tkeys), PART_KEYS):
                chunk = tuple(tkeys[start:start + PART_KEYS])
                job = self._new_job()
                outcomes = np.asarray(client.open_store(job, chunk).outcomes, dtype=np.int64)
                write = np.flatnonzero(outcomes == P.StoreOutcome.WRITE)
                no_space |= bool((outcomes == P.StoreOutcome.NO_SPACE).any())
                if len(write) == 0:
                    client.abort(job)               # nothing to write: no rank needs to see this job
                    continue
                parts.append(JobPart(job, chunk, write.astype(np.int64)))
                chosen.extend((start + write).tolist())
        except KvtierError as exc:
            for part in parts:                      # best effort; kvtierd times them out otherwise
                self._abort_quietly(part.job)
            self._down(exc, "store failed")
            return None
        if not parts:
            return None if no_space else PrepareStoreOutput([], KvtierLoadStoreSpec(), [])
        keys_to_store = [keys[i] for i in chosen]
        by_key = {t: k for k, t in zip(keys, tkeys)}
        for part in parts:
            for i in part.select.tolist():
                self._writing[by_key[part.keys[i]]] = part.job
        return PrepareStoreOutput(keys_to_store=keys_to_store, store_spec=KvtierLoadStoreSpec(parts),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        jobs = {self._writing.pop(k) for k in keys if k in self._writing}
        if not success:
            for job in jobs:
                self._abort_quietly(job)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        tkeys = [kvtier_key(k) for k in keys]
        parts: list[JobPart] = []
        client = self._connected()
        for start in range(0, len(tkeys), PART_KEYS):
            chunk = tuple(tkeys[start:start + PART_KEYS])
            select = np.arange(len(chunk), dtype=np.int64)
            job, hits = -1, 0
            if client is not None:
                job = self._new_job()
                try:
                    hits = client.open_load(job, chunk)
                except KvtierError as exc:
                    self._down(exc, "load failed")
                    client, job = None, -1
            if hits < len(chunk):
                logger.error("kvtier: load job %d pinned %d of %d blocks (evicted by another engine since "
                             "lookup, or kvtierd unreachable); the workers will report this load as failed",
                             job, hits, len(chunk))
            parts.append(JobPart(job, chunk, select, hits))
        return KvtierLoadStoreSpec(parts)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return None                                  # the ranks released their load jobs

    def _abort_quietly(self, job: int) -> None:
        if self._client is not None:
            try:
                self._client.abort(job)
            except KvtierError:
                pass

    def reset_cache(self) -> None:
        logger.info("kvtier: reset_cache forgets %d in-flight stores of engine %s; kvtierd's cache is shared "
                    "and stays (kvtierctl clears it)", len(self._writing), self.engine_id)
        self._writing.clear()

    def take_events(self) -> Iterable:
        return ()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return None

    def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

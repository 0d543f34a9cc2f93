"""kvtierd as vLLM's KV-cache offloading tier: an out-of-tree spec for vLLM's OffloadingConnector.

Turn it on with one ``--kv-transfer-config`` (docs/vllm.md has the whole line and every setting)::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm",
                                   "kvtier_socket": "/dev/shm/kvtierd/kvtierd.sock"}}

Importing this module imports vLLM and checks its version (``SUPPORTED_VLLM_SERIES``); importing
``kvtier`` alone never imports vLLM.

How vLLM's contract (vllm/v1/kv_offload/base.py, 0.33) maps onto kvtierd's:

- **One kvtier engine per vLLM engine.** The scheduler process's ``KvtierOffloadingManager`` is a
  *coordinator* session (rank None); each worker's ``KvtierOffloadingWorker`` is the *rank*
  session of its TP rank. All of them attach as engine ``vllm-<engine_id>`` (one per DP rank)
  with world size = vLLM's world size.
- **Keys.** vLLM's ``OffloadKey`` (block hash ‖ 4-byte group index, 36 bytes with sha256) is the
  kvtier key as is; a key longer than kvtierd's limit is shortened to sha256(hash) ‖ group index.
- **Job ids.** vLLM numbers a transfer only *after* ``prepare_store``/``prepare_load`` returned,
  so the manager cannot open a kvtier job under vLLM's id. It opens kvtier jobs under its own
  counter and hands their ids to the workers inside the ``KvtierLoadStoreSpec``; each worker
  maps vLLM's transfer job id to those kvtier jobs and reports vLLM's id back.
- **Stores.** ``prepare_store`` opens the store job (kvtierd decides per key: write, present, no
  space) and returns the keys to write; ``None`` when nothing fits. Each worker's
  ``submit_store`` is its rank's store request: writer ranks copy and vote after the copy
  completed, non-writer ranks vote at once. A block becomes loadable only when every rank voted.
- **Loads.** ``lookup`` asks kvtierd (HIT when ready; HIT_PENDING while this engine's own store of
  the key is in flight); ``prepare_load`` opens the load job, which pins the ready prefix; every
  rank copies and releases; the pins drop when every rank released.
- **Replicated (MLA) layout.** The kvtier namespace is *replicated* exactly when vLLM's own gate
  says so (``OffloadingConfig.replicated_layout``: pure MLA, TP > 1, no PP/PCP/DCP, single-node
  ``mp`` executor), else *sharded*. Then kvtierd keeps one copy and only rank 0 copies it.
  ``KvtierOffloadingSpec.replicated_layout`` stays False on purpose: when True, vLLM's worker
  acknowledges non-writer ranks' stores without calling ``submit_store``, but kvtierd needs those
  ranks' votes (a block is ready only when every rank of the job voted), so every rank must see
  every store. The deduplication happens in kvtierd instead.
- **Namespaces.** (model, KV dtype, tokens per block, bytes per block per rank, layout kind), with
  vLLM's KV-cache memory layout appended to the model name; ``kvtier_namespace`` overrides the
  model part (e.g. one name for one model served from different paths).

Supported: one KV-cache group, or several groups that use the same per-block byte ranges (vLLM's
hybrid allocator), ``blocks_per_chunk`` = 1, TP (and DCP/PCP, sharded) within one node. Not
supported: PP > 1, ``canonical_layout``, per-group layouts with different block sizes — the spec
raises at start-up naming the setting.

When kvtierd restarts, every session re-attaches on its own (``kvtier.Client``); transfers in
flight across the restart fail (a store is then simply not cached; a load is reported failed).
When kvtierd stays unreachable (no answer within ``kvtier_timeout_s``, and no re-attach within as
long again), the manager answers MISS and stores nothing — the engine keeps serving without the
tier — and tries to attach again every ``kvtier_retry_s``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

import vllm

SUPPORTED_VLLM_SERIES = ("0.33",)      # vLLM's offloading plugin API is experimental: pinned per minor
TESTED_VLLM_VERSIONS = ("0.33.0",)
ALLOW_UNSUPPORTED_ENV = "KVTIER_VLLM_ALLOW_UNSUPPORTED"


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not a version this plugin supports."""


def check_vllm_version(version: str | None = None) -> str:
    """Raise ``UnsupportedVllmVersion`` unless ``version`` (default: the installed vLLM's) is in a
    supported series; returns the version. ``KVTIER_VLLM_ALLOW_UNSUPPORTED=1`` turns the error into
    a warning (at your own risk: the plugin API changes between vLLM minor releases)."""
    from packaging.version import InvalidVersion, Version

    version = vllm.__version__ if version is None else version
    try:
        parsed = Version(version)
        series = f"{parsed.major}.{parsed.minor}"
    except InvalidVersion:
        series = None
    if series in SUPPORTED_VLLM_SERIES:
        return version
    message = (f"kvtier's vLLM plugin supports vLLM {', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)} "
               f"(tested with {', '.join(TESTED_VLLM_VERSIONS)}); this process has vLLM {version}. Install a "
               f"supported vLLM (pip install 'vllm=={TESTED_VLLM_VERSIONS[-1]}') or a kvtierd release that "
               f"supports vLLM {version}; {ALLOW_UNSUPPORTED_ENV}=1 tries anyway.")
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        logging.getLogger("vllm.kvtier").warning("%s (%s=1: continuing)", message, ALLOW_UNSUPPORTED_ENV)
        return version
    raise UnsupportedVllmVersion(message)


check_vllm_version()

# Only now the version-specific vLLM modules (a wrong version fails above with a clear message).
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402

from kvtierd import protocol as P  # noqa: E402

from ..api import Client, Layout, default_socket  # noqa: E402
from ..errors import KvtierError  # noqa: E402
from ..select import COPIERS  # noqa: E402

# A child of vLLM's logger, so that these lines go where vLLM's own go.
logger = logging.getLogger("vllm.kvtier")

# Keys per kvtier job: a vLLM transfer with more keys is split into several kvtier jobs.
PART_KEYS = min(4096, P.MAX_KEYS_PER_REQUEST)


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class KvtierSettings:
    """The ``kvtier_*`` settings of ``kv_connector_extra_config`` (docs/vllm.md describes each)."""

    socket: str                      # kvtierd's IPC socket
    namespace: str | None = None     # overrides the model part of the namespace
    layout: str = "auto"             # auto: vLLM's replicated gate decides; sharded: never replicated
    timeout_s: float = 5.0           # bound on one request to kvtierd
    retry_s: float = 10.0            # after kvtierd was unreachable, wait this long before reconnecting
    copier: str = "auto"             # how the workers copy (kvtier.select.COPIERS: auto, cpu, cuda, torch)
    engine_id: str | None = None     # kvtier engine id; default vllm-<vLLM engine_id>

    KEYS = {"kvtier_socket": "socket", "kvtier_namespace": "namespace", "kvtier_layout": "layout",
            "kvtier_timeout_s": "timeout_s", "kvtier_retry_s": "retry_s", "kvtier_copier": "copier",
            "kvtier_engine_id": "engine_id"}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "KvtierSettings":
        """Read and check the settings; a ``kvtier_*`` key that is not a setting is an error."""
        unknown = sorted(k for k in extra if k.startswith("kvtier_") and k not in cls.KEYS)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config settings {unknown}; "
                             f"kvtier's settings are {sorted(cls.KEYS)}")
        values: dict[str, Any] = {attr: extra[key] for key, attr in cls.KEYS.items() if extra.get(key) is not None}
        values.setdefault("socket", default_socket())
        for name in ("timeout_s", "retry_s"):
            if name in values:
                try:
                    values[name] = float(values[name])
                except (TypeError, ValueError):
                    raise ValueError(f"kvtier_{name} must be a number of seconds, got {values[name]!r}") from None
                if not values[name] > 0:
                    raise ValueError(f"kvtier_{name} must be > 0, got {values[name]}")
        for name in ("socket", "namespace", "layout", "copier", "engine_id"):
            if name in values and not isinstance(values[name], str):
                raise ValueError(f"kvtier_{name} must be a string, got {values[name]!r}")
        if values.get("layout", "auto") not in ("auto", "sharded"):
            raise ValueError(f"kvtier_layout must be 'auto' or 'sharded', got {values['layout']!r}")
        if values.get("copier", "auto") not in COPIERS:
            raise ValueError(f"kvtier_copier must be one of {', '.join(COPIERS)}, got {values['copier']!r}")
        return cls(**values)


def kvtier_key(key: bytes) -> bytes:
    """The kvtier key of a vLLM OffloadKey: the key itself when it fits kvtierd's limit, else
    sha256(block hash) ‖ group index (4 bytes), which keeps keys of different groups apart."""
    key = bytes(key)
    if len(key) <= P.MAX_KEY_BYTES:
        return key
    return hashlib.sha256(key[:-4]).digest() + key[-4:]


def _short(text: str, limit: int = P.MAX_STR_BYTES) -> str:
    """``text`` if it fits a protocol string, else a prefix plus a hash of the whole (stays unique)."""
    if len(text.encode()) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return text.encode()[: limit - 17].decode(errors="ignore") + "~" + digest


def namespace_layout(config: OffloadingConfig, settings: KvtierSettings) -> Layout:
    """The kvtier namespace of an engine, from vLLM's offloading config.

    Replicated exactly when vLLM's gate (``config.replicated_layout``) allows it and the settings
    do not force sharded. Raises ValueError for configurations the plugin does not support.
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
    kind = "replicated" if config.replicated_layout and settings.layout == "auto" else "sharded"
    model = settings.namespace or config.model.name
    if config.kv_cache_layout:
        model = f"{model}|{config.kv_cache_layout}"
    return Layout(model=_short(model), dtype=_short(config.model.dtype, 32), block_tokens=tokens.pop(),
                  block_bytes=config.worker_kv_bytes_per_block, kind=kind)


# ------------------------------------------------------------------------------ the spec passed to workers
@dataclass
class JobPart:
    """One kvtier job of a transfer.

    ``keys`` is the job's key list exactly as the manager opened it (every rank must name the same
    keys). ``select`` indexes the keys this transfer moves, in the order of the GPU spec's block
    ids: for a store the keys kvtierd decided to WRITE, for a load all of them. ``hits`` is the
    ready prefix the manager pinned for a load (-1 for a store); ``job`` is -1 when the manager
    could not open the job at all.
    """

    job: int
    keys: tuple[bytes, ...]
    select: np.ndarray
    hits: int = -1


class KvtierLoadStoreSpec(LoadStoreSpec):
    """Where a transfer's blocks live in kvtierd: the kvtier jobs that the manager opened.

    Travels from the scheduler to every worker inside vLLM's connector metadata (pickled).
    """

    def __init__(self, parts: Sequence[JobPart] = ()):
        self.parts: tuple[JobPart, ...] = tuple(parts)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.select) for p in self.parts)

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec(jobs={[p.job for p in self.parts]}, blocks={self.num_blocks})"


# ------------------------------------------------------------------------------ scheduler side
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

    def __init__(self, settings: KvtierSettings, engine_id: str, world_size: int, layout: Layout,
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
                                             world_size=self.world_size, layout=self.layout,
                                             timeout=self.settings.timeout_s,
                                             reconnect_timeout=self.settings.timeout_s)
                logger.info("kvtier: coordinator of engine %s attached to kvtierd at %s, namespace %s",
                            self.engine_id, self.settings.socket, self._client.info.get("namespace"))
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


# ------------------------------------------------------------------------------ worker side
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

    def __init__(self, settings: KvtierSettings, engine_id: str, rank: int, world_size: int, layout: Layout,
                 kv_caches: CanonicalKVCaches, connect: Callable[..., Client] = Client):
        self.layout = layout
        self.rank = rank
        self._views = block_views(kv_caches, layout.block_bytes)
        self._client = connect(settings.socket, engine_id=engine_id, rank=rank, world_size=world_size,
                               layout=layout, copier=settings.copier, timeout=settings.timeout_s,
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
                    rank, engine_id, self._client.info.get("namespace"), self._client.is_writer,
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


# ------------------------------------------------------------------------------ the spec
class KvtierOffloadingSpec(OffloadingSpec):
    """The entry point vLLM's ``OffloadingSpecFactory`` loads (``spec_name`` "KvtierOffloadingSpec",
    ``spec_module_path`` "kvtier.integrations.vllm"). Built once in the scheduler process and once
    in every worker; connects lazily (``get_manager`` / ``get_worker``)."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.settings = KvtierSettings.from_extra_config(self.extra_config)
        self.layout = namespace_layout(config, self.settings)
        self.engine_id = self.settings.engine_id or _short(f"vllm-{config.engine_id}")
        # Deliberately False even for the replicated namespace: see the module docstring.
        self.replicated_layout = False
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self.settings, self.engine_id, self.config.parallel.world_size,
                                                    self.layout)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(self.settings, self.engine_id, self.config.parallel.rank,
                                                  self.config.parallel.world_size, self.layout, kv_caches)
        return self._worker


__all__ = ["KvtierOffloadingSpec", "KvtierOffloadingManager", "KvtierOffloadingWorker", "KvtierLoadStoreSpec",
           "KvtierSettings", "JobPart", "kvtier_key", "namespace_layout", "block_views", "check_vllm_version",
           "SUPPORTED_VLLM_SERIES", "TESTED_VLLM_VERSIONS", "UnsupportedVllmVersion"]

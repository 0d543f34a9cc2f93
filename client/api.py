"""The public client API, in the engine's terms.

A ``Client`` is one session with kvtierd: a *rank* session (one per TP rank: registers its KV
cache, copies, votes) or a *coordinator* session (rank=None: the engine's scheduler process, which
looks up and opens jobs that its ranks then carry out). Engines whose ranks each issue the same
jobs need no coordinator: the first request of a job fixes its decision for everybody.

Rank usage::

    client = Client(socket, engine_id="e1", rank=r, world_size=n, namespace=namespace_id)
    client.register_kv_caches(per_layer_tensors)
    hits = client.lookup(keys)                      # leading keys that are cached
    client.lookup_detail(keys).pending              # keys after them being promoted from a second tier
    client.store(job, keys, block_ids)              # returns the per-key decision at once
    client.load(job2, keys[:hits], block_ids2)      # returns how many blocks will arrive
    for result in client.wait([job, job2]): ...     # or poll() from the engine's loop

Leases (invariant 10): ``lookup(keys, lease=L)`` also holds the hits for the engine until a load
names the lease (``load(..., lease=L)``, or the coordinator's ``open_load``), ``unlease([L])``,
or the lease's ttl passes; ``lease_held(L)`` says how many it holds. A load of leased keys cannot
come back short. Any session of the engine may consume the lease: a coordinator leases, its
ranks' load job consumes.

A store job finishes on this rank once its copy (if it is a writer) completed and its vote was
accepted; a load job once its copy completed and its release was accepted. ``JobResult.ok`` is
False when the daemon aborted the job (then loaded blocks must be treated as a miss).

Daemon restarts: when the daemon stops answering or no longer knows the session (it restarted,
or dropped a session that stopped heartbeating), the client re-attaches on its own (same engine,
rank and namespace; for up to ``reconnect_timeout`` seconds), remapping the region when its path
or generation changed. Before it re-attaches it waits for every copy in flight, and its hello
names the old session and token: that tells the daemon the pages it was handed are free again
(the page fence, invariant 9). Then it re-issues its live leases (leases are session state, lost
with the daemon) and redoes its loads in flight (a load's first copy may have read pages the new
daemon gave to someone else; READY blocks survive a restart, so the load job is opened again and
the same blocks copied again: the engine sees latency only; if fewer blocks are cached now, the
job finishes ``ok=False``). Stores in flight across the restart finish with ``ok=False`` and a
``DaemonUnavailable`` error (not cached); the call that discovered the restart is retried once on
the new daemon, except commit/release, whose jobs died with the old one — so a client never
commits into pages that were given to someone else meanwhile (a load whose release found the
restart is redone as above). ``poll`` and ``wait`` report every job exactly once, whatever
restart they find on the way. A session the
daemon cannot watch through a pidfd (another PID namespace) gets a heartbeat thread with its own
socket.

First touch: a process's mapping of the region has no page-table entries until it touches each
page, and a store into untouched 4 KiB pages ran at 0.35x the speed of the same store into pages
the process had touched (32 MiB jobs, ``kvtierctl bench --only attach``). So a rank session
populates its mapping at attach (and again after a remap) on ``populate_threads`` background
threads (``Client.populating``; 0: none), logging its progress; ``close()`` cancels it.
Registering a CUDA KV cache waits for it before pinning the mapping with cudaHostRegister, which
then finds every page present.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from kvtierd.contract import protocol as P
from kvtierd.contract.channel import Channel
from kvtierd.contract.errors import DaemonUnavailable, KvtierError, NotAttached, ShuttingDown
from kvtierd.contract.mapping import Mapping, Populate
from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.paths import default_socket
from kvtierd.contract.protocol import (HelloReply, JobsReply, LoadReply, LookupReply, StatsReply, StoreOutcome,
                                      StoreReply, UnleaseReply)
from kvtierd.contract.region_format import HEADER_BYTES, DataHeader, FormatError, shard_checksum

from .copy import Copier, CopyHandle
from .kvcache import KVCacheLayout
from .select import select_copier

log = logging.getLogger(__name__)


@dataclass
class StoreDecision:
    outcomes: list[StoreOutcome]

    @property
    def written(self) -> int:
        return sum(1 for o in self.outcomes if o is StoreOutcome.WRITE)


@dataclass
class JobResult:
    job: int
    kind: str                 # "store" | "load"
    ok: bool
    hits: int = 0             # load: blocks copied into the KV cache
    error: KvtierError | None = None


@dataclass(frozen=True)
class Lease:
    """A lease this client holds (``Client.leases``): what its leasing lookup reported."""

    id: int
    keys: tuple               # the keys that lookup asked (a re-issue asks them again)
    hits: int
    leased: int               # the leading hits kvtierd holds (fewer than hits: its caps)
    ttl: float                # seconds kvtierd granted
    expires: float            # time.monotonic() by which it has lapsed (counted from the request)


@dataclass
class _Pending:
    kind: str
    handle: CopyHandle
    hits: int = 0
    vote: bool = True         # store: this rank must commit after the copy
    pages: np.ndarray | None = None   # store: [written keys, pages per shard] this rank copied into
    keys: list | None = None          # load: its keys and GPU blocks, to redo it after a restart
    block_ids: np.ndarray | None = None
    result: JobResult | None = field(default=None)


class _Heartbeat(threading.Thread):
    """Proves a session alive from its own socket while the engine's thread is busy elsewhere."""

    def __init__(self, socket_path: str, session: int, token: int, interval: float):
        super().__init__(name="kvtier-heartbeat", daemon=True)
        self._args = (socket_path, session, token, interval)
        self._stop_event = threading.Event()

    def run(self) -> None:
        socket_path, session, token, interval = self._args
        channel = None
        try:
            while not self._stop_event.wait(interval):
                try:
                    channel = channel or Channel(socket_path, timeout=interval)
                    channel.call("ping", session=session, token=token)
                except KvtierError:
                    pass   # the engine's next call finds out and re-attaches
        finally:
            if channel is not None:
                channel.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


class _PopulateLog:
    """Progress of a mapping's background populate in the log: start, every 5 s, end."""

    EVERY = 5.0

    def __init__(self, nbytes: int, threads: int):
        self.started = self.said = time.monotonic()
        log.info("kvtier: populating this process's mapping of the region (%.2f GiB) on %d threads",
                 nbytes / (1 << 30), threads)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total:
            seconds = now - self.started
            log.info("kvtier: region mapping populated: %.2f GiB in %.2f s (%.3f s per GiB)", total / (1 << 30),
                     seconds, seconds * (1 << 30) / max(total, 1))
        elif now - self.said >= self.EVERY:
            self.said = now
            log.info("kvtier: populating region mapping: %d%%", 100 * done // total)


SECRET_ENV = "KVTIER_ENGINE_SECRET"      # the engine secret when Client(engine_secret=) is not given

# Ops that may be sent again after re-attaching: they do not refer to a job of the old daemon.
_RETRYABLE = frozenset({"lookup", "stats", "jobs", "store", "load", "abort", "unlease"})


class Client:
    def __init__(self, socket_path: str | None = None, *, engine_id: str, rank: int | None, world_size: int,
                 namespace: NamespaceId, copier: str = "auto", pin: str = "auto", timeout: float = 10.0,
                 reconnect_timeout: float = 30.0, populate_threads: int = 2,
                 engine_secret: bytes | str | None = None):
        self.socket_path = socket_path or default_socket()
        # The engine's sessions are bound together: the daemon lets a session join engine_id only
        # from the uid of its first session and, when that one presented a secret, with the same
        # secret. Every process of an engine passes the same one (or sets KVTIER_ENGINE_SECRET).
        secret = engine_secret if engine_secret is not None else os.environ.get(SECRET_ENV) or None
        self.engine_secret = secret.encode() if isinstance(secret, str) else secret
        if self.engine_secret is not None and not P.MIN_SECRET_BYTES <= len(self.engine_secret) <= P.MAX_SECRET_BYTES:
            raise ValueError(f"an engine secret is {P.MIN_SECRET_BYTES}..{P.MAX_SECRET_BYTES} bytes "
                             f"(engine_secret / {SECRET_ENV}); got {len(self.engine_secret)}")
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.engine_id = engine_id
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.channel: Channel | None = None
        self.mapping: Mapping | None = None
        self.populating: Populate | None = None   # the mapping's background populate (rank sessions; 0 threads: none)
        self._populate_threads = populate_threads
        self.pinned = "off"
        self.kv: KVCacheLayout | None = None
        self.copier: Copier | None = None
        self._stream = None                       # the compute stream copies wait for (None: current)
        self.info: HelloReply | None = None     # the last hello's reply
        self._heartbeat: _Heartbeat | None = None
        self._copier_name = copier
        self._pin = pin
        self._pending: dict[int, _Pending] = {}
        # Results settled outside the call that returns them: jobs in flight across a restart, and
        # jobs a wait() finished before it timed out on another. poll()/wait() hand them out once.
        self._settled: list[JobResult] = []
        self._leases: dict[int, Lease] = {}
        self._prune_at = 1024                     # lease records kept before lapsed ones are dropped
        self.attachments = 0                      # successful hellos so far (a restart makes it move)
        self._attach()

    # ------------------------------------------------------------------ setup
    def _attach(self) -> None:
        """hello on a fresh channel; map (or remap) the region when it is new to this client."""
        try:
            pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            pidns = None
        fields = dict(version=P.PROTOCOL_VERSION, engine=self.engine_id, rank=self.rank, world_size=self.world_size,
                      namespace=self.namespace.to_wire(), pid=os.getpid())
        if pidns is not None:        # unknown: the daemon cannot watch us and expects heartbeats
            fields["pidns"] = pidns
        if self.engine_secret is not None:
            fields["secret"] = self.engine_secret
        previous = self.info
        if previous is not None:   # re-attaching: the daemon may still hold our old session (a lost reply)
            fields.update(replaces=previous.session, replaces_token=previous.token)
        channel = Channel(self.socket_path, self.timeout)
        try:
            info = HelloReply.from_wire(channel.call("hello", **fields))
        except BaseException:
            channel.close()
            raise
        self.channel, self.info = channel, info
        self.attachments += 1
        self.session = info.session
        self.page_size = info.page_size
        self.pages_per_shard = info.pages_per_shard
        self.is_writer = self.rank is not None and self.rank in info.writers
        if self.rank is not None and (self.mapping is None or previous is None
                                      or (previous.region, previous.generation) != (info.region, info.generation)):
            if self.copier is not None:      # it holds the old mapping's addresses (and its pinning)
                self.copier.close()
                self.copier = None
            if self.mapping is not None:
                self.mapping.close()
                self.mapping = None
            self._map_region()
            if self.kv is not None:
                self._start_copier()
        if info.heartbeat_interval:
            self._heartbeat = _Heartbeat(self.socket_path, info.session, info.token, info.heartbeat_interval)
            self._heartbeat.start()

    def _reattach(self, cause: KvtierError, patience: float | None = None) -> None:
        """The daemon restarted or dropped us: wait for the copies in flight, attach again (for
        ``patience`` seconds, default reconnect_timeout; 0: one attempt), re-issue the live
        leases, redo the loads in flight; stores in flight are settled as lost."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        redo = []
        for job, p in list(self._pending.items()):
            try:
                # The copy must be over before the region may be remapped, and before the hello
                # tells the daemon that this session's pages are free.
                p.handle.wait()
            except Exception:
                pass
            if p.kind == "load" and p.handle.error() is None:
                redo.append((job, p))
            else:
                self._settled.append(self._lost(job, p.kind, cause))
        self._pending.clear()
        self.channel.close()
        patience = self.reconnect_timeout if patience is None else patience
        deadline = time.monotonic() + patience
        delay = 0.05
        while True:
            try:
                self._attach()
                break
            except (DaemonUnavailable, NotAttached, ShuttingDown) as exc:   # a stopping daemon: the next one
                if time.monotonic() + delay > deadline:
                    self._settled.extend(self._lost(job, "load", cause) for job, _ in redo)
                    raise DaemonUnavailable(f"kvtierd did not come back within {patience:g}s: {exc}") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        self._reissue_leases()
        for job, p in redo:
            if not self._redo_load(job, p):
                self._settled.append(self._lost(job, "load", cause))

    @staticmethod
    def _lost(job: int, kind: str, cause: KvtierError) -> JobResult:
        return JobResult(job, kind, False, 0, DaemonUnavailable(
            f"kvtierd restarted or dropped the session while job {job} was in flight ({cause})"))

    def _reissue_leases(self) -> None:
        """After re-attaching: lease again, for what is left of their ttl, the leases the old
        session held (kvtierd lost them with it). A lease that now holds fewer keys says so."""
        now = time.monotonic()
        leases, self._leases = self._leases, {}
        for lease in leases.values():
            left = lease.expires - now
            if left <= 0:
                continue
            try:
                self._lookup_leased(lease.keys, lease.id, left, self.channel.call)
            except KvtierError as exc:      # kvtierd went again: the next call finds out
                log.info("kvtier: re-issuing lease %d after re-attaching failed: %s", lease.id, exc)
                return

    def _redo_load(self, job: int, p: _Pending) -> bool:
        """Open load ``job`` again on the daemon we re-attached to and copy its blocks again
        (the first copy may have read pages the new daemon gave to another entry). False when
        kvtierd refuses it or holds fewer of its blocks now."""
        try:
            reply = LoadReply.from_wire(self.channel.call("load", job=job, keys=p.keys))
        except KvtierError as exc:
            log.info("kvtier: load job %d could not be redone after re-attaching: %s", job, exc)
            return False
        try:
            if reply.hits < p.hits:
                raise KvtierError(f"{reply.hits} of its {p.hits} blocks are cached now")
            pages = np.frombuffer(reply.pages, dtype=P.PAGES_DTYPE).reshape(reply.hits, self.pages_per_shard)
            desc = self.kv.descriptors(p.block_ids[:p.hits], pages[:p.hits], self.region_data, to_region=False)
            handle = self.copier.submit(desc)
        except Exception as exc:
            log.info("kvtier: load job %d not redone after re-attaching: %s", job, exc)
            try:
                self.channel.call("release", job=job)
            except KvtierError:
                pass
            return False
        self._pending[job] = dataclasses.replace(p, handle=handle)
        log.info("kvtier: load job %d redone after re-attaching (%d blocks)", job, p.hits)
        return True

    def reconnect(self) -> None:
        """Attach again now, one attempt, after kvtierd restarted or dropped this session (as
        any call does on its own, with retries for ``reconnect_timeout``): for a caller that
        watches the connection and paces its attempts itself. Re-issues the live leases.
        Raises DaemonUnavailable when kvtierd does not answer."""
        self._reattach(DaemonUnavailable("reconnect"), patience=0.0)

    def _call(self, op: str, **fields) -> dict:
        """One request; after a restart (no answer, or session unknown), re-attach and retry once."""
        try:
            return self.channel.call(op, **fields)
        except (DaemonUnavailable, NotAttached) as exc:
            if self.channel is None:
                raise
            self._reattach(exc)
            if op not in _RETRYABLE:
                raise DaemonUnavailable(f"kvtierd restarted: the {op} of job {fields.get('job')} is lost") from exc
            return self.channel.call(op, **fields)

    def _map_region(self) -> None:
        info = self.info
        mapping = Mapping.of_file(info.region)
        try:
            try:
                found = DataHeader.read(np.frombuffer(mapping.buffer, dtype=np.uint8)[:HEADER_BYTES]) \
                    if mapping.size >= HEADER_BYTES else None
            except FormatError:
                found = None
            announced = DataHeader(info.generation, info.page_size, info.num_pages, info.data_offset, info.file_bytes)
            if found != announced or mapping.size < info.file_bytes:
                raise KvtierError(f"region file {info.region} is not the one kvtierd announced (generation "
                                  f"{info.generation:x}, {info.file_bytes} bytes); it was replaced or truncated")
        except BaseException:
            mapping.close()
            raise
        self.mapping = mapping
        self.pinned = "off"       # pinning is per mapping: _start_copier pins it for a CUDA KV cache
        self.region_data = mapping.address + info.data_offset
        self.region_bytes = np.frombuffer(mapping.buffer, dtype=np.uint8)[info.data_offset:]
        # mapping.close() (close, remap) cancels and joins it before unmapping.
        self.populating = (mapping.populate_in_background(
            self._populate_threads, _PopulateLog(mapping.size, self._populate_threads))
            if self._populate_threads > 0 else None)

    def register_kv_caches(self, tensors: Sequence, stream=None) -> None:
        """Describe this rank's KV cache: per-layer tensors [num_blocks, ...] (see kvcache.py).

        ``stream``: the stream the engine runs its model on (torch.cuda.Stream, cupy Stream or a raw
        cudaStream_t); device copies start after the work queued on it when store()/load() is
        called. None means torch.cuda.current_stream() at each call.
        """
        self._need_rank("register KV caches")
        kv = KVCacheLayout(tensors, self.page_size)
        if kv.block_bytes != self.namespace.block_bytes:
            raise ValueError(f"the KV-cache tensors hold {kv.block_bytes} bytes per block; the namespace this "
                             f"client attached with says {self.namespace.block_bytes}")
        self.kv, self._stream = kv, stream
        self._start_copier()

    def _start_copier(self) -> None:
        """(Re)build the copier over the current mapping; for a CUDA KV cache, pin the mapping first."""
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        kv = self.kv
        if kv.device.type == "cuda":
            self._pin_for(kv.device)
        self.copier = select_copier(self._copier_name, kv.device, kv_tensors=kv.tensors,
                                    host_spans=[(self.mapping.address, self.mapping.size)], stream=self._stream)

    def _pin_for(self, device) -> None:
        """Register this process's mapping of the region with CUDA (once per mapping), on ``device``.

        Pinning is per process: the daemon's does not cover this mapping. It happens under the KV
        cache's device so that registering creates no context on device 0. pin='auto' continues
        unpinned after one warning line when registration fails (auto then picks the torch copier,
        which copies unpinned memory); pin='cuda' raises; pin='off' skips it.
        """
        if self.pinned == "cuda" or self._pin not in ("auto", "cuda"):
            return
        # cudaHostRegister faults in what is not populated yet, one page at a time under the driver's
        # lock; the populate threads do it in parallel, so let them finish first.
        if self.populating is not None:
            try:
                self.populating.wait()
            except OSError as exc:
                log.warning("kvtier: populating the region mapping failed (%s); pinning faults it in instead", exc)
        import torch
        with torch.cuda.device(device):
            try:
                if self.mapping.pin_cuda(required=self._pin == "cuda"):
                    self.pinned = "cuda"
            except RuntimeError as exc:
                raise KvtierError(str(exc)) from None

    def _need_rank(self, what: str) -> None:
        if self.rank is None:
            raise KvtierError(f"a coordinator session cannot {what}; rank sessions do")

    def _need_kv(self) -> KVCacheLayout:
        self._need_rank("copy blocks")
        if self.kv is None:
            raise KvtierError("call register_kv_caches() before store() or load()")
        return self.kv

    # ------------------------------------------------------------------ queries
    def lookup(self, keys: Sequence[bytes], lease: int | None = None, ttl: float | None = None) -> int:
        """How many leading keys are cached and ready (they count as recently used).

        ``lease``: an id of your choice, unique among the engine's live leases. kvtierd then also
        holds those hits for the engine: no eviction takes them until a load names the lease
        (``load``/``open_load`` of any session of the engine), ``unlease``, or ``ttl`` seconds
        pass (kvtierd clamps it to [10 ms, its max_lease_ttl]; None: its lease_ttl). The same id
        again renews it (replaces it at once). ``lease_held(lease)`` says how many hits it holds
        (fewer past kvtierd's caps) and until when. A lease belongs to this session: it ends with
        it, and after a daemon restart this client leases again what is left of it."""
        return self.lookup_detail(keys, lease, ttl).hits

    def lookup_detail(self, keys: Sequence[bytes], lease: int | None = None, ttl: float | None = None) -> LookupReply:
        """``lookup``'s whole answer: ``hits`` leading keys are ready (``lease``, ``leased``,
        ``ttl_ms``: what a lease holds of them); the ``pending`` keys after them are being promoted
        from the daemon's second tier (ask again shortly rather than compute them; 0 without a tier)."""
        if lease is None:
            return LookupReply.from_wire(self._call("lookup", keys=list(keys)))
        return self._lookup_leased(tuple(keys), lease, ttl, self._call)

    def _lookup_leased(self, keys: tuple, lease: int, ttl: float | None, call) -> LookupReply:
        fields: dict = {"keys": list(keys), "lease": lease}
        if ttl is not None:
            fields["ttl_ms"] = max(0, round(ttl * 1000))
        sent = time.monotonic()
        reply = LookupReply.from_wire(call("lookup", **fields))
        self._leases.pop(lease, None)
        if reply.lease is not None:
            self._leases[lease] = Lease(lease, keys, reply.hits, reply.leased, reply.ttl_ms / 1000,
                                        sent + reply.ttl_ms / 1000)
            if len(self._leases) > self._prune_at:    # leases another session consumed linger until they lapse
                self._drop_lapsed()
                self._prune_at = max(1024, 2 * len(self._leases))
        return reply

    def _drop_lapsed(self) -> None:
        now = time.monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires <= now]:
            del self._leases[lease_id]

    def lease_held(self, lease: int) -> Lease | None:
        """The lease of this id this client holds, unless it lapsed (what its lookup reported)."""
        held = self._leases.get(lease)
        return held if held is not None and held.expires > time.monotonic() else None

    @property
    def leases(self) -> dict[int, Lease]:
        """The leases this client holds and that have not lapsed, by id. (A lease another session
        of the engine consumed, e.g. the ranks' load of a coordinator's lease, stays listed until
        it lapses: the client cannot know.)"""
        self._drop_lapsed()
        return dict(self._leases)

    def unlease(self, leases: Iterable[int]) -> int:
        """End these leases of the engine (ids that name none are ignored); returns how many
        were live in kvtierd."""
        ids = list(dict.fromkeys(leases))
        for lease_id in ids:
            self._leases.pop(lease_id, None)
        released = 0
        for begin in range(0, len(ids), P.MAX_LEASES_PER_UNLEASE):
            chunk = ids[begin:begin + P.MAX_LEASES_PER_UNLEASE]
            released += UnleaseReply.from_wire(self._call("unlease", leases=chunk)).released
        return released

    def stats(self) -> StatsReply:
        return StatsReply.from_wire(self._call("stats"))

    def job_status(self, jobs: Iterable[int]) -> list[dict]:
        return JobsReply.from_wire(self._call("jobs", jobs=list(jobs))).jobs

    # ------------------------------------------------------------------ jobs
    @staticmethod
    def _store_hints(chain: bool, cold_tail: int) -> dict:
        """The store request's optional fields, sent only when they differ from the defaults."""
        hints: dict = {} if chain else {"chain": False}
        if cold_tail:
            hints["cold_tail"] = cold_tail
        return hints

    def open_store(self, job: int, keys: Sequence[bytes], chain: bool = True, cold_tail: int = 0) -> StoreDecision:
        """Coordinator: fix a store job's decision; the ranks then store() the same job.
        ``chain`` and ``cold_tail``: as for ``store``."""
        hints = self._store_hints(chain, cold_tail)
        reply = StoreReply.from_wire(self._call("store", job=job, keys=list(keys), **hints))
        return StoreDecision([StoreOutcome(o) for o in reply.outcomes])

    def open_load(self, job: int, keys: Sequence[bytes], lease: int | None = None) -> int:
        """Coordinator: pin the cached prefix of ``keys`` for a load job; returns its length.
        ``lease``: as for ``load``."""
        return LoadReply.from_wire(self._call("load", job=job, keys=list(keys), **self._consume(lease))).hits

    def _consume(self, lease: int | None) -> dict:
        """A load's lease field: the job's first request consumes the lease, whichever session
        sends it, so this client no longer holds it either way."""
        if lease is None:
            return {}
        self._leases.pop(lease, None)
        return {"lease": lease}

    def store(self, job: int, keys: Sequence[bytes], block_ids: Sequence[int], chain: bool = True,
              cold_tail: int = 0) -> StoreDecision:
        """Store KV-cache blocks ``block_ids`` under ``keys``. Returns the decision at once; the
        copy (writer ranks) runs in the background and the job finishes in poll()/wait().

        Hints for the eviction policy (the job's first request sets them): ``chain`` — the keys
        are one request's prefix chain in order, each extending the one before (so its tail is
        evicted before its head); pass False for unrelated keys. ``cold_tail`` — how many of the
        last keys you expect no reuse of (a partial last block, decode-phase blocks of a finished
        request): the policy may place them first in line for eviction."""
        kv = self._need_kv()
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if job in self._pending:
            raise KvtierError(f"job {job} is still in flight on this rank")
        hints = self._store_hints(chain, cold_tail)
        reply = StoreReply.from_wire(self._call("store", job=job, keys=list(keys), **hints))
        outcomes = [StoreOutcome(o) for o in reply.outcomes]
        if not self.is_writer:            # the request was this rank's vote
            self._pending[job] = _Pending("store", CopyHandle(), vote=False)
            return StoreDecision(outcomes)
        write = np.flatnonzero(np.frombuffer(reply.outcomes, dtype=np.uint8) == StoreOutcome.WRITE)
        pages = np.frombuffer(reply.pages, dtype=P.PAGES_DTYPE).reshape(len(write), self.pages_per_shard)
        try:
            desc = kv.descriptors(np.asarray(block_ids)[write], pages, self.region_data, to_region=True)
            handle = self.copier.submit(desc)
        except BaseException:
            self._call_quietly("commit", job=job, ok=False)
            raise
        self._pending[job] = _Pending("store", handle, pages=pages)
        return StoreDecision(outcomes)

    def load(self, job: int, keys: Sequence[bytes], block_ids: Sequence[int], lease: int | None = None) -> int:
        """Load the cached prefix of ``keys`` into KV-cache blocks ``block_ids`` (same order).
        Returns how many blocks will arrive; they are in place once the job finished ok.

        ``lease``: a lease of the engine (``lookup``), which the job's first request consumes:
        the leased keys become the job's pins with no moment in between, so if every key is
        leased none is missing. A lease that is no longer live (expired, revoked, lost with a
        restart) is no error: the load pins what is still cached."""
        kv = self._need_kv()
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if job in self._pending:
            raise KvtierError(f"job {job} is still in flight on this rank")
        keys = list(keys)
        reply = LoadReply.from_wire(self._call("load", job=job, keys=keys, **self._consume(lease)))
        hits = reply.hits
        pages = np.frombuffer(reply.pages, dtype=P.PAGES_DTYPE).reshape(hits, self.pages_per_shard)
        block_ids = np.asarray(block_ids)
        try:
            desc = kv.descriptors(block_ids[:hits], pages, self.region_data, to_region=False)
            handle = self.copier.submit(desc)
        except BaseException:
            self._call_quietly("release", job=job)
            raise
        self._pending[job] = _Pending("load", handle, hits=hits, keys=keys, block_ids=block_ids)
        return hits

    def abort(self, job: int) -> None:
        self._call("abort", job=job)

    def _call_quietly(self, op: str, **fields) -> None:
        try:
            self._call(op, **fields)
        except KvtierError:
            pass

    def _finish(self, job: int, p: _Pending) -> JobResult | None:
        """The copy completed: vote or release, and turn the daemon's answer into a result.
        None: the release found a daemon restart and the load was redone (still in flight)."""
        failure = p.handle.error()
        attachments = self.attachments
        try:
            if p.kind == "store":
                if p.vote and failure is None and self.info.checksums:
                    sums = [shard_checksum(self.region_bytes, row, self.page_size, self.namespace.block_bytes)
                            for row in p.pages]
                    self._call("commit", job=job, ok=True, checksums=sums)
                elif p.vote:
                    self._call("commit", job=job, ok=failure is None)
            else:
                self._call("release", job=job)
        except KvtierError as exc:        # an error reply, or no reply at all (DaemonUnavailable)
            if (p.kind == "load" and failure is None and self.attachments != attachments
                    and self.channel is not None and self._redo_load(job, p)):
                return None               # re-attached meanwhile: the load was opened again
            return JobResult(job, p.kind, False, 0, exc)
        if failure is not None:
            return JobResult(job, p.kind, False, 0, KvtierError(f"copy failed: {failure!r}"))
        return JobResult(job, p.kind, True, p.hits)

    def _take_settled(self, jobs: Iterable[int] | None = None) -> dict[int, JobResult]:
        """Hand out settled results (of ``jobs``, or all), each once."""
        wanted = None if jobs is None else set(jobs)
        taken = {r.job: r for r in self._settled if wanted is None or r.job in wanted}
        self._settled = [r for r in self._settled if r.job not in taken]
        return taken

    def poll(self) -> list[JobResult]:
        """Jobs of this rank that finished since the last poll (their copies completed), each once.

        Finishing one job may find a daemon restart; the jobs still pending then are settled as
        lost (stores) or redone (loads) and reported by this call or a later one."""
        done = []
        for job, p in list(self._pending.items()):
            if self._pending.get(job) is p and p.handle.done():   # not settled by a re-attach meanwhile
                del self._pending[job]
                result = self._finish(job, p)
                if result is not None:
                    done.append(result)
        return done + list(self._take_settled().values())

    def wait(self, jobs: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until the given in-flight jobs finished on this rank; returns their results in
        the order asked. On a timeout (FutureTimeout) the jobs finished meanwhile are kept for
        the next poll()/wait(), never lost."""
        wanted = list(dict.fromkeys(jobs))
        settled = {r.job for r in self._settled}
        missing = [j for j in wanted if j not in self._pending and j not in settled]
        if missing:
            raise KvtierError(f"jobs {missing} are not in flight on this rank")
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, JobResult] = {}
        for job in wanted:
            while (p := self._pending.get(job)) is not None:   # a redone load is in flight again
                try:
                    p.handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    self._settled.extend(results.values())
                    raise
                except Exception:
                    pass                          # a failed copy: _finish votes no and reports it
                if self._pending.get(job) is p:
                    del self._pending[job]
                    result = self._finish(job, p)
                    if result is not None:
                        results[job] = result
        results.update(self._take_settled(wanted))
        return [results[job] for job in wanted]

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish in-flight copies (voting/releasing them), say bye, unmap the region."""
        if self.channel is None:
            return
        try:
            if self._pending:
                self.wait(list(self._pending))
            self.channel.call("bye")
        except KvtierError:
            pass
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            if self.copier is not None:
                self.copier.close()
            if self.mapping is not None:
                self.mapping.close()
            self.channel.close()
            self.channel = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""``Rank``: the session of one TP rank — it maps the region, registers its KV cache, copies blocks
and votes (``kvtier.api`` describes the public API; ``Client(..., rank=r)`` builds one).

A store job finishes on this rank once its copy (if it is a writer) completed and its vote was
accepted; a load job once its copy completed and its release was accepted. Across a daemon
restart (``Client``'s re-attach): the copies in flight are waited for first (before the hello
tells the daemon this session's pages are free, and before a remap), stores in flight are settled
as lost, and loads in flight are opened again on the new daemon and copied again.

First touch: a process's mapping of the region has no page-table entries until it touches each
page, and a store into untouched 4 KiB pages ran at 0.35x the speed of the same store into pages
the process had touched (32 MiB jobs, ``kvtierctl bench --only attach``). So a rank populates its
mapping at attach (and again after a remap) on ``populate_threads`` background threads
(``populating``; 0: none), logging its progress; ``close()`` cancels it. Registering a CUDA KV
cache waits for it before pinning the mapping with cudaHostRegister, which then finds every page
present.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from kvtierd.contract import protocol as P
from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.errors import DaemonUnavailable, KvtierError
from kvtierd.contract.mapping import Mapping, Populate
from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.region_format import HEADER_BYTES, FormatError
from kvtierd.contract.region_sums import shard_checksum
from kvtierd.contract.region_view import DataHeader
from kvtierd.contract.replies import HelloReply, LoadReply, StoreReply

from .copy import Copier, CopyHandle
from .kvcache import KVCacheLayout
from .results import JobResult, StoreDecision
from .select import select_copier
from .session import Client

log = logging.getLogger("kvtier.api")


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


def _lost(job: int, kind: str, cause: KvtierError) -> JobResult:
    return JobResult(job, kind, False, 0, DaemonUnavailable(
        f"kvtierd restarted or dropped the session while job {job} was in flight ({cause})"))


class Rank(Client, role="rank"):
    """The session of TP rank ``rank`` of engine ``engine_id`` (module docstring)."""

    def __init__(self, socket_path: str | None = None, *, engine_id: str, rank: int, world_size: int,
                 namespace: NamespaceId, copier: str = "auto", pin: str = "auto", timeout: float = 10.0,
                 reconnect_timeout: float = 30.0, populate_threads: int = 2,
                 engine_secret: bytes | str | None = None):
        if rank is None:
            raise ValueError("a Rank needs its rank; Client(rank=None) or Coordinator(...) is the coordinator")
        self.mapping: Mapping | None = None
        self.populating: Populate | None = None   # the mapping's background populate (0 threads: none)
        self._populate_threads = populate_threads
        self.pinned = "off"
        self.kv: KVCacheLayout | None = None
        self.copier: Copier | None = None
        self._stream = None                       # the compute stream copies wait for (None: current)
        self._copier_name = copier
        self._pin = pin
        self._pending: dict[int, _Pending] = {}
        # Results settled outside the call that returns them: jobs in flight across a restart, and
        # jobs a wait() finished before it timed out on another. poll()/wait() hand them out once.
        self._settled: list[JobResult] = []
        super().__init__(socket_path, engine_id=engine_id, rank=rank, world_size=world_size, namespace=namespace,
                         timeout=timeout, reconnect_timeout=reconnect_timeout, engine_secret=engine_secret)

    # ------------------------------------------------------------------ attaching (Client's hooks)
    def _attached(self, previous: HelloReply | None) -> None:
        """Map (or remap) the region when it is new to this rank, and rebuild the copier over it."""
        info = self.info
        self.is_writer = self.rank in info.writers
        if self.mapping is not None and previous is not None and \
                (previous.region, previous.generation) == (info.region, info.generation):
            return
        if self.copier is not None:      # it holds the old mapping's addresses (and its pinning)
            self.copier.close()
            self.copier = None
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        self._map_region()
        if self.kv is not None:
            self._start_copier()

    def _quiesce(self, cause: KvtierError) -> list:
        """Wait for every copy in flight; settle the stores as lost, keep the loads to redo."""
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
                self._settled.append(_lost(job, p.kind, cause))
        self._pending.clear()
        return redo

    def _resume(self, redo: list, cause: KvtierError, attached: bool) -> None:
        for job, p in redo:
            if not (attached and self._redo_load(job, p)):
                self._settled.append(_lost(job, "load", cause))

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

    # ------------------------------------------------------------------ the KV cache and its copier
    def register_kv_caches(self, tensors: Sequence, stream=None) -> None:
        """Describe this rank's KV cache: per-layer tensors [num_blocks, ...] (see kvcache.py).

        ``stream``: the stream the engine runs its model on (torch.cuda.Stream, cupy Stream or a raw
        cudaStream_t); device copies start after the work queued on it when store()/load() is
        called. None means torch.cuda.current_stream() at each call.
        """
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

    def _need_kv(self, job: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> KVCacheLayout:
        if self.kv is None:
            raise KvtierError("call register_kv_caches() before store() or load()")
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if job in self._pending:
            raise KvtierError(f"job {job} is still in flight on this rank")
        return self.kv

    # ------------------------------------------------------------------ jobs
    def store(self, job: int, keys: Sequence[bytes], block_ids: Sequence[int], chain: bool = True,
              cold_tail: int = 0) -> StoreDecision:
        """Store KV-cache blocks ``block_ids`` under ``keys``. Returns the decision at once; the
        copy (writer ranks) runs in the background and the job finishes in poll()/wait().

        Hints for the eviction policy (the job's first request sets them): ``chain`` — the keys
        are one request's prefix chain in order, each extending the one before (so its tail is
        evicted before its head); pass False for unrelated keys. ``cold_tail`` — how many of the
        last keys you expect no reuse of (a partial last block, decode-phase blocks of a finished
        request): the policy may place them first in line for eviction."""
        kv = self._need_kv(job, keys, block_ids)
        reply = StoreReply.from_wire(self._call("store", job=job, keys=list(keys),
                                                **self._store_hints(chain, cold_tail)))
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
        kv = self._need_kv(job, keys, block_ids)
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

    # ------------------------------------------------------------------ close (Client's hooks)
    def _finish_all(self) -> None:
        if self._pending:
            self.wait(list(self._pending))

    def _release_resources(self) -> None:
        if self.copier is not None:
            self.copier.close()
        if self.mapping is not None:
            self.mapping.close()

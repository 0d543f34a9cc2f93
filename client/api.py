"""The public client API, in the engine's terms.

A ``Client`` is one session with kvtierd: a *rank* session (one per TP rank: registers its KV
cache, copies, votes) or a *coordinator* session (rank=None: the engine's scheduler process, which
looks up and opens jobs that its ranks then carry out). Engines whose ranks each issue the same
jobs need no coordinator: the first request of a job fixes its decision for everybody.

Rank usage::

    client = Client(socket, engine_id="e1", rank=r, world_size=n, namespace=namespace_id)
    client.register_kv_caches(per_layer_tensors)
    hits = client.lookup(keys)                      # leading keys that are cached
    client.store(job, keys, block_ids)              # returns the per-key decision at once
    client.load(job2, keys[:hits], block_ids2)      # returns how many blocks will arrive
    for result in client.wait([job, job2]): ...     # or poll() from the engine's loop

A store job finishes on this rank once its copy (if it is a writer) completed and its vote was
accepted; a load job once its copy completed and its release was accepted. ``JobResult.ok`` is
False when the daemon aborted the job (then loaded blocks must be treated as a miss).

Daemon restarts: when the daemon stops answering or no longer knows the session, the client
re-attaches on its own (same engine, rank and namespace; for up to ``reconnect_timeout`` seconds),
remapping the region when its path or generation changed. Jobs in flight across the restart
finish with ``ok=False`` and a ``DaemonUnavailable`` error (a miss for the engine); the call
that discovered the restart is retried once on the new daemon, except commit/release, whose
jobs died with the old one. A session the daemon cannot watch through a pidfd (another PID
namespace) gets a heartbeat thread with its own socket.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from kvtierd.contract import protocol as P
from kvtierd.contract.channel import Channel
from kvtierd.contract.errors import DaemonUnavailable, KvtierError, NotAttached
from kvtierd.contract.mapping import Mapping
from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.paths import default_socket
from kvtierd.contract.protocol import (HelloReply, JobsReply, LoadReply, LookupReply, StatsReply, StoreOutcome,
                                      StoreReply)
from kvtierd.contract.region_format import HEADER_BYTES, DataHeader, FormatError, shard_checksum

from .copy import Copier, CopyHandle
from .kvcache import KVCacheLayout
from .select import select_copier


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


@dataclass
class _Pending:
    kind: str
    handle: CopyHandle
    hits: int = 0
    vote: bool = True         # store: this rank must commit after the copy
    pages: np.ndarray | None = None   # store: [written keys, pages per shard] this rank copied into
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


SECRET_ENV = "KVTIER_ENGINE_SECRET"      # the engine secret when Client(engine_secret=) is not given

# Ops that may be sent again after re-attaching: they do not refer to a job of the old daemon.
_RETRYABLE = frozenset({"lookup", "stats", "jobs", "store", "load", "abort"})


class Client:
    def __init__(self, socket_path: str | None = None, *, engine_id: str, rank: int | None, world_size: int,
                 namespace: NamespaceId, copier: str = "auto", pin: str = "auto", timeout: float = 10.0,
                 reconnect_timeout: float = 30.0, engine_secret: bytes | str | None = None):
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
        self.pinned = "off"
        self.kv: KVCacheLayout | None = None
        self.copier: Copier | None = None
        self._stream = None                       # the compute stream copies wait for (None: current)
        self.info: HelloReply | None = None     # the last hello's reply
        self._heartbeat: _Heartbeat | None = None
        self._copier_name = copier
        self._pin = pin
        self._pending: dict[int, _Pending] = {}
        self._lost: list[JobResult] = []          # in flight across a daemon restart
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

    def _reattach(self, cause: KvtierError) -> None:
        """The daemon restarted or dropped us: settle in-flight jobs as lost, attach again."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        for job, p in list(self._pending.items()):
            try:
                p.handle.wait()               # the copy must be over before the region may be remapped
            except Exception:
                pass
            self._lost.append(JobResult(job, p.kind, False, 0, DaemonUnavailable(
                f"kvtierd restarted or dropped the session while job {job} was in flight ({cause})")))
        self._pending.clear()
        self.channel.close()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                self._attach()
                return
            except (DaemonUnavailable, NotAttached) as exc:
                if time.monotonic() + delay > deadline:
                    raise DaemonUnavailable(f"kvtierd did not come back within {self.reconnect_timeout:g}s: "
                                            f"{exc}") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

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
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are cached and ready (they count as recently used)."""
        return LookupReply.from_wire(self._call("lookup", keys=list(keys))).hits

    def stats(self) -> StatsReply:
        return StatsReply.from_wire(self._call("stats"))

    def job_status(self, jobs: Iterable[int]) -> list[dict]:
        return JobsReply.from_wire(self._call("jobs", jobs=list(jobs))).jobs

    # ------------------------------------------------------------------ jobs
    def open_store(self, job: int, keys: Sequence[bytes]) -> StoreDecision:
        """Coordinator: fix a store job's decision; the ranks then store() the same job."""
        reply = StoreReply.from_wire(self._call("store", job=job, keys=list(keys)))
        return StoreDecision([StoreOutcome(o) for o in reply.outcomes])

    def open_load(self, job: int, keys: Sequence[bytes]) -> int:
        """Coordinator: pin the cached prefix of ``keys`` for a load job; returns its length."""
        return LoadReply.from_wire(self._call("load", job=job, keys=list(keys))).hits

    def store(self, job: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> StoreDecision:
        """Store KV-cache blocks ``block_ids`` under ``keys``. Returns the decision at once; the
        copy (writer ranks) runs in the background and the job finishes in poll()/wait()."""
        kv = self._need_kv()
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if job in self._pending:
            raise KvtierError(f"job {job} is still in flight on this rank")
        reply = StoreReply.from_wire(self._call("store", job=job, keys=list(keys)))
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

    def load(self, job: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Load the cached prefix of ``keys`` into KV-cache blocks ``block_ids`` (same order).
        Returns how many blocks will arrive; they are in place once the job finished ok."""
        kv = self._need_kv()
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if job in self._pending:
            raise KvtierError(f"job {job} is still in flight on this rank")
        reply = LoadReply.from_wire(self._call("load", job=job, keys=list(keys)))
        hits = reply.hits
        pages = np.frombuffer(reply.pages, dtype=P.PAGES_DTYPE).reshape(hits, self.pages_per_shard)
        try:
            desc = kv.descriptors(np.asarray(block_ids)[:hits], pages, self.region_data, to_region=False)
            handle = self.copier.submit(desc)
        except BaseException:
            self._call_quietly("release", job=job)
            raise
        self._pending[job] = _Pending("load", handle, hits=hits)
        return hits

    def abort(self, job: int) -> None:
        self._call("abort", job=job)

    def _call_quietly(self, op: str, **fields) -> None:
        try:
            self._call(op, **fields)
        except KvtierError:
            pass

    def _finish(self, job: int, p: _Pending) -> JobResult:
        """The copy completed: vote or release, and turn the daemon's answer into a result."""
        failure = p.handle.error()
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
            return JobResult(job, p.kind, False, 0, exc)
        if failure is not None:
            return JobResult(job, p.kind, False, 0, KvtierError(f"copy failed: {failure!r}"))
        return JobResult(job, p.kind, True, p.hits)

    def poll(self) -> list[JobResult]:
        """Jobs of this rank that finished since the last poll (their copies completed)."""
        done, self._lost = self._lost, []
        for job, p in list(self._pending.items()):
            if p.handle.done():
                del self._pending[job]
                done.append(self._finish(job, p))
        return done

    def wait(self, jobs: Iterable[int], timeout: float | None = None) -> list[JobResult]:
        """Block until the given in-flight jobs finished on this rank; returns their results."""
        wanted = list(jobs)
        lost = {r.job: r for r in self._lost if r.job in wanted}
        self._lost = [r for r in self._lost if r.job not in lost]
        wanted = [j for j in wanted if j not in lost]
        missing = [j for j in wanted if j not in self._pending]
        if missing:
            raise KvtierError(f"jobs {missing} are not in flight on this rank")
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        for job in wanted:
            p = self._pending.get(job)
            if p is None:      # a restart, found while finishing an earlier job, settled it as lost
                results.append(next(r for r in self._lost if r.job == job))
                self._lost = [r for r in self._lost if r.job != job]
                continue
            try:
                p.handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise
            except Exception:
                pass                          # a failed copy: _finish votes no and reports it
            del self._pending[job]
            results.append(self._finish(job, p))
        return list(lost.values()) + results

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

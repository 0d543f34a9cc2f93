"""The daemon's state, as the server sees it: engines and sessions attach and detach, and the
operations run on the entry index (``kvtierd.index``) and the job machine (``kvtierd.jobs``).

No sockets and no threads: the server's single loop calls these methods one request at a time,
so nothing here locks. Every method either returns a result or raises ``RequestError`` with a
typed code, having changed nothing it should not have.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import time

from .contract.namespace import NamespaceId
from .contract.protocol import ErrorCode, JobKind, RequestError
from .contract.region_format import RegionView
from .index import COUNTERS as INDEX_COUNTERS
from .index import Index
from .jobs import COUNTERS as JOB_COUNTERS
from .jobs import Engine, Jobs
from .policy import create as create_policy
from .sessions import Session, SessionEnd


class Store:
    def __init__(self, view: RegionView, job_timeout: float = 30.0, clock=time.monotonic,
                 checksums: bool = False, policy: str = "lru", **job_limits: int):
        """``job_limits``: max_job_keys, max_job_keys_per_engine, max_tombstones (``jobs.Jobs``)."""
        self.checksums = checksums        # keep writers' checksums, verify them on recovery
        self.index = Index(view, create_policy(policy), verify_checksums=checksums)
        self.jobs = Jobs(self.index, job_timeout, clock, checksums, **job_limits)
        self.sessions: dict[int, Session] = {}
        self._session_ids = itertools.count(1)

    @property
    def recovered(self) -> dict[str, int]:
        """What recovery kept and discarded: ready, writing_discarded, corrupt_discarded."""
        return self.index.recovered

    @property
    def job_timeout(self) -> float:
        return self.jobs.job_timeout

    @property
    def clock(self):
        return self.jobs.clock

    # ------------------------------------------------------------------ sessions
    def attach(self, engine_id: str, rank: int | None, world_size: int, ns_id: NamespaceId,
               pid: int | None = None, uid: int | None = None, secret: bytes | None = None) -> Session:
        """A new session of ``engine_id`` (a rank, or the coordinator when ``rank`` is None); the
        engine's first session fixes its world size and namespace, which later ones must match,
        and who may join it: later sessions must come from the same ``uid`` (the peer's, as the
        kernel reports it) and present the same ``secret`` (or none, if the first had none)."""
        if rank is not None and rank >= world_size:   # before anything is created for the engine
            raise RequestError(ErrorCode.BAD_REQUEST, f"rank {rank} >= world_size {world_size}")
        engines = self.jobs.engines
        engine = engines.get(engine_id)
        digest = None if secret is None else hashlib.sha256(secret).digest()
        if engine is None:
            engine = Engine(engine_id, world_size, self.index.namespace(ns_id), uid=uid, secret=digest)
            engine.ns.users += 1
            engines[engine_id] = engine
        elif engine.uid != uid:
            raise RequestError(ErrorCode.FORBIDDEN, f"engine {engine_id!r} is attached from uid {engine.uid}; a "
                                                    f"session from uid {uid} cannot join it (choose another engine id)")
        elif not hmac.compare_digest(engine.secret or b"", digest or b""):
            raise RequestError(ErrorCode.FORBIDDEN, f"engine {engine_id!r} was attached with "
                               f"{'a secret' if engine.secret else 'no secret'} and this session presents "
                               f"{'another' if digest else 'none'}: every session of an engine presents the same "
                               "one (Client(engine_secret=...), KVTIER_ENGINE_SECRET)")
        elif engine.world_size != world_size or engine.ns.id != ns_id:
            raise RequestError(ErrorCode.LAYOUT_MISMATCH,
                               f"engine {engine_id!r} is attached with world size {engine.world_size} and namespace "
                               f"{engine.ns.id.name()}; this session asks for world size {world_size} and "
                               f"{ns_id.name()}")
        if rank is not None and rank in engine.ranks:
            other = engine.ranks[rank]
            raise RequestError(ErrorCode.LAYOUT_MISMATCH,
                               f"engine {engine_id!r} rank {rank} is already attached (session {other.id}, "
                               f"pid {other.pid}); every rank attaches once")
        session = Session(next(self._session_ids), engine, rank, pid)
        if rank is None:
            engine.coordinators.add(session)
        else:
            engine.ranks[rank] = session
        self.sessions[session.id] = session
        return session

    def detach(self, session: Session, cause: SessionEnd = SessionEnd.LEFT) -> None:
        """End a session (bye, death, or daemon stop). Jobs that still wait for this rank abort."""
        if self.sessions.pop(session.id, None) is None:
            return
        engine = session.engine
        if session.rank is None:
            engine.coordinators.discard(session)
        else:
            engine.ranks.pop(session.rank, None)
            self.jobs.rank_gone(engine, session.rank, cause)
        if not engine.ranks and not engine.coordinators:
            self.jobs.engine_gone(engine)
            engine.ns.users -= 1

    # ------------------------------------------------------------------ operations
    def lookup(self, session: Session, keys: list[bytes]) -> int:
        """How many leading keys are READY; touches them (they are about to be used)."""
        return self.index.lookup(session.engine.ns, keys)

    def store(self, session: Session, job_id: int, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        return self.jobs.store(session, job_id, keys)

    def commit(self, session: Session, job_id: int, ok: bool, checksums: list[int] | None = None) -> None:
        self.jobs.commit(session, job_id, ok, checksums)

    def load(self, session: Session, job_id: int, keys: list[bytes]) -> tuple[int, list[bytes]]:
        return self.jobs.load(session, job_id, keys)

    def release(self, session: Session, job_id: int) -> None:
        self.jobs.release(session, job_id)

    def abort(self, session: Session, job_id: int) -> None:
        self.jobs.abort(session, job_id)

    def job_states(self, session: Session, job_ids: list[int]) -> list[dict]:
        return self.jobs.job_states(session, job_ids)

    def expire(self) -> float | None:
        """Abort jobs past their deadline, free quarantines past theirs. Returns the next deadline."""
        return self.jobs.expire()

    def drop_all(self) -> int:
        """Drop every entry (the data file holding their bytes is gone). Call with no session
        attached: no job is open, nothing is pinned. Returns how many were dropped."""
        assert not self.sessions, "drop_all with sessions attached"
        return self.index.evict(None, None)

    def evict(self, namespace: str | None, count: int | None) -> int:
        """Operator eviction (kvtierctl evict/clear): see ``Index.evict``."""
        return self.index.evict(namespace, count)

    # ------------------------------------------------------------------ what is going on
    def open_loads(self) -> int:
        return self.jobs.open_jobs(JobKind.LOAD)

    def eviction_pressure(self) -> tuple[int, int, int]:
        """(evictions so far, free pages, pages): what the server logs under pressure."""
        return self.index.counters["evictions"], self.index.pages.free_count, self.index.pages.total

    def stats(self) -> dict:
        """The store's part of ``protocol.StatsReply``."""
        index, jobs = self.index, self.jobs
        counters = {name: index.counters[name] for name in INDEX_COUNTERS}
        counters.update({name: jobs.counters[name] for name in JOB_COUNTERS})
        return {**index.stats(), **jobs.stats(), "sessions": len(self.sessions), **counters}

    def namespace_stats(self) -> list[dict]:
        return self.index.namespace_stats()

    def verify(self) -> None:
        """Check the in-memory state against itself and the region's tables (tests)."""
        self.index.verify(self.jobs.quarantined())
        engines = self.jobs.engines.values()
        for engine in engines:
            assert all(self.sessions.get(s.id) is s and s.engine is engine
                       for s in [*engine.ranks.values(), *engine.coordinators])
        for ns in self.index.namespaces.values():
            assert ns.users == sum(1 for e in engines if e.ns is ns), f"namespace {ns.slot} user count"
        assert len(self.sessions) == sum(len(e.ranks) + len(e.coordinators) for e in self.jobs.engines.values())

    def shutdown(self) -> None:
        """Abort every open job (their pages are freed) and persist the access clock."""
        for session in list(self.sessions.values()):
            self.detach(session, SessionEnd.DAEMON_STOPPED)
        self.index.persist_tick()

"""The daemon's state, as the server sees it: engines and sessions attach and detach
(``kvtierd.attachments``), and the operations run on the entry index (``kvtierd.index``), the
job machine (``kvtierd.jobs``), the leases (``kvtierd.leases``) and the fenced writes
(``kvtierd.writes``, over the writer fence ``kvtierd.fence``). The second tier is built with
the store (``tier``: a factory from ``kvtierd.tiering``; ``NoTier`` when there is none): lookups
also report the keys being promoted from it, and namespace clears reach it. The event log
(``kvtierd.eventlog``) follows the index's events; coordinator sessions read their namespace's.

No sockets and no threads: the server's single loop calls these methods one request at a time,
so nothing here locks. Every method either returns a result or raises ``RequestError`` with a
typed code, having changed nothing it should not have.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .attachments import Attachments, Session, SessionEnd
from .contract.codes import ErrorCode, RequestError
from .contract.namespace import NamespaceId, format_ranks
from .contract.region_format import WRITER_SLOTS
from .contract.region_view import RegionView
from .eventlog import EventLog, EventsRead, Recorder, TableSnapshot
from .keycopies import KeyCopies
from .events import Events, Gone
from .fence import Fence, Release
from .holds import Holds
from .index import COUNTERS as INDEX_COUNTERS
from .index import Index
from .jobs import COUNTERS as JOB_COUNTERS
from .jobs import Jobs
from .leases import Leases
from .policy import DEFAULT as DEFAULT_POLICY
from .policy.native import create as create_policy
from .processes import Process
from .tiering.interface import TierFactory, no_tier
from .writes import Writes

# How a session's end bears on its writer's fenced pages: these ends prove the writer cannot
# write any more (the client waits for its copies before bye and before re-attaching; a dead
# process writes nothing; the pages of a replaced data file are gone, and a writer still copying
# copies into its mapping of the old file). Every other end leaves them fenced (kvtierd.fence):
# a lost heartbeat, a take-over, and a connection that ended (DISCONNECTED: a socket closed or
# dropped says nothing of the process, which may still be copying into its mapping).
PROOF_OF_END = {SessionEnd.LEFT: Release.LEFT, SessionEnd.DIED: Release.DIED,
                SessionEnd.DEAD_AT_HELLO: Release.DIED, SessionEnd.REATTACHED: Release.REATTACHED,
                SessionEnd.REGION_REPLACED: Release.REGION_REPLACED}


@dataclass(frozen=True)
class Lookup:
    """What a leasing lookup found, and what its lease holds (``lease`` None: it holds nothing)."""

    hits: int
    lease: int | None
    leased: int
    ttl: float


@dataclass(frozen=True)
class Eviction:
    """What an operator eviction did (``replies.EvictReply``)."""

    evicted: int
    skipped_leased: int
    revoked_leases: int


class Store:
    def __init__(self, view: RegionView, job_timeout: float = 30.0, clock=time.monotonic,
                 checksums: bool = False, policy: str = DEFAULT_POLICY, fence_grace: float = 600.0,
                 lease_ttl: float = 5.0, max_lease_ttl: float = 60.0, max_leased_keys_per_engine: int = 1 << 18,
                 max_leased_keys: int = 1 << 20, max_writer_rows: int = WRITER_SLOTS,
                 max_writer_rows_per_peer: int = 256, held_shares: tuple[float, float, float] = (0.25, 0.4, 0.75),
                 tier: TierFactory = no_tier, events_log_bytes: int = 64 << 20, **job_limits: int):
        """``held_shares``: the shares of the region one engine, one namespace and all engines may
        hold out of eviction (``holds.Holds``). ``max_writer_rows(_per_peer)``: the writer table's
        bounds (``fence.Fence``). ``tier``: builds the second tier (``kvtierd.tiering``; none by
        default). ``events_log_bytes``: the event log's memory budget (``eventlog.EventLog``).
        ``job_limits``: max_job_keys, max_job_keys_per_engine, max_tombstones (``jobs.Jobs``)."""
        self.checksums = checksums        # keep writers' checksums, verify them on recovery
        self.fence = Fence(view, fence_grace, clock, max_writer_rows, max_writer_rows_per_peer)
        geometry = view.geometry
        self.holds = Holds(geometry.entry_slots, geometry.num_pages, create_policy(policy), held_shares)
        events = Events()
        self.index = Index(view, self.holds, self.fence, verify_checksums=checksums, events=events)
        self.writes = Writes(self.index, self.fence)
        self.leases = Leases(self.index, self.holds, clock, lease_ttl, max_lease_ttl, max_leased_keys_per_engine,
                             max_leased_keys)
        self.attachments = Attachments()
        self.jobs = Jobs(self.index, self.writes, self.leases, self.holds, self.attachments.engines, job_timeout,
                         clock, checksums, **job_limits)
        self.tier = tier(self.index, self.writes, events, clock)
        self.event_log = EventLog(TableSnapshot(view.entries), events_log_bytes)
        self.recorder = Recorder(self.event_log, KeyCopies(view))
        events.subscribe(self.recorder)
        # session → (log key, epoch, cursor) of its last read: how far behind each reader is
        self._readers: dict[Session, tuple[int, int, int]] = {}

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
               process: Process = Process(), secret: bytes | None = None,
               node_ranks: tuple[int, ...] | None = None) -> Session:
        """A new session of ``engine_id`` (a rank, or the coordinator when ``rank`` is None); the
        engine's first session fixes its world size, the ranks of it on this daemon
        (``node_ranks``, None: all) and namespace, which later ones must match, and who may join
        it (``may_join``). A writer rank gets a row in the fence's writer table."""
        return self.attachments.attach(engine_id, rank, world_size, ns_id, process, secret, self.index.namespace,
                                       self.writes.add_writer, node_ranks)

    def may_join(self, engine_id: str, process: Process, secret: bytes | None) -> None:
        """Raise FORBIDDEN unless a session of ``process`` presenting ``secret`` may join engine
        ``engine_id`` (``Attachments.may_join``)."""
        self.attachments.may_join(engine_id, process, secret)

    def rank_holder(self, engine_id: str, rank: int | None) -> Session | None:
        """The session attached as ``rank`` of ``engine_id``, if any."""
        return self.attachments.rank_holder(engine_id, rank)

    def detach(self, session: Session, cause: SessionEnd = SessionEnd.LEFT, last_seen: float | None = None) -> None:
        """End a session (bye, death, heartbeat loss, or daemon stop). Jobs that still wait for
        this rank abort; the pages its writer may still copy into stay fenced unless ``cause``
        proves it cannot (``PROOF_OF_END``). ``last_seen``: its last proof of life (default now)."""
        if not self.attachments.leave(session):
            return
        self.leases.session_gone(session)
        engine = session.engine
        if session.rank is not None:
            self.jobs.rank_gone(engine, session.rank, cause)
        if not engine.sessions:
            self.jobs.engine_gone(engine)
            self.attachments.forget(engine)
        if session.writer is not None:
            seen = self.clock() if last_seen is None else last_seen
            self.writes.writer_ended(session.writer, PROOF_OF_END.get(cause), seen)

    def reattached(self, session_id: int, token: int | None) -> None:
        """A hello names a session that is gone (dropped, or of the daemon before a restart) and its
        token: the pages its writer was fenced for are free (the client waited for its copies)."""
        self.writes.reattached(session_id, token)

    def writer_died(self, pidfd: int) -> None:
        """The pidfd of a detached writer's process became readable."""
        self.writes.died(pidfd)

    # ------------------------------------------------------------------ operations
    def lookup(self, session: Session, keys: list[bytes]) -> int:
        """How many leading keys are READY; touches them (they are about to be used)."""
        hits = self.index.lookup(session.engine.ns, keys)
        self.index.access(hits)
        return len(hits)

    def lease(self, session: Session, lease_id: int, keys: list[bytes], ttl: float | None = None) -> Lookup:
        """``lookup``, and hold the ready prefix it found for the engine under ``lease_id`` for
        ``ttl`` seconds (clamped; None: the lease_ttl setting), replacing a live lease of that id
        (``Leases.grant``)."""
        hits = self.index.lookup(session.engine.ns, keys)
        leased, granted = self.leases.grant(session, lease_id, hits, ttl)
        self.index.access(hits[leased:])          # the leased ones left the policy, and got a tick
        return Lookup(len(hits), lease_id if leased else None, leased, granted)

    def unlease(self, session: Session, lease_ids: list[int]) -> int:
        """End the engine's live leases of these ids; returns how many there were."""
        return self.leases.release(session, lease_ids)

    def pending(self, session: Session, keys: list[bytes], hits: int) -> int:
        """How many keys after the ``hits`` READY ones are being promoted from the second tier
        (0 without one); starts the promotion of those not asked about yet. Never waits."""
        return self.tier.pending(session.engine.ns, keys, hits)

    def store(self, session: Session, job_id: int, keys: list[bytes], chain: bool = True,
              cold_tail: int = 0) -> tuple[bytes, bytes]:
        return self.jobs.store(session, job_id, keys, chain, cold_tail)

    def commit(self, session: Session, job_id: int, ok: bool, checksums: list[int] | None = None) -> None:
        self.jobs.commit(session, job_id, ok, checksums)

    def load(self, session: Session, job_id: int, keys: list[bytes], lease: int | None = None
             ) -> tuple[int, bytes]:
        return self.jobs.load(session, job_id, keys, lease)

    def release(self, session: Session, job_id: int) -> None:
        self.jobs.release(session, job_id)

    def abort(self, session: Session, job_id: int) -> None:
        self.jobs.abort(session, job_id)

    def job_states(self, session: Session, job_ids: list[int]) -> list[dict]:
        return self.jobs.job_states(session, job_ids)

    def expire(self) -> float | None:
        """Abort jobs past their deadline, end leases past theirs, release unwatchable writers past
        their grace. Returns the next deadline."""
        grace = self.writes.expire(self.clock())
        deadline = self.jobs.expire()
        return min(filter(None, (deadline, self.leases.expire(), grace)), default=None)

    def drop_all(self) -> int:
        """Drop every entry and every writer's fence: the data file holding their pages is gone
        (``Fence.reset``). Call with no session attached: no job is open, nothing is pinned, and
        no lease is held (leases die with their sessions). Returns how many entries were dropped."""
        assert not self.attachments.sessions, "drop_all with sessions attached"
        assert not len(self.leases), "drop_all with leases held"
        dropped = self.index.evict(None, None, Gone.REGION_REPLACED)
        self.writes.reset()
        return dropped

    def evict(self, namespace: str | None, count: int | None, force: bool = False) -> Eviction:
        """Operator eviction (kvtierctl evict/clear; ``Index.evict``): leased entries stay, and are
        reported as skipped when the evictable ones ran out; ``force`` revokes the leases in scope
        first, so that they go too (pinned and WRITING entries always stay)."""
        revoked = self.leases.revoke(namespace) if force else 0
        evicted = self.index.evict(namespace, count)
        ran_out = count is None or evicted < count
        return Eviction(evicted, self.leases.leased_entries(namespace) if ran_out else 0, revoked)

    def clear_tier(self, namespace: str | None, reply: Callable[[str, int | None], None]) -> None:
        """Remove the blocks of the namespace named ``namespace`` (None: of every namespace the
        region knows) from the second tier; ``reply(tier, removed)`` once it answered (at once
        when there is none: "off")."""
        self.tier.clear([ns for ns in self.index.namespaces.values() if namespace is None or ns.id.name() == namespace],
                        reply)

    # ------------------------------------------------------------------ the event log
    def events(self, session: Session, epoch: int | None, cursor: int | None, snapshot_from: int | None,
               max_keys: int) -> EventsRead:
        """A coordinator session reads its namespace's event log (``EventLog.read``)."""
        if session.rank is not None:
            raise RequestError(ErrorCode.FORBIDDEN, "the events op is for an engine's coordinator session (its "
                                                    "scheduler); a rank session cannot read events")
        ns = session.engine.ns
        slots = self.index.geometry.entry_slots
        if snapshot_from is not None and snapshot_from > slots:
            raise RequestError(ErrorCode.BAD_REQUEST, f"events.snapshot_from={snapshot_from} is past the entry table "
                                                      f"({slots} slots)")
        key = self.recorder.follow(ns)
        read = self.event_log.read(key, epoch, cursor, snapshot_from, max_keys)
        self._readers[session] = (key, read.epoch, read.seq)
        return read

    def replied(self) -> None:
        """A request's reply is sent: what waited for it runs before the next request (the event
        log's appends: ``EventLog.settle``)."""
        self.event_log.settle()

    def events_stats(self) -> dict:
        """The event log's counters, and how far its readers are behind (the worst, in keys)."""
        live = self.attachments.sessions
        for gone in [s for s in self._readers if live.get(s.id) is not s]:
            del self._readers[gone]
        lags = [self.event_log.lag(*reader) for reader in self._readers.values()]
        return {**self.event_log.stats(), "readers": len(self._readers),
                "reader_lag_keys": max((lag for lag in lags if lag is not None), default=0)}

    # ------------------------------------------------------------------ what is going on
    def open_jobs(self) -> int:
        """Store and load jobs still open (the drain waits for them: copies in flight)."""
        return self.jobs.open_jobs()

    def eviction_pressure(self) -> tuple[int, int, int]:
        """(evictions so far, free pages, pages): what the server logs under pressure."""
        return self.index.counters["evictions"], self.index.pages.free_count, self.index.pages.total

    def stats(self) -> dict:
        """The store's part of ``replies.StatsReply``."""
        index, jobs = self.index, self.jobs
        counters = {name: index.counters[name] for name in INDEX_COUNTERS}
        counters.update({name: jobs.counters[name] for name in JOB_COUNTERS})
        tier = self.tier.stats()
        return {**index.stats(), **jobs.stats(), **self.leases.stats(), **self.holds.stats(), **self.fence.stats(),
                "engines": len(self.attachments.engines), "sessions": len(self.attachments.sessions),
                "session_roles": self.attachments.roles(), **counters, "tier": tier}

    def namespace_stats(self) -> list[dict]:
        return self.index.namespace_stats()

    def clients(self, watched: Callable[[Session], bool], now: float) -> list[dict]:
        """Every session, as ``kvtierctl clients`` shows it (``watched``: the registry's word on
        whether a pidfd watches it)."""
        out = []
        for s in self.attachments.sessions.values():
            leases, leased_keys = self.leases.of_session(s)
            out.append({"session": s.id, "engine": s.engine.id, "role": s.role, "rank": s.rank, "pid": s.pid,
                        "world_size": s.engine.world_size, "node_ranks": format_ranks(s.engine.node_ranks),
                        "namespace": s.engine.ns.id.name(),
                        "watched": watched(s), "attached_seconds": now - s.attached_at,
                        "leases": leases, "leased_keys": leased_keys})
        return out

    def verify(self) -> None:
        """Check the in-memory state against itself and the region's tables (tests)."""
        self.index.verify()
        self.leases.verify()
        self.holds.verify_holders(self.leases.held() + self.jobs.held())
        self.jobs.verify()
        self.writes.verify()
        self.attachments.verify(list(self.index.namespaces.values()))

    def shutdown(self) -> None:
        """Abort every open job and persist the access clock. Pages a writer may still copy into
        stay fenced in the region's tables, for the next daemon to recover."""
        for session in list(self.attachments.sessions.values()):
            self.detach(session, SessionEnd.DAEMON_STOPPED)
        self.tier.close()
        self.fence.close()
        self.index.persist_tick()


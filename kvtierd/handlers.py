"""What the daemon does for each request of the protocol: the client socket's ops (hello, bye,
ping, lookup, store, commit, load, unlease, release, abort, jobs, events, stats) and the admin socket's
(clients, evict, clear, stats, ping), each from (identity, session, request fields) to its
declared reply (``replies.REPLIES``, ``ADMIN_REPLIES``). No sockets and no loop: the server
(``kvtierd.server``) decodes a frame, calls the op's handler and encodes what it returns.

Hello is where a session begins. Who sent it comes from the kernel, not from its word: the
connection's credentials (SO_PEERCRED: uid, and the pid as the daemon's PID namespace sees it, 0
when it cannot) decide whether its session is watched through a pidfd, which process a writer
row records, and whether a pid claimed in the daemon's own PID namespace is true (``_process``).
A hello naming an earlier session and its token replaces it (its writer's pages are free: the
client waited for its copies); a process taking its own orphaned rank back ends the orphan.

While the daemon drains, new sessions, new jobs and new leases (a lease promises a load, a new
job) are refused with SHUTTING_DOWN; requests of jobs already open are served.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from .attachments import Session, SessionEnd
from .contract import protocol as P
from .contract.codes import ErrorCode, RequestError
from .contract.events import MAX_EVENT_KEYS
from .contract.namespace import NamespaceId, format_ranks
from .contract.replies import (AdminPingReply, ClientsReply, EmptyReply, EventsReply, EvictReply, HelloReply,
                               JobsReply, LoadReply, LookupReply, PingReply, Reply, StatsReply, StoreReply,
                               UnleaseReply, ok_reply)
from .peers import Conn
from .processes import Process, start_ticks
from .region import Region
from .sessions import SessionRegistry
from .store import Store

log = logging.getLogger(__name__)


class Later:
    """An admin reply sent when it is known: a handler returns it, the tier resolves it later."""

    def __init__(self, rid: int):
        self.rid = rid
        self.reply: dict | None = None
        self._send: Callable[[dict], None] | None = None

    def resolve(self, reply: Reply) -> None:
        self.reply = ok_reply(self.rid, reply)
        if self._send is not None:
            self._send(self.reply)

    def deliver_with(self, send: Callable[[dict], None]) -> None:
        self._send = send
        if self.reply is not None:
            send(self.reply)


class Handlers:
    """The ops' handlers: ``client`` (op → handler of (identity, session, msg); hello apart, as
    it needs the connection) and ``admin`` (op → handler of msg)."""

    def __init__(self, store: Store, region: Region, sessions: SessionRegistry, heartbeat_timeout: float,
                 stopping: Callable[[], bool], listening: Callable[[], bool], stats: Callable[[], StatsReply]):
        self.store = store
        self.region = region
        self.sessions = sessions
        self.heartbeat_timeout = heartbeat_timeout
        self._stopping = stopping           # the daemon drains
        self._listening = listening         # its sockets are bound (not so in unit tests)
        self.client: dict[str, Callable[[bytes, Session | None, dict], Reply]] = {
            "ping": self._ping, "bye": self._bye, "lookup": self._lookup,
            "store": self._store, "commit": self._commit, "load": self._load, "unlease": self._unlease,
            "release": self._release, "abort": self._abort, "jobs": self._jobs, "events": self._events,
            "stats": lambda identity, session, msg: stats(),
        }
        self.admin: dict[str, Callable[[dict], Reply | Later]] = {
            "stats": lambda msg: stats(), "ping": lambda msg: AdminPingReply(self.region.generation),
            "clients": self._clients, "evict": self._evict, "clear": self._clear,
        }

    # ------------------------------------------------------------------ sessions
    def _process(self, msg: dict, conn: Conn | None) -> Process:
        """Who sent this hello, as the kernel says (``conn``: its connection's peer credentials).
        A pid claimed in the daemon's own PID namespace must be the peer's."""
        claimed_pid, claimed_ns = msg.get("pid"), msg.get("pidns")
        uid, pid = (conn.uid, conn.pid) if conn is not None else (None, 0)
        if claimed_pid and claimed_ns == self.sessions.pidns and pid and claimed_pid != pid:
            raise RequestError(ErrorCode.BAD_REQUEST, f"hello claims pid {claimed_pid} in the daemon's PID namespace, "
                                                      f"but the socket's peer is pid {pid}")
        ticks = start_ticks(pid) if pid else 0
        if ticks is None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"pid {pid} does not exist in the daemon's namespace")
        return Process(pid, ticks, claimed_pid, claimed_ns, uid)

    def hello(self, identity: bytes, session: Session | None, msg: dict, conn: Conn | None = None) -> HelloReply:
        if not P.MIN_PROTOCOL_VERSION <= msg["version"] <= P.PROTOCOL_VERSION:
            raise RequestError(ErrorCode.VERSION, f"client speaks protocol {msg['version']}, this kvtierd speaks "
                                                  f"{P.MIN_PROTOCOL_VERSION}-{P.PROTOCOL_VERSION}; install matching "
                                                  "kvtierd versions")
        if self._stopping():
            raise RequestError(ErrorCode.SHUTTING_DOWN, "kvtierd is stopping")
        if conn is None and self._listening():
            raise RequestError(ErrorCode.LIMIT, "this connection was closed (by its peer, or past the settings "
                                                "max_connections, max_connections_per_peer): connect again later")
        process = self._process(msg, conn)
        if session is not None:
            self.sessions.end(session, SessionEnd.REHELLO)
        if "replaces" in msg:
            replaced = self.sessions.proven(msg["replaces"], msg.get("replaces_token"))
            if replaced is not None:
                self.sessions.end(replaced, SessionEnd.REATTACHED)
            else:       # dropped, or a session of the daemon before a restart: its writer's pages
                self.store.reattached(msg["replaces"], msg.get("replaces_token"))
        # Who may join the engine is checked before anything is ended for this hello.
        self.store.may_join(msg["engine"], process, msg.get("secret"))
        held = self.store.rank_holder(msg["engine"], msg["rank"])
        if held is not None and not held.process.same_as(process):
            held = None
        self.sessions.admit(conn, replacing=held)
        if held is not None:
            # An orphan of this very process (a Client dropped without close(), a hello whose
            # reply came too late): the process takes its rank back.
            self.sessions.end(held, SessionEnd.TAKEN_OVER)
        node_ranks = msg.get("node_ranks")            # absent (and from a version-5 client): the whole world
        ns_id = NamespaceId.from_wire(msg["namespace"], msg["world_size"], node_ranks or ())
        session = self.store.attach(msg["engine"], msg["rank"], msg["world_size"], ns_id, process,
                                    secret=msg.get("secret"), node_ranks=node_ranks)
        watched = self.sessions.register(identity, session, conn)
        token = session.token
        log.info("attach session=%d engine=%r %s world_size=%d node_ranks=%s pid=%s namespace=%s watched=%s%s",
                 session.id, session.engine.id, session.role, msg["world_size"],
                 format_ranks(session.engine.node_ranks), session.pid, ns_id.name(), watched,
                 "" if msg["version"] == P.PROTOCOL_VERSION else f" (outdated client: protocol {msg['version']})")
        ns = session.engine.ns
        geo = self.region.geometry
        return HelloReply(
            session=session.id, version=P.PROTOCOL_VERSION, daemon_pid=os.getpid(),
            region=self.region.paths.region, generation=self.region.generation,
            file_bytes=geo.data_bytes, page_size=geo.page_size, num_pages=geo.num_pages,
            data_offset=geo.data_offset, namespace=ns.id.name(), pages_per_shard=ns.pages_per_shard,
            writers=sorted(session.engine.writers), node_ranks=list(session.engine.node_ranks),
            job_timeout=self.store.job_timeout,
            watched=watched, token=token, heartbeat_interval=None if watched else self.heartbeat_timeout / 3,
            checksums=self.store.checksums)

    def _bye(self, identity: bytes, session: Session, msg: dict) -> EmptyReply:
        self.sessions.end(session, SessionEnd.LEFT)
        return EmptyReply()

    def _ping(self, identity: bytes, session: Session | None, msg: dict) -> PingReply:
        if "session" in msg:       # a heartbeat for a session, possibly from another socket
            if not self.sessions.heartbeat(msg["session"], msg.get("token")):
                raise RequestError(ErrorCode.NOT_ATTACHED, f"no session {msg['session']} with that token")
            return PingReply(self.region.generation, True)
        return PingReply(self.region.generation, session is not None)

    # ------------------------------------------------------------------ data ops
    def _refuse_if_stopping(self, session: Session, job: int) -> None:
        """While draining, requests of open jobs are served; new jobs are refused."""
        if self._stopping() and job not in session.engine.jobs:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "kvtierd is stopping; no new jobs")

    def _lookup(self, identity: bytes, session: Session, msg: dict) -> LookupReply:
        keys = msg["keys"]
        if "lease" not in msg:
            hits = self.store.lookup(session, keys)
            return LookupReply(hits, None, 0, 0, self.store.pending(session, keys, hits))
        if self._stopping():      # a lease promises a load, a new job, which a stopping daemon refuses
            raise RequestError(ErrorCode.SHUTTING_DOWN, "kvtierd is stopping; no new leases")
        ttl = msg["ttl_ms"] / 1000 if "ttl_ms" in msg else None
        found = self.store.lease(session, msg["lease"], keys, ttl)
        return LookupReply(found.hits, found.lease, found.leased, round(found.ttl * 1000),
                           self.store.pending(session, keys, found.hits))

    def _unlease(self, identity: bytes, session: Session, msg: dict) -> UnleaseReply:
        return UnleaseReply(self.store.unlease(session, msg["leases"]))

    def _store(self, identity: bytes, session: Session, msg: dict) -> StoreReply:
        self._refuse_if_stopping(session, msg["job"])
        outcomes, pages = self.store.store(session, msg["job"], msg["keys"], msg.get("chain", True),
                                           min(msg.get("cold_tail", 0), len(msg["keys"])))
        return StoreReply(outcomes, pages)

    def _commit(self, identity: bytes, session: Session, msg: dict) -> EmptyReply:
        self.store.commit(session, msg["job"], msg["ok"], msg.get("checksums"))
        return EmptyReply()

    def _load(self, identity: bytes, session: Session, msg: dict) -> LoadReply:
        self._refuse_if_stopping(session, msg["job"])
        hits, pages = self.store.load(session, msg["job"], msg["keys"], msg.get("lease"))
        return LoadReply(hits, pages)

    def _release(self, identity: bytes, session: Session, msg: dict) -> EmptyReply:
        self.store.release(session, msg["job"])
        return EmptyReply()

    def _abort(self, identity: bytes, session: Session, msg: dict) -> EmptyReply:
        self.store.abort(session, msg["job"])
        return EmptyReply()

    def _jobs(self, identity: bytes, session: Session, msg: dict) -> JobsReply:
        return JobsReply(self.store.job_states(session, msg["jobs"]))

    def _events(self, identity: bytes, session: Session, msg: dict) -> EventsReply:
        read = self.store.events(session, msg.get("epoch"), msg.get("cursor"), msg.get("snapshot_from"),
                                 msg.get("max_keys", MAX_EVENT_KEYS))
        return EventsReply(**read.to_wire())

    # ------------------------------------------------------------------ admin ops
    def _clients(self, msg: dict) -> ClientsReply:
        return ClientsReply(self.store.clients(self.sessions.watched, time.monotonic()))

    def _evict(self, msg: dict) -> EvictReply:
        # Local only: the second tier keeps its copies (a later lookup promotes them again).
        done = self.store.evict(msg.get("namespace"), msg["count"])
        return EvictReply(done.evicted, done.skipped_leased, done.revoked_leases,
                          self.store.tier.local_evict, None)

    def _clear(self, msg: dict) -> Later:
        """Every evictable entry of the namespace(s) goes (leased ones too with ``force``); then the
        second tier is cleared of them."""
        done = self.store.evict(msg.get("namespace"), None, msg.get("force", False))
        later = Later(msg.get("rid", 0))
        self.store.clear_tier(msg.get("namespace"), lambda tier, removed: later.resolve(
            EvictReply(done.evicted, done.skipped_leased, done.revoked_leases, tier, removed)))
        return later

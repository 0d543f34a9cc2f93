"""Sessions: a client's attachment in the daemon, and the registry that knows who speaks for it
and whether its process still lives.

A ``Session`` is one attached client: a rank of an engine (copies and votes) or the engine's
coordinator (rank None: looks up and opens jobs). The store creates sessions (``Store.attach``)
and ends their part in jobs (``Store.detach``); the ``SessionRegistry`` ties each to the ZMQ
routing identity it speaks from, the token that proves it in heartbeats and re-attaches, and its
liveness:

- A client whose process the daemon can see (its pid from the socket's peer credentials is not
  0: the daemon's PID namespace or a child of it; ``kvtierd.processes``) is watched through a
  pidfd, which becomes readable the moment the process dies (``died``); its session then ends as
  if it had said ``bye``: jobs still waiting for that rank abort, its pins drop (invariant 6).
- A client the daemon cannot see (pid 0: a sibling PID namespace, another pod) must prove it is
  alive: any request, or a heartbeat (``ping`` with the session id and the token from its hello
  reply, sent from any socket), at least every ``heartbeat_timeout`` seconds; otherwise ``sweep``
  ends it. A lost heartbeat ends the session's rights (votes, pins), not its writer's fence: the
  store keeps the pages it may still copy into fenced (``kvtierd.fence``).

``sweep`` also persists every attached writer's last proof of life (``Fence.stamp``), so that a
restarted daemon counts the grace of a writer it cannot watch from it.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .contract.protocol import ErrorCode, RequestError
from .processes import Process, own_pid_namespace

if TYPE_CHECKING:
    from .fence import Fence, Writer
    from .jobs import Engine

log = logging.getLogger(__name__)


class SessionEnd(str, enum.Enum):
    """How a session ended; a rank that ends before it voted aborts the job with ``rank_<end>``."""

    LEFT = "left"                       # bye
    DIED = "died"                       # its pidfd said the process died
    HEARTBEAT_LOST = "heartbeat_lost"   # no request nor heartbeat for heartbeat_timeout
    REHELLO = "rehello"                 # the same socket said hello again
    REATTACHED = "reattached"           # a new hello replaced it, proving it with its token
    TAKEN_OVER = "taken_over"           # the same process attached as the same rank again (an orphan)
    DEAD_AT_HELLO = "dead_at_hello"     # its pid was gone by the time of its hello
    DAEMON_STOPPED = "daemon_stopped"


@dataclass(eq=False)
class Session:
    id: int
    engine: "Engine"
    rank: int | None            # None: a coordinator (the engine's scheduler process)
    token: int = 0              # proves the session in heartbeats and in a later hello's ``replaces``
    process: Process = Process()
    writer: "Writer | None" = None   # its row in the fence (writer ranks)
    attached_at: float = field(default_factory=time.monotonic)

    @property
    def role(self) -> str:
        return "coordinator" if self.rank is None else f"rank {self.rank}"

    @property
    def pid(self) -> int | None:
        """The pid the daemon sees, else the one the client claimed (for people to read)."""
        return self.process.pid or self.process.claimed_pid


@dataclass(eq=False)
class _Link:
    session: Session
    identity: bytes
    pidfd: int | None


class SessionRegistry:
    """ZMQ identity ↔ session, tokens, pidfds and heartbeats of the attached sessions.

    ``end`` (the store's detach) is called once for every session the registry ends; ``watch``
    and ``unwatch`` add a pidfd to the server's poller and take it out again.
    """

    def __init__(self, end: Callable[[Session, SessionEnd, float], None], heartbeat_timeout: float = 15.0,
                 watch: Callable[[int], None] = lambda fd: None, unwatch: Callable[[int], None] = lambda fd: None,
                 pidns: int | None = None, clock: Callable[[], float] = time.monotonic,
                 fence: "Fence | None" = None):
        self._end = end
        self.heartbeat_timeout = heartbeat_timeout
        self._watch, self._unwatch = watch, unwatch
        self.pidns = own_pid_namespace() if pidns is None else pidns
        self.clock = clock
        self.fence = fence
        self._by_identity: dict[bytes, _Link] = {}
        self._by_id: dict[int, _Link] = {}
        self.pidfds: dict[int, Session] = {}            # pidfd → the session it watches
        self.heartbeats: dict[int, float] = {}          # unwatched session id → when it last proved alive

    def __len__(self) -> int:
        return len(self._by_id)

    def session_of(self, identity: bytes) -> Session | None:
        """The session speaking from this identity, if any; a request proves it alive."""
        link = self._by_identity.get(identity)
        if link is None:
            return None
        if link.session.id in self.heartbeats:
            self.heartbeats[link.session.id] = self.clock()
        return link.session

    def proven(self, session_id: int | None, token: int | None) -> Session | None:
        """The session with this id, if ``token`` is its token (a heartbeat, or a hello replacing it)."""
        link = self._by_id.get(session_id)
        return link.session if link is not None and link.session.token == token else None

    def register(self, identity: bytes, session: Session) -> bool:
        """Tie a new session to its identity and watch it. Returns whether a pidfd watches it.

        A process the daemon can see (``session.process.pid``) is watched through a pidfd; if it
        no longer exists the session ends at once and BAD_REQUEST is raised. Any other session
        owes heartbeats.
        """
        link = _Link(session, identity, None)
        self._by_identity[identity] = link
        self._by_id[session.id] = link
        pid = session.process.pid
        if pid:
            try:
                link.pidfd = os.pidfd_open(pid)
            except OSError:
                self.end(session, SessionEnd.DEAD_AT_HELLO)
                raise RequestError(ErrorCode.BAD_REQUEST, f"pid {pid} does not exist in the daemon's namespace")
            self.pidfds[link.pidfd] = session
            self._watch(link.pidfd)
        else:
            self.heartbeats[session.id] = self.clock()
        return link.pidfd is not None

    def heartbeat(self, session_id: int, token: int | None) -> bool:
        """A heartbeat for a session, from any socket: False when no session has that id and token."""
        if self.proven(session_id, token) is None:
            return False
        if session_id in self.heartbeats:
            self.heartbeats[session_id] = self.clock()
        return True

    def watched(self, session: Session) -> bool:
        link = self._by_id.get(session.id)
        return link is not None and link.pidfd is not None

    def end(self, session: Session, cause: SessionEnd) -> None:
        """End a session: forget its identity, token and watch, then the store detaches it (told
        when the session last proved alive)."""
        link = self._by_id.pop(session.id, None)
        if link is not None:
            self._by_identity.pop(link.identity, None)
            if link.pidfd is not None:
                self._unwatch(link.pidfd)
                os.close(link.pidfd)
                del self.pidfds[link.pidfd]
        seen = self.heartbeats.pop(session.id, None)
        self._end(session, cause, self.clock() if seen is None else seen)
        log.info("detach session=%d engine=%r %s cause=%s", session.id, session.engine.id, session.role, cause.value)

    def died(self, pidfd: int) -> None:
        """The pidfd became readable: its process died."""
        session = self.pidfds[pidfd]
        log.warning("client pid %s (%s of engine %r) died; ending its session",
                    session.pid, session.role, session.engine.id)
        self.end(session, SessionEnd.DIED)

    def sweep(self, now: float) -> None:
        """End the unwatched sessions that sent nothing for longer than heartbeat_timeout, and
        persist every attached writer's last proof of life (now, for a watched one)."""
        for session_id, seen in list(self.heartbeats.items()):
            if now - seen > self.heartbeat_timeout:
                session = self._by_id[session_id].session
                log.warning("client pid %s (%s of engine %r) sent nothing for %.1fs; ending its session",
                            session.pid, session.role, session.engine.id, now - seen)
                self.end(session, SessionEnd.HEARTBEAT_LOST)
        if self.fence is not None:
            self.fence.stamp([(link.session.writer, self.heartbeats.get(session_id, now))
                              for session_id, link in self._by_id.items() if link.session.writer is not None])

    def close(self) -> None:
        """End every session (the daemon stops)."""
        for link in list(self._by_id.values()):
            self.end(link.session, SessionEnd.DAEMON_STOPPED)

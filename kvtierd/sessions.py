"""Sessions' liveness: the registry that knows who speaks for a session and whether its process
still lives.

Sessions themselves are ``kvtierd.attachments``' (the store creates them, ``Store.attach``, and
ends their part in jobs, ``Store.detach``); the ``SessionRegistry`` ties each to the ZMQ routing
identity it speaks from, the token that proves it in heartbeats and re-attaches, and its
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

A session is tied to the connection it said hello on (``peers.Conn``, whose credentials are
the kernel's: where its process comes from, as above): when that connection ends, the session
ends (``disconnected``), so a session cannot outlive its socket, whatever pid it claimed; a
request under the session's routing identity from any other connection is not the session's.
A connection's end is not a proof that the process stopped writing: like a lost heartbeat, it
ends the session's rights, not its writer's fence. The table is bounded: at most
``max_sessions`` sessions, and ``max_sessions_per_peer`` from one peer (``admit``; a process
taking over its own orphaned session replaces it, it does not count twice).

``sweep`` also persists every attached writer's last proof of life (``Fence.stamp``), so that a
restarted daemon counts the grace of a writer it cannot watch from it.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from .attachments import Session, SessionEnd
from .contract.codes import ErrorCode, RequestError
from .fence import Fence
from .peers import Conn
from .processes import own_pid_namespace

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Link:
    session: Session
    identity: bytes
    pidfd: int | None
    conn: "Conn | None"          # the connection it said hello on (None: no socket, as in unit tests)


# pidfd_open failing for want of descriptors or memory says nothing about the process: such a
# session is not watched (it owes heartbeats) rather than refused as dead.
_CANNOT_WATCH = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
DISCONNECT_GRACE = 1.0     # seconds a watched session outlives its connection, for its pidfd to tell a death


def readable(fd: int) -> bool:
    """Whether ``fd`` (a pidfd: its process died) is readable now, without waiting. poll, not
    select: select() takes no descriptor past 1,023, and the daemon holds thousands (issue 26 C)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class SessionRegistry:
    """ZMQ identity ↔ session, tokens, pidfds and heartbeats of the attached sessions.

    ``end`` (the store's detach) is called once for every session the registry ends; ``watch``
    and ``unwatch`` add a pidfd to the server's poller and take it out again.
    """

    def __init__(self, end: Callable[[Session, SessionEnd, float], None], heartbeat_timeout: float = 15.0,
                 watch: Callable[[int], None] = lambda fd: None, unwatch: Callable[[int], None] = lambda fd: None,
                 pidns: int | None = None, clock: Callable[[], float] = time.monotonic,
                 fence: "Fence | None" = None, max_sessions: int = 2048, max_sessions_per_peer: int = 128):
        self._end = end
        self.heartbeat_timeout = heartbeat_timeout
        self._watch, self._unwatch = watch, unwatch
        self.pidns = own_pid_namespace() if pidns is None else pidns
        self.clock = clock
        self.fence = fence
        self.max_sessions = max_sessions
        self.max_sessions_per_peer = max_sessions_per_peer
        self._by_identity: dict[bytes, _Link] = {}
        self._by_id: dict[int, _Link] = {}
        self._by_conn: dict[int, list[_Link]] = {}      # connection serial → the sessions tied to it
        self.per_peer: Counter = Counter()               # peer → its sessions
        self.pidfds: dict[int, Session] = {}            # pidfd → the session it watches
        self.heartbeats: dict[int, float] = {}          # unwatched session id → when it last proved alive
        self.disconnected_at: dict[int, float] = {}     # watched session id → when its connection ended

    def __len__(self) -> int:
        return len(self._by_id)

    def session_of(self, identity: bytes, conn: "Conn | None" = None) -> Session | None:
        """The session speaking from this identity on this connection, if any; a request proves it
        alive. The same routing identity on another connection (a client may choose its own) is not it."""
        link = self._by_identity.get(identity)
        if link is None or link.conn is not conn:
            return None
        if link.session.id in self.heartbeats:
            self.heartbeats[link.session.id] = self.clock()
        return link.session

    def admit(self, conn: "Conn | None", replacing: Session | None = None) -> None:
        """Raise LIMIT when a new session (from ``conn``'s peer) would exceed the table's bounds.
        ``replacing``: a session the new one takes the place of (an orphan of the same process),
        which is not counted."""
        link = self._by_id.get(replacing.id) if replacing is not None else None
        total = len(self._by_id) - (link is not None)
        if total >= self.max_sessions:
            raise RequestError(ErrorCode.LIMIT, f"kvtierd holds its maximum of {self.max_sessions} sessions "
                                                "(setting max_sessions)")
        if conn is None:
            return
        mine = self.per_peer[conn.peer] - (link is not None and link.conn is not None and link.conn.peer == conn.peer)
        if mine >= self.max_sessions_per_peer:
            raise RequestError(ErrorCode.LIMIT, f"{conn.describe()} already holds {self.max_sessions_per_peer} "
                                                "sessions (setting max_sessions_per_peer)")

    def proven(self, session_id: int | None, token: int | None) -> Session | None:
        """The session with this id, if ``token`` is its token (a heartbeat, or a hello replacing it)."""
        link = self._by_id.get(session_id)
        return link.session if link is not None and link.session.token == token else None

    def register(self, identity: bytes, session: Session, conn: "Conn | None" = None) -> bool:
        """Tie a new session to its identity and connection and watch it. Returns whether a pidfd
        watches it.

        A process the daemon can see (``session.process.pid``, the kernel's word) is watched
        through a pidfd; if it no longer exists the session ends at once and BAD_REQUEST is
        raised. Any other session owes heartbeats, as does one whose pidfd could not be opened
        for want of descriptors (EMFILE).
        """
        link = _Link(session, identity, None, conn)
        self._by_identity[identity] = link
        self._by_id[session.id] = link
        if conn is not None:
            self._by_conn.setdefault(conn.serial, []).append(link)
            self.per_peer[conn.peer] += 1
        pid = session.process.pid
        if pid:
            try:
                link.pidfd = os.pidfd_open(pid)
            except OSError as exc:
                if exc.errno not in _CANNOT_WATCH:
                    self.end(session, SessionEnd.DEAD_AT_HELLO)
                    raise RequestError(ErrorCode.BAD_REQUEST,
                                       f"pid {pid} does not exist in the daemon's namespace") from None
                log.warning("cannot watch pid %d (%s): its session owes heartbeats", pid, exc.strerror)
            except Exception:             # a pid the kernel cannot take (the protocol bounds it): no session
                self.end(session, SessionEnd.DEAD_AT_HELLO)
                raise
        if link.pidfd is not None:
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
            if self._by_identity.get(link.identity) is link:
                del self._by_identity[link.identity]
            if link.conn is not None:
                tied = self._by_conn[link.conn.serial]
                tied.remove(link)
                if not tied:
                    del self._by_conn[link.conn.serial]
                self.per_peer[link.conn.peer] -= 1
                if not self.per_peer[link.conn.peer]:
                    del self.per_peer[link.conn.peer]
            if link.pidfd is not None:
                self._unwatch(link.pidfd)
                os.close(link.pidfd)
                del self.pidfds[link.pidfd]
        seen = self.heartbeats.pop(session.id, None)
        self.disconnected_at.pop(session.id, None)
        self._end(session, cause, self.clock() if seen is None else seen)
        log.info("detach session=%d engine=%r %s cause=%s", session.id, session.engine.id, session.role, cause.value)

    def disconnected(self, conn: "Conn") -> None:
        """The connection ``conn`` ended: the sessions tied to it end too. A process that dies
        closes its sockets a moment before its pidfd says so: a watched session whose process
        still runs is given DISCONNECT_GRACE for its pidfd to tell (``died``), and ends as
        DISCONNECTED after it (``sweep``); its routing identity is gone at once."""
        for link in list(self._by_conn.get(conn.serial, ())):
            if link.pidfd is None:
                self.end(link.session, SessionEnd.DISCONNECTED)
            elif readable(link.pidfd):
                self.died(link.pidfd)
            else:
                self._by_identity.pop(link.identity, None)
                self.disconnected_at[link.session.id] = self.clock()

    def died(self, pidfd: int) -> None:
        """The pidfd became readable: its process died."""
        session = self.pidfds[pidfd]
        log.warning("client pid %s (%s of engine %r) died; ending its session",
                    session.pid, session.role, session.engine.id)
        self.end(session, SessionEnd.DIED)

    def sweep(self, now: float) -> None:
        """End the unwatched sessions that sent nothing for longer than heartbeat_timeout and the
        watched ones whose connection ended more than DISCONNECT_GRACE ago, and persist every
        attached writer's last proof of life (now, for a watched one)."""
        for session_id, gone in list(self.disconnected_at.items()):
            if now - gone > DISCONNECT_GRACE:
                self.end(self._by_id[session_id].session, SessionEnd.DISCONNECTED)
        for session_id, seen in list(self.heartbeats.items()):
            if now - seen > self.heartbeat_timeout:
                session = self._by_id[session_id].session
                log.warning("client pid %s (%s of engine %r) sent nothing for %.1fs; ending its session",
                            session.pid, session.role, session.engine.id, now - seen)
                self.end(session, SessionEnd.HEARTBEAT_LOST)
        if self.fence is not None:
            self.fence.stamp([(link.session.writer, self.heartbeats.get(session_id, now))
                              for session_id, link in self._by_id.items() if link.session.writer is not None])

    def close(self, cause: SessionEnd = SessionEnd.DAEMON_STOPPED) -> None:
        """End every session (the daemon stops, or its data file is replaced)."""
        for link in list(self._by_id.values()):
            self.end(link.session, cause)

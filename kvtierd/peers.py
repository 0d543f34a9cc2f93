"""The client socket's connections: who is on the other end, how many each peer holds, when one goes.

ZMQ hides its connections from the socket's user, but a socket monitor reports each accepted
connection with its file descriptor, and the kernel tells who holds the other end of a unix
socket (SO_PEERCRED: pid, uid, gid, as of connect). ``Connections`` reads the monitor's events on
the loop thread:

- ACCEPTED: the peer's credentials are read (on a duplicate of ZMQ's descriptor, which stays
  ZMQ's) and the connection is counted. Past ``max_total`` connections in all, or past
  ``max_per_peer`` from one peer, it is shut down at once (ZMQ then closes its descriptor): an
  attacker cannot run the daemon out of file descriptors, and one peer cannot take every slot.
- DISCONNECTED: the connection is forgotten and ``on_close`` runs (the server ends the sessions
  attached through it: a session whose socket is gone cannot be spoken for any more).

A *peer* is a process: (uid, pid) when the daemon sees the peer's pid, else (uid, 0) — every
process of that uid in PID namespaces the daemon cannot see (other pods) is one peer.

Every message read from the client socket carries the descriptor it came in on (ZMQ_SRCFD) and
its connection's credentials (the "Peer-Address" property, ``localhost:<uid>:<gid>:<pid>``), so
the server knows the connection of every request (``of``). The monitor's events arrive on their
own queue; ZMQ emits ACCEPTED before a connection's first message can arrive and DISCONNECTED
before it closes the descriptor, so draining the monitor before each burst of requests, and again
before a hello (``of(frame, fresh=True)``), keeps the two in step. One ambiguity is left: a
message still queued from a connection that ended may be read after its descriptor was reused by
a new connection. For a hello, whose session is tied to the connection, the message's own
credentials must then match the new connection's (else the hello is refused: its sender is gone);
a session so tied to a later connection of the same peer ends when that one does. The monitor's
queue is unbounded (RCVHWM 0): an event that ZMQ dropped would leave a connection uncounted.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import zmq

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_CRED = struct.Struct("3i")     # struct ucred: pid, uid, gid


class Cap(str, enum.Enum):
    """The cap a connection was refused past (kvtierd_connections_refused_total's ``cap``)."""

    TOTAL = "total"             # max_connections
    PER_PEER = "per_peer"       # max_connections_per_peer


@dataclass(eq=False)
class Conn:
    """One accepted connection of the client socket and the credentials of its peer."""

    serial: int                 # unique for the daemon's life (descriptors are reused)
    fd: int
    pid: int                    # in the daemon's PID namespace; 0 when the peer's is not visible
    uid: int
    gid: int

    @property
    def peer(self) -> tuple[int, int]:
        return (self.uid, self.pid)

    def describe(self) -> str:
        return f"uid {self.uid} pid {self.pid or '(not visible)'}"


def peer_credentials(fd: int) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of unix socket ``fd``; None when ``fd`` is
    no longer a connected unix socket. Works on a duplicate: the descriptor stays ZMQ's."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.family != socket.AF_UNIX:
                return None
            return _CRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return None


def shut_down(fd: int) -> None:
    """End the connection on ``fd`` (ZMQ sees the end and closes its descriptor)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass                    # already gone


class Connections:
    def __init__(self, max_total: int, max_per_peer: int, on_close: Callable[[Conn], None] = lambda conn: None):
        self.max_total = max_total
        self.max_per_peer = max_per_peer
        self._on_close = on_close
        self.by_fd: dict[int, Conn] = {}
        self.per_peer: Counter = Counter()
        self.refused: Counter = Counter()     # Cap value → connections shut down at once past it
        self._serial = 0
        self.monitor: zmq.Socket | None = None

    def __len__(self) -> int:
        return len(self.by_fd)

    def watch(self, sock: zmq.Socket) -> zmq.Socket:
        """Start the monitor of ``sock`` (before it binds); returns the socket to poll for events."""
        address = f"inproc://kvtierd-connections-{id(self)}"
        sock.monitor(address, _EVENTS)
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)     # before connecting: the inproc pipe is then unbounded
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(address)
        return self.monitor

    def poll(self) -> None:
        """Handle every event the monitor has queued (a connection's end after its start)."""
        if self.monitor is None:
            return
        events: list[tuple[int, int]] = []
        while True:
            try:
                head, _endpoint = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event, fd = struct.unpack("=Hi", head[:6])
            events.append((event, fd))
        for i, (event, fd) in enumerate(events):
            if event == zmq.EVENT_ACCEPTED:
                # Already ended again (the end is queued behind it): its descriptor may be another's now.
                gone = any(e == zmq.EVENT_DISCONNECTED and f == fd for e, f in events[i + 1:])
                self._accepted(fd, gone)
            elif event == zmq.EVENT_DISCONNECTED:
                self._disconnected(fd)

    def of(self, frame: zmq.Frame | None, fresh: bool = False) -> Conn | None:
        """The connection ``frame`` came in on; None when it is not (or no longer) a counted one.
        ``fresh`` (a hello): read the monitor's queue first, and check the frame's own
        credentials against the connection's."""
        if frame is None:
            return None
        if fresh:
            self.poll()
        conn = self.by_fd.get(frame.get(zmq.SRCFD))
        if fresh and conn is not None:
            try:
                uid, gid, pid = map(int, frame.get("Peer-Address").rsplit(":", 3)[1:])
            except (ValueError, zmq.ZMQError):
                return None
            if (pid, uid, gid) != (conn.pid, conn.uid, conn.gid):
                return None               # sent on an ended connection whose descriptor is another's now
        return conn

    def _accepted(self, fd: int, gone: bool) -> None:
        if fd in self.by_fd:              # its end was never reported: the descriptor was reused
            self._disconnected(fd)
        if gone:
            return
        cred = peer_credentials(fd)
        if cred is None:
            return
        pid, uid, gid = cred
        self._serial += 1
        conn = Conn(self._serial, fd, pid, uid, gid)
        if len(self.by_fd) >= self.max_total:
            self._refuse(conn, Cap.TOTAL, f"kvtierd holds its maximum of {self.max_total} connections "
                                        "(setting max_connections)")
        elif self.per_peer[conn.peer] >= self.max_per_peer:
            self._refuse(conn, Cap.PER_PEER, f"{conn.describe()} already holds {self.max_per_peer} connections "
                                           "(setting max_connections_per_peer)")
        else:
            self.by_fd[fd] = conn
            self.per_peer[conn.peer] += 1

    def _refuse(self, conn: Conn, cap: Cap, message: str) -> None:
        why = cap.value
        if not self.refused[why] & (self.refused[why] - 1):    # log the 1st, 2nd, 4th, 8th, ... refusal
            log.warning("refusing a connection: %s (%d refused so far)", message, self.refused[why] + 1)
        self.refused[why] += 1
        shut_down(conn.fd)

    def _disconnected(self, fd: int) -> None:
        conn = self.by_fd.pop(fd, None)
        if conn is None:
            return                        # a refused connection
        self.per_peer[conn.peer] -= 1
        if not self.per_peer[conn.peer]:
            del self.per_peer[conn.peer]
        self._on_close(conn)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None

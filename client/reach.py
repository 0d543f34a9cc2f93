"""Whether kvtierd serves: when a session that lost it tries again (the one reachability policy of
the client library and of the engine adapters).

A session loses kvtierd when a request goes unanswered, its connection closes, or the daemon says
``SHUTTING_DOWN``. Whatever the cause — ``systemctl restart`` (SIGTERM), an upgrade, a crash and
``Restart=on-failure`` — a daemon that starts binds its socket afresh (it removes a dead daemon's
file first), so **the socket path holding another socket than the one that failed us** means "a
daemon serves there now": try again at once. ``SocketWatch`` keeps the identity (device, inode,
change time) of the socket a session last tried and says when the path ``moved`` on; looking is
one ``stat`` (about 2 µs). Without a move, the same daemon is there or none: a hung daemon may
resume and a refusal may lift, so trying again is still due after a pause.

``Away`` is "kvtierd is away: serve misses, then attach again" for an engine adapter's sessions
(the vLLM link thread and workers, the SGLang backend): after a loss nothing is asked of kvtierd
until the socket moved or ``retry_s`` passed. The link thread looks every ``POLL_S`` while away;
workers and the backend look when the engine calls them. ``kvtier.Client`` waits on its own
``SocketWatch`` while it re-attaches.

Why a watch and not a notice from the daemon: systemd sends SIGTERM both to restart and to stop,
so a stopping daemon cannot know that another follows, and a killed one says nothing; what every
restart has in common is the new socket. Why a ``stat`` every 10 ms and not inotify: the waits it
sits in (the link thread's queue, an engine's own call) cannot also wait on a file descriptor;
inotify would need libc through ctypes and misses a directory replaced wholesale; and 100 stats a
second cost about 0.02 % of a core per waiting session, and only while kvtierd is away.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from kvtierd.contract.errors import DaemonUnavailable, NotAttached, ShuttingDown

# How often a waiting session looks at the socket path: a restarted daemon is noticed within this.
POLL_S = 0.01

# What says kvtierd is away (no answer, the session unknown, the daemon stopping), as opposed to a
# refusal of one request.
AWAY_ERRORS = (DaemonUnavailable, NotAttached, ShuttingDown)

Identity = tuple[int, int, int]


def socket_identity(path: str) -> Identity | None:
    """(device, inode, change time in ns) of the file at ``path``; None when there is none. The
    change time tells apart two sockets that got the same inode number (ext4 reuses them)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class SocketWatch:
    """The daemon's socket path as one session knows it: which socket it last tried."""

    def __init__(self, path: str):
        self.path = path
        self.known = socket_identity(path)

    def look(self) -> Identity | None:
        return socket_identity(self.path)

    def know(self, identity: Identity | None) -> None:
        """``identity`` is the socket this session tried last (it served it, or it failed it)."""
        self.known = identity

    def moved(self) -> bool:
        """Whether a socket other than the known one is at the path now (a daemon bound it since)."""
        now = socket_identity(self.path)
        return now is not None and now != self.known

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the socket to move; True as soon as it did."""
        deadline = time.monotonic() + timeout
        while not self.moved():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(POLL_S, left))
        return True


class Away:
    """Whether an engine adapter may ask kvtierd now (see the module docstring).

    ``lost(exc)`` when a request or an attempt found kvtierd away (``tried``: the socket identity
    looked at before that attempt), ``due()`` before asking again, ``back()`` once attached or
    answered. One warning per outage says what the engine does meanwhile (``meanwhile``)."""

    def __init__(self, socket_path: str, retry_s: float, what: str, meanwhile: str, logger: logging.Logger,
                 clock: Callable[[], float] = time.monotonic):
        self.watch = SocketWatch(socket_path)
        self.retry_s = retry_s
        self.what = what                  # who is away, for the log: "rank 1 of engine e", ...
        self.meanwhile = meanwhile        # what the engine does while away, for the log
        self._log = logger
        self._clock = clock
        self.down = False
        self.since = 0.0                  # when this outage began
        self._until = 0.0                 # when trying again is due without a move

    def look(self) -> Identity | None:
        """The socket's identity now: take it before an attempt and hand it to ``lost``."""
        return self.watch.look()

    def due(self) -> bool:
        """Whether to ask kvtierd now: not away, a daemon bound the socket since, or ``retry_s`` passed."""
        return not self.down or self._clock() >= self._until or self.watch.moved()

    def lost(self, exc: BaseException, tried: Identity | None | bool = False) -> None:
        """kvtierd is away: ask nothing until the socket moves from ``tried`` (default: the socket
        there now) or ``retry_s`` passed."""
        self.watch.know(self.watch.look() if tried is False else tried)
        now = self._clock()
        self._until = now + self.retry_s
        if self.down:
            return
        self.down, self.since = True, now
        level = logging.WARNING if isinstance(exc, AWAY_ERRORS) else logging.ERROR
        self._log.log(level, "kvtier: %s: kvtierd unreachable (%s); %s, and attaches again as soon as kvtierd "
                      "serves again (its socket reappears), else in %gs", self.what, exc, self.meanwhile, self.retry_s)

    def back(self) -> None:
        """Attached (or answered) again: through the socket there now."""
        self.watch.know(self.watch.look())
        if self.down:
            self.down = False
            self._log.info("kvtier: %s: attached to kvtierd again after %.3fs away", self.what,
                           self._clock() - self.since)

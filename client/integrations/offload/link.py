"""The scheduler's line to kvtierd: one thread that owns the coordinator session.

An engine's scheduler thread must never wait on kvtierd longer than it chooses to, so it never
touches a socket. A ``Link`` thread owns the coordinator ``Client``: it attaches, and re-attaches
the same ``Client`` after kvtierd went away (so that the client leases again what its old session
held). The scheduler hands it work through a queue (``submit``: a ``Future`` it may wait on with
its own bound; ``send``: fire and forget) and reads three plain attributes the thread alone
writes:

- ``up``: attached and the connection stands. While False the scheduler does no I/O.
- ``replies``: how many answers the thread has had; a scheduler that gave up waiting remembers
  the count and waits again only once it moved (a hung daemon costs one wait, not one per call).
- ``epoch``: the client's count of attachments (``Client.attachments``) as last seen; it moves
  when the session is new (a daemon restart), which ends what the old one held (leases).

A daemon that stops or dies closes its end of the IPC connection; the thread watches for that (a
ZMQ socket monitor, checked every ``WATCH_INTERVAL_S`` while idle, and the daemon's socket path,
which a stopped daemon removes and a restarted one binds anew) and marks the link down at once,
where a request would only find out after ``kvtier_timeout_s``. While down it answers every
queued call with ``DaemonUnavailable`` and looks at the daemon's socket path every
``kvtier.reach.POLL_S``: it attaches again as soon as a daemon bound it anew (a restart, planned
or not), else after ``retry_s`` (``kvtier.reach.Away``). Its client makes one attempt per
re-attach (``reconnect_timeout`` 0): the pacing is the link's.

The thread never takes the engine's locks (vLLM's ``manager.lock`` is held for a whole
``schedule()``), and the scheduler never blocks on the thread except in a ``Future``'s wait.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtierd.contract.errors import DaemonUnavailable, KvtierError

from ...reach import AWAY_ERRORS, POLL_S, Away
from ...session import Client

logger = logging.getLogger("vllm.kvtier")

# How often an idle link thread looks for a dropped connection (measured: a killed kvtierd's
# disconnect shows within microseconds; a request to it fails only after kvtier_timeout_s).
WATCH_INTERVAL_S = 0.05

# Errors after which the session is gone: the link drops it and attaches afresh.
LOST = AWAY_ERRORS

_STOP = object()


class Link:
    """The thread that owns the coordinator session (see the module docstring).

    ``connect()`` builds the coordinator ``Client``; ``socket_path`` is the daemon's socket it
    watches while away; ``what`` names the session in log lines."""

    def __init__(self, connect: Callable[[], Client], socket_path: str, retry_s: float, what: str,
                 first_wait_s: float):
        self._connect = connect
        self.what = what                      # for log lines: "coordinator of engine X at <socket>"
        self.up = False
        self.replies = 0
        self.epoch = 0
        self.requests = 0                     # requests sent to kvtierd (the thread counts them)
        self.client: Client | None = None     # the link thread's; others only read it for logging
        self._away = Away(socket_path, retry_s, what, "the engine serves without it (every lookup a miss, "
                          "nothing stored)", logger)
        self._watch: zmq.Socket | None = None
        self._watched = None                  # the client's channel that _watch watches
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._first = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-link", daemon=True)
        self._thread.start()
        self._first.wait(first_wait_s)        # start-up only: the first attempt, bounded

    # --- the scheduler's side
    def submit(self, fn: Callable[[Client], Any]) -> Future:
        """Queue ``fn(client)``; wait on the returned Future as long as you choose to."""
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def send(self, fn: Callable[[Client], Any]) -> None:
        """Queue ``fn(client)`` without waiting; dropped (and its error logged at debug) if it fails."""
        self._queue.put((fn, None))

    def close(self) -> None:
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(10)

    # --- the link thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.up and not (self._away.due() and self._attach()):
                    self._first.set()
                    self._refuse(POLL_S)
                    continue
                self._first.set()
                try:
                    item = self._queue.get(timeout=WATCH_INTERVAL_S)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                gone = self._gone()
                if gone is not None:
                    self._lose(DaemonUnavailable(gone))
                    if item is not None:
                        self._answer(item[1], None, DaemonUnavailable(f"{self.what}: kvtierd is unreachable"))
                elif item is not None:
                    self._serve(*item)
        finally:
            self._first.set()
            self.up = False
            self._drop_client()

    def _gone(self) -> str | None:
        """Why the daemon the client attached to is gone, or None: it closed the connection (a
        stop or a crash), or its socket path no longer holds the socket the client attached
        through (removed by a stopped daemon, bound anew by a restarted one: seen even when the
        connection's end came before the watch on it began)."""
        if self._dropped():
            return "kvtierd closed the connection"
        watch = self.client.socket_watch
        if watch.look() != watch.known:
            return "kvtierd's socket was removed or bound anew"
        return None

    def _dropped(self) -> bool:
        """Whether the daemon closed the connection of the client's (current) channel. (The
        channel's ZMQ socket is private to it; this thread owns the client and so the socket.)"""
        channel = self.client.channel
        if channel is None or channel._sock is None:
            return True
        if channel is not self._watched:      # attached, or the client re-attached by itself
            self._unwatch()
            self._watch = channel._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._watched = channel
        dropped = False
        while self._watch.poll(0):
            dropped |= recv_monitor_message(self._watch)["event"] == zmq.EVENT_DISCONNECTED
        return dropped

    def _unwatch(self) -> None:
        if self._watch is not None:
            try:
                self._watched._sock.disable_monitor()
            except (zmq.ZMQError, AttributeError):
                pass
            self._watch.close(linger=0)
            self._watch, self._watched = None, None

    def _drop_client(self) -> None:
        self._unwatch()
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except KvtierError:
                pass

    def _attach(self) -> bool:
        """Attach (the first time) or re-attach the same client: one attempt."""
        tried = self._away.look()
        try:
            if self.client is None:
                self.client = self._connect()
            else:
                self.client.reconnect()
        except KvtierError as exc:
            self._away.lost(exc, tried)
            return False
        self._away.back()
        self._dropped()                       # watch the new connection from now on
        logger.info("kvtier: %s attached, namespace %s", self.what, self.client.info.namespace)
        self.replies += 1
        self.epoch = self.client.attachments
        self.up = True
        return True

    def _refuse(self, timeout: float) -> None:
        """kvtierd is away: answer what is queued within ``timeout`` with DaemonUnavailable."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            if item is _STOP:
                self._stopping.set()
                return
            self._answer(item[1], None, DaemonUnavailable(f"{self.what}: kvtierd is unreachable"))
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _answer(future: Future | None, value: Any, error: BaseException | None) -> None:
        if future is None:
            if error is not None:
                logger.debug("kvtier: a background call to kvtierd failed: %s", error)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def _serve(self, fn: Callable[[Client], Any], future: Future | None) -> None:
        try:
            value = fn(self.client)
        except LOST as exc:
            self._answer(future, None, exc)
            self._lose(exc)
            return
        except KvtierError as exc:            # kvtierd answered with an error
            self.replies += 1
            self.epoch = self.client.attachments
            self._answer(future, None, exc)
            logger.debug("kvtier: %s: %s", self.what, exc)
            return
        except Exception as exc:              # a bug on our side: report it, keep the line
            logger.exception("kvtier: %s: unexpected error", self.what)
            self._answer(future, None, exc)
            return
        self.replies += 1
        self.epoch = self.client.attachments   # the client may have re-attached on its own
        self._answer(future, value, None)

    def _lose(self, exc: BaseException) -> None:
        """The connection is gone: down until ``_attach`` re-attaches the same client."""
        self.up = False
        self._away.lost(exc)
        self._unwatch()

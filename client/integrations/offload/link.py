"""The scheduler's line to kvtierd: one thread that owns the coordinator session.

vLLM's scheduler thread must never wait on kvtierd longer than it chooses to, so it never touches
a socket. A ``Link`` thread owns the coordinator ``Client``: it attaches, re-attaches after a
restart (the same ``Client``, so that it leases again what its old session held), and while
kvtierd is unreachable retries every ``retry_s``. The scheduler hands it work through a queue
(``submit``: a ``Call`` it may wait on with its own bound; ``send``: fire and forget) and reads
three plain attributes the thread alone writes:

- ``up``: attached and the connection stands. While False the scheduler does no I/O.
- ``replies``: how many answers the thread has had; a scheduler that gave up waiting remembers
  the count and waits again only once it moved (a hung daemon costs one wait, not one per call).
- ``epoch``: the client's count of attachments (``Client.attachments``) as last seen; it moves
  when the session is new (a daemon restart), which ends what the old one held (leases).

A daemon that dies closes its end of the IPC connection; the thread watches for that (a ZMQ
socket monitor, checked every ``WATCH_INTERVAL_S`` while idle) and marks the link down at once,
where a request would only find out after ``kvtier_timeout_s``.

The thread never takes vLLM's ``manager.lock`` (which vLLM holds for a whole ``schedule()``), and
the scheduler never blocks on the thread except inside ``Call.wait``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtierd.contract.errors import DaemonUnavailable, KvtierError, NotAttached

from ...api import Client

logger = logging.getLogger("vllm.kvtier")

# How often an idle link thread looks for a dropped connection (measured: a killed kvtierd's
# disconnect shows within microseconds; a request to it fails only after kvtier_timeout_s).
WATCH_INTERVAL_S = 0.05

# Errors after which the session is gone: the link drops it and attaches afresh.
LOST = (DaemonUnavailable, NotAttached)


class Call:
    """One piece of work for the link thread: ``fn(client)``; its value or error once done."""

    __slots__ = ("fn", "value", "error", "_done")

    def __init__(self, fn: Callable[[Client], Any]):
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """True once done; False if ``timeout`` seconds passed first."""
        return self._done.wait(timeout)

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def _finish(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self._done.set()


_STOP = object()


class Link:
    """The thread that owns the coordinator session (see the module docstring)."""

    def __init__(self, connect: Callable[[], Client], retry_s: float, what: str, first_wait_s: float):
        self._connect = connect
        self.retry_s = retry_s
        self.what = what                      # for log lines: "coordinator of engine X at <socket>"
        self.up = False
        self.replies = 0
        self.epoch = 0
        self.requests = 0                     # requests sent to kvtierd (the thread counts them)
        self.client: Client | None = None     # the link thread's; others only read it for logging
        self._watch: zmq.Socket | None = None
        self._watched = None                  # the client's channel that _watch watches
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._first = threading.Event()
        self._stopping = threading.Event()
        self._said_down = False
        self._thread = threading.Thread(target=self._run, name="kvtier-link", daemon=True)
        self._thread.start()
        self._first.wait(first_wait_s)        # start-up only: the first attempt, bounded

    # --- the scheduler's side
    def submit(self, fn: Callable[[Client], Any]) -> Call:
        """Queue ``fn(client)``; wait on the returned Call as long as you choose to."""
        call = Call(fn)
        self._queue.put(call)
        return call

    def send(self, fn: Callable[[Client], Any]) -> None:
        """Queue ``fn(client)`` without waiting; dropped (and its error logged at debug) if it fails."""
        self._queue.put(Call(fn))

    def close(self) -> None:
        self._stopping.set()
        self._queue.put(_STOP)
        self._thread.join(10)

    # --- the link thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.up and not self._attach():
                    self._first.set()
                    self._refuse_until(time.monotonic() + self.retry_s)
                    continue
                self._first.set()
                try:
                    item = self._queue.get(timeout=WATCH_INTERVAL_S)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if self._dropped():
                    self._lose(DaemonUnavailable("kvtierd closed the connection"))
                    if item is not None:
                        item._finish(None, DaemonUnavailable(f"{self.what}: kvtierd is unreachable"))
                elif item is not None:
                    self._serve(item)
        finally:
            self._first.set()
            self.up = False
            self._drop_client()

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
        try:
            if self.client is None:
                self.client = self._connect()
            else:
                self.client.reconnect()
        except KvtierError as exc:
            if not self._said_down:
                level = logging.WARNING if isinstance(exc, LOST) else logging.ERROR
                logger.log(level, "kvtier: %s cannot attach (%s); the engine serves without kvtierd (every lookup "
                           "a miss, nothing stored) and tries again every %gs", self.what, exc, self.retry_s)
                self._said_down = True
            return False
        logger.info("kvtier: %s attached, namespace %s", self.what, self.client.info.namespace)
        self._said_down = False
        self.replies += 1
        self.epoch = self.client.attachments
        self.up = True
        return True

    def _refuse_until(self, deadline: float) -> None:
        """kvtierd is away: answer every queued call with DaemonUnavailable until ``deadline``."""
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                return
            if item is _STOP:
                self._stopping.set()
                return
            item._finish(None, DaemonUnavailable(f"{self.what}: kvtierd is unreachable"))

    def _serve(self, call: Call) -> None:
        try:
            value = call.fn(self.client)
        except LOST as exc:
            call._finish(None, exc)
            self._lose(exc)
            return
        except KvtierError as exc:            # kvtierd answered with an error
            self.replies += 1
            self.epoch = self.client.attachments
            call._finish(None, exc)
            logger.debug("kvtier: %s: %s", self.what, exc)
            return
        except Exception as exc:              # a bug on our side: report it, keep the line
            logger.exception("kvtier: %s: unexpected error", self.what)
            call._finish(None, exc)
            return
        self.replies += 1
        self.epoch = self.client.attachments   # the client may have re-attached on its own
        call._finish(value, None)

    def _lose(self, exc: BaseException) -> None:
        """The connection is gone: down until ``_attach`` re-attaches the same client."""
        self.up = False
        logger.warning("kvtier: %s lost kvtierd (%s); the engine serves without it (every lookup a miss, nothing "
                       "stored) and re-attaches within %gs", self.what, exc, self.retry_s)
        self._said_down = True
        self._unwatch()

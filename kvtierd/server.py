"""The request loop and dispatch: ZMQ ROUTER sockets, decode → handler → encode.

One thread runs ``Server.run`` and is the only one that touches the store (DESIGN: one thread
owns the daemon's state), so handlers need no locks. Each wake-up of the poller drains a burst of
requests (up to ``BURST``) before polling again, which keeps the per-request cost flat when many
ranks fire at once.

We use a plain ``zmq.Poller`` loop rather than asyncio/uvloop: the loop has nothing to await but
the socket, the client pidfds and a signal pipe, and a poller round trip measured cheaper than the
same echo through zmq.asyncio on uvloop (docs/design.md has the figures and the command).

Two sockets, bound by ``listen``: the client socket (mode 0660: the daemon's user and the client
group) serves the protocol's REQUESTS; the admin socket (mode 0600: the daemon's user alone)
serves ADMIN_REQUESTS (clients, evict, clear). ``handle`` and ``handle_admin`` turn one frame into
one reply without touching a socket — decode, the op's handler (``kvtierd.handlers``), the
declared reply — so dispatch runs (and is tested) without them. Other threads
(the metrics endpoint) never touch the store; they hand a function to ``call_in_loop`` and the
loop runs it between requests.

Every message is read part by part: a request is one frame, and the parts of a multi-part
message are dropped without being copied (``_drain``). Every op but hello is decoded by the
compiled ``Requests`` from the protocol's specs; a frame it cannot prove well-formed goes to
``protocol.decode_request``, which names the fault. The loop's timers and the store's deadlines
are looked at when due and at most every ``TEND_AFTER_REQUESTS`` while requests stream in; while
requests alone come in, the loop polls the client socket and a plain descriptor for each other one
(a ZMQ socket's ZMQ_FD), and goes back to the full poll the moment any other is ready
(``_stream``). Each request comes with the connection it
arrived on (``peers.Connections``: the peer's uid and pid, counted and capped per peer and in
all); a session is tied to its connection and ends with it.

Every reply is built from its shape declared in ``protocol`` (``REPLIES``, ``ADMIN_REPLIES``);
one that does not encode costs its request only. Sessions' liveness is the ``SessionRegistry``'s
(``kvtierd.sessions``); the loop polls their pidfds and those of writers gone whose pages are
still fenced (``kvtierd.fence``), and sweeps heartbeats.

The region's files are checked every ``region_check_interval`` (``Region.check_files``): a
truncated metadata file stops the daemon; a truncated data file (any member of the client group
can do that) is replaced while the daemon serves on (``_replace_data``): every session ends,
every entry goes (its bytes went with the file), the tier companion is killed and started again
on the new file, the fence is reset (the pages it named went too), and clients re-attach to the
new file under a new generation.

The second tier (``Store.tier``, ``kvtierd.tiering``; ``NoTier`` without one) has its sockets in
the poller, and the loop gives it its turn (``Tier.pump``) at every wake-up and at least as
often as it asks; an admin ``clear`` is answered once the tier said how it went (``Later``).

Stopping (SIGTERM/SIGINT) drains: new jobs, new sessions and new leases (a lease promises a load,
a new job) are refused with SHUTTING_DOWN (clients then wait for the daemon that follows),
requests of jobs already open are still served, and the loop ends when no job is open any more
(store copies in flight and loads) or ``drain_timeout`` passed, whichever comes first. Pages a
writer may still copy into stay fenced in the region for the next daemon.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from .attachments import SessionEnd
from .contract import protocol as P
from .contract.replies import StatsReply, error_reply, ok_reply
from .contract.paths import check_socket_path
from ._native import Requests, keys_ok
from .contract.codes import ErrorCode, RequestError
from .gcwatch import GcWatch
from .handlers import Handlers, Later
from .histogram import Histogram
from .kvevents_pub import KvEventsPublisher, NoStream
from .peers import Conn, Connections
from .region import Region
from .sessions import SessionRegistry
from .store import Store
from .systemd import Notifier

log = logging.getLogger(__name__)

BURST = 256
# A reply's two parts go out in two sends with a plain int flag: send_multipart ORs pyzmq's enum
# flags in Python (3.11's enum), 11.5-16 µs a reply against 4-5.6 for the two sends (/tmp probe,
# 2-vCPU VM under load).
SNDMORE = int(zmq.SNDMORE)
# Replies queued for one peer that does not read them. A well-behaved client has one request in
# flight per socket (a pipelining one: at most ZMQ's default, 1000); past this ZMQ drops that
# peer's replies (ROUTER_MANDATORY off) instead of growing the daemon's memory: 60,000 unread
# stats replies took an unbounded daemon from 56 to 163 MiB. The peer only hurts itself.
REPLY_QUEUE_PER_PEER = 1000
PRESSURE_LOG_SECONDS = 10.0    # how often eviction pressure is reported in the log
# While requests stream in, the loop's timers and the store's deadlines are looked at once per this
# many seconds rather than at every request; a deadline is kept to within it.
TEND_AFTER_REQUESTS = 0.005


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, bounded, for an error reply or a log line; never raises
    (the message of an exception raised while handling a hostile frame may be huge or may fail to render)."""
    try:
        text = str(exc)
    except Exception:
        text = "?"
    return f"{type(exc).__name__}: {text[:P.MAX_ERROR_CHARS]}"


def _keys_ok(keys: Any) -> bool:
    """The compiled proof that a keys field is valid (the decoder's pure check judges the rest)."""
    return keys_ok(keys, P.MAX_KEY_BYTES, P.MAX_KEYS_PER_REQUEST)


def _hot_requests() -> Requests:
    """The compiled decoder of every op whose fields are ints, bools and keys (all but hello): the
    protocol's specs, read once. What it cannot prove well-formed goes to ``P.decode_request``."""
    ops = {op: fields for op, fields in P.REQUESTS.items()
           if all(f.kind in ("int", "bool", "keys", "ints") for f in fields.values())}
    return Requests(ops, P.MAX_FRAME_BYTES, P.MAX_KEY_BYTES, P.MAX_KEYS_PER_REQUEST, P.MAX_REQUEST_FIELDS,
                    P.MAX_REQUEST_ID)


_decode_hot = _hot_requests().decode


class Server:
    def __init__(self, store: Store, region: Region, gid: int | None = None, notifier: Notifier | None = None,
                 drain_timeout: float = 10.0, heartbeat_timeout: float = 15.0, region_check_interval: float = 5.0,
                 max_connections: int = 4096, max_connections_per_peer: int = 256, max_sessions: int = 2048,
                 max_sessions_per_peer: int = 128, stream: KvEventsPublisher | NoStream | None = None):
        """``stream``: the daemon's own KV events stream (``kvtierd.kvevents_pub``; none by default)."""
        self.store = store
        self.region = region
        self.gid = gid                    # the client group, which gets the client socket
        self.socket_path = region.paths.socket
        self.admin_socket_path = region.paths.admin_socket
        self.notifier = notifier or Notifier({})
        self.drain_timeout = drain_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.region_check_interval = region_check_interval
        self.exit_code = 0
        self.poller = zmq.Poller()
        self.sock: zmq.Socket | None = None
        self.admin: zmq.Socket | None = None
        self._signals: dict[zmq.Socket, int] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.tier = store.tier
        for sock in self.tier.sockets():
            self.poller.register(sock, zmq.POLLIN)
        self.stream = stream if stream is not None else NoStream()
        for sock in self.stream.sockets():
            self.poller.register(sock, zmq.POLLIN)
        self._watched = 0            # changes to the pidfds polled (``_watch``, ``_unwatch``; ``_stream``)
        self.sessions = SessionRegistry(store.detach, heartbeat_timeout, watch=self._watch, unwatch=self._unwatch,
                                        clock=store.clock, fence=store.fence, max_sessions=max_sessions,
                                        max_sessions_per_peer=max_sessions_per_peer)
        store.fence.watch_with(self._watch, self._unwatch)
        self.connections = Connections(max_connections, max_connections_per_peer, self.sessions.disconnected)
        self.stopping = False
        self.started = time.time()
        self.gc = GcWatch()             # the collector's passes: each is a pause of the one loop
        self.requests: Counter = Counter()
        self.errors: Counter = Counter()
        self.latency: dict[str, Histogram] = {op: Histogram() for op in P.REQUESTS}
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.metrics_address: str | None = None
        self.ops = Handlers(store, region, self.sessions, heartbeat_timeout, lambda: self.stopping,
                            lambda: self.sock is not None, self.stats)

    def listen(self) -> None:
        """Bind the client and admin sockets: from now on clients can connect."""
        self.sock = self._bind(self.socket_path, 0o117, self.gid, self.connections)   # 0660, client group
        self.poller.register(self.connections.monitor, zmq.POLLIN)
        self.poller.register(self.sock, zmq.POLLIN)
        self.admin = self._bind(self.admin_socket_path, 0o177, None)        # 0600, daemon's user only
        self.poller.register(self.admin, zmq.POLLIN)
        # Every ZMQ socket the loop watches but the client socket, by its ZMQ_FD (``_stream``).
        self._signals = {s: s.get(zmq.FD) for s, _ in self.poller.sockets
                         if isinstance(s, zmq.Socket) and s is not self.sock}

    def _bind(self, path: str, umask: int, gid: int | None, connections: Connections | None = None) -> zmq.Socket:
        check_socket_path(path)
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        if connections is not None:
            connections.watch(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # replies to vanished peers are dropped
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, REPLY_QUEUE_PER_PEER)    # per peer: ROUTER keeps one queue each
        # Frames up to twice the limit are read and refused with a LIMIT error; larger ones make ZMQ
        # drop the connection before allocating anything for them.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * P.MAX_FRAME_BYTES)
        if os.path.exists(path):
            os.unlink(path)          # our lock is held: a socket file here is a dead daemon's
        old_umask = os.umask(umask)
        try:
            sock.bind(f"ipc://{path}")
        finally:
            os.umask(old_umask)
        if gid is not None:
            os.chown(path, -1, gid)
        return sock

    def _watch(self, fd: int) -> None:
        self.poller.register(fd, zmq.POLLIN)
        self._watched += 1

    def _unwatch(self, fd: int) -> None:
        self.poller.unregister(fd)
        self._watched += 1

    # ------------------------------------------------------------------ loop
    def request_stop(self) -> None:
        """Async-signal-safe: start draining; the loop returns once drained."""
        self.stopping = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full: the loop is awake anyway

    def call_in_loop(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn`` on the loop thread (the only one that may touch the store); wait for it."""
        future: Future = Future()
        self._calls.append((fn, future))
        self._wake()
        return future.result(timeout)

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())

    def run(self) -> None:
        store = self.store
        tier = self.tier
        now = time.monotonic()
        self._timers = {"watchdog": now if self.notifier.watchdog_interval is not None else float("inf"),
                        "pressure": now + PRESSURE_LOG_SECONDS, "sweep": now + 0.5,
                        "region": now + self.region_check_interval}
        self._evictions_seen = 0
        tend_at = now                   # when the timers and deadlines are next looked at (``_tend``)
        drain_deadline = None
        while True:
            now = time.monotonic()
            next_tier = now + tier.pump(now)
            next_stream = now + self.stream.pump(now)
            if self.stopping:
                if drain_deadline is None:
                    drain_deadline = now + self.drain_timeout
                    self.notifier.notify(STOPPING=1, STATUS="draining in-flight stores and loads")
                    log.info("stopping: draining %d open job(s) for up to %.1fs", store.open_jobs(),
                             self.drain_timeout)
                if store.open_jobs() == 0 or now >= drain_deadline:
                    if store.open_jobs():
                        log.warning("stopping with %d job(s) open after drain_timeout; pages their writers may "
                                    "still copy into stay fenced for the next daemon", store.open_jobs())
                    break
            if now >= tend_at:
                tend_at = self._tend(now)
            if drain_deadline is not None:
                tend_at = min(tend_at, drain_deadline)
            timeout = max(0, min(1000, int((min(tend_at, next_tier, next_stream) - now) * 1000) + 1))
            events = dict(self.poller.poll(timeout))
            if len(events) == 1 and self.sock in events:
                # Requests alone: a handler may have opened a job or a lease whose deadline comes
                # before the next one ``_tend`` knew of, so it looks again within TEND_AFTER_REQUESTS.
                tend_at = min(tend_at, now + TEND_AFTER_REQUESTS)
                self._stream(min(tend_at, next_tier, next_stream))
                continue
            tend_at = now                # anything else (a death, a connection, a call) may move a deadline
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            self._run_calls()
            # Deaths first: a pidfd closed here cannot be confused with one a hello opens below.
            for fd in [fd for fd in events if isinstance(fd, int) and fd != self._wake_r]:
                if fd in self.sessions.pidfds:
                    self.sessions.died(fd)
                if fd in store.fence.pidfds:
                    store.writer_died(fd)
            if self.connections.monitor in events:   # connections come and go before their requests are read
                self.connections.poll()
            if self.sock in events:
                self._drain(self.sock, self.handle)
            if self.admin in events:
                self._drain(self.admin, self.handle_admin)
        self.close()

    def _stream(self, until: float) -> None:
        """Serve requests while they alone come in, until ``until`` (the loop's next timer).

        Between two requests this polls the client socket and, for every other descriptor, a
        plain file descriptor that is readable once it may have news: a pipe or pidfd itself, and
        for a ZMQ socket its ZMQ_FD (``_signals``), which ZMQ makes readable when a command reaches
        the socket — a message arriving after the loop read it dry is one. Anything but the client
        socket ready (or spuriously signalled) hands back to the loop, which polls all of them and
        sees to it first, so no descriptor waits longer than before (a request that makes the loop
        watch a pidfd or let one go ends the turn: the loop polls anew). Why: each ZMQ socket in a poll
        costs ZMQ a check of its mailbox (a syscall); the loop's five descriptors polled ~3 µs
        slower than the client socket alone, per request (/tmp/pollmicro.py, 2-vCPU VM)."""
        sock = self.sock
        signals = self._signals
        items = [(sock, zmq.POLLIN)]
        items += [(signals.get(s, s), zmq.POLLIN) for s, _ in self.poller.sockets if s is not sock]
        watched = self._watched
        while True:
            self._drain(sock, self.handle)
            if self._watched != watched:
                return
            # Rounded up, as the loop's own poll is: rounded down, every request of the turn's last
            # millisecond found the socket empty (its client waits for the reply just sent) and went
            # round the whole loop (the tier's and the stream's pumps, a poll of every socket).
            wait = until - time.monotonic()
            ready = zmq.zmq_poll(items, math.ceil(wait * 1000)) if wait > 0 else ()
            if len(ready) != 1 or ready[0][0] is not sock:
                return

    def _tend(self, now: float) -> float:
        """The loop's timers — sd_notify's watchdog, the eviction pressure log, the heartbeat sweep,
        the region files' check — and the store's deadlines (jobs, leases, fenced writers' grace).
        Returns when it must run next."""
        store = self.store
        timers = self._timers
        if self.notifier.watchdog_interval is not None and now >= timers["watchdog"]:
            self.notifier.notify(WATCHDOG=1)
            timers["watchdog"] = now + self.notifier.watchdog_interval
        if now >= timers["pressure"]:
            evictions, free_pages, pages = store.eviction_pressure()
            if evictions > self._evictions_seen:
                log.warning("eviction pressure: %d evictions in the last %.0fs (%d pages free of %d)",
                            evictions - self._evictions_seen, PRESSURE_LOG_SECONDS, free_pages, pages)
            timers["pressure"], self._evictions_seen = now + PRESSURE_LOG_SECONDS, evictions
        if now >= timers["sweep"]:
            self.sessions.sweep(now)
            timers["sweep"] = now + min(0.5, self.heartbeat_timeout / 4)
        if now >= timers["region"]:
            action = self.region.check_files()
            if action == "stop":               # the metadata: its next access may be a SIGBUS
                self.exit_code = 1
                self.drain_timeout = 0.0
                self.request_stop()
            elif action == "replace data":
                self._replace_data()
            timers["region"] = now + self.region_check_interval
        deadline = store.expire()
        wake_at = min(timers.values())
        return wake_at if deadline is None else min(wake_at, deadline)

    def _drain(self, sock: zmq.Socket, handle: Callable[..., dict]) -> None:
        for _ in range(BURST):
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            # ROUTER delivers whole messages: the parts after the routing identity are all there.
            # The request frame is not copied (msgpack reads ZMQ's buffer; the frame also tells
            # the connection it came in on); nor are the parts of a multi-part message, which are
            # refused (a client sends one frame per request).
            frame = sock.recv(copy=False)
            if frame.more:
                parts = 1
                while sock.recv(copy=False).more:
                    parts += 1
                self._count_error(ErrorCode.BAD_REQUEST)
                reply = error_reply(0, ErrorCode.BAD_REQUEST, f"expected one frame per request, got {parts + 1}")
            elif sock is self.sock:
                reply = handle(identity, frame.buffer, functools.partial(self.connections.of, frame))
            else:
                reply = handle(identity, frame.buffer)
                if isinstance(reply, Later):
                    reply.deliver_with(lambda r, to=identity, on=sock: self._send_later(on, to, r))
                    continue
            sock.send(identity, SNDMORE)
            sock.send(self._encode(reply))
            self.store.replied()         # never raises: a failed append is the event log's to count

    def _send_later(self, sock: zmq.Socket, identity: bytes, reply: dict) -> None:
        if sock in (self.sock, self.admin):       # not closed meanwhile (the daemon stopped)
            sock.send(identity, SNDMORE)
            sock.send(self._encode(reply))

    def _encode(self, reply: dict) -> bytes:
        """A reply's frame. One that does not encode (a bug: a value msgpack does not know) costs
        its request only, as a handler's exception does, never the loop."""
        try:
            return P.encode(reply)
        except Exception as exc:
            log.exception("internal error encoding a reply")
            self._count_error(ErrorCode.INTERNAL)
            return P.encode(error_reply(reply.get("rid", 0) if isinstance(reply.get("rid"), int) else 0,
                                        ErrorCode.INTERNAL, f"internal error: {_describe(exc)}"))

    # ------------------------------------------------------------------ dispatch
    def handle(self, identity: bytes, frame: bytes,
               connection: Callable[[bool], Conn | None] | None = None) -> dict[str, Any]:
        """One request frame from the client socket → one reply map. Never raises.
        ``connection(fresh)`` gives the connection it came in on (``Connections.of``; ``fresh``
        for a hello); without it (unit tests, no sockets) the connection and its peer are
        unknown, and a session said hello there owes heartbeats."""
        msg = _decode_hot(frame)
        if msg is None:
            try:
                msg = P.decode_request(frame, keys_ok=_keys_ok)
            except Exception as exc:   # RequestError; anything else is a decoder bug, and costs this request only
                return self._refusal(frame, exc)
        op, rid = msg["op"], msg.get("rid", 0)
        self.requests[op] += 1
        started = time.perf_counter()
        conn = connection(op == "hello") if connection is not None else None
        session = self.sessions.session_of(identity, conn)
        try:
            if session is None and op not in P.SESSIONLESS_OPS:
                raise RequestError(ErrorCode.NOT_ATTACHED, f"{op} before hello: attach a session first")
            if op == "hello":          # the one op that needs the connection: the session is tied to it
                return ok_reply(rid, self.ops.hello(identity, session, msg, conn))
            return ok_reply(rid, self.ops.client[op](identity, session, msg))
        except RequestError as exc:
            self._count_error(exc.code)
            return error_reply(rid, exc.code, exc.message)
        except Exception as exc:  # a bug must cost one request, not the daemon
            log.exception("internal error handling %s", op)
            self._count_error(ErrorCode.INTERNAL)
            return error_reply(rid, ErrorCode.INTERNAL, f"internal error: {_describe(exc)}")
        finally:
            self.latency[op].observe(time.perf_counter() - started)

    def handle_admin(self, identity: bytes, frame: bytes) -> dict[str, Any] | Later:
        """One admin request → one reply, or a ``Later`` one (a clear waiting for the second tier).
        Never raises."""
        try:
            msg = P.decode_request(frame, P.ADMIN_REQUESTS)
        except Exception as exc:
            return self._refusal(frame, exc)
        try:
            reply = self.ops.admin[msg["op"]](msg)
            if isinstance(reply, Later):
                return reply.reply if reply.reply is not None else reply
            return ok_reply(msg.get("rid", 0), reply)
        except RequestError as exc:
            self._count_error(exc.code)
            return error_reply(msg.get("rid", 0), exc.code, exc.message)
        except Exception as exc:
            log.exception("internal error handling an admin request")
            self._count_error(ErrorCode.INTERNAL)
            return error_reply(msg.get("rid", 0), ErrorCode.INTERNAL, f"internal error: {_describe(exc)}")

    def _refusal(self, frame: bytes, exc: Exception) -> dict[str, Any]:
        """The error reply to a frame that did not decode into a valid request."""
        if isinstance(exc, RequestError):
            code, message = exc.code, exc.message
        else:
            log.error("decoding a request raised %s", _describe(exc))
            code, message = ErrorCode.BAD_REQUEST, f"undecodable request ({type(exc).__name__})"
        self._count_error(code)
        return error_reply(P.request_id(frame), code, message)

    def _count_error(self, code: ErrorCode) -> None:
        self.errors[ErrorCode(code).name] += 1

    def stats(self) -> StatsReply:
        """Everything kvtierctl stats and the metrics endpoint show (loop thread only)."""
        return StatsReply(
            **self.store.stats(),
            namespace_list=self.store.namespace_stats(),
            requests=dict(self.requests),
            errors=dict(self.errors),
            latency={op: h.snapshot() for op, h in self.latency.items() if h.count},
            clients_watched=len(self.sessions.pidfds),
            uptime_seconds=time.time() - self.started,
            region=self.region.paths.region,
            socket=self.socket_path,
            admin_socket=self.admin_socket_path,
            metrics_address=self.metrics_address,
            generation=self.region.generation,
            pinned=self.region.pinned,
            hugepages=self.region.backing.kind,
            huge_page_size=self.region.backing.page_size,
            huge_bytes=self.region.backing.huge_bytes,
            file_bytes=self.region.geometry.data_bytes,
            daemon_pid=os.getpid(),
            stopping=self.stopping,
            region_problem=self.region.problem,
            sessions_heartbeat=len(self.sessions.heartbeats),
            checksums=self.store.checksums,
            connections=len(self.connections),
            connections_refused=dict(self.connections.refused),
            events={**self.store.events_stats(), "stream": self.stream.stats()},
            gc=self.gc.snapshot(),
        )

    def _replace_data(self) -> None:
        """The data file was truncated under the daemon: its blocks are gone. End every session
        (their jobs abort, their pins drop), kill and restart the tier companion (it maps the old
        file too; its promote jobs abort and its writer row goes: ``Tier.data_replaced``), drop
        every entry, reset the fence (the pages it named are gone; a writer still copying copies
        into its mapping of the old file), and serve a
        fresh data file under a new generation; clients re-attach and remap. The daemon never
        touched the truncated file."""
        log.critical("region file %s was truncated (a member of the client group can do that): its cached "
                     "blocks are gone; ending every session and replacing it", self.region.paths.region)
        self.sessions.close(SessionEnd.REGION_REPLACED)
        self.tier.data_replaced()         # the companion maps the old file too: it is restarted on the new one
        dropped = self.store.drop_all()
        generation = self.region.replace_data()
        log.warning("region file replaced: %d entries dropped, new generation %x", dropped, generation)

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        """End every session, close the sockets (when bound) and the wake pipe."""
        self.sessions.close()
        self.gc.close()
        registered = {sock for sock, _ in self.poller.sockets}    # a failed listen registered only some
        if self.connections.monitor is not None:
            if self.connections.monitor in registered:
                self.poller.unregister(self.connections.monitor)
            self.connections.close()
        for sock, path in ((self.sock, self.socket_path), (self.admin, self.admin_socket_path)):
            if sock is None:
                continue
            if sock in registered:
                self.poller.unregister(sock)
            sock.close(linger=0)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.sock = self.admin = None
        for sock in self.tier.sockets():
            self.poller.unregister(sock)
        for sock in self.stream.sockets():
            self.poller.unregister(sock)
        self.stream.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        while self._calls:   # nobody will run these any more
            self._calls.popleft()[1].set_exception(RuntimeError("kvtierd stopped"))


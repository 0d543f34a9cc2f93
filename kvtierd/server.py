"""The request loop: a ZMQ ROUTER socket, decode → handler → encode, sessions and liveness.

One thread runs ``Server.run`` and is the only one that touches the store (DESIGN: one thread
owns the daemon's state), so handlers need no locks. Each wake-up of the poller drains a burst of
requests (up to ``BURST``) before polling again, which keeps the per-request cost flat when many
ranks fire at once.

We use a plain ``zmq.Poller`` loop rather than asyncio/uvloop: the loop has nothing to await but
the socket, the client pidfds and a signal pipe, and a poller round trip measured cheaper than the
same echo through zmq.asyncio on uvloop (docs/design.md has the figures and the command).

Two sockets: the client socket (mode 0660: the daemon's user and the client group) serves the
protocol's REQUESTS; the admin socket (``<name>.admin.sock``, mode 0600: the daemon's user alone)
serves ADMIN_REQUESTS (clients, evict, clear). Other threads (the metrics endpoint) never touch
the store; they hand a function to ``call_in_loop`` and the loop runs it between requests.

Stopping (SIGTERM/SIGINT) drains: new jobs and new sessions are refused with SHUTTING_DOWN,
requests of jobs already open are still served, and the loop ends when no load job is open any
more or ``drain_timeout`` passed, whichever comes first.

Liveness: a client that shares the daemon's PID namespace (it reports the inode of its
/proc/self/ns/pid at hello) is watched through a pidfd, which becomes readable the moment the
process dies; its session then ends as if it had said ``bye``: jobs still waiting for that rank
abort, its pins drop (invariant 6). A PID from another namespace proves nothing, so such a
session must prove it is alive: any request, or a heartbeat (``ping`` with the session id and
the token from its hello reply, sent from any socket), at least every ``heartbeat_timeout``
seconds; otherwise it ends as dead.

The loop also checks every ``region_check_interval`` that the region file is still the file it
mapped (``Region.check_file``): a removed or replaced file is reported (new clients could not map
it); a truncated one stops the daemon, because any access past the new end would kill the daemon
and its clients with SIGBUS.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from .contract import protocol as P
from .contract.namespace import NamespaceId
from .contract.paths import admin_socket_for
from .contract.protocol import ErrorCode, JobState, RequestError
from .histogram import Histogram
from .region import Region
from .store import Session, Store
from .systemd import Notifier

log = logging.getLogger(__name__)

BURST = 256
MAX_SOCKET_PATH = 107          # sun_path is 108 bytes with the terminating NUL
PRESSURE_LOG_SECONDS = 10.0    # how often eviction pressure is reported in the log


def own_pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class Server:
    def __init__(self, store: Store, region: Region, socket_path: str, gid: int | None = None,
                 admin_socket_path: str | None = None, notifier: Notifier | None = None,
                 drain_timeout: float = 10.0, heartbeat_timeout: float = 15.0,
                 region_check_interval: float = 5.0):
        self.store = store
        self.region = region
        self.socket_path = socket_path
        self.admin_socket_path = admin_socket_path or admin_socket_for(socket_path)
        self.notifier = notifier or Notifier({})
        self.drain_timeout = drain_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.region_check_interval = region_check_interval
        self.heartbeats: dict[int, float] = {}   # unwatched session id → when it last proved alive
        self.tokens: dict[int, int] = {}         # session id → heartbeat token
        self.exit_code = 0
        self.ctx = zmq.Context.instance()
        self.sock = self._bind(socket_path, 0o117, gid)                 # 0660, client group
        self.admin = self._bind(self.admin_socket_path, 0o177, None)    # 0600, daemon's user only
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.admin, zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.sessions: dict[bytes, Session] = {}          # ZMQ routing identity → session
        self.identities: dict[int, bytes] = {}            # session id → identity
        self.pidfds: dict[int, Session] = {}              # pidfd → session it watches
        self.pidns = own_pid_namespace()
        self.stopping = False
        self.started = time.time()
        self.requests: Counter = Counter()
        self.errors: Counter = Counter()
        self.latency: dict[str, Histogram] = {op: Histogram() for op in P.REQUESTS}
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self.metrics_address: str | None = None
        self.handlers: dict[str, Callable[[bytes, Session | None, dict], dict]] = {
            "hello": self._hello, "ping": self._ping, "bye": self._bye, "lookup": self._lookup,
            "store": self._store, "commit": self._commit, "load": self._load, "release": self._release,
            "abort": self._abort, "jobs": self._jobs, "stats": self._stats,
        }
        self.admin_handlers: dict[str, Callable[[dict], dict]] = {
            "stats": lambda msg: self.stats(), "ping": lambda msg: {"generation": self.region.generation},
            "clients": self._clients, "evict": self._evict, "clear": self._clear,
        }

    def _bind(self, path: str, umask: int, gid: int | None) -> zmq.Socket:
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {path} is {len(path)} bytes; ipc paths are limited to "
                             f"{MAX_SOCKET_PATH}. Choose a shorter --dir or --name")
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # replies to vanished peers are dropped
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
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
        watchdog = self.notifier.watchdog_interval
        next_watchdog = time.monotonic()
        next_pressure, evictions_seen = time.monotonic() + PRESSURE_LOG_SECONDS, 0
        next_region_check = time.monotonic() + self.region_check_interval
        next_sweep = time.monotonic() + 0.5
        drain_deadline = None
        while True:
            now = time.monotonic()
            if self.stopping:
                if drain_deadline is None:
                    drain_deadline = now + self.drain_timeout
                    self.notifier.notify(STOPPING=1, STATUS="draining in-flight loads")
                    log.info("stopping: draining %d open load job(s) for up to %.1fs",
                             self._open_loads(), self.drain_timeout)
                if self._open_loads() == 0 or now >= drain_deadline:
                    break
            if watchdog is not None and now >= next_watchdog:
                self.notifier.notify(WATCHDOG=1)
                next_watchdog = now + watchdog
            if now >= next_pressure:
                evictions = store.counters["evictions"]
                if evictions > evictions_seen:
                    log.warning("eviction pressure: %d evictions in the last %.0fs (%d pages free of %d)",
                                evictions - evictions_seen, PRESSURE_LOG_SECONDS, store.pages.free_count,
                                store.pages.total)
                next_pressure, evictions_seen = now + PRESSURE_LOG_SECONDS, evictions
            if now >= next_sweep:
                self._sweep_heartbeats(now)
                next_sweep = now + min(0.5, self.heartbeat_timeout / 4)
            if now >= next_region_check:
                self._check_region_file()
                next_region_check = now + self.region_check_interval
            deadline = store.expire()
            wake_at = min(filter(None, [deadline, next_watchdog if watchdog else None, next_pressure,
                                        drain_deadline, next_sweep, next_region_check]))
            timeout = max(0, min(1000, int((wake_at - store.clock()) * 1000) + 1))
            events = dict(self.poller.poll(timeout))
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            self._run_calls()
            if self.sock in events:
                self._drain(self.sock, self.handle)
            if self.admin in events:
                self._drain(self.admin, self.handle_admin)
            for fd in [fd for fd in events if isinstance(fd, int) and fd in self.pidfds]:
                session = self.pidfds[fd]
                log.warning("client pid %s (%s of engine %r) died; ending its session",
                            session.pid, session.role, session.engine.id)
                self._end_session(session, "died")
        self.close()

    def _sweep_heartbeats(self, now: float) -> None:
        for session_id, seen in list(self.heartbeats.items()):
            if now - seen > self.heartbeat_timeout:
                session = self.store.sessions.get(session_id)
                if session is not None:
                    log.warning("client pid %s (%s of engine %r) sent nothing for %.1fs; ending its session",
                                session.pid, session.role, session.engine.id, now - seen)
                    self._end_session(session, "heartbeat_lost")
                else:
                    self.heartbeats.pop(session_id, None)

    def _check_region_file(self) -> None:
        if not self.region.check_file():     # truncated: any access past its end is a SIGBUS
            self.exit_code = 1
            self.drain_timeout = 0.0
            self.request_stop()

    def _open_loads(self) -> int:
        return sum(1 for e in self.store.engines.values() for j in e.jobs.values()
                   if j.kind == "load" and j.state is JobState.OPEN)

    def _drain(self, sock: zmq.Socket, handle: Callable[[bytes, bytes], dict]) -> None:
        for _ in range(BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity = frames[0]
            if len(frames) != 2:
                self._count_error(ErrorCode.BAD_REQUEST)
                reply = P.error_reply(0, ErrorCode.BAD_REQUEST, f"expected one frame per request, got {len(frames) - 1}")
            else:
                reply = handle(identity, frames[1])
            sock.send_multipart([identity, P.encode(reply)], copy=False)

    def handle(self, identity: bytes, frame: bytes) -> dict[str, Any]:
        """One request frame → one reply map. Never raises."""
        try:
            msg = P.decode_request(frame)
        except RequestError as exc:
            self._count_error(exc.code)
            return P.error_reply(P.request_id(frame), exc.code, exc.message)
        op, rid = msg["op"], msg.get("rid", 0)
        self.requests[op] += 1
        started = time.perf_counter()
        session = self.sessions.get(identity)
        if session is not None and session.id in self.heartbeats:
            self.heartbeats[session.id] = time.monotonic()
        try:
            if session is None and op not in P.SESSIONLESS_OPS:
                raise RequestError(ErrorCode.NOT_ATTACHED, f"{op} before hello: attach a session first")
            return P.ok_reply(rid, **self.handlers[op](identity, session, msg))
        except RequestError as exc:
            self._count_error(exc.code)
            return P.error_reply(rid, exc.code, exc.message)
        except Exception as exc:  # a bug must cost one request, not the daemon
            log.exception("internal error handling %s", op)
            self._count_error(ErrorCode.INTERNAL)
            return P.error_reply(rid, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.latency[op].observe(time.perf_counter() - started)

    def handle_admin(self, identity: bytes, frame: bytes) -> dict[str, Any]:
        """One admin request → one reply. Never raises."""
        try:
            msg = P.decode_request(frame, P.ADMIN_REQUESTS)
            return P.ok_reply(msg.get("rid", 0), **self.admin_handlers[msg["op"]](msg))
        except RequestError as exc:
            self._count_error(exc.code)
            return P.error_reply(P.request_id(frame), exc.code, exc.message)
        except Exception as exc:
            log.exception("internal error handling an admin request")
            self._count_error(ErrorCode.INTERNAL)
            return P.error_reply(P.request_id(frame), ErrorCode.INTERNAL, f"internal error: {exc}")

    def _count_error(self, code: ErrorCode) -> None:
        self.errors[ErrorCode(code).name] += 1

    # ------------------------------------------------------------------ sessions
    def _hello(self, identity: bytes, session: Session | None, msg: dict) -> dict:
        if msg["version"] != P.PROTOCOL_VERSION:
            raise RequestError(ErrorCode.VERSION, f"client speaks protocol {msg['version']}, this kvtierd speaks "
                                                  f"{P.PROTOCOL_VERSION}; install matching kvtierd versions")
        if self.stopping:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "kvtierd is stopping")
        if session is not None:
            self._end_session(session, "rehello")
        replaced = self.store.sessions.get(msg.get("replaces", -1))
        if replaced is not None and self.tokens.get(replaced.id) == msg.get("replaces_token"):
            self._end_session(replaced, "reattached")
        layout = NamespaceId.from_wire(msg["namespace"], msg["world_size"])
        pid = msg.get("pid")
        session = self.store.attach(msg["engine"], msg["rank"], msg["world_size"], layout, pid)
        self.sessions[identity] = session
        self.identities[session.id] = identity
        watched = False
        if pid and msg.get("pidns") is not None and msg.get("pidns") == self.pidns:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                self._end_session(session, "dead_at_hello")
                raise RequestError(ErrorCode.BAD_REQUEST, f"pid {pid} does not exist in the daemon's namespace")
            self.pidfds[fd] = session
            self.poller.register(fd, zmq.POLLIN)
            watched = True
        else:
            self.heartbeats[session.id] = time.monotonic()
        token = secrets.randbits(62)
        self.tokens[session.id] = token
        log.info("attach session=%d engine=%r %s world_size=%d pid=%s namespace=%s watched=%s", session.id,
                 session.engine.id, session.role, msg["world_size"], pid, layout.name(), watched)
        ns = session.engine.ns
        geo = self.region.geometry
        return {
            "session": session.id, "version": P.PROTOCOL_VERSION, "daemon_pid": os.getpid(),
            "region": self.region.paths.region, "generation": self.region.generation,
            "file_bytes": geo.file_bytes, "page_size": geo.page_size, "num_pages": geo.num_pages,
            "data_offset": geo.data_offset, "namespace": ns.layout.name(), "pages_per_shard": ns.pages_per_shard,
            "writers": sorted(session.engine.writers), "job_timeout": self.store.job_timeout,
            "watched": watched, "token": token,
            "heartbeat_interval": None if watched else self.heartbeat_timeout / 3,
            "checksums": self.store.checksums,
        }

    def _end_session(self, session: Session, cause: str) -> None:
        identity = self.identities.pop(session.id, None)
        if identity is not None:
            self.sessions.pop(identity, None)
        self.heartbeats.pop(session.id, None)
        self.tokens.pop(session.id, None)
        for fd, watched in list(self.pidfds.items()):
            if watched is session:
                self.poller.unregister(fd)
                os.close(fd)
                del self.pidfds[fd]
        self.store.detach(session, cause)
        log.info("detach session=%d engine=%r %s cause=%s", session.id, session.engine.id, session.role, cause)

    def _bye(self, identity: bytes, session: Session, msg: dict) -> dict:
        self._end_session(session, "left")
        return {}

    def _ping(self, identity: bytes, session: Session | None, msg: dict) -> dict:
        if "session" in msg:       # a heartbeat for a session, possibly from another socket
            session_id = msg["session"]
            if self.tokens.get(session_id) != msg.get("token"):
                raise RequestError(ErrorCode.NOT_ATTACHED, f"no session {session_id} with that token")
            if session_id in self.heartbeats:
                self.heartbeats[session_id] = time.monotonic()
            return {"generation": self.region.generation, "attached": True}
        return {"generation": self.region.generation, "attached": session is not None}

    # ------------------------------------------------------------------ data ops
    def _refuse_if_stopping(self, session: Session, job: int) -> None:
        """While draining, requests of open jobs are served; new jobs are refused."""
        if self.stopping and job not in session.engine.jobs:
            raise RequestError(ErrorCode.SHUTTING_DOWN, "kvtierd is stopping; no new jobs")

    def _lookup(self, identity: bytes, session: Session, msg: dict) -> dict:
        return {"hits": self.store.lookup(session, msg["keys"])}

    def _store(self, identity: bytes, session: Session, msg: dict) -> dict:
        self._refuse_if_stopping(session, msg["job"])
        outcomes, pages = self.store.store(session, msg["job"], msg["keys"])
        return {"outcomes": bytes(outcomes), "pages": b"".join(pages)}

    def _commit(self, identity: bytes, session: Session, msg: dict) -> dict:
        self.store.commit(session, msg["job"], msg["ok"], msg.get("checksums"))
        return {}

    def _load(self, identity: bytes, session: Session, msg: dict) -> dict:
        self._refuse_if_stopping(session, msg["job"])
        hits, pages = self.store.load(session, msg["job"], msg["keys"])
        return {"hits": hits, "pages": b"".join(pages)}

    def _release(self, identity: bytes, session: Session, msg: dict) -> dict:
        self.store.release(session, msg["job"])
        return {}

    def _abort(self, identity: bytes, session: Session, msg: dict) -> dict:
        self.store.abort(session, msg["job"])
        return {}

    def _jobs(self, identity: bytes, session: Session, msg: dict) -> dict:
        return {"jobs": self.store.job_states(session, msg["jobs"])}

    def _stats(self, identity: bytes, session: Session | None, msg: dict) -> dict:
        return self.stats()

    def stats(self) -> dict:
        """Everything kvtierctl stats and the metrics endpoint show (loop thread only)."""
        roles = Counter("coordinator" if s.rank is None else "rank" for s in self.store.sessions.values())
        return {
            **self.store.stats(),
            "namespace_list": self.store.namespace_stats(),
            "session_roles": {"rank": roles["rank"], "coordinator": roles["coordinator"]},
            "requests": dict(self.requests),
            "errors": dict(self.errors),
            "latency": {op: h.snapshot() for op, h in self.latency.items() if h.count},
            "clients_watched": len(self.pidfds),
            "uptime_seconds": time.time() - self.started,
            "region": self.region.paths.region,
            "socket": self.socket_path,
            "admin_socket": self.admin_socket_path,
            "metrics_address": self.metrics_address,
            "generation": self.region.generation,
            "pinned": self.region.pinned,
            "file_bytes": self.region.geometry.file_bytes,
            "daemon_pid": os.getpid(),
            "stopping": self.stopping,
            "region_problem": self.region.problem,
            "sessions_heartbeat": len(self.heartbeats),
            "checksums": self.store.checksums,
        }

    # ------------------------------------------------------------------ admin ops
    def _clients(self, msg: dict) -> dict:
        now = time.monotonic()
        watched = {id(s) for s in self.pidfds.values()}
        return {"clients": [
            {"session": s.id, "engine": s.engine.id, "role": s.role, "rank": s.rank, "pid": s.pid,
             "world_size": s.engine.world_size, "namespace": s.engine.ns.layout.name(),
             "watched": id(s) in watched, "attached_seconds": now - s.attached_at}
            for s in self.store.sessions.values()]}

    def _evict(self, msg: dict) -> dict:
        return {"evicted": self.store.evict(msg.get("namespace"), msg["count"])}

    def _clear(self, msg: dict) -> dict:
        return {"evicted": self.store.evict(msg.get("namespace"), None)}

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        for session in list(self.sessions.values()):
            self._end_session(session, "daemon_stopped")
        for sock, path in ((self.sock, self.socket_path), (self.admin, self.admin_socket_path)):
            self.poller.unregister(sock)
            sock.close(linger=0)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        while self._calls:   # nobody will run these any more
            self._calls.popleft()[1].set_exception(RuntimeError("kvtierd stopped"))

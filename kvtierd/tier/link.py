"""The daemon's side of the tier companion: start it, send requests without blocking, collect
replies, enforce deadlines and the page fence, stop or kill it.

Made for a single-threaded loop: ``socket`` goes into the loop's poller, ``submit`` never blocks
(it raises ``LinkBusy`` when ``max_inflight`` requests are out — the caller drops the demote and
counts it — and ``LinkDown`` when no companion is ready), ``collect(now)`` returns what happened
since the last call: replies, deadline notices and the companion's life events.

The fence. A ``put`` reads and a ``get`` writes region pages in the companion. Every request
ends with exactly one *final* ``Outcome`` (``final=True``): its reply, or an error when the
companion died or was killed. Until then its pages must not be reused. A request that outlives
its ``deadline`` gets an early, non-final ``Outcome`` (``TierTimeout``), so the caller can stop
waiting for it (a promote answers "miss" to the engine) while the pages stay fenced. When the
oldest fenced request is ``kill_after`` seconds past its deadline the link SIGKILLs the companion
and, without waiting for it, reaps it at a later ``collect``: only a reaped process provably no
longer touches the pages, so only then does every outstanding request get its final outcome and
the companion is started again (after ``restart_backoff``). A companion stuck in the kernel (a
hung disk: uninterruptible sleep, ``D``) dies only once its I/O returns; until then the link says
``killed``, refuses requests and keeps every page fenced, and the loop goes on serving.

The companion is started with ``PR_SET_PDEATHSIG``: it dies with the daemon, never outlives it.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from .backend import TierError, TierTimeout, TierUnavailable, error_from

PR_SET_PDEATHSIG = 1
FENCED_OPS = frozenset({"put", "get"})


class LinkDown(TierUnavailable):
    """No companion is ready (starting, restarting, or its backend could not be opened)."""


class LinkBusy(TierUnavailable):
    """``max_inflight`` requests are already out: drop this one and count it."""

    code = "busy"


@dataclass
class Request:
    id: int
    op: str
    deadline: float
    context: Any                     # the caller's own (e.g. the demote's entries)
    timed_out: bool = False


@dataclass
class Outcome:
    """What became of a request. ``final``: its pages (if any) may be reused now."""

    op: str
    context: Any
    final: bool
    ok: bool
    result: dict = field(default_factory=dict)
    error: TierError | None = None


def die_with_parent() -> None:
    """In a child between fork and exec: SIGKILL it when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class TierLink:
    def __init__(self, endpoint: str, region: str, data_offset: int, data_bytes: int, page_size: int,
                 backend: str, settings: dict, timeout: float = 1.0, data_timeout: float = 10.0,
                 failures: int = 3, cooldown: float = 5.0, max_inflight: int = 64, kill_after: float = 10.0,
                 restart_backoff: float = 5.0, log_path: str | None = None, python: str = sys.executable,
                 ctx: zmq.Context | None = None, clock=time.monotonic, socket_mode: int | None = None,
                 key_file: str = "", owner: str = ""):
        self.argv = [python, "-m", "kvtierd.tier.service", "--endpoint", endpoint, "--region", region,
                     "--offset", str(data_offset), "--length", str(data_bytes), "--page-size", str(page_size),
                     "--backend", backend, "--settings", json.dumps(settings), "--timeout", str(timeout),
                     "--data-timeout", str(data_timeout), "--failures", str(failures), "--cooldown", str(cooldown),
                     "--key-file", key_file, "--owner", owner]
        # A request's deadline in the daemon: the companion's own deadline plus slack for the hop.
        self.deadlines = {"meta": timeout + 0.5, "data": data_timeout + 0.5}
        self.max_inflight = max_inflight
        self.kill_after = kill_after
        self.restart_backoff = restart_backoff
        self.log_path = log_path
        self.clock = clock
        self.ctx = ctx or zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._bind(endpoint, socket_mode)
        self.proc: subprocess.Popen | None = None
        self.state = "stopped"        # stopped | starting | ready | failed | killed (not yet reaped) | down
        self.abandoned = False        # its requests' pages are in a replaced data file (``abandon``)
        self.info: dict = {}
        self.last_error: TierError | None = None
        self.restart_at = 0.0
        self.inflight: dict[int, Request] = {}
        self._ids = itertools.count(1)
        self.counters = {"started": 0, "killed": 0, "died": 0, "busy": 0, "timeouts": 0}

    def _bind(self, endpoint: str, mode: int | None) -> None:
        """Bind the endpoint; an ``ipc://`` file with ``mode`` (the daemon's: 0o600, so that no
        client can connect in the companion's place and be sent its requests)."""
        path = endpoint.removeprefix("ipc://") if endpoint.startswith("ipc://") else None
        if path is not None and os.path.exists(path):
            os.unlink(path)            # a dead daemon's: its owner holds the region's lock now
        old = os.umask(0o777 & ~mode) if mode is not None else None
        try:
            self.socket.bind(endpoint)
        finally:
            if old is not None:
                os.umask(old)

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Spawn the companion; it reports ``ready`` (or ``failed``) through ``collect``."""
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=die_with_parent)
        finally:
            if self.log_path:
                log.close()
        self.state = "starting"
        self.counters["started"] += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def unreaped(self) -> int | None:
        """The pid of the companion process not reaped yet (alive, or killed and not yet gone)."""
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask the companion to stop, SIGKILL it when it has not within ``timeout`` and wait as long
        again; close the socket. True once it is reaped; False when it still lives (stuck in the
        kernel): its pages must stay fenced."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.socket.send(msgpack.packb({"op": "stop", "id": 0}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
        self.state = "stopped"
        self.socket.close(0)
        return self.unreaped is None

    def kill(self) -> None:
        """SIGKILL the companion, without waiting for it: ``collect`` reaps it once it is gone, and
        until then its requests keep their pages (no final outcome)."""
        if self.proc is not None and self.proc.poll() is None and self.state != "killed":
            self.proc.kill()
            self.state = "killed"
            self.counters["killed"] += 1

    def abandon(self) -> None:
        """The region's data file was replaced: every request's pages are in the old file, which
        nobody maps any more. Kill the companion; every request ends at the next ``collect`` (it
        may still be dying), and the next companion starts at once after this one is reaped (it
        holds the tier's claims, such as the disk tier's lock, until then)."""
        if self.proc is None or self.state == "stopped":
            return
        self.kill()
        self.abandoned = True

    # ------------------------------------------------------------------ requests
    def submit(self, op: str, context: Any = None, **fields: Any) -> int:
        """Send a request without blocking; returns its id. ``fields`` per op: see ``service``."""
        if self.state != "ready":
            raise LinkDown(f"the tier companion is {self.state}" +
                           (f" ({self.last_error})" if self.last_error else ""))
        if len(self.inflight) >= self.max_inflight:
            self.counters["busy"] += 1
            raise LinkBusy(f"{len(self.inflight)} tier requests in flight (max_inflight)")
        rid = next(self._ids)
        try:
            self.socket.send(msgpack.packb({"op": op, "id": rid, **fields}, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["busy"] += 1
            # Full, or its companion just died and the link has not heard yet (ZMQ then has no
            # peer to queue for): either way nothing was sent, and the caller drops it as busy.
            raise LinkBusy("the tier companion's socket takes no request now (full, or its companion just "
                           "stopped)") from None
        lane = "data" if op in FENCED_OPS else "meta"
        self.inflight[rid] = Request(rid, op, self.clock() + self.deadlines[lane], context)
        return rid

    def collect(self, now: float | None = None) -> list[Outcome]:
        """Replies received, deadline notices, and the final outcomes of a companion's death."""
        now = self.clock() if now is None else now
        out: list[Outcome] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._received(msgpack.unpackb(frame, raw=False), out)
        for req in self.inflight.values():
            if not req.timed_out and now > req.deadline:
                req.timed_out = True
                self.counters["timeouts"] += 1
                fenced = req.op in FENCED_OPS
                out.append(Outcome(req.op, req.context, final=not fenced, ok=False,
                                   error=TierTimeout(f"tier {req.op} not answered in time")))
        for rid in [r.id for r in self.inflight.values() if r.timed_out and r.op not in FENCED_OPS]:
            del self.inflight[rid]     # a late reply to these is ignored
        self._watch(now, out)
        return out

    def _received(self, msg: dict, out: list[Outcome]) -> None:
        rid = msg.get("id")
        if rid is None:                # the companion's own news
            if self.state == "killed":
                return                 # sent before it was killed: it serves no more
            if msg.get("op") == "ready":
                self.state, self.info, self.last_error = "ready", msg.get("info", {}), None
            elif msg.get("op") == "failed":
                self.state = "failed"
                self.last_error = error_from(msg.get("error", "failed"), msg.get("message", ""))
            return
        req = self.inflight.pop(rid, None)
        if req is None:
            return                     # a stats reply nobody waits for, or a late meta reply
        if msg.get("ok"):
            out.append(Outcome(req.op, req.context, final=True, ok=True, result=msg))
        else:
            err = error_from(msg.get("error", "failed"), msg.get("message", ""))
            out.append(Outcome(req.op, req.context, final=True, ok=False, error=err))

    def _watch(self, now: float, out: list[Outcome]) -> None:
        """The companion's life: kill a stuck one, reap a dead one, restart after the backoff."""
        if self.proc is None or self.state == "stopped":
            return
        stuck = [r for r in self.inflight.values() if r.timed_out and now > r.deadline + self.kill_after]
        if stuck:
            self.kill()
        if self.abandoned and self.inflight:
            self._end_all(TierUnavailable("the region's data file was replaced"), out)
        if self.proc.poll() is None:
            return                     # alive, or killed but not gone yet: its pages stay fenced
        if self.state in ("starting", "ready", "failed", "killed"):
            if self.state != "failed":
                self.counters["died"] += 1
                self.last_error = TierUnavailable(f"the tier companion exited ({self.proc.returncode})")
            self.state = "down"
            self.restart_at = now if self.abandoned else now + self.restart_backoff
            self.abandoned = False
            self._end_all(self.last_error, out)
        if self.state == "down" and now >= self.restart_at:
            self.start()

    def _end_all(self, err: TierError | None, out: list[Outcome]) -> None:
        """Every request in flight ends now (final, failed)."""
        for req in self.inflight.values():
            out.append(Outcome(req.op, req.context, final=True, ok=False, error=err))
        self.inflight.clear()

    def status(self) -> dict:
        return {"state": self.state, "pid": self.pid, "inflight": len(self.inflight), "info": self.info,
                "last_error": str(self.last_error) if self.last_error else None, **self.counters}

"""Deadlines and a circuit breaker around a backend, so a down or slow tier never stalls its caller.

``Guard.call(method, *args)`` runs ``backend.method(*args)`` on the guard's one worker thread and
waits at most the call's deadline. Engine clients can block far longer than a caller may wait
(Mooncake's ``put`` takes ~4.3 s to fail when its master is gone, its ``setup`` ~90 s; a Redis
node that stops reading stalls a send until the socket timeout), and a C++ client cannot be
interrupted from Python: so the call is *abandoned*, not cancelled. While an abandoned call has
not returned, the guard refuses every other call at once (``TierUnavailable``, naming how long it
has been stuck) — a backend is not thread-safe, and the abandoned call may still be reading or
writing the memory its extents name. ``stuck_for()`` tells the owner (the companion's loop, and
through it the daemon) how long, so that it can end the process: the only way to prove that the
memory is no longer touched.

Breaker: ``failures`` consecutive ``TierUnavailable``/``TierTimeout``/``TierFailed`` results open
it; while open, calls fail at once with ``CircuitOpen`` (counted as ``rejected``) for
``cooldown`` seconds; then one call is let through (half-open): its success closes the breaker,
its failure opens it for another cooldown. ``TierRejected`` (the engine refused one request as
given) says nothing about the engine's health and leaves the breaker alone.

Every change is logged once (the companion's log, ``<name>.tier.log``): a call's failure after a
success (later ones are counted, not logged, until a success), the breaker opening, and the
first success after failures (the breaker closed again).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .backend import Backend, CircuitOpen, TierError, TierFailed, TierRejected, TierTimeout

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

log = logging.getLogger("kvtierd.tier")


class Guard:
    def __init__(self, backend: Backend, timeout: float = 2.0, failures: int = 3, cooldown: float = 5.0,
                 clock=time.monotonic, lane: str = ""):
        if timeout <= 0 or failures < 1 or cooldown < 0:
            raise ValueError("timeout > 0, failures >= 1 and cooldown >= 0 are required")
        self.backend = backend
        self.timeout = timeout
        self.failures = failures
        self.cooldown = cooldown
        self.clock = clock
        self.name = f"{backend.name} {lane} lane" if lane else backend.name
        self.state = CLOSED
        self.consecutive = 0
        self.open_until = 0.0
        self.counters: Counter = Counter()    # calls, ok, rejected, opened, errors_<code>
        self._stuck: tuple[Future, str, float] | None = None   # (call, method, started)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon thread: an engine call that never returns must not keep the process alive.
        self._thread = threading.Thread(target=self._worker, name=f"tier-{backend.name}", daemon=True)
        self._thread.start()

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:   # delivered to the caller, typed there
                future.set_exception(exc)

    def stuck_for(self) -> float:
        """Seconds the abandoned call has been running (0 when none is)."""
        if self._stuck is None:
            return 0.0
        if self._stuck[0].done():
            self._stuck = None
            return 0.0
        return self.clock() - self._stuck[2]

    def wait_abandoned(self, timeout: float | None = None) -> bool:
        """Wait until the abandoned call (if any) returned; False if it still runs after ``timeout``.
        Its caller must not reuse the memory the call names before then."""
        stuck = self._stuck
        if stuck is None:
            return True
        try:
            stuck[0].exception(timeout)
        except FutureTimeout:
            return False
        return True

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """``backend.method(*args)`` within ``timeout`` (default: the guard's), or a ``TierError``."""
        stuck = self.stuck_for()
        if stuck:
            self.counters["rejected"] += 1
            raise CircuitOpen(f"{self.backend.name}: a {self._stuck[1]} call has not returned for "
                                  f"{stuck:.1f} s; no other call runs until it does")
        now = self.clock()
        if self.state == OPEN:
            if now < self.open_until:
                self.counters["rejected"] += 1
                raise CircuitOpen(f"{self.backend.name}: circuit open for {self.open_until - now:.1f} s more after "
                                  f"{self.consecutive} consecutive failures")
            self.state = HALF_OPEN
        self.counters["calls"] += 1
        future: Future = Future()
        self._work.put((future, getattr(self.backend, method), args))
        limit = self.timeout if timeout is None else timeout
        try:
            result = future.result(limit)
        except FutureTimeout:
            self._stuck = (future, method, now)
            self._failed(TierTimeout(f"{self.backend.name}: {method} did not return within {limit:.2f} s"))
        except TierRejected as exc:
            self.counters[f"errors_{exc.code}"] += 1
            raise
        except TierError as exc:
            self._failed(exc)
        except Exception as exc:
            self._failed(TierFailed(f"{self.backend.name}: {method} raised {type(exc).__name__}: {exc}"), exc)
        self.counters["ok"] += 1
        if self.consecutive:
            log.info("%s: %s succeeded after %d failures; breaker closed", self.name, method, self.consecutive)
        self.consecutive = 0
        self.state = CLOSED
        return result

    def _failed(self, exc: TierError, cause: BaseException | None = None) -> None:
        self.counters[f"errors_{exc.code}"] += 1
        self.consecutive += 1
        if self.consecutive == 1:
            log.warning("%s: %s", self.name, exc)
        if self.state == HALF_OPEN or self.consecutive >= self.failures:
            if self.state != OPEN:
                self.counters["opened"] += 1
                log.warning("%s: breaker open for %.1f s after %d consecutive failures (last: %s)", self.name,
                            self.cooldown, self.consecutive, exc)
            self.state = OPEN
            self.open_until = self.clock() + self.cooldown
        raise exc from cause

    def snapshot(self) -> dict:
        """State and counters for stats and metrics."""
        return {"state": self.state, "consecutive_failures": self.consecutive, "stuck_s": self.stuck_for(),
                **self.counters}

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker after the call it runs (if that returns within ``timeout``), then close
        the backend — unless a call is stuck in it: then the process's end is the only cleanup."""
        self._work.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.backend.close()

"""The tier companion's life, as the daemon follows it: the process behind the link
(``kvtierd.tier.link.TierLink``: non-blocking ``submit`` and ``collect``), its row in the fence's
writer table, and the bookkeeping of every call made to it.

The companion is a writer like a rank (invariant 9): when it is ready it gets a writer row
(its pid and start time, so that a restarted daemon proves it gone); its promotes are fenced
writes whose writer it is (``kvtierd.writes``). When the link has reaped it (it died, or was
killed for not answering: a reaped process provably touches no page), its row ends with the
proof ``Release.DIED`` — after its promotes were aborted (``gone`` then ``end``): every page it
was handed comes back. A companion killed but not reaped yet (stuck in the kernel on a hung
disk) keeps its row and its pages until it is: the loop never waits for it. The link starts a
new one after ``restart_backoff``; a replaced data file kills the companion (``abandon``: its
pages are in the old file) and the link starts the next as soon as that one is reaped.

Every call's outcome passes ``observe`` first: its latency (final outcomes), its error (once per
call, a deadline's notice included), and whether it is past its deadline (``timed_out``).
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from typing import Any

import numpy as np

from ..contract.namespace import NamespaceId
from ..fence import Release, Writer
from ..histogram import Histogram
from ..namespaces import Namespace
from ..processes import Process, start_ticks
from ..tier.keys import identity
from ..tier.link import LinkBusy, LinkDown, Outcome, TierLink
from ..writes import Writes

log = logging.getLogger(__name__)

OPS = ("exists", "put", "get", "clear")
STATS_EVERY = 2.0             # seconds between the companion's stats (its breakers' state)


class _Stats:
    """The context of a stats request (nothing to undo)."""

    started = 0.0


class Companion:
    def __init__(self, link: TierLink, writes: Writes, where: str = ""):
        """``where``: the tier, as the log names it (its backend at its address)."""
        self.link = link
        self.writes = writes
        self.where = where
        self.writer: Writer | None = None       # its row in the fence, while it is ready
        self.writer_pid: int | None = None
        self.reported: dict = {}                # its last stats (guards, counters, its backend's info)
        self._up: bool | None = None            # the tier's state last logged (None: not known yet)
        self.errors: Counter = Counter()         # (op, code) → calls
        self.latency = {op: Histogram() for op in OPS}
        self._identities: dict[NamespaceId, bytes] = {}
        self._next_stats = 0.0

    # ------------------------------------------------------------------ life
    @property
    def ready(self) -> bool:
        return self.link.state == "ready"

    @property
    def current(self) -> Writer | None:
        """Its writer row, if it is the one the link has ready now (a promote may be handed pages)."""
        return self.writer if self.writer is not None and self.writer_pid == self.link.pid else None

    def gone(self) -> Writer | None:
        """The row of a companion the link has reaped, if any: its writes must be aborted before
        ``end``. (One killed but not reaped yet is not gone: it may still touch its pages.)"""
        return self.writer if self.writer is not None and self.link.unreaped != self.writer_pid else None

    def end(self, writer: Writer, now: float, proof: Release | None = Release.DIED) -> None:
        """The companion of ``writer`` is reaped (``proof`` DIED): everything parked under it comes
        back; without a proof its pages stay fenced until the fence sees its process gone."""
        self.writes.writer_ended(writer, proof, now)
        if writer is self.writer:
            if proof is Release.DIED:
                log.warning("tier companion pid %s is gone (%s); it is restarted in %.0fs", self.writer_pid,
                            self.link.last_error, self.link.restart_backoff)
            self.writer = self.writer_pid = None

    def join(self) -> None:
        """A ready companion without a row gets one."""
        pid = self.link.pid if self.ready else None
        if pid is None or self.writer is not None:
            return
        ticks = start_ticks(pid)
        if ticks is None:
            return                              # it died just now: the link reaps it next
        self.writer = self.writes.add_writer(0, secrets.randbits(62), Process(pid, ticks), "kvtierd-tier", 0)
        self.writer_pid = pid
        log.info("tier companion pid %d ready: %s", pid, self.link.info)

    def rows(self) -> list[Writer]:
        """Its writer row, if the fence still holds one."""
        return [w for w in (self.writer,) if w is not None and self.writes.holds(w)]

    def abandon(self) -> None:
        """The region's data file was replaced: kill it; the link's next ``collect`` ends every
        request it had, and it starts the next one once this one is reaped (no backoff)."""
        self.link.abandon()

    def stop(self) -> bool:
        """Stop it (killed if it does not stop in time); True once it is reaped."""
        return self.link.stop(timeout=2.0)

    # ------------------------------------------------------------------ calls
    def submit(self, op: str, context: Any, **fields: Any) -> None:
        """Send a call (raises ``LinkBusy`` / ``LinkDown``)."""
        self.link.submit(op, context, **fields)

    def room(self) -> int:
        """Calls that can still be sent before ``max_inflight``."""
        return self.link.max_inflight - len(self.link.inflight)

    def inflight(self, kind: type) -> int:
        """Calls in flight whose context is a ``kind``."""
        return sum(isinstance(r.context, kind) for r in self.link.inflight.values())

    def collect(self, now: float) -> list[Outcome]:
        """What came back, each observed (``observe``); the companion's own stats kept."""
        out = []
        for o in self.link.collect(now):
            if isinstance(o.context, _Stats):
                if o.ok:
                    self.reported = {"guards": o.result.get("guards", {}), "counters": o.result.get("counters", {}),
                                     "info": o.result.get("info", {})}
                continue
            self.observe(o, now)
            out.append(o)
        return out

    def observe(self, o: Outcome, now: float) -> None:
        ctx = o.context
        if o.final:
            self.latency[o.op].observe(now - ctx.started)
        if not o.ok and not getattr(ctx, "timed_out", False):     # a call's error counts once
            self.errors[(o.op, o.error.code if o.error else "failed")] += 1
        if not o.final:
            ctx.timed_out = True

    def log_state(self) -> None:
        """Log the tier going down and coming up, once per change: down while no companion is
        ready (it could not open its backend, died, was killed) or a breaker is open."""
        state = self.link.state
        if state in ("starting", "stopped"):
            return
        open_lanes = [lane for lane, g in self.reported.get("guards", {}).items() if g.get("state") == "open"]
        up = state == "ready" and not open_lanes
        if up == self._up:
            return
        if up:
            log.info("second tier up: %s", self.where)
        elif state != "ready":
            log.warning("second tier down: %s: the companion is %s (%s); serving from the region meanwhile",
                        self.where, state, self.link.last_error)
        else:
            log.warning("second tier down: %s: breaker open on the %s lane (the companion's log, %s, says why); "
                        "serving from the region meanwhile", self.where, " and ".join(open_lanes), self.link.log_path)
        self._up = up

    def ask_stats(self, now: float) -> None:
        """Ask for its stats every STATS_EVERY seconds (its breakers' state)."""
        if self.ready and now >= self._next_stats:
            self._next_stats = now + STATS_EVERY
            try:
                self.link.submit("stats", _Stats())
            except (LinkBusy, LinkDown):
                pass

    def identity(self, ns: Namespace) -> bytes:
        """The namespace's identity in tier keys (``kvtierd.tier.keys.identity``), computed once."""
        ident = self._identities.get(ns.id)
        if ident is None:
            ident = self._identities[ns.id] = identity(ns.id)
        return ident

    def fields(self, ns: Namespace, slots: np.ndarray) -> dict:
        """A put's or a get's fields: the entries' keys and whole page chains (every shard)."""
        index = self.writes.index
        return {"ns": self.identity(ns), "keys": index.keys_of(slots), "pages": index.pages_of(ns, slots),
                "length": ns.id.block_bytes, "shards": ns.shards}

    # ------------------------------------------------------------------ what is going on
    def stats(self) -> dict:
        link = self.link
        guards = self.reported.get("guards", {})
        return {
            "state": link.state, "pid": link.pid, "last_error": str(link.last_error) if link.last_error else None,
            "engine": self.reported.get("info") or link.info, "restarts": max(0, link.counters["started"] - 1), "killed": link.counters["killed"],
            "inflight": len(link.inflight), "max_inflight": link.max_inflight,
            "errors": [{"op": op, "code": code, "calls": n} for (op, code), n in sorted(self.errors.items())],
            "call_seconds": {op: h.snapshot() for op, h in self.latency.items() if h.count},
            "breaker": {lane: g.get("state", "unknown") for lane, g in guards.items()},
        }

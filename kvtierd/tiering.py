"""The second tier in the daemon: blocks demoted before their pages are reused, lookup misses
promoted, both under the page fence (docs/tier.md, "Phase 2 as built").

The companion process (``kvtierd.tier.service``) talks to the engine; ``TierLink`` is the
daemon's end of it (a non-blocking ``submit`` and ``collect``). ``Tiering`` is what the daemon
does with them, on the loop thread, between requests (``pump``): no call here waits on the tier.

Demote. The index keeps a free-page reserve (``low_watermark`` of the pages): when free pages
(plus those being demoted) fall below it, the policy's first victims are taken — a victim the
tier already holds is freed at once (unless it was promoted and no engine has used it yet: the
engine that asked for it is about to); any other, unless its namespace is excluded, gets a
*demote pin* (``Index.pin(access=False)``: READY and loadable, out of the policy, so no store
takes its pages) and goes into a ``put`` with its page chain. On the put's final outcome the pin
drops; a block the tier took is marked *in tier* (never sent again) and, if nobody used it since
(its access tick did not move), freed. A block whose put failed is freed just the same (dropped,
counted ``failed``), and after a failed call demotes pause for ``cooldown`` seconds. Demotes
never hold more than half of ``max_inflight``. Nothing waits: a store that needs pages now
evicts the policy's victims that are not demote-pinned (``Index._make_room``); those the tier
does not hold are counted dropped, by why (``down``, ``failed``, ``busy``, ``pressure``).

Promote. ``lookup`` (after the index's own) looks at the keys after the local hits: keys being
promoted or being checked count as *pending*, so are the READY keys among them; at the first key
the tier is known not to hold (a recent check: ``ABSENT_SECONDS``), or that an engine is storing,
the run ends. Keys nobody asked about yet go into one ``exists`` (meta lane) and count as pending
now: the reply never waits for the tier, and the check is sent ``CHECK_DELAY`` after it (checks
promised meanwhile go with it), so that the companion does not compete with the reply, and the
engine taking it in, for the CPU. When ``exists`` answers, the leading run of keys the
tier holds becomes a *promote job*: pages allocated like a store's (``Index.place``, making room
through the policy), WRITING entries owned by the job, the pages fenced for the companion's
writer row (``Fence.hand``) before the ``get`` names them. On the get's final outcome the pages
are settled: keys whose bytes landed whole become READY (READY last, invariant 1), born in tier;
the others are freed. Past its deadline the job aborts at once (the entries go, the engine sees
a miss) but its pages stay fenced, parked under the companion's row, until the get's final
outcome or the companion's death: the link kills and reaps a companion that does not answer for
``kill_after`` more seconds, and a reaped process is the proof that it writes no more
(invariant 9). A check older than ``PATIENCE`` seconds no longer counts as pending, and after a
failed check lookups check nothing for ``cooldown`` seconds: a slow or dead tier costs a lookup
nothing.

The companion is a writer like a rank: ``Fence.add`` gives it a row when it is ready (its pid and
start time, so that a restarted daemon proves it gone), ``Fence.detach`` with ``Release.DIED``
ends it once the link has reaped it.

Identities: a tier key carries the namespace's identity (``identity``: model, dtype, tokens per
block, bytes per block, sharding and — sharded only — world size), so two models never meet and
a replicated (MLA) namespace's blocks are one copy for every TP degree. A sharded entry is stored
whole, its shards back to back.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

import msgpack
import numpy as np

from .contract.namespace import NamespaceId
from .contract.protocol import AbortCause, StoreOutcome
from .contract.region_format import EntryState
from .events import EntryEvents, Gone
from .fence import Release, Writer
from .histogram import Histogram
from .index import Entry, Index
from .namespaces import Namespace
from .processes import Process, start_ticks
from .tier.link import LinkBusy, LinkDown, Outcome, TierLink
from .writes import Write, Writes, WriterKind

log = logging.getLogger(__name__)

_PAGES = attrgetter("pages")
_KEY = attrgetter("key")

DEMOTE_BATCH = 256            # blocks per put
PROMOTE_BATCH = 256           # blocks per get
LOOK_LIMIT = 4096             # victims a demote pass looks at (excluded namespaces are skipped)
DEMOTE_SHARE = 0.5            # of max_inflight: the rest stays free for lookups' checks and promotes
# A key the tier was just found not to hold (or could not give) is not checked again for this
# long: an engine asks again every scheduler step while keys are pending, and a fresh check
# each time would keep them pending forever. Another node's demote of it is found after it.
ABSENT_SECONDS = 1.0
ABSENT_KEYS = 1 << 20         # keys remembered absent, per namespace (the oldest go first)
# A check older than this is no longer reported pending: the engine computes those blocks
# (an existence check takes well under a millisecond; one this late means a slow tier).
PATIENCE = 0.05
# Checks go out this long after the first lookup that promised one: its reply is delivered first.
# Sent at once, a 1-key miss took 2.1-4.3x a local lookup on a 2-CPU machine (the companion and
# the engine's client threads woke while the reply was on its way); 256 keys, 1.05x either way.
CHECK_DELAY = 0.0005
STATS_EVERY = 2.0             # seconds between the companion's stats (its breakers' state)
TICK = 0.1                    # the loop wakes at least this often while a tier is configured
OPS = ("exists", "put", "get", "clear")


def identity(ns_id: NamespaceId) -> bytes:
    """The namespace identity folded into its tier keys (``kvtierd.tier.keys.Keyspace``): fixed
    fields in a fixed order, so every daemon of a fleet derives the same bytes."""
    return msgpack.packb(["kvtierd-namespace", ns_id.model, ns_id.dtype, ns_id.block_tokens, ns_id.block_bytes,
                          ns_id.sharding.value, ns_id.world_size])


@dataclass(frozen=True)
class TierConfig:
    """What the daemon does with its tier (the ``tier_*`` settings)."""

    backend: str
    address: str
    demote: bool = True
    promote: bool = True
    low_watermark: float = 0.05
    exclude: frozenset = frozenset()      # model names
    cooldown: float = 5.0


@dataclass(eq=False)
class _Demote:
    ns: Namespace
    entries: list
    ticks: np.ndarray
    started: float
    timed_out: bool = False


@dataclass(eq=False)
class _Check:
    ns: Namespace
    keys: list
    started: float


@dataclass(eq=False)
class Promote:
    """A promote job (``JobKind.PROMOTE``): the companion writes its entries' pages."""

    id: int
    ns: Namespace
    writer: Writer
    started: float
    write: Write | None = None              # its fenced write (kvtierd.writes)
    cause: AbortCause | None = None
    timed_out: bool = False


@dataclass(eq=False)
class _Clear:
    ns: Namespace
    batch: "_ClearBatch"
    started: float


@dataclass(eq=False)
class _ClearBatch:
    remaining: int
    reply: Callable[[str, int | None], None]
    removed: int = 0
    failed: bool = False


class _Stats:
    """The context of a stats request (nothing to undo)."""

    started = 0.0


class Tiering(EntryEvents):
    def __init__(self, index: Index, writes: Writes, link: TierLink, config: TierConfig,
                 clock: Callable[[], float] = time.monotonic):
        self.index = index
        self.writes = writes
        self.link = link
        self.config = config
        self.clock = clock
        index.events.subscribe(self)          # what leaves the index: counted, forgotten
        self.in_tier = np.zeros(index.geometry.entry_slots, bool)   # slot → the tier holds its block
        self.writer: Writer | None = None       # the companion's row in the fence
        self.writer_pid: int | None = None
        self.promotes: dict[int, Promote] = {}
        self._job_ids = itertools.count(1)
        self._identities: dict[NamespaceId, bytes] = {}
        self._checking: dict[NamespaceId, dict[bytes, _Check]] = {}
        self._to_check: list[_Check] = []       # checks promised by lookups, sent at the next pump
        self._absent: dict[NamespaceId, dict[bytes, float]] = {}
        self._fresh: dict[int, int] = {}        # slot → tick: promoted, not used since (not freed ahead of need)
        self.demoting_pages = 0
        self.demoting_blocks = 0
        self.demotes_off_until = 0.0
        self.checks_off_until = 0.0
        self._next_stats = 0.0
        self.companion: dict = {}                # the companion's last stats (guards, counters, engine)
        self.counters: Counter = Counter()
        self.dropped: Counter = Counter()        # reason → blocks evicted that the tier does not hold
        self.errors: Counter = Counter()         # (op, code) → calls
        self.aborted: Counter = Counter()        # AbortCause value → promote jobs
        self.latency = {op: Histogram() for op in OPS}

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self.link.start()

    def close(self) -> None:
        """Stop the companion (it is killed if it does not stop in time): every request it had is
        over, so the pages it was handed are released."""
        self.link.stop(timeout=2.0)
        writers = {job.writer for job in self.promotes.values()} | ({self.writer} if self.writer else set())
        for job in self.promotes.values():
            self._abort(job, AbortCause.TIER_FAILED)
        self.promotes.clear()
        now = self.clock()
        for writer in writers:
            if self.writes.holds(writer):
                self.writes.writer_ended(writer, Release.DIED, now)
        self.writer = self.writer_pid = None

    def data_replaced(self) -> None:
        """The region's data file was truncated and is being replaced (``Server._replace_data``):
        the companion maps the old file. It is killed and reaped (afterwards it provably touches no
        page), every request it had ends (promote jobs abort and their fenced pages come back,
        demotes fail and their pins drop), its writer row is released (``Fence.reset`` needs no
        writer attached), and it is started again at the loop's next turn: the new companion maps
        the new file, as a client re-attaches and remaps."""
        if self.link.state == "stopped":
            return
        self.link.kill()
        now = self.clock()
        for outcome in self.link.collect(now):     # the link reaps it: every request's final outcome
            self._outcome(outcome, now)
        self._companion(now)
        self.link.restart_at = now                 # not a failure of the companion's: no backoff
        self.counters["region_replaced_restarts"] += 1

    def _companion(self, now: float) -> None:
        """Follow the companion's life: a ready one gets a writer row, a gone one loses it (the
        link has reaped it and ended every request it had)."""
        pid = self.link.pid if self.link.state == "ready" else None
        if self.writer is not None and pid != self.writer_pid:
            for job in [j for j in self.promotes.values() if j.writer is self.writer]:
                self._abort(job, AbortCause.TIER_FAILED)
                self.writes.drop_writer(job.write, 0)   # reaped: no final outcome comes
                self.promotes.pop(job.id, None)
            self.writes.writer_ended(self.writer, Release.DIED, now)
            log.warning("tier companion pid %s is gone (%s); it is restarted in %.0fs", self.writer_pid,
                        self.link.last_error, self.link.restart_backoff)
            self.writer = self.writer_pid = None
        if pid is not None and self.writer is None:
            ticks = start_ticks(pid)
            if ticks is None:
                return                          # it died just now: the link reaps it next
            self.writer = self.writes.add_writer(0, secrets.randbits(62), Process(pid, ticks), "kvtierd-tier", 0)
            self.writer_pid = pid
            log.info("tier companion pid %d ready: %s", pid, self.link.info)

    # ------------------------------------------------------------------ the loop
    def pump(self, now: float | None = None) -> float:
        """Apply what the companion answered, follow its life, demote ahead of need. Returns the
        seconds until the loop should call again at the latest."""
        now = self.clock() if now is None else now
        for outcome in self.link.collect(now):
            self._outcome(outcome, now)
        wait = TICK
        if self._to_check:
            wait = self._to_check[0].started + CHECK_DELAY - now
            if wait <= 0:
                self._send_checks(now)
                wait = TICK
        self._companion(now)
        if self.link.state == "ready":
            self._demote_ahead(now)
            if now >= self._next_stats:
                self._next_stats = now + STATS_EVERY
                try:
                    self.link.submit("stats", _Stats())
                except (LinkBusy, LinkDown):
                    pass
        return wait

    def _outcome(self, o: Outcome, now: float) -> None:
        ctx = o.context
        if isinstance(ctx, _Stats):
            if o.ok:
                self.companion = {"guards": o.result.get("guards", {}), "counters": o.result.get("counters", {})}
            return
        if o.final:
            self.latency[o.op].observe(now - ctx.started)
        if not o.ok and not getattr(ctx, "timed_out", False):     # a call's error counts once
            self.errors[(o.op, o.error.code if o.error else "failed")] += 1
        if not o.final:
            ctx.timed_out = True
        if isinstance(ctx, _Demote):
            self._demoted(ctx, o, now)
        elif isinstance(ctx, Promote):
            self._fetched(ctx, o, now)
        elif isinstance(ctx, _Check):
            self._checked(ctx, o, now)
        elif isinstance(ctx, _Clear):
            self._cleared(ctx, o)

    # ------------------------------------------------------------------ namespaces
    def _identity(self, ns: Namespace) -> bytes:
        ident = self._identities.get(ns.id)
        if ident is None:
            ident = self._identities[ns.id] = identity(ns.id)
        return ident

    def serves(self, ns: Namespace) -> bool:
        """Whether the namespace's blocks go to and come from the tier at all (``tier_exclude``)."""
        return ns.id.model not in self.config.exclude

    def _fields(self, ns: Namespace, entries: list[Entry]) -> dict:
        return {"ns": self._identity(ns), "keys": list(map(_KEY, entries)), "pages": b"".join(map(_PAGES, entries)),
                "length": ns.id.block_bytes, "shards": ns.shards}

    # ------------------------------------------------------------------ demote
    def _demote_ahead(self, now: float) -> None:
        """Keep ``low_watermark`` of the pages free: demote the policy's first victims (or free
        those the tier holds)."""
        if not self.config.demote or now < self.demotes_off_until:
            return
        index = self.index
        short = math.ceil(self.config.low_watermark * index.total_pages) - index.free_pages - self.demoting_pages
        if short <= 0:
            return
        batches = int(self.link.max_inflight * DEMOTE_SHARE) - sum(
            isinstance(r.context, _Demote) for r in self.link.inflight.values())
        if batches <= 0:
            return
        free_now, chosen = [], {}
        room, fresh = batches * DEMOTE_BATCH, self._fresh
        for looked, entry in enumerate(index.victims()):
            slot = entry.slot
            if slot in fresh:
                if self.index.ticks_of([entry])[0] == fresh[slot]:
                    continue                    # promoted for an engine that has not come back yet
                del fresh[slot]
            if self.in_tier[slot]:
                free_now.append(entry)
            elif self.serves(entry.ns):
                chosen.setdefault(entry.ns, []).append(entry)
                room -= 1
            else:
                continue
            short -= entry.ns.entry_pages
            if short <= 0 or room <= 0 or looked >= LOOK_LIMIT:
                break
        index.free_ahead(free_now)
        for ns, entries in chosen.items():
            for i in range(0, len(entries), DEMOTE_BATCH):
                if not self._demote(ns, entries[i:i + DEMOTE_BATCH], now):
                    return

    def _demote(self, ns: Namespace, entries: list[Entry], now: float) -> bool:
        ctx = _Demote(ns, entries, self.index.ticks_of(entries), now)
        try:
            self.link.submit("put", ctx, **self._fields(ns, entries))
        except (LinkBusy, LinkDown):
            return False                       # they stay; if a store takes their pages, counted
        self.index.pin(entries, access=False)  # READY and loadable; no store takes their pages
        self.demoting_pages += len(entries) * ns.entry_pages
        self.demoting_blocks += len(entries)
        return True

    def _demoted(self, ctx: _Demote, o: Outcome, now: float) -> None:
        if not o.final:                        # past its deadline: its pages stay pinned until the end
            return
        entries, ns = ctx.entries, ctx.ns
        self.index.unpin(entries)
        self.demoting_pages -= len(entries) * ns.entry_pages
        self.demoting_blocks -= len(entries)
        done = o.result.get("done", b"") if o.ok else b""
        done = done if len(done) == len(entries) else bytes(len(entries))
        if not o.ok:
            self.demotes_off_until = now + self.config.cooldown
        untouched = self.index.ticks_of(entries) == ctx.ticks
        free, failed = [], []
        for entry, took, same in zip(entries, done, untouched.tolist()):
            if took:
                self.in_tier[entry.slot] = True
                self.counters["demoted_blocks"] += 1
                self.counters["demoted_bytes"] += ns.id.entry_bytes
            if same:
                (free if took else failed).append(entry)
        self.index.free_ahead(free)
        self.dropped["failed"] += self.index.free_ahead(failed)

    def leaving(self, cause: Gone, slots: np.ndarray, keys: list[bytes], namespaces: np.ndarray) -> None:
        """Entries leave the index: forget what was known of them; count those a store's room took
        that the tier does not hold, by why the tier did not get them."""
        if self._fresh:
            for slot in slots.tolist():
                self._fresh.pop(slot, None)
        held = self.in_tier[slots]
        self.in_tier[slots] = False
        if cause is not Gone.EVICTED or not self.config.demote:
            return
        lost = sum(int(count) for ns_slot, count in zip(*np.unique(namespaces[~held], return_counts=True))
                   if self.serves(self.index.ns.at(int(ns_slot))))
        if not lost:
            return
        if self.link.state != "ready":
            reason = "down"
        elif self.clock() < self.demotes_off_until:
            reason = "failed"
        elif len(self.link.inflight) >= self.link.max_inflight:
            reason = "busy"
        else:
            reason = "pressure"
        self.dropped[reason] += lost

    # ------------------------------------------------------------------ promote
    def pending(self, ns: Namespace, keys: list[bytes], hits: int) -> int:
        """How many keys after the ``hits`` local ones are being promoted (or checked in the tier:
        this call sends the check for those nobody asked about yet). Never waits."""
        if hits >= len(keys) or not self.config.promote or self.link.state != "ready" or not self.serves(ns):
            return 0
        now = self.clock()
        if now < self.checks_off_until or len(self.link.inflight) + len(self._to_check) >= self.link.max_inflight:
            return 0
        rest = keys[hits:]
        found = self.index.find(ns, rest)
        checking = self._checking.setdefault(ns.id, {})
        absent = self._absent.setdefault(ns.id, {})
        if (found.count(None) == len(found) and not any(map(checking.__contains__, rest))
                and not any(map(absent.__contains__, rest))):
            self._check(ns, rest, now)          # the common case: a fresh miss
            return len(rest)
        pending, first_new, new = 0, None, []
        for key, entry in zip(rest, found):
            if entry is not None:
                if entry.state is EntryState.READY or entry.write.kind is WriterKind.TIER:
                    pending += 1
                    continue
                break                           # an engine is storing it: not the tier's to promise
            check = checking.get(key)
            if check is not None:
                if now - check.started > PATIENCE:
                    break
                pending += 1
                continue
            until = absent.get(key)
            if until is not None:
                if until > now:
                    break
                del absent[key]
            if first_new is None:
                first_new = pending
            new.append(key)
            pending += 1
        if new:
            self._check(ns, new, now)
        return pending

    def _check(self, ns: Namespace, keys: list[bytes], now: float) -> None:
        """Promise a check of ``keys``: they count as being checked from now on; it is sent at the
        next ``pump``, after the lookup's reply."""
        ctx = _Check(ns, keys, now)
        self._to_check.append(ctx)
        self._checking.setdefault(ns.id, {}).update(dict.fromkeys(keys, ctx))

    def _send_checks(self, now: float) -> None:
        checks, self._to_check = self._to_check, []
        for ctx in checks:
            try:
                self.link.submit("exists", ctx, ns=self._identity(ctx.ns), keys=ctx.keys)
            except (LinkBusy, LinkDown) as exc:   # not checked: misses for now
                self.errors[("exists", exc.code)] += 1
                self._forget_check(ctx)
                self._remember_absent(ctx.ns, ctx.keys, now + ABSENT_SECONDS)

    def _forget_check(self, ctx: _Check) -> None:
        checking = self._checking.get(ctx.ns.id, {})
        for key in ctx.keys:
            if checking.get(key) is ctx:
                del checking[key]

    def _checked(self, ctx: _Check, o: Outcome, now: float) -> None:
        ns = ctx.ns
        self._forget_check(ctx)
        if not o.ok:
            self.checks_off_until = now + self.config.cooldown
            return
        present = o.result.get("present", b"")
        if len(present) != len(ctx.keys):
            return
        held = sum(present)
        self.counters["lookup_hit_keys"] += held
        self.counters["lookup_miss_keys"] += len(present) - held
        until = now + ABSENT_SECONDS
        self._remember_absent(ns, [k for k, p in zip(ctx.keys, present) if not p], until)
        if not self.index.live(ns):             # taken over meanwhile: its engines are gone
            return
        run = []
        for key, held_it, entry in zip(ctx.keys, present, self.index.find(ns, ctx.keys)):
            if not held_it:
                break
            if entry is None:
                run.append(key)
            elif not (entry.state is EntryState.READY or entry.write.kind is WriterKind.TIER):
                break
        for i in range(0, len(run), PROMOTE_BATCH):
            self._promote(ns, run[i:i + PROMOTE_BATCH], now)

    def _remember_absent(self, ns: Namespace, keys: list[bytes], until: float) -> None:
        if not keys:
            return
        absent = self._absent.setdefault(ns.id, {})
        absent.update(dict.fromkeys(keys, until))
        if len(absent) > ABSENT_KEYS:          # forget the oldest half
            for key in list(itertools.islice(absent, len(absent) // 2)):
                del absent[key]

    def _promote(self, ns: Namespace, keys: list[bytes], now: float) -> None:
        """A promote job for keys the tier holds: a fenced write (``kvtierd.writes``) whose writer
        is the companion — WRITING entries, their pages fenced for it before the get names them."""
        writer = self.writer
        if writer is None or self.writer_pid != self.link.pid:
            return
        job = Promote(next(self._job_ids), ns, writer, now)
        job.write, outcomes, _ = self.writes.begin(WriterKind.TIER, job.id, ns, keys)
        self._remember_absent(ns, [k for k, out in zip(keys, outcomes) if out is StoreOutcome.NO_SPACE],
                              now + ABSENT_SECONDS)
        entries = job.write.entries
        if not entries:
            return
        self.writes.hand(job.write, 0, writer)          # every shard (the tier holds whole entries), before the get
        try:
            self.link.submit("get", job, **self._fields(ns, entries))
        except (LinkBusy, LinkDown):
            self.writes.settle(job.write, 0)                    # never sent: nothing landed
            self.writes.complete(job.write, bytes(len(entries)))
            self._remember_absent(ns, keys, now + ABSENT_SECONDS)
            return
        self.promotes[job.id] = job
        self.counters["promote_jobs"] += 1

    def _fetched(self, job: Promote, o: Outcome, now: float) -> None:
        if not o.final:                        # past its deadline: a miss for the engine, pages stay fenced
            self._abort(job, AbortCause.TIER_TIMEOUT)
            return
        self.promotes.pop(job.id, None)
        write = job.write
        self.writes.settle(write, 0)           # the companion is done with the pages (aborted: they come back)
        if not write.open:
            return
        entries = list(write.entries)
        done = o.result.get("done", b"") if o.ok else b""
        done = done if len(done) == len(entries) else bytes(len(entries))
        landed = self.writes.complete(write, done)
        lost = [e.key for e, d in zip(entries, done) if not d]
        if lost:
            self._remember_absent(job.ns, lost, now + ABSENT_SECONDS)
            self.counters["promote_failed_blocks"] += len(lost)
        if landed:
            self.in_tier[[e.slot for e in landed]] = True
            self._fresh.update(zip(map(attrgetter("slot"), landed), self.index.ticks_of(landed).tolist()))
            self.counters["promoted_blocks"] += len(landed)
            self.counters["promoted_bytes"] += len(landed) * job.ns.id.entry_bytes
        if o.ok:
            self.counters["promote_jobs_done"] += 1
        else:
            self.aborted[AbortCause.TIER_FAILED.value] += 1

    def _abort(self, job: Promote, cause: AbortCause) -> None:
        """The job is over for the engine: its entries go at once; its pages stay fenced, parked
        under the companion's row, until the get's final outcome or the companion's death."""
        write = job.write
        if not write.open:
            return
        job.cause = cause
        keys = list(map(_KEY, write.entries))
        self.writes.abort(write)
        self._remember_absent(job.ns, keys, self.clock() + ABSENT_SECONDS)
        self.counters["promote_failed_blocks"] += len(keys)
        self.aborted[cause.value] += 1
        log.info("promote job %d (%d blocks) aborted: %s", job.id, len(keys), cause.value)

    # ------------------------------------------------------------------ clear
    def clear(self, namespaces: list[Namespace], reply: Callable[[str, int | None], None]) -> None:
        """Remove every block of these namespaces from the tier; ``reply(tier, removed)`` says how
        it went (now, or once the companion answered): excluded | failed | removed."""
        served = [ns for ns in namespaces if self.serves(ns)]
        if not served:
            reply("excluded" if namespaces else "removed", None if namespaces else 0)
            return
        for ns in served:                      # their entries' copies in the tier are going
            self.in_tier[[e.slot for e in ns.index.values()]] = False
        batch = _ClearBatch(len(served), reply)
        now = self.clock()
        for ns in served:
            try:
                self.link.submit("clear", _Clear(ns, batch, now), ns=self._identity(ns))
            except (LinkBusy, LinkDown) as exc:
                self.errors[("clear", exc.code)] += 1
                batch.failed = True
                self._clear_done(batch)

    def _cleared(self, ctx: _Clear, o: Outcome) -> None:
        if o.ok:
            ctx.batch.removed += int(o.result.get("removed", 0))
            self.counters["cleared_blocks"] += int(o.result.get("removed", 0))
        else:
            ctx.batch.failed = True
        self._clear_done(ctx.batch)

    @staticmethod
    def _clear_done(batch: _ClearBatch) -> None:
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.reply("failed" if batch.failed else "removed", batch.removed)

    # ------------------------------------------------------------------ what is going on
    def stats(self) -> dict:
        link = self.link
        c = self.counters
        guards = self.companion.get("guards", {})
        return {
            "backend": self.config.backend, "address": self.config.address, "state": link.state, "pid": link.pid,
            "last_error": str(link.last_error) if link.last_error else None, "engine": link.info,
            "restarts": max(0, link.counters["started"] - 1), "killed": link.counters["killed"],
            "inflight": len(link.inflight), "max_inflight": link.max_inflight,
            "demote": self.config.demote, "promote": self.config.promote,
            "exclude": sorted(self.config.exclude), "low_watermark": self.config.low_watermark,
            "demoted_blocks": c["demoted_blocks"], "demoted_bytes": c["demoted_bytes"],
            "demoting_blocks": self.demoting_blocks,
            "demote_dropped_blocks": {r: self.dropped[r] for r in ("busy", "down", "failed", "pressure")},
            "promoted_blocks": c["promoted_blocks"], "promoted_bytes": c["promoted_bytes"],
            "promoting_blocks": sum(len(j.write.entries) for j in self.promotes.values() if j.write.open),
            "promote_failed_blocks": c["promote_failed_blocks"], "promote_jobs": c["promote_jobs"],
            "promote_jobs_done": c["promote_jobs_done"], "promote_aborted": dict(self.aborted),
            "lookup_keys": {"hit": c["lookup_hit_keys"], "miss": c["lookup_miss_keys"]},
            "cleared_blocks": c["cleared_blocks"],
            "errors": [{"op": op, "code": code, "calls": n} for (op, code), n in sorted(self.errors.items())],
            "call_seconds": {op: h.snapshot() for op, h in self.latency.items() if h.count},
            "breaker": {lane: g.get("state", "unknown") for lane, g in guards.items()},
        }


def build(config_values, region_path: str, data_offset: int, data_bytes: int, page_size: int, directory: str,
          name: str, index: Index, writes: Writes) -> Tiering | None:
    """The daemon's ``Tiering`` from its settings (None when ``tier_backend`` is off). The companion's
    socket (mode 0600) and log live beside the region: ``<dir>/<name>.tier.sock``, ``.tier.log``."""
    c = config_values
    if c.tier_backend == "off":
        return None
    if not c.tier_address:
        raise ValueError(f"tier_backend {c.tier_backend} needs tier_address (--tier-address: the Mooncake master's "
                         "HOST:PORT, or Valkey/Redis Cluster nodes HOST:PORT,HOST:PORT)")
    where = {"mooncake": "master", "redis": "nodes"}[c.tier_backend]
    settings = {where: c.tier_address, "timeout": c.tier_timeout, **c.tier_settings}
    socket_path = os.path.join(directory, f"{name}.tier.sock")
    link = TierLink(f"ipc://{socket_path}", region_path, data_offset, data_bytes, page_size, c.tier_backend, settings,
                    timeout=c.tier_timeout, data_timeout=c.tier_data_timeout, failures=c.tier_failures,
                    cooldown=c.tier_cooldown, max_inflight=c.tier_max_inflight, kill_after=c.tier_kill_after,
                    restart_backoff=c.tier_restart_backoff, log_path=os.path.join(directory, f"{name}.tier.log"),
                    socket_mode=0o600)
    exclude = frozenset(filter(None, (m.strip() for m in c.tier_exclude.split(","))))
    return Tiering(index, writes, link, TierConfig(c.tier_backend, c.tier_address, c.tier_demote, c.tier_promote,
                                                  c.tier_low_watermark, exclude, c.tier_cooldown))

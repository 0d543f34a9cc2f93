"""Promote: a node's lookup misses brought back from the second tier, under the page fence.

``pending`` (after the index's own lookup) looks at the keys after the local hits: keys being
promoted or being checked count as *pending*, so are the READY keys among them; at the first key
the tier is known not to hold (a recent check: ``ABSENT_SECONDS``), or that an engine is storing,
the run ends. Keys nobody asked about yet go into one ``exists`` (meta lane) and count as pending
now: the reply never waits for the tier, and the check is sent ``CHECK_DELAY`` after it (checks
promised meanwhile go with it), so that the companion does not compete with the reply, and the
engine taking it in, for the CPU.

When ``exists`` answers, the leading run of keys the tier holds becomes a *promote job*: a
fenced write (``kvtierd.writes``, ``WriterKind.TIER``) whose writer is the companion — WRITING
entries with pages (made room for through the policy, as a store's), the pages fenced for the
companion's writer row before the ``get`` names them. On the get's final outcome the write
settles and completes: keys whose bytes landed whole become READY (READY last, invariant 1),
known to be in the tier; the others are freed — among them blocks whose seal the companion found
wrong (issue 26 G, invariant 14: counted by reason, ``seal_rejected_blocks``). Past its deadline the job aborts at once (the
entries go, the engine sees a miss) but its pages stay fenced, parked under the companion's row,
until the get's final outcome or the companion's death (invariant 9). A check older than
``PATIENCE`` seconds no longer counts as pending, and after a failed check lookups check nothing
for ``cooldown`` seconds: a slow or dead tier costs a lookup nothing. A check whose namespace was
taken over meanwhile promotes nothing (``Index.live``).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..contract.namespace import NamespaceId
from ..contract.codes import AbortCause, StoreOutcome
from ..contract.region_format import EntryState
from ..fence import Writer
from ..index import Index
from ..namespaces import Namespace
from ..tier.link import LinkBusy, LinkDown, Outcome
from ..tier.seal import REASONS
from ..writes import Write, Writes, WriterKind
from .companion import Companion
from .demote import Copies
from .interface import TierConfig

log = logging.getLogger(__name__)

PROMOTE_BATCH = 256           # blocks per get
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
READY = int(EntryState.READY)


@dataclass(eq=False)
class Check:
    """The context of an existence check."""

    ns: Namespace
    keys: list
    started: float
    timed_out: bool = False


@dataclass(eq=False)
class Promote:
    """A promote job (``JobKind.PROMOTE``): the companion writes its entries' pages."""

    id: int
    ns: Namespace
    writer: Writer
    write: Write
    started: float
    cause: AbortCause | None = None
    timed_out: bool = False


class Promotes:
    def __init__(self, index: Index, writes: Writes, companion: Companion, config: TierConfig, copies: Copies,
                 clock: Callable[[], float]):
        self.index = index
        self.writes = writes
        self.companion = companion
        self.config = config
        self.copies = copies
        self.clock = clock
        self.jobs: dict[int, Promote] = {}
        self._ids = itertools.count(1)
        self._checking: dict[NamespaceId, dict[bytes, Check]] = {}
        self._to_check: list[Check] = []       # checks promised by lookups, sent at the next pump
        self._absent: dict[NamespaceId, dict[bytes, float]] = {}
        self.off_until = 0.0                     # checks paused after a failed one
        self.counters: Counter = Counter()
        self.aborted: Counter = Counter()        # AbortCause value → promote jobs
        self.rejected: Counter = Counter()       # seal.REASONS → promoted blocks whose seal failed

    # ------------------------------------------------------------------ lookups
    def pending(self, ns: Namespace, keys: list[bytes], hits: int) -> int:
        """How many keys after the ``hits`` local ones are being promoted (or checked in the tier:
        this call promises the check of those nobody asked about yet). Never waits."""
        if hits >= len(keys) or not self.config.promote or not self.companion.ready or not self.config.serves(ns):
            return 0
        now = self.clock()
        if now < self.off_until or len(self._to_check) >= self.companion.room():
            return 0
        rest = keys[hits:]
        found = self.index.find(ns, rest)
        checking = self._checking.setdefault(ns.id, {})
        absent = self._absent.setdefault(ns.id, {})
        if ((found < 0).all() and not any(map(checking.__contains__, rest))
                and not any(map(absent.__contains__, rest))):
            self._check(ns, rest, now)          # the common case: a fresh miss
            return len(rest)
        promised = self._promised(found)
        if promised.all():                      # the other common case: all being promoted (or READY)
            return len(rest)
        pending, new = 0, []
        for key, slot, coming in zip(rest, found.tolist(), promised.tolist()):
            if slot >= 0:
                if coming:
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
            new.append(key)
            pending += 1
        if new:
            self._check(ns, new, now)
        return pending

    def _check(self, ns: Namespace, keys: list[bytes], now: float) -> None:
        """Promise a check of ``keys``: they count as being checked from now on; it is sent at the
        next ``pump``, after the lookup's reply."""
        ctx = Check(ns, keys, now)
        self._to_check.append(ctx)
        self._checking.setdefault(ns.id, {}).update(dict.fromkeys(keys, ctx))

    def send_checks(self, now: float) -> float | None:
        """Send the promised checks once CHECK_DELAY passed; returns when they are due, if not yet."""
        if not self._to_check:
            return None
        due = self._to_check[0].started + CHECK_DELAY
        if due > now:
            return due
        checks, self._to_check = self._to_check, []
        for ctx in checks:
            try:
                self.companion.submit("exists", ctx, ns=self.companion.identity(ctx.ns), keys=ctx.keys)
            except (LinkBusy, LinkDown) as exc:   # not checked: misses for now
                self.companion.errors[("exists", exc.code)] += 1
                self._forget_check(ctx)
                self._remember_absent(ctx.ns, ctx.keys, now + ABSENT_SECONDS)
        return None

    def _forget_check(self, ctx: Check) -> None:
        checking = self._checking.get(ctx.ns.id, {})
        for key in ctx.keys:
            if checking.get(key) is ctx:
                del checking[key]

    def checked(self, ctx: Check, o: Outcome, now: float) -> None:
        """An ``exists`` answered: the leading run of keys the tier holds is promoted."""
        ns = ctx.ns
        self._forget_check(ctx)
        if not o.ok:
            self.off_until = now + self.config.cooldown
            return
        present = o.result.get("present", b"")
        if len(present) != len(ctx.keys):
            return
        held = sum(present)
        self.counters["lookup_hit_keys"] += held
        self.counters["lookup_miss_keys"] += len(present) - held
        self._remember_absent(ns, [k for k, p in zip(ctx.keys, present) if not p], now + ABSENT_SECONDS)
        if not self.index.live(ns):             # taken over meanwhile: its engines are gone
            return
        run = []
        found = self.index.find(ns, ctx.keys)
        for key, held_it, slot, coming in zip(ctx.keys, present, found.tolist(), self._promised(found).tolist()):
            if not held_it:
                break
            if slot < 0:
                run.append(key)
            elif not coming:
                break
        for i in range(0, len(run), PROMOTE_BATCH):
            self._promote(ns, run[i:i + PROMOTE_BATCH], now)

    def _promised(self, found: np.ndarray) -> np.ndarray:
        """Per key's slot (-1: none), whether its local entry is one a lookup may count as coming:
        READY, or being written by a promote (an engine storing it is not the tier's to promise).
        For all the keys at once: per key, the enum lookups alone cost ~8 us (2-3 ms a lookup of
        256 keys being promoted, asked again every scheduler step)."""
        out = np.zeros(len(found), bool)
        have = found >= 0
        if have.any():
            slots = found[have]
            out[have] = (self.index.states(slots) == READY) | self.writes.written_by(slots, WriterKind.TIER)
        return out

    def _remember_absent(self, ns: Namespace, keys: list[bytes], until: float) -> None:
        if not keys:
            return
        absent = self._absent.setdefault(ns.id, {})
        absent.update(dict.fromkeys(keys, until))
        if len(absent) > ABSENT_KEYS:          # forget the oldest half
            for key in list(itertools.islice(absent, len(absent) // 2)):
                del absent[key]

    # ------------------------------------------------------------------ promote jobs
    def _promote(self, ns: Namespace, keys: list[bytes], now: float) -> None:
        """A promote job for keys the tier holds: a fenced write whose writer is the companion —
        WRITING entries, their pages fenced for it before the get names them."""
        writer = self.companion.current
        if writer is None:
            return
        job_id = next(self._ids)
        write, outcomes, _ = self.writes.begin(WriterKind.TIER, job_id, ns, keys)
        self._remember_absent(ns, [k for k, out in zip(keys, outcomes) if out == StoreOutcome.NO_SPACE],
                              now + ABSENT_SECONDS)
        slots = write.slots
        if not len(slots):
            return
        job = Promote(job_id, ns, writer, write, now)
        self.writes.hand(write, 0, writer)      # every shard (the tier holds whole entries), before the get
        try:
            self.companion.submit("get", job, **self.companion.fields(ns, slots))
        except (LinkBusy, LinkDown):
            self.writes.settle(write, 0)        # never sent: nothing landed
            self.writes.complete(write, bytes(len(slots)))
            self._remember_absent(ns, keys, now + ABSENT_SECONDS)
            return
        self.jobs[job.id] = job
        self.counters["promote_jobs"] += 1

    def fetched(self, job: Promote, o: Outcome, now: float) -> None:
        """A get's outcome: past its deadline, the job aborts (a miss for the engine; the pages
        stay fenced); final, the companion is done with the pages."""
        if not o.final:
            self._abort(job, AbortCause.TIER_TIMEOUT)
            return
        self.jobs.pop(job.id, None)
        write = job.write
        self.writes.settle(write, 0)            # aborted earlier: its parked pages come back (a late final)
        if not write.open:
            return
        slots = write.slots
        done = o.result.get("done", b"") if o.ok else b""
        done = done if len(done) == len(slots) else bytes(len(slots))
        # Blocks whose seal failed (issue 26 G) did not land: the companion says why.
        self.rejected.update({r: int(n) for r, n in o.result.get("rejected", {}).items() if r in REASONS})
        landed = self.writes.complete(write, done)
        lost = [key for key, d in zip(self.index.keys_of(slots), done) if not d] if done.count(0) else []
        if lost:
            self._remember_absent(job.ns, lost, now + ABSENT_SECONDS)
            self.counters["promote_failed_blocks"] += len(lost)
        if len(landed):
            self.copies.promoted(landed.tolist(), self.index.ticks_of(landed).tolist())
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
        keys = self.index.keys_of(write.slots)
        self.writes.abort(write)
        self._remember_absent(job.ns, keys, self.clock() + ABSENT_SECONDS)
        self.counters["promote_failed_blocks"] += len(keys)
        self.aborted[cause.value] += 1
        log.info("promote job %d (%d blocks) aborted: %s", job.id, len(keys), cause.value)

    def companion_gone(self, writer: Writer) -> None:
        """The companion of ``writer`` was reaped: its jobs abort, and no final outcome will come."""
        for job in [j for j in self.jobs.values() if j.writer is writer]:
            self._abort(job, AbortCause.TIER_FAILED)
            self.writes.drop_writer(job.write, 0)
            del self.jobs[job.id]

    def stats(self) -> dict:
        c = self.counters
        return {"promoted_blocks": c["promoted_blocks"], "promoted_bytes": c["promoted_bytes"],
                "promoting_blocks": sum(len(j.write.slots) for j in self.jobs.values() if j.write.open),
                "promote_failed_blocks": c["promote_failed_blocks"], "promote_jobs": c["promote_jobs"],
                "promote_jobs_done": c["promote_jobs_done"], "promote_aborted": dict(self.aborted),
                "seal_rejected_blocks": {r: self.rejected[r] for r in REASONS},
                "lookup_keys": {"hit": c["lookup_hit_keys"], "miss": c["lookup_miss_keys"]}}

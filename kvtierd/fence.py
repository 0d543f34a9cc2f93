"""The writer fence (invariant 9): pages handed to a writer that has not committed go to nobody
else until that writer provably cannot write into them any more — across the daemon's restarts.

A *writer* is a rank session that is handed pages to copy into (rank 0 of a replicated engine,
every rank of a sharded one). Each has a row in the region's writer table saying how to prove
its process gone; the fence table says, per page, which writer row may still copy into it. The
fence is written before a store reply hands pages out (``hand``) and cleared when the writer's
commit is accepted (``settle``). When a job aborts while a writer still holds its pages, the
entries go at once but the pages stay fenced, *parked* under the writer (``park``), until:

- the writer commits that job after all (ok or not: it copies no more): ``release_job``;
- it says bye (the client waits for its copies first), or it attaches again naming its old
  session and token (the client waits for its copies before re-attaching): ``detach`` with a
  proof, ``reattached``;
- its process dies: a pidfd, for a process the daemon can see (its PID namespace or a child of
  it); after a restart, its recorded pid no longer names a process with its start time, or the
  boot changed: ``died``, ``recover``. Only that is a proof: when the daemon cannot check the
  process (out of descriptors or memory: EMFILE, ENFILE, ENOMEM), the pages stay fenced and the
  check is made again every ``RECHECK_SECONDS`` (``expire``);
- only for a writer the daemon cannot watch (pid 0: a sibling PID namespace, e.g. another pod),
  ``grace`` seconds after it was last seen: ``expire``. A writer frozen longer than that could
  still scribble over reused pages; docs/reliability.md states that residual risk;
- the data file was truncated under the daemon and replaced by a new one (``reset``): every page
  the fence named was a page of the old file, and a writer still copying copies into its own
  mapping of that old file, never into the new one (it maps the new file only when it attaches
  again, after waiting for its copies).

A watchable writer keeps its pages for as long as it lives, however long it stalls: they are
reported (``stats``: fenced pages by reason, and the age of the oldest), never released on a
timer. A lost heartbeat is not a proof of death: the session's rights (votes, pins) end, its
pages stay. The fence owns no free list: whatever it releases it returns, and the caller (the
fenced write, ``kvtierd.writes``) gives the pages back to the index.

The writer table is bounded: ``max_rows`` rows in all (the region format's WRITER_SLOTS, fewer
when the daemon's open-files limit cannot hold a pidfd for each: ``kvtierd.daemon.fit_fd_caps``),
and ``max_rows_per_peer`` from one peer (a process; every process of a uid the daemon cannot see,
together: as sessions are counted, ``kvtierd.peers``), counting the rows of writers gone whose
pages are still fenced. A writer looping "hello, store, close the socket" thus fills its own
share only, and is told which bound it hit.

Persistence: a row is written, its state last, before any page names it; all pages naming a row
are cleared before the row is freed. ``last_seen`` is stamped on CLOCK_MONOTONIC (system-wide,
from boot), so a restarted daemon of the same boot counts a writer's grace from it. ``recover``
rebuilds the writers from the tables and parks every fenced page that no READY entry holds.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .contract.codes import ErrorCode, RequestError
from .contract.protocol import PAGES_DTYPE
from .contract.region_format import FENCE_NONE, WRITER_DTYPE, WRITER_SLOTS, WriterState
from .contract.region_view import RegionView
from .pages import FreeStack
from .processes import Process, boot_id, open_if_same, own_pid_namespace
from .recovery import RegionScan

log = logging.getLogger(__name__)

NO_PAGES = np.zeros(0, dtype=PAGES_DTYPE)
# Seconds between checks of a gone writer whose process could not be checked (the daemon was out of
# descriptors or memory): until one proves it dead or watches it, its pages stay fenced.
RECHECK_SECONDS = 1.0
ROW_CAPS = ("total", "per_peer")    # the bounds a writer row is refused past (kvtierd_writer_rows_refused_total)


class Release(str, enum.Enum):
    """Why fenced pages came back (the ``cause`` of kvtierd_fence_released_pages_total)."""

    COMMITTED = "committed"       # the writer committed the job (ok or not, the job aborted or not)
    LEFT = "left"                 # bye: the client waits for its copies before it says bye
    REATTACHED = "reattached"     # a hello named the session and its token (the copies were waited for)
    DIED = "died"                 # its process is gone: pidfd, or after a restart pid/start time/boot
    GRACE = "grace"               # a writer the daemon cannot watch was not seen for the grace period
    REGION_REPLACED = "region_replaced"   # the data file was truncated and replaced: its pages are gone


class Reason(str, enum.Enum):
    """Why pages are fenced now (the ``reason`` of kvtierd_fenced_pages)."""

    WRITER_ALIVE = "writer_alive"           # its session is attached, or its process lives (pidfd)
    RESTART_RECOVERY = "restart_recovery"   # held across a restart: until death, re-attach or grace
    GRACE = "grace"                         # not watchable and not seen: until its re-attach or the grace
    UNPROVEN = "unproven"                   # its process could not be checked (EMFILE, ENOMEM, ...): retried


@dataclass(eq=False)
class Writer:
    row: int                    # in the region's writer table
    session: int
    token: int
    process: Process            # pid 0: the daemon cannot watch it
    last_seen: float            # the fence's clock: its last proof of life
    attached: bool = True       # its session is live
    recovered: bool = False     # carried over a daemon restart
    pidfd: int | None = None    # watched while detached
    parked: dict = field(default_factory=dict)      # job id (None: found by recovery) → fenced pages
    parked_since: float | None = None
    peer: tuple | None = None   # (uid, pid; 0 when not visible), as sessions count peers; None: no socket

    @property
    def parked_count(self) -> int:
        return sum(map(len, self.parked.values()))

    @property
    def reason(self) -> Reason:
        if self.attached:
            return Reason.WRITER_ALIVE
        if self.recovered:
            return Reason.RESTART_RECOVERY
        if self.pidfd is not None:
            return Reason.WRITER_ALIVE
        return Reason.UNPROVEN if self.process.watchable else Reason.GRACE


class Fence:
    """The writer rows and the per-page fence of a region. ``recover`` must run before use."""

    def __init__(self, view: RegionView, grace: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 max_rows: int = WRITER_SLOTS, max_rows_per_peer: int = 256):
        self.view = view
        self.table = view.fence                 # page → writer row, or FENCE_NONE
        self.rows = view.writers
        self.grace = grace
        self.clock = clock
        self.pidns = own_pid_namespace() or 0
        self.boot = boot_id()
        self.writers: dict[int, Writer] = {}                    # row → writer
        self.pidfds: dict[int, Writer] = {}                     # pidfd → detached writer it watches
        self.released: Counter = Counter()                      # Release value → pages
        self._free_rows = FreeStack(WRITER_SLOTS)
        self._gone: dict[tuple[int, int], Writer] = {}         # (session, token) → writers without a session
        self._graces: list[tuple[float, int, int, Writer]] = []  # (deadline, seq, row, writer)
        self._unproven: dict[int, Writer] = {}                  # row → gone writer whose process was not checked
        self._recheck_at = 0.0
        self.check_failures = 0                                 # checks of a process that could not be done
        self.max_rows = min(max_rows, WRITER_SLOTS)             # fewer when the open-files limit is short
        self.max_rows_per_peer = max_rows_per_peer
        self.per_peer: Counter = Counter()                      # peer → its rows
        self.refused: Counter = Counter()                       # writer rows refused: total | per_peer
        self._seq = itertools.count()
        self._watch: Callable[[int], None] = lambda fd: None
        self._unwatch: Callable[[int], None] = lambda fd: None

    def watch_with(self, watch: Callable[[int], None], unwatch: Callable[[int], None]) -> None:
        """Hand pidfds to a poller (the server's): those opened so far, and every later one."""
        self._watch, self._unwatch = watch, unwatch
        for fd in self.pidfds:
            watch(fd)

    # ------------------------------------------------------------------ recovery
    def recover(self, found: RegionScan) -> np.ndarray:
        """Rebuild the writers from the tables (``found``: the scan of them) and return the pages
        to keep from the free list: those still fenced for a writer not proven gone.

        A page a sound READY entry holds is that entry's (every writer committed it); a fence
        naming no row in use is cleared. Each row holding pages is proven: of another boot, or a
        pid of this PID namespace that is gone or names another process (start time): dead, its
        pages free. A living one is watched; one the daemon cannot watch waits for its re-attach
        or the grace period from ``last_seen``.
        """
        table, rows = self.table, self.rows
        table[np.flatnonzero((table != FENCE_NONE) & (found.owner >= 0))] = FENCE_NONE
        table[found.stale_fence] = FENCE_NONE
        order = np.argsort(found.fenced_rows, kind="stable")
        by_row = dict(zip(*_groups(found.fenced_rows[order], found.fenced[order])))
        kept, used = [], []
        now = self.clock()
        for row in found.writers.tolist():
            pages = by_row.get(row)
            rec = rows[row]
            if pages is None:                       # nothing fenced: the row is free again
                rows["state"][row] = WriterState.FREE
                continue
            same_ns = int(rec["pidns"]) == self.pidns and int(rec["boot"]) == self.boot
            writer = Writer(row, int(rec["session"]), int(rec["token"]),
                            Process(int(rec["pid"]) if same_ns else 0, int(rec["start_ticks"]) if same_ns else 0),
                            float(rec["last_seen"]), attached=False, recovered=True,
                            parked={None: pages.astype(PAGES_DTYPE)}, parked_since=now)
            self.writers[row] = writer
            rows["state"][row] = WriterState.DETACHED
            engine = bytes(rec["engine"]).decode(errors="replace")
            what = (f"writer row {row} (engine {engine!r} rank {int(rec['rank'])}, pid {int(rec['pid'])}) holds "
                    f"{len(pages)} fenced pages from before the restart")
            if int(rec["boot"]) != self.boot:
                log.info("%s; it ran in another boot: released", what)
                self._release(writer, Release.DIED)
                continue
            if writer.process.watchable:
                if not self._watch_process(writer):
                    log.info("%s; its process is gone: released", what)
                    self._release(writer, Release.DIED)
                    continue
                log.warning("%s; its process lives (or could not be checked): fenced until it dies or re-attaches",
                            what)
            else:
                self._wait_grace(writer)
                log.warning("%s; it cannot be watched from here: fenced until it re-attaches or %.0fs after it was "
                            "last seen", what, self.grace)
            self._gone[(writer.session, writer.token)] = writer
            kept.append(writer.parked[None])
            used.append(row)
        self._free_rows = FreeStack(WRITER_SLOTS, used)
        return np.concatenate(kept) if kept else NO_PAGES

    # ------------------------------------------------------------------ writers
    def add(self, session: int, token: int, process: Process, engine: str, rank: int) -> Writer:
        """A row for a new writer session (written before any page can name it). Its peer (the
        process; every process of a uid the daemon cannot see, together) holds at most
        ``max_rows_per_peer`` rows, attached or gone with pages fenced (LIMIT past it); all peers
        together at most ``max_rows`` (NO_SPACE)."""
        peer = (process.uid, process.pid) if process.uid is not None else None   # None: no socket (the tier's)
        if peer is not None and self.per_peer[peer] >= self.max_rows_per_peer:
            self.refused["per_peer"] += 1
            who = f"uid {process.uid} pid {process.pid or '(not visible)'}"
            raise RequestError(ErrorCode.LIMIT, f"{who} already holds {self.max_rows_per_peer} writer rows: writers "
                               "attached, and writers gone whose pages stay fenced until they are proven done "
                               "(setting max_writer_rows_per_peer; fence_grace for writers the daemon cannot watch); "
                               "retry later")
        rows = self._free_rows.alloc(1) if len(self.writers) < self.max_rows else None
        if rows is None:
            self.refused["total"] += 1
            bound = ("the region format's bound" if self.max_rows == WRITER_SLOTS
                     else "what the open-files limit holds: raise LimitNOFILE")
            raise RequestError(ErrorCode.NO_SPACE,
                               f"all {self.max_rows} writer rows ({bound}) are taken by attached writers and by "
                               "writers gone whose pages are still fenced (kvtierctl stats: writer_rows, "
                               "fenced_pages); retry later")
        row = rows[0]
        now = self.clock()
        rec = np.zeros((), WRITER_DTYPE)
        rec["rank"], rec["pid"], rec["start_ticks"], rec["boot"] = rank, process.pid, process.start_ticks, self.boot
        rec["pidns"] = self.pidns if process.pid else 0
        rec["token"], rec["session"], rec["last_seen"] = token, session, now
        rec["engine"] = engine.encode()[:64]
        self.rows[row] = rec
        self.rows["state"][row] = WriterState.ATTACHED      # last: the row is whole before it counts
        writer = Writer(row, session, token, process, now, peer=peer)
        self.writers[row] = writer
        if peer is not None:
            self.per_peer[peer] += 1
        return writer

    def holds(self, writer: Writer) -> bool:
        """Whether ``writer``'s row is still in use (not released)."""
        return self.writers.get(writer.row) is writer

    def hand(self, writer: Writer, pages: np.ndarray) -> None:
        """``pages`` go to ``writer`` to copy into: fenced before the reply carries them."""
        self.table[pages] = writer.row

    def settle(self, writer: Writer, pages: np.ndarray) -> None:
        """The writer committed the job these pages belong to: it copies no more into them (they
        stay with their entries)."""
        self.table[pages] = FENCE_NONE

    def park(self, writer: Writer, job: int, pages: np.ndarray) -> None:
        """The job aborted while ``writer`` may still copy into ``pages``: they stay fenced, held by
        the writer instead of by entries, until it is proven done."""
        if not len(pages):
            return
        held = writer.parked.get(job)
        writer.parked[job] = pages if held is None else np.concatenate([held, pages])
        if writer.parked_since is None:
            writer.parked_since = self.clock()

    def release_job(self, writer: Writer, job: int) -> np.ndarray:
        """The writer committed an aborted job: the pages parked for it are free."""
        pages = writer.parked.pop(job, None)
        if pages is None:
            return NO_PAGES
        self._clear(pages, Release.COMMITTED)
        if not writer.parked:
            writer.parked_since = None
        return pages

    def detach(self, writer: Writer, proof: Release | None, last_seen: float) -> np.ndarray:
        """The writer's session ended (its open jobs already parked their pages). With a ``proof``
        that it cannot write, its pages are released and returned; without one they stay fenced:
        its process is watched if the daemon can see it, else the grace period starts."""
        writer.attached = False
        writer.last_seen = last_seen
        self.rows["last_seen"][writer.row] = last_seen
        if proof is not None or not writer.parked:
            return self._release(writer, proof or Release.LEFT)
        self.rows["state"][writer.row] = WriterState.DETACHED
        self._gone[(writer.session, writer.token)] = writer
        if writer.process.watchable:
            if not self._watch_process(writer):
                return self._release(writer, Release.DIED)
        else:
            self._wait_grace(writer)
        log.info("writer row %d (session %d, pid %d) left with %d pages fenced (%s)", writer.row, writer.session,
                 writer.process.pid, writer.parked_count, writer.reason.value)
        return NO_PAGES

    def reattached(self, session: int, token: int | None) -> np.ndarray:
        """A hello named a session that is gone (dropped, or of the daemon before a restart) with its
        token: that client waited for its copies, so its pages are free."""
        writer = self._gone.get((session, token))
        if writer is None:
            return NO_PAGES
        return self._release(writer, Release.REATTACHED)

    def died(self, pidfd: int) -> np.ndarray:
        """The pidfd of a detached writer became readable: its process died."""
        writer = self.pidfds.get(pidfd)
        return NO_PAGES if writer is None else self._release(writer, Release.DIED)

    def expire(self, now: float) -> tuple[np.ndarray, float | None]:
        """Release the writers the daemon cannot watch whose grace period ended, and check again the
        processes that could not be checked (those proven gone are released). Returns (the pages
        released, when to come back: the next grace deadline or check)."""
        freed = []
        if self._unproven and now >= self._recheck_at:
            self._recheck_at = now + RECHECK_SECONDS
            for writer in list(self._unproven.values()):
                if not self._watch_process(writer):
                    log.info("writer row %d (session %d, pid %d) is gone: its %d fenced pages are released",
                             writer.row, writer.session, writer.process.pid, writer.parked_count)
                    freed.append(self._release(writer, Release.DIED))
        while self._graces and self._graces[0][0] <= now:
            _, _, row, writer = heapq.heappop(self._graces)
            if self.writers.get(row) is writer and not writer.attached and writer.pidfd is None:
                log.warning("writer row %d (session %d) not seen for %.0fs and not watchable: its %d fenced pages "
                            "are released (fence_grace)", row, writer.session, now - writer.last_seen,
                            writer.parked_count)
                freed.append(self._release(writer, Release.GRACE))
        deadlines = [self._graces[0][0]] if self._graces else []
        if self._unproven:
            deadlines.append(self._recheck_at)
        return (np.concatenate(freed) if freed else NO_PAGES), min(deadlines, default=None)

    def stamp(self, seen: list[tuple[Writer, float]]) -> None:
        """Attached writers' last proofs of life, persisted (a restarted daemon counts grace from them)."""
        if seen:
            writers, times = zip(*seen)
            for writer, t in seen:
                writer.last_seen = t
            self.rows["last_seen"][np.fromiter((w.row for w in writers), np.intp, len(writers))] = times

    def reset(self) -> np.ndarray:
        """The data file was replaced (every session ended first): release every writer and clear
        both tables, since the pages they named are gone. Returns the pages released."""
        assert not any(w.attached for w in self.writers.values()), "reset with writers attached"
        freed = [self._release(writer, Release.REGION_REPLACED) for writer in list(self.writers.values())]
        self.table[:] = FENCE_NONE
        return np.concatenate(freed) if freed else NO_PAGES

    # ------------------------------------------------------------------ internals
    def _watch_process(self, writer: Writer) -> bool:
        """Watch a gone writer's process through a pidfd. False when it is proven gone (ESRCH, or
        another process has its pid); a check that could not be done (the daemon out of descriptors
        or memory: EMFILE, ENFILE, ENOMEM, ...) proves nothing: its pages stay fenced and it is
        checked again ``RECHECK_SECONDS`` later (``expire``)."""
        try:
            fd = open_if_same(writer.process.pid, writer.process.start_ticks)
        except OSError as exc:
            self.check_failures += 1
            if writer.row not in self._unproven:
                if not self._unproven:
                    self._recheck_at = self.clock() + RECHECK_SECONDS
                self._unproven[writer.row] = writer
                log.warning("cannot check writer row %d's process (pid %d): %s; its %d pages stay fenced, checked "
                            "again every %.0fs", writer.row, writer.process.pid, exc.strerror or exc,
                            writer.parked_count, RECHECK_SECONDS)
            return True
        self._unproven.pop(writer.row, None)
        if fd is None:
            return False
        writer.pidfd = fd
        self.pidfds[fd] = writer
        self._watch(fd)
        return True

    def _wait_grace(self, writer: Writer) -> None:
        heapq.heappush(self._graces, (writer.last_seen + self.grace, next(self._seq), writer.row, writer))

    def _clear(self, pages: np.ndarray, cause: Release) -> None:
        self.table[pages] = FENCE_NONE
        self.released[cause.value] += len(pages)

    def _release(self, writer: Writer, cause: Release) -> np.ndarray:
        """All of the writer's pages come back and its row is freed (pages first, row last)."""
        pages = np.concatenate(list(writer.parked.values())) if writer.parked else NO_PAGES
        self._clear(pages, cause)
        writer.parked.clear()
        writer.parked_since = None
        if writer.pidfd is not None:
            self._unwatch(writer.pidfd)
            del self.pidfds[writer.pidfd]
            os.close(writer.pidfd)
            writer.pidfd = None
        self._gone.pop((writer.session, writer.token), None)
        self._unproven.pop(writer.row, None)
        if writer.peer is not None:
            self.per_peer[writer.peer] -= 1
            if not self.per_peer[writer.peer]:
                del self.per_peer[writer.peer]
        del self.writers[writer.row]
        self.rows["state"][writer.row] = WriterState.FREE
        self._free_rows.free([writer.row])
        return pages

    # ------------------------------------------------------------------ what is going on
    def parked_pages(self) -> np.ndarray:
        """Every parked page (fenced, held by no entry)."""
        held = [p for w in self.writers.values() for p in w.parked.values()]
        return np.concatenate(held) if held else NO_PAGES

    def stats(self) -> dict:
        now = self.clock()
        by_reason = dict.fromkeys((r.value for r in Reason), 0)
        oldest = 0.0
        for writer in self.writers.values():
            if writer.parked:
                by_reason[writer.reason.value] += writer.parked_count
                oldest = max(oldest, now - writer.parked_since)
        return {
            "pages_fenced": sum(by_reason.values()),
            "fenced_pages": by_reason,
            "fence_released_pages": {c.value: self.released[c.value] for c in Release},
            "fence_oldest_seconds": oldest,
            "fence_grace_seconds": self.grace,
            "writer_rows": len(self.writers),
            "fence_check_failures": self.check_failures,
            "writer_rows_refused": {cap: self.refused[cap] for cap in ROW_CAPS},
        }

    def verify(self, handed: dict[int, list[np.ndarray]]) -> None:
        """Check the tables against the writers (tests): the pages the fence table gives each row are
        exactly its parked pages plus ``handed[row]`` (pages of open jobs it holds, uncommitted)."""
        table = self.table
        named = np.flatnonzero(table != FENCE_NONE)
        assert set(np.unique(table[named]).tolist()) <= set(self.writers), "a page names a row not in use"
        for row, writer in self.writers.items():
            assert int(self.rows["state"][row]) == (WriterState.ATTACHED if writer.attached else WriterState.DETACHED)
            want = np.sort(np.concatenate([*writer.parked.values(), *handed.get(row, []), NO_PAGES]).astype(np.int64))
            got = named[table[named] == row]
            assert np.array_equal(want, got), f"writer row {row}: fence table {got.tolist()} != {want.tolist()}"
        assert self.per_peer == Counter(w.peer for w in self.writers.values() if w.peer is not None), "rows per peer"
        assert all(self.writers.get(row) is w and not w.attached and w.pidfd is None
                   for row, w in self._unproven.items()), "an unproven writer that is watched or attached"
        in_use = np.flatnonzero(self.rows["state"] != WriterState.FREE)
        assert set(in_use.tolist()) == set(self.writers), "writer rows in use differ from the writers"

    def close(self) -> None:
        """Stop watching (the daemon stops; the tables keep the fence for the next one)."""
        for fd in list(self.pidfds):
            self._unwatch(fd)
            os.close(fd)
            self.pidfds[fd].pidfd = None
        self.pidfds.clear()


def _groups(keys: np.ndarray, values: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """(distinct keys, the values of each) of ``values`` sorted by ``keys``."""
    if not len(keys):
        return [], []
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[starts].tolist(), np.split(values, starts[1:])

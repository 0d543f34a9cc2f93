"""The event log: per namespace, in order, which keys became READY and which left, for the readers
that follow a namespace's contents (coordinator sessions over the protocol, the daemon's own KV
events publisher). No sockets, no threads: the index's observer appends, readers read with a
cursor, and the log forgets its oldest records to stay within its memory budget.

- **Records.** Each call of ``stored`` or ``removed`` (one store job's entries, one eviction, one
  clear) becomes one or more records: the keys of one length, at most ``RECORD_KEYS`` of them, as
  one bytes blob (36 bytes per vLLM key, no Python object per key kept alive), under the next
  sequence number of the namespace's log. A removal names its cause (``Cause``).
- **Cursors.** A namespace's log has an ``epoch`` (random, new with every daemon start and every
  new use of a namespace slot) and numbers its records 1, 2, 3, ... A reader holds (epoch,
  cursor = the last sequence number it applied) and ``read`` returns the records after it,
  batched (``max_keys``): one request, not one per event.
- **Falling behind is told, never silent.** Memory is bounded by one budget for all namespaces
  (``budget_bytes``): past it the oldest records go (down to ``TRIM_SLACK`` below it), whoever
  has read them or not, so a reader that never reads costs nothing. A cursor the log can no longer continue (its records are gone,
  another epoch, or none) gets ``reset``: the reader starts its view again from empty, and the
  reply carries, besides the records after the reset point, pages of a *snapshot* — the READY keys
  of a range of entry slots as they are at the time of the reply — until ``snapshot_next`` is None.
  Applying records and pages in reply order gives exactly the READY keys (tests/unit/
  test_events.py proves it for any interleaving): a page taken at time t lists what its slots hold
  at t, every change after t comes as a record, and pages only add keys.
- **Consistency with the index.** What the observer appends is queued and taken into the logs
  (``settle``) once the reply of the request that made it is sent, and first thing by every read
  (the daemon's own stream reads at every turn of its loop; appends made outside a request, by
  the second tier's turn or a timer, wait for the next read or reply); the snapshot reads the
  entry table, whose state byte says READY exactly while the index does (kvtierd.index): then a
  snapshot page and the records agree at every read. The queue keeps the keys' reads and the
  log's bookkeeping off the replies of the store and commit requests that record: the Recorder
  queues slots, and the keys are read when the log takes them (``Recorder`` says how that stays
  exact).
- **Fed by the index's events** (``Recorder``, a listener of ``kvtierd.events``): a namespace's
  log is kept from its first read on (``follow``; every namespace's while the daemon publishes
  its own stream), so that a namespace nobody follows costs nothing; its first read resets onto
  a snapshot anyway. Logs are keyed by the namespace's table slot; a slot taken over by another
  namespace ends the log (``forget``): a reader of the new one starts on a new epoch.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Protocol, Sequence

import numpy as np

from .contract.events import Cause, Kind
from .events import EntryEvents, Gone
from .keycopies import KeyCopies
from .records import ready_slots

logger = logging.getLogger(__name__)

# A run of keys to append: (namespace, kind, cause, key length, blob).
Run = tuple[Hashable, Kind, str | None, int, bytes]

# A record holds at most this many keys (a batch is cut into several), so that any reply of at
# least RECORD_KEYS keys moves a reader on by at least one record.
RECORD_KEYS = 4096
# Past its budget the log drops its oldest records until it is this share of the budget below it:
# with the stream on every store job appends records, and a trim per append cost each ~1 µs of
# the daemon's loop (through the daemon, thread time); a 32nd of the budget is ~27 store jobs of
# 256 keys at the bench's 8 MiB.
TRIM_SLACK = 1 / 32
# Appends queued before the log takes them (``EventLog.append_later``): a request's, a few (a store
# and its eviction's); the bound holds the queue where nothing settles it. Each holds a request's
# slots or a blob it made anyway (an operator's clear of everything, one); taking it trims the log
# to budget.
PENDING_RUNS = 64
# What a record costs besides its keys (the Record, its slot in two containers), for the budget.
RECORD_OVERHEAD = 200
# Entry slots a snapshot page scans per NumPy pass, and at most per page: a page of a sparse
# namespace in a large region ends early (its reader asks for the next) rather than hold the
# daemon's loop for a scan of the whole table (measured: 256Ki slots of the region's 128-byte
# records in ~4 ms on a loaded 2-core VM; 1Mi slots took 35 ms).
SCAN_SLOTS = 1 << 16
MAX_SCAN_SLOTS = 1 << 18


@dataclass(slots=True)
class Record:
    seq: int
    kind: Kind
    cause: str | None
    key_len: int
    keys: bytes              # ``count`` keys of key_len bytes, in the order given
    upto: int = 0            # keys appended to the namespace's log up to and including this record
    count: int = 0           # len(keys) // key_len, kept: readers ask it of every record they pass

    def to_wire(self) -> list:
        return [self.seq, int(self.kind), self.cause, self.key_len, self.keys]


class SnapshotSource(Protocol):
    def ready_keys(self, ns: Hashable, start: int, limit: int) -> tuple[list[tuple[int, bytes]], int, int | None]:
        """READY keys of ``ns`` in entry slots from ``start`` on, at most about ``limit`` of them:
        (runs of (key length, keys blob), how many keys, the slot to go on from or None at the end)."""


class TableSnapshot:
    """Snapshot pages read from the region's entry table (state, ns, key_len and key columns):
    vectorised, whatever holds the index's own per-entry state. ``ns`` is the namespace slot."""

    def __init__(self, entries: np.ndarray, scan_slots: int = SCAN_SLOTS, max_scan_slots: int = MAX_SCAN_SLOTS):
        self.entries = entries
        self.scan_slots, self.max_scan_slots = scan_slots, max_scan_slots

    def ready_keys(self, ns: int, start: int, limit: int) -> tuple[list[tuple[int, bytes]], int, int | None]:
        table = self.entries
        total, pos, slots = len(table), start, []
        found, stop = 0, min(total, start + self.max_scan_slots)
        while pos < stop and found < limit:
            end = min(stop, pos + self.scan_slots)
            hit = ready_slots(table, ns, pos, end)
            if found + len(hit) >= limit:
                hit = hit[:limit - found]
                end = int(hit[-1]) + 1
            slots.append(hit)
            found += len(hit)
            pos = end
        hit = np.concatenate(slots) if slots else np.zeros(0, np.intp)
        rows, lengths = table["key"][hit], table["key_len"][hit]
        runs = [(int(n), rows[lengths == n, :n].tobytes()) for n in np.unique(lengths).tolist()]
        return runs, len(hit), (pos if pos < total else None)


@dataclass
class EventsRead:
    """One read of a namespace's log: what the events op replies (its wire map: ``to_wire``)."""

    epoch: int
    seq: int                              # the cursor to send next: the last record given (or the reset point)
    reset: bool                           # start the view again from empty: the cursor could not be continued
    records: list[Record]
    snapshot: list[tuple[int, bytes]]     # runs (key length, keys) of READY keys in a range of slots
    snapshot_next: int | None             # the slot to ask the next page from; None: no snapshot in progress
    behind: int                           # records after ``seq`` still to read

    def to_wire(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "reset": self.reset,
                "records": [r.to_wire() for r in self.records], "snapshot": [list(run) for run in self.snapshot],
                "snapshot_next": self.snapshot_next, "behind": self.behind}


@dataclass(eq=False)
class _Log:
    """One namespace's records: a list with a head offset (the oldest ones dropped), contiguous
    sequence numbers, so that a cursor's position is arithmetic."""

    epoch: int
    seq: int = 0                          # of the newest record (0: none yet)
    base: int = 1                         # sequence number of records[0]
    head: int = 0                         # records[:head] are dropped
    keys: int = 0                         # keys appended, ever (Record.upto counts them)
    records: list = field(default_factory=list)
    live: bool = True

    @property
    def floor(self) -> int:
        """The oldest cursor the log can continue: every record after it is held."""
        return self.base + self.head - 1

    def after(self, cursor: int) -> int:
        """Index in ``records`` of the first record after ``cursor`` (floor <= cursor <= seq)."""
        return cursor + 1 - self.base

    def drop_oldest(self) -> None:
        self.head += 1
        if self.head > 1024 and self.head * 2 > len(self.records):
            del self.records[:self.head]
            self.base += self.head
            self.head = 0


class EventLog:
    """Per-namespace event logs within one memory budget (see the module docstring)."""

    def __init__(self, snapshot: SnapshotSource, budget_bytes: int, new_epoch=lambda: secrets.randbits(63)):
        if budget_bytes <= 0:
            raise ValueError("the event log needs a positive budget")
        self.snapshot = snapshot
        self.budget_bytes = budget_bytes
        self._new_epoch = new_epoch
        self._logs: dict[Hashable, _Log] = {}
        # Told before a namespace's log ends (``forget``), so that a reader in the daemon itself
        # (the KV events publisher) takes its last records first.
        self.forgetting: Callable[[Hashable], None] | None = None
        self._fifo: deque[tuple[_Log, Record]] = deque()   # every held record, oldest first
        self.bytes = 0
        # Counters (kvtierd_events_*): keys appended by kind, keys dropped unread or not, reads
        # that reset a reader, snapshot keys sent.
        self.appended = {Kind.STORED: 0, Kind.REMOVED: 0}
        self._news = 0                    # records appended, ever: a reader's cheap "anything new?"
        self._pending: list[Callable[[], Iterable[Run]]] = []   # appends not yet taken (``settle``)
        self._settling = False
        self._broken = False              # a failed append's feed not whole again yet (``settle``)
        self.removed_by_cause = dict.fromkeys((c.value for c in Cause), 0)
        self.dropped_keys = 0
        self.resets = 0
        self.snapshot_keys = 0
        self.failed_runs = 0
        # Told after a queued append failed (a bug) and every log ended: whoever feeds the log makes
        # what its appends read whole again (``Recorder``: the key copies).
        self.failing: Callable[[], None] | None = None

    # ------------------------------------------------------------------ the observer's side
    def stored(self, ns: Hashable, keys: Sequence[bytes]) -> None:
        """``keys`` (of namespace ``ns``) became READY, in this order."""
        self.stored_runs(ns, _runs(keys))

    def removed(self, ns: Hashable, keys: Sequence[bytes], cause: Cause) -> None:
        """READY ``keys`` of ``ns`` left, for ``cause``."""
        self.removed_runs(ns, _runs(keys), cause)

    def stored_runs(self, ns: Hashable, runs: Sequence[tuple[int, bytes]]) -> None:
        """``stored`` of keys given as (key length, blob) runs: no bytes object per key."""
        for key_len, blob in runs:
            self.append(ns, Kind.STORED, None, key_len, blob)

    def removed_runs(self, ns: Hashable, runs: Sequence[tuple[int, bytes]], cause: Cause) -> None:
        """``removed`` of keys given as (key length, blob) runs."""
        cause = Cause(cause).value
        for key_len, blob in runs:
            self.append(ns, Kind.REMOVED, cause, key_len, blob)

    def forget(self, ns: Hashable) -> None:
        """The namespace is gone (its slot reclaimed for another): its log ends; a reader of it
        is reset (to a namespace that has nothing) on its next read."""
        self.settle()
        if ns in self._logs and self.forgetting is not None:
            self.forgetting(ns)
        log = self._logs.pop(ns, None)
        if log is not None:
            log.live = False
            held = log.records[log.head:]
            self.bytes -= sum(len(r.keys) + RECORD_OVERHEAD for r in held)

    def append(self, ns: Hashable, kind: Kind, cause: str | None, key_len: int, blob: bytes) -> None:
        """One run of keys (``blob``: ``key_len`` bytes each) as the next record of ``ns``'s log,
        several when it holds more than RECORD_KEYS keys; ``cause``: a removal's ``Cause`` value
        (None for a store). Queued, as ``append_later``'s runs are."""
        if blob:
            self.append_later(lambda: ((ns, kind, cause, key_len, blob),))

    def append_later(self, runs: Callable[[], Iterable[Run]]) -> None:
        """Runs of keys, each (ns, kind, cause, key length, blob) as ``append`` takes them, that
        ``runs()`` gives when the log takes them (``settle``), in order with every other append:
        the observer's path (``Recorder``), inside the store and commit requests, which reads the
        keys and does the log's bookkeeping once the request's reply is sent. The log settles
        first thing when it is read, and by itself when PENDING_RUNS are queued (a log used
        without a server)."""
        self._pending.append(runs)
        if len(self._pending) >= PENDING_RUNS and not self._settling:
            self.settle()

    def settle(self) -> None:
        """Take the queued appends into the logs, in order (the server's loop, after each reply;
        every read first; the Recorder's hooks, inside the index's). Through a daemon, thread
        time, a record's bookkeeping was ~3 µs of a store job's reply, twice a job with the
        eviction's (0.3.6).

        An append that fails (a bug: its keys unreadable, memory) is logged and counted, never
        raised into the index's hooks; its records are lost, so every log ends (``forget``): each
        reader resyncs from a snapshot on its next read, and the daemon's stream from
        AllBlocksCleared, rather than follow a log that misses them."""
        if self._settling:
            return                        # a forget inside a run's settle: the runs stay in order
        failed, self._settling = 0, True
        try:
            while self._pending:
                pending, self._pending = self._pending, []
                for runs in pending:
                    try:
                        for ns, kind, cause, key_len, blob in runs():
                            if blob:
                                self._append(ns, kind, cause, key_len, blob)
                    except Exception:
                        logger.exception("the event log could not take a queued append; every reader is resynced")
                        failed += 1
        finally:
            self._settling = False
        self.failed_runs += failed
        if failed or self._broken:
            for ns in list(self._logs):
                self.forget(ns)
            try:
                if self.failing is not None:
                    self.failing()
                self._broken = False
            except Exception:             # tried again at the next settle; the logs end until then
                logger.exception("the event log's feed could not be made whole again; every reader is resynced")
                self._broken = True

    def _append(self, ns: Hashable, kind: Kind, cause: str | None, key_len: int, blob: bytes) -> int:
        count = len(blob) // key_len
        if count > RECORD_KEYS:
            step = key_len * RECORD_KEYS
            return sum([self._append(ns, kind, cause, key_len, blob[at:at + step]) for at in range(0, len(blob), step)])
        log = self._logs.get(ns) or self._log(ns)
        log.seq += 1
        log.keys += count
        record = Record(log.seq, kind, cause, key_len, blob, log.keys, count)
        log.records.append(record)
        self._fifo.append((log, record))
        self.bytes += len(blob) + RECORD_OVERHEAD
        self.appended[kind] += count
        if cause is not None:
            self.removed_by_cause[cause] += count
        self._news += 1
        if self.bytes > self.budget_bytes:
            self._trim()
        return count

    @property
    def news(self) -> int:
        """Records appended, ever: a reader's cheap "anything new?"."""
        self.settle()
        return self._news

    def _trim(self) -> None:
        """Drop the oldest records (of any namespace) until the log is TRIM_SLACK of its budget
        below it: one trim per some appends, not one per append."""
        fifo, floor = self._fifo, self.budget_bytes - int(self.budget_bytes * TRIM_SLACK)
        while self.bytes > floor and fifo:
            log, record = fifo.popleft()
            if not log.live:
                continue                  # its bytes left the budget when it was forgotten
            log.drop_oldest()
            self.bytes -= len(record.keys) + RECORD_OVERHEAD
            self.dropped_keys += record.count

    def _log(self, ns: Hashable) -> _Log:
        log = self._logs.get(ns)
        if log is None:
            log = self._logs[ns] = _Log(self._new_epoch())
        return log

    # ------------------------------------------------------------------ the readers' side
    def read(self, ns: Hashable, epoch: int | None, cursor: int | None, snapshot_from: int | None,
             max_keys: int) -> EventsRead:
        """The records after ``cursor`` (at least one when there is one, then up to ``max_keys``
        keys in all), and, while a snapshot is in progress (``snapshot_from``), its next page.

        A cursor of another epoch, or one the log no longer continues, or None, resets the
        reader: the reply starts a snapshot from slot 0 at the log's newest record."""
        self.settle()
        log = self._log(ns)
        reset = cursor is None or epoch != log.epoch or not log.floor <= cursor <= log.seq
        if reset:
            self.resets += cursor is not None
            cursor, snapshot_from = log.seq, 0
        records, taken = [], 0
        for record in log.records[log.after(cursor):]:
            if records and taken + record.count > max_keys:
                break
            records.append(record)
            taken += record.count
        seq = records[-1].seq if records else cursor
        snapshot, snapshot_next = [], None
        if snapshot_from is not None:
            # A page gets half the reply at least, so that a snapshot ends under any event rate.
            snapshot, count, snapshot_next = self.snapshot.ready_keys(ns, snapshot_from,
                                                                     max(max_keys - taken, max_keys // 2, 1))
            self.snapshot_keys += count
        return EventsRead(log.epoch, seq, reset, records, snapshot, snapshot_next, log.seq - seq)

    def head(self, ns: Hashable) -> tuple[int, int] | None:
        """(epoch, sequence number of the newest record) of ``ns``'s log; None: no log."""
        self.settle()
        log = self._logs.get(ns)
        return None if log is None else (log.epoch, log.seq)

    def lag(self, ns: Hashable, epoch: int, cursor: int) -> int | None:
        """Keys appended to ``ns``'s log after ``cursor`` (None: the cursor is not continuable)."""
        self.settle()
        log = self._logs.get(ns)
        if log is None or epoch != log.epoch or not log.floor <= cursor <= log.seq:
            return None
        at = log.after(cursor)
        if at >= len(log.records):
            return 0
        first = log.records[at]
        return log.keys - (first.upto - first.count)

    def stats(self) -> dict:
        """The log's part of ``StatsReply.events`` (docs/operations.md, kvtierd_events_*)."""
        self.settle()
        return {"log_bytes": self.bytes, "log_budget_bytes": self.budget_bytes, "namespaces": len(self._logs),
                "stored_keys": self.appended[Kind.STORED], "removed_keys": dict(self.removed_by_cause),
                "dropped_keys": self.dropped_keys, "resets": self.resets, "snapshot_keys": self.snapshot_keys,
                "failed_runs": self.failed_runs}


# The index's reasons for entries leaving, as a removal record names them (ABORTED: never READY,
# never announced: no record).
CAUSES = {Gone.EVICTED: Cause.EVICTED.value, Gone.AHEAD: Cause.EVICTED.value, Gone.CLEARED: Cause.CLEARED.value,
          Gone.RECLAIMED: Cause.RECLAIMED.value, Gone.REGION_REPLACED: Cause.REGION_REPLACED.value}


class Recorder(EntryEvents):
    """The index's events into the event log, for the namespaces someone follows (see the module
    docstring). ``follow_all``: every namespace (the daemon's own KV events stream is on).

    Neither hook reads a key: each queues the entries' slots (``EventLog.append_later``), and
    when the log takes them, after the request's reply, a store's keys are read from its records
    (then still in cache) into the key copies (``kvtierd.keycopies``), and a removal's from the
    copies, its records being reused by then. Three rules keep that exact:

    - records are rewritten only after their entries leave, and entries leave only with no
      store's keys (nor a namespace's copy, ``_copy_ready``) waiting to be read: ``leaving``
      settles the log first when one waits (with a server, only after a commit outside a request:
      the second tier's promotes, on its turn; the log settles after every reply);
    - the copies change only in the queue's order (a newly followed namespace's are queued too);
    - which namespaces are followed changes only with the queue settled (``follow`` settles
      first; a reclaimed namespace's log ends through ``EventLog.forget``, which does), so that a
      removal names the namespaces followed when it happened.
    """

    def __init__(self, log: EventLog, keys: KeyCopies, follow_all: bool = False):
        self.log = log
        self.keys = keys                            # the copies of the followed entries' keys
        self.follow_all = follow_all
        self._followed: dict[int, object] = {}      # table slot → the namespace whose log it holds
        self._unread_stores = 0                     # store runs and copies queued, their records not read yet
        log.failing = self._recopy

    def follow(self, ns) -> int:
        """Keep ``ns``'s log from now on (a reader asks for it); returns its key in the log."""
        owner = self._followed.get(ns.slot)
        if owner is not ns:
            self.log.settle()                        # the queue's removals name what was followed
            if owner is not None:
                self.log.forget(ns.slot)             # the slot changed hands without a removal to tell
            self._followed[ns.slot] = ns
            self._copy_ready(ns.slot)                # what it holds now; ``ready`` copies the rest
        return ns.slot

    def follow_every(self, namespaces) -> None:
        """Follow every namespace from now on (the daemon's own stream): those of ``namespaces``
        (the index's, at start), their READY entries' keys copied in one scan of the entry table,
        and each new one from its first store."""
        self.follow_all = True
        self.log.settle()
        for ns in namespaces:
            self._followed[ns.slot] = ns
        self._copy_ready(None)

    def _copy_ready(self, ns: int | None) -> None:
        """Copy the keys of the READY entries of the namespace in table slot ``ns`` (None: of
        every namespace) when the log next settles, in order with the runs queued before: a scan
        of the entry table (~35 ms a million slots) that a commit should not wait for. Counted as
        a store's keys waiting to be read: their entries do not leave before it."""
        self._unread_stores += 1
        self.log.append_later(lambda: self._copied(ns))

    def _copied(self, ns: int | None) -> tuple:
        self._unread_stores -= 1
        self.keys.put_ready(ns)
        return ()

    def _recopy(self) -> None:
        """A queued append failed (``EventLog.settle``: every log ended): the copies of the
        followed namespaces' keys are made whole again, at once."""
        for ns in self._followed:
            self.keys.put_ready(ns)

    def ready(self, ns, slots: np.ndarray) -> None:
        owner = self._followed.get(ns.slot)
        if self.follow_all or owner is ns:
            at = self.follow(ns)
            self._unread_stores += 1
            self.log.append_later(lambda slots=slots.copy(): self._stored(at, slots))
        elif owner is not None:
            self._forget(ns.slot)   # its followed namespace left with no entries: no removal told it

    def _stored(self, at: int, slots: np.ndarray) -> list[Run]:
        self._unread_stores -= 1
        return [(at, Kind.STORED, None, key_len, blob) for key_len, blob in self.keys.put(slots)]

    def leaving(self, cause: Gone, slots: np.ndarray, namespaces: np.ndarray) -> None:
        if cause is Gone.ABORTED or not self._followed or not len(slots):
            return
        first = int(namespaces[0])
        if first not in self._followed and (namespaces == first).all():
            return                                    # one namespace's, and nobody follows it
        if self._unread_stores:
            self.log.settle()                         # their records are whole until this returns
        self.log.append_later(lambda slots=slots.copy(): self._removed(CAUSES[cause], slots, namespaces))
        if cause is Gone.RECLAIMED:
            for n in np.unique(namespaces).tolist():
                if n in self._followed:
                    self._forget(n)

    def _removed(self, cause: str, slots: np.ndarray, namespaces: np.ndarray) -> list[Run]:
        first = int(namespaces[0])
        if (namespaces == first).all():               # the usual case: one namespace's
            return [(first, Kind.REMOVED, cause, key_len, blob) for key_len, blob in self.keys.runs(slots)]
        return [(n, Kind.REMOVED, cause, key_len, blob) for n in np.unique(namespaces).tolist() if n in self._followed
                for key_len, blob in self.keys.runs(slots[namespaces == n])]

    def _forget(self, n: int) -> None:
        """The namespace of table slot ``n`` was reclaimed: its log ends."""
        self.log.forget(n)
        del self._followed[n]


def _runs(keys: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """The keys as (length, blob) runs of one length each, in order within a length. One run in
    the common case (every key of a vLLM engine has the same length), built in C."""
    lengths = set(map(len, keys))
    if len(lengths) == 1:
        return [(lengths.pop(), b"".join(keys))]
    by_len: dict[int, list[bytes]] = {}
    for key in keys:
        by_len.setdefault(len(key), []).append(key)
    return [(n, b"".join(group)) for n, group in by_len.items()]

"""The event log (kvtierd.eventlog) and a reader's view of it (kvtier.events), without sockets.

The model (tests/eventlog.py): an entry table (the region's record layout) that a small "index"
fills and empties slot by slot, telling the log as the real index's observer does; readers follow one namespace
through the events reply's wire form (msgpack), and must end up holding exactly its READY keys,
whatever the interleaving of changes and reads, the size of the replies and the log's budget.
"""

import gc
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.events import EventView
from kvtierd.contract.events import Cause, Kind, split_keys
from kvtierd.contract.replies import EventsReply
from kvtierd.eventlog import PENDING_RUNS, RECORD_KEYS
from tests.eventlog import Table


def wire(read) -> EventsReply:
    """The reply as a reader receives it (through msgpack, as the protocol sends it)."""
    return EventsReply.from_wire(msgpack.unpackb(msgpack.packb(read.to_wire(), use_bin_type=True), raw=False))


def read(table: Table, ns: int, view: EventView, max_keys: int, announced: set) -> dict:
    reply = wire(table.log.read(ns, view.epoch, view.cursor, view.snapshot_from, max_keys))
    for removed, keys in view.apply(reply):
        (announced.difference_update if removed else announced.update)(keys)
    return reply


def catch_up(table: Table, ns: int, view: EventView, max_keys: int, announced: set) -> None:
    for _ in range(10_000):
        reply = read(table, ns, view, max_keys, announced)
        if not reply.behind and not view.resyncing:
            return
    raise AssertionError("the reader never caught up")


KEYS = st.sampled_from([bytes([i]) * 35 + bytes([i % 3]) for i in range(40)] + [b"short", b"\x00" * 36])
OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 1), st.lists(KEYS, max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 1), st.lists(KEYS, max_size=12)),
    st.tuples(st.just("read"), st.integers(0, 2), st.integers(1, 9)),
    st.tuples(st.just("forget"), st.integers(0, 1), st.none()),
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, budget=st.sampled_from([300, 600, 2000, 1 << 20]), scan=st.sampled_from([1, 3, 64]))
def test_any_interleaving_of_changes_and_reads_leaves_a_reader_with_the_ready_keys(ops, budget, scan):
    """Readers (two of namespace 0, one of namespace 1) read at random points with random reply
    sizes under a budget that drops records; the namespace's slot may be taken over. After catching
    up, each reader's view, and the set its announced changes build, are the READY keys of its
    namespace: nothing missed, nothing stale, nothing of the other namespace."""
    table = Table(48, budget, scan_slots=scan)
    readers = [(0, EventView(), set()), (0, EventView(), set()), (1, EventView(), set())]
    for op, who, arg in ops:
        if op == "store":
            table.store(who, arg)
        elif op == "remove":
            table.remove(who, arg)
        elif op == "forget":                     # the slot is reclaimed: its entries go, its log ends
            table.remove(who, sorted(table.ready(who)), Cause.RECLAIMED)
            table.log.forget(who)
        else:
            ns, view, announced = readers[who]
            read(table, ns, view, arg, announced)
    for ns, view, announced in readers:
        catch_up(table, ns, view, 5, announced)
        assert view.keys == table.ready(ns) == announced


def test_records_are_batched_and_continue_from_the_cursor():
    table = Table(64, 1 << 20, scan_slots=64)
    view = EventView()
    first = wire(table.log.read(0, None, None, None, 100))
    assert first.reset and first.seq == 0 and first.snapshot_next is None
    view.apply(first)
    keys = [bytes([i]) * 36 for i in range(10)]
    table.store(0, keys[:6])
    table.remove(0, keys[:2], Cause.CLEARED)
    table.store(0, keys[6:])
    reply = wire(table.log.read(0, view.epoch, view.cursor, view.snapshot_from, 100))
    assert not reply.reset and [r[:4] for r in reply.records] == [
        [1, Kind.STORED, None, 36], [2, Kind.REMOVED, "cleared", 36], [3, Kind.STORED, None, 36]]
    assert view.apply(reply) == [(False, keys[:6]), (True, keys[:2]), (False, keys[6:])]
    assert table.log.read(0, view.epoch, view.cursor, None, 100).records == []


def test_a_large_batch_is_cut_into_records_and_a_small_reply_still_moves_on():
    table = Table(3 * RECORD_KEYS, 1 << 26, scan_slots=4096)
    view = EventView()
    view.apply(wire(table.log.read(0, None, None, None, 10)))
    keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(2 * RECORD_KEYS + 5)]
    table.store(0, keys)
    counts = []
    while True:
        reply = wire(table.log.read(0, view.epoch, view.cursor, view.snapshot_from, 10))
        if not reply.records:
            break
        counts.append(len(reply.records[0][4]) // 36)
        view.apply(reply)
    assert counts == [RECORD_KEYS, RECORD_KEYS, 5] and view.keys == set(keys)


def test_a_reader_that_fell_behind_is_reset_and_told_what_left():
    """A reader that knew keys k0..k9 falls behind a log that dropped records: its next read says
    reset, and when the snapshot completes it announces exactly the keys that left meanwhile."""
    table = Table(64, 600)                      # room for about two records
    view, announced = EventView(), set()
    keys = [bytes([i]) * 36 for i in range(20)]
    table.store(0, keys[:10])
    catch_up(table, 0, view, 100, announced)
    assert view.keys == set(keys[:10])
    for i in range(5):                          # five records: the first ones are dropped
        table.remove(0, [keys[i]])
    table.store(0, keys[10:12])
    changes = []
    while True:
        reply = wire(table.log.read(0, view.epoch, view.cursor, view.snapshot_from, 3))
        changes += view.apply(reply)
        if not reply.behind and not view.resyncing:
            break
    assert view.resets == 2 and table.log.resets == 1   # the first read, then the fall
    assert changes == [(True, sorted(keys[:5], key=keys.index)), (False, keys[10:12])] or \
        {(r, frozenset(k)) for r, k in changes} == {(True, frozenset(keys[:5])), (False, frozenset(keys[10:12]))}
    assert view.keys == table.ready(0)


def test_another_epoch_resets_the_reader():
    """A cursor of an earlier daemon (or of the namespace slot's earlier use) is never continued."""
    table = Table(16, 1 << 20)
    view = EventView()
    table.store(0, [b"a" * 36])
    catch_up(table, 0, view, 10, set())
    table.log.forget(0)
    reply = table.log.read(0, view.epoch, view.cursor, None, 10)
    assert reply.reset and reply.epoch != view.epoch


def test_the_lag_counts_keys_after_a_cursor():
    table = Table(64, 1 << 20)
    log = table.log
    epoch = log.read(0, None, None, None, 1).epoch
    table.store(0, [bytes([i]) * 36 for i in range(5)])
    table.remove(0, [bytes([1]) * 36])
    assert [log.lag(0, epoch, c) for c in (0, 1, 2)] == [6, 1, 0]
    assert log.lag(0, epoch + 1, 0) is None and log.lag(0, epoch, 3) is None


def test_keys_of_other_lengths_and_trailing_zero_bytes_come_back_whole():
    keys = [b"\x00" * 36, b"a" + b"\x00" * 35, b"x" * 20, b"y" * 33]
    table = Table(16, 1 << 20)
    view = EventView()
    table.store(0, keys)
    catch_up(table, 0, view, 10, set())
    assert view.keys == set(keys)
    assert split_keys(4, b"ab\0\0cd\0\1") == [b"ab\0\0", b"cd\0\1"]
    with pytest.raises(ValueError):
        split_keys(4, b"abc")


def test_memory_stays_within_the_budget_when_nobody_reads():
    """200 batches or 2,000 of 256 fresh 36-byte keys leave the same memory behind: the log holds
    its budget, no more, with no reader at all."""
    budget = 4 << 20
    table = Table(8, budget)
    log = table.log

    def feed(batches: int, start: int) -> int:
        for b in range(start, start + batches):
            log.stored(0, [(b * 256 + i).to_bytes(32, "big") + b"\0\0\0\0" for i in range(256)])
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        after_few = feed(600, 0)
        after_many = feed(6000, 600)
    finally:
        tracemalloc.stop()
    assert log.bytes <= budget and log.dropped_keys > 0
    assert after_many < after_few * 1.2 + (1 << 20)
    stats = log.stats()
    assert stats["stored_keys"] == 6600 * 256 and stats["log_bytes"] == log.bytes
    assert stats["dropped_keys"] == log.dropped_keys and stats["namespaces"] == 1


def test_appends_are_queued_until_the_reply_is_sent_and_every_read_takes_them_first():
    """A store's and an eviction's appends are only queued (the server's loop settles them once the
    reply is sent); a read, the head, the lag, the stats and a forget take them first, in order; and
    the queue holds at most PENDING_RUNS runs where nothing settles it."""
    table = Table(8, 1 << 20)
    log = table.log
    log.stored(0, [b"a" * 36, b"b" * 36])
    log.removed(0, [b"a" * 36], Cause.EVICTED)
    assert len(log._pending) == 2 and log._logs == {}
    assert log.head(0)[1] == 2 and not log._pending                     # taken by the read, in order
    got = log.read(0, None, None, None, 10)
    log.stored(0, [b"c" * 36])
    again = log.read(0, got.epoch, 0, None, 10)
    assert [(r.kind, r.keys) for r in again.records] == [(Kind.STORED, b"a" * 36 + b"b" * 36),
                                                         (Kind.REMOVED, b"a" * 36), (Kind.STORED, b"c" * 36)]
    log.stored(1, [b"d" * 36])
    assert log.stats()["stored_keys"] == 4 and log.lag(0, got.epoch, 3) == 0
    log.stored(1, [b"e" * 36])
    log.forget(1)                                                      # its queued record went first
    assert log.stats()["namespaces"] == 1 and log.news == 5
    for i in range(PENDING_RUNS):
        log.stored(0, [bytes([i]) * 36])
    assert not log._pending and log.news == 5 + PENDING_RUNS            # a full queue is taken at once


def test_a_run_that_fails_to_be_taken_is_counted_and_every_reader_resyncs(monkeypatch):
    """settle meets a run that raises (a bug): it does not raise (it may run inside the index's
    hooks); the run is counted, the runs after it are taken, every log ends so that each reader
    resets onto a snapshot rather than follow a log that misses it, and the feed is told."""
    log = Table(8, 1 << 20).log
    told = []
    log.failing = lambda: told.append(True)
    log.stored(0, [b"a" * 36])
    before = log.read(0, None, None, None, 10)
    for name in (b"b", b"c"):
        log.stored(0, [name * 36])
    take = log._append

    def failing(ns, kind, cause, key_len, blob):
        if blob == b"b" * 36:
            raise MemoryError
        return take(ns, kind, cause, key_len, blob)

    monkeypatch.setattr(log, "_append", failing)
    log.settle()
    assert log.stats()["failed_runs"] == 1 and told == [True] and log._logs == {}
    again = log.read(0, before.epoch, before.seq, None, 10)
    assert again.reset and again.epoch != before.epoch
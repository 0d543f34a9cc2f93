"""The event log fed by the real store (kvtierd.eventlog's Recorder on the index's events) and read
through ``Store.events`` as the events op does, without sockets: a coordinator's view of its
namespace follows every way an entry becomes READY and leaves, and never sees another's."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.events import EventView
from kvtierd.contract.codes import ErrorCode
from kvtierd.contract.events import Kind
from kvtierd.contract.replies import EventsReply
from kvtierd.contract.region_format import EntryState
from kvtierd.events import EntryEvents, Gone

from .store_env import Env, err, keys, lay, reopen


def follow(env: Env, session, view: EventView, max_keys: int = 1 << 14) -> list:
    """Read until caught up; the changes the view announced, in order."""
    changes = []
    while True:
        read = env.store.events(session, **view.request(), max_keys=max_keys)   # as the events op, through msgpack:
        read = EventsReply.from_wire(msgpack.unpackb(msgpack.packb(read.to_wire(), use_bin_type=True), raw=False))
        changes += view.apply(read)
        if not read.behind and not view.resyncing:
            return changes


def ready(env: Env, session) -> set:
    """The READY keys of the session's namespace, as the index holds them."""
    index = env.store.index
    slots = index.slots_of(session.engine.ns)
    return set(index.keys_of(slots[index.states(slots) == EntryState.READY]))


def test_a_coordinator_follows_what_every_engine_of_its_namespace_stores_and_what_leaves():
    env = Env(num_pages=16)
    a = env.engine("a", 1, model="M")
    other = env.engine("o", 1, model="Other")
    env.put(a, 1, keys("x", 4))                  # before anyone follows: the first read's snapshot has them
    env.put(other, 1, keys("o", 2))
    b = env.store.attach("b", None, 1, lay(model="M"))
    view = EventView()
    assert [(removed, sorted(ks)) for removed, ks in follow(env, b, view)] == [(False, keys("x", 4))]
    assert view.keys == set(keys("x", 4)) and view.resets == 1

    env.put(a, 2, keys("y", 3))
    env.put(other, 2, keys("p", 3))
    assert follow(env, b, view) == [(False, keys("y", 3))]
    env.store.evict(None, 2)                     # kvtierctl evict: the policy's first victims, any namespace
    env.put(a, 3, keys("z", 10))                 # more than the free pages: room taken from the others
    changes = follow(env, b, view)
    assert view.keys == ready(env, a[0]) and set(keys("z", 10)) <= view.keys
    assert any(removed for removed, _ in changes)
    assert not view.keys & (set(keys("o", 2)) | set(keys("p", 3)))

    # A write that aborts was never READY: nothing to announce of its keys (the room it took is).
    env.store.store(a[0], 4, keys("w", 2))
    env.store.abort(a[0], 4)
    changes = follow(env, b, view)
    assert not {k for _, ks in changes for k in ks} & set(keys("w", 2)) and view.keys == ready(env, a[0])

    before = set(view.keys)
    env.store.evict(a[0].engine.ns.id.name(), None)      # kvtierctl clear of the namespace
    changes = follow(env, b, view)
    assert [removed for removed, _ in changes] == [True] and set(changes[0][1]) == before
    assert view.keys == set() == ready(env, a[0])
    stats = env.store.events_stats()
    assert stats["removed_keys"]["cleared"] >= 1 and stats["readers"] == 1 and stats["reader_lag_keys"] == 0
    env.store.verify()


def test_only_a_coordinator_reads_events():
    env = Env()
    rank = env.engine("a", 1)[0]
    with err(ErrorCode.FORBIDDEN):
        env.store.events(rank, None, None, None, 10)


def test_a_reader_that_falls_behind_or_crosses_a_restart_is_resynced_to_the_ready_keys():
    env = Env(num_pages=256, events_log_bytes=1 << 12)   # a log of a few records: a slow reader falls behind
    a = env.engine("a", 1)
    b = env.store.attach("b", None, 1, a[0].engine.ns.id)
    view = EventView()
    follow(env, b, view)
    for job in range(1, 40):
        env.put(a, job, keys(f"k{job}-", 4))
    env.store.evict(None, 30)
    follow(env, b, view, max_keys=8)
    assert view.keys == ready(env, a[0]) and view.resets == 2 and env.store.events_stats()["dropped_keys"] > 0

    store = reopen(env.view)                     # a restarted daemon: a new epoch, the recovered entries
    b2 = store.attach("b", None, 1, a[0].engine.ns.id)
    env.store = store
    gone = follow(env, b2, view)
    assert view.resets == 3 and gone == [] and view.keys == ready(env, b2)


def test_a_namespace_slot_taken_over_starts_a_new_log():
    env = Env(num_pages=32, ns_slots=1)
    a = env.engine("a", 1, model="A")
    env.put(a, 1, keys("a", 3))
    coord = env.store.attach("ca", None, 1, lay(model="A"))
    view = EventView()
    follow(env, coord, view)
    epoch = view.epoch
    for s in a + [coord]:
        env.store.detach(s)
    b = env.engine("b", 1, model="B")            # the one slot is taken over: A's entries go (reclaimed)
    env.put(b, 1, keys("b", 2))
    cb = env.store.attach("cb", None, 1, lay(model="B"))
    fresh = EventView()
    follow(env, cb, fresh)
    assert fresh.keys == set(keys("b", 2)) and fresh.epoch != epoch
    assert env.store.events_stats()["removed_keys"]["reclaimed"] == 3


class Truth(EntryEvents):
    """The keys each event names, read from the records as the index tells it (subscribed after
    the Recorder: its hooks run first, and the records are whole in both)."""

    def __init__(self, index, namespaces: set):
        self.index, self.namespaces, self.heard = index, namespaces, []

    def ready(self, ns, slots):
        if ns.slot in self.namespaces:
            self.heard.append((ns.slot, Kind.STORED, self.index.keys_of(slots)))

    def leaving(self, cause, slots, namespaces):
        for n in set(namespaces.tolist()) & self.namespaces:
            if cause is not Gone.ABORTED:
                self.heard.append((n, Kind.REMOVED, self.index.keys_of(slots[namespaces == n])))


def merged(events) -> list:
    """(kind, sorted keys) with a kind's consecutive events as one: how a log's records (a run a
    key length) and the truth's events (one a job) compare."""
    out: list = []
    for kind, keys in events:
        if out and out[-1][0] == kind:
            out[-1] = (kind, sorted(out[-1][1] + list(keys)))
        else:
            out.append((kind, sorted(keys)))
    return out


def replay(log, ns: int, held: set) -> set:
    """The keys a reader of ``ns``'s whole log holds: every removal names a key it holds."""
    for record in log._logs[ns].records if ns in log._logs else []:
        run = {record.keys[i:i + record.key_len] for i in range(0, len(record.keys), record.key_len)}
        if record.kind == Kind.STORED:
            held |= run
        else:
            assert run <= held, "a removal names a key that was not stored"
            held -= run
    return held


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["a", "o", "evict", "clear", "abort", "settle", "follow a", "follow o",
                                               "every"]), st.integers(1, 9)), max_size=30))
def test_the_logs_name_every_key_that_left_though_its_record_was_reused(ops):
    """The Recorder reads a removal's keys after the request (from its copies, the records reused
    by then): whatever runs between the requests, whether the server settles after each, and when
    each namespace starts being followed (a reader's follow, or the daemon's stream following them
    all), every followed namespace's log, from what it held when it was first followed, names in
    order what each event named when it happened, and replays to exactly its READY keys. Keys of
    two lengths in one job."""
    env = Env(num_pages=12)
    engines = {"a": env.engine("a", 1, model="A"), "o": env.engine("o", 1, model="O")}
    recorder, found = env.store.recorder, {}     # what each namespace held when it was first followed
    truth = Truth(env.store.index, set())
    env.store.index.events.subscribe(truth)

    def started(sessions) -> None:
        ns = sessions[0].engine.ns.slot
        if ns not in found:
            found[ns] = ready(env, sessions[0])
            truth.namespaces.add(ns)

    for step, (op, n) in enumerate(ops):
        if op in engines:
            job = step + 1
            env.put(engines[op], job, [f"{op}{job}.{i}".encode() + b"-" * (i % 2) for i in range(n)])
            if recorder.follow_all:
                started(engines[op])
        elif op == "evict":
            env.store.evict(None, n)
        elif op == "clear":
            env.store.evict(engines["a"][0].engine.ns.id.name(), None)
        elif op == "abort":
            env.store.store(engines["a"][0], 1000 + step, [f"w{step}.{i}".encode() for i in range(n)])
            env.store.abort(engines["a"][0], 1000 + step)
        elif op == "every":
            for sessions in engines.values():
                started(sessions)
            recorder.follow_every(env.store.index.namespaces.values())
        elif op.startswith("follow"):
            sessions = engines[op[-1]]
            started(sessions)
            recorder.follow(sessions[0].engine.ns)
        else:
            env.store.replied()
    log = env.store.event_log
    log.settle()
    for sessions in engines.values():
        ns = sessions[0].engine.ns.slot
        if ns in found:
            assert replay(log, ns, set(found[ns])) == ready(env, sessions[0])
            records = [(r.kind, [r.keys[i:i + r.key_len] for i in range(0, len(r.keys), r.key_len)])
                       for r in log._logs[ns].records] if ns in log._logs else []
            assert merged(records) == merged((kind, keys) for n, kind, keys in truth.heard if n == ns)
    env.store.verify()


def test_a_namespace_followed_after_its_slots_were_reused_unsettled_leaves_the_removals_exact():
    """A's entries are evicted by O's store into the same slots, and O is followed before the log
    settles: A's removal names A's keys (the follow takes the queue first), not O's."""
    env = Env(num_pages=8)
    a, o = env.engine("a", 1, model="A"), env.engine("o", 1, model="O")
    recorder, log = env.store.recorder, env.store.event_log
    recorder.follow(a[0].engine.ns)
    env.put(a, 1, keys("a", 8))
    env.put(o, 1, keys("o", 8))                  # evicts all of A's into the same slots, nothing settled
    recorder.follow(o[0].engine.ns)
    log.settle()
    records = [(r.kind, sorted(r.keys[i:i + 2] for i in range(0, len(r.keys), 2)))
               for r in log._logs[a[0].engine.ns.slot].records]
    assert records == [(Kind.STORED, keys("a", 8)), (Kind.REMOVED, keys("a", 8))]


def test_a_namespace_followed_after_an_unsettled_eviction_of_its_entries_hears_nothing_of_it():
    """An operator's evict takes A's and O's entries together while only A is followed; O is
    followed before the log settles: the removal was told when O was not followed, so O's log
    does not name its entries (they were gone when it began), and A's names exactly A's."""
    env = Env(num_pages=8)
    a, o = env.engine("a", 1, model="A"), env.engine("o", 1, model="O")
    recorder, log = env.store.recorder, env.store.event_log
    recorder.follow(a[0].engine.ns)
    env.put(a, 1, keys("a", 8))
    env.put(o, 1, keys("o", 4))                  # in four of A's slots (their copies: A's keys)
    log.settle()
    env.store.evict(None, None)                  # both namespaces' entries in one leaving
    recorder.follow(o[0].engine.ns)
    log.settle()
    removed = [r for r in log._logs[a[0].engine.ns.slot].records if r.kind == Kind.REMOVED]
    assert sorted(k for r in removed for k in (r.keys[i:i + 2] for i in range(0, len(r.keys), 2))) == keys("a", 8)
    assert o[0].engine.ns.slot not in log._logs


def test_a_taken_over_namespace_with_no_entries_ends_its_log():
    """A followed namespace that leaves with no entries tells no removal; the namespace that takes
    its table slot is not followed, and its entries' removals never reach the old log."""
    env = Env(num_pages=8, ns_slots=1)
    a = env.engine("a", 1, model="A")
    env.store.recorder.follow(a[0].engine.ns)
    for s in a:
        env.store.detach(s)
    b = env.engine("b", 1, model="B")            # the one slot, taken over: A had nothing to remove
    env.put(b, 1, keys("b", 8))
    env.store.evict(None, None)
    log = env.store.event_log
    log.settle()
    assert log._logs == {} and env.store.events_stats()["stored_keys"] == 0


def test_an_append_that_fails_resyncs_every_reader_and_makes_the_copies_whole(monkeypatch):
    """A queued run that raises (a bug) is logged and counted, not raised into the index; every
    log ends (its readers resync from a snapshot), and the copies are made again, so that the
    removals after it name the right keys."""
    env = Env(num_pages=8)
    a = env.engine("a", 1, model="A")
    b = env.store.attach("b", None, 1, lay(model="A"))
    view = EventView()
    follow(env, b, view)
    epoch = view.epoch
    copies, calls = env.store.recorder.keys, []
    put = copies.put

    def failing_once(slots):
        calls.append(len(slots))
        if len(calls) == 1:
            raise MemoryError
        return put(slots)

    monkeypatch.setattr(copies, "put", failing_once)
    env.put(a, 1, keys("x", 4))                  # its store run fails when the log takes it
    env.store.replied()
    assert env.store.events_stats()["failed_runs"] == 1 and len(calls) > 1
    env.store.evict(None, None)                  # named from the copies made again
    follow(env, b, view)
    assert view.epoch != epoch and view.keys == set() == ready(env, a[0])
    removed = [r for r in env.store.event_log._logs[a[0].engine.ns.slot].records if r.kind == Kind.REMOVED]
    assert sorted(removed[0].keys[i:i + 2] for i in range(0, 8, 2)) == sorted(keys("x", 4))


def test_a_stream_turned_on_late_names_the_entries_it_found_when_they_leave():
    env = Env(num_pages=16)
    a = env.engine("a", 1)
    env.put(a, 1, keys("old", 5))                # READY before anyone follows
    env.store.recorder.follow_every([])          # the daemon's stream, with no namespace at its start
    env.put(a, 2, keys("new", 3))                # the namespace is followed from here on
    env.store.evict(None, None)
    log = env.store.event_log
    log.settle()
    kinds = [(r.kind, r.keys) for r in log._logs[a[0].engine.ns.slot].records]
    assert kinds[0] == (Kind.STORED, b"".join(keys("new", 3)))
    assert kinds[1][0] == Kind.REMOVED and sorted(kinds[1][1][i:i + 4] for i in range(0, 32, 4)) == \
        sorted(keys("old", 5) + keys("new", 3))


def test_the_daemons_stream_follows_the_namespaces_it_starts_with_before_their_first_store():
    """A restarted daemon's stream publishes every namespace from its contents on: an entry it
    found that leaves before its namespace stores again is a removal too (0.3.7 told none)."""
    env = Env(num_pages=16)
    a = env.engine("a", 1)
    env.put(a, 1, keys("old", 5))
    env.store.recorder.follow_every(env.store.index.namespaces.values())
    env.store.evict(None, None)
    log = env.store.event_log
    log.settle()
    records = log._logs[a[0].engine.ns.slot].records
    assert [r.kind for r in records] == [Kind.REMOVED]
    assert sorted(records[0].keys[i:i + 4] for i in range(0, 20, 4)) == keys("old", 5)

"""The event log fed by the real store (kvtierd.eventlog's Recorder on the index's events) and read
through ``Store.events`` as the events op does, without sockets: a coordinator's view of its
namespace follows every way an entry becomes READY and leaves, and never sees another's."""

from __future__ import annotations

import msgpack

from kvtier.events import EventView
from kvtierd.contract.codes import ErrorCode
from kvtierd.contract.replies import EventsReply
from kvtierd.contract.region_format import EntryState

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

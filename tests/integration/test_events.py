"""The events op with a real daemon and real rank processes: engine A's ranks store blocks (bytes
checked by content); engine B's coordinator, of the same namespace, follows them through
``Coordinator.events`` and ``kvtier.events.EventView`` — the stores, ``kvtierctl evict`` and
``clear``, another namespace's blocks never, a SIGKILLed and restarted daemon (a new epoch: the
view is resynced onto the recovered blocks, with the difference announced)."""

from __future__ import annotations

import pytest

from kvtier import Client, NamespaceId
from kvtier.events import EventView

from .test_faults import SPEC, kill_daemon, layout_of, restart
from .test_kvtierctl import ctl_json
from .test_leases import engine, fill_region

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def follow(coordinator, view: EventView) -> list:
    changes = []
    while True:
        reply = coordinator.events(**view.request())
        changes += view.apply(reply)
        if not reply.behind and not view.resyncing:
            return changes


def test_a_coordinator_follows_its_namespace_across_evict_clear_and_a_restart(daemon, ranks):
    procs, a_coordinator, keys, _source = engine(daemon, ranks, "a", n=6)
    b = Client(daemon.socket, engine_id="b", rank=None, world_size=2,
               namespace=NamespaceId(**layout_of(SPEC, "replicated")), timeout=10)
    try:
        view = EventView()
        assert [(removed, sorted(k)) for removed, k in follow(b, view)] == [(False, sorted(keys))]

        out = ctl_json(daemon, "evict", "--count", "2")
        assert out["evicted"] == 2
        changes = follow(b, view)
        assert [removed for removed, _ in changes] == [True] and len(changes[0][1]) == 2
        assert view.keys < set(keys) and len(view.keys) == 4

        filler = fill_region(daemon)              # another namespace's stores evict ours; its keys never show
        assert filler > 0
        follow(b, view)
        assert view.keys == set(keys) & {k for k in keys if a_coordinator.lookup([k]) == 1}
        assert not any(k.startswith(b"fill") for k in view.keys)

        stats = daemon.stats()["events"]
        assert stats["readers"] == 1 and stats["reader_lag_keys"] == 0 and stats["removed_keys"]["evicted"] >= 1

        kill_daemon(daemon)
        restart(daemon)
        before = set(view.keys)
        changes = follow(b, view)                 # b re-attaches; its cursor names the old epoch: a reset
        assert view.resets == 2 and view.keys == before and changes == []
        ctl_json(daemon, "clear", "--all")
        changes = follow(b, view)
        assert view.keys == set() and {k for _, ks in changes for k in ks} == before
    finally:
        b.close()
        a_coordinator.close()


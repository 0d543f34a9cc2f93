"""kvtierd.events: the index tells every way an entry becomes READY and leaves, a batch per call,
with the cause — what the tier's demote listens to, and what a log of KV events will."""

from __future__ import annotations

import numpy as np

from kvtierd.attachments import SessionEnd
from kvtierd.events import EntryEvents, Gone

from .store_env import Env, keys, lay


class Recorder(EntryEvents):
    def __init__(self, index):
        self.index = index
        self.heard: list[tuple] = []

    def ready(self, ns, slots):
        assert isinstance(slots, np.ndarray)
        keys = self.held(slots, np.full(len(slots), ns.slot))
        self.heard.append(("ready", ns.id.model, sorted(keys)))

    def leaving(self, cause, slots, namespaces):
        # told before they go: the index still holds them
        keys = self.held(slots, namespaces)
        models = sorted({self.index.namespace_at(int(n)).id.model for n in namespaces.tolist()})
        self.heard.append((cause, models, sorted(keys)))

    def held(self, slots, namespaces) -> list[bytes]:
        """The entries' keys, once checked that the index finds each entry under its key in its namespace."""
        assert (self.index.namespaces_of(slots) == namespaces).all()
        keys = self.index.keys_of(slots)
        for n in np.unique(namespaces).tolist():
            mine = namespaces == n
            found = self.index.find(self.index.namespace_at(n), [k for k, m in zip(keys, mine.tolist()) if m])
            assert (found == slots[mine]).all()
        return keys


def recorded(num_pages: int = 8, **env) -> tuple[Env, Recorder]:
    e = Env(num_pages, **env)
    rec = Recorder(e.store.index)
    e.store.index.events.subscribe(rec)
    return e, rec


def test_every_way_in_and_out_is_told_once_with_its_cause():
    e, rec = recorded(8)
    (a,) = e.engine("a", model="A")
    e.put([a], 1, keys("k", 6))
    assert rec.heard == [("ready", "A", keys("k", 6))]
    e.store.store(a, 2, keys("n", 4))                  # room for 4: two evicted, WRITING until commit
    cause, models, evicted = rec.heard[-1]
    assert (cause, models, len(evicted)) == (Gone.EVICTED, ["A"], 2) and set(evicted) < set(keys("k", 6))
    e.store.abort(a, 2)                                # never READY: aborted
    assert rec.heard[-1] == (Gone.ABORTED, ["A"], keys("n", 4))
    assert e.store.evict(None, 1).evicted == 1
    cause, _, cleared = rec.heard[-1]
    assert cause is Gone.CLEARED and len(cleared) == 1
    e.store.detach(a, SessionEnd.LEFT)
    e.store.drop_all()
    assert rec.heard[-1] == (Gone.REGION_REPLACED, ["A"], sorted(set(keys("k", 6)) - set(evicted) - set(cleared)))
    assert len(rec.heard) == 5                         # each once
    e.store.verify()


def test_a_namespace_taken_over_is_told_reclaimed():
    e, rec = recorded(8, ns_slots=1)
    (a,) = e.engine("a", model="A")
    e.put([a], 1, keys("k", 2))
    e.store.detach(a)
    e.store.attach("b", 0, 1, lay(model="B"))
    assert rec.heard[-1] == (Gone.RECLAIMED, ["A"], keys("k", 2))
    e.store.verify()

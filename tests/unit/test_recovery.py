"""kvtierd.recovery.scan: what a region's tables hold, judged record by record, without changing a
byte. (What a restarted index then keeps is tested in test_index.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.contract.region_format import CHAIN_END, EntryState
from kvtierd.recovery import scan

from .store_env import PAGE, keys, pages, small


def region():
    """Namespace A: 1-page entries a0..a3; namespace B: 2-page entries b0..b1; w0 WRITING."""
    env = small(16)
    a = env.engine("a", 1, model="A")
    b = env.engine("b", 1, model="B", block_bytes=2 * PAGE)
    env.put(a, 1, keys("a", 4))
    env.put(b, 1, keys("b", 2))
    env.store.lookup(a[0], [b"a0"])                  # a0 is now the youngest
    env.store.store(a[0], 2, [b"w0"])
    return env, a[0].engine.ns, b[0].engine.ns


def test_sound_region():
    env, na, nb = region()
    before = bytes(env.view.raw)
    found = scan(env.view)
    assert bytes(env.view.raw) == before                                  # a judge, not a fixer
    assert found.namespaces == {na.slot: na.id, nb.slot: nb.id} and found.damaged_namespaces == {}
    assert found.problems == []
    assert found.writing.tolist() == [na.index[b"w0"].slot]
    assert found.ready_keys == [b"a1", b"a2", b"a3", b"b0", b"b1", b"a0"]   # least recently used first
    for slot, ns_slot, key, chain in found.ready:
        entry = env.store.index.by_slot[slot]
        assert (entry.key, entry.ns.slot) == (key, ns_slot) and chain.tolist() == pages(entry.pages)
        assert (found.owner[chain] == slot).all()
    assert found.pages_held == 4 + 2 * 2 and (found.owner[pages(na.index[b"w0"].pages)] == -1).all()


@pytest.mark.parametrize("damage,victim,reason", [
    ("key_len", b"a1", "bad key length"),
    ("ns", b"a1", "unknown or damaged namespace"),
    ("count", b"b0", "page count differs from its namespace's"),
    ("out", b"a1", "chain leaves the data area"),
    ("long", b"a1", "chain longer than its page count"),
    ("shared", b"b1", "shares a page with entry"),
    ("duplicate", b"a2", "duplicate key in its namespace"),
    ("state", b"a1", "unknown state 9"),
])
def test_each_damage_is_named(damage, victim, reason):
    env, na, nb = region()
    ents, view = env.view.entries, env.view
    entry = {**na.index, **nb.index}[victim]
    slot = entry.slot
    if damage == "key_len":
        ents[slot]["key_len"] = 0
    elif damage == "ns":
        ents[slot]["ns"] = 1000
    elif damage == "count":
        ents[slot]["page_count"] = 3
    elif damage == "out":
        ents[slot]["first_page"] = view.geometry.num_pages
    elif damage == "long":
        view.chain[pages(entry.pages)[-1]] = pages(na.index[b"a3"].pages)[0]
    elif damage == "shared":                         # b1 (younger) claims b0's first page
        ents[slot]["first_page"] = pages(nb.index[b"b0"].pages)[0]
        view.chain[pages(nb.index[b"b0"].pages)[0]] = pages(entry.pages)[1]
    elif damage == "duplicate":                      # a2's record now says a1, and a1 is older
        ents[slot]["key"][:2] = np.frombuffer(b"a1", np.uint8)
    else:
        ents[slot]["state"] = 9
    found = scan(view)
    assert [s for s, _ in found.problems] == [slot]
    assert found.problems[0][1].startswith(reason)
    assert slot not in found.ready_slots.tolist()
    assert len(found.ready_keys) == 5


def test_damaged_namespace_record_takes_its_entries():
    env, na, _ = region()
    env.view.namespaces[na.slot]["sharding"] = 7
    found = scan(env.view)
    assert set(found.damaged_namespaces) == {na.slot} and na.slot not in found.namespaces
    assert sorted(found.ready_keys) == [b"b0", b"b1"]
    assert {reason for _, reason in found.problems} == {"unknown or damaged namespace"}


def test_a_broken_chain_does_not_break_the_scan():
    env, _, nb = region()
    chain = pages(nb.index[b"b0"].pages)
    env.view.chain[chain[1]] = chain[0]              # a cycle
    env.view.chain[pages(nb.index[b"b1"].pages)[0]] = CHAIN_END   # cut short: its next link is no page
    found = scan(env.view)
    assert dict(found.problems) == {nb.index[b"b0"].slot: "chain longer than its page count",
                                    nb.index[b"b1"].slot: "chain leaves the data area"}
    assert (env.view.entries["state"][[nb.index[b"b0"].slot, nb.index[b"b1"].slot]] == EntryState.READY).all()

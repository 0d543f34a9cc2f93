"""kvtierd.recovery.scan: what a region's tables hold, judged record by record, without changing a
byte. (What a restarted index then keeps is tested in test_index.py.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy as np

from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import EntryState
from kvtierd.contract.region_sums import shard_checksum
from kvtierd.recovery import scan

from .store_env import (PAGE, DAMAGES, Env, corrupt_env, damage_region, keys, pages, per_entry, reopen, slot_of,
                        slot_pages, two_namespaces)


def region():
    """Namespace A: 1-page entries a0..a3; namespace B: 2-page entries b0..b1; w0 WRITING."""
    env, a, b = two_namespaces(16, 4, 2)
    env.store.lookup(a, [b"a0"])                     # a0 is now the youngest
    env.store.store(a, 2, [b"w0"])
    return env, a.engine.ns, b.engine.ns


def test_sound_region():
    env, na, nb = region()
    before = bytes(env.view.raw)
    found = scan(env.view)
    assert bytes(env.view.raw) == before                                  # a judge, not a fixer
    assert found.namespaces == {na.slot: na.id, nb.slot: nb.id} and found.damaged_namespaces == {}
    assert found.problems == []
    index = env.store.index
    w0, w0_pages = slot_pages((index, na), b"w0")
    assert found.writing.tolist() == [w0]
    assert found.ready_keys == [b"a1", b"a2", b"a3", b"b0", b"b1", b"a0"]   # least recently used first
    for slot, ns_slot, key, chain in found.ready:
        one = np.array([slot], np.int32)
        assert (index.keys_of(one), index.namespaces_of(one).tolist()) == ([key], [ns_slot])
        assert chain.tolist() == pages(index.pages_of(index.namespace_at(ns_slot), one))
        assert (found.owner[chain] == slot).all()
    assert found.pages_held == 4 + 2 * 2 and (found.owner[w0_pages] == -1).all()
    # w0's writer holds its page, uncommitted: the fence gives it to that writer's row.
    writer = env.store.jobs.engines["a"].ranks[0].writer
    assert found.fenced.tolist() == w0_pages and found.fenced_rows.tolist() == [writer.row]
    assert writer.row in found.writers.tolist() and found.stale_fence.tolist() == [] and found.pages_fenced == 1


def test_a_fence_naming_no_row_in_use_is_stale():
    env, na, nb = region()
    env.view.fence[15] = 77                                              # row 77 is free
    found = scan(env.view)
    assert found.stale_fence.tolist() == [15] and 15 not in found.fenced.tolist()


# What scan calls each damage of store_env.DAMAGES (the records it names are the lost keys').
REASONS = {
    "shared_page": "shares a page with entry", "first_out_of_range": "chain leaves the data area",
    "link_out_of_range": "chain leaves the data area", "chain_short": "chain leaves the data area",
    "chain_long_short_row": "chain longer than its page count", "cycle": "chain longer than its page count",
    "bad_ns": "unknown or damaged namespace", "key_len_zero": "bad key length", "key_len_too_long": "bad key length",
    "duplicate_key": "duplicate key in its namespace", "page_count_huge": "page count differs from its namespace's",
    "page_count_wrong": "page count differs from its namespace's", "bad_state": "unknown state 77",
    "ns_record_garbage": "unknown or damaged namespace", "first_page_moved": "record checksum mismatch",
    "length_edited": "record checksum mismatch", "tick_huge": "tick out of range",
    "ns_record_edited": "unknown or damaged namespace",
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_each_damage_is_named_and_nothing_changes(damage):
    env, ia, ib = corrupt_env()
    # The slots before the damage (it may leave a record that no longer says its key).
    slot = {k: slot_of(*where, k) for where, prefix in ((ia, "a"), (ib, "b")) for k in keys(prefix, 4)}
    lost = damage_region(env, ia, ib, damage)
    before = bytes(env.view.raw)
    found = scan(env.view)
    assert bytes(env.view.raw) == before
    slots = {slot[k] for k in lost}
    assert {slot for slot, _ in found.problems} == slots, found.problems
    assert all(reason.startswith(REASONS[damage]) for _, reason in found.problems), found.problems
    assert not slots & set(found.ready_slots.tolist()) and len(found.ready_keys) == 8 - len(lost)
    assert not set(found.owner.tolist()) & slots                 # no page is held by a lost record
    if damage in ("ns_record_garbage", "ns_record_edited"):
        assert list(found.damaged_namespaces) == [ia[1].slot]


def test_a_stale_record_revived_is_no_entry():
    # Issue 11 item 6: a FREE record keeps the fields of the entry it was, and its pages go to
    # other entries. One byte (its state) made a restarted daemon serve the new entry's bytes under
    # the old key. Here: slot F held key "old" on a2's page before a2 got it (what freeing leaves:
    # the fields, state FREE, record_sum zeroed), and its state byte is set back to READY.
    env, a, b = two_namespaces(16, 4, 2)
    view, a2 = env.view, slot_of(env.store.index, a.engine.ns, b"a2")
    free = int(np.flatnonzero(view.entries["state"] == 0)[0])
    view.entries[free] = view.entries[a2]
    view.entries["key"][free][:3] = np.frombuffer(b"old", np.uint8)
    view.entries["tick"][free] = 0                             # older than a2: it would win the page
    view.entries["record_sum"][free] = 0
    view.entries["state"][free] = 2                            # READY again
    found = scan(view)
    assert found.problems == [(free, "record checksum mismatch")]
    assert b"old" not in found.ready_keys and b"a2" in found.ready_keys and len(found.ready_keys) == 6


def test_an_entry_moved_to_another_namespace_or_its_checksum_zeroed_is_caught():
    # Issue 11 item 6: with checksums, an entry's namespace field moved model X's block to model Y
    # (same size), and a zeroed checksum turned verification off for that entry.
    env = Env(16)
    env.store = reopen(env.view, env.clock, checksums=True)
    x, y = env.engine("x", 1, model="X"), env.engine("y", 1, model="Y")
    ks = [b"k0", b"k1"]
    for s in (x, y):
        _, got = env.store.store(s[0], 1, ks)
        env.store.commit(s[0], 1, True, [shard_checksum(env.view.data, np.frombuffer(p, PAGES_DTYPE), PAGE, PAGE)
                                         for p in per_entry(got, len(ks))])
    assert len(scan(env.view, verify_checksums=True).ready_keys) == 4
    ents = env.view.entries
    moved = slot_of(env.store.index, x[0].engine.ns, b"k0")
    ents["ns"][moved] = y[0].engine.ns.slot                    # X's k0 claims to be Y's
    zeroed = slot_of(env.store.index, x[0].engine.ns, b"k1")
    ents["checksum"][zeroed] = 0
    found = scan(env.view, verify_checksums=True)
    assert sorted(found.problems) == sorted([(moved, "record checksum mismatch"), (zeroed, "record checksum mismatch")])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scribbles=st.lists(st.tuples(st.sampled_from(["entries", "chain"]), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=12)),
                          min_size=1, max_size=12))
def test_scribbled_tables_never_raise_and_what_is_kept_is_whole(scribbles):
    """Random bytes over entry records and chain links (the compiled walk reads whatever is there):
    scan never raises, and every entry it keeps is READY, of a sound namespace, with a chain of its
    namespace's length inside the data area, sharing no page and no key with another kept one."""
    env, na, nb = region()
    for table, at, junk in scribbles:
        raw = getattr(env.view, table).view(np.uint8)
        at %= len(raw)
        raw[at:at + len(junk)] = np.frombuffer(junk, np.uint8)[: len(raw) - at]
    found = scan(env.view)
    num_pages = env.view.geometry.num_pages
    kept_pages, kept_keys = [], set()
    for slot, ns_slot, key, chain in found.ready:
        ns_id = found.namespaces[ns_slot]
        assert env.view.entries["state"][slot] == EntryState.READY
        assert len(chain) == ns_id.entry_pages(PAGE) and ((chain >= 0) & (chain < num_pages)).all()
        assert (ns_slot, key) not in kept_keys
        kept_keys.add((ns_slot, key))
        kept_pages += chain.tolist()
    assert len(kept_pages) == len(set(kept_pages))
    assert set(found.ready_slots.tolist()).isdisjoint(slot for slot, _ in found.problems)

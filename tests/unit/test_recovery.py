"""kvtierd.recovery.scan: what a region's tables hold, judged record by record, without changing a
byte. (What a restarted index then keeps is tested in test_index.py.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy as np

from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import TICK_LIMIT, EntryState, FormatError
from kvtierd.contract.region_sums import shard_checksum
from kvtierd.records import judge_ready, keys_of
from kvtierd.recovery import _checksum_matches, _namespaces, scan

from .store_env import (PAGE, DAMAGES, Env, corrupt_env, damage_region, keys, pages, per_entry, reopen, reseal,
                        slot_of, slot_pages, two_namespaces)


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


def related_model(view, verify_checksums: bool, require_checksums: bool):
    """scan's second stage as NumPy and Python did it before it was compiled (kvtierd 0.3.1), the
    model that records.judge_related must match decision for decision: judge_ready's sound records
    oldest first (a stable sort of the ticks); those that meet another on a page or a fingerprint
    judged one by one against the older kept ones, the rest kept unless a verified checksum fails.
    Returns (kept slots, namespaces, fingerprints, chains, counts, problems, owner)."""
    tables = _namespaces(view)
    ready = judge_ready(view, tables.pages, tables.identity, tables.checksums, require_checksums)
    order = np.argsort(ready["tick"], kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    cand = order[ready["why"][order] == 0]
    slots, counts, ns_of, fps = ready["slots"][cand], ready["counts"][cand], ready["ns"][cand], ready["fps"][cand]
    chains, checksum = ready["chains"][cand], np.where(tables.checksums[ns_of], ready["checksum"][cand], 0)
    pages_in = chains[np.arange(chains.shape[1])[None, :] < counts[:, None]]
    holder = np.repeat(np.arange(len(cand)), counts)
    involved = np.zeros(len(cand), dtype=bool)
    involved[holder[np.bincount(pages_in, minlength=view.geometry.num_pages)[pages_in] > 1]] = True
    fingerprint = fps ^ (ns_of.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    twin_order = np.argsort(fingerprint, kind="stable")
    twins = np.flatnonzero(fingerprint[twin_order][1:] == fingerprint[twin_order][:-1])
    involved[twin_order[twins]] = involved[twin_order[twins + 1]] = True
    reasons = ["", "bad key length", "unknown or damaged namespace", "page count differs from its namespace's",
               "chain leaves the data area", "chain longer than its page count", "tick out of range",
               "record checksum mismatch", "stored without a data checksum"]
    judged = [(int(rank[i]), int(ready["slots"][i]), reasons[ready["why"][i]]) for i in np.flatnonzero(ready["why"])]
    owner = np.full(view.geometry.num_pages, -1, dtype=np.int64)
    keep = np.ones(len(cand), dtype=bool)
    keys_seen = set()
    key_of = dict(zip(np.flatnonzero(involved).tolist(), keys_of(view, slots[involved])))

    def matches(i):
        return _checksum_matches(view, tables.namespaces[int(ns_of[i])], chains[i, : counts[i]], int(checksum[i]))

    for i in range(len(cand)):
        entry_pages, problem = chains[i, : counts[i]], None
        if involved[i] and (owner[entry_pages] >= 0).any():
            problem = f"shares a page with entry {int(owner[entry_pages][owner[entry_pages] >= 0][0])}"
        elif involved[i] and (int(ns_of[i]), key_of[i]) in keys_seen:
            problem = "duplicate key in its namespace"
        elif verify_checksums and checksum[i] and not matches(i):
            problem = "checksum mismatch"
        if problem:
            keep[i] = False
            judged.append((int(rank[cand[i]]), int(slots[i]), problem))
        else:
            if involved[i]:
                keys_seen.add((int(ns_of[i]), key_of[i]))
            owner[entry_pages] = slots[i]
    return (slots[keep], ns_of[keep], fps[keep], chains[keep], counts[keep],
            [(slot, reason) for _, slot, reason in sorted(judged)], owner)


def checksummed_region():
    """Namespaces X (1-page entries x0..x5) and Y (2-page entries y0..y3), every entry with its data
    checksum, and x2 read again (a younger tick)."""
    env = Env(24)
    env.store = reopen(env.view, env.clock, checksums=True)
    x, y = env.engine("x", 1, model="X"), env.engine("y", 1, model="Y", block_bytes=2 * PAGE)
    for s, ks in ((x, keys("x", 6)), (y, keys("y", 4))):
        _, got = env.store.store(s[0], 1, ks)
        env.store.commit(s[0], 1, True, [shard_checksum(env.view.data, np.frombuffer(p, PAGES_DTYPE), PAGE,
                                                        s[0].engine.ns.id.block_bytes)
                                         for p in per_entry(got, len(ks))])
    env.store.lookup(x[0], [b"x2"])
    return env


# Edits that a compiled second stage must judge as the model does. Most reseal the record (as a
# daemon with a bug would have written it), so that the edit gets past the record checksum to the
# judgments in relation: ticks (ties, reversals, out of range), a chain moved onto another entry's
# pages, a key or namespace copied from another record, a checksum changed, a FREE record revived.
EDITS = st.one_of(
    st.tuples(st.just("tick"), st.integers(0, 63),
              st.sampled_from([0, 1, 2, 7, TICK_LIMIT - 1, TICK_LIMIT, (1 << 64) - 1])),
    st.tuples(st.just("first_page"), st.integers(0, 63), st.integers(0, 63)),
    st.tuples(st.just("key"), st.integers(0, 63), st.integers(0, 63)),
    st.tuples(st.just("ns"), st.integers(0, 63), st.integers(0, 63)),
    st.tuples(st.just("checksum"), st.integers(0, 63), st.sampled_from([0, 1, 12345])),
    st.tuples(st.just("revive"), st.integers(0, 63), st.just(0)),
    st.tuples(st.just("scribble"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=12)),
)


def edit_region(view, kind, at, what) -> None:
    ents = view.entries
    if kind == "scribble":
        raw = ents.view(np.uint8)
        at %= len(raw)
        raw[at:at + len(what)] = np.frombuffer(what, np.uint8)[: len(raw) - at]
        return
    slot, other = at % len(ents), what % len(ents)
    if kind == "tick":
        ents["tick"][slot] = what
    elif kind == "first_page":
        ents["first_page"][slot] = ents["first_page"][other]
    elif kind == "key":
        ents["key_len"][slot], ents["key"][slot] = ents["key_len"][other], ents["key"][other]
    elif kind == "ns":
        ents["ns"][slot] = ents["ns"][other]
    elif kind == "checksum":
        ents["checksum"][slot] = what
    elif kind == "revive":
        ents["state"][slot] = EntryState.READY
    try:
        reseal(view, slot)
    except (FormatError, IndexError):
        pass                                    # a chain that cannot be walked: left for the record sum to refuse


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(EDITS, min_size=1, max_size=10), verify=st.booleans(), require=st.booleans())
def test_the_compiled_judgment_in_relation_is_the_models(edits, verify, require):
    """scan (records.judge_related) keeps, orders and refuses exactly what related_model does, with
    the same reasons in the same order and the same holder of every page, on edited and scribbled
    tables."""
    env = checksummed_region()
    for kind, at, what in edits:
        edit_region(env.view, kind, at, what)
    slots, ns_of, fps, chains, counts, problems, owner = related_model(env.view, verify, require)
    found = scan(env.view, verify_checksums=verify, require_checksums=require)
    assert found.ready_slots.tolist() == slots.tolist() and found.ready_ns.tolist() == ns_of.tolist()
    assert found.ready_fps.tolist() == fps.tolist() and found.ready_counts.tolist() == counts.tolist()
    assert found.ready_chains.tolist() == chains.tolist()
    assert [p for p in found.problems if not p[1].startswith("unknown state")] == problems
    assert found.owner.tolist() == owner.tolist()


def test_the_judgment_in_relation_keeps_the_oldest_of_a_shared_page_and_of_a_key():
    """Three records on one page and two of one key, ticks out of slot order: the oldest of each
    is kept, the younger named with the holder of the page or as a duplicate, oldest first."""
    env = checksummed_region()
    view, index = env.view, env.store.index
    ents = view.entries
    x_ns = index.ns.by_id[next(ns for ns in index.ns.by_id if ns.model == "X")]
    x = {k: slot_of(index, x_ns, k) for k in keys("x", 6)}
    for k, tick in ((b"x4", 10), (b"x1", 11), (b"x0", 12), (b"x3", 13), (b"x5", 14)):   # x4 the oldest
        ents["tick"][x[k]] = tick
    for young in (b"x0", b"x1"):
        ents["first_page"][x[young]] = ents["first_page"][x[b"x4"]]
    ents["key"][x[b"x5"]] = ents["key"][x[b"x3"]]                                      # x5 says x3 (younger)
    for k in (b"x4", b"x1", b"x0", b"x3", b"x5"):
        reseal(view, x[k])
    found = scan(view, verify_checksums=True)
    assert found.problems == [(x[b"x1"], f"shares a page with entry {x[b'x4']}"),
                              (x[b"x0"], f"shares a page with entry {x[b'x4']}"),
                              (x[b"x5"], "duplicate key in its namespace")]
    kept = found.ready_slots.tolist()
    assert kept.index(x[b"x4"]) < kept.index(x[b"x3"]) == len(kept) - 1 and (found.owner == x[b"x4"]).sum() == 1

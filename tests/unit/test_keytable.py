"""kvtierd.keytable: (namespace, key) -> slot over the region's entry records, against a plain dict
under random operation sequences, with the hashes forced to collide (``hash_mask``): a lookup must
never return another key's entry, whatever the hashes do."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtierd.contract.protocol import MAX_KEY_BYTES
from kvtierd.contract.region_format import ENTRY_DTYPE, EntryState, Geometry
from kvtierd.contract.region_view import RegionView
from kvtierd.keytable import ALL_BITS, key_table

SLOTS = 48
READY, WRITING = int(EntryState.READY), int(EntryState.WRITING)


def region(slots: int = SLOTS) -> RegionView:
    geo = Geometry.for_pages(slots, 4096)
    view = RegionView(bytearray(geo.meta_bytes), None, geo)
    view.format(1, 0)
    return view


def write(view: RegionView, slot: int, ns: int, state: int = READY) -> None:
    """What the index writes before it indexes a key: a zeroed record of its namespace."""
    view.entries[slot] = np.zeros((), ENTRY_DTYPE)
    view.entries["ns"][slot] = ns
    view.entries["state"][slot] = state


def slots(raw: bytes) -> list[int]:
    return np.frombuffer(raw, np.int32).tolist()


# Keys that share prefixes, differ in length by one byte, or only in their last byte: what a
# comparison that stopped early, or trusted a hash, would confuse.
KEYS = st.sampled_from([b"a", b"ab", b"abc", b"b", b"ba", b"\x00", b"\x00\x00", b"k" * MAX_KEY_BYTES,
                        b"k" * (MAX_KEY_BYTES - 1) + b"j", b"k" * (MAX_KEY_BYTES - 1), bytes(range(36)),
                        bytes(range(35)) + b"\x00", bytes(range(1, 37))])


class KeyTableModel(RuleBasedStateMachine):
    """The key table against a dict (ns, key) -> slot."""

    def __init__(self):
        super().__init__()
        self.view = region()
        self.table = None
        self.model: dict[tuple[int, bytes], int] = {}
        self.free = list(range(SLOTS))

    @rule(mask=st.sampled_from([ALL_BITS, 0, 1, 3, 0xFF00000000000000]))
    @precondition(lambda self: self.table is None)
    def start(self, mask):
        self.table = key_table(self.view, mask)

    @rule(ns=st.integers(0, 2), keys=st.lists(KEYS, max_size=6, unique=True))
    @precondition(lambda self: self.table is not None)
    def insert(self, ns, keys):
        new = [k for k in keys if (ns, k) not in self.model][:len(self.free)]
        taken = [self.free.pop() for _ in new]
        for slot in taken:
            write(self.view, slot, ns, WRITING)
        self.table.insert(ns, new, np.asarray(taken, np.int32))
        for key, slot in zip(new, taken):
            self.model[(ns, key)] = slot
            assert self.view.entry_key(slot) == key       # the table wrote the key into its record

    @rule(ns=st.integers(0, 2), keys=st.lists(KEYS, max_size=8))
    @precondition(lambda self: self.table is not None)
    def find(self, ns, keys):
        assert slots(self.table.find(ns, keys)) == [self.model.get((ns, k), -1) for k in keys]

    @rule(ns=st.integers(0, 2), keys=st.lists(KEYS, max_size=8))
    @precondition(lambda self: self.table is not None)
    def prefix(self, ns, keys):
        want = []
        for key in keys:
            slot = self.model.get((ns, key))
            if slot is None or self.view.entries["state"][slot] != READY:
                break
            want.append(slot)
        assert slots(self.table.prefix(ns, keys, READY)) == want

    @rule(data=st.data())
    @precondition(lambda self: self.table is not None and self.model)
    def make_ready(self, data):
        slot = data.draw(st.sampled_from(sorted(self.model.values())))
        self.view.entries["state"][slot] = READY

    @rule(data=st.data())
    @precondition(lambda self: self.table is not None and self.model)
    def remove(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=5, unique=True))
        self.table.remove(np.asarray([self.model[k] for k in gone], np.int32))
        for k in gone:
            self.free.append(self.model.pop(k))     # the record keeps its key: only the index forgets it

    @rule()
    @precondition(lambda self: self.table is not None)
    def rebuild(self):
        """A restart: the same entries, indexed again from their records."""
        self.table.rebuild(np.asarray(sorted(self.model.values()), np.int32))

    @invariant()
    def consistent(self):
        if self.table is not None:
            self.table.verify()
            assert len(self.table) == len(self.model)
            fps = np.frombuffer(self.table.fingerprints(np.asarray(list(self.model.values()), np.int32)), np.int64)
            assert fps.tolist() == [hash(key) for _, key in self.model]


TestKeyTableModel = KeyTableModel.TestCase
TestKeyTableModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_colliding_keys_are_told_apart_by_their_bytes():
    """Every key of a namespace hashes alike (mask 0): found by comparing bytes, one by one."""
    view = region(64)
    table = key_table(view, hash_mask=0)
    keys = [bytes([i]) * (1 + i % 5) for i in range(40)]
    for i in range(40):
        write(view, i, 7)
    table.insert(7, keys, np.arange(40, dtype=np.int32))
    assert slots(table.find(7, keys)) == list(range(40))
    assert slots(table.find(7, [b"\xff", b"\x00\x00"])) == [-1, -1]
    assert slots(table.find(8, keys[:3])) == [-1, -1, -1]          # another namespace sees none of them
    table.remove(np.arange(0, 40, 2, dtype=np.int32))              # holes in the middle of one long run
    assert slots(table.find(7, keys)) == [-1 if i % 2 == 0 else i for i in range(40)]
    table.verify()


def test_the_same_key_in_two_namespaces_is_two_entries():
    view = region()
    table = key_table(view, hash_mask=0)
    write(view, 0, 1)
    write(view, 1, 2)
    table.insert(1, [b"same"], np.array([0], np.int32))
    table.insert(2, [b"same"], np.array([1], np.int32))
    assert slots(table.find(1, [b"same"])) + slots(table.find(2, [b"same"])) == [0, 1]


def test_a_present_key_or_a_missing_slot_changes_nothing():
    view = region()
    table = key_table(view)
    for slot in range(3):
        write(view, slot, 0)
    table.insert(0, [b"x", b"y"], np.array([0, 1], np.int32))
    with pytest.raises(KeyError):
        table.insert(0, [b"z", b"y"], np.array([2, 3], np.int32))
    assert slots(table.find(0, [b"z"])) == [-1] and len(table) == 2
    with pytest.raises(KeyError):
        table.remove(np.array([0, 5], np.int32))                   # 5 is not indexed: 0 stays
    assert slots(table.find(0, [b"x"])) == [0]
    with pytest.raises(KeyError):
        table.rebuild(np.array([0, 0], np.int32))                  # one key twice: nothing indexed
    assert len(table) == 0
    table.verify()


@pytest.mark.parametrize("keys, error", [
    ("abc", TypeError), ([b""], ValueError), ([b"x" * (MAX_KEY_BYTES + 1)], ValueError), (["str"], ValueError),
])
def test_bad_keys_are_refused(keys, error):
    table = key_table(region())
    with pytest.raises(error):
        table.find(0, keys)


def test_pages_walks_each_chain():
    view = region(16)
    table = key_table(view)
    write(view, 3, 0)
    view.entries["first_page"][3], view.entries["page_count"][3] = 5, 3
    view.write_chain(np.array([5, 9, 2], np.uint32))
    write(view, 4, 0)
    view.entries["first_page"][4], view.entries["page_count"][4] = 7, 1
    view.write_chain(np.array([7], np.uint32))
    assert np.frombuffer(table.pages(view.chain, np.array([3], np.int32), 3, 1, 3), np.uint32).tolist() == [9, 2]
    assert np.frombuffer(table.pages(view.chain, np.array([4, 3], np.int32)), np.uint32).tolist() == [7, 5, 9, 2]
    view.chain[9] = 99                                              # a link out of the data area
    with pytest.raises(ValueError, match="chain leaves"):
        table.pages(view.chain, np.array([3], np.int32))

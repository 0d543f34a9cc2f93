"""kvtierd.index: the entry index over flat arrays, against a plain dict model under random
operation sequences (stores, commits, aborts, lookups, loads, leases, evictions, restarts), with
keys forced to collide in the key table; namespace reclaim; and recovery from a region that
today's format wrote (tests/unit/data/region-v2.meta.gz: the metadata file the store of commit
af97510 left, before the array index, when killed with a store job open: two namespaces, one
sharded, WRITING records and their writer's fenced pages)."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.protocol import ErrorCode, PAGES_DTYPE, RequestError
from kvtierd.contract.region_format import EntryState, Geometry, NS_SLOTS
from kvtierd.contract.region_view import RegionView
from kvtierd.fence import Fence
from kvtierd.holds import Holds
from kvtierd.index import Index
from kvtierd.keytable import ALL_BITS
from kvtierd.policy.native import NATIVE
from kvtierd.processes import boot_id
from kvtierd.recovery import scan

PAGES = 24
READY, WRITING = EntryState.READY, EntryState.WRITING
W, P, N = StoreOutcome.WRITE, StoreOutcome.PRESENT, StoreOutcome.NO_SPACE
LAYOUTS = [NamespaceId("one", "bf16", 16, 4096), NamespaceId("two", "bf16", 16, 8192),
           NamespaceId("shard", "bf16", 16, 4096, "sharded", 2)]
KEYS = [b"k%d" % i for i in range(16)] + [b"k", b"k1\x00", b"\x00" * 36]


def fresh_view(pages: int = PAGES) -> RegionView:
    geo = Geometry.for_pages(pages, 4096)
    view = RegionView(bytearray(geo.meta_bytes), None, geo)
    view.format(1, 0)
    return view


def index(view: RegionView, policy: str = "slru", mask: int = ALL_BITS) -> Index:
    holds = Holds(view.geometry.entry_slots, view.geometry.num_pages, NATIVE[policy]())
    return Index(view, holds, Fence(view, 600.0), hash_mask=mask)


def slots_of(idx: Index, ns, keys) -> list[int]:
    return idx.find(ns, keys).tolist()


class Engine:
    """What holds count a load's pins and a lease against: an engine of a namespace."""

    def __init__(self, ns):
        self.ns = ns


class IndexModel(RuleBasedStateMachine):
    """The index against {(layout, key): state} and the holds per key."""

    @initialize(policy=st.sampled_from(sorted(NATIVE)), mask=st.sampled_from([ALL_BITS, 0, 1]))
    def start(self, policy, mask):
        self.policy, self.mask = policy, mask
        self.view = fresh_view()
        self.idx = index(self.view, policy, mask)
        self.ns = [self.idx.namespace(layout) for layout in LAYOUTS]
        self.engines = [Engine(ns) for ns in self.ns]
        self.model: dict[tuple[int, bytes], EntryState] = {}
        self.pins: dict[tuple[int, bytes], int] = {}
        self.leases: dict[tuple[int, bytes], int] = {}
        self.jobs: list[tuple[int, list[bytes], np.ndarray]] = []        # open store jobs

    def held(self, item) -> bool:
        return bool(self.pins.get(item) or self.leases.get(item))

    def ready_prefix(self, n: int, keys: list[bytes]) -> list[bytes]:
        out = []
        for key in keys:
            if self.model.get((n, key)) is not READY:
                break
            out.append(key)
        return out

    def forget_evicted(self, spared=()) -> set:
        """Keys the index no longer has were evicted: each must have been READY and unheld."""
        gone = set()
        for (n, key), state in list(self.model.items()):
            if slots_of(self.idx, self.ns[n], [key]) == [-1]:
                assert state is READY and not self.held((n, key)) and (n, key) not in spared, (n, key, state)
                del self.model[(n, key)]
                gone.add((n, key))
        return gone

    @rule(n=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    def store(self, n, keys):
        ns = self.ns[n]
        present = [(n, k) in self.model for k in keys]
        outcomes, slots, present_count = self.idx.place(ns, keys)
        self.forget_evicted(spared={(n, k) for k in keys})
        new = [k for k, p in zip(keys, present) if not p]
        assert len(outcomes) == len(keys) and present_count == sum(present)
        written = [k for k, o in zip(keys, outcomes) if o == W]
        assert written == new[:len(written)]                 # the new keys that fit, in order
        assert all((o == P) == p for o, p in zip(outcomes, present))
        assert all(o == N for o, k in zip(outcomes, keys) if k in new[len(written):])
        assert self.idx.keys_of(slots) == written
        for key in written:
            self.model[(n, key)] = WRITING
        if written:
            self.jobs.append((n, written, slots))

    @rule(data=st.data())
    @precondition(lambda self: self.jobs)
    def commit(self, data):
        n, keys, slots = self.jobs.pop(data.draw(st.integers(0, len(self.jobs) - 1)))
        self.idx.make_ready(slots, chain=data.draw(st.booleans()), cold=data.draw(st.integers(0, 2)))
        for key in keys:
            self.model[(n, key)] = READY

    @rule(data=st.data())
    @precondition(lambda self: self.jobs)
    def abort(self, data):
        n, keys, slots = self.jobs.pop(data.draw(st.integers(0, len(self.jobs) - 1)))
        pages = np.frombuffer(self.idx.pages_of(self.ns[n], slots), PAGES_DTYPE).copy()
        self.idx.abandon(slots)
        self.idx.release_pages(pages)        # (the job machine frees or fences them)
        for key in keys:
            del self.model[(n, key)]

    @rule(n=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), max_size=8, unique=True))
    def lookup(self, n, keys):
        hits = self.idx.lookup(self.ns[n], keys)
        assert self.idx.keys_of(hits) == self.ready_prefix(n, keys)
        self.idx.access(hits)

    @rule(n=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), max_size=8, unique=True),
          kind=st.sampled_from(["pin", "lease"]))
    def hold(self, n, keys, kind):
        hits = self.idx.ready(self.ns[n], keys)
        (self.idx.pin if kind == "pin" else self.idx.lease)(hits, self.engines[n])
        counts = self.pins if kind == "pin" else self.leases
        for key in self.ready_prefix(n, keys):
            counts[(n, key)] = counts.get((n, key), 0) + 1

    @rule(data=st.data(), kind=st.sampled_from(["pin", "lease"]))
    def let_go(self, data, kind):
        counts = self.pins if kind == "pin" else self.leases
        held = sorted(item for item, c in counts.items() if c)
        if not held:
            return
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        for n in {n for n, _ in chosen}:        # each namespace's engine lets go of its own holds
            slots = np.asarray(slots_of(self.idx, self.ns[n], [k for m, k in chosen if m == n]), np.int32)
            (self.idx.unpin if kind == "pin" else self.idx.unlease)(slots, self.engines[n])
        for item in chosen:
            counts[item] -= 1

    @rule(n=st.one_of(st.none(), st.integers(0, 2)), count=st.one_of(st.none(), st.integers(0, 5)))
    def operator_evict(self, n, count):
        evictable = [i for i, s in self.model.items() if s is READY and not self.held(i) and (n is None or i[0] == n)]
        done = self.idx.evict(None if n is None else LAYOUTS[n].name(), count)
        assert done == (len(evictable) if count is None else min(count, len(evictable)))
        assert len(self.forget_evicted()) == done

    @rule()
    def restart(self):
        """A new index over the same tables: READY entries stay, WRITING ones go, holds die."""
        self.idx = index(RegionView(self.view.raw, None, self.view.geometry), self.policy, self.mask)
        self.ns = [self.idx.namespace(layout) for layout in LAYOUTS]
        self.engines = [Engine(ns) for ns in self.ns]
        self.model = {i: s for i, s in self.model.items() if s is READY}
        self.pins.clear()
        self.leases.clear()
        self.jobs.clear()
        assert self.idx.recovered["ready"] == len(self.model)

    @invariant()
    def matches(self):
        self.idx.verify()
        for n, ns in enumerate(self.ns):
            keys = [k for (m, k) in self.model if m == n]
            slots = self.idx.find(ns, keys)
            assert (slots >= 0).all()
            assert [EntryState(s) for s in self.idx.states(slots)] == [self.model[(n, k)] for k in keys]
            for key, slot in zip(keys, slots.tolist()):
                assert self.idx.holds.of(slot) == (self.pins.get((n, key), 0), self.leases.get((n, key), 0))
        # Each engine's holds count its entries' pages, once per pin and per lease.
        held = Counter()
        for (n, key), count in (Counter(self.pins) + Counter(self.leases)).items():
            held[self.engines[n]] += count * self.ns[n].entry_pages
        self.idx.holds.verify_holders(held)
        stats = self.idx.stats()
        assert stats["entries_ready"] == sum(s is READY for s in self.model.values())
        assert stats["entries_writing"] == sum(s is WRITING for s in self.model.values())
        assert stats["evictable"] == sum(s is READY and not self.held(i) for i, s in self.model.items())
        counts = {ns["name"]: ns["entries"] for ns in self.idx.namespace_stats()}
        assert [counts[layout.name()] for layout in LAYOUTS] == [sum(m == n for m, _ in self.model) for n in range(3)]


TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---------------------------------------------------------------------------------------- namespaces
def test_a_full_namespace_table_takes_over_the_least_recently_used_unused_namespace():
    """Unused namespaces are taken over, the one used least recently first (one that holds no
    entry before any), their entries evicted; used ones never: NO_SPACE when none is left."""
    idx = index(fresh_view(64))
    spaces = [idx.namespace(NamespaceId(f"m{i}", "bf16", 16, 4096)) for i in range(NS_SLOTS)]
    for i in (3, 5, 7):
        idx.make_ready(idx.place(spaces[i], [b"x", b"y"])[1])
    idx.access(idx.lookup(spaces[3], [b"x"]))
    idx.access(idx.lookup(spaces[5], [b"x"]))               # 5 was used after 3
    for i, ns in enumerate(spaces):
        ns.users = 0 if i in (3, 5, 9) else 1               # 9: unused, no entries
    taken = []
    for i in range(3):
        taken.append(idx.namespace(NamespaceId(f"new{i}", "bf16", 16, 4096)))
        taken[-1].users = 1                                 # an engine attached to it
    assert [ns.slot for ns in taken] == [9, 3, 5]
    assert idx.counters["evictions"] == 4                   # 3's two entries, then 5's
    assert len(idx.lookup(spaces[7], [b"x", b"y"])) == 2 and idx.find(taken[1], [b"x"]).tolist() == [-1]
    idx.verify()
    with pytest.raises(RequestError) as info:
        idx.namespace(NamespaceId("one-too-many", "bf16", 16, 4096))
    assert info.value.code is ErrorCode.NO_SPACE


# ---------------------------------------------------------------------------------------- recovery
FIXTURE = Path(__file__).parent / "data" / "region-v2.meta.gz"


@pytest.mark.parametrize("policy", sorted(NATIVE))
@pytest.mark.parametrize("same_boot", [True, False])
def test_a_region_written_by_todays_format_recovers(policy, same_boot):
    """What today's store wrote (Entry objects, OrderedDict policies) the array index reads:
    every committed entry, in recency order, the uncommitted job's entries discarded, and its
    writer's pages kept from everyone while that writer may live (``same_boot``: its row says
    this boot, and it cannot be watched: the grace period) or freed (another boot: it is dead)."""
    raw = bytearray(gzip.decompress(FIXTURE.read_bytes()))
    view = RegionView(raw)
    view.writers["boot"][0] = boot_id() if same_boot else boot_id() ^ 1
    found = scan(RegionView(raw))
    assert found.problems == [] and len(found.writing) == 2 and found.pages_fenced == 2
    idx = index(view, policy)
    idx.verify()
    one, shard = idx.namespace(NamespaceId("one-page", "bf16", 16, 4096)), None
    for ns in idx.namespaces.values():
        if ns.id.model == "sharded":
            shard = ns
    assert (one.entry_pages, shard.entry_pages, shard.shards) == (1, 2, 2)
    a, c, b = [b"a%d" % i for i in range(20)], [b"c%d" % i for i in range(3)], [b"b%d" % i for i in range(6)]
    assert len(idx.lookup(one, a + c)) == 23 and len(idx.lookup(shard, b)) == 6
    assert idx.find(one, [b"w0", b"w1"]).tolist() == [-1, -1]            # never committed
    fenced = 2 if same_boot else 0
    assert idx.recovered == {"ready": 29, "writing_discarded": 2, "corrupt_discarded": 0, "pages_fenced": fenced}
    assert idx.pages.free_count == idx.geometry.num_pages - (20 + 3 + 2 * 6) - fenced
    # The policy's order is the tick order: the entries a lookup touched last come last.
    walk = np.frombuffer(idx.policy.victims(-1), np.int32)
    # (stored a0..a19, then b0..b5, looked a3..a7 up, stored c0..c2; one tick per request)
    assert idx.keys_of(walk) == a[:3] + a[8:] + b + a[3:8] + c
    # And it stores into it as into its own.
    _, slots, _ = idx.place(one, [b"new"])
    idx.make_ready(slots)
    idx.verify()

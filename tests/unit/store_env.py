"""What the store's unit tests share: a region in memory, a fake clock, engines and the whole
store and load protocols (``Env``), and ``err`` for expected error codes.

No sockets, no files: the region is a RegionView over an in-memory buffer (4 KiB pages), and
time is a fake clock the tests advance. Every scenario ends with ``store.verify()`` (the store's
own consistency checker); the ``env`` fixture (conftest.py) also runs it at teardown.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.codes import ErrorCode, RequestError, StoreOutcome
from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import CHAIN_END, EntryState, Geometry
from kvtierd.contract.region_sums import entry_record_sums, namespace_identities
from kvtierd.contract.region_view import RegionView
from kvtierd.policy import DEFAULT as DEFAULT_POLICY
from kvtierd.store import Store

PAGE = 4096
W, P, N = StoreOutcome.WRITE, StoreOutcome.PRESENT, StoreOutcome.NO_SPACE
TIMEOUT = 10.0


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_view(num_pages: int, ns_slots: int | None = None) -> RegionView:
    """A formatted region in memory. ``ns_slots``: the daemon sees only that many slots of the
    namespace table (the format's 1,024 make a full table slow to reach in a test that churns it)."""
    geo = Geometry.for_pages(num_pages, PAGE)
    view = RegionView(bytearray(geo.meta_bytes), bytearray(geo.data_bytes), geo)
    view.format(generation=1, created_unix_ns=0)
    if ns_slots is not None:
        view.namespaces = view.namespaces[:ns_slots]
    return view


def reopen(view: RegionView, clock=None, checksums: bool = False) -> Store:
    """A restarted daemon: a fresh Store over the same region bytes."""
    return Store(RegionView(view.raw, view.data_file, view.geometry), job_timeout=TIMEOUT, clock=clock or FakeClock(),
                 checksums=checksums, held_shares=HOLD_ALL)


def lay(kind: str = "replicated", world_size: int = 1, block_bytes: int = PAGE, model: str = "m",
        dtype: str = "bf16", block_tokens: int = 16) -> NamespaceId:
    return NamespaceId.from_wire({"model": model, "dtype": dtype, "block_tokens": block_tokens,
                                  "block_bytes": block_bytes, "sharding": kind}, world_size)


def keys(prefix: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(start, start + n)]


def pages(p: bytes) -> list[int]:
    return np.frombuffer(p, PAGES_DTYPE).tolist()


def per_entry(p: bytes, n: int) -> list[bytes]:
    """A reply's pages (PAGES_DTYPE bytes, ``n`` entries' runs one after the other) split per entry."""
    if n == 0:
        return []
    step = len(p) // n
    return [p[i * step:(i + 1) * step] for i in range(n)]


def slot_of(index, ns, key: bytes) -> int:
    """The slot of ``key``'s entry in ``ns`` (WRITING or READY), -1 when there is none."""
    return int(index.find(ns, [key])[0])


# What the unit stores let engines hold out of eviction: all of it. Their regions are a few pages,
# where any share would cut the pins and leases they test; the tests of the shares (test_holds.py)
# pass the shares they test.
HOLD_ALL = (1.0, 1.0, 1.0)


class Env:
    def __init__(self, num_pages: int = 64, policy: str = DEFAULT_POLICY, ns_slots: int | None = None,
                 held_shares=HOLD_ALL, **store):
        """``store``: more of ``Store``'s arguments (a ``tier`` factory)."""
        self.clock = FakeClock()
        self.view = make_view(num_pages, ns_slots)
        self.store = Store(self.view, job_timeout=TIMEOUT, clock=self.clock, policy=policy, held_shares=held_shares,
                           **store)

    def ranks(self, engine: str, world_size: int, layout: NamespaceId) -> list:
        return [self.store.attach(engine, r, world_size, layout) for r in range(world_size)]

    def engine(self, engine: str, world_size: int = 1, kind: str = "replicated", **kw) -> list:
        return self.ranks(engine, world_size, lay(kind, world_size, **kw))

    def put(self, sessions: list, job: int, ks: list[bytes]) -> tuple[list, dict]:
        """The whole store protocol: every rank stores, then the writers commit."""
        outcomes, got = None, {}
        for s in sessions:
            outcomes, got[s.rank] = self.store.store(s, job, ks)
        for s in sessions:
            if s.rank in s.engine.writers:
                self.store.commit(s, job, True)
        return outcomes, got

    def get(self, sessions: list, job: int, ks: list[bytes]) -> tuple[int, dict]:
        """The whole load protocol: every rank loads, then releases."""
        hits, got = None, {}
        for s in sessions:
            hits, got[s.rank] = self.store.load(s, job, ks)
        for s in sessions:
            self.store.release(s, job)
        return hits, got

    def has(self, session, key: bytes) -> bool:
        """Without touching the LRU (unlike lookup)."""
        return slot_of(self.store.index, session.engine.ns, key) in self.ready_slots()

    def ready_slots(self) -> set[int]:
        index = self.store.index
        return set(np.flatnonzero(index.states(np.arange(index.geometry.entry_slots)) == EntryState.READY).tolist())

    def stats(self) -> dict:
        return self.store.stats()


def small(num_pages: int, policy: str = DEFAULT_POLICY) -> Env:
    return Env(num_pages, policy)


@contextlib.contextmanager
def err(code: ErrorCode):
    """Expect a RequestError with exactly this code."""
    with pytest.raises(RequestError) as info:
        yield info
    assert info.value.code is code, f"expected {code.name}, got {info.value.code.name}: {info.value.message}"


def two_namespaces(num_pages: int, a: int, b: int):
    """A region holding entries a0.. (namespace A, 1 page each) and b0.. (namespace B, 2 pages each:
    chains of different lengths). Returns (env, a rank session of A, a rank session of B)."""
    env = small(num_pages)
    ea = env.engine("a", 1, model="A")
    eb = env.engine("b", 1, model="B", block_bytes=2 * PAGE)
    env.put(ea, 1, keys("a", a))
    env.put(eb, 1, keys("b", b))
    return env, ea[0], eb[0]


def corrupt_env():
    """Namespace A: 1-page entries a0..a3; namespace B: 2-page entries b0..b3."""
    env, a, b = two_namespaces(32, 4, 4)
    return env, (env.store.index, a.engine.ns), (env.store.index, b.engine.ns)


def slot_pages(where, key):
    """(slot, whole page chain) of ``key``'s entry; ``where``: (index, namespace)."""
    index, ns = where
    slot = slot_of(index, ns, key)
    return slot, pages(index.pages_of(ns, np.array([slot], np.int32)))


def reseal(view: RegionView, slot: int) -> None:
    """Recompute an entry record's record_sum after an edit, as a daemon with a bug would have
    written it: the damage then gets past the record checksum, to the checks behind it."""
    rec = view.entries[slot:slot + 1]
    chain = np.asarray([view.chain_of(slot)], dtype=np.uint32)
    ns = int(rec["ns"][0])
    if ns >= len(view.namespaces):                  # scribbled: no namespace to seal it under
        raise IndexError(f"slot {slot}: namespace slot {ns} is outside the namespace table")
    identity = namespace_identities(view.namespaces[ns:ns + 1])
    view.entries["record_sum"][slot] = entry_record_sums(rec, chain, None, identity)[0]


# Damage done to the tables of ``corrupt_env``'s region, each to one record (or one namespace).
DAMAGES = ["shared_page", "first_out_of_range", "link_out_of_range", "chain_short", "chain_long_short_row",
           "cycle", "bad_ns", "key_len_zero", "duplicate_key", "page_count_huge", "page_count_wrong",
           "bad_state", "ns_record_garbage", "key_len_too_long", "first_page_moved", "length_edited",
           "tick_huge", "ns_record_edited"]


def damage_region(env, ia, ib, damage: str) -> list[bytes]:
    """Do ``damage`` to the tables; returns the keys a restart must then lose."""
    view = env.view
    ents = view.entries
    sa, pa = slot_pages(ia, b"a1")
    sb, pb = slot_pages(ib, b"b1")
    lost = [b"a1"]
    if damage == "shared_page":
        sb2, pb2 = slot_pages(ib, b"b2")
        ents[sb2]["first_page"] = pb[0]            # b2 now claims b1's pages; b1 is older
        reseal(view, sb2)
        lost = [b"b2"]
    elif damage == "first_out_of_range":
        ents[sa]["first_page"] = view.geometry.num_pages + 5
    elif damage == "link_out_of_range":
        view.chain[pb[0]] = view.geometry.num_pages
        lost = [b"b1"]
    elif damage == "chain_short":
        view.chain[pb[0]] = CHAIN_END
        lost = [b"b1"]
    elif damage == "chain_long_short_row":
        view.chain[pa[0]] = pb[0]                 # a 1-page entry whose chain goes on
    elif damage == "cycle":
        view.chain[pb[1]] = pb[0]
        lost = [b"b1"]
    elif damage == "bad_ns":
        ents[sa]["ns"] = 999
    elif damage == "key_len_zero":
        ents[sa]["key_len"] = 0
    elif damage == "key_len_too_long":
        ents[sa]["key_len"] = 200
    elif damage == "duplicate_key":
        sa2, _ = slot_pages(ia, b"a2")
        ents[sa2]["key"][:2] = np.frombuffer(b"a1", np.uint8)  # a2's record now says a1 (younger)
        reseal(view, sa2)
        lost = [b"a2"]
    elif damage == "page_count_huge":
        ents[sa]["page_count"] = 0xFFFFFFF0
    elif damage == "page_count_wrong":
        ents[sb]["page_count"] = 1
        lost = [b"b1"]
    elif damage == "bad_state":
        ents[sa]["state"] = 77
    elif damage == "ns_record_garbage":
        view.namespaces[ents[sa]["ns"]]["sharding"] = 9
        lost = keys("a", 4)
    elif damage == "first_page_moved":             # a page number edited: still in range, still unshared
        ents[sa]["first_page"] = int(np.setdiff1d(np.arange(view.geometry.num_pages), pages_held(env))[0])
    elif damage == "length_edited":
        ents[sa]["length"] += 1
    elif damage == "tick_huge":                    # 2^64 - 1 made every request fail with INTERNAL
        ents[sa]["tick"] = (1 << 64) - 1
    elif damage == "ns_record_edited":             # "A" becomes "Z": its entries would serve model Z
        view.namespaces[ents[sa]["ns"]]["model"] = b"Z"
        lost = keys("a", 4)
    return lost


def pages_held(env) -> np.ndarray:
    """Every page the live entries hold."""
    index = env.store.index
    return np.concatenate([np.frombuffer(index.pages_of(ns, index.slots_of(ns)), PAGES_DTYPE) for ns in index.ns])

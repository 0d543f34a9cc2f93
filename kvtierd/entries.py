"""The entry index over flat arrays: namespaces, (namespace, key) → entry slot, entry states, holds,
eviction, the access clock, and recovery from the region's tables. No sockets, no threads, no jobs,
and no Python object per entry.

An entry is one cached block of one namespace, named by its slot in the region's entry table. It
is WRITING from the moment a store job is given its pages until every rank of the job has voted
(``make_ready``), then READY: visible to lookup and load, and evictable unless a load pins it or a
lease holds it (``kvtierd.leases``). Its record mirrors it; READY is the last byte written there,
FREE the first (invariant 1: a restarted daemon never takes a half-written record for a ready one).

Where an entry's state lives, all of it in arrays indexed by slot:

- the region's entry table (``region_format``): state, namespace, key, page chain, tick and
  sums. It is the source of truth: a restart rebuilds everything below from it in a few passes
  (``recovery.scan``, then ``KeyTable.rebuild`` and ``Policy.recovered``);
- the key table (``kvtierd.keytable``): (namespace, key) → slot, and each key's fingerprint;
- the holds: load pins and leases, two uint32 counts per slot;
- the eviction policy's lists (``kvtierd.policy.native``).

Every operation takes a whole request's keys or slots (an int32 NumPy array) and is a handful of
compiled or NumPy passes: no Python per key, and nothing per entry for the garbage collector to
walk (docs/benchmarks.md: a full region of a million entries under eviction has no GC pauses).

Eviction: the policy holds exactly the READY entries that no load pins and no lease holds, and
chooses among them, across all namespaces; the index frees what it chooses (invariants 2 and 10).
An entry leaves the policy's set when the first hold of either kind comes and re-enters it when
the last one goes. A page is free, held by an entry, or fenced (``kvtierd.fence``): held by no
entry, but kept from everyone until the writer that was handed it is proven unable to write.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import numpy as np

from ._native import hold
from .contract.namespace import NamespaceId
from .contract.protocol import PAGES_DTYPE, ErrorCode, RequestError, StoreOutcome
from .contract.region_format import (ENTRY_DTYPE, NS_CHECKSUMS, NS_SLOTS, TICK_LIMIT, EntryState, RegionView,
                                     entry_checksum, namespace_identities, namespace_record)
from .fence import Fence
from .keytable import ALL_BITS, key_table
from .pages import FreeIds
from .policy import Policy
from .records import keys_of, record_sums
from .recovery import scan

log = logging.getLogger(__name__)

NO_SLOTS = np.zeros(0, dtype=np.int32)
# Plain ints: NumPy compares and stores an IntEnum member 2-3x slower than an int (per call).
READY, WRITING, FREE = int(EntryState.READY), int(EntryState.WRITING), int(EntryState.FREE)
WRITE, PRESENT, NO_SPACE = int(StoreOutcome.WRITE), int(StoreOutcome.PRESENT), int(StoreOutcome.NO_SPACE)

# Monotonic counters the index keeps (Store.stats reports them with the job machine's).
COUNTERS = ("lookup_hit_keys", "lookup_miss_keys", "store_written_keys", "store_present_keys",
            "store_no_space_keys", "evictions", "operator_evictions")


def _slots(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, np.int32)


class Namespace:
    """One namespace: what every entry of it has in common (its entries are slots of the index)."""

    __slots__ = ("slot", "id", "shards", "pages_per_shard", "entry_pages", "record", "users", "identity")

    def __init__(self, slot: int, ns_id: NamespaceId, page_size: int, identity: int):
        self.slot = slot                  # in the region's namespace table
        self.id = ns_id
        self.identity = identity          # namespace_identities of its record: every entry's record_sum covers it
        self.shards = ns_id.shards
        self.pages_per_shard = ns_id.pages_per_shard(page_size)
        self.entry_pages = ns_id.entry_pages(page_size)
        self.users = 0                    # attached engines of this namespace
        # What every new entry record of this namespace starts from.
        self.record = np.zeros(1, ENTRY_DTYPE)
        self.record[["state", "ns", "page_count", "length"]] = (WRITING, slot, self.entry_pages, ns_id.entry_bytes)

    def shard(self, rank: int | None) -> tuple[int, int]:
        """The links of an entry's chain that ``rank`` copies: the whole chain of a replicated
        entry (rank 0 writes its one copy, every rank loads it), run ``rank`` of a sharded one."""
        if self.shards == 1 or rank is None:
            return 0, self.entry_pages
        return rank * self.pages_per_shard, (rank + 1) * self.pages_per_shard


class EntryIndex:
    def __init__(self, view: RegionView, policy: Policy, fence: Fence, verify_checksums: bool = False,
                 hash_mask: int = ALL_BITS):
        """``hash_mask``: the bits of each key's hash the key table uses (tests narrow it so that
        keys collide)."""
        self.view = view
        self.fence = fence
        self.geometry = view.geometry
        self.page_size = view.geometry.page_size
        self.policy = policy
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self.ns_by_slot: dict[int, Namespace] = {}
        self.keys = key_table(view, hash_mask)
        slots = self.geometry.entry_slots
        self.entry_count = {WRITING: 0, READY: 0}
        # What holds each slot's entry out of the policy: load jobs (pins) and leases.
        self._pins = np.zeros(slots, np.uint32)
        self._leases = np.zeros(slots, np.uint32)
        self.pinned_entries = 0
        self.leased_entries = 0
        self.checksums = verify_checksums         # entries carry data checksums (their namespaces' flag)
        self.tick = 0                             # the access clock (recovery orders by it)
        self.counters: Counter = Counter()
        # Told of every eviction, before the entries are freed: (slots, counter name). The second
        # tier counts the blocks a store's room took that it could not demote (kvtierd.tiering).
        self.evicting: Callable[[np.ndarray, str], None] | None = None
        entries = view.entries                    # columns of the entry table, for vectorised writes
        self._states, self._ticks, self._sums = entries["state"], entries["tick"], entries["record_sum"]
        self._ns_col, self._page_counts = entries["ns"], entries["page_count"]
        # The entry table as rows of bytes: NumPy scatters whole structured records ~100x slower
        # than the same bytes as uint8 rows.
        self._records = entries.view(np.uint8).reshape(len(entries), ENTRY_DTYPE.itemsize)
        self.recovered = self._recover(verify_checksums)

    # ------------------------------------------------------------------ recovery
    def _recover(self, verify_checksums: bool) -> dict[str, int]:
        """Rebuild the key table, the policy's order and the free pages and slots from the tables.

        READY entries whose namespace record and page chain are sound (``recovery.scan``) are
        kept, oldest tick first in the policy; WRITING entries (a copy or vote that never
        finished) are discarded, as are entries whose chain is broken or shares a page with an
        earlier entry, and damaged records. The pages of discarded entries are free unless the
        fence holds them for a writer that may still copy into them (``Fence.recover``). Nothing
        in the tables can make recovery raise. A few passes over arrays: a million entries are
        indexed without a Python object each.
        """
        view = self.view
        # With checksums on, an entry stored without one (the setting was off) is not kept: every
        # entry served was verified at recovery.
        found = scan(view, verify_checksums=verify_checksums, require_checksums=verify_checksums)
        for slot, why in found.damaged_namespaces.items():
            log.warning("namespace slot %d is damaged (%s); discarding it and its entries", slot, why)
            view.namespaces[slot]["in_use"] = 0
        flag = NS_CHECKSUMS if verify_checksums else 0
        for slot, ns_id in found.namespaces.items():
            self._add_namespace(slot, ns_id)
            if int(view.namespaces[slot]["flags"]) & NS_CHECKSUMS != flag:
                view.namespaces[slot] = namespace_record(ns_id, flag)   # the setting changed: it follows
        states = self._states
        for slot, why in found.problems:
            log.warning("entry %d discarded: %s", slot, why)
            states[slot] = FREE
        states[found.writing] = FREE
        self._sums[states != READY] = 0
        ready = found.ready_slots.astype(np.int32)
        self.keys.rebuild(ready, found.ready_fps, found.ready_ns)
        self.policy.recovered(ready, found.ready_fps)
        self.entry_count[READY] = len(ready)
        fenced = self.fence.recover(found)
        self.pages = FreeIds(self.geometry.num_pages, np.concatenate([np.flatnonzero(found.owner >= 0), fenced]))
        self.slots = FreeIds(self.geometry.entry_slots, np.flatnonzero(states != FREE))
        # The clock goes on from the newest tick kept (scan refused any at or past TICK_LIMIT).
        header_tick = int(view.header["tick"])
        self.tick = max(header_tick if header_tick < TICK_LIMIT else 0,
                        int(self._ticks[ready[-1]]) if len(ready) else 0)       # the newest: last
        return {"ready": len(ready), "writing_discarded": len(found.writing),
                "corrupt_discarded": len(found.problems), "pages_fenced": len(fenced)}

    # ------------------------------------------------------------------ namespaces
    def _add_namespace(self, slot: int, ns_id: NamespaceId) -> Namespace:
        table = self.view.namespaces
        ns = Namespace(slot, ns_id, self.page_size, int(namespace_identities(table[slot:slot + 1])[0]))
        self.namespaces[ns_id] = ns
        self.ns_by_slot[slot] = ns
        return ns

    def namespace(self, ns_id: NamespaceId) -> Namespace:
        """The namespace of ``ns_id``, recorded in the namespace table when it is new. When the
        table is full, the slot of a namespace no attached engine uses is taken over — the one
        whose entries were used least recently, its entries evicted — so namespaces that an engine
        (or an attacker) left behind cannot keep new models out, across restarts too."""
        ns = self.namespaces.get(ns_id)
        if ns is not None:
            return ns
        if ns_id.entry_pages(self.page_size) > self.geometry.num_pages:
            raise RequestError(ErrorCode.NO_SPACE,
                               f"one block of {ns_id.name()} needs {ns_id.entry_pages(self.page_size)} pages; "
                               f"the region has {self.geometry.num_pages}")
        table = self.view.namespaces
        free = np.flatnonzero(table["in_use"] == 0)
        slot = int(free[0]) if len(free) else self._reclaim_namespace()
        table[slot] = namespace_record(ns_id, NS_CHECKSUMS if self.checksums else 0)
        ns = self._add_namespace(slot, ns_id)
        log.info("namespace %d: %s", slot, ns_id.name())
        return ns

    def _reclaim_namespace(self) -> int:
        """Free the table slot of the unused namespace used least recently (evicting its entries)."""
        unused = [n for n in self.namespaces.values() if not n.users]
        if not unused:
            raise RequestError(ErrorCode.NO_SPACE, f"all {len(self.view.namespaces)} namespace slots are held by "
                                                   "attached engines")
        live = np.flatnonzero(self._states != FREE)
        newest = np.full(NS_SLOTS, -1, dtype=np.int64)
        np.maximum.at(newest, self._ns_col[live].astype(np.intp), self._ticks[live].astype(np.int64))
        victim = min(unused, key=lambda ns: int(newest[ns.slot]))
        slots = self.slots_of(victim)       # no engine uses it: no job holds them, none pinned
        self._evict(slots)
        del self.namespaces[victim.id]
        del self.ns_by_slot[victim.slot]
        self.view.namespaces[victim.slot]["in_use"] = 0
        log.warning("namespace table full: namespace %d (%s) taken over, %d of its entries evicted", victim.slot,
                    victim.id.name(), len(slots))
        return victim.slot

    def slots_of(self, ns: Namespace) -> np.ndarray:
        """Every live (WRITING or READY) entry of the namespace: a pass over the whole table."""
        return np.flatnonzero((self._states != FREE) & (self._ns_col == ns.slot)).astype(np.int32)

    def entries_per_namespace(self) -> np.ndarray:
        """Live entries per namespace slot: a pass over the table (stats are asked for seldom; a
        count kept per store and eviction would cost every job a bincount)."""
        return np.bincount(self._ns_col[self._states != FREE], minlength=NS_SLOTS)

    def namespace_stats(self) -> list[dict]:
        counts = self.entries_per_namespace()
        return [{"slot": ns.slot, "name": ns.id.name(), "entries": int(counts[ns.slot]),
                 "entry_pages": ns.entry_pages} for ns in self.namespaces.values()]

    # ------------------------------------------------------------------ lookup and access
    def lookup(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """The slots of the leading keys that are READY, counted as looked up. The caller accesses
        them (they are about to be used), or leases them (``lease``)."""
        hits = self.ready_prefix(ns, keys)
        self.counters["lookup_hit_keys"] += len(hits)
        self.counters["lookup_miss_keys"] += len(keys) - len(hits)
        return hits

    def ready_prefix(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """The slots of the leading keys that are in the namespace and READY."""
        return _slots(self.keys.prefix(ns.slot, keys, READY))

    def find(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """Each key's slot in the namespace (WRITING or READY), -1 where there is none."""
        return _slots(self.keys.find(ns.slot, keys))

    def states(self, slots: np.ndarray) -> np.ndarray:
        return self._states[slots]

    def access(self, slots: np.ndarray) -> None:
        """The entries were just used: the policy hears it, and they get a new tick."""
        if len(slots):
            self.policy.accessed(slots)
            self.stamp(slots)

    def stamp(self, slots: np.ndarray) -> None:
        """A new access tick for these entries in the table (recovery rebuilds the policy's order from it)."""
        self.tick += 1
        self._ticks[slots] = self.tick

    def pin(self, slots: np.ndarray, access: bool = True) -> None:
        """A load (or a demote to the second tier) holds the (distinct, READY) entries: those held
        by nothing else leave the policy; all get a new tick, unless the pin is no access (a
        demote reads them for the daemon itself)."""
        self.pinned_entries += self._hold(self._pins, self._leases, slots)
        if len(slots) and access:   # pinned: out of the policy until released; only the tick moves
            self.stamp(slots)

    def unpin(self, slots: np.ndarray) -> None:
        self.pinned_entries -= self._let_go(self._pins, self._leases, slots)

    def lease(self, slots: np.ndarray) -> None:
        """A lease holds the (distinct, READY) entries: those held by nothing else leave the
        policy, as a pin's do; all get a new tick (just looked up: they are not accessed in the
        policy first, since they leave it)."""
        self.leased_entries += self._hold(self._leases, self._pins, slots)
        if len(slots):
            self.stamp(slots)

    def unlease(self, slots: np.ndarray) -> None:
        self.leased_entries -= self._let_go(self._leases, self._pins, slots)

    def _hold(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One more hold of one kind (``mine``, beside the ``other`` kind) on each slot: those
        held by nothing before leave the policy. Returns how many had no hold of this kind."""
        fresh, leaving = hold(mine, other, slots, 1)
        self.policy.pinned(_slots(leaving))
        return fresh

    def _let_go(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One hold of this kind less on each slot: those held by nothing now re-enter the policy.
        Returns how many have no hold of this kind left."""
        gone, back = hold(mine, other, slots, -1)
        self.policy.unpinned(_slots(back))
        return gone

    def holds(self, slot: int) -> tuple[int, int]:
        """(load pins, leases) holding the entry of ``slot``."""
        return int(self._pins[slot]), int(self._leases[slot])

    # ------------------------------------------------------------------ store decisions
    def decide_store(self, ns: Namespace, keys: list[bytes]) -> tuple[bytes, np.ndarray]:
        """A store job's decision (``place``), counted. Returns (outcome bytes, new slots)."""
        outcomes, slots, present = self.place(ns, keys)
        self.counters["store_written_keys"] += len(slots)
        self.counters["store_present_keys"] += present
        self.counters["store_no_space_keys"] += len(keys) - len(slots) - present
        return outcomes, slots

    def place(self, ns: Namespace, keys: list[bytes]) -> tuple[bytes, np.ndarray, int]:
        """Per key: PRESENT (READY, or WRITING by another job: accessed and never evicted for this
        job), WRITE (a new WRITING entry with pages), or NO_SPACE — after the first key that does
        not fit, every later new key. Returns (one StoreOutcome byte per key, the new slots in key
        order, how many were present). A store job's decision, and a promote's from the second
        tier."""
        found = self.find(ns, keys)              # keys of a job are distinct (protocol)
        absent = found < 0
        present = found[~absent]
        self.access(present[self._states[present] == READY])
        new = np.flatnonzero(absent)
        fit = self._make_room(len(new), ns.entry_pages, present)
        if fit == len(keys):                     # the usual store: every key new, all fit
            return bytes(fit), self._new_entries(ns, keys), 0
        outcomes = np.full(len(keys), PRESENT, dtype=np.uint8)
        outcomes[new[fit:]] = NO_SPACE
        outcomes[new[:fit]] = WRITE
        written = keys[:fit] if len(new) == len(keys) else [keys[i] for i in new[:fit].tolist()]
        return outcomes.tobytes(), self._new_entries(ns, written), len(present)

    def _make_room(self, count: int, entry_pages: int, exclude: np.ndarray) -> int:
        """Evict the policy's victims (never those in ``exclude``: the job's present keys) until
        ``count`` entries of ``entry_pages`` fit, or nothing evictable is left. Returns how many
        fit: the job writes that prefix of its new keys and the rest get NO_SPACE."""
        need = count * entry_pages - self.pages.free_count
        if need > 0:
            self._evict(_slots(self.policy.victims(need, exclude, self._page_counts)))
        return min(count, self.pages.free_count // entry_pages)

    def _new_entries(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """WRITING entries for ``keys``, with pages (there is room: ``_make_room``) and records."""
        n = len(keys)
        if n == 0:
            return NO_SLOTS
        pages = self.pages.alloc(n * ns.entry_pages).view(PAGES_DTYPE).reshape(n, -1)
        slots = self.slots.alloc(n)
        # The records are built in a fresh array and written with one scatter; the key table writes
        # each key into its record as it indexes it. A torn write is harmless: recovery discards
        # WRITING records.
        rec = np.repeat(ns.record, n)
        rec["first_page"] = pages[:, 0]
        rec["tick"] = self.tick
        self._records[slots] = rec.view(np.uint8).reshape(n, -1)
        self.view.write_chain(pages)
        self.keys.insert(ns.slot, keys, slots)
        self.entry_count[WRITING] += n
        return slots

    def make_ready(self, slots: np.ndarray, shard_sums: list[list[int]] | None = None, chain: bool = True,
                   cold: int = 0) -> None:
        """Every rank voted: the WRITING entries (of one namespace: a job's) become READY and
        evictable, in order. ``shard_sums`` holds each writer's checksums of its shard of every
        entry, in rank order. ``chain`` and ``cold`` tell the policy what the store request said:
        its keys are a prefix chain; its last ``cold`` entries are expected not to be reused."""
        self.tick += 1
        n = len(slots)
        if n == 0:
            return
        self._ticks[slots] = self.tick
        self.view.entries["checksum"][slots] = [entry_checksum([sums[i] for sums in shard_sums])
                                                for i in range(n)] if shard_sums else 0
        ns = self.ns_by_slot[int(self._ns_col[slots[0]])]
        chains = np.frombuffer(self.keys.pages(self.view.chain, slots), PAGES_DTYPE).reshape(n, ns.entry_pages)
        self._sums[slots] = record_sums(self.view, slots, chains, None, ns.identity)
        self._states[slots] = READY    # last: the records are complete before they say READY
        self.policy.inserted(slots, np.frombuffer(self.keys.fingerprints(slots), np.uint64), chain, cold)
        self.entry_count[WRITING] -= n
        self.entry_count[READY] += n

    def abandon(self, slots: np.ndarray) -> None:
        """Forget the WRITING entries of an aborted job. Their pages stay taken: the job machine
        fences those a writer may still copy into and frees the others (``release_pages``)."""
        self._free_entries(slots)

    def release_pages(self, pages: np.ndarray) -> None:
        self.pages.free(pages)

    # ------------------------------------------------------------------ pages of entries
    def pages_of(self, ns: Namespace, slots: np.ndarray, rank: int | None = None) -> bytes:
        """The pages ``rank`` copies of each entry (``Namespace.shard``), in order, as
        PAGES_DTYPE bytes: what a store or load reply carries. One compiled pass."""
        lo, hi = ns.shard(rank)
        return self.keys.pages(self.view.chain, slots, ns.entry_pages, lo, hi)

    def shard_pages(self, ns: Namespace, slots: np.ndarray) -> np.ndarray:
        """The entries' pages as [entry, shard, page of the shard] (one shard when replicated)."""
        return np.frombuffer(self.pages_of(ns, slots), PAGES_DTYPE).reshape(len(slots), ns.shards, ns.pages_per_shard)

    def keys_of(self, slots: np.ndarray) -> list[bytes]:
        """The entries' keys, a bytes object each (a demote to the second tier names them)."""
        return keys_of(self.view, slots)

    # ------------------------------------------------------------------ eviction and freeing
    def evict(self, namespace: str | None, count: int | None) -> int:
        """Operator eviction: up to ``count`` (None: all) of the policy's victims in the namespace
        named ``namespace`` (None: any). Pinned, leased and WRITING entries stay."""
        chosen = None
        if namespace is not None:
            chosen = next((ns for ns in self.namespaces.values() if ns.id.name() == namespace), None)
            if chosen is None:
                raise RequestError(ErrorCode.BAD_REQUEST, f"no namespace {namespace!r}; kvtierctl namespaces lists them")
        victims = _slots(self.policy.victims(-1))
        if chosen is not None:
            victims = victims[self._ns_col[victims] == chosen.slot]
        victims = victims if count is None else victims[:count]
        self._evict(victims, "operator_evictions")
        if len(victims):
            log.info("operator evicted %d entries (namespace %s)", len(victims), namespace or "any")
        return len(victims)

    def evict_entries(self, slots: np.ndarray) -> None:
        """Free READY, unpinned entries taken from the policy's victims ahead of need (the second
        tier holds them): counted as evictions for room."""
        self._evict(slots)

    def ticks_of(self, slots: np.ndarray) -> np.ndarray:
        """The entries' last-access ticks (a later access gives an entry a new one)."""
        return self._ticks[slots].copy()

    def _evict(self, slots: np.ndarray, counter: str = "evictions") -> None:
        if not len(slots):
            return
        if self.evicting is not None:
            self.evicting(slots, counter)
        pages = np.frombuffer(self.keys.pages(self.view.chain, slots), PAGES_DTYPE)
        self._free_entries(slots)
        self.pages.free(pages)
        self.counters[counter] += len(slots)

    def _free_entries(self, slots: np.ndarray) -> None:
        """Forget entries: out of the table first (state FREE), the key table and the policy."""
        if not len(slots):
            return
        ready = int(np.count_nonzero(self._states[slots] == READY))
        self._states[slots] = FREE
        self._sums[slots] = 0       # a stale record whose state byte came back to READY is no entry
        self.keys.remove(slots)
        self.entry_count[READY] -= ready
        self.entry_count[WRITING] -= len(slots) - ready
        self.policy.removed(slots)
        self.slots.free(slots)

    # ------------------------------------------------------------------ stats and checks
    def stats(self) -> dict:
        pages, page_size = self.pages, self.page_size
        return {
            "capacity_bytes": self.geometry.capacity_bytes,
            "page_size": page_size,
            "pages_total": pages.total,
            "pages_free": pages.free_count,
            "pages_used": pages.used_count,
            "used_bytes": pages.used_count * page_size,
            "entries_ready": self.entry_count[READY],
            "entries_writing": self.entry_count[WRITING],
            "entries_pinned": self.pinned_entries,
            "entries_leased": self.leased_entries,
            "evictable": len(self.policy),
            "namespaces": len(self.namespaces),
            **self.policy_stats(),
        }

    def policy_stats(self) -> dict:
        """The policy's counters under their ``StatsReply`` names."""
        s = self.policy.stats()
        return {"policy": self.policy.name, "policy_admitted_keys": s["admitted"], "policy_refused_keys": s["refused"],
                "policy_segments": s["segments"], "policy_evictions": s["evicted"], "policy_extra": s["extra"]}

    def verify(self) -> None:
        """Check the index against itself and the entry table (tests): every page is exactly one
        of free, held by one live entry, or parked by the fence; every slot is free or holds one
        entry, indexed by its key; the policy holds exactly the READY unheld entries; the counts
        match. (The lease counts are ``Leases.verify``'s.)"""
        states = self._states
        live = np.flatnonzero(states != FREE).astype(np.int32)
        free_slots = self.slots.free_ids()
        assert len(np.unique(free_slots)) == len(free_slots), "an entry slot is free twice"
        assert (states[free_slots] == FREE).all(), "a free slot holds an entry"
        assert len(free_slots) + len(live) == self.geometry.entry_slots, "entry slots leaked"
        assert set(np.unique(states).tolist()) <= {FREE, WRITING, READY}, "an entry in an unknown state"
        self.keys.verify()
        assert len(self.keys) == len(live), "the key table does not index exactly the live entries"
        self.policy.verify()
        owner = np.full(self.geometry.num_pages, -1, dtype=np.int64)
        free = self.pages.free_ids()
        assert len(np.unique(free)) == len(free), "a page is free twice"
        owner[free] = -2
        parked = self.fence.parked_pages()
        assert len(np.unique(parked)) == len(parked), "a page is parked twice"
        assert (owner[parked] == -1).all(), "a fenced page is also free"
        owner[parked] = -3
        counts = self._page_counts[live].astype(np.int64)
        pages = np.frombuffer(self.keys.pages(self.view.chain, live), PAGES_DTYPE).astype(np.int64)
        assert (owner[pages] == -1).all() and len(np.unique(pages)) == len(pages), "an entry shares a page"
        owner[pages] = np.repeat(live, counts)
        assert (owner != -1).all(), f"{int((owner == -1).sum())} pages leaked"
        ready = live[states[live] == READY]
        for ns in self.namespaces.values():
            mine, done = live[self._ns_col[live] == ns.slot], ready[self._ns_col[ready] == ns.slot]
            assert (self._page_counts[mine] == ns.entry_pages).all(), f"namespace {ns.slot}: an entry's page count"
            assert (self.find(ns, self.keys_of(mine)) == mine).all(), f"namespace {ns.slot}: an entry not found"
            chains = np.frombuffer(self.keys.pages(self.view.chain, done), PAGES_DTYPE).reshape(len(done), ns.entry_pages)
            assert (record_sums(self.view, done, chains, None, ns.identity) == self._sums[done]).all(), \
                f"namespace {ns.slot}: a READY record's sum is stale"
        assert set(np.unique(self._ns_col[live]).tolist()) <= set(self.ns_by_slot), "an entry of no namespace"
        held = (self._pins[ready] > 0) | (self._leases[ready] > 0)
        in_policy = np.fromiter((slot in self.policy for slot in live.tolist()), bool, len(live))
        assert (in_policy == np.isin(live, ready[~held])).all(), "the policy holds other than the READY unheld"
        assert len(self.policy) == int((~held).sum())
        writing = live[states[live] == WRITING]
        assert not self._pins[writing].any() and not self._leases[writing].any(), "a WRITING entry is held"
        assert not self._pins[free_slots].any() and not self._leases[free_slots].any(), "a free slot is held"
        assert self.entry_count == {WRITING: len(writing), READY: len(ready)}
        assert self.pinned_entries == int(np.count_nonzero(self._pins))
        assert self.leased_entries == int(np.count_nonzero(self._leases))

    def persist_tick(self) -> None:
        """Write the access clock to the header (a clean stop)."""
        self.view.header["tick"] = self.tick

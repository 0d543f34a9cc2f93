"""The entry index: namespaces, the (namespace, key) → entry map, pages and entry slots, eviction,
the access clock, and recovery from the region's tables. No sockets, no threads, no jobs.

An entry is one cached block of one namespace. It is WRITING from the moment a store job is
given its pages until every rank of the job has voted (``make_ready``), then READY: visible to
lookup and load, and evictable unless a load pins it or a lease holds it (``kvtierd.leases``).
Its record in the region's entry table mirrors it; READY is the last byte written there, FREE
the first (invariant 1: a restarted daemon never takes a half-written record for a ready one).

Eviction: the policy (``kvtierd.policy``) holds exactly the READY entries that no load pins and
no lease holds, and chooses among them, across all namespaces; the index frees what it chooses
(invariants 2 and 10: WRITING, pinned and leased entries are never in the policy, so they are
never chosen). Pins and leases are two counts per entry slot (NumPy arrays, so that a job's or a
lease's thousands of entries are held in a few passes); an entry leaves the policy's set when the
first hold of either kind comes and re-enters it when the last one goes (``pinned``/``unpinned``).

A page is free, held by an entry, or fenced (``kvtierd.fence``): held by no entry, but kept from
everyone until the writer that was handed it is proven unable to write. Recovery asks the fence
which pages those are; the job machine gives the pages it releases back (``release_pages``).

Per-key work is done in C-level passes (map over attribute getters, NumPy fancy indexing of the
entry table) rather than Python loops: a job carries up to thousands of keys, and the daemon's
cost per key is what bounds lookup latency and keys/s (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, deque
from itertools import repeat
from operator import attrgetter
from typing import Any, Callable

import numpy as np

from .contract.namespace import NamespaceId
from .contract.protocol import PAGES_DTYPE, ErrorCode, RequestError, StoreOutcome
from .contract.region_format import (ENTRY_DTYPE, NS_CHECKSUMS, TICK_LIMIT, EntryState, RegionView, entry_checksum,
                                     entry_record_sums, namespace_identities, namespace_record)
from .fence import Fence
from .pages import FreeStack
from .policy import Policy
from .recovery import scan

log = logging.getLogger(__name__)

_SLOT = attrgetter("slot")
_KEY = attrgetter("key")
_STATE = attrgetter("state")
_PAGES = attrgetter("pages")


def _slots(entries: list) -> np.ndarray:
    return np.fromiter(map(_SLOT, entries), np.intp, len(entries))


class _Absent:
    """Stands in for a key the index does not hold, so that a state can be read for every key."""
    state = EntryState.FREE


_ABSENT = _Absent()
_READY = bytes([EntryState.READY])

# Monotonic counters the index keeps (Store.stats reports them with the job machine's).
COUNTERS = ("lookup_hit_keys", "lookup_miss_keys", "store_written_keys", "store_present_keys",
            "store_no_space_keys", "evictions", "operator_evictions")


class Entry:
    __slots__ = ("slot", "ns", "key", "state", "pages", "job", "in_tier")

    def __init__(self, slot: int, ns: "Namespace", key: bytes, state: EntryState, pages: bytes, job=None):
        self.slot = slot
        self.ns = ns
        self.key = key
        self.state = state
        self.pages = pages      # the whole chain, PAGES_DTYPE bytes (sent to clients as slices)
        self.job = job          # the store (or promote) job writing it (WRITING only)
        self.in_tier = False    # the second tier holds it (demoted or promoted; not kept across restarts)


class Namespace:
    """One namespace's entries, and what every entry of it has in common."""

    __slots__ = ("slot", "id", "index", "shards", "pages_per_shard", "entry_pages", "shard_bytes", "record",
                 "users", "identity")

    def __init__(self, slot: int, ns_id: NamespaceId, page_size: int, identity: int):
        self.slot = slot                  # in the region's namespace table
        self.id = ns_id
        self.identity = identity          # namespace_identities of its record: every entry's record_sum covers it
        self.index: dict[bytes, Entry] = {}
        self.shards = ns_id.shards
        self.pages_per_shard = ns_id.pages_per_shard(page_size)
        self.entry_pages = ns_id.entry_pages(page_size)
        self.shard_bytes = self.pages_per_shard * 4   # bytes of one shard's page list
        self.users = 0                    # attached engines of this namespace
        # What every new entry record of this namespace starts from.
        self.record = np.zeros(1, ENTRY_DTYPE)
        self.record[["state", "ns", "page_count", "length"]] = (EntryState.WRITING, slot, self.entry_pages,
                                                                 ns_id.entry_bytes)

    def pages_for(self, entries: list[Entry], rank: int) -> list[bytes]:
        """The pages ``rank`` copies of each entry, in order: the whole chain of a replicated
        entry (its one copy: rank 0 writes it, every rank loads it), run ``rank`` of a sharded one.

        One call for a job's entries: per entry it would be a Python frame per key."""
        if self.shards == 1:
            return list(map(_PAGES, entries))
        lo, hi = rank * self.shard_bytes, (rank + 1) * self.shard_bytes
        return [e.pages[lo:hi] for e in entries]

    def shard_pages(self, entries: list[Entry]) -> np.ndarray:
        """The entries' pages as [entry, shard, page of the shard] (one shard when replicated)."""
        return np.frombuffer(b"".join(map(_PAGES, entries)), PAGES_DTYPE).reshape(
            len(entries), self.shards, self.pages_per_shard)


class Index:
    def __init__(self, view: RegionView, policy: Policy, fence: Fence, verify_checksums: bool = False):
        self.view = view
        self.fence = fence
        self.geometry = view.geometry
        self.page_size = view.geometry.page_size
        self.policy = policy
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self.ns_by_slot: dict[int, Namespace] = {}
        self.by_slot: list[Entry | None] = [None] * self.geometry.entry_slots
        self.entry_count = {EntryState.WRITING: 0, EntryState.READY: 0}
        # What holds each slot's entry out of the policy: load jobs (pins) and leases, counted per
        # slot so that a job's or a lease's thousands of entries are held in a few NumPy passes.
        self._pins = np.zeros(self.geometry.entry_slots, np.uint32)
        self._leases = np.zeros(self.geometry.entry_slots, np.uint32)
        self.pinned_entries = 0
        self.leased_entries = 0
        self.checksums = verify_checksums         # entries carry data checksums (their namespaces' flag)
        self.tick = 0                             # the access clock (recovery orders by it)
        self.counters: Counter = Counter()
        # Told of every eviction, before the entries are freed: (entries, counter name). The second
        # tier counts the blocks a store's room took that it could not demote (kvtierd.tiering).
        self.evicting: Callable[[list[Entry], str], None] | None = None
        self._states = view.entries["state"]      # columns of the entry table, for vectorised writes
        self._ticks = view.entries["tick"]
        self._sums = view.entries["record_sum"]
        # The entry table as rows of bytes: NumPy scatters whole structured records ~100x slower
        # than the same bytes as uint8 rows.
        self._records = view.entries.view(np.uint8).reshape(len(view.entries), ENTRY_DTYPE.itemsize)
        # Recovery allocates an object or two per entry, millions of them: the cyclic collector's
        # passes over the growing heap cost 40% of it (and find nothing to collect) if left on.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.recovered = self._recover(verify_checksums)
        finally:
            if collecting:
                gc.enable()

    # ------------------------------------------------------------------ recovery
    def _recover(self, verify_checksums: bool) -> dict[str, int]:
        """Rebuild the index, the policy's order and the free pages and slots from the tables.

        READY entries whose namespace record and page chain are sound (``recovery.scan``) are
        kept, oldest tick first in the policy; WRITING entries (a copy or vote that never
        finished) are discarded, as are entries whose chain is broken or shares a page with an
        earlier entry, and damaged records. The pages of discarded entries are free unless the
        fence holds them for a writer that may still copy into them (``Fence.recover``). Nothing
        in the tables can make recovery raise.
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
            ns = Namespace(slot, ns_id, self.page_size, int(namespace_identities(view.namespaces[slot:slot + 1])[0]))
            self.namespaces[ns_id] = ns
            self.ns_by_slot[slot] = ns
            if int(view.namespaces[slot]["flags"]) & NS_CHECKSUMS != flag:
                view.namespaces[slot] = namespace_record(ns_id, flag)   # the setting changed: it follows
        states = self._states
        for slot, why in found.problems:
            log.warning("entry %d discarded: %s", slot, why)
            states[slot] = EntryState.FREE
        states[found.writing] = EntryState.FREE
        self._sums[states != EntryState.READY] = 0
        # A region holds millions of entries: the objects are built with C-level loops (map, zip).
        slots = found.ready_slots.tolist()
        kept = list(map(Entry, slots, map(self.ns_by_slot.__getitem__, found.ready_ns.tolist()), found.ready_keys,
                        repeat(EntryState.READY), found.ready_pages))
        if len(self.namespaces) == 1:
            next(iter(self.namespaces.values())).index.update(zip(found.ready_keys, kept))
        else:
            for key, entry in zip(found.ready_keys, kept):
                entry.ns.index[key] = entry
        deque(map(self.by_slot.__setitem__, slots, kept), 0)
        self.policy.recovered(slots, found.ready_keys)
        self.entry_count[EntryState.READY] = len(kept)
        fenced = self.fence.recover(found)
        self.pages = FreeStack(self.geometry.num_pages, np.concatenate([np.flatnonzero(found.owner >= 0), fenced]))
        self.slots = FreeStack(self.geometry.entry_slots, np.flatnonzero(states != EntryState.FREE))
        # The clock goes on from the newest tick kept (scan refused any at or past TICK_LIMIT).
        header_tick = int(view.header["tick"])
        self.tick = max(header_tick if header_tick < TICK_LIMIT else 0,
                        int(self._ticks[slots].max()) if slots else 0)
        return {"ready": len(kept), "writing_discarded": len(found.writing),
                "corrupt_discarded": len(found.problems), "pages_fenced": len(fenced)}

    # ------------------------------------------------------------------ namespaces
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
        ns = Namespace(slot, ns_id, self.page_size, int(namespace_identities(table[slot:slot + 1])[0]))
        self.namespaces[ns_id] = ns
        self.ns_by_slot[slot] = ns
        log.info("namespace %d: %s", slot, ns_id.name())
        return ns

    def _reclaim_namespace(self) -> int:
        """Free the table slot of the unused namespace used least recently (evicting its entries)."""
        unused = [n for n in self.namespaces.values() if not n.users]
        if not unused:
            raise RequestError(ErrorCode.NO_SPACE, f"all {len(self.view.namespaces)} namespace slots are held by "
                                                   "attached engines")

        def last_used(ns: Namespace) -> int:
            return int(self._ticks[list(map(_SLOT, ns.index.values()))].max()) if ns.index else -1
        victim = min(unused, key=last_used)
        entries = list(victim.index.values())   # no engine uses it: no job holds them, none pinned
        self._evict(entries)
        del self.namespaces[victim.id]
        del self.ns_by_slot[victim.slot]
        self.view.namespaces[victim.slot]["in_use"] = 0
        log.warning("namespace table full: namespace %d (%s) taken over, %d of its entries evicted", victim.slot,
                    victim.id.name(), len(entries))
        return victim.slot

    def namespace_stats(self) -> list[dict]:
        return [{"slot": ns.slot, "name": ns.id.name(), "entries": len(ns.index),
                 "entry_pages": ns.entry_pages} for ns in self.namespaces.values()]

    # ------------------------------------------------------------------ lookup and access
    def lookup(self, ns: Namespace, keys: list[bytes]) -> list[Entry]:
        """The entries of the leading keys that are READY, counted as looked up. The caller
        accesses them (they are about to be used), or leases them (``lease``)."""
        hits = self.ready_prefix(ns, keys)
        self.counters["lookup_hit_keys"] += len(hits)
        self.counters["lookup_miss_keys"] += len(keys) - len(hits)
        return hits

    @staticmethod
    def ready_prefix(ns: Namespace, keys: list[bytes]) -> list[Entry]:
        """The entries of the leading keys that are in the namespace and READY."""
        entries = list(map(ns.index.get, keys, repeat(_ABSENT)))
        states = bytes(map(_STATE, entries))               # one byte per key
        hits = len(states) - len(states.lstrip(_READY))
        return entries if hits == len(entries) else entries[:hits]

    def access(self, entries: list[Entry]) -> None:
        """The entries were just used: the policy hears it, and they get a new tick."""
        if entries:
            slots = list(map(_SLOT, entries))
            self.policy.accessed(slots)
            self.stamp(slots)

    def stamp(self, slots: list[int] | np.ndarray) -> None:
        """A new access tick for these entries in the table (recovery rebuilds the policy's order from it)."""
        self.tick += 1
        self._ticks[slots if isinstance(slots, np.ndarray) else np.fromiter(slots, np.intp, len(slots))] = self.tick

    def pin(self, entries: list[Entry], access: bool = True) -> None:
        """A load (or a demote to the second tier) holds the (distinct) entries: those held by
        nothing else leave the policy; all get a new tick, unless the pin is no access (a demote
        reads them for the daemon itself)."""
        slots = _slots(entries)
        self.pinned_entries += self._hold(self._pins, self._leases, slots)
        if len(slots) and access:   # pinned: out of the policy until released; only the tick moves
            self.stamp(slots)

    def unpin(self, entries: list[Entry]) -> None:
        self.pinned_entries -= self._let_go(self._pins, self._leases, _slots(entries))

    def lease(self, entries: list[Entry]) -> None:
        """A lease holds the (distinct, READY) entries: those held by nothing else leave the
        policy, as a pin's do; all get a new tick (just looked up: they are not accessed in the
        policy first, since they leave it)."""
        slots = _slots(entries)
        self.leased_entries += self._hold(self._leases, self._pins, slots)
        if len(slots):
            self.stamp(slots)

    def unlease(self, entries: list[Entry]) -> None:
        self.leased_entries -= self._let_go(self._leases, self._pins, _slots(entries))

    def _hold(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One more hold of one kind (``mine``, beside the ``other`` kind) on each slot: those
        held by nothing before leave the policy. Returns how many had no hold of this kind."""
        before = mine[slots]
        mine[slots] = before + 1
        fresh = slots[before == 0]
        self.policy.pinned(fresh[other[fresh] == 0].tolist())
        return len(fresh)

    def _let_go(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One hold of this kind less on each slot: those held by nothing now re-enter the policy.
        Returns how many have no hold of this kind left."""
        after = mine[slots] - 1
        mine[slots] = after
        gone = slots[after == 0]
        self.policy.unpinned(gone[other[gone] == 0].tolist())
        return len(gone)

    def holds(self, slot: int) -> tuple[int, int]:
        """(load pins, leases) holding the entry of ``slot``."""
        return int(self._pins[slot]), int(self._leases[slot])

    # ------------------------------------------------------------------ store decisions
    def decide_store(self, ns: Namespace, keys: list[bytes], job: Any) -> tuple[list[StoreOutcome], list[Entry]]:
        """A store job's decision (``place``), counted. Returns (outcomes, new entries)."""
        outcomes, entries, present = self.place(ns, keys, job)
        self.counters["store_written_keys"] += len(entries)
        self.counters["store_present_keys"] += present
        self.counters["store_no_space_keys"] += len(keys) - len(entries) - present
        return outcomes, entries

    def place(self, ns: Namespace, keys: list[bytes], job: Any) -> tuple[list[StoreOutcome], list[Entry], int]:
        """Per key: PRESENT (READY, or WRITING by another job: accessed and never evicted for this
        job), WRITE (a new WRITING entry with pages, written by ``job``), or NO_SPACE — after the
        first key that does not fit, every later new key. Returns (outcomes, new entries, how many
        were present). A store job's decision, and a promote's from the second tier."""
        found = list(map(ns.index.get, keys))    # keys of a job are distinct (protocol)
        present = [e for e in found if e is not None]
        self.access([e for e in present if e.state is EntryState.READY])
        new_keys = [k for k, e in zip(keys, found) if e is None]
        fit = self._make_room(len(new_keys), ns.entry_pages, set(map(_SLOT, present)))
        entries = self._new_entries(ns, new_keys[:fit], job)
        decided = iter([StoreOutcome.WRITE] * fit + [StoreOutcome.NO_SPACE] * (len(new_keys) - fit))
        outcomes = [StoreOutcome.PRESENT if e is not None else next(decided) for e in found]
        return outcomes, entries, len(present)

    def _make_room(self, count: int, entry_pages: int, exclude: set[int]) -> int:
        """Evict the policy's victims (never those in ``exclude``: the job's present keys) until
        ``count`` entries of ``entry_pages`` fit, or nothing evictable is left. Returns how many
        fit: the job writes that prefix of its new keys and the rest get NO_SPACE."""
        need = count * entry_pages - self.pages.free_count
        if need > 0:
            victims = []
            for slot in self.policy.victims(exclude):
                victims.append(self.by_slot[slot])
                need -= victims[-1].ns.entry_pages
                if need <= 0:
                    break
            self._evict(victims)
        return min(count, self.pages.free_count // entry_pages)

    def _new_entries(self, ns: Namespace, keys: list[bytes], job: Any) -> list[Entry]:
        """WRITING entries for ``keys``, with pages (there is room: ``_make_room``) and records."""
        n = len(keys)
        if n == 0:
            return []
        pages = np.asarray(self.pages.alloc(n * ns.entry_pages), dtype=PAGES_DTYPE).reshape(n, -1)
        slots = self.slots.alloc(n)
        # The records are built in a fresh array and written with one scatter. A torn write is
        # harmless: recovery discards WRITING records.
        rec = np.repeat(ns.record, n)
        rec["first_page"] = pages[:, 0]
        rec["tick"] = self.tick
        lengths = list(map(len, keys))
        rec["key_len"] = lengths
        if len(set(lengths)) == 1:
            rec["key"][:, :lengths[0]] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, -1)
        else:
            for i, key in enumerate(keys):      # keys of mixed lengths (unusual): row by row
                rec["key"][i, :len(key)] = np.frombuffer(key, np.uint8)
        self._records[np.asarray(slots)] = rec.view(np.uint8).reshape(n, -1)
        self.view.write_chain(pages)
        entries = list(map(Entry, slots, repeat(ns), keys, repeat(EntryState.WRITING),
                           pages.view(f"V{pages.shape[1] * 4}").ravel().tolist(), repeat(job)))
        ns.index.update(zip(keys, entries))
        deque(map(self.by_slot.__setitem__, slots, entries), 0)
        self.entry_count[EntryState.WRITING] += n
        return entries

    def make_ready(self, entries: list[Entry], shard_sums: list[list[int]] | None = None, chain: bool = True,
                   cold: int = 0) -> None:
        """Every rank voted: the WRITING entries become READY (and evictable), in order.
        ``shard_sums`` holds each writer's checksums of its shard of every entry, in rank order.
        ``chain`` and ``cold`` tell the policy what the store request said: its keys are a prefix
        chain; its last ``cold`` entries are expected not to be reused."""
        self.tick += 1
        slots = list(map(_SLOT, entries))
        for entry in entries:
            entry.state = EntryState.READY
            entry.job = None
        self._ticks[slots] = self.tick
        self.view.entries["checksum"][slots] = [entry_checksum([sums[i] for sums in shard_sums])
                                                for i in range(len(entries))] if shard_sums else 0
        if entries:          # the record is complete: its sum (a job's entries share a namespace)
            ns = entries[0].ns
            chains = np.frombuffer(b"".join(map(_PAGES, entries)), PAGES_DTYPE).reshape(len(entries), ns.entry_pages)
            self._sums[slots] = entry_record_sums(self._records[slots], chains, None, ns.identity)
        self._states[slots] = EntryState.READY    # last: the records are complete before they say READY
        self.policy.inserted(slots, list(map(_KEY, entries)), chain, cold)
        self.entry_count[EntryState.WRITING] -= len(entries)
        self.entry_count[EntryState.READY] += len(entries)

    def abandon(self, entries: list[Entry]) -> None:
        """Forget the WRITING entries of an aborted job. Their pages stay taken: the job machine
        fences those a writer may still copy into and frees the others (``release_pages``)."""
        self._free_entries(entries)

    def release_pages(self, pages: np.ndarray) -> None:
        self.pages.free(pages.tolist())

    # ------------------------------------------------------------------ eviction and freeing
    def evict(self, namespace: str | None, count: int | None) -> int:
        """Operator eviction: up to ``count`` (None: all) of the policy's victims in the namespace
        named ``namespace`` (None: any). Pinned, leased and WRITING entries stay."""
        if namespace is not None and not any(ns.id.name() == namespace for ns in self.namespaces.values()):
            raise RequestError(ErrorCode.BAD_REQUEST, f"no namespace {namespace!r}; kvtierctl namespaces lists them")
        victims = [self.by_slot[slot] for slot in self.policy.victims()
                   if namespace is None or self.by_slot[slot].ns.id.name() == namespace]
        victims = victims if count is None else victims[:count]
        self._evict(victims, "operator_evictions")
        if victims:
            log.info("operator evicted %d entries (namespace %s)", len(victims), namespace or "any")
        return len(victims)

    def evict_entries(self, entries: list[Entry]) -> None:
        """Free READY, unpinned entries taken from the policy's victims ahead of need (the second
        tier holds them): counted as evictions for room."""
        self._evict(entries)

    def ticks_of(self, entries: list[Entry]) -> np.ndarray:
        """The entries' last-access ticks (a later access gives an entry a new one)."""
        return self._ticks[list(map(_SLOT, entries))].copy()

    def _evict(self, entries: list[Entry], counter: str = "evictions") -> None:
        if self.evicting is not None and entries:
            self.evicting(entries, counter)
        pages = self._pages_of(entries)
        self._free_entries(entries)
        self.pages.free(pages)
        self.counters[counter] += len(entries)

    @staticmethod
    def _pages_of(entries: list[Entry]) -> list[int]:
        return np.frombuffer(b"".join(map(_PAGES, entries)), PAGES_DTYPE).tolist()

    def _free_entries(self, entries: list[Entry]) -> None:
        """Forget entries: out of the table first (state FREE), the index and the policy."""
        if not entries:
            return
        slots = list(map(_SLOT, entries))
        self._states[slots] = EntryState.FREE
        self._sums[slots] = 0       # a stale record whose state byte came back to READY is no entry
        by_slot, count = self.by_slot, self.entry_count
        for entry in entries:
            del entry.ns.index[entry.key]
            by_slot[entry.slot] = None
            count[entry.state] -= 1
            entry.state = EntryState.FREE
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
            "entries_ready": self.entry_count[EntryState.READY],
            "entries_writing": self.entry_count[EntryState.WRITING],
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
        """Check the index against itself and the entry table (tests, ``Store.verify``): every
        page is exactly one of free, held by one live entry, or parked by the fence; every slot
        is free or holds one entry; the policy holds exactly the READY unpinned entries; the
        table's records match the index. (The lease counts are ``Leases.verify``'s.)"""
        owner = np.full(self.geometry.num_pages, -1, dtype=np.int64)
        free = self.pages.free_ids()
        assert len(np.unique(free)) == len(free), "a page is free twice"
        owner[free] = -2
        parked = self.fence.parked_pages()
        assert len(np.unique(parked)) == len(parked), "a page is parked twice"
        assert (owner[parked] == -1).all(), "a fenced page is also free"
        owner[parked] = -3
        free_slots = self.slots.free_ids()
        assert len(np.unique(free_slots)) == len(free_slots), "an entry slot is free twice"
        assert all(self.by_slot[s] is None for s in free_slots.tolist()), "a free slot holds an entry"
        assert len(free_slots) + sum(map(len, (ns.index for ns in self.namespaces.values()))) == \
            self.geometry.entry_slots, "entry slots leaked"
        table = self.view.entries
        for ns in self.namespaces.values():
            for key, entry in ns.index.items():
                pages = np.frombuffer(entry.pages, PAGES_DTYPE).astype(np.int64)
                assert len(pages) == ns.entry_pages, f"entry {entry.slot} has {len(pages)} pages"
                assert (owner[pages] == -1).all(), f"entry {entry.slot} shares a page"
                owner[pages] = entry.slot
                assert self.by_slot[entry.slot] is entry
                rec = table[entry.slot]
                assert int(rec["state"]) == entry.state and bytes(rec["key"][: rec["key_len"]]) == key
                assert np.array_equal(self.view.chain_of(entry.slot), pages)
                held = self._pins[entry.slot] or self._leases[entry.slot]
                assert (entry.slot in self.policy) == (entry.state is EntryState.READY and not held), \
                    f"entry {entry.slot} policy membership"
                assert entry.state is EntryState.READY or not held, f"entry {entry.slot} held"
        assert (owner != -1).all(), f"{int((owner == -1).sum())} pages leaked"
        free = np.asarray(free_slots, np.intp)
        assert not self._pins[free].any() and not self._leases[free].any(), "a free slot is held"
        assert len(self.policy) == sum(1 for e in self.by_slot if e is not None and e.state is EntryState.READY
                                       and not self._pins[e.slot] and not self._leases[e.slot])
        assert self.pinned_entries == int(np.count_nonzero(self._pins))
        assert self.leased_entries == int(np.count_nonzero(self._leases))

    def persist_tick(self) -> None:
        """Write the access clock to the header (a clean stop)."""
        self.view.header["tick"] = self.tick

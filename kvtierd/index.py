"""The entry index: (namespace, key) → entry slot, entry states, pages and entry slots, eviction, the
access clock, and recovery from the region's tables. No sockets, no threads, no jobs, and no Python
object per entry.

An entry is one cached block of one namespace (``kvtierd.namespaces``), named by its slot in the
region's entry table; a batch of entries (a job's, an eviction's) is an int32 NumPy array of slots.
It is WRITING from the moment a write (``kvtierd.writes``: a store job, a promote) is given its
pages until the write completes (``make_ready``), then READY: visible to lookup and load, and
evictable unless a hold keeps it (``kvtierd.holds``: a load's or a demote's pin, a lease). Its record
in the region's entry table mirrors it; READY is the last byte written there, FREE the first
(invariant 1).

Where an entry's state lives, all of it in arrays indexed by slot:

- the region's entry table (``region_format``): state, namespace, key, page chain, tick and sums.
  It is the source of truth: a restart rebuilds everything below from it in a few passes
  (``recovery.scan``, then ``KeyTable.rebuild`` and the policy's ``recovered``);
- the key table (``kvtierd.keytable``, compiled): (namespace, key) → slot, and each key's
  fingerprint. It keeps no copy of the keys: it compares the key in the record a bucket names, so
  it can never return another key's entry whatever the hashes do;
- the holds (``kvtierd.holds``): load pins and leases, two counts per slot;
- the eviction policy's lists (``kvtierd.policy``, compiled).

Page ownership (invariant 12). A page is free, held by an entry, or fenced (``kvtierd.fence``).
Everything that frees entries — eviction for room, the tier's frees ahead of need, operator
evictions, a namespace's takeover, the region's replacement, a write's abort — goes through
``_free``, which refuses an entry a writer may still write (WRITING: only its write frees it) or a
reader may still read (held); a takeover only takes a namespace nothing of which is held or written.
Fenced pages come back only through the writes (``release_pages``).

Eviction: the policy holds exactly the READY entries nothing holds and chooses among them, across
all namespaces (``victims``); the index frees what it chooses (invariants 2 and 10). The index tells
its ``Events`` (``kvtierd.events``) what becomes of entries.

Every operation takes a whole request's keys or slots and is a handful of compiled or NumPy passes:
a job carries up to thousands of keys, and the daemon's cost per key is what bounds lookup latency
and keys/s; and nothing per entry is left for the garbage collector to walk (docs/benchmarks.md:
a full region of a million entries under eviction, and a restart with them).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from .contract.codes import ErrorCode, RequestError, StoreOutcome
from .contract.namespace import NamespaceId
from .contract.protocol import PAGES_DTYPE
from .contract.region_format import NS_SLOTS, TICK_LIMIT, EntryState
from .contract.region_sums import entry_checksum
from .contract.region_view import RegionView
from .events import EntryEvents, Events, Gone
from .fence import Fence
from .holds import Holder, Holds
from .keytable import ALL_BITS, key_table
from .namespaces import Namespace, Namespaces
from .pages import FreeIds
from .records import count_state, fill, keys_of, new_records, record_sums, seal_records
from .recovery import scan

log = logging.getLogger(__name__)

NO_SLOTS = np.zeros(0, dtype=np.int32)
# Plain ints: NumPy compares and stores an IntEnum member 2-3x slower than an int (per call).
READY, WRITING, FREE = int(EntryState.READY), int(EntryState.WRITING), int(EntryState.FREE)
WRITE, PRESENT, NO_SPACE = int(StoreOutcome.WRITE), int(StoreOutcome.PRESENT), int(StoreOutcome.NO_SPACE)

# Monotonic counters the index keeps (Store.stats reports them with the job machine's).
COUNTERS = ("lookup_hit_keys", "lookup_miss_keys", "evictions", "operator_evictions")
# The counter each way of leaving counts in (an aborted write's entries were never READY: none).
_COUNTED = {Gone.EVICTED: "evictions", Gone.AHEAD: "evictions", Gone.RECLAIMED: "evictions",
            Gone.CLEARED: "operator_evictions", Gone.REGION_REPLACED: "operator_evictions"}


def _slots(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, np.int32)


class Index:
    def __init__(self, view: RegionView, holds: Holds, fence: Fence, verify_checksums: bool = False,
                 events: EntryEvents | None = None, hash_mask: int = ALL_BITS):
        """``holds``: the entries' holds, over the eviction policy (``holds.policy``).
        ``hash_mask``: the bits of each key's hash the key table uses (tests narrow it so that keys
        collide)."""
        self.view = view
        self.fence = fence
        self.geometry = view.geometry
        self.page_size = view.geometry.page_size
        self.policy = holds.policy
        self.events = events if events is not None else Events()
        self.ns = Namespaces(view, self.page_size, verify_checksums)
        self.keys = key_table(view, hash_mask)
        self.entry_count = {WRITING: 0, READY: 0}
        self.holds = holds
        self.checksums = verify_checksums         # entries carry data checksums (their namespaces' flag)
        self.tick = 0                             # the access clock (recovery orders by it)
        self.counters: Counter = Counter()
        # Columns of the entry table, read vectorised; a job's writes go through records.fill and
        # records.new_records (one compiled pass each: NumPy scatters into 128-byte records slowly).
        entries = view.entries
        self._states, self._ticks, self._sums = entries["state"], entries["tick"], entries["record_sum"]
        self._ns_col, self._page_counts = entries["ns"], entries["page_count"]
        self.recovered = self._recover(verify_checksums)

    @property
    def namespaces(self) -> dict[NamespaceId, Namespace]:
        return self.ns.by_id

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
        self.ns.recover(found)
        # The scan's copy of the state column is contiguous: each NumPy pass over the column itself
        # reads a cache line per record (~13 ms for a million).
        states = found.states
        for slot, why in found.problems:
            log.warning("entry %d discarded: %s", slot, why)
        discarded = np.concatenate([np.array([slot for slot, _ in found.problems], np.int64), found.writing])
        self._states[discarded] = states[discarded] = FREE
        fill(view, np.flatnonzero(states != READY), "record_sum", 0)
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
    def namespace(self, ns_id: NamespaceId) -> Namespace:
        """The namespace of ``ns_id``, recorded in the namespace table when it is new. When the
        table is full, the slot of a namespace no attached engine uses is taken over — the one
        whose entries were used least recently, its entries evicted — so namespaces that an engine
        (or an attacker) left behind cannot keep new models out, across restarts too."""
        ns = self.ns.get(ns_id)
        if ns is not None:
            return ns
        if ns_id.entry_pages(self.page_size) > self.geometry.num_pages:
            raise RequestError(ErrorCode.NO_SPACE,
                               f"one block of {ns_id.name()} needs {ns_id.entry_pages(self.page_size)} pages; "
                               f"the region has {self.geometry.num_pages}")
        slot = self.ns.free_slot()
        return self.ns.add(ns_id, self._reclaim_namespace() if slot is None else slot)

    def _reclaim_namespace(self) -> int:
        """Free the table slot of the unused namespace used least recently, evicting its entries.

        A namespace no engine uses may still have entries someone touches: a demote's put reading
        them, a promote writing them (the second tier's work belongs to no engine). Such a
        namespace is not taken now (``_busy``); the next one is — its slot is worth nothing more
        than another's, and the tier's work ends within its deadlines (issue 26, case E)."""
        unused = [ns for ns in self.ns if not ns.users]
        if not unused:
            raise RequestError(ErrorCode.NO_SPACE, f"all {len(self.view.namespaces)} namespace slots are held by "
                                                   "attached engines")
        live = np.flatnonzero(self._states != FREE)
        newest = np.full(NS_SLOTS, -1, dtype=np.int64)
        np.maximum.at(newest, self._ns_col[live].astype(np.intp), self._ticks[live].astype(np.int64))
        for victim in sorted(unused, key=lambda ns: int(newest[ns.slot])):
            slots = self.slots_of(victim)
            if self._busy(slots):
                continue
            self._free(slots, Gone.RECLAIMED)
            self.ns.drop(victim)
            log.warning("namespace table full: namespace %d (%s) taken over, %d of its entries evicted", victim.slot,
                        victim.id.name(), len(slots))
            return victim.slot
        raise RequestError(ErrorCode.NO_SPACE, f"all {len(self.view.namespaces)} namespace slots are held by attached "
                                               f"engines or by blocks the second tier is moving ({len(unused)}): "
                                               "retry in a few seconds")

    def _busy(self, slots: np.ndarray) -> bool:
        """Whether a writer or a reader may still touch any of these entries' pages."""
        return count_state(self.view, slots, READY) != len(slots) or self.holds.any_held(slots)

    def namespace_at(self, slot: int) -> Namespace:
        """The namespace recorded in table slot ``slot``."""
        return self.ns.at(slot)

    def live(self, ns: Namespace) -> bool:
        """Whether ``ns`` is still in the table (a namespace taken over is not, even if its id comes back)."""
        return self.ns.get(ns.id) is ns

    def slots_of(self, ns: Namespace) -> np.ndarray:
        """Every live (WRITING or READY) entry of the namespace: a pass over the whole table (a
        takeover, a tier clear, stats: seldom)."""
        return np.flatnonzero((self._states != FREE) & (self._ns_col == ns.slot)).astype(np.int32)

    def namespace_stats(self) -> list[dict]:
        counts = np.bincount(self._ns_col[self._states != FREE], minlength=NS_SLOTS)
        return [{"slot": ns.slot, "name": ns.id.name(), "entries": int(counts[ns.slot]),
                 "entry_pages": ns.entry_pages} for ns in self.ns]

    # ------------------------------------------------------------------ lookup and access
    def lookup(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """The slots of the leading keys that are READY, counted as looked up. The caller
        accesses them (they are about to be used), or leases them (``lease``)."""
        hits = self.ready(ns, keys)
        self.counters["lookup_hit_keys"] += len(hits)
        self.counters["lookup_miss_keys"] += len(keys) - len(hits)
        return hits

    def ready(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """The slots of the leading keys that are in the namespace and READY (one compiled pass)."""
        return _slots(self.keys.prefix(ns.slot, keys, READY))

    def find(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """Each key's slot in the namespace (WRITING or READY), -1 where there is none."""
        return _slots(self.keys.find(ns.slot, keys))

    def states(self, slots: np.ndarray) -> np.ndarray:
        return self._states[slots]

    def namespaces_of(self, slots: np.ndarray) -> np.ndarray:
        """The table slot of each entry's namespace."""
        return self._ns_col[slots]

    def access(self, slots: np.ndarray) -> None:
        """The entries were just used: the policy hears it, and they get a new tick."""
        if len(slots):
            self.policy.accessed(slots)
            self.stamp(slots)

    def stamp(self, slots: np.ndarray) -> None:
        """A new access tick for these entries in the table (recovery rebuilds the policy's order from it)."""
        self.tick += 1
        fill(self.view, slots, "tick", self.tick)

    def ticks_of(self, slots: np.ndarray) -> np.ndarray:
        """The entries' last-access ticks (a later access gives an entry a new one)."""
        return self._ticks[slots].copy()

    # ------------------------------------------------------------------ holds
    def pin(self, slots: np.ndarray, holder: Holder | None = None, access: bool = True) -> None:
        """A load of ``holder`` (or, holder None, a demote to the second tier) reads the (distinct,
        READY) entries: those held by nothing else leave the policy; all get a new tick, unless the
        pin is no access (a demote reads them for the daemon itself)."""
        self.holds.pin(slots, holder)
        if len(slots) and access:   # pinned: out of the policy until released; only the tick moves
            self.stamp(slots)

    def unpin(self, slots: np.ndarray, holder: Holder | None = None) -> None:
        self.holds.unpin(slots, holder)

    def lease(self, slots: np.ndarray, holder: Holder) -> None:
        """A lease of ``holder`` holds the (distinct, READY) entries: those held by nothing else
        leave the policy, as a pin's do; all get a new tick (just looked up: they are not accessed
        in the policy first, since they leave it)."""
        self.holds.lease(slots, holder)
        if len(slots):
            self.stamp(slots)

    def unlease(self, slots: np.ndarray, holder: Holder) -> None:
        self.holds.unlease(slots, holder)

    # ------------------------------------------------------------------ store decisions
    def place(self, ns: Namespace, keys: list[bytes]) -> tuple[bytes, np.ndarray, int]:
        """Per key: PRESENT (READY, or WRITING by another write: accessed and never evicted for
        this one), WRITE (a new WRITING entry with pages), or NO_SPACE — after the first key that
        does not fit, every later new key. Returns (one StoreOutcome byte per key, the new slots
        in key order, how many were present). The decision of every write (``kvtierd.writes``):
        an engine's store job, a promote from the second tier."""
        found = self.find(ns, keys)              # keys of a write are distinct (protocol)
        # The usual store has every key new: one pass says so (the general case's take six, ~5 µs
        # of a 1,024-key store).
        present = NO_SLOTS if len(found) and found.max() < 0 else found[found >= 0]
        if len(present):
            self.access(present[self._states[present] == READY])
        fit = self._make_room(len(keys) - len(present), ns.entry_pages, present)
        if fit == len(keys):                     # every key new, all fit
            return bytes([WRITE]) * fit, self._new_entries(ns, keys), 0
        new = np.flatnonzero(found < 0)
        outcomes = np.full(len(keys), PRESENT, dtype=np.uint8)
        outcomes[new[fit:]] = NO_SPACE
        outcomes[new[:fit]] = WRITE
        written = keys[:fit] if len(new) == len(keys) else [keys[i] for i in new[:fit].tolist()]
        return outcomes.tobytes(), self._new_entries(ns, written), len(present)

    def _make_room(self, count: int, entry_pages: int, exclude: np.ndarray) -> int:
        """Evict the policy's victims (never those in ``exclude``: the write's present keys)
        until ``count`` entries of ``entry_pages`` fit, or nothing evictable is left. Returns how
        many fit: the write takes that prefix of its new keys and the rest get NO_SPACE."""
        need = count * entry_pages - self.pages.free_count
        if need > 0:
            self._free(self.victims(need, exclude), Gone.EVICTED)
        return min(count, self.pages.free_count // entry_pages)

    def _new_entries(self, ns: Namespace, keys: list[bytes]) -> np.ndarray:
        """WRITING entries for ``keys``, with pages (there is room: ``_make_room``) and records."""
        n = len(keys)
        if n == 0:
            return NO_SLOTS
        pages = self.pages.alloc(n * ns.entry_pages).view(PAGES_DTYPE).reshape(n, -1)
        slots = self.slots.alloc(n)
        # The records are written from the namespace's template in one pass; the key table writes
        # each key into its record as it indexes it. A torn write is harmless: recovery discards
        # WRITING records.
        new_records(self.view, slots, ns.record, pages, self.tick)
        self.view.write_chain(pages)
        self.keys.insert(ns.slot, keys, slots)
        self.entry_count[WRITING] += n
        return slots

    def make_ready(self, slots: np.ndarray, shard_sums: list[list[int]] | None = None, chain: bool = True,
                   cold: int = 0) -> None:
        """Every rank voted: the WRITING entries (of one namespace: a write's) become READY and
        evictable, in order. ``shard_sums`` holds each writer's checksums of its shard of every
        entry, in rank order. ``chain`` and ``cold`` tell the policy what the store request said:
        its keys are a prefix chain; its last ``cold`` entries are expected not to be reused."""
        self.tick += 1
        n = len(slots)
        if n == 0:
            return
        if shard_sums:              # else the records' checksums stay 0, as _new_entries wrote them
            self.view.entries["checksum"][slots] = [entry_checksum([sums[i] for sums in shard_sums])
                                                    for i in range(n)]
        ns = self.ns.at(int(self._ns_col[slots[0]]))
        chains = np.frombuffer(self.keys.pages(self.view.chain, slots), PAGES_DTYPE).reshape(n, ns.entry_pages)
        # Record by record: the tick, the record sum, and READY last (a record is complete before it
        # says READY).
        seal_records(self.view, slots, chains, ns.identity, self.tick, READY)
        self.policy.inserted(slots, np.frombuffer(self.keys.fingerprints(slots), np.uint64), chain, cold)
        self.entry_count[WRITING] -= n
        self.entry_count[READY] += n
        self.events.ready(ns, slots)

    def abandon(self, slots: np.ndarray) -> None:
        """Forget the WRITING entries of a write that ended without them. Their pages stay taken:
        the write fences those a writer may still copy into and frees the others (``release_pages``)."""
        if (self._states[slots] != WRITING).any():
            raise RuntimeError("only WRITING entries are abandoned")
        self._forget(slots, Gone.ABORTED)

    def release_pages(self, pages: np.ndarray) -> None:
        """Pages that no writer can touch any more come back (``kvtierd.writes`` alone; the
        fence's proofs are asked every turn of the loop, and most turns release none)."""
        if len(pages):
            self.pages.free(pages)

    # ------------------------------------------------------------------ pages and keys of entries
    def pages_of(self, ns: Namespace, slots: np.ndarray, rank: int | None = None) -> bytes:
        """The pages ``rank`` copies of each entry, in order, as PAGES_DTYPE bytes (what a store
        or load reply carries): the whole chain of a replicated entry (its one copy: the node's
        lowest rank writes it, every rank loads it), the run of ``rank``'s shard of a sharded one
        (``NamespaceId.shard_of``: its place in the node slice); the whole chain of every entry for
        ``rank`` None (a writer of whole entries: the tier). One compiled pass."""
        if ns.shards == 1 or rank is None:
            return self.keys.pages(self.view.chain, slots, ns.entry_pages)
        shard = ns.id.shard_of(rank)
        return self.keys.pages(self.view.chain, slots, ns.entry_pages, shard * ns.pages_per_shard,
                               (shard + 1) * ns.pages_per_shard)

    def shard_pages(self, ns: Namespace, slots: np.ndarray) -> np.ndarray:
        """The entries' pages as [entry, shard, page of the shard] (one shard when replicated)."""
        return np.frombuffer(self.pages_of(ns, slots), PAGES_DTYPE).reshape(len(slots), ns.shards,
                                                                             ns.pages_per_shard)

    def keys_of(self, slots: np.ndarray) -> list[bytes]:
        """The entries' keys, a bytes object each (for those who name them: the second tier)."""
        return keys_of(self.view, slots)

    # ------------------------------------------------------------------ eviction and freeing
    def victims(self, need: int = -1, exclude: np.ndarray = NO_SLOTS) -> np.ndarray:
        """The entries eviction may take (READY, held by nothing) and not in ``exclude``, the
        policy's best victim first, until their pages reach ``need`` (< 0: all of them)."""
        return _slots(self.policy.victims(need, exclude, self._page_counts))

    def evict(self, namespace: str | None, count: int | None, cause: Gone = Gone.CLEARED) -> int:
        """Operator eviction: up to ``count`` (None: all) of the policy's victims in the namespace
        named ``namespace`` (None: any). Pinned, leased and WRITING entries stay."""
        victims = self.victims()
        if namespace is not None:
            chosen = next((ns for ns in self.ns if ns.id.name() == namespace), None)
            if chosen is None:
                raise RequestError(ErrorCode.BAD_REQUEST, f"no namespace {namespace!r}; kvtierctl namespaces lists them")
            victims = victims[self._ns_col[victims] == chosen.slot]
        victims = victims if count is None else victims[:count]
        self._free(victims, cause)
        if len(victims) and cause is Gone.CLEARED:
            log.info("operator evicted %d entries (namespace %s)", len(victims), namespace or "any")
        return len(victims)

    def free_ahead(self, slots: np.ndarray) -> int:
        """Free those of the entries that nothing holds or writes (the second tier's frees ahead
        of need: it holds them, or could not take them). Returns how many were freed."""
        slots = np.asarray(slots, np.int32)
        chosen = slots[(self._states[slots] == READY) & ~self.holds.held(slots)] if len(slots) else NO_SLOTS
        self._free(chosen, Gone.AHEAD)
        return len(chosen)

    @property
    def free_pages(self) -> int:
        return self.pages.free_count

    @property
    def total_pages(self) -> int:
        return self.pages.total

    def _free(self, slots: np.ndarray, cause: Gone) -> None:
        """The one way READY entries and their pages go. Raises (changing nothing) when a writer
        or a reader may still touch one of them: that would be a bug of the caller, and a page
        given to two owners at once is a wrong block for someone (invariant 12)."""
        if not len(slots):
            return
        if self._busy(slots):
            raise RuntimeError(f"{cause.value}: an entry a writer or a reader may still touch cannot be freed")
        pages = np.frombuffer(self.keys.pages(self.view.chain, slots), PAGES_DTYPE)
        self._forget(slots, cause)
        self.pages.free(pages)
        self.counters[_COUNTED[cause]] += len(slots)

    def _forget(self, slots: np.ndarray, cause: Gone) -> None:
        """Entries leave: the listeners hear it (their records still whole), then out of the table
        first (state FREE), the key table and the policy."""
        if not len(slots):
            return
        self.events.leaving(cause, slots, self._ns_col[slots].astype(np.intp))
        ready = count_state(self.view, slots, READY)
        fill(self.view, slots, "state", FREE)
        fill(self.view, slots, "record_sum", 0)   # a stale record whose state byte came back to READY is no entry
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
            "entries_pinned": self.holds.pinned,
            "entries_leased": self.holds.leased,
            "evictable": len(self.policy),
            "namespaces": len(self.ns),
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
        is free or holds one entry, indexed by its key; the policy holds exactly the READY entries
        nothing holds; READY records' sums are current; the counts match. (The lease counts are
        ``Leases.verify``'s, the writes' ``Writes.verify``'s.)"""
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
        for ns in self.ns:
            assert self.ns.at(ns.slot) is ns and int(self.view.namespaces["in_use"][ns.slot]), f"namespace {ns.slot}"
            mine, done = live[self._ns_col[live] == ns.slot], ready[self._ns_col[ready] == ns.slot]
            assert (self._page_counts[mine] == ns.entry_pages).all(), f"namespace {ns.slot}: an entry's page count"
            assert (self.find(ns, self.keys_of(mine)) == mine).all(), f"namespace {ns.slot}: an entry not found"
            chains = np.frombuffer(self.keys.pages(self.view.chain, done), PAGES_DTYPE).reshape(len(done),
                                                                                              ns.entry_pages)
            assert (record_sums(self.view, done, chains, None, ns.identity) == self._sums[done]).all(), \
                f"namespace {ns.slot}: a READY record's sum is stale"
        assert set(np.unique(self._ns_col[live]).tolist()) <= {ns.slot for ns in self.ns}, "an entry of no namespace"
        held = self.holds.held(ready)
        in_policy = np.fromiter((slot in self.policy for slot in live.tolist()), bool, len(live))
        assert (in_policy == np.isin(live, ready[~held])).all(), "the policy holds other than the READY unheld"
        assert len(self.policy) == int((~held).sum())
        writing = live[states[live] == WRITING]
        assert not self.holds.held(writing).any(), "a WRITING entry is held"
        assert self.entry_count == {WRITING: len(writing), READY: len(ready)}
        self.holds.verify(free_slots)

    def persist_tick(self) -> None:
        """Write the access clock to the header (a clean stop)."""
        self.view.header["tick"] = self.tick

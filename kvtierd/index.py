"""The entry index: the (namespace, key) → entry map, pages and entry slots, eviction, the access
clock, and recovery from the region's tables. No sockets, no threads, no jobs.

An entry is one cached block of one namespace (``kvtierd.namespaces``). It is WRITING from the
moment a write (``kvtierd.writes``: a store job, a promote) is given its pages until the write
completes (``make_ready``), then READY: visible to lookup and load, and evictable unless a hold
keeps it (``kvtierd.holds``: a load's or a demote's pin, a lease). Its record in the region's
entry table mirrors it; READY is the last byte written there, FREE the first (invariant 1).

Page ownership (invariant 12). A page is free, held by an entry, or fenced (``kvtierd.fence``).
Everything that frees entries — eviction for room, the tier's frees ahead of need, operator
evictions, a namespace's takeover, the region's replacement, a write's abort — goes through
``_free``, which refuses an entry a writer may still write (WRITING: only its write frees it) or
a reader may still read (held); a takeover only takes a namespace nothing of which is held or
written. Fenced pages come back only through the writes (``release_pages``).

Eviction: the policy (``kvtierd.policy``) holds exactly the READY entries nothing holds and
chooses among them, across all namespaces (``victims``); the index frees what it chooses
(invariants 2 and 10). The index tells its ``Events`` (``kvtierd.events``) what becomes of entries.

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
from typing import Any, Iterator

import numpy as np

from .contract.codes import ErrorCode, RequestError, StoreOutcome
from .contract.namespace import NamespaceId
from .contract.protocol import PAGES_DTYPE
from .contract.region_format import ENTRY_DTYPE, TICK_LIMIT, EntryState
from .contract.region_sums import entry_checksum, entry_record_sums
from .contract.region_view import RegionView
from .events import EntryEvents, Events, Gone
from .fence import Fence
from .holds import Holder, Holds
from .namespaces import Namespace, Namespaces
from .pages import FreeStack
from .recovery import scan

log = logging.getLogger(__name__)

_SLOT = attrgetter("slot")
_KEY = attrgetter("key")
_PAGES = attrgetter("pages")


def _slots(entries: list) -> np.ndarray:
    return np.fromiter(map(_SLOT, entries), np.intp, len(entries))


# Monotonic counters the index keeps (Store.stats reports them with the job machine's).
COUNTERS = ("lookup_hit_keys", "lookup_miss_keys", "evictions", "operator_evictions")
# The counter each way of leaving counts in (an aborted write's entries were never READY: none).
_COUNTED = {Gone.EVICTED: "evictions", Gone.AHEAD: "evictions", Gone.RECLAIMED: "evictions",
            Gone.CLEARED: "operator_evictions", Gone.REGION_REPLACED: "operator_evictions"}


class Entry:
    __slots__ = ("slot", "ns", "key", "state", "pages", "write")

    def __init__(self, slot: int, ns: Namespace, key: bytes, state: EntryState, pages: bytes, write=None):
        self.slot, self.ns, self.key, self.state = slot, ns, key, state
        self.pages = pages      # the whole chain, PAGES_DTYPE bytes (sent to clients as slices)
        self.write = write      # the write (kvtierd.writes) writing it (WRITING only)


class Index:
    def __init__(self, view: RegionView, holds: Holds, fence: Fence, verify_checksums: bool = False,
                 events: EntryEvents | None = None):
        """``holds``: the entries' holds, over the eviction policy (``holds.policy``)."""
        self.view = view
        self.fence = fence
        self.geometry = view.geometry
        self.page_size = view.geometry.page_size
        self.policy = holds.policy
        self.events = events if events is not None else Events()
        self.ns = Namespaces(view, self.page_size, verify_checksums)
        self.by_slot: list[Entry | None] = [None] * self.geometry.entry_slots
        self.entry_count = {EntryState.WRITING: 0, EntryState.READY: 0}
        self.holds = holds
        self.checksums = verify_checksums         # entries carry data checksums (their namespaces' flag)
        self.tick = 0                             # the access clock (recovery orders by it)
        self.counters: Counter = Counter()
        self._states = view.entries["state"]      # columns of the entry table, for vectorised writes
        self._ticks = view.entries["tick"]
        self._sums = view.entries["record_sum"]
        self._ns_slots = view.entries["ns"]
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

    @property
    def namespaces(self) -> dict[NamespaceId, Namespace]:
        return self.ns.by_id

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
        self.ns.recover(found)
        states = self._states
        for slot, why in found.problems:
            log.warning("entry %d discarded: %s", slot, why)
            states[slot] = EntryState.FREE
        states[found.writing] = EntryState.FREE
        self._sums[states != EntryState.READY] = 0
        # A region holds millions of entries: the objects are built with C-level loops (map, zip).
        slots = found.ready_slots.tolist()
        kept = list(map(Entry, slots, map(self.ns.at, found.ready_ns.tolist()), found.ready_keys,
                        repeat(EntryState.READY), found.ready_pages))
        if len(self.ns) == 1:
            next(iter(self.ns)).index.update(zip(found.ready_keys, kept))
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

        def last_used(ns: Namespace) -> int:
            return int(self._ticks[_slots(list(ns.index.values()))].max()) if ns.index else -1
        for victim in sorted(unused, key=last_used):
            entries = list(victim.index.values())
            if self._busy(entries):
                continue
            self._free(entries, Gone.RECLAIMED)
            self.ns.drop(victim)
            log.warning("namespace table full: namespace %d (%s) taken over, %d of its entries evicted", victim.slot,
                        victim.id.name(), len(entries))
            return victim.slot
        raise RequestError(ErrorCode.NO_SPACE, f"all {len(self.view.namespaces)} namespace slots are held by attached "
                                               f"engines or by blocks the second tier is moving ({len(unused)}): "
                                               "retry in a few seconds")

    def _busy(self, entries: list[Entry]) -> bool:
        """Whether a writer or a reader may still touch any of these entries' pages."""
        slots = _slots(entries)
        return bool(len(slots)) and bool(((self._states[slots] != EntryState.READY) | self.holds.held(slots)).any())

    def namespace_at(self, slot: int) -> Namespace:
        """The namespace recorded in table slot ``slot``."""
        return self.ns.at(slot)

    def live(self, ns: Namespace) -> bool:
        """Whether ``ns`` is still in the table (a namespace taken over is not, even if its id comes back)."""
        return self.ns.get(ns.id) is ns

    def namespace_stats(self) -> list[dict]:
        return self.ns.stats()

    # ------------------------------------------------------------------ lookup and access
    def lookup(self, ns: Namespace, keys: list[bytes]) -> list[Entry]:
        """The entries of the leading keys that are READY, counted as looked up. The caller
        accesses them (they are about to be used), or leases them (``lease``)."""
        hits = ns.ready(keys)
        self.counters["lookup_hit_keys"] += len(hits)
        self.counters["lookup_miss_keys"] += len(keys) - len(hits)
        return hits

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

    def ticks_of(self, entries: list[Entry]) -> np.ndarray:
        """The entries' last-access ticks (a later access gives an entry a new one)."""
        return self._ticks[_slots(entries)].copy()

    # ------------------------------------------------------------------ holds
    def pin(self, entries: list[Entry], holder: Holder | None = None, access: bool = True) -> None:
        """A load of ``holder`` (or, holder None, a demote to the second tier) reads the (distinct,
        READY) entries: those held by nothing else leave the policy; all get a new tick, unless the
        pin is no access (a demote reads them for the daemon itself)."""
        slots = _slots(entries)
        self.holds.pin(slots, holder)
        if len(slots) and access:   # pinned: out of the policy until released; only the tick moves
            self.stamp(slots)

    def unpin(self, entries: list[Entry], holder: Holder | None = None) -> None:
        self.holds.unpin(_slots(entries), holder)

    def lease(self, entries: list[Entry], holder: Holder) -> None:
        """A lease of ``holder`` holds the (distinct, READY) entries: those held by nothing else
        leave the policy, as a pin's do; all get a new tick (just looked up: they are not accessed
        in the policy first, since they leave it)."""
        slots = _slots(entries)
        self.holds.lease(slots, holder)
        if len(slots):
            self.stamp(slots)

    def unlease(self, entries: list[Entry], holder: Holder) -> None:
        self.holds.unlease(_slots(entries), holder)

    # ------------------------------------------------------------------ store decisions
    def place(self, ns: Namespace, keys: list[bytes], write: Any) -> tuple[list[StoreOutcome], list[Entry], int]:
        """Per key: PRESENT (READY, or WRITING by another write: accessed and never evicted for
        this one), WRITE (a new WRITING entry with pages, written by ``write``), or NO_SPACE —
        after the first key that does not fit, every later new key. Returns (outcomes, new entries,
        how many were present). The decision of every write (``kvtierd.writes``): an engine's store
        job, a promote from the second tier."""
        found = list(map(ns.index.get, keys))    # keys of a job are distinct (protocol)
        present = [e for e in found if e is not None]
        self.access([e for e in present if e.state is EntryState.READY])
        new_keys = [k for k, e in zip(keys, found) if e is None]
        fit = self._make_room(len(new_keys), ns.entry_pages, set(map(_SLOT, present)))
        entries = self._new_entries(ns, new_keys[:fit], write)
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
            for entry in self.victims(exclude):
                victims.append(entry)
                need -= entry.ns.entry_pages
                if need <= 0:
                    break
            self._free(victims, Gone.EVICTED)
        return min(count, self.pages.free_count // entry_pages)

    def _new_entries(self, ns: Namespace, keys: list[bytes], write: Any) -> list[Entry]:
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
                           pages.view(f"V{pages.shape[1] * 4}").ravel().tolist(), repeat(write)))
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
        slots = _slots(entries)
        for entry in entries:
            entry.state = EntryState.READY
            entry.write = None
        self._ticks[slots] = self.tick
        self.view.entries["checksum"][slots] = [entry_checksum([sums[i] for sums in shard_sums])
                                                for i in range(len(entries))] if shard_sums else 0
        if not entries:
            return
        ns = entries[0].ns          # the record is complete: its sum (a write's entries share a namespace)
        chains = np.frombuffer(b"".join(map(_PAGES, entries)), PAGES_DTYPE).reshape(len(entries), ns.entry_pages)
        self._sums[slots] = entry_record_sums(self._records[slots], chains, None, ns.identity)
        self._states[slots] = EntryState.READY    # last: the records are complete before they say READY
        keys = list(map(_KEY, entries))
        self.policy.inserted(slots.tolist(), keys, chain, cold)
        self.entry_count[EntryState.WRITING] -= len(entries)
        self.entry_count[EntryState.READY] += len(entries)
        self.events.ready(ns, slots, keys)

    def abandon(self, entries: list[Entry]) -> None:
        """Forget the WRITING entries of a write that ended without them. Their pages stay taken:
        the write fences those a writer may still copy into and frees the others (``release_pages``)."""
        if any(e.state is not EntryState.WRITING for e in entries):
            raise RuntimeError("only WRITING entries are abandoned")
        self._forget(entries, Gone.ABORTED)

    def release_pages(self, pages: np.ndarray) -> None:
        """Pages that no writer can touch any more come back (``kvtierd.writes`` alone)."""
        self.pages.free(pages.tolist())

    # ------------------------------------------------------------------ eviction and freeing
    def victims(self, exclude: set[int] | frozenset[int] = frozenset()) -> Iterator[Entry]:
        """The entries eviction may take (READY, held by nothing), the policy's best victim first."""
        return map(self.by_slot.__getitem__, self.policy.victims(exclude))

    def evict(self, namespace: str | None, count: int | None, cause: Gone = Gone.CLEARED) -> int:
        """Operator eviction: up to ``count`` (None: all) of the policy's victims in the namespace
        named ``namespace`` (None: any). Pinned, leased and WRITING entries stay."""
        if namespace is not None and not any(ns.id.name() == namespace for ns in self.ns):
            raise RequestError(ErrorCode.BAD_REQUEST, f"no namespace {namespace!r}; kvtierctl namespaces lists them")
        victims = [e for e in self.victims() if namespace is None or e.ns.id.name() == namespace]
        victims = victims if count is None else victims[:count]
        self._free(victims, cause)
        if victims and cause is Gone.CLEARED:
            log.info("operator evicted %d entries (namespace %s)", len(victims), namespace or "any")
        return len(victims)

    def free_ahead(self, entries: list[Entry]) -> int:
        """Free those of the entries that nothing holds or writes (the second tier's frees ahead
        of need: it holds them, or could not take them). Returns how many were freed."""
        slots = _slots(entries)
        free = (self._states[slots] == EntryState.READY) & ~self.holds.held(slots) if len(slots) else []
        chosen = [e for e, ok in zip(entries, free) if ok]
        self._free(chosen, Gone.AHEAD)
        return len(chosen)

    @property
    def free_pages(self) -> int:
        return self.pages.free_count

    @property
    def total_pages(self) -> int:
        return self.pages.total

    def _free(self, entries: list[Entry], cause: Gone) -> None:
        """The one way READY entries and their pages go. Raises (changing nothing) when a writer
        or a reader may still touch one of them: that would be a bug of the caller, and a page
        given to two owners at once is a wrong block for someone (invariant 12)."""
        if not entries:
            return
        if self._busy(entries):
            raise RuntimeError(f"{cause.value}: an entry a writer or a reader may still touch cannot be freed")
        pages = np.frombuffer(b"".join(map(_PAGES, entries)), PAGES_DTYPE).tolist()
        self._forget(entries, cause)
        self.pages.free(pages)
        self.counters[_COUNTED[cause]] += len(entries)

    def _forget(self, entries: list[Entry], cause: Gone) -> None:
        """Entries leave: the listeners hear it, then out of the table first (state FREE), the
        index and the policy."""
        if not entries:
            return
        slots = _slots(entries)
        self.events.leaving(cause, slots, list(map(_KEY, entries)), self._ns_slots[slots].astype(np.intp))
        self._states[slots] = EntryState.FREE
        self._sums[slots] = 0       # a stale record whose state byte came back to READY is no entry
        by_slot, count = self.by_slot, self.entry_count
        for entry in entries:
            del entry.ns.index[entry.key]
            by_slot[entry.slot] = None
            count[entry.state] -= 1
            entry.state = EntryState.FREE
        free = slots.tolist()
        self.policy.removed(free)
        self.slots.free(free)

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
        is free or holds one entry; the policy holds exactly the READY entries nothing holds; the
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
        assert len(free_slots) + sum(len(ns.index) for ns in self.ns) == self.geometry.entry_slots, "entry slots leaked"
        table = self.view.entries
        held_slots = self.holds.held(np.arange(self.geometry.entry_slots))
        for ns in self.ns:
            assert self.ns.at(ns.slot) is ns and int(self.view.namespaces["in_use"][ns.slot]), f"namespace {ns.slot}"
            for key, entry in ns.index.items():
                pages = np.frombuffer(entry.pages, PAGES_DTYPE).astype(np.int64)
                assert len(pages) == ns.entry_pages, f"entry {entry.slot} has {len(pages)} pages"
                assert (owner[pages] == -1).all(), f"entry {entry.slot} shares a page"
                owner[pages] = entry.slot
                assert self.by_slot[entry.slot] is entry and entry.ns is ns
                rec = table[entry.slot]
                assert int(rec["state"]) == entry.state and bytes(rec["key"][: rec["key_len"]]) == key
                assert int(rec["ns"]) == ns.slot, f"entry {entry.slot} names namespace {int(rec['ns'])}"
                assert np.array_equal(self.view.chain_of(entry.slot), pages)
                held = held_slots[entry.slot]
                assert (entry.slot in self.policy) == (entry.state is EntryState.READY and not held), \
                    f"entry {entry.slot} policy membership"
                assert entry.state is EntryState.READY or not held, f"entry {entry.slot} held"
                assert (entry.state is EntryState.WRITING) == (entry.write is not None), f"entry {entry.slot} write"
        assert (owner != -1).all(), f"{int((owner == -1).sum())} pages leaked"
        self.holds.verify(np.asarray(free_slots, np.intp))
        assert len(self.policy) == sum(1 for e in self.by_slot if e is not None and e.state is EntryState.READY
                                       and not held_slots[e.slot])

    def persist_tick(self) -> None:
        """Write the access clock to the header (a clean stop)."""
        self.view.header["tick"] = self.tick

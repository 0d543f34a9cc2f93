"""Holds (invariants 2, 10, 12 and 13): who may still read a READY entry's pages, and how much of
the region each engine may keep out of eviction that way. No sockets, no threads.

Per entry slot, two kinds of hold, each a count (uint32 arrays: a job's or a lease's thousands of
entries are held in one compiled pass, ``kvtierd._native.hold``):

- a *pin*: someone copies out of the entry's pages now — an engine's load job (until every rank
  released it) or the second tier's put (a demote, until its final outcome);
- a *lease*: a lookup promised the entry to an engine (``kvtierd.leases``, invariant 10).

An entry held by either kind is out of the eviction policy's set; it leaves the set when the first
hold of either kind comes and re-enters it when the last one goes (the policy's ``pinned`` and
``unpinned`` hooks). WRITING entries are their write's (``kvtierd.writes``), never held. ``held``
is the question every path that frees entries asks (``Index._free``): nothing may free a page that
a reader may still touch (invariant 12).

Per holder (issue 26 D). A held entry cannot be evicted, so whatever engines hold is room no store
can make; counting entries would not bound that (an absolute count far above a region's entries
bounds nothing; an entry's pages differ by namespace). A hold of an engine (its leases, its load
jobs' pins) counts its entries' pages, each hold on its own (a lease and a load of the same entries
count twice, as do two leases of one engine), against:

- ``engine`` share of the region's pages for one engine (setting max_held_share_per_engine);
- ``namespace`` share for all engines of one namespace (max_held_share_per_namespace);
- ``total`` share for all engines together (max_held_share): whatever the holders, that much of
  the region stays evictable, so another engine's store always finds room.

The pages are counted by the same call that holds the slots, so the two counts cannot part. A hold
past a cap fails soft: ``fit`` says how many of the entries fit (a lease holds that prefix, its
reply says how many; a load pins that prefix and the rest are misses), and the keys left out are
counted per cap (``capped``). Pages about to be given back by the same request (the lease a load
consumes, the lease a lookup renews) count as room, so a load of leased keys, or a renewal of what
is held, is never cut short. Demote pins of the second tier belong to no engine (holder None) and
count against no share.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import numpy as np

from ._native import any_held, hold
from .policy import Policy

CAPS = ("engine", "namespace", "total")     # kvtierd_hold_capped_keys_total's cap label


class Holder(Protocol):
    """An engine, as holds count it: by itself and by its namespace (``ns.entry_pages`` each entry)."""

    ns: Any


class Holds:
    def __init__(self, slots: int, pages_total: int, policy: Policy,
                 shares: tuple[float, float, float] = (0.25, 0.4, 0.75)):
        """``shares``: of ``pages_total``, what one engine, one namespace and all engines may hold."""
        self.policy = policy
        self.pins = np.zeros(slots, np.uint32)
        self.leases = np.zeros(slots, np.uint32)
        self.pinned = 0           # slots with at least one pin
        self.leased = 0           # slots with at least one lease
        self.caps = {cap: max(1, int(pages_total * share)) for cap, share in zip(CAPS, shares)}
        self._engine: Counter = Counter()       # engine → pages its holds count
        self._namespace: Counter = Counter()    # namespace → pages the holds of its engines count
        self.pages = 0                          # pages all engines' holds count
        self.capped: Counter = Counter()        # cap → keys left out of a hold past it

    # ------------------------------------------------------------------ holding entries
    def pin(self, slots: np.ndarray, holder: Holder | None = None) -> None:
        """A pin on each slot, by ``holder``'s load (None: the second tier's demote)."""
        self.pinned += self._hold(self.pins, self.leases, slots)
        self._take(holder, len(slots))

    def unpin(self, slots: np.ndarray, holder: Holder | None = None) -> None:
        self.pinned -= self._let_go(self.pins, self.leases, slots)
        self._give(holder, len(slots))

    def lease(self, slots: np.ndarray, holder: Holder) -> None:
        self.leased += self._hold(self.leases, self.pins, slots)
        self._take(holder, len(slots))

    def unlease(self, slots: np.ndarray, holder: Holder) -> None:
        self.leased -= self._let_go(self.leases, self.pins, slots)
        self._give(holder, len(slots))

    def _hold(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One more hold of one kind (``mine``, beside the ``other`` kind) on each slot: those
        held by nothing before leave the policy. Returns how many had no hold of this kind."""
        fresh, leaving = hold(mine, other, slots, 1)
        self.policy.pinned(np.frombuffer(leaving, np.int32))
        return fresh

    def _let_go(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One hold of this kind less on each slot: those held by nothing now re-enter the policy.
        Returns how many have no hold of this kind left."""
        gone, back = hold(mine, other, slots, -1)
        self.policy.unpinned(np.frombuffer(back, np.int32))
        return gone

    def held(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: whether anything holds it."""
        return (self.pins[slots] != 0) | (self.leases[slots] != 0)

    def any_held(self, slots: np.ndarray) -> bool:
        """Whether anything holds any of the slots (one compiled pass)."""
        return any_held(self.pins, self.leases, slots)

    def of(self, slot: int) -> tuple[int, int]:
        """(pins, leases) holding the entry of ``slot``."""
        return int(self.pins[slot]), int(self.leases[slot])

    # ------------------------------------------------------------------ shares
    def fit(self, holder: Holder, count: int, returned: int = 0) -> int:
        """How many of ``count`` entries of its namespace ``holder`` may hold more, with
        ``returned`` of its pages about to be given back; the keys left out are counted against
        the cap that bound them."""
        rooms = {"engine": self.caps["engine"] - self._engine[holder],
                 "namespace": self.caps["namespace"] - self._namespace[holder.ns],
                 "total": self.caps["total"] - self.pages}
        bound = min(rooms, key=rooms.get)
        fits = max(0, min(count, (rooms[bound] + returned) // holder.ns.entry_pages))
        if fits < count:
            self.capped[bound] += count - fits
        return fits

    def _take(self, holder: Holder | None, entries: int) -> None:
        if holder is None or not entries:
            return
        pages = entries * holder.ns.entry_pages
        self._engine[holder] += pages
        self._namespace[holder.ns] += pages
        self.pages += pages

    def _give(self, holder: Holder | None, entries: int) -> None:
        if holder is None or not entries:
            return
        pages = entries * holder.ns.entry_pages
        for table, key in ((self._engine, holder), (self._namespace, holder.ns)):
            table[key] -= pages
            if not table[key]:
                del table[key]
        self.pages -= pages

    # ------------------------------------------------------------------ stats and checks
    def stats(self) -> dict:
        return {"held_pages": self.pages, "held_pages_top_engine": max(self._engine.values(), default=0),
                "hold_capped_keys": {cap: self.capped[cap] for cap in CAPS}}

    def verify(self, free_slots: np.ndarray) -> None:
        """The counts against the arrays, and no free slot held (tests, ``Index.verify``)."""
        assert not self.held(free_slots).any(), "a free slot is held"
        assert self.pinned == int(np.count_nonzero(self.pins))
        assert self.leased == int(np.count_nonzero(self.leases))

    def verify_holders(self, held: Counter) -> None:
        """The pages per engine and namespace against ``held`` (engine → pages of its leases and
        load pins; tests, ``Store.verify``)."""
        assert +self._engine == +held, f"held pages per engine {dict(self._engine)} != {dict(held)}"
        namespaces: Counter = Counter()
        for engine, pages in held.items():
            namespaces[engine.ns] += pages
        assert +self._namespace == +namespaces and self.pages == sum(held.values())

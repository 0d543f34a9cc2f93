"""Leases (invariant 10: a looked-up hit stays loadable): the ready prefix a lookup reported, held
for the engine that asked until a load consumes it, the engine releases it, it expires, or the
session that made it ends. No sockets, no threads.

A lease is named by its client: (engine, lease id), the id unique per engine while the lease
lives. It holds its entries as a load's pin does — out of the eviction policy's set
(``Index.lease``), so neither a store making room nor ``kvtierctl evict``/``clear`` can take
them — but for a bounded time: the ttl the lookup asked for, clamped to [``MIN_TTL``,
``max_lease_ttl``] (default ``lease_ttl``). A lookup naming a live lease id renews it by
replacing it: the new prefix is held before the old lease lets go, so an entry in both is never
evictable in between.

How a lease ends (``LeaseEnd``, the ``cause`` of kvtierd_lease_ends_total):

- consumed: a load job of the engine named it. The job's first request pins the job's ready
  prefix first and ends the lease after, so no entry is evictable in between, and a load whose
  keys are all leased cannot come back short;
- released (``unlease``), replaced (renewed), expired (the deadline heap, ``expire``);
- revoked: ``kvtierctl clear --force`` (the loads that name it then come back short);
- session_ended: leases are session state. Any session of the engine may consume, release or
  renew a lease (the coordinator leases, the ranks' load consumes), but it dies with the session
  that holds it — also with a daemon restart; the client library re-issues its live leases once
  it re-attached.

Bounds (issue 11's pattern for open jobs): a lease counts its entries plus one against
``max_leased_keys_per_engine`` and ``max_leased_keys`` (all engines together), which bound the
records' memory; and its entries' pages against the shares of the region an engine, a namespace
and all engines may hold out of eviction (``kvtierd.holds``, with load pins). A lookup past any
leases the longest prefix of its hits that fits, or nothing; its reply says how many it holds
(``leased``), and the keys left out are counted (``lease_capped_keys``).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .attachments import Engine, Session
from .holds import Holds
from .index import Index

MIN_TTL = 0.01          # seconds: the shortest lease granted, whatever the lookup asked for


class LeaseEnd(str, enum.Enum):
    """How a lease ended (kvtierd_lease_ends_total's cause)."""

    CONSUMED = "consumed"             # a load job of the engine named it
    RELEASED = "released"             # unlease
    REPLACED = "replaced"             # a lookup renewed it (same id)
    EXPIRED = "expired"
    REVOKED = "revoked"               # kvtierctl clear --force
    SESSION_ENDED = "session_ended"   # the session that held it ended


@dataclass(eq=False)
class Lease:
    id: int
    engine: Engine
    session: Session            # the session that made (or last renewed) it: it dies with it
    slots: np.ndarray           # the held prefix, READY (no eviction may take them while held)
    deadline: float
    live: bool = True

    @property
    def pages(self) -> int:
        """What it counts against the held shares (``kvtierd.holds``): its entries' pages."""
        return len(self.slots) * self.engine.ns.entry_pages

    @property
    def cost(self) -> int:
        """What it counts against the caps: its entries plus one (the record itself)."""
        return len(self.slots) + 1


class Leases:
    def __init__(self, index: Index, holds: Holds, clock: Callable[[], float] = time.monotonic, ttl: float = 5.0,
                 max_ttl: float = 60.0, max_keys_per_engine: int = 1 << 18, max_keys: int = 1 << 20):
        self.index = index
        self.holds = holds
        self.clock = clock
        self.ttl = ttl                                  # setting lease_ttl
        self.max_ttl = max(max_ttl, MIN_TTL)            # setting max_lease_ttl
        self.max_keys_per_engine = max_keys_per_engine
        self.max_keys = max_keys
        self._leases: dict[tuple[Engine, int], Lease] = {}
        self._by_session: dict[Session, dict[int, Lease]] = {}
        self._engine_keys: Counter = Counter()          # engine -> cost of its leases
        self.keys = 0                                   # cost of all leases
        # (deadline, seq, lease): an ended lease stays until it comes up (or a rebuild drops it).
        self._deadlines: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self.granted = 0
        self.ends: Counter = Counter()                  # LeaseEnd value -> leases
        self.missed_loads = 0
        self.capped_keys = 0

    def __len__(self) -> int:
        return len(self._leases)

    # ------------------------------------------------------------------ grant, renew
    def grant(self, session: Session, lease_id: int, slots: np.ndarray, ttl: float | None) -> tuple[int, float]:
        """Hold the entries of ``slots`` (a lookup's READY prefix) for ``session``'s engine under ``lease_id``,
        replacing the live lease of that id. Returns (entries held, ttl granted in seconds); (0, 0)
        when nothing is held (no hits, or no room under the caps: any earlier lease of the id ends)."""
        engine = session.engine
        old = self._leases.get((engine, lease_id))
        returned = old.cost if old is not None else 0
        room = min(self.max_keys_per_engine - self._engine_keys[engine],
                   self.max_keys - self.keys) + returned - 1
        n = max(0, min(len(slots), room))
        n = self.holds.fit(engine, n, old.pages if old is not None else 0)
        self.capped_keys += len(slots) - n
        if n == 0:
            if old is not None:
                self._end(old, LeaseEnd.REPLACED)
            return 0, 0.0
        ttl = min(max(self.ttl if ttl is None else ttl, MIN_TTL), self.max_ttl)
        held = slots[:n]
        self.index.lease(held, engine)  # before the old lease lets go: never evictable in between
        if old is not None:
            self._end(old, LeaseEnd.REPLACED)
        lease = Lease(lease_id, engine, session, held, self.clock() + ttl)
        self._leases[(engine, lease_id)] = lease
        self._by_session.setdefault(session, {})[lease_id] = lease
        self._engine_keys[engine] += lease.cost
        self.keys += lease.cost
        self.granted += 1
        self._push_deadline(lease)
        return n, ttl

    # ------------------------------------------------------------------ ends
    def pages_of(self, engine: Engine, lease_id: int) -> int:
        """The pages the live lease ``lease_id`` of ``engine`` holds (0: none is live)."""
        lease = self._leases.get((engine, lease_id))
        return 0 if lease is None else lease.pages

    def consume(self, engine: Engine, lease_id: int) -> None:
        """A load job of ``engine`` named the lease; the caller pinned the job's entries first."""
        lease = self._leases.get((engine, lease_id))
        if lease is None:
            self.missed_loads += 1
            return
        self._end(lease, LeaseEnd.CONSUMED)

    def release(self, session: Session, lease_ids: list[int]) -> int:
        """``unlease``: end the engine's live leases among ``lease_ids``; returns how many."""
        released = 0
        for lease_id in lease_ids:
            lease = self._leases.get((session.engine, lease_id))
            if lease is not None:
                self._end(lease, LeaseEnd.RELEASED)
                released += 1
        return released

    def session_gone(self, session: Session) -> None:
        """The session ended: its leases with it."""
        for lease in list(self._by_session.get(session, {}).values()):
            self._end(lease, LeaseEnd.SESSION_ENDED)

    def revoke(self, namespace: str | None) -> int:
        """End every lease of the namespace named ``namespace`` (None: all); returns how many."""
        doomed = [lease for lease in self._leases.values()
                  if namespace is None or lease.engine.ns.id.name() == namespace]
        for lease in doomed:
            self._end(lease, LeaseEnd.REVOKED)
        return len(doomed)

    def expire(self) -> float | None:
        """End the leases past their deadline. Returns the next deadline."""
        now, heap = self.clock(), self._deadlines
        while heap and (heap[0][0] <= now or not heap[0][2].live):
            _, _, lease = heapq.heappop(heap)
            if lease.live:
                self._end(lease, LeaseEnd.EXPIRED)
        return heap[0][0] if heap else None

    def _end(self, lease: Lease, cause: LeaseEnd) -> None:
        lease.live = False
        del self._leases[(lease.engine, lease.id)]
        owned = self._by_session[lease.session]
        del owned[lease.id]
        if not owned:
            del self._by_session[lease.session]
        self._engine_keys[lease.engine] -= lease.cost
        if not self._engine_keys[lease.engine]:
            del self._engine_keys[lease.engine]
        self.keys -= lease.cost
        self.index.unlease(lease.slots, lease.engine)
        self.ends[cause.value] += 1

    def _push_deadline(self, lease: Lease) -> None:
        heap = self._deadlines
        heapq.heappush(heap, (lease.deadline, next(self._seq), lease))
        # Renewals leave their old lease's item behind until its deadline: rebuilt from the live
        # ones whenever ended ones outnumber them (amortised: one pass per as many pushes).
        if len(heap) > 2 * len(self._leases) + 1024:
            self._deadlines = [item for item in heap if item[2].live]
            heapq.heapify(self._deadlines)

    # ------------------------------------------------------------------ what is going on
    def leased_entries(self, namespace: str | None) -> int:
        """Entries held by a lease in the namespace named ``namespace`` (None: all)."""
        mine = [lease.slots for lease in self._leases.values()
                if namespace is None or lease.engine.ns.id.name() == namespace]
        return len(np.unique(np.concatenate(mine))) if mine else 0

    def held(self) -> Counter:
        """Engine → the pages its leases hold (``Holds.verify_holders``)."""
        held: Counter = Counter()
        for lease in self._leases.values():
            held[lease.engine] += lease.pages
        return held

    def of_session(self, session: Session) -> tuple[int, int]:
        """(leases, entries in them) that ``session`` holds."""
        owned = self._by_session.get(session, {})
        return len(owned), sum(len(lease.slots) for lease in owned.values())

    def stats(self) -> dict:
        return {"leases_open": len(self._leases), "leased_keys": self.keys - len(self._leases),
                "leases_granted": self.granted, "lease_ends": dict(self.ends),
                "lease_missed_loads": self.missed_loads, "lease_capped_keys": self.capped_keys}

    def verify(self) -> None:
        """The leases against themselves and the entries' lease counts (tests)."""
        held: Counter = Counter()
        for (engine, lease_id), lease in self._leases.items():
            assert lease.live and lease.engine is engine and lease.id == lease_id
            assert self._by_session[lease.session][lease_id] is lease
            held.update(lease.slots.tolist())
        assert sum(map(len, self._by_session.values())) == len(self._leases)
        assert self.keys == sum(lease.cost for lease in self._leases.values()) == sum(self._engine_keys.values())
        for slot, count in held.items():
            assert self.holds.of(slot)[1] == count, f"entry {slot} lease count"
        assert self.holds.leased == len(held)
        live = sum(1 for item in self._deadlines if item[2].live)
        assert live == len(self._leases), "a live lease without a deadline"

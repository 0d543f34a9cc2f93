"""Holds: the region's pages that engines keep out of eviction — through their leases and their
load jobs' pins — counted per engine, per namespace and in all, and capped as a share of the
region (issue 26 D). No sockets, no threads.

A held entry cannot be evicted, so whatever engines hold is room no store can make. Counting
entries would not bound that (an absolute count far above a region's entries bounds nothing; an
entry's pages differ by namespace): a hold counts its entries' pages, each hold on its own (a
lease and a load of the same entries count twice, as do two leases of one engine), against:

- ``engine_share`` of the region's pages for one engine (setting max_held_share_per_engine);
- ``namespace_share`` for all engines of one namespace (max_held_share_per_namespace);
- ``total_share`` for all engines together (max_held_share): whatever the holders, that much of
  the region stays evictable, so another engine's store always finds room.

A hold past a cap fails soft: ``fit`` says how many of the entries fit (a lease holds that
prefix, its reply says how many; a load pins that prefix and the rest are misses), and the keys
left out are counted per cap (``capped``). Pages about to be given back by the same request (the
lease a load consumes, the lease a lookup renews) count as room, so a load of leased keys, or a
renewal of what is held, is never cut short. Demote pins of the second tier belong to no engine
and are not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

CAPS = ("engine", "namespace", "total")     # kvtierd_hold_capped_keys_total's cap label


class Holds:
    def __init__(self, pages_total: int, engine_share: float = 0.25, namespace_share: float = 0.4,
                 total_share: float = 0.75):
        self.caps = {cap: max(1, int(pages_total * share))
                     for cap, share in zip(CAPS, (engine_share, namespace_share, total_share))}
        self._engine: Counter = Counter()       # engine → pages its holds count
        self._namespace: Counter = Counter()    # namespace → pages the holds of its engines count
        self.pages = 0                          # pages all holds count
        self.capped: Counter = Counter()        # cap → keys left out of a hold past it

    def fit(self, engine: Any, entry_pages: int, count: int, returned: int = 0) -> int:
        """How many of ``count`` entries of ``entry_pages`` pages ``engine`` may hold more, with
        ``returned`` of its pages about to be given back; the keys left out are counted against
        the cap that bound them."""
        rooms = {"engine": self.caps["engine"] - self._engine[engine],
                 "namespace": self.caps["namespace"] - self._namespace[engine.ns],
                 "total": self.caps["total"] - self.pages}
        bound = min(rooms, key=rooms.get)
        fits = max(0, min(count, (rooms[bound] + returned) // entry_pages))
        if fits < count:
            self.capped[bound] += count - fits
        return fits

    def take(self, engine: Any, pages: int) -> None:
        self._engine[engine] += pages
        self._namespace[engine.ns] += pages
        self.pages += pages

    def give(self, engine: Any, pages: int) -> None:
        for table, key in ((self._engine, engine), (self._namespace, engine.ns)):
            table[key] -= pages
            if not table[key]:
                del table[key]
        self.pages -= pages

    def stats(self) -> dict:
        return {"held_pages": self.pages, "held_pages_top_engine": max(self._engine.values(), default=0),
                "hold_capped_keys": {cap: self.capped[cap] for cap in CAPS}}

    def verify(self, held: Counter) -> None:
        """The counts against ``held`` (engine → pages of its leases and load pins; tests)."""
        assert +self._engine == +held, f"held pages per engine {dict(self._engine)} != {dict(held)}"
        namespaces: Counter = Counter()
        for engine, pages in held.items():
            namespaces[engine.ns] += pages
        assert +self._namespace == +namespaces and self.pages == sum(held.values())

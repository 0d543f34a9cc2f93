"""Namespaces: what every entry of one namespace has in common, and the region's namespace table.

A namespace is a ``NamespaceId`` (model, dtype, tokens per block, bytes per block and rank,
sharding; invariant 8) recorded in a slot of the region's namespace table, so that recovery and
offline tools know it. ``Namespaces`` keeps the live ones by id and by slot and writes their
records. Which namespace to take over when the table is full is the index's decision
(``Index.namespace``: it must first free the namespace's entries, and nothing may free what a
writer or reader may still touch).
"""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np

from .contract.namespace import NamespaceId
from .contract.region_format import ENTRY_DTYPE, NS_CHECKSUMS, EntryState
from .contract.region_sums import namespace_identities
from .contract.region_view import RegionView, namespace_record
from .recovery import RegionScan

log = logging.getLogger(__name__)


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
        self.record[["state", "ns", "page_count", "length"]] = (EntryState.WRITING, slot, self.entry_pages,
                                                                 ns_id.entry_bytes)


class Namespaces:
    """The live namespaces of a region (by id and by table slot) and their records."""

    def __init__(self, view: RegionView, page_size: int, checksums: bool):
        self.view = view
        self.page_size = page_size
        self.checksums = checksums        # new records say that their entries carry data checksums
        self.by_id: dict[NamespaceId, Namespace] = {}
        self.by_slot: dict[int, Namespace] = {}

    def recover(self, found: RegionScan) -> None:
        """The namespaces ``recovery.scan`` found sound; damaged records are discarded."""
        table = self.view.namespaces
        for slot, why in found.damaged_namespaces.items():
            log.warning("namespace slot %d is damaged (%s); discarding it and its entries", slot, why)
            table[slot]["in_use"] = 0
        flag = NS_CHECKSUMS if self.checksums else 0
        for slot, ns_id in found.namespaces.items():
            self._live(slot, ns_id)
            if int(table[slot]["flags"]) & NS_CHECKSUMS != flag:
                table[slot] = namespace_record(ns_id, flag)   # the setting changed: it follows

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Namespace]:
        return iter(list(self.by_id.values()))

    def get(self, ns_id: NamespaceId) -> Namespace | None:
        return self.by_id.get(ns_id)

    def at(self, slot: int) -> Namespace:
        """The namespace recorded in table slot ``slot``."""
        return self.by_slot[slot]

    def free_slot(self) -> int | None:
        """A table slot no namespace holds, if any."""
        free = np.flatnonzero(self.view.namespaces["in_use"] == 0)
        return int(free[0]) if len(free) else None

    def add(self, ns_id: NamespaceId, slot: int) -> Namespace:
        """Record ``ns_id`` in the free table slot ``slot``."""
        self.view.namespaces[slot] = namespace_record(ns_id, NS_CHECKSUMS if self.checksums else 0)
        log.info("namespace %d: %s", slot, ns_id.name())
        return self._live(slot, ns_id)

    def drop(self, ns: Namespace) -> None:
        """Forget ``ns`` and free its table slot (its entries are gone already)."""
        assert not ns.users, "dropping a namespace still in use"
        del self.by_id[ns.id]
        del self.by_slot[ns.slot]
        self.view.namespaces[ns.slot]["in_use"] = 0

    def _live(self, slot: int, ns_id: NamespaceId) -> Namespace:
        ns = Namespace(slot, ns_id, self.page_size, int(namespace_identities(self.view.namespaces[slot:slot + 1])[0]))
        self.by_id[ns_id] = ns
        self.by_slot[slot] = ns
        return ns

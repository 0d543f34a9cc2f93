"""``Coordinator``: the session of an engine's scheduler process (no rank): it looks up keys and
opens the jobs that the engine's ranks then carry out; it copies nothing and maps no region
(``kvtier.api`` describes the public API; ``Client(..., rank=None)`` builds one).

Whichever request of a job reaches kvtierd first — the coordinator's ``open_store``/``open_load``
or a rank's ``store``/``load`` — fixes its decision for every rank (invariant 4).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.events import MAX_EVENT_KEYS
from kvtierd.contract.replies import EventsReply, LoadReply, StoreReply

from .results import StoreDecision
from .session import Client

# What Client() takes for a rank alone; a coordinator accepts and ignores them (it copies nothing).
RANK_ONLY = frozenset({"copier", "pin", "populate_threads"})


class Coordinator(Client, role="coordinator"):
    """The coordinator session of engine ``engine_id`` (module docstring)."""

    mapping = populating = None              # it maps no region (a Rank's attributes, for code given either)

    def __init__(self, socket_path: str | None = None, *, engine_id: str, world_size: int, namespace: NamespaceId,
                 timeout: float = 10.0, reconnect_timeout: float = 30.0, engine_secret: bytes | str | None = None,
                 node_ranks: Iterable[int] | None = None, rank: None = None, **rank_only):
        if rank is not None:
            raise ValueError(f"a Coordinator has no rank (got {rank}); Client(rank=r) or Rank(...) is a rank")
        unknown = set(rank_only) - RANK_ONLY
        if unknown:
            raise TypeError(f"Coordinator() got unexpected keyword arguments {sorted(unknown)}")
        super().__init__(socket_path, engine_id=engine_id, rank=None, world_size=world_size, namespace=namespace,
                         timeout=timeout, reconnect_timeout=reconnect_timeout, engine_secret=engine_secret,
                         node_ranks=node_ranks)

    def open_store(self, job: int, keys: Sequence[bytes], chain: bool = True, cold_tail: int = 0) -> StoreDecision:
        """Fix a store job's decision; the ranks then ``store`` the same job. ``chain`` and
        ``cold_tail``: as for ``Rank.store``."""
        reply = StoreReply.from_wire(self._call("store", job=job, keys=list(keys),
                                                **self._store_hints(chain, cold_tail)))
        return StoreDecision([StoreOutcome(o) for o in reply.outcomes])

    def open_load(self, job: int, keys: Sequence[bytes], lease: int | None = None) -> int:
        """Pin the cached prefix of ``keys`` for a load job; returns its length. ``lease``: as
        for ``Rank.load``."""
        return LoadReply.from_wire(self._call("load", job=job, keys=list(keys), **self._consume(lease))).hits

    def events(self, epoch: int | None = None, cursor: int | None = None, snapshot_from: int | None = None,
               max_keys: int = MAX_EVENT_KEYS) -> EventsReply:
        """One read of the namespace's event log after ``cursor`` (``kvtier.events.EventView``
        keeps the fields and applies the reply: ``Coordinator.events(**view.request())``)."""
        return EventsReply.from_wire(self._call("events", epoch=epoch, cursor=cursor, snapshot_from=snapshot_from,
                                                max_keys=max_keys))

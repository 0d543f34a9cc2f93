"""The entries' lifecycle as the index tells it: one observer interface, a batch at a time.

The index (``kvtierd.index``) says when entries became READY and when entries leave it — before
they are freed, so that a listener can still read what the index knows of them — and why
(``Gone``). Whoever needs to follow entries subscribes to the index's ``Events`` instead of
being called from inside the index: the second tier's demote (what the tier holds, what an
eviction for room cost it) and the per-namespace log of KV events for routers (``kvtierd.eventlog``).

Calls are batch-shaped: a job's or an eviction's entries in one call, as an array of slots —
never a call per key (jobs carry thousands of keys, and the index's per-key work is what bounds
the daemon's keys/s). A listener that needs the keys reads them from the records (``Index.keys_of``,
``kvtierd.records``: the records are whole until the hook returns), or later from where it copied
them (the KV events log, ``kvtierd.keycopies``: an eviction's records are rewritten by the store
that needed the room within the same request); most never need them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .namespaces import Namespace


class Gone(str, enum.Enum):
    """Why entries left the index."""

    EVICTED = "evicted"                  # for room: a store or a promote needed their pages
    AHEAD = "ahead"                      # freed ahead of need by the second tier (it holds them, or its put failed)
    CLEARED = "cleared"                  # an operator's kvtierctl evict or clear
    RECLAIMED = "reclaimed"              # their namespace's table slot was taken over
    REGION_REPLACED = "region_replaced"  # the data file that held their bytes was replaced
    ABORTED = "aborted"                  # WRITING entries of a write that ended without them: never READY


class EntryEvents:
    """A listener of the index's entries; every hook does nothing unless overridden."""

    def ready(self, ns: "Namespace", slots: np.ndarray) -> None:
        """The entries of ``slots`` (all of ``ns``, in the write's key order) became READY."""

    def leaving(self, cause: Gone, slots: np.ndarray, namespaces: np.ndarray) -> None:
        """The entries of ``slots`` (with their namespaces' table slots) leave the index for
        ``cause``; they are freed when this returns."""


class Events(EntryEvents):
    """What the index tells, handed to every subscriber in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[EntryEvents] = []

    def subscribe(self, listener: EntryEvents) -> None:
        self._listeners.append(listener)

    def ready(self, ns: "Namespace", slots: np.ndarray) -> None:
        for listener in self._listeners:
            listener.ready(ns, slots)

    def leaving(self, cause: Gone, slots: np.ndarray, namespaces: np.ndarray) -> None:
        for listener in self._listeners:
            listener.leaving(cause, slots, namespaces)

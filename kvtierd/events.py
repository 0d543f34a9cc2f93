"""The entries' lifecycle as the index tells it: one observer interface, a batch at a time.

The index (``kvtierd.index``) says when entries became READY and when entries leave it — before
they are freed, so that a listener can still read what the index knows of them — and why
(``Gone``). Whoever needs to follow entries subscribes to the index's ``Events`` instead of
being called from inside the index: the second tier's demote (what the tier holds, what an
eviction for room cost it), and later a per-namespace log of KV events for routers.

Calls are batch-shaped: a job's or an eviction's entries in one call, as an array of slots —
never a call per key (jobs carry thousands of keys, and the index's per-key work is what bounds
the daemon's keys/s). A listener that needs the keys asks the index for them (``Index.keys_of``,
or ``Index.key_runs`` for one blob per key length: the records are whole until the hook
returns), or says it wants them and gets them gathered in a pass the index makes anyway: for
``ready`` (``wants_keys``) as the entries are sealed, for ``leaving`` (``wants_leaving_keys``)
as their states are checked; most never need them.
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

    def wants_keys(self, ns: "Namespace") -> bool:
        """Whether ``ready`` of ``ns``'s entries should come with their keys: the index gathers
        them in the pass that makes the entries READY, with each record in cache (the KV events
        log's, asked for every store job while the daemon publishes its stream)."""
        return False

    def ready(self, ns: "Namespace", slots: np.ndarray, keys: tuple[int, bytes, int] | None = None) -> None:
        """The entries of ``slots`` (all of ``ns``, in the write's key order) became READY.
        ``keys``: when a listener ``wants_keys`` of ``ns``, their keys as ``Index.key_run`` gives
        them (None when they are not of one length; ask the index)."""

    def wants_leaving_keys(self) -> bool:
        """Whether ``leaving`` should come with the entries' keys, gathered in the index's first
        pass over their records (which namespaces they are of is in those records): an eviction's
        entries are cold, and a pass of the listener's own waits on their memory again."""
        return False

    def leaving(self, cause: Gone, slots: np.ndarray, namespaces: np.ndarray,
                keys: tuple[int, bytes, int] | None = None) -> None:
        """The entries of ``slots`` (with their namespaces' table slots) leave the index for
        ``cause``; they are freed when this returns. ``keys``: when a listener
        ``wants_leaving_keys``, their keys as ``Index.key_run`` gives them, if the index gathered
        them (None: not gathered, or not of one length and namespace; ask the index)."""


class Events(EntryEvents):
    """What the index tells, handed to every subscriber in the order they subscribed."""

    def __init__(self) -> None:
        self._listeners: list[EntryEvents] = []

    def subscribe(self, listener: EntryEvents) -> None:
        self._listeners.append(listener)

    def wants_keys(self, ns: "Namespace") -> bool:
        for listener in self._listeners:
            if listener.wants_keys(ns):
                return True
        return False

    def ready(self, ns: "Namespace", slots: np.ndarray, keys: tuple[int, bytes, int] | None = None) -> None:
        for listener in self._listeners:
            listener.ready(ns, slots, keys)

    def wants_leaving_keys(self) -> bool:
        for listener in self._listeners:
            if listener.wants_leaving_keys():
                return True
        return False

    def leaving(self, cause: Gone, slots: np.ndarray, namespaces: np.ndarray,
                keys: tuple[int, bytes, int] | None = None) -> None:
        for listener in self._listeners:
            listener.leaving(cause, slots, namespaces, keys)

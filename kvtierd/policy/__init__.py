"""Eviction policies: the interface the index drives, and the registry of policies by name.

A policy only chooses; the index frees. It tracks the *evictable* entries — READY and not pinned
by a load (later: nor leased) — named by their entry-table slot, and hears of every change to
that set through hooks named after what happened to the entries:

``inserted(slots, chain)``   the entries became READY (a store job's last vote), in the store
                             request's key order; ``chain``: those keys are one request's prefix
                             chain, each extending the one before
``accessed(slots)``          looked up, loaded or stored again (slots not in the set are ignored)
``pinned(slots)``            left the evictable set (a load pinned them)
``unpinned(slots)``          re-entered it (their last pin was released)
``removed(slots)``           freed (evicted, cleared, aborted); slots not in the set are ignored
``recovered(slots)``         the set after a restart, least recently used first (from the ticks)
``victims(exclude)``         the evictable slots not in ``exclude``, best victim first; choosing
                             removes nothing: the index frees the victims it takes, then calls
                             ``removed``

WRITING and pinned entries are never in the set, so they can never be chosen (invariant 2)
without any check at eviction time. Hooks take a whole job's slots at once: the daemon's cost per
request is mostly per-key work, which a policy should do in C-level passes, not a Python loop.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Iterable, Iterator


class Policy(ABC):
    @abstractmethod
    def __len__(self) -> int:
        """How many entries are evictable."""

    @abstractmethod
    def __contains__(self, slot: int) -> bool:
        """Whether the entry is evictable."""

    @abstractmethod
    def inserted(self, slots: list[int], chain: bool = False) -> None: ...

    @abstractmethod
    def accessed(self, slots: list[int]) -> None: ...

    @abstractmethod
    def pinned(self, slots: list[int]) -> None: ...

    @abstractmethod
    def unpinned(self, slots: list[int]) -> None: ...

    @abstractmethod
    def removed(self, slots: list[int]) -> None: ...

    @abstractmethod
    def recovered(self, slots_oldest_first: Iterable[int]) -> None: ...

    @abstractmethod
    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]: ...


# name → "module:class" below this package; a policy's module is imported when it is chosen.
POLICIES: dict[str, str] = {"lru": "lru:LRUPolicy"}


def create(name: str = "lru") -> Policy:
    """A new, empty policy of the given name."""
    try:
        module, cls = POLICIES[name].split(":")
    except KeyError:
        raise ValueError(f"no eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()

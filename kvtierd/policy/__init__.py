"""Eviction policies: the interface the index drives, and the registry of policies by name.

A policy only chooses; the index frees. It tracks the *evictable* entries — READY and not pinned
by a load (later: nor leased) — named by their entry-table slot, and hears of every change to
that set through hooks named after what happened to the entries:

``inserted(slots, keys, chain, cold)``  the entries became READY (a store job's last vote), in
                             the store request's key order. ``keys`` are their keys, same order: a
                             policy that remembers keys it no longer holds (a frequency sketch)
                             needs them, since slots are reused. ``chain``: those keys are one
                             request's prefix chain, each extending the one before (how vLLM and
                             SGLang send a request's blocks), so a later one is worth nothing
                             without the earlier ones; a client whose jobs are not chains says so
                             on the wire. ``cold``: the client expects no reuse of the last
                             ``cold`` of them (the store request's ``cold_tail``); a policy may
                             place them first in line for eviction (it counts them refused)
``accessed(slots)``          looked up, loaded or stored again (slots not in the set are ignored)
``pinned(slots)``            left the evictable set (a load's first pin)
``unpinned(slots)``          re-entered it (its last pin was released)
``removed(slots)``           freed (evicted, cleared, aborted); slots not in the set are ignored
``recovered(slots, keys)``   the set after a restart, least recently used first (from the ticks)
``victims(exclude)``         the evictable slots not in ``exclude``, best victim first; choosing
                             removes nothing: the index frees the victims it takes, then calls
                             ``removed``. A policy may reorganise itself while walking, never drop
                             an entry
``stats()``                  what the policy counts (``PolicyStats``): keys admitted and refused,
                             entries and evictions per segment, its own extras

WRITING and pinned entries are never in the set, so they can never be chosen (invariant 2)
without any check at eviction time. Hooks take a whole job's slots at once: the daemon's cost per
request is mostly per-key work, which a policy should do in C-level passes, not a Python loop.

A policy never knows the region's capacity: segment sizes follow what it tracks (evictable and
pinned entries), which is the capacity whenever eviction happens. docs/policy.md tells how the
default was chosen; docs/operations.md how to choose one (setting ``policy``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator, Sequence, TypedDict

Slots = Sequence[int]


class PolicyStats(TypedDict):
    """``Policy.stats()``: monotonic counters and the segments' sizes now."""

    admitted: int             # stored keys that entered as any other (counted at ``inserted``)
    refused: int              # stored keys placed first in line for eviction instead
    segments: dict            # segment -> evictable entries in it now
    evicted: dict             # segment -> entries freed from it (``removed``) since the start
    extra: dict               # the policy's own counters (promotions, sketch bytes, ...)


class Policy(ABC):
    name: ClassVar[str] = ""
    # Its segments (the label values of the per-segment metrics), in the order victims come from.
    segments: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def __len__(self) -> int:
        """How many entries are evictable."""

    @abstractmethod
    def __contains__(self, slot: int) -> bool:
        """Whether the entry is evictable."""

    @abstractmethod
    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True, cold: int = 0) -> None: ...

    @abstractmethod
    def accessed(self, slots: Slots) -> None: ...

    @abstractmethod
    def pinned(self, slots: Slots) -> None: ...

    @abstractmethod
    def unpinned(self, slots: Slots) -> None: ...

    @abstractmethod
    def removed(self, slots: Slots) -> None: ...

    @abstractmethod
    def recovered(self, slots_oldest_first: Slots, keys: Sequence[bytes]) -> None: ...

    @abstractmethod
    def victims(self, exclude: "set[int] | frozenset[int]" = frozenset()) -> Iterator[int]: ...

    @abstractmethod
    def stats(self) -> PolicyStats: ...


# name → "module:class" below this package; a policy's module is imported when it is chosen.
POLICIES: dict[str, str] = {"lru": "lru:LRUPolicy", "slru": "slru:SLRUPolicy", "s3fifo": "s3fifo:S3FIFOPolicy",
                            "tinylfu": "tinylfu:TinyLFUPolicy"}

DEFAULT = "slru"        # chosen by replaying traces through the daemon against LRU and Belady: docs/policy.md


def policy_class(name: str) -> type[Policy]:
    """The class of the policy of the given name (its ``segments`` are a class attribute)."""
    try:
        module, cls = POLICIES[name].split(":")
    except KeyError:
        raise ValueError(f"no eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def reference(name: str = DEFAULT) -> Policy:
    """A new, empty policy of the given name, in Python: the reference the compiled policies are
    checked against victim for victim (tests/unit/test_native_policy.py), and what the in-process
    trace replays of kvtierbench run."""
    return policy_class(name)()

"""The eviction policy interface: event-named hooks, and the registry of policies by name.

A policy only *chooses*; the index frees. It tracks the *evictable* entries (READY and not pinned)
by their entry-table slot, hears about every change to that set through the hooks below, and
answers ``victims(exclude)``: an iterator of evictable slots, best victim first. The index takes
as many as it needs, frees them and then reports them through ``removed``. Choosing removes
nothing, so WRITING, pinned or never-inserted entries can never come out of ``victims``.

Hooks (each takes a whole job's slots at once; the daemon's per-key cost is mostly work like
this, so implementations use C-level passes over the list, not a Python loop per key):

- ``inserted(slots, keys, chain=True)``: the entries became READY (a store job's new entries),
  in the store request's key order. ``keys`` are their keys (same order): a policy that remembers
  keys it no longer holds (a ghost list, a frequency sketch) needs them, since slots are reused.
  ``chain=True`` says the keys form a prefix chain (each extends the one before it — how vLLM and
  SGLang send a request's blocks), so the later ones are worth nothing without the earlier ones.
- ``accessed(slots)``: READY entries looked up, loaded or stored again; pinned ones are ignored.
- ``pinned(slots)`` / ``unpinned(slots)``: left / re-entered the evictable set (a load's first pin
  / its last release). A policy keeps what it knows about a pinned entry; it never chooses it.
- ``removed(slots)``: freed (evicted, cleared, aborted); slots it does not hold are ignored.
- ``recovered(slots_oldest_first, keys)``: bulk rebuild after a restart, least recently used first.
- ``victims(exclude)``: evictable slots not in ``exclude``, best victim first. A policy may
  reorganise itself while walking (promote an entry it passes over), never drop an entry; the
  caller frees what it took before or after it drops the iterator.
- ``stats()``: the policy's own counters (admitted/refused, promotions, entries per segment).

A policy never knows the region's capacity; segment sizes follow what it tracks (evictable and
pinned entries), which is the capacity whenever eviction happens. docs/policy.md: how the default
was chosen.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterator, Sequence

Slots = Sequence[int]

DEFAULT = "slru"        # chosen by replaying traces against LRU and Belady: docs/policy.md


class Policy(ABC):
    name: str = ""

    @abstractmethod
    def inserted(self, slots: Slots, keys: Sequence[bytes], chain: bool = True) -> None: ...

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
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, slot: int) -> bool: ...

    def stats(self) -> dict[str, int]:
        return {}


def policies() -> dict[str, Callable[[], Policy]]:
    """Every policy by name (imported here, not at the top: each module imports this one)."""
    from .lru import LRUPolicy
    from .s3fifo import S3FIFOPolicy
    from .slru import SLRUPolicy
    from .tinylfu import TinyLFUPolicy
    return {cls.name: cls for cls in (LRUPolicy, SLRUPolicy, S3FIFOPolicy, TinyLFUPolicy)}


def make(name: str) -> Policy:
    known = policies()
    if name not in known:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(known))}")
    return known[name]()

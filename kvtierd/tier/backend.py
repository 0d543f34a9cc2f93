"""The second-tier backend interface: what every engine (Mooncake Store, Valkey/Redis Cluster)
implements, its typed errors, and how a block's bytes are described.

A backend moves whole blocks between the engine and one *registered* memory (the region's data
area, mapped by the companion process): ``attach(memory)`` once, then every put and get names its
blocks as **extents** — (offset into that memory, bytes) runs, one per contiguous run of the
block's pages — so an engine that can read and write registered memory directly (Mooncake's
``register_buffer`` + multi-buffer put/get, a socket's gather-write and ``recv_into``) never
copies a block through a staging buffer.

Calls are batched and their outcome is per key: ``put`` and ``get`` return one bool per key
(``get`` is True only when the whole block arrived with exactly its length). A failure of the
engine as a whole raises a ``TierError`` subclass: ``TierUnavailable`` (unreachable, down,
refusing), ``TierTimeout`` (a call ran past its deadline), ``TierRejected`` (the engine refused
the request as given: a value larger than it allows, bad parameters — the engine itself is
fine), ``TierFailed`` (anything else the client library raised). Backends keep each network wait
bounded by their ``timeout``; ``guard.Guard`` adds the deadline of the whole call and the
circuit breaker on top.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

Extent = tuple[int, int]            # (offset into the attached memory, bytes)
Block = Sequence[Extent]


class TierError(Exception):
    """The second tier did not serve a call. ``code`` is the metric label and the wire name."""

    code = "failed"


class TierUnavailable(TierError):
    code = "unavailable"


class CircuitOpen(TierUnavailable):
    """Refused without calling the engine: the breaker is open after repeated failures."""

    code = "circuit_open"


class TierTimeout(TierError):
    code = "timeout"


class TierRejected(TierError):
    code = "rejected"


class TierFailed(TierError):
    code = "failed"


ERRORS: dict[str, type[TierError]] = {
    cls.code: cls for cls in (TierUnavailable, CircuitOpen, TierTimeout, TierRejected, TierFailed)}


def error_from(code: str, message: str) -> TierError:
    """The typed exception for a code received on the companion link."""
    return ERRORS.get(code, TierFailed)(message)


class Backend(ABC):
    """One client of a second-tier engine. Not thread-safe: ``guard.Guard`` runs every call on
    its one worker thread."""

    name: str = ""

    @abstractmethod
    def attach(self, memory: memoryview) -> None:
        """Register ``memory`` (writable, contiguous, mapped for the backend's life): the extents of
        every later put and get are offsets into it."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the engine holds each key (one round trip per engine node, not per key)."""

    @abstractmethod
    def put(self, keys: list[str], blocks: Sequence[Block]) -> list[bool]:
        """Store each key's block from its extents. True: the engine holds the key (written now, or
        already there — blocks are immutable, so an existing value is the same block)."""

    @abstractmethod
    def get(self, keys: list[str], blocks: Sequence[Block]) -> list[bool]:
        """Fetch each key's block into its extents. True only when the engine had the key and its
        value has exactly the extents' total length; on False the extents' bytes are undefined."""

    @abstractmethod
    def remove(self, keys: list[str]) -> int:
        """Remove the keys; returns how many the engine held."""

    @abstractmethod
    def clear(self, prefix: str) -> int:
        """Remove every key that starts with ``prefix`` (a namespace's keyspace); returns how many."""

    @abstractmethod
    def health(self) -> None:
        """Return when the engine serves, raise ``TierUnavailable`` when it does not."""

    @abstractmethod
    def info(self) -> dict:
        """What ``kvtierctl status`` shows: engine, version, addresses, zero-copy or not."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine's resources (connections, registration). Idempotent."""


BACKENDS = {"mooncake": "kvtierd.tier.mooncake:MooncakeBackend",
            "redis": "kvtierd.tier.redis:RedisClusterBackend"}


def open_backend(name: str, **settings) -> Backend:
    """Import and construct the backend called ``name`` (its engine client is imported only here)."""
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown tier backend {name!r}; choose from {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)(**settings)


def page_extents(pages: np.ndarray, page_size: int, length: int, base: int = 0) -> list[list[Extent]]:
    """Extents of blocks stored in fixed pages: ``pages`` is [blocks, pages_per_block] page indices,
    ``length`` each block's bytes (its last page may be partly used), ``base`` the offset of page 0
    in the attached memory. Adjacent pages merge into one extent, so a block whose pages are
    contiguous (the allocator hands out freed pages in order) is a single extent."""
    pages = np.asarray(pages, dtype=np.int64)
    n, per = pages.shape
    if per * page_size < length or (per - 1) * page_size >= length:
        raise ValueError(f"{per} pages of {page_size} bytes do not hold blocks of {length} bytes")
    # A run starts at page 0 of a block and wherever a page does not follow the one before it.
    starts = np.ones((n, per), dtype=bool)
    starts[:, 1:] = pages[:, 1:] != pages[:, :-1] + 1
    offsets = base + pages * page_size
    # Blocks of one run each (the common case): built for all at once (a loop per block cost
    # ~10 us each, 2.5-4.6 ms for a batch of 256).
    out = [[(offset, length)] for offset in offsets[:, 0].tolist()]
    split = np.flatnonzero(starts[:, 1:].any(axis=1))
    if len(split):
        sizes = np.full((len(split), per), page_size, dtype=np.int64)
        sizes[:, -1] = length - (per - 1) * page_size
        # Run lengths: the bytes from each run start up to the next run start (or the block's end).
        ends = np.cumsum(sizes, axis=1)
        for i, row_ends in zip(split.tolist(), ends):
            idx = np.flatnonzero(starts[i])
            stop = np.append(row_ends[idx[1:] - 1], row_ends[-1])
            begin = np.append(0, row_ends[idx[1:] - 1])
            out[i] = list(zip(offsets[i, idx].tolist(), (stop - begin).tolist()))
    return out

"""The second-tier backend interface: what every engine (Mooncake Store, Valkey/Redis Cluster,
the node's own disk) implements, its typed errors, and how a block's bytes are described.

A backend moves whole blocks between the engine and one *registered* memory (the region's data
area, mapped by the companion process): ``attach(memory, owner)`` once, then every put and get
names its blocks as **extents** — (offset into that memory, bytes) runs, one per contiguous run
of the block's pages — so an engine that can read and write registered memory directly
(Mooncake's ``register_buffer`` + multi-buffer put/get, a socket's gather-write and
``recv_into``, ``O_DIRECT`` reads and writes) never copies a block through a staging buffer.

Every value carries its *seal* (``seal.Seals``: ``SEAL_BYTES`` that bind the block's bytes to
its namespace and key under the fleet's key): ``put`` stores ``seals.make(i)`` with block ``i``,
``get`` hands the stored seal to ``seals.check(i, seal)`` once the bytes landed and reports the
block only when the check passed. Where a backend keeps the seal is its own business (Redis and
Mooncake: the value's last 32 bytes; the disk: the block's record). The disk tier, inside the
node, stores checksum seals instead (``seals.sums``, checked by ``seals.check_sums``: ``seal``
says why a MAC adds nothing there); a remote backend never does.

Calls are batched and their outcome is per key: ``put`` and ``get`` return one bool per key
(``get`` is True only when the whole block arrived with exactly its length and its seal held). A
failure of the engine as a whole raises a ``TierError`` subclass: ``TierUnavailable``
(unreachable, down, refusing), ``TierTimeout`` (a call ran past its deadline), ``TierRejected``
(the engine refused the request as given, or cannot take writes now — a value larger than it
allows, a full or read-only disk: the engine itself serves, so the breaker is not moved),
``TierFailed`` (anything else the client library raised). Backends keep each network wait
bounded by their ``timeout``; ``guard.Guard`` adds the deadline of the whole call and the
circuit breaker on top.

Each backend's constructor takes ``address`` (``tier_address``: where the engine is) and its own
settings as keywords (``tier_settings``); ``check_settings`` refuses a key none of them takes
before anything starts.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .seal import Seals

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


@dataclass(frozen=True)
class Owner:
    """Who attaches a backend: the daemon's name (``name`` setting) and the id of the key that
    seals its values (``seal.SealKey.id_hex``). A backend whose data outlives the companion (the
    disk) refuses data that another owner wrote."""

    name: str
    key_id: str


class Backend(ABC):
    """One client of a second-tier engine. Not thread-safe: ``guard.Guard`` runs every call on
    its one worker thread."""

    name: str = ""

    @abstractmethod
    def attach(self, memory: memoryview, owner: Owner) -> None:
        """Register ``memory`` (writable, contiguous, mapped for the backend's life): the extents of
        every later put and get are offsets into it."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the engine holds each key (one round trip per engine node, not per key)."""

    @abstractmethod
    def put(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        """Store each key's block from its extents with its seal (``seals.make(i)``). True: the
        engine holds the key (written now, or already there — blocks are immutable, so an existing
        value is the same block)."""

    @abstractmethod
    def get(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        """Fetch each key's block into its extents. True only when the engine had the key, its
        value has exactly the extents' total length and ``seals.check(i, seal)`` passed; on False
        the extents' bytes are undefined."""

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
            "redis": "kvtierd.tier.redis:RedisClusterBackend",
            "disk": "kvtierd.tier.disk:DiskBackend"}


def backend_class(name: str) -> type[Backend]:
    """The class of the backend called ``name``; importing it imports no engine client (each
    imports its own when constructed)."""
    try:
        module, cls = BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown tier backend {name!r}; choose from {', '.join(BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)


def check_settings(name: str, settings: dict) -> None:
    """Refuse settings the backend does not take (a typo such as ``ttl`` for ``ttl_s`` would
    otherwise start a companion that fails, or silently ignore it): ValueError names the key and
    the valid ones. ``address`` comes from ``tier_address``, not from here."""
    params = inspect.signature(backend_class(name)).parameters
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = [p for p, param in params.items() if p != "address" and param.kind in keyword]
    if "address" in settings:
        raise ValueError(f"tier_settings: set the {name} backend's address with tier_address, not in tier_settings")
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"tier_settings: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"for the {name} backend; its keys are {', '.join(valid)}")


def open_backend(name: str, address: str, **settings) -> Backend:
    """Construct the backend called ``name`` for the engine at ``address``."""
    return backend_class(name)(address, **settings)


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

"""The second tier as the store and the server see it: a small, non-blocking interface, and the
null object that stands for "no second tier" (so that nothing asks whether there is one).

Every call returns at once: the tier's own work happens in ``pump``, which the server's loop
calls at every wake-up and at least as often as ``pump`` asked. A tier is built by a factory at
the store's construction (``TierFactory``: the index, the fenced writes and the index's events
are what it works with), and started once the daemon is wired (``start``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from ..events import Events
from ..index import Index
from ..namespaces import Namespace
from ..writes import Writes

Reply = Callable[[str, "int | None"], None]      # (how a clear went: excluded | failed | removed | off, blocks)


@dataclass(frozen=True)
class TierConfig:
    """What the daemon does with its tier (the ``tier_*`` settings)."""

    backend: str
    address: str
    demote: bool = True
    promote: bool = True
    low_watermark: float = 0.05
    exclude: frozenset = frozenset()      # model names
    cooldown: float = 5.0

    def serves(self, ns: Namespace) -> bool:
        """Whether the namespace's blocks go to and come from the tier at all (``tier_exclude``)."""
        return ns.id.model not in self.exclude


class Tier(ABC):
    """A second tier behind the region."""

    # What an operator's local eviction says of the tier (``EvictReply.tier``): "local", the tier
    # keeps its copies; "off", there is none.
    local_evict: str = "local"

    @abstractmethod
    def start(self) -> None:
        """Begin (the daemon is wired and about to serve)."""

    @abstractmethod
    def sockets(self) -> list:
        """What the server's poller watches for it (its replies wake the loop)."""

    @abstractmethod
    def pending(self, ns: Namespace, keys: list[bytes], hits: int) -> int:
        """How many keys after the ``hits`` local ones are being promoted from the tier (or
        checked in it: a check for those nobody asked about yet is promised here). Never waits."""

    @abstractmethod
    def pump(self, now: float) -> float:
        """The tier's turn on the loop: apply what came back, go on with its work. Returns the
        seconds until it wants its next turn at the latest (``math.inf``: none needed)."""

    @abstractmethod
    def clear(self, namespaces: list[Namespace], reply: Reply) -> None:
        """Remove these namespaces' blocks from the tier; ``reply(how, removed)`` says how it went
        (now, or once the tier answered)."""

    @abstractmethod
    def data_replaced(self) -> None:
        """The region's data file is being replaced: whatever touches its pages for the tier ends."""

    @abstractmethod
    def stats(self) -> dict:
        """``StatsReply.tier``."""

    @abstractmethod
    def close(self) -> None:
        """Stop (the daemon stops): every page handed to the tier comes back."""


class NoTier(Tier):
    """No second tier: nothing pending, nothing to pump, clears answered "off"."""

    local_evict = "off"

    def start(self) -> None:
        pass

    def sockets(self) -> list:
        return []

    def pending(self, ns: Namespace, keys: list[bytes], hits: int) -> int:
        return 0

    def pump(self, now: float) -> float:
        return math.inf

    def clear(self, namespaces: list[Namespace], reply: Reply) -> None:
        reply("off", None)

    def data_replaced(self) -> None:
        pass

    def stats(self) -> dict:
        return {"backend": "off"}

    def close(self) -> None:
        pass


# Builds a store's tier from what it works with: (index, writes, the index's events, clock) → Tier.
TierFactory = Callable[[Index, Writes, Events, Callable[[], float]], Tier]


def no_tier(index: Index, writes: Writes, events: Events, clock: Callable[[], float]) -> Tier:
    """The factory of a store without a second tier."""
    return NoTier()

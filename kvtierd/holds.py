"""Who may still read a READY entry's pages, per entry slot: the holds that keep it from eviction.

Two kinds of hold, each a count per slot (NumPy arrays, so that a job's or a lease's thousands of
entries are held in a few passes):

- a *pin*: someone copies out of the entry's pages now — an engine's load job (until every rank
  released it) or the second tier's put (a demote, until its final outcome);
- a *lease*: a lookup promised the entry to an engine (``kvtierd.leases``, invariant 10).

An entry held by either kind is out of the eviction policy's set; it leaves the set when the first
hold of either kind comes and re-enters it when the last one goes (the policy's ``pinned`` and
``unpinned`` hooks). WRITING entries are their write's (``kvtierd.writes``), never held.

``held`` is the question every path that frees entries asks (``Index._free``): nothing may free a
page that a reader may still touch (invariant 12).
"""

from __future__ import annotations

import numpy as np

from .policy import Policy


class Holds:
    def __init__(self, slots: int, policy: Policy):
        self.policy = policy
        self.pins = np.zeros(slots, np.uint32)
        self.leases = np.zeros(slots, np.uint32)
        self.pinned = 0           # slots with at least one pin
        self.leased = 0           # slots with at least one lease

    def pin(self, slots: np.ndarray) -> None:
        self.pinned += self._hold(self.pins, self.leases, slots)

    def unpin(self, slots: np.ndarray) -> None:
        self.pinned -= self._let_go(self.pins, self.leases, slots)

    def lease(self, slots: np.ndarray) -> None:
        self.leased += self._hold(self.leases, self.pins, slots)

    def unlease(self, slots: np.ndarray) -> None:
        self.leased -= self._let_go(self.leases, self.pins, slots)

    def _hold(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One more hold of one kind (``mine``, beside the ``other`` kind) on each slot: those
        held by nothing before leave the policy. Returns how many had no hold of this kind."""
        before = mine[slots]
        mine[slots] = before + 1
        fresh = slots[before == 0]
        self.policy.pinned(fresh[other[fresh] == 0].tolist())
        return len(fresh)

    def _let_go(self, mine: np.ndarray, other: np.ndarray, slots: np.ndarray) -> int:
        """One hold of this kind less on each slot: those held by nothing now re-enter the policy.
        Returns how many have no hold of this kind left."""
        after = mine[slots] - 1
        mine[slots] = after
        gone = slots[after == 0]
        self.policy.unpinned(gone[other[gone] == 0].tolist())
        return len(gone)

    def held(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: whether anything holds it."""
        return (self.pins[slots] != 0) | (self.leases[slots] != 0)

    def of(self, slot: int) -> tuple[int, int]:
        """(pins, leases) holding the entry of ``slot``."""
        return int(self.pins[slot]), int(self.leases[slot])

    def verify(self, free_slots: np.ndarray) -> None:
        """The counts against the arrays, and no free slot held (tests, ``Index.verify``)."""
        assert not self.held(free_slots).any(), "a free slot is held"
        assert self.pinned == int(np.count_nonzero(self.pins))
        assert self.leased == int(np.count_nonzero(self.leases))

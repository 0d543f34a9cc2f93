"""Demote: the blocks the node is about to evict go to the second tier before their pages are
reused; and what this node knows the tier holds (``Copies``).

The index keeps a free-page reserve (``low_watermark`` of the pages): when free pages (plus those
being demoted) fall below it, the eviction policy's first victims (``Index.victims``) are taken
— a victim the tier already holds is freed at once (unless it was promoted and no engine has
used it yet: the engine that asked for it is about to); any other, unless its namespace is
excluded, gets a *demote pin* (``Index.pin(access=False)``: READY and loadable, out of the
policy, so no store takes its pages, and nothing frees it: invariant 12) and goes into a ``put``
with its page chain. On the put's final outcome the pin drops; a block the tier took is known
to be in it (never sent again) and, if nobody used it since (its access tick did not move),
freed ahead of need (``Index.free_ahead``). A block whose put failed is freed just the same
(dropped, counted ``failed``), and after a failed call demotes pause for ``cooldown`` seconds.
Demotes never hold more than half of ``max_inflight``.

Nothing waits: a store that needs pages now evicts the policy's victims that are not
demote-pinned; ``Demotes`` hears of it through the index's events (``leaving``, cause
``evicted``) and counts those the tier does not hold as dropped, by why (``down``, ``failed``,
``busy``, ``pressure``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..events import EntryEvents, Gone
from ..index import NO_SLOTS, Index
from ..namespaces import Namespace
from ..tier.link import LinkBusy, LinkDown, Outcome
from .companion import Companion
from .interface import TierConfig

DEMOTE_BATCH = 256            # blocks per put
LOOK_LIMIT = 4096             # victims a demote pass looks at (excluded namespaces are skipped)
DEMOTE_SHARE = 0.5            # of max_inflight: the rest stays free for lookups' checks and promotes


class Copies:
    """What this node knows the tier holds, per entry slot (not kept across restarts), and which
    promoted blocks no engine has used yet (they are not freed ahead of need)."""

    def __init__(self, slots: int):
        self.held = np.zeros(slots, bool)
        self.fresh: dict[int, int] = {}          # slot → its tick when promoted

    def promoted(self, slots: list[int], ticks: list[int]) -> None:
        self.held[slots] = True
        self.fresh.update(zip(slots, ticks))

    def forget(self, slots: np.ndarray) -> np.ndarray:
        """The entries of ``slots`` leave: returns which of them the tier held."""
        if self.fresh:
            for slot in slots.tolist():
                self.fresh.pop(slot, None)
        held = self.held[slots]
        self.held[slots] = False
        return held


@dataclass(eq=False)
class Put:
    """The context of a demote's put."""

    ns: Namespace
    slots: np.ndarray
    ticks: np.ndarray
    started: float
    timed_out: bool = False


class Demotes(EntryEvents):
    def __init__(self, index: Index, companion: Companion, config: TierConfig, copies: Copies,
                 clock: Callable[[], float]):
        self.index = index
        self.companion = companion
        self.config = config
        self.copies = copies
        self.clock = clock
        self.pages = 0                          # being demoted
        self.blocks = 0
        self.off_until = 0.0                     # paused after a failed put
        self.counters: Counter = Counter()
        self.dropped: Counter = Counter()        # reason → blocks evicted that the tier does not hold

    def ahead(self, now: float) -> None:
        """Keep ``low_watermark`` of the pages free: demote the policy's first victims (or free
        those the tier holds)."""
        if not self.config.demote or now < self.off_until or not self.companion.ready:
            return
        index = self.index
        short = math.ceil(self.config.low_watermark * index.total_pages) - index.free_pages - self.pages
        if short <= 0:
            return
        batches = int(self.companion.link.max_inflight * DEMOTE_SHARE) - self.companion.inflight(Put)
        if batches <= 0:
            return
        free_now, chosen = [], {}
        room, fresh, held = batches * DEMOTE_BATCH, self.copies.fresh, self.copies.held
        looked = 0
        for slot, ns_slot in self._candidates(short):
            looked += 1
            if slot in fresh:
                if index.ticks_of(slot) == fresh[slot]:
                    continue                    # promoted for an engine that has not come back yet
                del fresh[slot]
            ns = index.namespace_at(ns_slot)
            if held[slot]:
                free_now.append(slot)
            elif self.config.serves(ns):
                chosen.setdefault(ns, []).append(slot)
                room -= 1
            else:
                continue
            short -= ns.entry_pages
            if short <= 0 or room <= 0 or looked >= LOOK_LIMIT:
                break
        index.free_ahead(np.array(free_now, np.int32))
        for ns, slots in chosen.items():
            for i in range(0, len(slots), DEMOTE_BATCH):
                if not self._put(ns, np.array(slots[i:i + DEMOTE_BATCH], np.int32), now):
                    return

    def _candidates(self, short: int) -> Iterator[tuple[int, int]]:
        """(slot, namespace slot) of the policy's victims, best first, asked for ``short`` pages
        at a time (a walk moves the policy's lists as far as it goes: no further than needed)."""
        index, seen = self.index, NO_SLOTS
        while len(seen) < LOOK_LIMIT:
            batch = index.victims(max(short, 1), seen)
            if not len(batch):
                return
            yield from zip(batch.tolist(), index.namespaces_of(batch).tolist())
            seen = np.concatenate([seen, batch])

    def _put(self, ns: Namespace, slots: np.ndarray, now: float) -> bool:
        ctx = Put(ns, slots, self.index.ticks_of(slots), now)
        try:
            self.companion.submit("put", ctx, **self.companion.fields(ns, slots))
        except (LinkBusy, LinkDown):
            return False                       # they stay; if a store takes their pages, counted
        self.index.pin(slots, access=False)    # READY and loadable; no store takes their pages
        self.pages += len(slots) * ns.entry_pages
        self.blocks += len(slots)
        return True

    def done(self, ctx: Put, o: Outcome, now: float) -> None:
        """A put's outcome (past its deadline: its pages stay pinned until its final one)."""
        if not o.final:
            return
        slots, ns = ctx.slots, ctx.ns
        self.index.unpin(slots)
        self.pages -= len(slots) * ns.entry_pages
        self.blocks -= len(slots)
        done = o.result.get("done", b"") if o.ok else b""
        done = done if len(done) == len(slots) else bytes(len(slots))
        if not o.ok:
            self.off_until = now + self.config.cooldown
        took = np.frombuffer(done, np.uint8) != 0
        untouched = self.index.ticks_of(slots) == ctx.ticks
        self.copies.held[slots[took]] = True
        self.counters["demoted_blocks"] += int(took.sum())
        self.counters["demoted_bytes"] += int(took.sum()) * ns.id.entry_bytes
        self.index.free_ahead(slots[untouched & took])
        self.dropped["failed"] += self.index.free_ahead(slots[untouched & ~took])

    def leaving(self, cause: Gone, slots: np.ndarray, namespaces: np.ndarray) -> None:
        """Entries leave the index (``kvtierd.events``): forget what was known of them; count
        those a store's room took that the tier does not hold, by why the tier did not get them."""
        held = self.copies.forget(slots)
        if cause is not Gone.EVICTED or not self.config.demote:
            return
        lost = sum(int(count) for ns_slot, count in zip(*np.unique(namespaces[~held], return_counts=True))
                   if self.config.serves(self.index.namespace_at(int(ns_slot))))
        if not lost:
            return
        if not self.companion.ready:
            reason = "down"
        elif self.clock() < self.off_until:
            reason = "failed"
        elif self.companion.room() <= 0:
            reason = "busy"
        else:
            reason = "pressure"
        self.dropped[reason] += lost

    def stats(self) -> dict:
        c = self.counters
        return {"demoted_blocks": c["demoted_blocks"], "demoted_bytes": c["demoted_bytes"],
                "demoting_blocks": self.blocks,
                "demote_dropped_blocks": {r: self.dropped[r] for r in ("busy", "down", "failed", "pressure")}}

"""The fenced write (invariants 1, 9 and 12): the one lifecycle by which any writer of region pages
— an engine's rank storing a job, the tier companion promoting blocks, any later writer — is given
pages, and by which those pages come back. No other code hands, settles, parks or releases a page.

A ``Write`` is one job's WRITING entries (one namespace; their slots), and the writers it handed
their pages:

    begin(kind, id, ns, keys)   the decision (``Index.place``): per key PRESENT, WRITE (a new WRITING
                                entry with pages) or NO_SPACE
    hand(write, key, writer)    the pages ``writer`` copies into, fenced for it (``Fence.hand``)
                                before anyone names them to it
    settle(write, key)          that writer says its copy is over, whatever became of it (a rank's
                                commit; the final outcome of the companion's get): its fence is
                                cleared — or, if the write was aborted meanwhile (a *late final*),
                                the pages parked for it come back
    complete(write, landed)     the write is done (every vote in): the entries that landed become
                                READY (READY last: invariant 1), the others go with their pages
    abort(write)                the write ends without its entries (failed vote, conflict, timeout,
                                a rank or the engine gone, the tier's deadline or its companion's
                                death): they go at once; the pages of every writer handed them and
                                not settled stay fenced, parked under that writer (``Fence.park``),
                                until it settles after all or the fence proves it cannot write
    drop_writer(write, key)     that writer's session ended: no late final will come; what is
                                parked under it is the fence's to release (its proofs)

The fence's proofs release parked pages through here too (``writer_ended``, ``reattached``,
``died``, ``expire``, ``reset``), so every page a writer held returns to the index in one place.
Readers (a load's pin, a demote's put, a lease) hold READY entries in ``kvtierd.holds``; the
index frees no entry a write or a reader may still touch (``Index._free``).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import numpy as np

from .contract.codes import StoreOutcome
from .contract.protocol import PAGES_DTYPE
from .contract.region_format import EntryState
from .index import NO_SLOTS, Index
from .fence import Fence, Release, Writer
from .namespaces import Namespace
from .processes import Process


class WriterKind(str, enum.Enum):
    """Who writes a write's pages."""

    RANK = "rank"       # a rank of an engine: its shard (the node's lowest rank: the whole entry when replicated)
    TIER = "tier"       # the tier companion: whole entries, every shard


@dataclass(eq=False)
class Write:
    kind: WriterKind
    id: int                 # what the fence parks pages under, per writer (a job id; a promote's id)
    ns: Namespace
    slots: np.ndarray = field(default_factory=lambda: NO_SLOTS)   # its WRITING entries, in key order
    # key (a rank; 0 for the companion) → (the writer, the pages it was handed, its shard's place in
    # the entry: None for every shard): writers handed pages that have not settled. An aborted
    # write keeps them until they settle (late) or are dropped, so that their late final is
    # recognised.
    handed: dict = field(default_factory=dict)
    open: bool = True
    tag: int = 0            # its key among the open writes (0: it wrote nothing)


class Writes:
    def __init__(self, index: Index, fence: Fence):
        self.index = index
        self.fence = fence
        self._open: dict[int, Write] = {}
        self._tags = itertools.count(1)
        # Per entry slot, the tag of the open write whose WRITING entry it is (0: none): which write
        # a WRITING entry belongs to, without an object per entry.
        self._of_slot = np.zeros(index.geometry.entry_slots, np.int64)

    # ------------------------------------------------------------------ a write
    def begin(self, kind: WriterKind, write_id: int, ns: Namespace, keys: list[bytes]
              ) -> tuple[Write, list[StoreOutcome], int]:
        """A write of ``keys``: (the write, the outcome per key, how many keys were present)."""
        write = Write(kind, write_id, ns)
        outcomes, write.slots, present = self.index.place(ns, keys)
        if len(write.slots):
            write.tag = next(self._tags)
            self._open[write.tag] = write
            self._of_slot[write.slots] = write.tag
        return write, outcomes, present

    def written_by(self, slots: np.ndarray, kind: WriterKind) -> np.ndarray:
        """Per slot, whether an open write of ``kind`` is writing its entry: one look per write,
        not per slot (a lookup asks this of every key it reports pending)."""
        tags = self._of_slot[slots]
        out = np.zeros(len(tags), bool)
        for tag in np.unique(tags[tags != 0]).tolist():
            if self._open[tag].kind is kind:
                out |= tags == tag
        return out

    def hand(self, write: Write, key: int, writer: Writer, rank: int | None = None) -> bytes:
        """The pages ``writer`` (``key``: its rank, or 0) copies of each entry — rank ``rank``'s
        shard (``Index.pages_of``), every shard for None — fenced for it before returned."""
        pages = self.index.pages_of(write.ns, write.slots, rank)
        if pages:
            flat = np.frombuffer(pages, PAGES_DTYPE)
            self.fence.hand(writer, flat)
            shard = None if rank is None or write.ns.shards == 1 else write.ns.id.shard_of(rank)
            write.handed[key] = (writer, flat, shard)
        return pages

    def settle(self, write: Write, key: int) -> None:
        """The writer of ``key`` copies no more (ok or not): its pages stay with the entries, or,
        the write aborted, those parked for it come back."""
        held = write.handed.pop(key, None)
        if held is None:
            return
        writer, pages, _ = held
        if write.open:
            self.fence.settle(writer, pages)
        else:
            self.index.release_pages(self.fence.release_job(writer, write.id))

    def complete(self, write: Write, landed: bytes | None = None, sums: list[list[int]] | None = None,
                 chain: bool = True, cold: int = 0) -> np.ndarray:
        """Every vote is in (the writers' after they settled): the entries (those whose ``landed``
        byte is not 0, or all) become READY, with the writers' ``sums`` and the policy's hints; the
        others go, with their pages. Returns the entries made READY."""
        self._close(write)
        ready = write.slots
        if landed is not None and landed.count(0):
            ok = np.frombuffer(landed, np.uint8) != 0
            ready, lost = write.slots[ok], write.slots[~ok]
            pages = np.frombuffer(self.index.pages_of(write.ns, lost), PAGES_DTYPE)
            self.index.abandon(lost)
            self.index.release_pages(pages)
        self.index.make_ready(ready, sums, chain, cold)
        return ready

    def abort(self, write: Write) -> None:
        """The write ends without its entries: they go now; the pages of every writer handed
        them and not settled stay parked under it; the rest are free."""
        if not write.open:
            return
        self._close(write)
        if not len(write.slots):
            return
        ns = write.ns
        shards = self.index.shard_pages(ns, write.slots)  # [entry, shard, page of the shard]
        self.index.abandon(write.slots)
        write.slots = NO_SLOTS
        fenced = np.zeros(ns.shards, dtype=bool)
        for writer, pages, shard in write.handed.values():
            self.fence.park(writer, write.id, pages)
            fenced[slice(None) if shard is None else shard] = True
        self.index.release_pages(shards[:, ~fenced].ravel())

    def drop_writer(self, write: Write, key: int) -> bool:
        """The writer of ``key`` is gone (its session ended): nothing waits for its final now.
        Returns whether it had been handed pages."""
        return write.handed.pop(key, None) is not None

    def _close(self, write: Write) -> None:
        write.open = False
        if self._open.pop(write.tag, None) is not None:
            self._of_slot[write.slots] = 0

    # ------------------------------------------------------------------ writers and the fence's proofs
    def add_writer(self, session: int, token: int, process: Process, engine: str, rank: int) -> Writer:
        """A row in the fence's writer table for a new writer (NO_SPACE when none is free)."""
        return self.fence.add(session, token, process, engine, rank)

    def holds(self, writer: Writer) -> bool:
        """Whether ``writer``'s row is still the fence's (its pages not all released)."""
        return self.fence.holds(writer)

    def writer_ended(self, writer: Writer, proof: Release | None, last_seen: float) -> None:
        """The writer's session ended; with a ``proof`` that it cannot write, its parked pages
        come back now, else the fence keeps them until one (``Fence.detach``)."""
        self.index.release_pages(self.fence.detach(writer, proof, last_seen))

    def reattached(self, session: int, token: int | None) -> None:
        """A hello named a session that is gone and its token: its writer's pages come back."""
        self.index.release_pages(self.fence.reattached(session, token))

    def died(self, pidfd: int) -> None:
        """The pidfd of a gone writer's process became readable."""
        self.index.release_pages(self.fence.died(pidfd))

    def expire(self, now: float) -> float | None:
        """Writers the daemon cannot watch, past their grace: their pages come back. Returns the
        next grace deadline."""
        pages, deadline = self.fence.expire(now)
        self.index.release_pages(pages)
        return deadline

    def reset(self) -> None:
        """The data file was replaced: every writer's pages come back (``Fence.reset``)."""
        self.index.release_pages(self.fence.reset())

    # ------------------------------------------------------------------ checks
    def verify(self) -> None:
        """The open writes against the index and the fence's table (tests, ``Store.verify``)."""
        handed: dict[int, list[np.ndarray]] = {}
        for tag, write in self._open.items():
            assert write.open and write.tag == tag and (self._of_slot[write.slots] == tag).all()
            assert (self.index.states(write.slots) == EntryState.WRITING).all()
            for writer, pages, _ in write.handed.values():
                handed.setdefault(writer.row, []).append(pages)
        assert sum(len(w.slots) for w in self._open.values()) == self.index.entry_count[EntryState.WRITING] \
            == int(np.count_nonzero(self._of_slot)), "a WRITING entry belongs to no open write"
        self.fence.verify(handed)

"""The fenced write (invariants 1, 9 and 12): the one lifecycle by which any writer of region pages
— an engine's rank storing a job, the tier companion promoting blocks, any later writer — is given
pages, and by which those pages come back. No other code hands, settles, parks or releases a page.

A ``Write`` is one job's WRITING entries (one namespace), and the writers it handed their pages:

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
from dataclasses import dataclass, field

import numpy as np

from .contract.codes import StoreOutcome
from .contract.protocol import PAGES_DTYPE
from .contract.region_format import EntryState
from .fence import Fence, Release, Writer
from .index import Entry, Index
from .namespaces import Namespace
from .processes import Process


class WriterKind(str, enum.Enum):
    """Who writes a write's pages."""

    RANK = "rank"       # a rank of an engine: its shard (rank 0 the whole entry of a replicated namespace)
    TIER = "tier"       # the tier companion: whole entries, every shard


@dataclass(eq=False)
class Write:
    kind: WriterKind
    id: int                 # what the fence parks pages under, per writer (a job id; a promote's id)
    ns: Namespace
    entries: list = field(default_factory=list)
    # key (a rank; 0 for the companion) → (the writer, the pages it was handed, its shard: None for
    # every shard): writers handed pages that have not settled. An aborted write keeps them until
    # they settle (late) or are dropped, so that their late final is recognised.
    handed: dict = field(default_factory=dict)
    open: bool = True


class Writes:
    def __init__(self, index: Index, fence: Fence):
        self.index = index
        self.fence = fence
        self._open: set[Write] = set()

    # ------------------------------------------------------------------ a write
    def begin(self, kind: WriterKind, write_id: int, ns: Namespace, keys: list[bytes]
              ) -> tuple[Write, list[StoreOutcome], int]:
        """A write of ``keys``: (the write, the outcome per key, how many keys were present)."""
        write = Write(kind, write_id, ns)
        outcomes, write.entries, present = self.index.place(ns, keys, write)
        if write.entries:
            self._open.add(write)
        return write, outcomes, present

    def hand(self, write: Write, key: int, writer: Writer, rank: int | None = None) -> list[bytes]:
        """The pages ``writer`` (``key``: its rank, or 0) copies of each entry — rank ``rank``'s
        shard (``Namespace.pages_for``), every shard for None — fenced for it before returned."""
        pages = write.ns.pages_for(write.entries, rank)
        if pages:
            flat = np.frombuffer(b"".join(pages), PAGES_DTYPE)
            self.fence.hand(writer, flat)
            shard = None if rank is None or write.ns.shards == 1 else rank
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
                 chain: bool = True, cold: int = 0) -> list[Entry]:
        """Every vote is in (the writers' after they settled): the entries (those whose ``landed``
        byte is not 0, or all) become READY, with the writers' ``sums`` and the policy's hints; the
        others go, with their pages. Returns the entries made READY."""
        self._close(write)
        if landed is None:
            ready, lost = write.entries, []
        else:
            ready = [e for e, ok in zip(write.entries, landed) if ok]
            lost = [e for e, ok in zip(write.entries, landed) if not ok]
        if lost:
            pages = np.frombuffer(b"".join(e.pages for e in lost), PAGES_DTYPE)
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
        if not write.entries:
            return
        ns = write.ns
        shards = ns.shard_pages(write.entries)            # [entry, shard, page of the shard]
        self.index.abandon(write.entries)
        write.entries = []
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
        self._open.discard(write)

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
        for write in self._open:
            assert write.open and all(e.write is write and e.state is EntryState.WRITING for e in write.entries)
            for writer, pages, _ in write.handed.values():
                handed.setdefault(writer.row, []).append(pages)
        assert sum(len(w.entries) for w in self._open) == self.index.entry_count[EntryState.WRITING], \
            "a WRITING entry belongs to no open write"
        self.fence.verify(handed)

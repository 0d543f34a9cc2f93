"""The daemon's state: sessions, namespaces, the key index, entries, jobs, votes and pins.

No sockets and no threads: the server's single loop calls these methods one request at a time,
so nothing here locks. Every method either returns a result or raises ``RequestError`` with a
typed code, having changed nothing it should not have.

Entries: (namespace, key) → Entry. An entry is WRITING from the moment a store job allocates its
pages until every rank of the job has voted, then READY (visible to lookup and load, evictable).
Its record in the region's entry table mirrors it; READY is written there last (invariant 1).

Jobs are identified by (engine id, job id). The first request of a job, from any session of the
engine, fixes its decision; every later request of the job must name the same kind and keys and
gets the same decision, or the job aborts with CONFLICT (invariant 4).

Store job: for each key, PRESENT if the namespace has it (READY, or WRITING by another job),
else pages are allocated (evicting LRU victims, never the job's own keys) and the key is WRITE;
once one key does not fit, every later key that needs writing is NO_SPACE (a prefix is stored).
Writers are rank 0 for a replicated layout and every rank for a sharded one. A non-writer's
store request is its vote; a writer votes with ``commit`` after its copy completed. When all
world_size ranks voted, the job's entries become READY (invariant 5).

Load job: the leading READY keys are the hits; they are pinned (not evictable) until every rank
released the job, then unpinned (invariant 2).

Abort (failed vote, conflict, timeout, a rank leaving or dying): WRITING entries leave the index
at once, so nobody can see them; their pages are freed when no writer that was handed them may
still be copying into them (every such writer committed, left or died), or at the latest one
``job_timeout`` later — so an aborted job's late copy can never land in another entry's pages.
A load job's pins are dropped; a rank that releases it afterwards learns that it was aborted
and must treat the blocks it copied as a miss.

Finished and aborted jobs are remembered (a bounded tombstone list), so a late request for them
gets a precise error instead of silently opening a new job with a reused id.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter

import numpy as np

from .histogram import Histogram
from .contract.namespace import NamespaceId, Sharding
from .contract.protocol import PAGES_DTYPE, ErrorCode, JobState, RequestError, StoreOutcome
from .contract.region_format import ENTRY_DTYPE, EntryState, RegionView, entry_checksum, namespace_record
from .pages import FreeStack
from .policy import create as create_policy
from .recovery import scan

log = logging.getLogger(__name__)

TOMBSTONES = 65536

# Per-key work is done in C-level passes (map over these getters, NumPy fancy indexing of the
# entry table) rather than Python loops: a job carries up to thousands of keys, and the daemon's
# cost per key is what bounds lookup latency and keys/s (docs/benchmarks.md has the figures).
_SLOT = attrgetter("slot")
_STATE = attrgetter("state")
_PAGES = attrgetter("pages")


class _Absent:
    """Stands in for a key the index does not hold, so that a state can be read for every key."""
    state = EntryState.FREE


_ABSENT = _Absent()
_READY = bytes([EntryState.READY])

# Monotonic counters, reported by stats() (zero until they happen).
COUNTERS = (
    "lookup_hit_keys", "lookup_miss_keys",          # keys asked by lookup, found / not found
    "store_written_keys", "store_present_keys", "store_no_space_keys",
    "store_aborted_keys",                           # keys a store job was writing when it aborted
    "store_jobs_done", "load_hit_keys", "load_miss_keys", "load_jobs_done",
    "evictions",                                    # entries evicted to make room for a store
    "operator_evictions",                           # entries evicted by kvtierctl evict/clear
    "bytes_written",                                # bytes copied into the region (D2H), all shards
    "bytes_saved_dedup",                            # bytes replicated ranks did not have to copy
)


class Entry:
    __slots__ = ("slot", "ns", "key", "state", "pages", "pins", "job")

    def __init__(self, slot: int, ns: "Namespace", key: bytes, state: EntryState, pages: bytes, job=None):
        self.slot = slot
        self.ns = ns
        self.key = key
        self.state = state
        self.pages = pages      # the whole chain, PAGES_DTYPE bytes (sent to clients as slices)
        self.pins = 0           # load jobs holding this entry
        self.job = job          # the store job writing it (WRITING only)


class Namespace:
    __slots__ = ("slot", "layout", "index", "pages_per_shard", "entry_pages", "shard_bytes", "record")

    def __init__(self, slot: int, layout: NamespaceId, page_size: int):
        self.slot = slot
        self.layout = layout
        self.index: dict[bytes, Entry] = {}
        self.pages_per_shard = layout.pages_per_shard(page_size)
        self.entry_pages = layout.entry_pages(page_size)
        self.shard_bytes = self.pages_per_shard * 4   # bytes of one shard's page list
        # What every new entry record of this namespace starts from.
        self.record = np.zeros(1, ENTRY_DTYPE)
        self.record[["state", "ns", "page_count", "length"]] = (EntryState.WRITING, slot, self.entry_pages,
                                                                 layout.entry_bytes)


@dataclass(eq=False)
class Session:
    id: int
    engine: "Engine"
    rank: int | None            # None: a coordinator (the engine's scheduler process)
    pid: int | None = None
    attached_at: float = field(default_factory=time.monotonic)

    @property
    def role(self) -> str:
        return "coordinator" if self.rank is None else f"rank {self.rank}"


@dataclass(eq=False)
class Engine:
    id: str
    world_size: int
    ns: Namespace
    ranks: dict[int, Session] = field(default_factory=dict)
    coordinators: set = field(default_factory=set)
    jobs: dict[int, "Job"] = field(default_factory=dict)
    # Finished and aborted jobs, newest last: a late request for one gets a precise error. They
    # go with the engine: a restarted engine (new sessions, same id) may count job ids from 0.
    tombstones: OrderedDict = field(default_factory=OrderedDict)

    @property
    def writers(self) -> frozenset[int]:
        if self.ns.layout.sharding is Sharding.REPLICATED:
            return frozenset({0})
        return frozenset(range(self.world_size))


@dataclass(eq=False)
class Job:
    engine: Engine
    id: int
    kind: str                         # "store" | "load"
    keys: list
    deadline: float
    outcomes: list = field(default_factory=list)   # store: StoreOutcome per key
    entries: list = field(default_factory=list)    # store: entries being written; load: pinned hits
    seen: set = field(default_factory=set)         # ranks that got the decision
    done_ranks: set = field(default_factory=set)   # store: voted; load: released
    state: JobState = JobState.OPEN
    cause: str = ""
    quarantine: list = field(default_factory=list)  # pages of an aborted store job not yet freed
    copying: set = field(default_factory=set)       # writers that may still copy into them
    quarantine_deadline: float = 0.0
    opened: float = 0.0                             # clock() at the first request (vote-wait metric)
    shard_sums: dict = field(default_factory=dict)  # writer rank → checksum of its shard per entry


class Store:
    def __init__(self, view: RegionView, job_timeout: float = 30.0, clock=time.monotonic,
                 checksums: bool = False):
        self.view = view
        self.checksums = checksums        # keep writers' checksums, verify them on recovery
        self.geometry = view.geometry
        self.page_size = view.geometry.page_size
        self.job_timeout = job_timeout
        self.clock = clock
        self.policy = create_policy("lru")
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self.ns_by_slot: dict[int, Namespace] = {}
        self.engines: dict[str, Engine] = {}
        self.sessions: dict[int, Session] = {}
        self.tick = int(view.header["tick"])
        self._session_ids = itertools.count(1)
        # (deadline, seq, engine id, job id): ids, not the Job, so that a finished job is freed at
        # once instead of living on in the heap until its deadline comes up.
        self._deadlines: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self.entry_count = {EntryState.WRITING: 0, EntryState.READY: 0}
        self.pinned_entries = 0
        self.by_slot: list[Entry | None] = [None] * self.geometry.entry_slots
        self._states = view.entries["state"]    # columns of the entry table, for vectorised writes
        self._ticks = view.entries["tick"]
        # The entry table as rows of bytes: NumPy scatters whole structured records ~100x slower
        # than the same bytes as uint8 rows.
        self._records = view.entries.view(np.uint8).reshape(len(view.entries), ENTRY_DTYPE.itemsize)
        self.counters: Counter = Counter()
        self.aborted: Counter = Counter()
        self.vote_wait = Histogram()      # first request of a store job → its last vote
        # Recovery allocates an object or two per entry, millions of them: the cyclic collector's
        # passes over the growing heap cost 40% of it (and find nothing to collect) if left on.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.recovered = self._recover()
        finally:
            if collecting:
                gc.enable()

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> dict[str, int]:
        """Rebuild the index, LRU order and free pages from the region's tables.

        READY entries whose namespace record and page chain are sound are kept, oldest tick
        first in the LRU; WRITING entries (a copy or vote that never finished) are discarded, as
        are entries whose chain is broken or shares a page with an earlier entry, and damaged
        records (unknown state, namespace, page count or key length). Nothing in the tables can
        make recovery raise.
        """
        view, geo = self.view, self.geometry
        found = scan(view, verify_checksums=self.checksums)
        for slot, why in found.damaged_namespaces.items():
            log.warning("namespace slot %d is damaged (%s); discarding it and its entries", slot, why)
            view.namespaces[slot]["in_use"] = 0
        for slot, layout in found.namespaces.items():
            ns = Namespace(slot, layout, self.page_size)
            self.namespaces[layout] = ns
            self.ns_by_slot[slot] = ns
        states = view.entries["state"]
        for slot, why in found.problems:
            log.warning("entry %d discarded: %s", slot, why)
            states[slot] = EntryState.FREE
        states[found.writing] = EntryState.FREE
        # A region holds millions of entries: the objects are built with C-level loops (map, zip).
        slots = found.ready_slots.tolist()
        kept = list(map(Entry, slots, map(self.ns_by_slot.__getitem__, found.ready_ns.tolist()), found.ready_keys,
                        repeat(EntryState.READY), found.ready_pages))
        if len(self.namespaces) == 1:
            next(iter(self.namespaces.values())).index.update(zip(found.ready_keys, kept))
        else:
            for key, entry in zip(found.ready_keys, kept):
                entry.ns.index[key] = entry
        deque(map(self.by_slot.__setitem__, slots, kept), 0)
        self.policy.recovered(slots)
        self.entry_count[EntryState.READY] = len(kept)
        self.pages = FreeStack(geo.num_pages, np.flatnonzero(found.owner >= 0))
        self.slots = FreeStack(geo.entry_slots, np.flatnonzero(states != EntryState.FREE))
        if len(view.entries):
            self.tick = max(self.tick, int(view.entries["tick"].max()))
        return {"ready": len(kept), "writing_discarded": len(found.writing),
                "corrupt_discarded": len(found.problems)}

    # ------------------------------------------------------------------ sessions
    def attach(self, engine_id: str, rank: int | None, world_size: int, layout: NamespaceId,
               pid: int | None = None) -> Session:
        if rank is not None and rank >= world_size:   # before anything is created for the engine
            raise RequestError(ErrorCode.BAD_REQUEST, f"rank {rank} >= world_size {world_size}")
        engine = self.engines.get(engine_id)
        if engine is None:
            engine = Engine(engine_id, world_size, self._namespace(layout))
            self.engines[engine_id] = engine
        elif engine.world_size != world_size or engine.ns.layout != layout:
            raise RequestError(ErrorCode.LAYOUT_MISMATCH,
                               f"engine {engine_id!r} is attached with world size {engine.world_size} and layout "
                               f"{engine.ns.layout.name()}; this session asks for world size {world_size} and "
                               f"{layout.name()}")
        if rank is not None:
            if rank in engine.ranks:
                other = engine.ranks[rank]
                raise RequestError(ErrorCode.LAYOUT_MISMATCH,
                                   f"engine {engine_id!r} rank {rank} is already attached (session {other.id}, "
                                   f"pid {other.pid}); every rank attaches once")
        session = Session(next(self._session_ids), engine, rank, pid)
        if rank is None:
            engine.coordinators.add(session)
        else:
            engine.ranks[rank] = session
        self.sessions[session.id] = session
        return session

    def detach(self, session: Session, cause: str = "left") -> None:
        """End a session (bye, death, or daemon stop). Jobs that still wait for this rank abort."""
        if self.sessions.pop(session.id, None) is None:
            return
        engine = session.engine
        if session.rank is None:
            engine.coordinators.discard(session)
        else:
            engine.ranks.pop(session.rank, None)
        for job in list(engine.jobs.values()):
            if job.state is not JobState.OPEN:
                continue
            if session.rank is not None and session.rank not in job.done_ranks:
                self._abort(job, f"rank_{cause}")
        for job in list(engine.jobs.values()):
            if session.rank is not None and job.quarantine:
                self._writer_gone(job, session.rank)
        if not engine.ranks and not engine.coordinators:
            for job in list(engine.jobs.values()):
                if job.state is JobState.OPEN:
                    self._abort(job, "engine_left")
                job.quarantine_deadline = 0.0  # no writer of this engine is left to copy
                self._free_quarantine(job)
            del self.engines[engine.id]

    def _namespace(self, layout: NamespaceId) -> Namespace:
        ns = self.namespaces.get(layout)
        if ns is not None:
            return ns
        if layout.entry_pages(self.page_size) > self.geometry.num_pages:
            raise RequestError(ErrorCode.NO_SPACE,
                               f"one block of {layout.name()} needs {layout.entry_pages(self.page_size)} pages; "
                               f"the region has {self.geometry.num_pages}")
        table = self.view.namespaces
        free = np.flatnonzero(table["in_use"] == 0)
        if len(free) == 0:
            empty = [n for n in self.namespaces.values() if not n.index and not self._ns_in_use(n)]
            if not empty:
                raise RequestError(ErrorCode.NO_SPACE, f"all {len(table)} namespace slots are in use")
            slot = empty[0].slot
            del self.namespaces[empty[0].layout]
        else:
            slot = int(free[0])
        table[slot] = namespace_record(layout)
        ns = Namespace(slot, layout, self.page_size)
        self.namespaces[layout] = ns
        self.ns_by_slot[slot] = ns
        log.info("namespace %d: %s", slot, layout.name())
        return ns

    def _ns_in_use(self, ns: Namespace) -> bool:
        return any(e.ns is ns for e in self.engines.values())

    # ------------------------------------------------------------------ lookup
    def lookup(self, session: Session, keys: list[bytes]) -> int:
        """How many leading keys are READY; touches them (they are about to be used)."""
        hits = self._ready_prefix(session.engine.ns.index, keys)
        self._touch(hits)
        self.counters["lookup_hit_keys"] += len(hits)
        self.counters["lookup_miss_keys"] += len(keys) - len(hits)
        return len(hits)

    @staticmethod
    def _ready_prefix(index: dict[bytes, Entry], keys: list[bytes]) -> list[Entry]:
        """The entries of the leading keys that are in the index and READY."""
        entries = list(map(index.get, keys, repeat(_ABSENT)))
        states = bytes(map(_STATE, entries))               # one byte per key
        hits = len(states) - len(states.lstrip(_READY))
        return entries if hits == len(entries) else entries[:hits]

    def _touch(self, entries: list[Entry]) -> None:
        """The entries were just used: young end of the policy (if evictable), new tick."""
        if entries:
            slots = list(map(_SLOT, entries))
            self.policy.accessed(slots)
            self._stamp(slots)

    def _stamp(self, slots: list[int]) -> None:
        """A new access tick for these entries in the table (recovery rebuilds the LRU order from it)."""
        self.tick += 1
        self._ticks[np.fromiter(slots, np.intp, len(slots))] = self.tick

    # ------------------------------------------------------------------ jobs
    def _job(self, session: Session, job_id: int, kind: str, keys: list[bytes]) -> tuple[Job, bool]:
        """The open job (engine, job_id), checked against ``kind`` and ``keys``; or a new one."""
        engine = session.engine
        job = engine.jobs.get(job_id)
        if job is None or job.state is not JobState.OPEN:
            if job is not None:     # aborted, pages still quarantined: the id stays taken (its
                self._refuse_aborted(job.kind, job_id, job.cause)   # tombstone may be gone)
            self._refuse_finished(engine, job_id)
            now = self.clock()
            job = Job(engine, job_id, kind, keys, now + self.job_timeout, opened=now)
            engine.jobs[job_id] = job
            heapq.heappush(self._deadlines, (job.deadline, next(self._seq), engine.id, job_id))
            return job, True
        if job.kind != kind or job.keys != keys:
            self._abort(job, "conflict")
            what = f"a {job.kind} job" if job.kind != kind else "a job with different keys"
            raise RequestError(ErrorCode.CONFLICT,
                               f"job {job_id} of engine {engine.id!r} was opened as {what}; "
                               f"{session.role} asked for a {kind} of {len(keys)} keys. The job is aborted")
        return job, False

    def _refuse_finished(self, engine: Engine, job_id: int) -> None:
        tomb = engine.tombstones.get(job_id)
        if tomb is None:
            return
        kind, state, cause = tomb
        if state is JobState.ABORTED:
            self._refuse_aborted(kind, job_id, cause)
        raise RequestError(ErrorCode.CONFLICT, f"{kind} job {job_id} already finished; job ids are not reused")

    @staticmethod
    def _refuse_aborted(kind: str, job_id: int, cause: str) -> None:
        code = ErrorCode.TIMEOUT if cause == "timeout" else ErrorCode.ABORTED
        raise RequestError(code, f"{kind} job {job_id} was aborted ({cause})")

    def _open_job(self, session: Session, job_id: int, kind: str) -> Job:
        job = session.engine.jobs.get(job_id)
        if job is None or job.state is not JobState.OPEN:
            if job is not None:
                self._refuse_aborted(job.kind, job_id, job.cause)
            self._refuse_finished(session.engine, job_id)
            raise RequestError(ErrorCode.UNKNOWN_JOB, f"no job {job_id} for engine {session.engine.id!r}")
        if job.kind != kind:
            raise RequestError(ErrorCode.CONFLICT, f"job {job_id} is a {job.kind} job")
        return job

    def _rank_of(self, session: Session, what: str) -> int:
        if session.rank is None:
            raise RequestError(ErrorCode.FORBIDDEN, f"a coordinator session cannot {what}; ranks do")
        return session.rank

    # ------------------------------------------------------------------ store
    def store(self, session: Session, job_id: int, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Open or join a store job. Returns (outcome per key, this rank's pages per WRITE key).

        A writer rank gets its shard's pages for each WRITE key (in key order) and must commit
        after copying; a non-writer rank's request is its vote; a coordinator gets no pages.
        """
        job, new = self._job(session, job_id, "store", keys)
        if new:
            self._decide_store(job)
        rank = session.rank
        if rank is None:
            return job.outcomes, []
        job.seen.add(rank)
        if rank in job.engine.writers:
            ns = job.engine.ns
            if ns.layout.sharding is Sharding.REPLICATED:
                return job.outcomes, list(map(_PAGES, job.entries))
            lo, hi = rank * ns.shard_bytes, (rank + 1) * ns.shard_bytes
            return job.outcomes, [e.pages[lo:hi] for e in job.entries]
        self._vote(job, rank)
        return job.outcomes, []

    def _decide_store(self, job: Job) -> None:
        ns = job.engine.ns
        found = list(map(ns.index.get, job.keys))    # keys of a job are distinct (protocol)
        present = [e for e in found if e is not None]
        self._touch([e for e in present if e.state is EntryState.READY])
        new_keys = [k for k, e in zip(job.keys, found) if e is None]
        fit = self._make_room(len(new_keys), ns.entry_pages, set(map(_SLOT, present)))
        job.entries = self._new_entries(ns, new_keys[:fit], job)
        decided = iter([StoreOutcome.WRITE] * fit + [StoreOutcome.NO_SPACE] * (len(new_keys) - fit))
        job.outcomes = [StoreOutcome.PRESENT if e is not None else next(decided) for e in found]
        self.counters["store_written_keys"] += fit
        self.counters["store_present_keys"] += len(present)
        self.counters["store_no_space_keys"] += len(new_keys) - fit

    def _make_room(self, count: int, entry_pages: int, exclude: set[int]) -> int:
        """Evict least recently used entries (never those in ``exclude``: the job's present keys)
        until ``count`` entries of ``entry_pages`` fit, or nothing evictable is left. Returns how
        many fit: the job writes that prefix of its new keys and the rest get NO_SPACE."""
        need = count * entry_pages - self.pages.free_count
        if need > 0:
            victims = []
            for slot in self.policy.victims(exclude):
                victims.append(self.by_slot[slot])
                need -= victims[-1].ns.entry_pages
                if need <= 0:
                    break
            self._evict(victims)
        return min(count, self.pages.free_count // entry_pages)

    def _evict(self, entries: list[Entry], counter: str = "evictions") -> None:
        self._free_entries(entries)
        self.pages.free(self._pages_of(entries))
        self.counters[counter] += len(entries)

    @staticmethod
    def _pages_of(entries: list[Entry]) -> list[int]:
        return np.frombuffer(b"".join(map(_PAGES, entries)), PAGES_DTYPE).tolist()

    def _new_entries(self, ns: Namespace, keys: list[bytes], job: Job) -> list[Entry]:
        """WRITING entries for ``keys``, with pages (there is room: ``_make_room``) and records."""
        n = len(keys)
        if n == 0:
            return []
        pages = np.asarray(self.pages.alloc(n * ns.entry_pages), dtype=PAGES_DTYPE).reshape(n, -1)
        slots = self.slots.alloc(n)
        # The records are built in a fresh array and written with one scatter. A torn write is
        # harmless: recovery discards WRITING records.
        rec = np.repeat(ns.record, n)
        rec["first_page"] = pages[:, 0]
        rec["tick"] = self.tick
        lengths = list(map(len, keys))
        rec["key_len"] = lengths
        if len(set(lengths)) == 1:
            rec["key"][:, :lengths[0]] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, -1)
        else:
            for i, key in enumerate(keys):      # keys of mixed lengths (unusual): row by row
                rec["key"][i, :len(key)] = np.frombuffer(key, np.uint8)
        self._records[np.asarray(slots)] = rec.view(np.uint8).reshape(n, -1)
        self.view.write_chain(pages)
        entries = list(map(Entry, slots, repeat(ns), keys, repeat(EntryState.WRITING),
                           pages.view(f"V{pages.shape[1] * 4}").ravel().tolist(), repeat(job)))
        ns.index.update(zip(keys, entries))
        deque(map(self.by_slot.__setitem__, slots, entries), 0)
        self.entry_count[EntryState.WRITING] += n
        return entries

    def _free_entries(self, entries: list[Entry]) -> None:
        """Forget entries: out of the table first (state FREE), the index and the policy."""
        if not entries:
            return
        slots = list(map(_SLOT, entries))
        self._states[slots] = EntryState.FREE
        by_slot, count = self.by_slot, self.entry_count
        for entry in entries:
            del entry.ns.index[entry.key]
            by_slot[entry.slot] = None
            count[entry.state] -= 1
            entry.state = EntryState.FREE
        self.policy.removed(slots)
        self.slots.free(slots)

    def commit(self, session: Session, job_id: int, ok: bool, checksums: list[int] | None = None) -> None:
        """A rank's vote on a store job; writers send it after their copy completed, with the
        checksums of their shard of each entry when the daemon keeps checksums."""
        rank = self._rank_of(session, "vote")
        job = self._find_for_vote(session, job_id)
        if job.state is JobState.ABORTED:       # a writer acknowledging an aborted job's copy
            self._writer_gone(job, rank)
            raise RequestError(ErrorCode.TIMEOUT if job.cause == "timeout" else ErrorCode.ABORTED,
                               f"store job {job_id} was aborted ({job.cause})")
        if rank not in job.seen:
            raise RequestError(ErrorCode.CONFLICT, f"rank {rank} commits store job {job_id} before storing it")
        if not ok:
            self._abort(job, "vote_failed")
            self._writer_gone(job, rank)        # a writer voting no is not copying any more
            return
        if checksums is not None:
            if rank not in job.engine.writers or len(checksums) != len(job.entries):
                raise RequestError(ErrorCode.BAD_REQUEST, f"commit of job {job_id} carries {len(checksums)} "
                                   f"checksums; rank {rank} writes {len(job.entries) if rank in job.engine.writers else 0} entries")
            job.shard_sums[rank] = checksums
        self._vote(job, rank)

    def _find_for_vote(self, session: Session, job_id: int) -> Job:
        job = session.engine.jobs.get(job_id)
        if job is not None and job.kind == "store" and job.quarantine:
            return job                        # aborted, its pages wait for this writer
        return self._open_job(session, job_id, "store")

    def _vote(self, job: Job, rank: int) -> None:
        job.done_ranks.add(rank)
        if len(job.done_ranks) < job.engine.world_size:
            return
        # Every rank voted, the writers after their copies: the entries become READY.
        entries = job.entries
        self.tick += 1
        writers = sorted(job.engine.writers)
        sums = job.shard_sums if self.checksums and all(r in job.shard_sums for r in writers) else None
        slots = list(map(_SLOT, entries))
        for entry in entries:
            entry.state = EntryState.READY
            entry.job = None
        self._ticks[slots] = self.tick
        self.view.entries["checksum"][slots] = [entry_checksum([sums[r][i] for r in writers])
                                                for i in range(len(entries))] if sums else 0
        self._states[slots] = EntryState.READY    # last: the records are complete before they say READY
        self.policy.inserted(slots, chain=True)
        n = len(entries)
        self.entry_count[EntryState.WRITING] -= n
        self.entry_count[EntryState.READY] += n
        layout = job.engine.ns.layout
        self.counters["bytes_written"] += n * layout.entry_bytes
        if layout.sharding is Sharding.REPLICATED:
            self.counters["bytes_saved_dedup"] += n * layout.block_bytes * (job.engine.world_size - 1)
        self.counters["store_jobs_done"] += 1
        self.vote_wait.observe(self.clock() - job.opened)
        self._finish(job, JobState.DONE)

    # ------------------------------------------------------------------ load
    def load(self, session: Session, job_id: int, keys: list[bytes]) -> tuple[int, list[bytes]]:
        """Open or join a load job. Returns (hits, this rank's pages per hit key).

        The first request pins the READY prefix of ``keys``; they stay pinned until every rank
        released the job (or it is aborted).
        """
        job, new = self._job(session, job_id, "load", keys)
        if new:
            job.entries = self._ready_prefix(job.engine.ns.index, keys)
            pinned = []
            for entry in job.entries:
                entry.pins += 1
                if entry.pins == 1:
                    pinned.append(entry.slot)
            self.policy.pinned(pinned)
            self.pinned_entries += len(pinned)
            if job.entries:          # pinned: out of the policy until released; only the tick moves
                self._stamp(list(map(_SLOT, job.entries)))
            self.counters["load_hit_keys"] += len(job.entries)
            self.counters["load_miss_keys"] += len(keys) - len(job.entries)
        hits = len(job.entries)
        if session.rank is None:
            return hits, []
        job.seen.add(session.rank)
        ns = job.engine.ns
        if ns.layout.sharding is Sharding.SHARDED:
            lo, hi = session.rank * ns.shard_bytes, (session.rank + 1) * ns.shard_bytes
            return hits, [e.pages[lo:hi] for e in job.entries]
        return hits, list(map(_PAGES, job.entries))

    def release(self, session: Session, job_id: int) -> None:
        """A rank finished copying a load job's blocks out of the region."""
        rank = self._rank_of(session, "release a load")
        job = self._open_job(session, job_id, "load")
        if rank not in job.seen:
            raise RequestError(ErrorCode.CONFLICT, f"rank {rank} releases load job {job_id} before loading it")
        job.done_ranks.add(rank)
        if len(job.done_ranks) == job.engine.world_size:
            self._unpin(job)
            self.counters["load_jobs_done"] += 1
            self._finish(job, JobState.DONE)

    def _unpin(self, job: Job) -> None:
        unpinned = []
        for entry in job.entries:
            entry.pins -= 1
            if entry.pins == 0:
                unpinned.append(entry.slot)
        self.pinned_entries -= len(unpinned)
        self.policy.unpinned(unpinned)
        job.entries = []

    # ------------------------------------------------------------------ abort and finish
    def abort(self, session: Session, job_id: int) -> None:
        """Any session of the engine gives up an open job; aborting an aborted job is a no-op."""
        job = session.engine.jobs.get(job_id)
        if job is not None and job.state is JobState.OPEN:
            self._abort(job, "aborted_by_client")
            return
        tomb = session.engine.tombstones.get(job_id)
        if tomb is not None and tomb[1] is JobState.ABORTED:
            return
        self._open_job(session, job_id, "store")   # raises the precise error

    def _abort(self, job: Job, cause: str) -> None:
        if job.state is not JobState.OPEN:
            return
        job.cause = cause
        if job.kind == "store":
            # Writers that were handed pages and may still be copying into them.
            live_writers = {r for r in job.seen & job.engine.writers if r in job.engine.ranks}
            job.copying = live_writers - job.done_ranks
            self.counters["store_aborted_keys"] += len(job.entries)
            self._free_entries(job.entries)
            job.quarantine.extend(self._pages_of(job.entries))
            job.entries = []
            job.quarantine_deadline = self.clock() + self.job_timeout
            self._free_quarantine(job)
        else:
            self._unpin(job)
        self.aborted[cause] += 1
        log.info("%s job %d of engine %r aborted: %s", job.kind, job.id, job.engine.id, cause)
        self._finish(job, JobState.ABORTED)

    def _writer_gone(self, job: Job, rank: int) -> None:
        job.copying.discard(rank)
        self._free_quarantine(job)

    def _free_quarantine(self, job: Job) -> None:
        if job.quarantine and (not job.copying or self.clock() >= job.quarantine_deadline):
            self.pages.free(job.quarantine)
            job.quarantine = []
        if not job.quarantine and job.state is not JobState.OPEN:
            job.engine.jobs.pop(job.id, None)
        elif job.quarantine:
            heapq.heappush(self._deadlines, (job.quarantine_deadline, next(self._seq), job.engine.id, job.id))

    def _finish(self, job: Job, state: JobState) -> None:
        job.state = state
        tombstones = job.engine.tombstones
        tombstones[job.id] = (job.kind, state, job.cause)
        if len(tombstones) > TOMBSTONES:
            tombstones.popitem(last=False)
        if not job.quarantine:
            job.engine.jobs.pop(job.id, None)

    def job_states(self, session: Session, job_ids: list[int]) -> list[dict]:
        out = []
        for job_id in job_ids:
            job = session.engine.jobs.get(job_id)
            if job is not None and job.state is JobState.OPEN:
                out.append({"job": job_id, "kind": job.kind, "state": JobState.OPEN.value,
                            "waiting": job.engine.world_size - len(job.done_ranks)})
                continue
            tomb = session.engine.tombstones.get(job_id)
            if tomb is None:
                out.append({"job": job_id, "state": "unknown"})
            else:
                out.append({"job": job_id, "kind": tomb[0], "state": tomb[1].value, "cause": tomb[2]})
        return out

    def expire(self) -> float | None:
        """Abort jobs past their deadline, free quarantines past theirs. Returns the next deadline."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, engine_id, job_id = heapq.heappop(self._deadlines)
            engine = self.engines.get(engine_id)
            job = engine.jobs.get(job_id) if engine is not None else None
            if job is None:
                continue                      # finished, or its engine left: nothing to expire
            if job.state is JobState.OPEN and job.deadline <= now:
                self._abort(job, "timeout")
            elif job.quarantine and job.quarantine_deadline <= now:
                self._free_quarantine(job)
        return self._deadlines[0][0] if self._deadlines else None

    # ------------------------------------------------------------------ stats and shutdown
    def stats(self) -> dict:
        pages = self.pages
        quarantined = sum(len(j.quarantine) for e in self.engines.values() for j in e.jobs.values())
        return {
            "capacity_bytes": self.geometry.capacity_bytes,
            "page_size": self.page_size,
            "pages_total": pages.total,
            "pages_free": pages.free_count,
            "pages_used": pages.used_count,
            "pages_quarantined": quarantined,
            "used_bytes": pages.used_count * self.page_size,
            "entries_ready": self.entry_count[EntryState.READY],
            "entries_writing": self.entry_count[EntryState.WRITING],
            "entries_pinned": self.pinned_entries,
            "evictable": len(self.policy),
            "namespaces": len(self.namespaces),
            "engines": len(self.engines),
            "sessions": len(self.sessions),
            "open_jobs": sum(1 for e in self.engines.values() for j in e.jobs.values()
                             if j.state is JobState.OPEN),
            "aborted_jobs": dict(self.aborted),
            "vote_wait": self.vote_wait.snapshot(),
            **{name: self.counters[name] for name in COUNTERS},
        }

    def evict(self, namespace: str | None, count: int | None) -> int:
        """Operator eviction: up to ``count`` (None: all) least recently used evictable entries of
        the namespace named ``namespace`` (None: any). Pinned and WRITING entries stay."""
        if namespace is not None and not any(ns.layout.name() == namespace for ns in self.namespaces.values()):
            raise RequestError(ErrorCode.BAD_REQUEST, f"no namespace {namespace!r}; kvtierctl namespaces lists them")
        victims = [self.by_slot[slot] for slot in self.policy.victims()
                   if namespace is None or self.by_slot[slot].ns.layout.name() == namespace]
        victims = victims if count is None else victims[:count]
        self._evict(victims, "operator_evictions")
        if victims:
            log.info("operator evicted %d entries (namespace %s)", len(victims), namespace or "any")
        return len(victims)

    def namespace_stats(self) -> list[dict]:
        return [{"slot": ns.slot, "name": ns.layout.name(), "entries": len(ns.index),
                 "entry_pages": ns.entry_pages} for ns in self.namespaces.values()]

    def verify(self) -> None:
        """Check the in-memory state against itself and the entry table (tests, kvtierctl check).

        Every page is exactly one of: free, owned by one live entry, quarantined; every slot is
        free or holds one entry; the policy holds exactly the READY unpinned entries; the table's
        records match the index. Only public accessors of the free stacks and the policy.
        """
        owner = np.full(self.geometry.num_pages, -1, dtype=np.int64)
        free = self.pages.free_ids()
        assert len(np.unique(free)) == len(free), "a page is free twice"
        owner[free] = -2
        quarantined = [p for e in self.engines.values() for j in e.jobs.values() for p in j.quarantine]
        assert (owner[quarantined] == -1).all(), "a quarantined page is also free"
        owner[quarantined] = -3
        free_slots = self.slots.free_ids()
        assert len(np.unique(free_slots)) == len(free_slots), "an entry slot is free twice"
        assert all(self.by_slot[s] is None for s in free_slots.tolist()), "a free slot holds an entry"
        assert len(free_slots) + sum(map(len, (ns.index for ns in self.namespaces.values()))) == \
            self.geometry.entry_slots, "entry slots leaked"
        table = self.view.entries
        for ns in self.namespaces.values():
            for key, entry in ns.index.items():
                pages = np.frombuffer(entry.pages, PAGES_DTYPE).astype(np.int64)
                assert len(pages) == ns.entry_pages, f"entry {entry.slot} has {len(pages)} pages"
                assert (owner[pages] == -1).all(), f"entry {entry.slot} shares a page"
                owner[pages] = entry.slot
                assert self.by_slot[entry.slot] is entry
                rec = table[entry.slot]
                assert int(rec["state"]) == entry.state and bytes(rec["key"][: rec["key_len"]]) == key
                assert np.array_equal(self.view.chain_of(entry.slot), pages)
                evictable = entry.state is EntryState.READY and entry.pins == 0
                assert (entry.slot in self.policy) == evictable, f"entry {entry.slot} policy membership"
        assert (owner != -1).all(), f"{int((owner == -1).sum())} pages leaked"
        assert len(self.policy) == sum(1 for e in self.by_slot if e is not None
                                       and e.state is EntryState.READY and e.pins == 0)

    def shutdown(self) -> None:
        """Abort every open job (their pages are freed) and persist the access clock."""
        for session in list(self.sessions.values()):
            self.detach(session, "daemon_stopped")
        self.view.header["tick"] = self.tick

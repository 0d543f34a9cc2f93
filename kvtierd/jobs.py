"""The job machine: store and load jobs, their votes and pins, aborts, deadlines, tombstones and
the page fence. No sockets, no threads; the index holds the entries and pages a job works on.

Jobs are identified by (engine id, job id). The first request of a job, from any session of the
engine, fixes its decision; every later request of the job must name the same kind and keys and
gets the same decision, or the job aborts with CONFLICT (invariant 4).

Store job: the index decides per key (PRESENT, WRITE with pages, or NO_SPACE for the rest once one
key does not fit). Writers are the engine's lowest rank on this daemon for a replicated namespace
and every rank of it here for a sharded one (``Engine.writers``). A non-writer's store request is
its vote; a writer votes with ``commit`` after its copy completed. When every rank of the engine
on this daemon voted (``Engine.node_ranks``: the world, or its node's ranks when it spans nodes),
the job's entries become READY (invariant 5).

Load job: the leading READY keys are the hits; they are pinned (not evictable) until every rank
released the job, then unpinned (invariant 2). A load job may name a lease of its engine
(``kvtierd.leases``): its first request pins the hits, then ends the lease (consumed), so the
leased entries are never evictable in between and a load of leased keys is never short.

A store job is a fenced write (``kvtierd.writes``, invariant 9): a writer's pages are fenced for
it before the reply carries them, and settled when its commit is accepted. Abort (failed vote,
conflict, timeout, a rank leaving or dying, the engine leaving): WRITING entries leave the index
at once, so nobody can see them; the pages of every writer that was handed them and has not
committed stay fenced, parked under that writer, until it commits the job after all or is proven
unable to write (the fence decides when) — never on a timer while it may live, so an aborted
job's late copy can never land in another entry's pages. The other pages are free at once. A load
job's pins are dropped; a rank that releases it afterwards learns that it was aborted and must
treat the blocks it copied as a miss.

Finished and aborted jobs are remembered (tombstones), so a late request for them gets a precise
error instead of silently opening a new job with a reused id.

What one client can make the daemon hold is bounded (issue 11): the keys of open jobs, per engine
(``max_job_keys_per_engine``) and in all (``max_job_keys``) — a job counts its keys plus one, and
a job past a bound is refused with LIMIT before anything is allocated for it; the tombstones, in
all (``max_tombstones``, the oldest forgotten first, whichever engine they were of); the deadline
heap, which is rebuilt from the jobs that still need it when finished jobs crowd it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .attachments import Engine, Session, SessionEnd
from .contract.codes import AbortCause, ErrorCode, JobKind, JobState, RequestError, StoreOutcome
from .contract.namespace import Sharding
from .histogram import Histogram
from .holds import Holds
from .index import NO_SLOTS, Index
from .leases import Leases
from .writes import Write, Writes, WriterKind

log = logging.getLogger(__name__)


# Monotonic counters the job machine keeps (Store.stats reports them with the index's).
COUNTERS = ("store_written_keys", "store_present_keys", "store_no_space_keys", "store_aborted_keys",
            "store_jobs_done", "load_hit_keys", "load_miss_keys", "load_jobs_done", "bytes_written",
            "bytes_saved_dedup")


@dataclass(eq=False)
class Job:
    engine: Engine
    id: int
    kind: JobKind
    keys: list
    deadline: float
    outcomes: bytes = b""                          # store: a StoreOutcome byte per key
    write: Write | None = None                     # store: its fenced write (entries, writers handed pages)
    slots: np.ndarray = field(default_factory=lambda: NO_SLOTS)   # load: the pinned hits
    seen: set = field(default_factory=set)         # ranks that got the decision
    done_ranks: set = field(default_factory=set)   # store: voted; load: released
    state: JobState = JobState.OPEN
    cause: AbortCause | None = None
    opened: float = 0.0                             # clock() at the first request (vote-wait metric)
    chain: bool = True                              # store: the keys are a prefix chain (the policy's hint)
    cold: int = 0                                   # store: written keys the client expects no reuse of
    shard_sums: dict = field(default_factory=dict)  # writer rank → checksum of its shard per entry
    cost: int = 0                                   # what it counts against the open-job key bounds

    @property
    def handed(self) -> dict:
        """store: writer rank → its handed pages, not committed; an aborted job stays findable
        while one is left, so that its late commit is recognised."""
        return self.write.handed if self.write is not None else {}


class Jobs:
    def __init__(self, index: Index, writes: Writes, leases: Leases, holds: Holds, engines: dict[str, Engine],
                 job_timeout: float = 30.0, clock=time.monotonic, checksums: bool = False, max_job_keys: int = 1 << 20,
                 max_job_keys_per_engine: int = 1 << 18, max_tombstones: int = 1 << 17):
        """``engines``: the attached engines by id (``Attachments.engines``), whose jobs these are;
        ``holds``: what a load may pin of the region (``Holds.fit``)."""
        self.index = index
        self.writes = writes
        self.leases = leases
        self.holds = holds
        self.job_timeout = job_timeout
        self.clock = clock
        self.checksums = checksums        # keep writers' checksums of their shards
        self.max_job_keys = max_job_keys
        self.max_job_keys_per_engine = max_job_keys_per_engine
        self.max_tombstones = max_tombstones
        self.engines = engines
        self.open_keys = 0                # keys (+1 per job) of every open job
        # Finished and aborted jobs, oldest first: (engine serial, job id) → (kind, state, cause),
        # the value one shared tuple per combination.
        self.tombstones: OrderedDict[tuple[int, int], tuple] = OrderedDict()
        self._tomb_values: dict[tuple, tuple] = {}
        # (deadline, seq, engine id, job id): ids, not the Job, so that a finished job is freed at
        # once instead of living on in the heap until its deadline comes up.
        self._deadlines: list[tuple[float, int, str, int]] = []
        self._compact_at = 4096
        self._seq = itertools.count()
        self.counters: Counter = Counter()
        self.aborted: Counter = Counter()   # AbortCause value → jobs
        self.vote_wait = Histogram()        # first request of a store job → its last vote

    # ------------------------------------------------------------------ open, join, find
    def _job(self, session: Session, job_id: int, kind: JobKind, keys: list[bytes]) -> tuple[Job, bool]:
        """The open job (engine, job_id), checked against ``kind`` and ``keys``; or a new one."""
        engine = session.engine
        job = engine.jobs.get(job_id)
        if job is None or job.state is not JobState.OPEN:
            if job is not None:     # aborted, a writer's pages still fenced: the id stays taken
                self._refuse_settled(job.kind, job.state, job.cause, job_id)   # (its tombstone may be gone)
            self._refuse_finished(engine, job_id)
            cost = self._admit(engine, len(keys))
            now = self.clock()
            job = Job(engine, job_id, kind, keys, now + self.job_timeout, opened=now, cost=cost)
            engine.jobs[job_id] = job
            engine.open_keys += cost
            self.open_keys += cost
            self._push_deadline(job.deadline, engine.id, job_id)
            return job, True
        if job.kind is not kind or job.keys != keys:
            self._abort(job, AbortCause.CONFLICT)
            what = f"a {job.kind.value} job" if job.kind is not kind else "a job with different keys"
            raise RequestError(ErrorCode.CONFLICT,
                               f"job {job_id} of engine {engine.id!r} was opened as {what}; "
                               f"{session.role} asked for a {kind.value} of {len(keys)} keys. The job is aborted")
        return job, False

    def _admit(self, engine: Engine, keys: int) -> int:
        """What a new job of ``keys`` keys costs; LIMIT when the open jobs' bounds cannot take it."""
        cost = keys + 1
        if engine.open_keys + cost > self.max_job_keys_per_engine:
            raise RequestError(ErrorCode.LIMIT, f"engine {engine.id!r} holds {engine.open_keys} keys in open jobs; a "
                               f"job of {keys} more exceeds max_job_keys_per_engine ({self.max_job_keys_per_engine}): "
                               "finish, release or abort jobs first")
        if self.open_keys + cost > self.max_job_keys:
            raise RequestError(ErrorCode.LIMIT, f"kvtierd holds {self.open_keys} keys in open jobs; a job of {keys} "
                               f"more exceeds max_job_keys ({self.max_job_keys}): retry once jobs finished")
        return cost

    def _refuse_finished(self, engine: Engine, job_id: int) -> None:
        tomb = self.tombstones.get((engine.serial, job_id))
        if tomb is not None:
            self._refuse_settled(*tomb, job_id)

    @staticmethod
    def _refuse_settled(kind: JobKind, state: JobState, cause: AbortCause | None, job_id: int) -> None:
        """The precise error for a request naming a job that is no longer open."""
        if state is JobState.ABORTED:
            code = ErrorCode.TIMEOUT if cause is AbortCause.TIMEOUT else ErrorCode.ABORTED
            raise RequestError(code, f"{kind.value} job {job_id} was aborted ({cause.value})")
        raise RequestError(ErrorCode.CONFLICT, f"{kind.value} job {job_id} already finished; job ids are not reused")

    def _open_job(self, session: Session, job_id: int, kind: JobKind) -> Job:
        job = session.engine.jobs.get(job_id)
        if job is None or job.state is not JobState.OPEN:
            if job is not None:
                self._refuse_settled(job.kind, job.state, job.cause, job_id)
            self._refuse_finished(session.engine, job_id)
            raise RequestError(ErrorCode.UNKNOWN_JOB, f"no job {job_id} for engine {session.engine.id!r}")
        if job.kind is not kind:
            raise RequestError(ErrorCode.CONFLICT, f"job {job_id} is a {job.kind.value} job")
        return job

    @staticmethod
    def _rank_of(session: Session, what: str) -> int:
        if session.rank is None:
            raise RequestError(ErrorCode.FORBIDDEN, f"a coordinator session cannot {what}; ranks do")
        return session.rank

    # ------------------------------------------------------------------ store
    def store(self, session: Session, job_id: int, keys: list[bytes], chain: bool = True,
              cold_tail: int = 0) -> tuple[bytes, bytes]:
        """Open or join a store job. Returns (outcome byte per key, this rank's pages per WRITE key).

        A writer rank gets its shard's pages for each WRITE key (in key order) and must commit
        after copying; a non-writer rank's request is its vote; a coordinator gets no pages.
        ``chain`` and ``cold_tail`` (how many of the last keys the client expects no reuse of) go
        to the eviction policy when the entries become READY; the job's first request sets them.
        """
        job, new = self._job(session, job_id, JobKind.STORE, keys)
        if new:
            job.write, job.outcomes, present = self.writes.begin(WriterKind.RANK, job_id, job.engine.ns, keys)
            written = len(job.write.slots)
            self.counters["store_written_keys"] += written
            self.counters["store_present_keys"] += present
            self.counters["store_no_space_keys"] += len(keys) - written - present
            job.chain = chain
            if cold_tail:
                job.cold = job.outcomes[max(0, len(keys) - cold_tail):].count(StoreOutcome.WRITE)
        rank = session.rank
        if rank is None:
            return job.outcomes, b""
        job.seen.add(rank)
        if rank in job.engine.writers:
            if rank in job.done_ranks:
                # Its commit settled its pages: handing them again would fence READY pages for it
                # and keep the job past its end, waiting for a second commit (issue 26 A).
                raise RequestError(ErrorCode.CONFLICT, f"rank {rank} already committed store job {job_id}: a writer "
                                                       "stores a job once, then commits it once")
            # fenced for this writer before the reply hands them out
            return job.outcomes, self.writes.hand(job.write, rank, session.writer, rank)
        self._vote(job, rank)
        return job.outcomes, b""

    def commit(self, session: Session, job_id: int, ok: bool, checksums: list[int] | None = None) -> None:
        """A rank's vote on a store job; writers send it after their copy completed, with the
        checksums of their shard of each entry when the daemon keeps checksums."""
        rank = self._rank_of(session, "vote")
        job = self._find_for_vote(session, job_id)
        if job.state is JobState.ABORTED:       # a writer acknowledging an aborted job's copy (a late final)
            self.writes.settle(job.write, rank)
            self._drop_if_settled(job)
            self._refuse_settled(job.kind, job.state, job.cause, job_id)
        if rank not in job.seen:
            raise RequestError(ErrorCode.CONFLICT, f"rank {rank} commits store job {job_id} before storing it")
        if ok and checksums is None and self.checksums and rank in job.engine.writers:
            raise RequestError(ErrorCode.BAD_REQUEST, f"this kvtierd keeps checksums (setting checksums): the commit "
                               f"of job {job_id} must carry the checksum of rank {rank}'s shard of each entry")
        if checksums is not None and ok:
            entries = len(job.write.slots)
            writes = entries if rank in job.engine.writers else 0
            if rank not in job.engine.writers or len(checksums) != entries:
                raise RequestError(ErrorCode.BAD_REQUEST, f"commit of job {job_id} carries {len(checksums)} "
                                   f"checksums; rank {rank} writes {writes} entries")
            job.shard_sums[rank] = checksums
        self.writes.settle(job.write, rank)     # its copy is over, whatever its vote: no more fence
        if not ok:
            self._abort(job, AbortCause.VOTE_FAILED)
            return
        self._vote(job, rank)

    def _find_for_vote(self, session: Session, job_id: int) -> Job:
        job = session.engine.jobs.get(job_id)
        if (job is not None and job.kind is JobKind.STORE and job.state is JobState.ABORTED
                and session.rank in job.handed):
            return job                        # aborted, its pages wait for this writer's commit
        return self._open_job(session, job_id, JobKind.STORE)

    def _vote(self, job: Job, rank: int) -> None:
        job.done_ranks.add(rank)
        engine = job.engine
        if len(job.done_ranks) < len(engine.node_ranks):
            return
        # Every rank voted, the writers after their copies: the entries become READY.
        writers = sorted(engine.writers)
        sums = [job.shard_sums[r] for r in writers] if self.checksums and all(
            r in job.shard_sums for r in writers) else None
        n = len(self.writes.complete(job.write, sums=sums, chain=job.chain, cold=job.cold))
        ns_id = engine.ns.id
        self.counters["bytes_written"] += n * ns_id.entry_bytes
        if ns_id.sharding is Sharding.REPLICATED:
            self.counters["bytes_saved_dedup"] += n * ns_id.block_bytes * (len(engine.node_ranks) - 1)
        self.counters["store_jobs_done"] += 1
        self.vote_wait.observe(self.clock() - job.opened)
        self._finish(job, JobState.DONE)

    # ------------------------------------------------------------------ load
    def load(self, session: Session, job_id: int, keys: list[bytes], lease: int | None = None
             ) -> tuple[int, bytes]:
        """Open or join a load job. Returns (hits, this rank's pages per hit key).

        The first request pins the READY prefix of ``keys`` — as much of it as the engine may
        hold (``kvtierd.holds``; the rest are misses); they stay pinned until every rank released
        the job (or it is aborted). It also consumes ``lease``, after pinning (later requests of
        the job ignore it); the lease's pages count as room, so a load of leased keys is whole.
        """
        job, new = self._job(session, job_id, JobKind.LOAD, keys)
        if new:
            engine = job.engine
            ready = self.index.ready(engine.ns, keys)
            returned = self.leases.pages_of(engine, lease) if lease is not None else 0
            job.slots = ready[:self.holds.fit(engine, len(ready), returned)]
            self.index.pin(job.slots, engine)
            if lease is not None:
                self.leases.consume(job.engine, lease)
            self.counters["load_hit_keys"] += len(job.slots)
            self.counters["load_miss_keys"] += len(keys) - len(job.slots)
        hits = len(job.slots)
        if session.rank is None:
            return hits, b""
        job.seen.add(session.rank)
        return hits, self.index.pages_of(job.engine.ns, job.slots, session.rank)

    def release(self, session: Session, job_id: int) -> None:
        """A rank finished copying a load job's blocks out of the region."""
        rank = self._rank_of(session, "release a load")
        job = self._open_job(session, job_id, JobKind.LOAD)
        if rank not in job.seen:
            raise RequestError(ErrorCode.CONFLICT, f"rank {rank} releases load job {job_id} before loading it")
        job.done_ranks.add(rank)
        if len(job.done_ranks) == len(job.engine.node_ranks):
            self._unpin(job)
            self.counters["load_jobs_done"] += 1
            self._finish(job, JobState.DONE)

    def _unpin(self, job: Job) -> None:
        self.index.unpin(job.slots, job.engine)
        job.slots = NO_SLOTS

    # ------------------------------------------------------------------ abort and finish
    def abort(self, session: Session, job_id: int) -> None:
        """Any session of the engine gives up an open job; aborting an aborted job is a no-op."""
        job = session.engine.jobs.get(job_id)
        if job is not None and job.state is JobState.OPEN:
            self._abort(job, AbortCause.ABORTED_BY_CLIENT)
            return
        tomb = self.tombstones.get((session.engine.serial, job_id))
        if tomb is not None and tomb[1] is JobState.ABORTED:
            return
        self._open_job(session, job_id, JobKind.STORE)   # raises the precise error

    def _abort(self, job: Job, cause: AbortCause) -> None:
        if job.state is not JobState.OPEN:
            return
        job.cause = cause
        if job.kind is JobKind.STORE:
            self.counters["store_aborted_keys"] += len(job.write.slots)
            self.writes.abort(job.write)
        else:
            self._unpin(job)
        self.aborted[cause.value] += 1
        log.info("%s job %d of engine %r aborted: %s", job.kind.value, job.id, job.engine.id, cause.value)
        self._finish(job, JobState.ABORTED)

    def _drop_if_settled(self, job: Job) -> None:
        """A finished job leaves the engine's open jobs once no writer may still commit it."""
        if job.state is not JobState.OPEN and not job.handed:
            job.engine.jobs.pop(job.id, None)

    def _finish(self, job: Job, state: JobState) -> None:
        job.state = state
        engine = job.engine
        engine.open_keys -= job.cost
        self.open_keys -= job.cost
        job.keys = []                     # compared only while open; a job kept for a late commit needs none
        tomb = (job.kind, state, job.cause)
        self.tombstones[(engine.serial, job.id)] = self._tomb_values.setdefault(tomb, tomb)
        if len(self.tombstones) > self.max_tombstones:
            self.tombstones.popitem(last=False)
        self._drop_if_settled(job)

    # ------------------------------------------------------------------ sessions leaving
    def rank_gone(self, engine: Engine, rank: int, end: SessionEnd) -> None:
        """A rank's session ended: the open jobs still waiting for it abort (``rank_<end>``; its
        pages stay parked under its writer, whose fate the fence decides), and no job waits for
        its commit any more."""
        cause = AbortCause(f"rank_{end.value}")
        for job in list(engine.jobs.values()):
            if job.state is JobState.OPEN and rank not in job.done_ranks:
                self._abort(job, cause)
        for job in list(engine.jobs.values()):
            if job.write is not None and self.writes.drop_writer(job.write, rank):
                self._drop_if_settled(job)

    def engine_gone(self, engine: Engine) -> None:
        """The engine's last session ended: its open jobs abort (its writers' fenced pages are the
        fence's; its tombstones, keyed by its serial, are never matched again and age out)."""
        for job in list(engine.jobs.values()):
            if job.state is JobState.OPEN:
                self._abort(job, AbortCause.ENGINE_LEFT)

    # ------------------------------------------------------------------ deadlines
    def _push_deadline(self, deadline: float, engine_id: str, job_id: int) -> None:
        heap = self._deadlines
        heapq.heappush(heap, (deadline, next(self._seq), engine_id, job_id))
        # A finished job's entry stays until its deadline comes up: at thousands of jobs per
        # second that is job_timeout's worth of them. Rebuilt from the jobs that still need one
        # whenever it doubled since the last rebuild (amortised: one pass per as many pushes).
        if len(heap) > self._compact_at:
            live = [item for item in heap if self._needs_deadline(item)]
            heapq.heapify(live)
            self._deadlines = live
            self._compact_at = max(4096, 2 * len(live))

    def _needs_deadline(self, item: tuple[float, int, str, int]) -> bool:
        engine = self.engines.get(item[2])
        job = engine.jobs.get(item[3]) if engine is not None else None
        return job is not None and job.state is JobState.OPEN

    def expire(self) -> float | None:
        """Abort jobs past their deadline (their writers' pages stay fenced). Returns the next deadline."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, engine_id, job_id = heapq.heappop(self._deadlines)
            engine = self.engines.get(engine_id)
            job = engine.jobs.get(job_id) if engine is not None else None
            if job is not None and job.state is JobState.OPEN and job.deadline <= now:
                self._abort(job, AbortCause.TIMEOUT)
        return self._deadlines[0][0] if self._deadlines else None

    # ------------------------------------------------------------------ what is going on
    def job_states(self, session: Session, job_ids: list[int]) -> list[dict]:
        out = []
        for job_id in job_ids:
            job = session.engine.jobs.get(job_id)
            if job is not None and job.state is JobState.OPEN:
                out.append({"job": job_id, "kind": job.kind.value, "state": JobState.OPEN.value,
                            "waiting": len(job.engine.node_ranks) - len(job.done_ranks)})
                continue
            tomb = self.tombstones.get((session.engine.serial, job_id))
            if tomb is None:
                out.append({"job": job_id, "state": "unknown"})
            else:
                kind, state, cause = tomb
                out.append({"job": job_id, "kind": kind.value, "state": state.value,
                            "cause": cause.value if cause else ""})
        return out

    def open_jobs(self, kind: JobKind | None = None) -> int:
        return sum(1 for e in self.engines.values() for j in e.jobs.values()
                   if j.state is JobState.OPEN and (kind is None or j.kind is kind))

    def stats(self) -> dict:
        return {
            "open_jobs": self.open_jobs(),
            "jobs_held": sum(len(e.jobs) for e in self.engines.values()),
            "open_job_keys": self.open_keys,
            "tombstones": len(self.tombstones),
            "aborted_jobs": dict(self.aborted),
            "vote_wait": self.vote_wait.snapshot(),
        }

    def held(self) -> Counter:
        """Engine → the pages its load jobs' pins hold (``Holds.verify_holders``)."""
        held: Counter = Counter()
        for engine in self.engines.values():
            for job in engine.jobs.values():
                if job.kind is JobKind.LOAD:
                    held[engine] += len(job.slots) * engine.ns.entry_pages
        return held

    def verify(self) -> None:
        """No settled job left in an engine's table: only open ones, and aborted store jobs that
        wait for a writer's commit (tests, ``Store.verify``)."""
        for engine in self.engines.values():
            assert all(job.state is JobState.OPEN or (job.state is JobState.ABORTED and job.handed)
                       for job in engine.jobs.values()), f"engine {engine.id!r} holds a settled job"

"""Each request's lookups: one batched, leased lookup of all its keys, and the verdict that answers
its per-key lookups from then on.

Two rules shape it (docs/vllm.md has the measurements):

- **One kvtierd request per request, not one per block.** An engine like vLLM asks ``lookup`` one
  key at a time, thousands of times for a long prompt, and again every step while the request
  waits for GPU blocks. ``Lookups`` answers from one batched ``lookup`` of all the request's keys
  and keeps the answer (a ``Request``, which the engine keeps with its request).
- **A HIT stays loadable.** That batched lookup leases its hits (``lease_ttl``): kvtierd holds
  them for the engine until the load names the lease (``jobs.JobPart.lease``), the request lets
  them go, or they expire. A request that waits for GPU blocks has its leases renewed (the same
  lookup, the same lease ids) once half their ttl passed, in the background, answered from the
  answer it has meanwhile.
- **The scheduler never waits on kvtierd beyond ``wait_s``.** The batch runs on the ``Link``
  thread and only a request's first batch is waited for, at most ``wait_s``; an answer that comes
  later is used next step. After a wait ran out, no request waits until kvtierd answered again
  (they are deferred), and after ``GIVE_UP_S`` without an answer they are misses. While the link
  is down every lookup is a miss at once.

Answers are the engine's own values (``Answers``: vLLM passes its ``LookupResult`` members), so
the per-key hot path returns what the verdict holds without mapping it. All of it runs on the
scheduler thread; the link thread only runs ``_ready_prefixes``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Collection, Iterable, NamedTuple

from ...session import Client
from ..common import PART_KEYS
from .keys import group_of, grouped, kvtier_keys
from .link import LOST, Link
from .stats import ManagerStats

logger = logging.getLogger("vllm.kvtier")

# How long a batched lookup that holds no lease answers the request's later lookups (leases off,
# or every hit past kvtierd's caps): a block may be evicted meanwhile (the load then comes back
# short and is reported); asking again once a second keeps it young in kvtierd.
LOOKUP_RESULTS_TTL_S = 1.0

# A leased answer is used for this share of the ttl kvtierd granted (counted from when the lookup
# was sent), and renewed once half of it passed: the margin covers a renewal answered late.
LEASE_USE = 0.8
LEASE_RENEW = 0.5

# After a wait for kvtierd ran out, the scheduler does not wait again until the link has an answer
# (a hung daemon costs one wait); requests asked meanwhile are deferred (RETRY), and after this
# long without an answer they are answered MISS instead, so that they do not wait for kvtierd.
GIVE_UP_S = 0.1


class Answer(enum.Enum):
    """What a lookup of one key answers, engine-free."""

    HIT = "hit"                       # cached and ready (and leased): load it
    MISS = "miss"                     # compute it
    RETRY = "retry"                   # ask again next step (kvtierd's answer is on its way)
    PENDING = "pending"               # being stored by this engine, or promoted from a second tier


class Answers(NamedTuple):
    """The engine's values for each ``Answer``."""

    hit: Any
    miss: Any
    retry: Any
    pending: Any


ANSWERS = Answers(Answer.HIT, Answer.MISS, Answer.RETRY, Answer.PENDING)


@dataclasses.dataclass(eq=False)
class Request:
    """What the scheduler side knows about one request (the engine keeps it with the request)."""

    req_id: str
    verdict: dict | None = None       # key -> answer, from the last batch (None: ask kvtierd)
    recheck_step: int = -1            # the verdict holds keys kvtierd is promoting: good for this step only
    start: int = 0                    # end-token position of the batch's first key
    npos: int = -1                    # how many key positions the engine had recorded for the batch
    expires: float = 0.0
    renew_at: float = float("inf")    # when to renew the verdict's leases
    epoch: int = -1                   # the link's epoch (coordinator session) the verdict came from
    valid_step: int = -1              # the step in which ``verdict`` was last checked as current
    lease_ids: dict = dataclasses.field(default_factory=dict)  # (group, chunk) -> the lease id it uses
    held: set = dataclasses.field(default_factory=set)         # lease ids kvtierd holds for the verdict
    groups: list = dataclasses.field(default_factory=list)     # the verdict's batch: its keys per group
    lease_of: dict = dataclasses.field(default_factory=dict)   # leased key -> its lease id
    pending: Future | None = None     # the batch in flight
    pending_batch: tuple = ()         # (start, npos, [per-group keys], when sent) of that batch
    retry_step: int = -1              # the step in which it last answered RETRY
    retry_groups: set = dataclasses.field(default_factory=set)   # the KV-cache groups it answered RETRY then
    collected: list | None = None     # public path: keys answered RETRY this step, to batch
    load_failed: bool = False         # a load of it failed: MISS from now on


class Lookups:
    """The requests' lookups (module docstring). ``positions(engine_request)`` gives the key ->
    end-token position map the engine recorded for a request before its first lookup, or None
    where the engine shows none (then keys answered RETRY are collected and batched at
    ``schedule_end``)."""

    def __init__(self, link: Link, stats: ManagerStats, num_groups: int, wait_s: float, lease_ttl: float | None,
                 positions: Callable[[Any], dict | None], answers: Answers = ANSWERS,
                 clock: Callable[[], float] = time.monotonic):
        self._link = link
        self.stats = stats
        self.num_groups = num_groups                   # offloaded KV-cache groups
        self._wait_s = wait_s
        self._lease_ttl = lease_ttl                    # None: no leases
        self._positions = positions
        self.answers = answers
        self._clock = clock
        self.step = 0
        self._next_lease = 1
        self._stalled_at: tuple[int, float] | None = None   # (link.replies, when) as a wait last ran out
        self._requests: dict[str, Request] = {}
        self._collecting: list[Request] = []

    def track(self, req_id: str) -> Request:
        state = self._requests[req_id] = Request(req_id)
        return state

    def _lease_id(self, state: Request, slot: tuple) -> int:
        """The lease id of one (group, chunk) of the request's batches: the same on renewal."""
        lease = state.lease_ids.get(slot)
        if lease is None:
            lease = state.lease_ids[slot] = self._next_lease
            self._next_lease += 1
        return lease

    def stalled(self) -> bool:
        """A wait ran out and the link has had no answer since: do not wait again."""
        if self._stalled_at is None:
            return False
        if self._stalled_at[0] != self._link.replies:
            self._stalled_at = None
            return False
        return True

    def given_up(self) -> bool:
        """Stalled for GIVE_UP_S: kvtierd looks hung; answer MISS rather than defer requests."""
        return self.stalled() and self._clock() - self._stalled_at[1] >= GIVE_UP_S

    # --- one key
    def lookup(self, key: bytes, state: Request, engine_request: Any) -> Any:
        """The answer for ``key`` of the request ``state`` (the engine's hot path, a dict lookup
        in the current verdict, is the caller's: see ``current``)."""
        a = self.answers
        if state.load_failed:
            return a.miss
        if not self._link.up or self.given_up():
            # kvtierd away, or silent for GIVE_UP_S: no HIT from an earlier answer either (its
            # load could not be served)
            self.stats.down += 1
            return a.miss
        positions = self._positions(engine_request)
        if state.pending is not None and state.pending.done():
            self._absorb(state)
        known = self._known(state, key, positions)
        if known is not None:
            return known
        if state.pending is not None:
            return self._retry(state, key)
        if positions is None:
            return self._collect(state, key)
        return self._batch(state, key, positions)

    def _known(self, state: Request, key: bytes, positions: dict | None) -> Any:
        """The answer from the request's current batch; None when kvtierd must be asked."""
        verdict = state.verdict
        if verdict is None:
            return None
        now = self._clock()
        if now >= state.expires or state.epoch != self._link.epoch:
            return None                       # lapsed, or from a session before a restart (its leases are gone)
        if state.recheck_step not in (-1, self.step):
            return None                       # kvtierd was promoting some of them: ask again
        if positions is not None and len(positions) != state.npos:
            return None                       # the request grew (e.g. preempted, then resumed)
        if now >= state.renew_at and state.pending is None:
            self._renew(state)
        state.valid_step = self.step
        result = verdict.get(key)
        if result is not None:
            return result
        if positions is None:
            return None                       # public path: a key not asked yet
        position = positions.get(key)
        if position is not None and position < state.start:
            return None                       # before the batch: the engine's GPU prefix hit shrank
        return self.answers.miss

    def _retry(self, state: Request, key: bytes) -> Any:
        """RETRY once per KV-cache group and step: vLLM then scans on to the group's next key,
        which gets MISS and ends its scan; the request is deferred and asked again next step.
        (A group whose first answer is MISS would make vLLM drop the request's hit altogether.)"""
        if state.retry_step != self.step:
            state.retry_step, state.retry_groups = self.step, set()
        group = group_of(key)
        if group in state.retry_groups:
            return self.answers.miss
        state.retry_groups.add(group)
        self.stats.retries += 1
        return self.answers.retry

    def _collect(self, state: Request, key: bytes) -> Any:
        if state.collected is None:
            state.collected = []
            self._collecting.append(state)
        state.collected.append(key)
        self.stats.retries += 1
        return self.answers.retry

    def _batch(self, state: Request, key: bytes, positions: dict) -> Any:
        """Ask kvtierd about every key of the request from ``key``'s position on, in one request
        per KV-cache group, and wait a bounded time."""
        start = positions.get(key)
        if start is None:
            return self.answers.miss
        if self.num_groups == 1:                    # positions grow with insertion order: a C-level cut
            keys = list(positions)
            batch = [keys[keys.index(key):]]
        else:
            batch = grouped(k for k, position in positions.items() if position >= start)
        self._send_batch(state, start, len(positions), batch)
        if not self.stalled():
            waiting = time.perf_counter()
            try:
                state.pending.exception(self._wait_s)
                answered = True
            except FutureTimeout:
                answered = False
            self.stats.waited_s += time.perf_counter() - waiting
            if answered:
                self._absorb(state)
                return self._known(state, key, positions) or self.answers.miss
            self._stalled_at = (self._link.replies, self._clock())
            self.stats.late += 1
        return self._retry(state, key)

    # --- the batch
    def _send_batch(self, state: Request, start: int, npos: int, groups: list[list]) -> None:
        """One batched lookup of the request's keys (per KV-cache group), leasing what it finds
        under the request's lease ids (the same ids again renew)."""
        self.stats.batches += 1
        leases = None
        if self._lease_ttl is not None:
            leases = [[self._lease_id(state, (group_of(keys[0]), chunk)) for chunk in range(-(-len(keys) // PART_KEYS))]
                      for keys in groups]
        state.pending = self._link.submit(functools.partial(self._ready_prefixes, groups, leases))
        state.pending_batch = (start, npos, groups, self._clock())

    def _renew(self, state: Request) -> None:
        """Send the request's batch again, not waited for: its leases are renewed, and the answer
        replaces the verdict when it comes."""
        self.stats.renewals += 1
        self._send_batch(state, state.start, state.npos, state.groups)

    def _ready_prefixes(self, groups: list[list], leases: list[list] | None, client: Client) -> tuple:
        """(link thread) Per group: the ready prefix length of its keys and how many keys after it
        kvtierd is promoting from its second tier (pending), and (lease id, first key, keys held)
        of each lease that holds some; the shortest ttl granted; the session's epoch."""
        prefixes, held, ttl = [], [], None
        for index, keys in enumerate(groups):
            tkeys, hits, pending, spans = kvtier_keys(keys), 0, 0, []
            for chunk, begin in enumerate(range(0, len(tkeys), PART_KEYS)):
                part = tkeys[begin:begin + PART_KEYS]
                self._link.requests += 1
                if leases is None:
                    found = client.lookup_detail(part)
                else:
                    lease = leases[index][chunk]
                    found = client.lookup_detail(part, lease=lease, ttl=self._lease_ttl)
                    granted = client.lease_held(lease)
                    if granted is not None:
                        spans.append((lease, begin, granted.leased))
                        ttl = granted.ttl if ttl is None else min(ttl, granted.ttl)
                hits += found.hits
                if found.hits < len(part):
                    pending = found.pending
                    break
            prefixes.append((hits, pending))
            held.append(spans)
        return prefixes, held, ttl, client.attachments

    def _absorb(self, state: Request) -> None:
        """Turn the finished batch into the request's verdict (all MISS if kvtierd refused it)."""
        future, state.pending = state.pending, None
        start, npos, groups, sent = state.pending_batch
        state.pending_batch = ()
        try:
            prefixes, held, ttl, epoch = future.result()
        except LOST:                          # asked again once the link is back
            state.verdict, state.valid_step = None, -1
            return
        except Exception as exc:              # kvtierd refused: these keys are misses (for a while)
            logger.debug("kvtier: lookup of request %s failed: %s", state.req_id, exc)
            prefixes, held, ttl, epoch = [(0, 0)] * len(groups), [[] for _ in groups], None, self._link.epoch
        a = self.answers
        verdict: dict = {}
        lease_of: dict = {}
        for keys, (hits, pending), spans in zip(groups, prefixes, held):
            verdict.update(dict.fromkeys(keys[:hits], a.hit))
            # Being promoted from kvtierd's second tier: PENDING (the engine defers the request and
            # asks again next step) rather than computing them or waiting here.
            verdict.update(dict.fromkeys(keys[hits:hits + pending], a.pending))
            verdict.update(dict.fromkeys(keys[hits + pending:], a.miss))
            for lease, begin, leased in spans:
                lease_of.update(dict.fromkeys(keys[begin:begin + leased], lease))
        now_held = {lease for spans in held for lease, _, _ in spans}
        self._release(state.held - now_held)  # leases of chunks this batch no longer reached
        state.verdict, state.start, state.npos, state.epoch = verdict, start, npos, epoch
        state.held, state.lease_of, state.groups = now_held, lease_of, groups
        if ttl is None:
            state.expires, state.renew_at = self._clock() + LOOKUP_RESULTS_TTL_S, float("inf")
        else:
            state.expires, state.renew_at = sent + ttl * LEASE_USE, sent + ttl * LEASE_RENEW
        state.recheck_step = self.step if any(pending for _, pending in prefixes) else -1
        state.valid_step = -1

    # --- leases
    def _release(self, leases: Collection[int]) -> None:
        """Release these leases in the background (a lapsed link: kvtierd lost or expires them)."""
        if leases and self._link.up:
            self._link.send(functools.partial(self._unlease, sorted(leases)))

    def _unlease(self, leases: list[int], client: Client) -> None:
        self._link.requests += 1
        client.unlease(leases)

    def _forget(self, state: Request) -> None:
        """Drop the request's answer and release its leases; a later lookup asks kvtierd again."""
        self._release(state.held)
        state.verdict, state.valid_step, state.held, state.lease_of = None, -1, set(), {}

    def loading(self, state: Request, used: Collection[int]) -> None:
        """The request's load names the leases ``used`` (its jobs consume them); the others are
        released, and a later lookup (recompute, preemption) asks again under new lease ids."""
        state.held -= set(used)
        self._forget(state)
        state.lease_ids = {}

    # --- the engine's other calls
    def schedule_end(self) -> None:
        """The step ended: batch the keys collected on the public path."""
        self.step += 1
        collecting, self._collecting = self._collecting, []
        for state in collecting:
            keys, state.collected = state.collected, None
            if state.req_id not in self._requests or not self._link.up or state.pending is not None:
                continue
            if state.verdict is not None and self._clock() < state.expires:
                keys = [*state.verdict, *keys]    # one batch holds all the request's keys (and leases)
            self._send_batch(state, 0, -1, grouped(dict.fromkeys(keys)))

    def touch(self, keys: Collection[bytes]) -> None:
        """Tell kvtierd these keys were used (in the background)."""
        if keys and self._link.up:
            self._link.send(functools.partial(self._ready_prefixes, [list(keys)], None))

    def finished(self, req_id: str) -> None:
        state = self._requests.pop(req_id, None)
        if state is not None:
            self._forget(state)

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """The workers could not load these requests' blocks: answer MISS for them from now on, so
        that a request the engine recomputes is not offered the same load again."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None and not state.load_failed:
                self._forget(state)
                state.load_failed = True
                self.stats.load_failures += 1
                logger.warning("kvtier: request %s: loading its blocks from kvtierd failed; its lookups are "
                               "misses from now on", req_id)

    def reset(self) -> None:
        """Forget every answer (and release its leases)."""
        for state in self._requests.values():
            self._forget(state)

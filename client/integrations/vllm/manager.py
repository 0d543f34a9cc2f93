"""The scheduler side: vLLM's ``OffloadingManager`` as a kvtierd coordinator session.

The scheduler process's ``KvtierOffloadingManager`` is the *coordinator* session (rank None) of
the vLLM engine's kvtier engine: it looks up keys and opens the kvtier jobs that the workers'
rank sessions then carry out (kvtier.integrations.vllm.transfer says how their ids travel). Its
class docstring gives the contract per vLLM method.

Two rules shape it (docs/vllm.md has the measurements):

- **One kvtierd request per request, not one per block.** vLLM asks
  ``lookup`` one key at a time, thousands of times for a long prompt, and again every step while
  the request waits for GPU blocks. The manager answers from one batched ``lookup`` of all the
  request's keys and keeps the answer (per request, in vLLM's ``ReqContext``).
- **A HIT stays loadable.** That batched lookup leases its hits (``kvtier_lease_ttl_s``): kvtierd
  holds them for this engine until the load names the lease (``JobPart.lease``: the ranks' load
  job, or the manager's own ``open_load``, consumes it), the manager releases it, or it expires.
  A request that waits for GPU blocks has its lease renewed (the same lookup, the same lease ids)
  once half its ttl passed, in the background, answered from the answer it has meanwhile.
- **The scheduler thread never waits on kvtierd beyond ``kvtier_lookup_wait_ms``.** All I/O runs
  on a ``Link`` thread, and only a request's batched lookup is waited for; stores and loads are
  opened in the background. While kvtierd is unreachable every lookup is a MISS at once and
  nothing is stored.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Callable, Collection, Iterable

import numpy as np
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvtierd.contract.errors import KvtierError
from kvtierd.contract.namespace import NamespaceId

from ... import StoreOutcome
from ...api import Client
from .link import LOST, Call, Link
from .settings import PART_KEYS, KvtierSettings, kvtier_keys
from .transfer import JobPart, KvtierLoadStoreSpec

# A child of vLLM's logger, so that these lines go where vLLM's own go.
logger = logging.getLogger("vllm.kvtier")

# How long a batched lookup that holds no lease answers the request's later lookups (leases off,
# or every hit past kvtierd's caps): a block may be evicted meanwhile (the load then comes back
# short and is reported, see connector.py); asking again once a second keeps it young in kvtierd.
LOOKUP_RESULTS_TTL_S = 1.0

# A leased answer is used for this share of the ttl kvtierd granted (counted from when the lookup
# was sent), and renewed once half of it passed: the margin covers a renewal answered late.
LEASE_USE = 0.8
LEASE_RENEW = 0.5

# After a wait for kvtierd ran out, the scheduler does not wait again until the link has an answer
# (a hung daemon costs one wait); requests asked meanwhile are deferred (RETRY), and after this
# long without an answer they are answered MISS instead, so that they do not wait for kvtierd.
GIVE_UP_S = 0.1

# After a store found no room for any of its keys (every entry pinned or being written), the
# manager answers "not stored" without asking kvtierd for this long.
FULL_REGION_BACKOFF_S = 1.0

# vLLM 0.33's ReqContext records the end-token position of every offload key of the request
# before its first lookup (OffloadingConnectorScheduler.update_offload_keys), in this private
# dict; no public API lists a request's keys. It is read only on the vLLM series this was checked
# against; elsewhere the manager takes the public path (RETRY, collect, batch at on_schedule_end).
KEY_POSITIONS_ATTR = "_offload_key_positions"
KEY_POSITIONS_SERIES = ("0.33",)

_HIT, _MISS, _RETRY, _PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING


def key_positions_readable(version: str | None = None) -> bool:
    """Whether this vLLM's ReqContext is known to hold ``KEY_POSITIONS_ATTR``: a checked series,
    and the field is there."""
    from packaging.version import InvalidVersion, Version
    try:
        parsed = Version(vllm.__version__ if version is None else version)
    except InvalidVersion:
        return False
    return (f"{parsed.major}.{parsed.minor}" in KEY_POSITIONS_SERIES
            and KEY_POSITIONS_ATTR in {f.name for f in dataclasses.fields(ReqContext)})


@dataclasses.dataclass(eq=False)
class _Request:
    """What the manager knows about one vLLM request (kept in its ReqContext)."""

    req_id: str
    verdict: dict | None = None       # key -> HIT/HIT_PENDING/MISS, from the last batch (None: ask kvtierd)
    recheck_step: int = -1            # the verdict holds keys kvtierd is promoting: good for this step only
    start: int = 0                    # end-token position of the batch's first key
    npos: int = -1                    # how many key positions vLLM had recorded for the batch
    expires: float = 0.0
    renew_at: float = float("inf")    # when to renew the verdict's leases
    epoch: int = -1                   # the link's epoch (coordinator session) the verdict came from
    valid_step: int = -1              # the step in which ``verdict`` was last checked as current
    lease_ids: dict = dataclasses.field(default_factory=dict)  # (group, chunk) -> the lease id it uses
    held: set = dataclasses.field(default_factory=set)         # lease ids kvtierd holds for the verdict
    groups: list = dataclasses.field(default_factory=list)     # the verdict's batch: its keys per group
    lease_of: dict = dataclasses.field(default_factory=dict)   # leased key -> its lease id
    pending: Call | None = None       # the batch in flight
    pending_batch: tuple = ()         # (start, npos, [per-group keys], when sent) of that batch
    retry_step: int = -1              # the step in which it last answered RETRY
    retry_groups: set = dataclasses.field(default_factory=set)   # the KV-cache groups it answered RETRY then
    collected: list | None = None     # public path: keys answered RETRY this step, to batch
    load_failed: bool = False         # a load of it failed: MISS from now on


@dataclasses.dataclass
class ManagerStats:
    """Counters for the benchmark and the logs (scheduler thread only)."""

    batches: int = 0                  # batched lookups sent
    late: int = 0                     # lookup waits that ran out (answered next step)
    waited_s: float = 0.0             # time the scheduler thread spent waiting for kvtierd
    retries: int = 0                  # RETRY answers
    down: int = 0                     # lookups answered MISS without asking (kvtierd away or slow)
    stores_skipped: int = 0           # prepare_store answered "not stored" without asking
    load_failures: int = 0            # requests whose load failed (reported by the connector)
    renewals: int = 0                 # batches sent to renew a waiting request's leases
    leased_loads: int = 0             # load jobs that named a lease


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's OffloadingManager backed by a kvtierd coordinator session (scheduler process).

    Contract, per vLLM method:

    - ``lookup(key)``: HIT_PENDING while a store of the key that this manager prepared has not
      completed; else the verdict of the request's batched lookup (HIT for the ready prefix of its
      keys, HIT_PENDING for the keys after it that kvtierd is promoting from its second tier —
      vLLM defers the request and the manager asks kvtierd again next step —, MISS after them).
      The first lookup of a request sends one batched ``lookup`` of all its keys (from that key
      on, per KV-cache group, leasing the hits) and waits for it at most
      ``kvtier_lookup_wait_ms``; later lookups, including every step while the request waits
      for GPU blocks, are dict lookups (the leases renewed in the background). An answer that
      comes later is used next step (this step: RETRY once per KV-cache group, then MISS, so
      that vLLM defers the request without scanning on). After a wait ran out, no request waits until kvtierd answered again (they
      are deferred), and after ``GIVE_UP_S`` without an answer they get MISS. MISS at once
      while kvtierd is unreachable, and for a request whose load failed.
      Where vLLM's key positions are not readable (another vLLM series): RETRY for every key,
      which lets vLLM show all of them, and one batch per request at ``on_schedule_end``.
    - ``prepare_store(keys)``: never waits. Returns every offered key in kvtier store jobs, which
      it opens in the background; kvtierd decides per key (write / present / no room) and the
      workers copy what it decided to write, so an offered key may end up not stored. An empty
      output ("not stored, do not offer again") without asking while kvtierd is unreachable or
      slow, and for ``FULL_REGION_BACKOFF_S`` after a store found no room for any key; never
      ``None`` (which would make vLLM offer the keys again, and warn, every step).
      ``evicted_keys`` is always empty: kvtierd evicts on its own, across engines.
    - ``prepare_load(keys)``: returns the load's kvtier jobs at once, each naming the lease that
      holds its keys, and opens them in the background; the ranks' own load requests open them if
      they get there first. Whichever opens a job consumes its lease: the leased keys cannot come
      back short. Leases of the request the load does not use are released. A key that was not
      leased (leases off, kvtierd's caps) or whose lease was lost (revoked, a restart before the
      client re-leased it) and then evicted makes the load come back short: the workers report
      it and the request is recomputed or failed (``KvtierOffloadingConnector``).
    - ``complete_store``/``complete_load``: local bookkeeping (the ranks voted / released); a
      failed store's jobs are aborted.
    - ``on_request_finished``: releases the request's leases. ``reset_cache``: forgets this
      engine's in-flight bookkeeping and lookup answers (releasing their leases); it does not
      clear kvtierd, whose cache is shared and outlives the engine (kvtierctl clears it).
    - No KV events: kvtierd's evictions are not reported back.

    ``lock`` stays vLLM's no-op: only the scheduler thread enters the manager; the link thread
    shares nothing with it but queues and ``Call`` objects.
    """

    def __init__(self, settings: KvtierSettings, engine_id: str, world_size: int, namespace: NamespaceId,
                 num_groups: int = 1, connect: Callable[..., Client] = Client,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.engine_id = engine_id
        self.world_size = world_size
        self.namespace = namespace
        self.num_groups = num_groups                   # offloaded KV-cache groups
        self.stats = ManagerStats()
        self.use_key_positions = key_positions_readable()
        self._clock = clock
        self._wait_s = settings.lookup_wait_ms / 1000
        self._lease_ttl = settings.lease_ttl_s or None      # None: no leases
        self._next_lease = 1
        self._step = 0
        self._stalled_at: tuple[int, float] | None = None   # (link.replies, when) as a wait last ran out
        self._next_job = 1
        self._requests: dict[str, _Request] = {}
        self._collecting: list[_Request] = []
        self._writing: dict[OffloadKey, int] = {}      # key -> kvtier store job, until complete_store
        self._full_until = 0.0                         # the link thread sets it (see _open_stores)
        self._link = Link(functools.partial(connect, settings.socket, engine_id=engine_id, rank=None,
                                            world_size=world_size, namespace=namespace, timeout=settings.timeout_s,
                                            reconnect_timeout=settings.timeout_s),
                          settings.retry_s, f"coordinator of engine {engine_id} at {settings.socket}",
                          first_wait_s=settings.timeout_s + 1)

    @property
    def link(self) -> Link:
        return self._link

    def _new_job(self) -> int:
        job = self._next_job
        self._next_job += 1
        return job

    def _lease_id(self, state: _Request, slot: tuple) -> int:
        """The lease id of one (group, chunk) of the request's batches: the same on renewal."""
        lease = state.lease_ids.get(slot)
        if lease is None:
            lease = state.lease_ids[slot] = self._next_lease
            self._next_lease += 1
        return lease

    def _stalled(self) -> bool:
        """A wait ran out and the link has had no answer since: do not wait again."""
        if self._stalled_at is None:
            return False
        if self._stalled_at[0] != self._link.replies:
            self._stalled_at = None
            return False
        return True

    def _given_up(self) -> bool:
        """Stalled for GIVE_UP_S: kvtierd looks hung; answer MISS rather than defer requests."""
        return self._stalled() and self._clock() - self._stalled_at[1] >= GIVE_UP_S

    def _track(self, req_context: ReqContext) -> _Request:
        state = _Request(req_context.req_id)
        req_context.set_state(state)
        self._requests[req_context.req_id] = state
        return state

    def _key_positions(self, req_context: ReqContext) -> dict | None:
        if not self.use_key_positions:
            return None
        positions = getattr(req_context, KEY_POSITIONS_ATTR, None)
        return positions if isinstance(positions, dict) else None

    # --- lookups
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._track(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._writing:
            return _PENDING
        state = req_context.get_state(_Request)
        if state is not None and state.valid_step == self._step:       # the hot path: a dict lookup
            result = state.verdict.get(key)
            if result is not None:
                return result
        return self._lookup(key, req_context, state or self._track(req_context))

    def _lookup(self, key: OffloadKey, req_context: ReqContext, state: _Request) -> LookupResult:
        if state.load_failed:
            return _MISS
        if not self._link.up or self._given_up():
            # kvtierd away, or silent for GIVE_UP_S: no HIT from an earlier answer either (its
            # load could not be served)
            self.stats.down += 1
            return _MISS
        positions = self._key_positions(req_context)
        if state.pending is not None and state.pending.done:
            self._absorb(state)
        known = self._known(state, key, positions)
        if known is not None:
            return known
        if state.pending is not None:
            return self._retry(state, key)
        if positions is None:
            return self._collect(state, key)
        return self._batch(state, key, positions)

    def _known(self, state: _Request, key: OffloadKey, positions: dict | None) -> LookupResult | None:
        """The answer from the request's current batch; None when kvtierd must be asked."""
        verdict = state.verdict
        if verdict is None:
            return None
        now = self._clock()
        if now >= state.expires or state.epoch != self._link.epoch:
            return None                       # lapsed, or from a session before a restart (its leases are gone)
        if state.recheck_step not in (-1, self._step):
            return None                       # kvtierd was promoting some of them: ask again
        if positions is not None and len(positions) != state.npos:
            return None                       # the request grew (e.g. preempted, then resumed)
        if now >= state.renew_at and state.pending is None:
            self._renew(state)
        state.valid_step = self._step
        result = verdict.get(key)
        if result is not None:
            return result
        if positions is None:
            return None                       # public path: a key not asked yet
        position = positions.get(key)
        if position is not None and position < state.start:
            return None                       # before the batch: vLLM's GPU prefix hit shrank
        return _MISS

    def _retry(self, state: _Request, key: OffloadKey) -> LookupResult:
        """RETRY once per KV-cache group and step: vLLM then scans on to the group's next key,
        which gets MISS and ends its scan; the request is deferred and asked again next step.
        (A group whose first answer is MISS would make vLLM drop the request's hit altogether.)"""
        if state.retry_step != self._step:
            state.retry_step, state.retry_groups = self._step, set()
        group = key[-4:]
        if group in state.retry_groups:
            return _MISS
        state.retry_groups.add(group)
        self.stats.retries += 1
        return _RETRY

    def _collect(self, state: _Request, key: OffloadKey) -> LookupResult:
        if state.collected is None:
            state.collected = []
            self._collecting.append(state)
        state.collected.append(key)
        self.stats.retries += 1
        return _RETRY

    def _batch(self, state: _Request, key: OffloadKey, positions: dict) -> LookupResult:
        """Ask kvtierd about every key of the request from ``key``'s position on, in one request
        per KV-cache group (the group is a key's last 4 bytes), and wait a bounded time."""
        start = positions.get(key)
        if start is None:
            return _MISS
        if self.num_groups == 1:                    # positions grow with insertion order: a C-level cut
            keys = list(positions)
            batch = [keys[keys.index(key):]]
        else:
            groups: dict[bytes, list] = {}
            for k, position in positions.items():
                if position >= start:
                    groups.setdefault(k[-4:], []).append(k)
            batch = list(groups.values())
        self._send_batch(state, start, len(positions), batch)
        if not self._stalled():
            waiting = time.perf_counter()
            answered = state.pending.wait(self._wait_s)
            self.stats.waited_s += time.perf_counter() - waiting
            if answered:
                self._absorb(state)
                return self._known(state, key, positions) or _MISS
            self._stalled_at = (self._link.replies, self._clock())
            self.stats.late += 1
        return self._retry(state, key)

    def _send_batch(self, state: _Request, start: int, npos: int, groups: list[list]) -> None:
        """One batched lookup of the request's keys (per KV-cache group), leasing what it finds
        under the request's lease ids (the same ids again renew)."""
        self.stats.batches += 1
        leases = None
        if self._lease_ttl is not None:
            leases = [[self._lease_id(state, (keys[0][-4:], chunk)) for chunk in range(-(-len(keys) // PART_KEYS))]
                      for keys in groups]
        state.pending = self._link.submit(functools.partial(self._ready_prefixes, groups, leases))
        state.pending_batch = (start, npos, groups, self._clock())

    def _renew(self, state: _Request) -> None:
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

    def _absorb(self, state: _Request) -> None:
        """Turn the finished batch into the request's verdict (all MISS if kvtierd refused it)."""
        call, state.pending = state.pending, None
        start, npos, groups, sent = state.pending_batch
        state.pending_batch = ()
        try:
            prefixes, held, ttl, epoch = call.result()
        except LOST:                          # asked again once the link is back
            state.verdict, state.valid_step = None, -1
            return
        except Exception as exc:              # kvtierd refused: these keys are misses (for a while)
            logger.debug("kvtier: lookup of request %s failed: %s", state.req_id, exc)
            prefixes, held, ttl, epoch = [(0, 0)] * len(groups), [[] for _ in groups], None, self._link.epoch
        verdict: dict = {}
        lease_of: dict = {}
        for keys, (hits, pending), spans in zip(groups, prefixes, held):
            verdict.update(dict.fromkeys(keys[:hits], _HIT))
            # Being promoted from kvtierd's second tier: HIT_PENDING (vLLM defers the request and
            # asks again next step) rather than computing them or waiting here.
            verdict.update(dict.fromkeys(keys[hits:hits + pending], _PENDING))
            verdict.update(dict.fromkeys(keys[hits + pending:], _MISS))
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
        state.recheck_step = self._step if any(pending for _, pending in prefixes) else -1
        state.valid_step = -1

    def _release(self, leases: Collection[int]) -> None:
        """Release these leases in the background (a lapsed link: kvtierd lost or expires them)."""
        if leases and self._link.up:
            self._link.send(functools.partial(self._unlease, sorted(leases)))

    def _unlease(self, leases: list[int], client: Client) -> None:
        self._link.requests += 1
        client.unlease(leases)

    def _forget(self, state: _Request) -> None:
        """Drop the request's answer and release its leases; a later lookup asks kvtierd again."""
        self._release(state.held)
        state.verdict, state.valid_step, state.held, state.lease_of = None, -1, set(), {}

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._step += 1
        collecting, self._collecting = self._collecting, []
        for state in collecting:
            keys, state.collected = state.collected, None
            if state.req_id not in self._requests or not self._link.up or state.pending is not None:
                continue
            if state.verdict is not None and self._clock() < state.expires:
                keys = [*state.verdict, *keys]    # one batch holds all the request's keys (and leases)
            self._send_batch(state, 0, -1, _grouped(dict.fromkeys(keys)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if keys and self._link.up:
            self._link.send(functools.partial(self._ready_prefixes, [list(keys)], None))

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = self._requests.pop(req_context.req_id, None)
        if state is not None:
            self._forget(state)

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """The workers could not load these requests' blocks: answer MISS for them from now on, so
        that a request vLLM recomputes is not offered the same load again."""
        for req_id in req_ids:
            state = self._requests.get(req_id)
            if state is not None and not state.load_failed:
                self._forget(state)
                state.load_failed = True
                self.stats.load_failures += 1
                logger.warning("kvtier: request %s: loading its blocks from kvtierd failed; its lookups are "
                               "misses from now on", req_id)

    # --- stores
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        keys = list(dict.fromkeys(keys))            # kvtierd refuses duplicate keys in one job
        if not keys:
            return _nothing_stored()
        if not self._link.up or self._given_up() or self._clock() < self._full_until:
            self.stats.stores_skipped += 1
            return _nothing_stored()
        parts = self._parts(keys)
        self._link.send(functools.partial(self._open_stores, parts))
        for index, part in enumerate(parts):
            self._writing.update(dict.fromkeys(keys[index * PART_KEYS:(index + 1) * PART_KEYS], part.job))
        return PrepareStoreOutput(keys_to_store=keys, store_spec=KvtierLoadStoreSpec(parts), evicted_keys=[])

    def _parts(self, keys: list[OffloadKey], lease_of: dict | None = None) -> list[JobPart]:
        """The keys (as kvtier keys) in kvtier jobs of at most PART_KEYS keys, in order; with
        ``lease_of`` (key -> lease id), one job per run of keys of the same lease, naming it."""
        tkeys = kvtier_keys(keys)
        runs = itertools.groupby(map(lease_of.get, keys)) if lease_of else [(None, tkeys)]
        parts, begin = [], 0
        for lease, run in runs:
            end = begin + len(list(run))
            parts.extend(JobPart(self._new_job(), tuple(tkeys[first:min(end, first + PART_KEYS)]), lease)
                         for first in range(begin, end, PART_KEYS))
            begin = end
        return parts

    def _open_stores(self, parts: list[JobPart], client: Client) -> None:
        """(link thread) Open the store jobs before the ranks' requests arrive: kvtierd decides and
        allocates now, off the workers' next step. A store that found no room for any key makes
        the manager answer "not stored" without asking for ``FULL_REGION_BACKOFF_S``."""
        written = no_space = 0
        for part in parts:
            try:
                self._link.requests += 1
                outcomes = np.asarray(client.open_store(part.job, part.keys).outcomes, dtype=np.uint8)
            except LOST:
                raise
            except KvtierError as exc:                  # e.g. the ranks were faster and finished it
                logger.debug("kvtier: store job %d: %s", part.job, exc)
                continue
            written += int(np.count_nonzero(outcomes == StoreOutcome.WRITE))
            no_space += int(np.count_nonzero(outcomes == StoreOutcome.NO_SPACE))
        if no_space and not written:
            self._full_until = self._clock() + FULL_REGION_BACKOFF_S

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        jobs = {self._writing.pop(k) for k in keys if k in self._writing}
        if not success and jobs and self._link.up:
            self._link.send(functools.partial(self._abort_jobs, sorted(jobs)))

    def _abort_jobs(self, jobs: list[int], client: Client) -> None:
        for job in jobs:
            self._link.requests += 1
            client.abort(job)

    # --- loads
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        state = req_context.get_state(_Request)
        keys = list(keys)
        parts = self._parts(keys, state.lease_of if state is not None else None)
        if state is not None:
            # The load's jobs consume the leases they name; the rest are released, and a later
            # lookup (recompute, preemption) asks again under new lease ids.
            state.held -= {part.lease for part in parts}
            self._forget(state)
            state.lease_ids = {}
        self.stats.leased_loads += sum(1 for part in parts if part.lease is not None)
        if parts and self._link.up:
            self._link.send(functools.partial(self._open_loads, parts))
        return KvtierLoadStoreSpec(parts)

    def _open_loads(self, parts: list[JobPart], client: Client) -> None:
        """(link thread) Pin the loads' ready prefixes now, rather than when the first rank asks."""
        for part in parts:
            try:
                self._link.requests += 1
                hits = client.open_load(part.job, part.keys, lease=part.lease)
            except LOST:
                raise
            except KvtierError as exc:                  # e.g. the ranks were faster and finished it
                logger.debug("kvtier: load job %d: %s", part.job, exc)
                continue
            if hits < len(part.keys):
                logger.warning("kvtier: load job %d found %d of %d blocks (evicted since lookup); the workers "
                               "will report the rest as not loaded", part.job, hits, len(part.keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return None                                  # the ranks released their load jobs

    # --- the rest
    def reset_cache(self) -> None:
        logger.info("kvtier: reset_cache forgets %d in-flight stores and the lookup answers (and leases) of engine "
                    "%s; kvtierd's cache is shared and stays (kvtierctl clears it)", len(self._writing), self.engine_id)
        self._writing.clear()
        for state in self._requests.values():
            self._forget(state)

    def take_events(self) -> Iterable:
        return ()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return None

    def shutdown(self) -> None:
        self._link.close()


def _grouped(keys: Iterable[OffloadKey]) -> list[list]:
    """Keys per KV-cache group (a key's last 4 bytes), in order."""
    groups: dict[bytes, list] = {}
    for key in keys:
        groups.setdefault(key[-4:], []).append(key)
    return list(groups.values())


def _nothing_stored() -> PrepareStoreOutput:
    return PrepareStoreOutput(keys_to_store=[], store_spec=KvtierLoadStoreSpec(), evicted_keys=[])

"""The scheduler side: vLLM's ``OffloadingManager`` as a kvtierd coordinator session.

The scheduler process's ``KvtierOffloadingManager`` is the *coordinator* session (rank None) of
the vLLM engine's kvtier engine: it looks up keys and opens the kvtier jobs that the workers'
rank sessions then carry out. The bookkeeping is engine-free (``kvtier.integrations.offload``: the
``Link`` thread that owns the session, each request's batched and leased ``Lookups``, the kvtier
``Jobs`` of a transfer); this class maps vLLM's calls and types onto it. Its class docstring gives
the contract per vLLM method.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Collection, Iterable

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from kvtierd.contract.namespace import NamespaceId

from ...session import Client
from ..offload.events import EventFeed
from ..offload.jobs import Jobs
from ..offload.link import Link
from ..offload.lookups import Answers, Lookups, Request
from ..offload.stats import ManagerStats
from .settings import KvtierSettings
from .transfer import KvtierLoadStoreSpec

# A child of vLLM's logger, so that these lines go where vLLM's own go.
logger = logging.getLogger("vllm.kvtier")

# vLLM 0.33's ReqContext records the end-token position of every offload key of the request
# before its first lookup (OffloadingConnectorScheduler.update_offload_keys), in this private
# dict; no public API lists a request's keys. It is read only on the vLLM series this was checked
# against; elsewhere the manager takes the public path (RETRY, collect, batch at on_schedule_end).
KEY_POSITIONS_ATTR = "_offload_key_positions"
KEY_POSITIONS_SERIES = ("0.33",)

VLLM_ANSWERS = Answers(LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, LookupResult.HIT_PENDING)


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


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's OffloadingManager backed by a kvtierd coordinator session (scheduler process).

    Contract, per vLLM method (``kvtier.integrations.offload`` has the why):

    - ``lookup(key)``: HIT_PENDING while a store of the key that this manager prepared has not
      completed; else the verdict of the request's batched lookup (HIT for the ready prefix of its
      keys, HIT_PENDING for the keys after it that kvtierd is promoting from its second tier —
      vLLM defers the request and the manager asks kvtierd again next step —, MISS after them).
      The first lookup of a request sends one batched ``lookup`` of all its keys (from that key
      on, per KV-cache group, leasing the hits) and waits for it at most
      ``kvtier_lookup_wait_ms``; later lookups, including every step while the request waits
      for GPU blocks, are dict lookups (the leases renewed in the background). An answer that
      comes later is used next step (this step: RETRY once per KV-cache group, then MISS, so
      that vLLM defers the request without scanning on). After a wait ran out, no request waits
      until kvtierd answered again (they are deferred), and after ``GIVE_UP_S`` without an
      answer they get MISS. MISS at once while kvtierd is unreachable, and for a request whose
      load failed. Where vLLM's key positions are not readable (another vLLM series): RETRY for
      every key, which lets vLLM show all of them, and one batch per request at
      ``on_schedule_end``.
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
    - ``take_events``: with KV events on (vLLM's ``--kv-events-config``; ``events`` is the feed),
      the changes of the namespace's blocks that this engine can load, whichever engine stored
      them and whatever removed them, as OffloadingEvents (medium CPU). The link thread reads
      kvtierd's event log (a poll claimed at the end of a step, at most every
      ``offload.events.POLL_INTERVAL_S``), never the scheduler; ``has_pending_work`` keeps the
      engine stepping while changes wait to be taken, so that they go out at once.
    - ``get_stats``: None. vLLM already counts kvtier's transfers (its
      ``vllm:kv_offload_{load,store}_*``): each worker's transfer results reach the scheduler's
      stats through vLLM's own worker metadata; counting them here too would double them.

    ``lock`` stays vLLM's no-op: only the scheduler thread enters the manager; the link thread
    shares nothing with it but queues and futures.
    """

    def __init__(self, settings: KvtierSettings, engine_id: str, world_size: int, namespace: NamespaceId,
                 num_groups: int = 1, connect: Callable[..., Client] = Client,
                 clock: Callable[[], float] = time.monotonic, node_ranks: tuple[int, ...] | None = None,
                 events: EventFeed | None = None):
        self.settings = settings
        self.engine_id = engine_id
        self.world_size = world_size
        self.namespace = namespace
        self.node_ranks = node_ranks          # the ranks on this scheduler's node (None: all)
        self.stats = ManagerStats()
        self.use_key_positions = key_positions_readable()
        # The link paces its own attempts (kvtier.reach.Away): its client tries once per re-attach.
        self._link = Link(functools.partial(connect, settings.socket, engine_id=engine_id, rank=None,
                                            world_size=world_size, namespace=namespace, timeout=settings.timeout_s,
                                            reconnect_timeout=0.0, node_ranks=node_ranks),
                          settings.socket, settings.retry_s, f"coordinator of engine {engine_id} at {settings.socket}",
                          first_wait_s=settings.timeout_s + 1)
        self._lookups = Lookups(self._link, self.stats, num_groups, settings.lookup_wait_ms / 1000,
                                settings.lease_ttl_s or None, self._key_positions, VLLM_ANSWERS, clock)
        self._jobs = Jobs(self._link, self.stats, clock)
        self.events = events

    @property
    def link(self) -> Link:
        return self._link

    @property
    def num_groups(self) -> int:
        return self._lookups.num_groups

    def _key_positions(self, req_context: ReqContext) -> dict | None:
        if not self.use_key_positions:
            return None
        positions = getattr(req_context, KEY_POSITIONS_ATTR, None)
        return positions if isinstance(positions, dict) else None

    def _track(self, req_context: ReqContext) -> Request:
        state = self._lookups.track(req_context.req_id)
        req_context.set_state(state)
        return state

    # --- lookups
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._track(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._jobs.writing:
            return LookupResult.HIT_PENDING
        state = req_context.get_state(Request)
        if state is not None and state.valid_step == self._lookups.step:       # the hot path: a dict lookup
            result = state.verdict.get(key)
            if result is not None:
                return result
        return self._lookups.lookup(key, state or self._track(req_context), req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.schedule_end()
        feed = self.events
        if feed is not None and self._link.up and feed.claim():
            self._link.submit(lambda client: feed.poll(client.events)).add_done_callback(feed.released)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._lookups.touch(keys)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.finished(req_context.req_id)

    def loads_failed(self, req_ids: Iterable[str]) -> None:
        """The workers could not load these requests' blocks: answer MISS for them from now on, so
        that a request vLLM recomputes is not offered the same load again."""
        self._lookups.loads_failed(req_ids)

    # --- stores
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        keys, parts = self._jobs.prepare_store(keys, self._link.up and not self._lookups.given_up())
        return PrepareStoreOutput(keys_to_store=keys, store_spec=KvtierLoadStoreSpec(parts), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._jobs.complete_store(keys, success)

    # --- loads
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        state = req_context.get_state(Request)
        parts = self._jobs.prepare_load(list(keys), state.lease_of if state is not None else None)
        if state is not None:
            self._lookups.loading(state, {part.lease for part in parts})
        return KvtierLoadStoreSpec(parts, lease_ranks=self.node_ranks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return None                                  # the ranks released their load jobs

    # --- the rest
    def reset_cache(self) -> None:
        logger.info("kvtier: reset_cache forgets %d in-flight stores and the lookup answers (and leases) of engine "
                    "%s; kvtierd's cache is shared and stays (kvtierctl clears it)", len(self._jobs.writing),
                    self.engine_id)
        self._jobs.writing.clear()
        self._lookups.reset()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        return [OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed) for removed, keys in self.events.take()]

    def has_pending_work(self) -> bool:
        return self.events is not None and self.events.pending

    def get_stats(self) -> OffloadingConnectorStats | None:
        return None                                  # vLLM counts the workers' transfers (class docstring)

    def shutdown(self) -> None:
        self._link.close()

"""Prometheus exposition: a collector that reads the daemon's state at scrape time.

The HTTP endpoint (on its own threads) never touches the store: a scrape asks the server loop
for a snapshot (``Server.call_in_loop``), so the one-thread-owns-the-state rule holds, and the
values are exactly those of the moment of the snapshot. The rendered page is kept for
``metrics_cache_seconds``: any local user can scrape in a loop, and each snapshot and rendering
costs the request loop its time (issue 11: a scrape loop raised a client's lookup p99 from 0.8
to 5.8 ms); a scrape within that time gets the same page.

Metric names follow Prometheus conventions: ``kvtierd_`` prefix, ``_total`` for counters,
``_bytes`` and ``_seconds`` units. docs/operations.md lists them with their meaning.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from typing import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    InfoMetricFamily, Metric)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from .contract.codes import AbortCause, ErrorCode, JobKind
from .contract.events import Cause
from .contract.protocol import REQUESTS
from .contract.replies import StatsReply
from .fence import ROW_CAPS, Reason, Release
from .histogram import Histogram
from .holds import CAPS as HOLD_CAPS
from .leases import LeaseEnd
from .peers import Cap
from .policy import policy_class
from .tier.backend import ERRORS as TIER_ERRORS
from .tier.disk import CAUSES as DISK_ERROR_CAUSES
from .tier.link import LinkBusy
from .tier.seal import REASONS as SEAL_REASONS
from .tiering.companion import OPS as TIER_OPS

log = logging.getLogger(__name__)

# Every value of each label the daemon fills sparsely (a Counter that holds what happened), from the
# enums that define them: each series is exported from the daemon's start, 0 until its first event.
# A series born at its first event has no sample before it, so increase() and rate() cannot see
# that event (issue 27: KvtierdInternalErrors never fired on a first INTERNAL error, `promtool test
# rules` shows it). Families whose dicts the daemon fills whole (pages, entries, ...) need no entry;
# tests/unit/test_metrics.py checks that a fresh daemon's snapshot exports every series.
LABEL_VALUES: dict[str, Callable[[StatsReply], Iterable[str]]] = {
    "fenced_pages": lambda s: [r.value for r in Reason],
    "fence_released_pages": lambda s: [c.value for c in Release],
    "lease_ends": lambda s: [e.value for e in LeaseEnd],
    "jobs_completed": lambda s: [k.value for k in JobKind],
    "aborted_jobs": lambda s: [c.value for c in AbortCause],
    "connections_refused": lambda s: [c.value for c in Cap],
    "errors": lambda s: [c.name for c in ErrorCode],
    "policy_entries": lambda s: policy_class(s.policy).segments,
    "policy_evictions": lambda s: policy_class(s.policy).segments,
    "writer_rows_refused": lambda s: ROW_CAPS,
    "hold_capped_keys": lambda s: HOLD_CAPS,
    "tier_seal_rejected_blocks": lambda s: SEAL_REASONS,
    "tier_disk_errors": lambda s: DISK_ERROR_CAUSES,
    "events_removed_keys": lambda s: [c.value for c in Cause],
}
TIER_ERROR_CODES = (*TIER_ERRORS, LinkBusy.code)


def _every_op(ops: Iterable[str], series: dict[str, dict]) -> dict[str, dict]:
    """A histogram's series by op, with an empty one for every op that has none yet."""
    empty = Histogram().snapshot()
    return {op: series.get(op, empty) for op in {*ops, *series}}

# kvtierd_store_keys_total's outcome label → the StatsReply field it reads.
STORE_KEY_OUTCOMES = {"written": "store_written_keys", "present": "store_present_keys",
                      "no_space": "store_no_space_keys", "aborted": "store_aborted_keys"}


def _histogram(name: str, doc: str, label: str | None, series: dict[str, dict]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=[label] if label else None)
    for value, snap in sorted(series.items()):
        buckets = [("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in snap["buckets"]]
        family.add_metric([value] if label else [], buckets, snap["sum"])
    return family


class DaemonCollector:
    """Turns one snapshot of the daemon's stats into metric families."""

    def __init__(self, snapshot: Callable[[], StatsReply]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        f = Families(self._snapshot())
        yield from _occupancy(f)
        yield from _traffic(f)
        yield from _policy_and_server(f)
        yield from events_families(f)


class Families:
    """Metric families of one stats snapshot ``s``, each named ``kvtierd_<name>``; a labelled
    family exports every value its label can take (``LABEL_VALUES``), 0 until its first event."""

    def __init__(self, s: StatsReply):
        self.s = s

    def gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"kvtierd_{name}", doc, value=value)

    def counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(f"kvtierd_{name}", doc, value=value)

    def labelled(self, cls, name: str, doc: str, label: str, values: dict) -> Metric:
        family = cls(f"kvtierd_{name}", doc, labels=[label])
        known = dict.fromkeys(LABEL_VALUES[name](self.s), 0) if name in LABEL_VALUES else {}
        for key, value in sorted({**known, **values}.items()):
            family.add_metric([key], value)
        return family


def _occupancy(f: Families) -> Iterator[Metric]:
    """The region, its pages and entries, the fence, leases and holds."""
    s = f.s
    yield InfoMetricFamily("kvtierd_region", "The region this daemon serves.",
                           value={"path": s.region, "pinned": s.pinned,
                                  "generation": f"{s.generation:x}", "page_size": str(s.page_size),
                                  "hugepages": s.hugepages, "huge_page_size": str(s.huge_page_size)})
    yield f.gauge("region_huge_bytes", "Bytes of the region the daemon's mapping got in huge pages at start "
                  "(hugetlb or THP; the rest is in 4 KiB pages).", s.huge_bytes)
    yield f.gauge("capacity_bytes", "Bytes of the data area (pages × page size).", s.capacity_bytes)
    yield f.gauge("used_bytes", "Bytes of pages held by entries or fenced.", s.used_bytes)
    yield f.labelled(GaugeMetricFamily, "pages", "Pages by state.", "state",
                     {"free": s.pages_free, "used": s.pages_used - s.pages_fenced, "fenced": s.pages_fenced})
    yield f.labelled(GaugeMetricFamily, "fenced_pages", "Pages fenced for a writer that may still copy into them, "
                     "by why it is not proven done.", "reason", s.fenced_pages)
    yield f.labelled(CounterMetricFamily, "fence_released_pages", "Fenced pages given back, by the proof that "
                     "their writer could not write any more.", "cause", s.fence_released_pages)
    yield f.gauge("fence_oldest_seconds", "Seconds since the longest-fenced writer's pages were fenced (0: none).",
                  s.fence_oldest_seconds)
    yield f.gauge("fence_grace_seconds", "The fence_grace setting: how long an unwatchable writer's pages stay "
                  "fenced after it was last seen.", s.fence_grace_seconds)
    yield f.gauge("writer_rows", "Rows of the region's writer table in use (writers attached, or gone with pages "
                  "fenced).", s.writer_rows)
    yield f.labelled(CounterMetricFamily, "writer_rows_refused", "Writer hellos refused for want of a writer row, "
                     "by the bound: per_peer (max_writer_rows_per_peer), total (the region's 4,096 rows, or what "
                     "the open-files limit holds).", "cap", s.writer_rows_refused)
    yield f.counter("fence_check_failures", "Checks of a gone writer's process that could not be made (the daemon "
                    "out of descriptors or memory): its pages stayed fenced (reason unproven), checked again.",
                    s.fence_check_failures)
    yield f.labelled(GaugeMetricFamily, "entries", "Entries by state (pinned: READY and held by a load; leased: "
                     "READY and held by a lease; an entry may be both).", "state",
                     {"ready": s.entries_ready, "writing": s.entries_writing, "pinned": s.entries_pinned,
                      "leased": s.entries_leased})
    yield f.gauge("leases_open", "Leases holding a lookup's hits for an engine.", s.leases_open)
    yield f.gauge("leased_keys", "Entries in open leases, counted per lease (what max_leased_keys counts).",
                  s.leased_keys)
    yield f.counter("leases_granted", "Leases granted or renewed by a lookup.", s.leases_granted)
    yield f.labelled(CounterMetricFamily, "lease_ends", "Leases ended, by cause: consumed (by a load), released, "
                     "replaced (renewed), expired, revoked (kvtierctl clear --force), session_ended.", "cause",
                     s.lease_ends)
    yield f.counter("lease_missed_loads", "Load jobs that named a lease that was not live (expired, revoked, "
                    "released, or lost with a daemon restart): their keys were pinned only if still ready.",
                    s.lease_missed_loads)
    yield f.counter("lease_capped_keys", "Hits a lookup could not lease because of max_leased_keys_per_engine, "
                    "max_leased_keys or a max_held_share setting.", s.lease_capped_keys)
    yield f.gauge("held_pages", "Pages engines hold out of eviction through leases and load pins, each hold counted "
                  "on its own (what max_held_share caps).", s.held_pages)
    yield f.gauge("held_pages_top_engine", "The most pages one engine holds out of eviction (what "
                  "max_held_share_per_engine caps).", s.held_pages_top_engine)
    yield f.labelled(CounterMetricFamily, "hold_capped_keys", "Keys a lease or a load could not hold, by the cap "
                     "that bound it: engine (max_held_share_per_engine), namespace (max_held_share_per_namespace), "
                     "total (max_held_share).", "cap", s.hold_capped_keys)


def _traffic(f: Families) -> Iterator[Metric]:
    """Keys and jobs: lookups, stores, loads, their outcomes, aborts and evictions."""
    s = f.s
    yield f.labelled(CounterMetricFamily, "lookup_keys", "Keys asked by lookup, by result.", "result",
                     {"hit": s.lookup_hit_keys, "miss": s.lookup_miss_keys})
    yield f.labelled(CounterMetricFamily, "store_keys", "Keys of store jobs by outcome.", "outcome",
                     {label: getattr(s, field) for label, field in STORE_KEY_OUTCOMES.items()})
    yield f.labelled(CounterMetricFamily, "load_keys", "Keys of load jobs by result.", "result",
                     {"hit": s.load_hit_keys, "miss": s.load_miss_keys})
    # Promote jobs are the daemon's own, from the second tier: a tier whose stats count none
    # (no tier: {"backend": "off"}) made none.
    completed = {JobKind.STORE.value: s.store_jobs_done, JobKind.LOAD.value: s.load_jobs_done,
                 JobKind.PROMOTE.value: s.tier.get("promote_jobs_done", 0)}
    aborted = Counter(s.aborted_jobs)
    aborted.update(s.tier.get("promote_aborted", {}))
    yield f.labelled(CounterMetricFamily, "jobs_completed", "Jobs every rank finished (promote: the second "
                     "tier's blocks made READY), by kind.", "kind", completed)
    yield f.labelled(CounterMetricFamily, "aborted_jobs", "Aborted jobs by cause.", "cause", aborted)
    yield f.labelled(CounterMetricFamily, "evictions", "Entries evicted, by reason: room (a store needed the "
                     "space), operator (kvtierctl evict/clear).", "reason",
                     {"room": s.evictions, "operator": s.operator_evictions})


def _policy_and_server(f: Families) -> Iterator[Metric]:
    """The eviction policy, bytes copied, sessions, connections, errors, latencies, the second tier."""
    s = f.s
    yield InfoMetricFamily("kvtierd_policy", "The eviction policy (setting policy).", value={"policy": s.policy})
    yield f.labelled(CounterMetricFamily, "policy_keys", "Stored keys by the policy's admission: admitted, or "
                     "refused (placed first in line for eviction).", "decision",
                     {"admitted": s.policy_admitted_keys, "refused": s.policy_refused_keys})
    yield f.labelled(GaugeMetricFamily, "policy_entries", "Evictable entries per segment of the eviction policy.",
                     "segment", s.policy_segments)
    yield f.labelled(CounterMetricFamily, "policy_evictions", "Entries evicted (room and operator) per segment "
                     "of the eviction policy they were in.", "segment", s.policy_evictions)
    yield f.counter("written_bytes", "Bytes copied into the region by writer ranks (D2H).", s.bytes_written)
    yield f.counter("dedup_saved_bytes", "Bytes replicated-namespace ranks did not copy thanks to one-copy dedup.",
                    s.bytes_saved_dedup)
    yield f.labelled(GaugeMetricFamily, "sessions", "Attached client sessions by role.", "role", s.session_roles)
    yield f.gauge("engines", "Engines with at least one attached session.", s.engines)
    yield f.gauge("connections", "Open connections to the client socket.", s.connections)
    yield f.labelled(CounterMetricFamily, "connections_refused", "Connections closed at once, past a cap "
                     "(total: max_connections; per_peer: max_connections_per_peer).", "cap",
                     s.connections_refused)
    yield f.gauge("open_jobs", "Jobs waiting for copies, votes or releases.", s.open_jobs)
    yield f.gauge("jobs_held", "Job records the daemon holds: the open jobs, and aborted store jobs kept until "
                  "every writer handed their pages committed or was proven gone.", s.jobs_held)
    yield f.labelled(CounterMetricFamily, "errors", "Error replies by code.", "code", s.errors)
    yield _histogram("kvtierd_request_duration_seconds", "Time to handle one request, by operation.", "op",
                     _every_op(REQUESTS, s.latency))
    yield _histogram("kvtierd_vote_wait_seconds", "Time from a store job's first request to its last vote.",
                     None, {"": s.vote_wait})
    yield from TIER_FAMILIES.get(s.tier["backend"], tier_families)(f)




def events_families(f: Families) -> Iterator[Metric]:
    """The event log's families (``Store.events_stats``), and the daemon's KV events stream's when
    it publishes (docs/events.md)."""
    e = f.s.events
    yield f.gauge("events_log_bytes", "Bytes the event log holds (bounded by events_log_bytes).", e["log_bytes"])
    yield f.gauge("events_namespaces", "Namespaces whose event log is kept (followed by a reader or the daemon's "
                  "stream).", e["namespaces"])
    yield f.counter("events_stored_keys", "Keys the event log recorded as READY.", e["stored_keys"])
    yield f.labelled(CounterMetricFamily, "events_removed_keys", "Keys the event log recorded as gone, by cause: "
                     "evicted (room, or ahead of need for the second tier), cleared (kvtierctl evict/clear), "
                     "reclaimed (their namespace's slot taken over), region_replaced.", "cause", e["removed_keys"])
    yield f.counter("events_dropped_keys", "Keys of records the event log dropped to stay within events_log_bytes "
                    "(a reader that had not read them is resynced from a snapshot).", e["dropped_keys"])
    yield f.counter("events_resets", "Reads that reset a reader that fell behind the log (or read across a "
                    "restart) onto a snapshot.", e["resets"])
    yield f.counter("events_snapshot_keys", "Keys sent in snapshot pages to readers being resynced.",
                    e["snapshot_keys"])
    yield f.counter("events_failed_runs", "Appends the event log could not take (a bug, logged): every log ended "
                    "and its readers were resynced.", e["failed_runs"])
    yield f.gauge("events_readers", "Coordinator sessions that read their namespace's events.", e["readers"])
    yield f.gauge("events_reader_lag_keys", "Keys recorded after the cursor of the reader furthest behind.",
                  e["reader_lag_keys"])
    stream = e.get("stream")
    if stream:                                      # kv_events_endpoint set: the daemon publishes
        yield f.counter("kvevents_batches", "KVEventBatch messages the daemon's stream published.", stream["batches"])
        yield f.counter("kvevents_events", "Events (BlockStored, BlockRemoved, AllBlocksCleared) in them.",
                        stream["events"])
        yield f.counter("kvevents_sent_bytes", "Bytes of their payloads.", stream["bytes"])
        yield f.counter("kvevents_resyncs", "Namespaces published again from AllBlocksCleared (the stream fell "
                        "behind the event log, or a replay asked for more than its buffer holds).", stream["resyncs"])
        yield f.counter("kvevents_replays", "Replay requests served.", stream["replays"])
        yield f.counter("kvevents_replay_batches", "Batches sent again to replay requests.",
                        stream["replay_batches"])
        yield f.counter("kvevents_replays_cut", "Replays cut short (the subscriber gone or at its high-water "
                        "mark).", stream["replays_cut"])
        yield f.gauge("kvevents_buffered_batches", "Batches kept for replays (at most kv_events_buffer_batches).",
                      stream["buffered_batches"])


def tier_families(f: Families) -> Iterator[Metric]:
    """The second tier's families (``Tier.stats``: a companion's)."""
    t = f.s.tier
    yield InfoMetricFamily("kvtierd_tier", "The second tier (settings tier_backend, tier_address).",
                           value={"backend": t["backend"], "address": t["address"]})
    yield f.gauge("tier_up", "1 while the tier companion is ready (0: starting, restarting, or its backend "
                  "unreachable).", 1 if t["state"] == "ready" else 0)
    yield f.counter("tier_companion_restarts", "Times the tier companion was started again (it died, was killed "
                    "or could not open its backend).", t["restarts"])
    yield f.gauge("tier_inflight", "Requests to the tier companion in flight.", t["inflight"])
    yield f.labelled(GaugeMetricFamily, "tier_breaker_open", "1 while the companion's circuit breaker of a lane "
                     "is open (meta: existence checks, clears; data: demotes, promotes).", "lane",
                     {lane: 1 if state == "open" else 0 for lane, state in t["breaker"].items()})
    yield f.counter("tier_demoted_blocks", "Blocks written to the second tier before their pages were reused.",
                    t["demoted_blocks"])
    yield f.counter("tier_demoted_bytes", "Bytes of the demoted blocks.", t["demoted_bytes"])
    yield f.gauge("tier_demoting_blocks", "Blocks being demoted now (pinned until the tier answered).",
                  t["demoting_blocks"])
    yield f.labelled(CounterMetricFamily, "tier_demote_dropped_blocks", "Blocks evicted that the tier does not "
                     "hold, by why: down (companion not ready), failed (its put failed), busy (tier_max_inflight "
                     "reached), pressure (a store needed the pages before the demote got to them).", "reason",
                     t["demote_dropped_blocks"])
    yield f.counter("tier_promoted_blocks", "Blocks fetched from the second tier and made READY.", t["promoted_blocks"])
    yield f.counter("tier_promoted_bytes", "Bytes of the promoted blocks.", t["promoted_bytes"])
    yield f.gauge("tier_promoting_blocks", "Blocks being promoted now (WRITING, reported pending).",
                  t["promoting_blocks"])
    yield f.counter("tier_promote_failed_blocks", "Blocks a promote could not make READY (not whole, failed, "
                    "past tier_data_timeout, companion gone).", t["promote_failed_blocks"])
    yield f.labelled(CounterMetricFamily, "tier_lookup_keys", "Keys after a lookup's local hits checked in the "
                     "second tier, by whether it held them.", "result", t["lookup_keys"])
    yield f.counter("tier_cleared_blocks", "Blocks namespace clears removed from the second tier.",
                    t["cleared_blocks"])
    errors = CounterMetricFamily("kvtierd_tier_errors", "Tier calls that failed, by op and TierError code.",
                                 labels=["op", "code"])
    calls = {(op, code): 0 for op in TIER_OPS for code in TIER_ERROR_CODES}
    calls.update({(e["op"], e["code"]): e["calls"] for e in t["errors"]})
    for (op, code), n in sorted(calls.items()):
        errors.add_metric([op, code], n)
    yield errors
    yield _histogram("kvtierd_tier_call_seconds", "Time from a tier request to its answer, by op.", "op",
                     _every_op(TIER_OPS, t["call_seconds"]))
    yield f.labelled(CounterMetricFamily, "tier_seal_rejected_blocks", "Promoted blocks dropped because their seal "
                     "failed, by why: mismatch (bytes, namespace or key not the ones sealed: planted, foreign, "
                     "damaged or torn), other_key (sealed with another tier_key_file's key).", "reason",
                     t["seal_rejected_blocks"])
    yield from ENGINE_FAMILIES.get(t["engine"].get("engine"), _none)(f)


def _none(f: Families) -> Iterator[Metric]:
    """No families: no second tier (``NoTier.stats`` is {"backend": "off"}), or a backend with none of its own."""
    return iter(())


def _disk_families(f: Families) -> Iterator[Metric]:
    """The disk tier's own families (its engine's stats, once its companion reported them)."""
    disk = f.s.tier["engine"]
    if "errors" in disk:
        yield f.labelled(GaugeMetricFamily, "tier_disk_bytes", "The disk tier's bytes: used (by its blocks), "
                         "allocated (preallocated on the filesystem), capacity (its setting).", "kind",
                         {kind: disk[f"{kind}_bytes"] for kind in ("used", "allocated", "capacity")})
        yield f.gauge("tier_disk_blocks", "Blocks the disk tier holds.", disk["blocks"])
        yield f.labelled(CounterMetricFamily, "tier_disk_errors", "The disk tier's failures by cause (since its "
                         "companion started): no_space, io_error, read_only, full (capacity or free floor reached, "
                         "nothing to evict), slow (an I/O past tier_timeout), other.", "cause", disk["errors"])


# The tier's families by the backend its stats name, as the daemon's factory chose its Tier (a
# companion's, unless there is none); and the backend's own, by the engine the companion reports.
TIER_FAMILIES: dict[str, Callable[[Families], Iterator[Metric]]] = {"off": _none}
ENGINE_FAMILIES: dict[str, Callable[[Families], Iterator[Metric]]] = {"disk": _disk_families}


class CachedPage:
    """The WSGI app of /metrics: the registry rendered at most once per ``seconds``."""

    def __init__(self, registry: CollectorRegistry, seconds: float, clock=time.monotonic):
        self._registry = registry
        self._seconds = seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._page = b""
        self._at = float("-inf")
        self.renders = 0

    def page(self) -> bytes:
        with self._lock:            # concurrent scrapes wait for one rendering instead of each doing one
            now = self._clock()
            if now - self._at >= self._seconds:
                self._page, self._at = generate_latest(self._registry), now
                self.renders += 1
            return self._page

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: scrape /metrics\n"]
        body = self.page()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):    # noqa: A002 (the base class's name): no line per scrape
        pass


class Endpoint:
    """The /metrics HTTP endpoint. Bound at construction — before the daemon touches the region, so
    a bad or taken address fails the start at once, not after minutes of prefault — and served from
    ``serve`` on, with the daemon's snapshot."""

    def __init__(self, address: str, cache_seconds: float = 1.0):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"metrics address {address!r} must be HOST:PORT with a port of 0..65535 (0: any free "
                             "one), or off; setting metrics_address (--metrics-address)")
        host = host.strip("[]")

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._registry = CollectorRegistry(auto_describe=False)
        try:
            self.server = make_server(host, int(port), CachedPage(self._registry, cache_seconds), Server,
                                      handler_class=_QuietHandler)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {address}: {exc.strerror or exc}; change metrics_address "
                             "(--metrics-address) or set it to off") from None
        bound_host, bound_port = self.server.server_address[:2]
        self.address = f"{bound_host}:{bound_port}"
        self._serving = False

    def serve(self, snapshot: Callable[[], StatsReply]) -> None:
        """Answer scrapes from now on (connections made since the bind waited in the backlog)."""
        self._registry.register(DaemonCollector(snapshot))
        ProcessCollector(registry=self._registry)   # process_resident_memory_bytes, open fds, CPU, start time
        threading.Thread(target=self.server.serve_forever, name="kvtierd-metrics", daemon=True).start()
        self._serving = True

    def close(self) -> None:
        if self._serving:           # shutdown() waits for serve_forever: it would wait forever before it
            self.server.shutdown()
        self.server.server_close()

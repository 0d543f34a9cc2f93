"""Wires the daemon together: config → region → store (and its second tier) → server → metrics;
logs; signals; stop.

Start-up order matters: the region is locked before anything else touches it, the store rebuilds
its index from the region's tables, and only then are the sockets bound (``Server.listen``), so a
client that can connect always meets a daemon that is ready to serve; READY=1 goes to systemd
after that.
"""

from __future__ import annotations

import functools
import gc
import logging
import resource
import sys
import time

import zmq

from .config import Config, format_size
from .contract.paths import DaemonPaths, check_socket_path
from .contract.region_format import WRITER_SLOTS
from .heap import keep_freed_heap
from .kvevents_pub import KvEventsPublisher, NoStream, topic_of
from .region import Region, RegionError
from .server import Server
from .store import Store
from .systemd import Notifier
from .tiering.tier import build as build_tier
from .tiering.tier import check as check_tier

log = logging.getLogger("kvtierd")


class LogFormatter(logging.Formatter):
    """One structured line per event: ts=… level=… logger=… msg="…"."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        msg = record.getMessage().replace('"', "'")
        line = f'ts={ts} level={record.levelname.lower()} logger={record.name} msg="{msg}"'
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# Descriptors kept free of the connection and session caps: the region, lock and sockets, ZMQ's own
# (two per socket and per context), the metrics endpoint's, logs.
FD_RESERVE = 256


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (no privilege needed); returns the new soft limit.

    Every client connection holds a descriptor in the daemon and every watched session a pidfd:
    at the usual soft limit of 1,024 a thousand idle connections made ZMQ abort the daemon."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


def fit_fd_caps(nofile: int, max_connections: int, max_sessions: int,
                writer_rows: int = WRITER_SLOTS) -> tuple[int, int, int]:
    """(connections, sessions, writer rows) caps that fit the open-files limit: every connection
    takes a descriptor, every watched session a pidfd, every writer gone whose pages are still
    fenced a pidfd (while the daemon watches its process), and FD_RESERVE stay free for
    everything else."""
    room = nofile - FD_RESERVE
    wanted = max_connections + max_sessions + writer_rows
    if room >= wanted:
        return max_connections, max_sessions, writer_rows
    connections = max(16, room * max_connections // wanted)
    sessions = max(1, room * max_sessions // wanted)
    rows = max(1, room - connections - sessions)
    log.warning("the open-files limit (%d) cannot hold max_connections=%d plus max_sessions=%d plus %d writer rows "
                "(a pidfd each); serving at most %d connections, %d sessions and %d writer rows. Raise the hard limit "
                "(LimitNOFILE= in the unit, ulimit -Hn) to lift this", nofile, max_connections, max_sessions,
                writer_rows, connections, sessions, rows)
    return connections, sessions, rows


def preflight(c: Config) -> None:
    """Every check of the settings that costs nothing, made before the daemon touches memory: one
    found after the prefault costs minutes of a large region's start, and Restart=on-failure repeats
    it. (The region's own — directory, group, lock, huge pages, space, memlock for pin=mlock — come
    first in Region.open, before it prefaults; the metrics address is bound right after this.)"""
    paths = DaemonPaths(c.dir, c.name)
    for path in (paths.socket, paths.admin_socket):
        check_socket_path(path)
    check_tier(c)


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        c = config
        max_connections, max_sessions, max_writer_rows = fit_fd_caps(raise_fd_limit(), c.max_connections,
                                                                     c.max_sessions)
        self.notifier = Notifier()
        last = [-1]

        def progress(done: int, total: int) -> None:
            pct = 100 * done // max(total, 1)
            self.notifier.status(f"prefaulting region: {pct}%" if done < total else "pinning region")
            if pct // 25 != last[0] // 25:
                last[0] = pct
                log.info("prefault %d%% (%s of %s)", pct, format_size(done), format_size(total))

        started = time.monotonic()
        preflight(c)
        # Bound before the prefault: a bad or taken address fails the start at once. Imported only
        # when on: prometheus_client and its HTTP server are ~0.05 s of every start (-X importtime).
        self.metrics = None
        if c.metrics_address != "off":
            from .metrics import Endpoint
            self.metrics = Endpoint(c.metrics_address, c.metrics_cache_seconds)
        try:
            self.notifier.status("prefaulting region")
            self.region = Region.open(c.dir, c.name, c.size, c.page_size, pin=c.pin, group=c.group or None,
                                      recreate=c.recreate, prefault_threads=c.prefault_threads, progress=progress,
                                      huge=c.hugepages)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        self.store: Store | None = None
        self.server: Server | None = None
        try:
            self._serve(c, max_connections, max_sessions, max_writer_rows)
        except BaseException:
            # Every failed start leaves nothing behind: sockets, the companion, the lock, and a
            # region this start created (it caches nothing yet and holds its size in memory).
            if self.server is not None:
                self.server.close()
            if self.store is not None:
                self.store.tier.close()
            if self.metrics is not None:
                self.metrics.close()
            self.region.close(clean=False, remove=not self.region.adopted)
            raise
        geo, backing = self.region.geometry, self.region.backing
        log.info("ready: socket=%s region=%s size=%s pages=%d page_size=%s capacity=%s data_offset=%d "
                 "pinned=%s prefault=%s hugepages=%s huge_page_size=%s huge_bytes=%s generation=%x started_in=%.2fs "
                 "admin_socket=%s", self.server.socket_path, self.region.paths.region, format_size(geo.total_bytes),
                 geo.num_pages, format_size(geo.page_size), format_size(geo.capacity_bytes), geo.data_offset,
                 self.region.pinned, self.region.prefault, backing.kind, format_size(backing.page_size),
                 format_size(backing.huge_bytes),
                 self.region.generation, time.monotonic() - started, self.server.admin_socket_path)
        self.notifier.notify(READY=1, STATUS=f"serving {self.server.socket_path}: {geo.num_pages} pages of "
                                             f"{format_size(geo.page_size)}, pinned={self.region.pinned}, "
                                             f"{backing.describe()}")

    def _serve(self, c: Config, max_connections: int, max_sessions: int, max_writer_rows: int) -> None:
        """The store on the region, its second tier, the sockets, the metrics: from here clients connect."""
        self.store = self._open_store(c, max_writer_rows)
        self.store.tier.start()
        self.server = Server(self.store, self.region, self.region.gid, notifier=self.notifier,
                             stream=self._open_stream(c, self.store),
                             drain_timeout=c.drain_timeout, heartbeat_timeout=c.heartbeat_timeout,
                             region_check_interval=c.region_check_interval, max_connections=max_connections,
                             max_connections_per_peer=c.max_connections_per_peer, max_sessions=max_sessions,
                             max_sessions_per_peer=c.max_sessions_per_peer)
        self.server.listen()
        if self.metrics is not None:
            self.metrics.serve(lambda: self.server.call_in_loop(self.server.stats))
            self.server.metrics_address = self.metrics.address
            log.info("metrics: http://%s/metrics", self.metrics.address)

    @staticmethod
    def _open_stream(c: Config, store: Store) -> KvEventsPublisher | NoStream:
        """The daemon's own KV events stream (docs/events.md), when ``kv_events_endpoint`` is set:
        every namespace's log is kept from the start, and published from its contents on."""
        if not c.kv_events_endpoint:
            return NoStream()
        node, template = c.kv_events_node, c.kv_events_topic
        try:
            topic_of(template, node, "n", "m")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"setting kv_events_topic {template!r}: {exc!r}; it may name {{node}}, {{model}} and "
                             "{namespace}") from None
        store.recorder.follow_every(store.index.namespaces.values())
        namespaces = store.index.namespaces

        @functools.lru_cache(maxsize=4096)
        def topic(ns_id) -> str:
            """A namespace's topic, formatted once: the stream asks for every namespace's at each
            flush, and the name and the template took ~3 µs a namespace (measured)."""
            return topic_of(template, node, ns_id.name(), ns_id.model)

        try:
            stream = KvEventsPublisher(
                zmq.Context.instance(), store.event_log,
                lambda: {ns.slot: topic(ns.id) for ns in namespaces.values()},
                c.kv_events_endpoint, c.kv_events_replay_endpoint or None, hash_form=c.kv_events_hash,
                buffer_batches=c.kv_events_buffer_batches, hwm=c.kv_events_hwm,
                flush_interval=c.kv_events_flush_ms / 1000)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot publish KV events on {c.kv_events_endpoint} (replay "
                             f"{c.kv_events_replay_endpoint or 'none'}): {exc}; change kv_events_endpoint, "
                             "kv_events_replay_endpoint, or leave kv_events_endpoint empty") from None
        log.info("KV events: publishing on %s (replay %s), topics %s", stream.endpoint, stream.replay_endpoint,
                 template)
        return stream

    def _open_store(self, c: Config, max_writer_rows: int) -> Store:
        """The store over the region (its index recovered from the tables) and its second tier."""
        store = Store(self.region.view, job_timeout=c.job_timeout, checksums=c.checksums, policy=c.policy,
                      fence_grace=c.fence_grace, max_job_keys=c.max_job_keys,
                      max_job_keys_per_engine=c.max_job_keys_per_engine, max_tombstones=c.max_tombstones,
                      lease_ttl=c.lease_ttl, max_lease_ttl=c.max_lease_ttl,
                      max_leased_keys_per_engine=c.max_leased_keys_per_engine, max_leased_keys=c.max_leased_keys,
                      max_writer_rows=max_writer_rows, max_writer_rows_per_peer=c.max_writer_rows_per_peer,
                      held_shares=(c.max_held_share_per_engine, c.max_held_share_per_namespace, c.max_held_share),
                      events_log_bytes=c.events_log_bytes, tier=build_tier(c, self.region.paths, self.region.geometry))
        # What the daemon built to start (modules, functions, its store: ~35,000 objects, none per
        # entry) lives as long as it does: frozen out of the cyclic collector's passes, a full pass
        # walks only what requests create (docs/benchmarks.md: a full pass over them paused the
        # loop 10-18 ms here).
        gc.freeze()
        rec = store.recovered
        if self.region.adopted:
            log.info("adopted region %s (last stop %s): %d ready entries recovered, %d unfinished and %d "
                     "damaged discarded, %d pages fenced for writers not proven gone", self.region.paths.region,
                     "clean" if self.region.was_clean else "unclean", rec["ready"],
                     rec["writing_discarded"], rec["corrupt_discarded"], rec["pages_fenced"])
            if rec["writing_discarded"] or rec["corrupt_discarded"]:
                # The tables were rebuilt: page numbers a client held may mean other entries now.
                log.info("region rebuilt: new generation %x (clients remap on re-attach)",
                         self.region.new_generation())
        log.info("eviction policy: %s", c.policy)
        return store

    def run(self) -> None:
        self.server.install_signal_handlers()
        try:
            self.server.run()
        finally:
            self.stop()

    def stop(self) -> None:
        if self.region.view is None:
            return
        log.info("stopping")
        self.notifier.notify(STOPPING=1)
        if self.metrics is not None:
            self.metrics.close()
        self.store.shutdown()
        self.region.close(clean=True)
        self.notifier.close()
        log.info("stopped cleanly")


def run(config: Config) -> int:
    setup_logging(config.log_level)
    log.info("%s", keep_freed_heap())
    try:
        daemon = Daemon(config)
    except (RegionError, ValueError, OSError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    daemon.run()
    return daemon.server.exit_code

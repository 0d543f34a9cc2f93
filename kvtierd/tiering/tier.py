"""A second tier reached through a companion process (``CompanionTier``), and the factory that
builds it from the daemon's settings (``build``).

The companion (``kvtierd.tier.service``) runs the engine's client (Mooncake Store, Valkey/Redis
Cluster); the daemon never calls an engine from its loop: an engine call can block for seconds
and cannot be cancelled, and only the end of the process that made it proves it no longer touches
the region's pages. ``CompanionTier`` is what the daemon does with it, on the loop thread, between
requests (``pump``): apply what came back, follow the companion's life (``companion``), send the
checks lookups promised and demote ahead of need (``demote``, ``promote``). Clears go to the
companion as they come.

Identities: a tier key carries the namespace's identity (``kvtierd.tier.keys``), so two models
never meet and a replicated (MLA) namespace's blocks are one copy for every TP degree. A sharded
entry is stored whole, its shards back to back.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from ..contract.paths import DaemonPaths
from ..contract.region_format import Geometry
from ..events import Events
from ..fence import Release
from ..index import Index
from ..namespaces import Namespace
from ..tier.backend import check_settings
from ..tier.link import LinkBusy, LinkDown, Outcome, TierLink
from ..tier.seal import load_key
from ..writes import Writes
from .companion import Companion
from .demote import Copies, Demotes, Put
from .interface import Reply, Tier, TierConfig, TierFactory, no_tier
from .promote import Check, Promote, Promotes

log = logging.getLogger(__name__)

TICK = 0.1                    # the loop wakes at least this often while a tier is configured


@dataclass(eq=False)
class _Clear:
    ns: Namespace
    batch: "_ClearBatch"
    started: float
    timed_out: bool = False


@dataclass(eq=False)
class _ClearBatch:
    remaining: int
    reply: Reply
    removed: int = 0
    failed: bool = False


class CompanionTier(Tier):
    def __init__(self, index: Index, writes: Writes, events: Events, link: TierLink, config: TierConfig,
                 clock: Callable[[], float]):
        self.config = config
        self.clock = clock
        self.index = index
        self.companion = Companion(link, writes, f"{config.backend} at {config.address}")
        copies = Copies(index.geometry.entry_slots)
        self.copies = copies
        self.demotes = Demotes(index, self.companion, config, copies, clock)
        self.promotes = Promotes(index, writes, self.companion, config, copies, clock)
        events.subscribe(self.demotes)          # what leaves the index: counted, forgotten
        self.cleared = 0
        self._handlers = {Put: self.demotes.done, Check: self.promotes.checked, Promote: self.promotes.fetched,
                          _Clear: self._cleared}

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        c = self.config
        link = self.companion.link
        link.start()
        log.info("second tier: %s at %s (demote %s, promote %s, low watermark %.2f); companion log %s", c.backend,
                 c.address, c.demote, c.promote, c.low_watermark, link.log_path)

    def sockets(self) -> list:
        return [self.companion.link.socket]

    def close(self) -> None:
        """Stop the companion (it is killed if it does not stop in time): every request it had is
        over, so the pages it was handed come back — once it is reaped; one still stuck in the
        kernel keeps them fenced (a restarted daemon proves it gone by its pid and start time)."""
        reaped = self.companion.stop()
        for writer in self.companion.rows():
            self.promotes.companion_gone(writer)
            self.companion.end(writer, self.clock(), Release.DIED if reaped else None)

    def data_replaced(self) -> None:
        """The region's data file was truncated and is being replaced (``Server._replace_data``):
        the companion maps the old file. It is killed (``abandon``: the loop does not wait for it
        to be gone), every request it had ends now (promote jobs abort, demotes fail and their
        pins drop: their pages are in the old file, which nobody maps any more), its writer row
        ends (``Fence.reset`` needs no writer attached; one not reaped yet is released by that
        reset), and the link starts the next one as soon as it is reaped: the new companion maps
        the new file, as a client re-attaches and remaps."""
        if self.companion.link.state == "stopped":
            return
        now = self.clock()
        self.companion.abandon()
        self._apply(now)                        # every request's final outcome
        self._follow(now)                       # reaped already: its row ends (DIED)
        writer = self.companion.writer
        if writer is not None:                  # still dying: its row goes with the old file's pages
            self.promotes.companion_gone(writer)
            self.companion.end(writer, now, proof=None)

    def _follow(self, now: float) -> None:
        """A reaped companion's writes abort and its row ends; a ready one gets a row."""
        gone = self.companion.gone()
        if gone is not None:
            self.promotes.companion_gone(gone)
            self.companion.end(gone, now)
        self.companion.join()

    # ------------------------------------------------------------------ the loop
    def pump(self, now: float) -> float:
        """Apply what the companion answered, follow its life, send due checks, demote ahead of
        need. Returns the seconds until the loop should call again at the latest."""
        self._apply(now)
        due = self.promotes.send_checks(now)
        self._follow(now)
        self.companion.log_state()
        self.demotes.ahead(now)
        self.companion.ask_stats(now)
        return TICK if due is None else min(TICK, due - now)

    def _apply(self, now: float) -> None:
        for outcome in self.companion.collect(now):
            self._handlers[type(outcome.context)](outcome.context, outcome, now)

    def pending(self, ns: Namespace, keys: list[bytes], hits: int) -> int:
        return self.promotes.pending(ns, keys, hits)

    # ------------------------------------------------------------------ clear
    def clear(self, namespaces: list[Namespace], reply: Reply) -> None:
        """Remove every block of these namespaces from the tier; ``reply(tier, removed)`` says how
        it went (now, or once the companion answered): excluded | failed | removed."""
        served = [ns for ns in namespaces if self.config.serves(ns)]
        if not served:
            reply("excluded" if namespaces else "removed", None if namespaces else 0)
            return
        for ns in served:                      # their entries' copies in the tier are going
            self.copies.held[self.index.slots_of(ns)] = False
        batch = _ClearBatch(len(served), reply)
        now = self.clock()
        for ns in served:
            try:
                self.companion.submit("clear", _Clear(ns, batch, now), ns=self.companion.identity(ns))
            except (LinkBusy, LinkDown) as exc:
                self.companion.errors[("clear", exc.code)] += 1
                batch.failed = True
                self._clear_done(batch)

    def _cleared(self, ctx: _Clear, o: Outcome, now: float) -> None:
        if o.ok:
            ctx.batch.removed += int(o.result.get("removed", 0))
            self.cleared += int(o.result.get("removed", 0))
        else:
            ctx.batch.failed = True
        self._clear_done(ctx.batch)

    @staticmethod
    def _clear_done(batch: _ClearBatch) -> None:
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.reply("failed" if batch.failed else "removed", batch.removed)

    # ------------------------------------------------------------------ what is going on
    def stats(self) -> dict:
        c = self.config
        return {"backend": c.backend, "address": c.address, **self.companion.stats(),
                "demote": c.demote, "promote": c.promote, "exclude": sorted(c.exclude),
                "low_watermark": c.low_watermark, **self.demotes.stats(), **self.promotes.stats(),
                "cleared_blocks": self.cleared}


def check(c) -> None:
    """The second tier's settings, checked before the daemon touches the region (ValueError): an
    address, and no ``tier_settings`` key its backend does not take."""
    if c.tier_backend == "off":
        return
    if not c.tier_address:
        raise ValueError(f"tier_backend {c.tier_backend} needs tier_address (--tier-address: the Mooncake master's "
                         "HOST:PORT, Valkey/Redis Cluster nodes HOST:PORT,HOST:PORT, or the disk tier's directory)")
    check_settings(c.tier_backend, c.tier_settings)


def key_file(c, paths: DaemonPaths) -> str:
    """The file of the key that seals the tier's blocks (``tier_key_file``), generated when absent:
    by default in the disk tier's own directory (it lives as long as the blocks), else beside the
    region (node-local: a warning says that other nodes' blocks will then fail their check)."""
    path = c.tier_key_file
    if not path and c.tier_backend == "disk":
        os.makedirs(c.tier_address, mode=0o700, exist_ok=True)
        path = os.path.join(c.tier_address, "seal.key")
    elif not path:
        path = paths.tier_key
        log.warning("tier_key_file is not set: blocks are sealed with a key of this node's own (%s); blocks other "
                    "nodes demote will fail their check here. Give every node that shares the tier the same "
                    "tier_key_file", path)
    key = load_key(path, create=True)
    log.info("second tier: blocks sealed with the key in %s (key id %s)", path, key.id_hex)
    return path


def build(c, paths: DaemonPaths, geometry: Geometry) -> TierFactory:
    """The factory of the daemon's tier from its settings (``no_tier`` when ``tier_backend`` is
    off). The companion's socket (mode 0600) and log live beside the region (``DaemonPaths``); the
    seal key is loaded (or generated) now, so that a bad one stops the start."""
    check(c)
    if c.tier_backend == "off":
        return no_tier
    settings = {"address": c.tier_address, "timeout": c.tier_timeout, **c.tier_settings}
    seal_key = key_file(c, paths)
    exclude = frozenset(filter(None, (m.strip() for m in c.tier_exclude.split(","))))
    config = TierConfig(c.tier_backend, c.tier_address, c.tier_demote, c.tier_promote, c.tier_low_watermark, exclude,
                        c.tier_cooldown)

    def make(index: Index, writes: Writes, events: Events, clock: Callable[[], float]) -> Tier:
        link = TierLink(f"ipc://{paths.tier_socket}", paths.region, geometry.data_offset, geometry.capacity_bytes,
                        geometry.page_size, c.tier_backend, settings, timeout=c.tier_timeout,
                        data_timeout=c.tier_data_timeout, failures=c.tier_failures, cooldown=c.tier_cooldown,
                        max_inflight=c.tier_max_inflight, kill_after=c.tier_kill_after,
                        restart_backoff=c.tier_restart_backoff, log_path=paths.tier_log, socket_mode=0o600,
                        key_file=seal_key, owner=paths.name)
        return CompanionTier(index, writes, events, link, config, clock)
    return make

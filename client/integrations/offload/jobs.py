"""The kvtier jobs of an engine's transfers: numbered here, opened in the background, handed to the
ranks.

An engine like vLLM numbers a transfer only *after* it was prepared, so the scheduler side cannot
name a kvtier job after it: it numbers kvtier jobs with its own counter and hands their ids to the
ranks (one ``JobPart`` per kvtier job; a transfer with more keys than one job takes becomes
several). A kvtier job is decided by whichever of its requests reaches kvtierd first, the
coordinator's (``open_store``/``open_load``, sent on the link thread) or a rank's: for a store,
which keys are written (the others are present already or find no room); for a load, the ready
prefix it pins. Every rank gets that same decision; a load job also consumes the lease its part
names (kvtierd.leases), so that the keys the lookup found cannot have been evicted meanwhile.

``Jobs`` never waits: stores and loads are opened in the background. While kvtierd is away or
slow, and for ``FULL_REGION_BACKOFF_S`` after a store found no room for any of its keys, a store is
answered "not stored" without asking. Keys being stored stay ``writing`` until the store
completes (a lookup of one answers "pending").
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Collection

import numpy as np

from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.errors import KvtierError

from ...coordinator import Coordinator
from ..common import PART_KEYS
from .keys import kvtier_keys
from .link import LOST, Link
from .stats import ManagerStats

logger = logging.getLogger("vllm.kvtier")

# After a store found no room for any of its keys (every entry pinned or being written), stores are
# answered "not stored" without asking kvtierd for this long.
FULL_REGION_BACKOFF_S = 1.0


@dataclass(frozen=True)
class JobPart:
    """One kvtier job of a transfer: its id and its keys, in the order of the transfer's GPU
    block ids (every rank must name the same keys); for a load, the lease of the engine that
    holds those keys (the job's first request consumes it), if any."""

    job: int
    keys: tuple[bytes, ...]
    lease: int | None = None


class Jobs:
    """The engine's kvtier jobs (module docstring)."""

    def __init__(self, link: Link, stats: ManagerStats, clock: Callable[[], float] = time.monotonic):
        self._link = link
        self.stats = stats
        self._clock = clock
        self._next_job = 1
        self.writing: dict[bytes, int] = {}           # key -> kvtier store job, until complete_store
        self._full_until = 0.0                         # the link thread sets it (see _open_stores)

    def parts(self, keys: list[bytes], lease_of: dict | None = None) -> list[JobPart]:
        """The keys (as kvtier keys) in kvtier jobs of at most PART_KEYS keys, in order; with
        ``lease_of`` (key -> lease id), one job per run of keys of the same lease, naming it."""
        tkeys = kvtier_keys(keys)
        runs = itertools.groupby(map(lease_of.get, keys)) if lease_of else [(None, tkeys)]
        parts, begin = [], 0
        for lease, run in runs:
            end = begin + len(list(run))
            for first in range(begin, end, PART_KEYS):
                parts.append(JobPart(self._next_job, tuple(tkeys[first:min(end, first + PART_KEYS)]), lease))
                self._next_job += 1
            begin = end
        return parts

    # --- stores
    def prepare_store(self, keys: Collection[bytes], may_ask: bool) -> tuple[list[bytes], list[JobPart]]:
        """The keys to store (duplicates dropped: kvtierd refuses them in one job) and their store
        jobs, opened in the background; none (not stored) when not ``may_ask`` (kvtierd away or
        slow) or the region was found full lately."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return [], []
        if not may_ask or self._clock() < self._full_until:
            self.stats.stores_skipped += 1
            return [], []
        parts = self.parts(keys)
        self._link.send(functools.partial(self._open_stores, parts))
        for index, part in enumerate(parts):
            self.writing.update(dict.fromkeys(keys[index * PART_KEYS:(index + 1) * PART_KEYS], part.job))
        return keys, parts

    def _open_stores(self, parts: list[JobPart], client: Coordinator) -> None:
        """(link thread) Open the store jobs before the ranks' requests arrive: kvtierd decides and
        allocates now, off the ranks' next step. A store that found no room for any key makes
        ``prepare_store`` answer "not stored" without asking for ``FULL_REGION_BACKOFF_S``."""
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

    def complete_store(self, keys: Collection[bytes], success: bool) -> None:
        """The ranks finished the store of ``keys``; a failed one's jobs are aborted."""
        jobs = {self.writing.pop(k) for k in keys if k in self.writing}
        if not success and jobs and self._link.up:
            self._link.send(functools.partial(self._abort_jobs, sorted(jobs)))

    def _abort_jobs(self, jobs: list[int], client: Coordinator) -> None:
        for job in jobs:
            self._link.requests += 1
            client.abort(job)

    # --- loads
    def prepare_load(self, keys: list[bytes], lease_of: dict | None) -> list[JobPart]:
        """The load jobs of ``keys``, each naming the lease that holds its keys (``lease_of``),
        opened in the background; the ranks' own load requests open them if they get there first."""
        parts = self.parts(keys, lease_of)
        self.stats.leased_loads += sum(1 for part in parts if part.lease is not None)
        if parts and self._link.up:
            self._link.send(functools.partial(self._open_loads, parts))
        return parts

    def _open_loads(self, parts: list[JobPart], client: Coordinator) -> None:
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
                logger.warning("kvtier: load job %d found %d of %d blocks (evicted since lookup); the ranks "
                               "will report the rest as not loaded", part.job, hits, len(part.keys))

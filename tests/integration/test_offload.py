"""The scheduler side's engine-free bookkeeping (kvtier.integrations.offload) against a real kvtierd,
in the main venv: a link thread with its coordinator session, requests' leased lookups, the kvtier
jobs of transfers carried out by a real rank session, across a planned restart of the daemon.

(The vLLM suite drives the same code through vLLM's Scheduler; this proves it without vLLM.)
"""

from __future__ import annotations

import functools
import hashlib
import signal
import time

import pytest
import torch

from kvtier import Client, NamespaceId
from kvtier.integrations.offload.jobs import Jobs
from kvtier.integrations.offload.link import Link
from kvtier.integrations.offload.lookups import Answer, Lookups
from kvtier.integrations.offload.stats import ManagerStats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCK = 4096
NS = NamespaceId("offload-model", "bfloat16", 16, BLOCK, "sharded")


def keys(prefix: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}{i}".encode()).digest() + bytes(4) for i in range(n)]


def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


class SchedulerSide:
    """What vLLM's manager is made of, without vLLM: a link, lookups and jobs."""

    def __init__(self, socket: str, retry_s: float):
        connect = functools.partial(Client, socket, engine_id="offload", rank=None, world_size=1, namespace=NS,
                                    timeout=2.0, reconnect_timeout=0.0)
        self.link = Link(connect, socket, retry_s, "coordinator of engine offload", first_wait_s=5.0)
        self.stats = ManagerStats()
        self.positions: dict = {}
        self.lookups = Lookups(self.link, self.stats, 1, 60.0, 5.0, self.positions.get)
        self.jobs = Jobs(self.link, self.stats)

    def scan(self, name: str, ks: list[bytes]) -> tuple:
        """A new request's lookups of ``ks`` in one step: (its state, the answers)."""
        self.positions[name] = {k: (i + 1) * 16 for i, k in enumerate(ks)}
        request = self.lookups.track(name)
        answers = [self.lookups.lookup(k, request, name) for k in ks]
        self.lookups.schedule_end()
        return request, answers

    def settled(self) -> None:
        self.link.submit(lambda client: None).result(30)


def test_stores_lookups_and_leased_loads_across_a_planned_restart(start_daemon):
    daemon = start_daemon(page_size="4KiB")
    side = SchedulerSide(daemon.socket, retry_s=600)
    kv = [torch.randint(0, 255, (16, BLOCK), dtype=torch.uint8)]
    rank = Client(daemon.socket, engine_id="offload", rank=0, world_size=1, namespace=NS, timeout=2.0)
    try:
        rank.register_kv_caches(kv)
        ks = keys("offload", 5)
        stored, parts = side.jobs.prepare_store(ks, may_ask=side.link.up)
        assert stored == ks and len(parts) == 1
        side.settled()                                        # the coordinator opened the job first
        assert rank.store(parts[0].job, parts[0].keys, range(5)).written == 5
        assert rank.wait([parts[0].job])[0].ok
        side.jobs.complete_store(ks, True)
        assert side.scan("before", ks)[1] == [Answer.HIT] * 5

        assert daemon.stop(signal.SIGTERM) == 0                # what systemctl restart does first
        until(lambda: not side.link.up)
        assert side.scan("while-down", ks)[1] == [Answer.MISS] * 5
        daemon.start()
        until(lambda: side.link.up)                           # kvtier_retry_s is 600 s: not waited for
        request, answers = side.scan("after", ks)
        assert answers == [Answer.HIT] * 5
        (part,) = side.jobs.prepare_load(ks, request.lease_of)
        assert part.lease is not None                         # leased by the new session
        side.lookups.loading(request, {part.lease})
        assert rank.load(part.job, part.keys, range(8, 13), lease=part.lease) == 5
        assert rank.wait([part.job])[0].ok
        assert torch.equal(kv[0][8:13], kv[0][0:5])
        side.settled()
        stats = daemon.stats()
        assert stats["lease_ends"].get("consumed") == 1 and stats["load_hit_keys"] == 5
    finally:
        rank.close()
        side.link.close()

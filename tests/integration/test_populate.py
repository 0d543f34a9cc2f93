"""A rank client populates its mapping of the region in the background: it finishes, close()
cancels it, and a remap after a daemon restart never unmaps under it."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from kvtier import Client, DaemonUnavailable, NamespaceId
from kvtierd import hugepages

from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def make_client(daemon, rank: int | None = 0, **kw) -> tuple[Client, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    kv = [torch.randint(0, 255, (8, 16, 512), dtype=torch.uint8, generator=gen) for _ in range(2)]
    namespace = NamespaceId.for_kv_caches(kv, "populate-model", 16)
    client = Client(daemon.socket, engine_id="populate", rank=rank, world_size=1, namespace=namespace, timeout=3,
                    reconnect_timeout=30, **kw)
    if rank is not None:
        client.register_kv_caches(kv)
    return client, kv


def round_trip(client: Client, kv: list[torch.Tensor], job: int, tag: str) -> None:
    """Store blocks 0-2 under fresh keys and load them into 5-7: the bytes must come back."""
    keys = keys_for(tag, 3)
    client.store(job, keys, [0, 1, 2])
    assert client.wait([job])[0].ok
    assert client.load(job + 1, keys, [5, 6, 7]) == 3
    assert client.wait([job + 1])[0].ok
    for t in kv:
        assert torch.equal(t[5:8], t[0:3])


def test_rank_client_populates_its_mapping_in_the_background(daemon, caplog):
    caplog.set_level(logging.INFO, logger="kvtier.api")
    client, kv = make_client(daemon)
    try:
        task = client.populating
        assert task is not None and task.wait(60) and task.finished
        assert hugepages.backing(client.mapping.address).resident_bytes == client.mapping.size
        messages = [r.getMessage() for r in caplog.records]
        assert any("populating this process's mapping" in m for m in messages)
        assert any("region mapping populated" in m for m in messages)
        round_trip(client, kv, 1, "populated")
    finally:
        client.close()
    assert task.cancelled                                   # close() stops it (a no-op once finished)
    coordinator, _ = make_client(daemon, rank=None)           # maps nothing: nothing to populate
    unpopulated, _ = make_client(daemon, populate_threads=0)
    try:
        assert coordinator.populating is None and unpopulated.populating is None
    finally:
        coordinator.close()
        unpopulated.close()


def test_close_right_after_attach_cancels_the_populate(start_daemon):
    daemon = start_daemon(size="256MiB", root="/dev/shm")
    client, _ = make_client(daemon, populate_threads=1)
    task, mapping = client.populating, client.mapping
    client.close()                                          # typically mid-populate
    assert task.cancelled and mapping.address is None       # unmapped once the populate stopped
    task.wait(0)                                            # its threads are gone: no error, no wait


def test_remap_after_a_daemon_restart_cancels_the_old_populate_first(start_daemon):
    daemon = start_daemon(size="256MiB", root="/dev/shm")
    client, kv = make_client(daemon, populate_threads=1)
    try:
        old_task, old_mapping, generation = client.populating, client.mapping, client.info.generation
        client.store(1, keys_for("in-flight", 2), [3, 4])   # WRITING when the daemon dies: the region is
        os.kill(daemon.proc.pid, signal.SIGKILL)             # rebuilt on restart (new generation), so the
        daemon.proc.wait(10)                                 # client must remap
        daemon.start()
        (lost,) = client.wait([1])
        assert not lost.ok and isinstance(lost.error, DaemonUnavailable)
        assert client.info.generation != generation and client.mapping is not old_mapping
        assert old_task.cancelled and old_mapping.address is None
        assert client.populating is not old_task and client.populating.wait(60)
        round_trip(client, kv, 2, "after-restart")
    finally:
        client.close()

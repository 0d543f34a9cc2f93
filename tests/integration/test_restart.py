"""Daemon restarts under live clients, heartbeat liveness, and the region file changing under us."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from kvtier import Client, Coordinator, DaemonUnavailable, LayoutMismatch, NamespaceId, Rank
from kvtierd.contract.channel import Channel
from kvtierd.contract import protocol as P
from kvtierd.contract.region_view import RegionView
from kvtierd.contract.mapping import Mapping

from .ranks import CacheSpec
from .test_faults import layout_of
from .test_jobs import wait_for
from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def make_client(daemon, rank: int = 0, world_size: int = 1, engine: str = "restart", seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randint(0, 255, (8, 16, 512), dtype=torch.uint8, generator=gen) for _ in range(2)]
    layout = NamespaceId.for_kv_caches(kv, "restart-model", 16)
    client = Client(daemon.socket, engine_id=engine, rank=rank, world_size=world_size, namespace=layout,
                    timeout=3, reconnect_timeout=30)
    client.register_kv_caches(kv)
    return client, kv


def test_client_reattaches_after_a_daemon_crash_and_in_flight_jobs_fail_typed(daemon):
    client, kv = make_client(daemon)
    try:
        keys = keys_for("before", 3)
        client.store(1, keys, [0, 1, 2])
        assert client.wait([1])[0].ok
        pid_before, generation_before = client.info.daemon_pid, client.info.generation

        client.store(2, keys_for("in-flight", 2), [3, 4])    # copied, but not yet committed...
        os.kill(daemon.proc.pid, signal.SIGKILL)              # ...when the daemon dies
        daemon.proc.wait(10)
        daemon.start()
        # The job that was in flight fails with a typed error (a miss for the engine)...
        (lost,) = client.wait([2])
        assert not lost.ok and isinstance(lost.error, DaemonUnavailable)
        assert client.info.daemon_pid == daemon.proc.pid != pid_before   # ...and it re-attached on its own
        # The unfinished entries were discarded, so the region was rebuilt: a new generation.
        assert client.info.generation != generation_before
        assert "2 unfinished and 0 damaged discarded" in daemon.log()
        # What was READY before the crash is still there and loads back byte for byte.
        assert client.lookup(keys) == 3
        assert client.load(3, keys, [5, 6, 7]) == 3
        assert client.wait([3])[0].ok
        for t in kv:
            assert torch.equal(t[5:8], t[0:3])
        assert client.lookup(keys_for("in-flight", 2)) == 0
        stats = daemon.stats()
        assert stats["sessions"] == 1 and stats["entries_writing"] == 0 and stats["entries_pinned"] == 0
    finally:
        client.close()


def test_clean_restart_keeps_the_generation(daemon):
    client, _ = make_client(daemon)
    try:
        generation = client.info.generation
        assert daemon.stop() == 0
        daemon.start()
        assert client.lookup(keys_for("x", 1)) == 0          # re-attached transparently
        assert client.info.generation == generation       # nothing was rebuilt: no remap needed
    finally:
        client.close()


def test_a_planned_restart_under_a_client_is_invisible_beyond_its_duration(daemon):
    """SIGTERM (systemctl restart), then a new daemon on the same region: a lookup made while
    kvtierd is down waits for the new one and is answered there (leased again), and the blocks
    stored before load byte for byte; nothing the client asked fails."""
    client, kv = make_client(daemon)
    try:
        keys = keys_for("planned", 3)
        client.store(1, keys, [0, 1, 2])
        assert client.wait([1])[0].ok
        assert daemon.stop() == 0
        restart = threading.Thread(target=lambda: (time.sleep(0.3), daemon.start()))
        restart.start()
        try:
            assert client.lookup(keys, lease=7) == 3          # asked while kvtierd is down
        finally:
            restart.join()
        assert client.lease_held(7).leased == 3
        assert client.load(2, keys, [5, 6, 7], lease=7) == 3
        assert client.wait([2])[0].ok
        for t in kv:
            assert torch.equal(t[5:8], t[0:3])
        assert daemon.stats()["lease_ends"] == {"consumed": 1}
    finally:
        client.close()


def test_client_builds_the_role_its_rank_names(daemon):
    """Client(rank=r) is a Rank and Client(rank=None) a Coordinator, both Clients; each has only
    its own role's calls."""
    rank, _ = make_client(daemon)
    coordinator = Client(daemon.socket, engine_id="restart", rank=None, world_size=1, namespace=rank.namespace,
                         copier="cpu")
    try:
        assert isinstance(rank, Rank) and isinstance(rank, Client) and rank.is_writer
        assert isinstance(coordinator, Coordinator) and isinstance(coordinator, Client) and not coordinator.is_writer
        assert not hasattr(coordinator, "store") and not hasattr(rank, "open_store")
        assert coordinator.open_store(9, keys_for("role", 1)).written == 1
        with pytest.raises(ValueError, match="needs its rank"):
            Rank(daemon.socket, engine_id="restart", rank=None, world_size=1, namespace=rank.namespace)
    finally:
        coordinator.close()
        rank.close()


def test_daemon_gone_for_good_raises_daemon_unavailable(daemon):
    client, _ = make_client(daemon)
    client.reconnect_timeout = 1.0
    try:
        daemon.stop(signal.SIGKILL)
        with pytest.raises(DaemonUnavailable):
            client.lookup(keys_for("x", 1))
    finally:
        client.close()


def test_hello_may_replace_its_own_lost_session_but_not_anothers(daemon, ranks):
    """Rank 0 is held by another process's session: a hello naming it with a wrong token proves
    nothing; with its token it replaces it (a client's own re-attach after a lost reply)."""
    (first,) = ranks(1)
    spec = CacheSpec(num_blocks=4)
    layout = layout_of(spec, "replicated")
    info = first.call("connect", socket=daemon.socket, engine="restart", rank=0, world_size=1, spec=spec,
                      layout=layout, seed=0)
    hello = dict(version=P.PROTOCOL_VERSION, engine="restart", rank=0, world_size=1, namespace=layout)
    other = Channel(daemon.socket, timeout=5)
    try:
        with pytest.raises(LayoutMismatch):                   # rank 0 is taken...
            other.call("hello", **hello, replaces=info["session"], replaces_token=info["token"] ^ 1)
        reply = other.call("hello", **hello, replaces=info["session"], replaces_token=info["token"])
        assert reply["session"] != info["session"]            # ...unless the caller proves it was its own
        assert daemon.stats()["sessions"] == 1
    finally:
        other.close()


def test_unwatched_session_lives_by_heartbeats_and_dies_without_them(start_daemon):
    """The daemon in a PID namespace of its own sees no client's pid (as across pods): clients
    prove themselves alive by heartbeats, whatever pid and PID namespace they claim."""
    daemon = start_daemon("--heartbeat-timeout", "1.0", own_pid_namespace=True)
    client, _ = make_client(daemon)
    try:
        assert client.info.watched is False and client.info.heartbeat_interval == pytest.approx(1 / 3)
        session = client.session
        # Idle for three heartbeat timeouts: the heartbeat thread keeps the session alive.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert daemon.stats()["sessions"] == 1
            time.sleep(0.2)
        assert client.lookup(keys_for("x", 1)) == 0 and client.session == session
    finally:
        client.close()
    # A raw session that never sends anything is declared dead.
    silent = Channel(daemon.socket, timeout=5)
    try:
        silent.call("hello", version=P.PROTOCOL_VERSION, engine="silent", rank=None, world_size=1,
                    namespace=client.namespace.to_wire(), pid=os.getpid(), pidns=os.stat("/proc/self/ns/pid").st_ino)
        assert daemon.stats()["sessions"] == 1
        wait_for(lambda: daemon.stats()["sessions"] == 0, what="heartbeat timeout")
        assert "sent nothing for" in daemon.log()
    finally:
        silent.close()


def test_region_file_removed_is_reported_and_truncated_metadata_stops_the_daemon(start_daemon):
    daemon = start_daemon("--region-check-interval", "0.1")
    moved = daemon.region + ".moved"
    os.rename(daemon.region, moved)
    wait_for(lambda: daemon.stats()["region_problem"] == "region file removed", what="removal detected")
    assert "region file removed while the daemon runs" in daemon.log()
    os.rename(moved, daemon.region)
    wait_for(lambda: daemon.stats()["region_problem"] is None, what="file back")
    # Only the daemon's user can truncate the metadata file: then any access past its end is a
    # SIGBUS, and the daemon stops. (A truncated region file is replaced: test_access.py.)
    os.truncate(daemon.paths.meta, 4096 * 4)
    assert daemon.proc.wait(20) == 1
    assert "metadata file truncated under the daemon" in daemon.log()


def test_checksums_catch_a_corrupted_block_offline_and_on_restart(start_daemon):
    daemon = start_daemon("--checksums")
    client, kv = make_client(daemon)
    keys = keys_for("sums", 3)
    try:
        assert client.info.checksums is True
        client.store(1, keys, [0, 1, 2])
        assert client.wait([1])[0].ok
    finally:
        client.close()
    assert daemon.stop() == 0
    from .test_kvtierctl import run
    entries = {e["key"]: e for e in json.loads(run(daemon, "entries", "--json").stdout)}
    assert len(entries) == 3
    assert json.loads(run(daemon, "check", "--checksums", "--json").stdout)["ok"]
    # Flip one byte in the middle of the second block's bytes.
    damaged = json.loads(run(daemon, "inspect", "key", keys[1].hex(), "--json").stdout)["entries"][0]
    meta, data = Mapping.of_file(daemon.paths.meta), Mapping.of_file(daemon.region)
    view = RegionView(meta.buffer, data.buffer)
    offset = damaged["pages"][0] * view.geometry.page_size + 1000
    view.data[offset] ^= 0xFF
    del view
    meta.close()
    data.close()
    assert json.loads(run(daemon, "check", "--json").stdout)["ok"]          # tables alone look sound
    report = json.loads(run(daemon, "check", "--checksums", "--json", expect=1).stdout)
    assert report["problems"] == [{"slot": damaged["slot"], "reason": "checksum mismatch"}]
    daemon.start()
    assert "1 damaged discarded" in daemon.log()
    client, kv = make_client(daemon, seed=0)
    try:
        assert client.lookup(keys[:1]) == 1 and client.lookup(keys[1:2]) == 0 and client.lookup(keys[2:]) == 1
    finally:
        client.close()

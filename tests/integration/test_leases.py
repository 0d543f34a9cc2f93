"""Leases with a real daemon and real processes (invariant 10: a looked-up hit stays loadable).

An engine's coordinator (a ``kvtier.Client`` with rank None, in the test process or in a child
that is killed) leases what it looked up; its rank processes load it naming the lease. In
between, another engine fills the region, an operator clears it, the lease runs out or is
renewed, the daemon restarts. Every loaded block is checked against the bytes that were stored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvtier import Client, NamespaceId

from .ranks import all_call
from .test_faults import SPEC, attach, clobber, kill_daemon, layout_of, restart, store_all, wait_for
from .test_kvtierctl import ctl, ctl_json
from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

OTHER = NamespaceId("another-model", SPEC.dtype, SPEC.row_shape[0], SPEC.block_bytes(), "sharded")


def engine(daemon, ranks, name: str, n: int = 5, tp: int = 2):
    """An engine of ``tp`` rank processes that stored ``n`` blocks, and its coordinator.
    Returns (procs, coordinator, keys, the stored blocks' hashes)."""
    procs = ranks(tp)
    attach(procs, daemon, name, tp, list(range(tp)), seeds=[7] * tp)
    keys = keys_for(name, n)
    source = procs[0].call("hashes", block_ids=list(range(n)))
    store_all(procs, 1, keys, list(range(n)))
    coordinator = Client(daemon.socket, engine_id=name, rank=None, world_size=tp,
                         namespace=NamespaceId(**layout_of(SPEC, "replicated")), timeout=10)
    return procs, coordinator, keys, source


def fill_region(daemon) -> int:
    """Another engine opens stores for as many blocks as the region has pages: every evictable
    entry goes. Returns how many of its keys found room."""
    filler = Client(daemon.socket, engine_id="filler", rank=None, world_size=1, namespace=OTHER, timeout=10)
    try:
        pages = daemon.stats()["pages_total"]
        written = 0
        for job, begin in enumerate(range(0, pages, 4096), start=1):
            keys = [b"fill%09d" % i for i in range(begin, min(pages, begin + 4096))]
            written += filler.open_store(job, keys).written
        return written
    finally:
        filler.close()


def load_all(procs, job: int, keys, block_ids, lease=None) -> list[dict]:
    return all_call(procs, "load", job=job, keys=keys, block_ids=block_ids, lease=lease)


def loaded_right(procs, block_ids, source) -> bool:
    return all(hashes == source for hashes in all_call(procs, "hashes", block_ids=block_ids))


# ---------------------------------------------------------------------------- the race, closed
@pytest.mark.parametrize("window", ["another engine fills the region", "kvtierctl clear", "kvtierctl evict"])
def test_leased_hits_load_in_full_whatever_happens_between_lookup_and_load(daemon, ranks, window):
    procs, coordinator, keys, source = engine(daemon, ranks, "race")
    try:
        assert coordinator.lookup(keys, lease=11, ttl=30) == 5
        held = coordinator.lease_held(11)
        assert (held.hits, held.leased, held.ttl) == (5, 5, 30.0)
        if window.startswith("another"):
            written = fill_region(daemon)
            assert written == daemon.stats()["pages_total"] - 5        # all but our leased blocks
        elif window == "kvtierctl clear":
            out = ctl_json(daemon, "clear", "--all")
            assert (out["evicted"], out["skipped_leased"], out["revoked_leases"]) == (0, 5, 0)
            assert "skipped 5 leased entries" in ctl(daemon, "clear", "--all")
        else:
            out = ctl_json(daemon, "evict", "--count", "3")
            assert (out["evicted"], out["skipped_leased"]) == (0, 5)
        clobber(procs, list(range(8, 13)))
        for result in load_all(procs, 2, keys, list(range(8, 13)), lease=11):
            assert result["ok"] and result["hits"] == 5, result
        assert loaded_right(procs, list(range(8, 13)), source)
        stats = daemon.stats()
        assert stats["lease_ends"] == {"consumed": 1} and stats["leases_open"] == 0
        assert stats["lease_missed_loads"] == 0 and stats["entries_leased"] == 0
    finally:
        coordinator.close()


def test_without_a_lease_the_same_race_comes_back_short(daemon, ranks):
    procs, coordinator, keys, _ = engine(daemon, ranks, "unleased")
    try:
        assert coordinator.lookup(keys) == 5 and not coordinator.leases
        fill_region(daemon)
        for result in load_all(procs, 2, keys, list(range(8, 13))):
            assert result["hits"] == 0, result
    finally:
        coordinator.close()


def test_a_forced_clear_revokes_the_lease_and_the_load_comes_back_short(daemon, ranks):
    procs, coordinator, keys, _ = engine(daemon, ranks, "forced")
    try:
        coordinator.lookup(keys, lease=3)
        out = ctl_json(daemon, "clear", "--all", "--force")
        assert (out["evicted"], out["skipped_leased"], out["revoked_leases"]) == (5, 0, 1)
        for result in load_all(procs, 2, keys, list(range(8, 13)), lease=3):
            assert result["hits"] == 0, result                      # the engine's phase-1 path recomputes
        stats = daemon.stats()
        assert stats["lease_ends"] == {"revoked": 1} and stats["lease_missed_loads"] == 1
    finally:
        coordinator.close()


# ---------------------------------------------------------------------------- expiry, renewal, release
def test_a_lease_expires_and_a_renewed_one_holds(daemon, ranks):
    procs, coordinator, keys, source = engine(daemon, ranks, "ttl")
    try:
        coordinator.lookup(keys[:2], lease=1, ttl=0.3)               # expires
        coordinator.lookup(keys[2:], lease=2, ttl=0.6)               # renewed while it waits
        for _ in range(8):
            time.sleep(0.2)
            assert coordinator.lookup(keys[2:], lease=2, ttl=0.6) == 3
        wait_for(lambda: daemon.stats()["lease_ends"].get("expired") == 1, what="the lapsed lease expiring")
        assert coordinator.lease_held(1) is None and coordinator.lease_held(2).leased == 3
        fill_region(daemon)
        results = load_all(procs, 2, keys[2:], list(range(8, 11)), lease=2)
        assert [r["hits"] for r in results] == [3, 3]
        assert loaded_right(procs, list(range(8, 11)), source[2:])
        stats = daemon.stats()
        assert stats["lease_ends"] == {"expired": 1, "replaced": 8, "consumed": 1}
        assert stats["leases_granted"] == 10
        assert coordinator.lookup(keys[:2]) == 0                      # the expired lease's blocks went
    finally:
        coordinator.close()


def test_unlease_lets_the_entries_go(daemon, ranks):
    _, coordinator, keys, _ = engine(daemon, ranks, "unlease")
    try:
        coordinator.lookup(keys, lease=5)
        assert daemon.stats()["evictable"] == 0
        assert coordinator.unlease([5, 6]) == 1 and not coordinator.leases
        assert daemon.stats()["evictable"] == 5 and daemon.stats()["lease_ends"] == {"released": 1}
    finally:
        coordinator.close()


def test_the_cap_per_engine_leases_a_prefix_and_clients_shows_the_leases(start_daemon, ranks):
    daemon = start_daemon("--max-leased-keys-per-engine", "4")
    procs, coordinator, keys, source = engine(daemon, ranks, "capped")
    try:
        assert coordinator.lookup(keys, lease=9) == 5
        assert coordinator.lease_held(9).leased == 3                     # 3 entries + 1 for the lease
        rows = {row["session"]: row for row in ctl_json(daemon, "clients")["clients"]}
        assert rows[coordinator.session]["leases"] == 1 and rows[coordinator.session]["leased_keys"] == 3
        assert " leases " in ctl(daemon, "clients").splitlines()[0] + " "
        assert daemon.stats()["lease_capped_keys"] == 2
        fill_region(daemon)                                           # the 2 unleased blocks go
        results = load_all(procs, 2, keys, list(range(8, 13)), lease=9)
        assert [r["hits"] for r in results] == [3, 3]
        assert loaded_right(procs, list(range(8, 11)), source[:3])
    finally:
        coordinator.close()


# ---------------------------------------------------------------------------- sessions and restarts
LEASER = """
import sys, time
from kvtier import Client, NamespaceId
socket, engine, keys = sys.argv[1], sys.argv[2], [bytes.fromhex(k) for k in sys.argv[3:]]
client = Client(socket, engine_id=engine, rank=None, world_size=2,
                namespace=NamespaceId("tiny-mla", "bfloat16", 16, {block_bytes}, "replicated"))
print(client.lookup(keys, lease=1, ttl=60), flush=True)
time.sleep(600)
"""


def test_leases_die_with_the_session_that_holds_them(daemon, ranks):
    procs, coordinator, keys, _ = engine(daemon, ranks, "dies")
    coordinator.close()
    leaser = subprocess.Popen([sys.executable, "-c", LEASER.format(block_bytes=SPEC.block_bytes()), daemon.socket,
                               "dies", *(k.hex() for k in keys)], stdout=subprocess.PIPE, text=True)
    try:
        assert leaser.stdout.readline().strip() == "5"
        assert daemon.stats()["leases_open"] == 1 and daemon.stats()["evictable"] == 0
        os.kill(leaser.pid, signal.SIGKILL)
        leaser.wait(10)
        stats = wait_for(lambda: (s := daemon.stats())["leases_open"] == 0 and s, what="the lease ending")
        assert stats["lease_ends"] == {"session_ended": 1} and stats["evictable"] == 5
    finally:
        if leaser.poll() is None:
            leaser.kill()
            leaser.wait(10)


@pytest.mark.parametrize("first", ["the coordinator", "the ranks"])
def test_a_restart_between_lookup_and_load_loses_nothing(daemon, ranks, first):
    """Leases are lost with the daemon: the coordinator's client leases again once it
    re-attached, and the ranks' load (retried after their own re-attach) gets every block, which
    survived the restart in the region. If the ranks get there first, the lease is not there yet
    and their load pins the blocks as they are: all of them, since nothing evicted them."""
    procs, coordinator, keys, source = engine(daemon, ranks, "restart")
    try:
        coordinator.lookup(keys, lease=4, ttl=30)
        kill_daemon(daemon)
        restart(daemon)
        if first == "the coordinator":
            coordinator.job_status([1])                               # its next call re-attaches, re-leases
            assert daemon.stats()["leases_open"] == 1 and coordinator.lease_held(4).leased == 5
            fill_region(daemon)                                       # the re-issued lease holds
        clobber(procs, list(range(8, 13)))
        for result in load_all(procs, 2, keys, list(range(8, 13)), lease=4):
            assert result["ok"] and result["hits"] == 5, result
        assert loaded_right(procs, list(range(8, 13)), source)
        stats = daemon.stats()
        assert (stats["lease_ends"], stats["lease_missed_loads"]) == (
            ({"consumed": 1}, 0) if first == "the coordinator" else ({}, 1))
    finally:
        coordinator.close()


@pytest.mark.parametrize("released_before", [False, True])
def test_a_load_in_flight_across_a_restart_is_redone(start_daemon, ranks, released_before):
    """The daemon is SIGKILLed after the ranks' load requests and copies: the copies may have read
    pages the new daemon hands to someone else, so each rank's client opens the load again on
    the restarted daemon and copies again. ``released_before``: rank 0 had finished (released)
    before the kill, so the redone job waits for it in vain until job_timeout; rank 1's load is
    still whole."""
    daemon = start_daemon(job_timeout=2.0)
    procs, coordinator, keys, source = engine(daemon, ranks, "redo")
    coordinator.close()
    clobber(procs, list(range(8, 13)))
    if released_before:
        assert procs[0].call("load", job=2, keys=keys, block_ids=list(range(8, 13)))["hits"] == 5
        assert procs[1].call("load_hold", job=2, keys=keys, block_ids=list(range(8, 13)))["hits"] == 5
    else:
        assert [h["hits"] for h in all_call(procs, "load_hold", job=2, keys=keys, block_ids=list(range(8, 13)))] \
            == [5, 5]
    kill_daemon(daemon)
    restart(daemon)
    waiting = procs[1:] if released_before else procs
    for results in all_call(waiting, "finish", jobs=[2]):
        assert results[0]["ok"] and results[0]["hits"] == 5, results
    assert loaded_right(procs, list(range(8, 13)), source)
    if released_before:
        stats = wait_for(lambda: (s := daemon.stats())["open_jobs"] == 0 and s, what="the redone job's timeout")
        assert stats["aborted_jobs"] == {"timeout": 1} and stats["entries_pinned"] == 0
    else:
        assert daemon.stats()["load_jobs_done"] == 1


def test_a_load_that_finds_fewer_blocks_after_a_restart_fails(start_daemon, ranks):
    daemon = start_daemon()
    procs, coordinator, keys, _ = engine(daemon, ranks, "gone", tp=1)
    coordinator.close()
    assert procs[0].call("load_hold", job=2, keys=keys, block_ids=list(range(8, 13)))["hits"] == 5
    kill_daemon(daemon)
    restart(daemon)
    assert ctl_json(daemon, "clear", "--all")["evicted"] == 5
    (result,) = procs[0].call("finish", jobs=[2])
    assert not result["ok"] and result["error_type"] == "DaemonUnavailable", result
    assert daemon.stats()["open_jobs"] == 0


def test_lease_metrics_are_exported(daemon, ranks):
    import urllib.request
    _, coordinator, keys, _ = engine(daemon, ranks, "metrics", tp=1)
    try:
        coordinator.lookup(keys, lease=1)
        text = urllib.request.urlopen(f"http://{daemon.stats()['metrics_address']}/metrics", timeout=10).read().decode()
        assert "kvtierd_leases_open 1.0" in text and 'kvtierd_entries{state="leased"} 5.0' in text
        assert "kvtierd_leases_granted_total 1.0" in text
    finally:
        coordinator.close()

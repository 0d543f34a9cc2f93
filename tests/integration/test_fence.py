"""The page fence (issue 10, items 1-3): a load never returns another engine's bytes, however a
writer stops being seen — the daemon restarting under it (SIGTERM or SIGKILL), its job timing
out while it stalls, its heartbeats stopping while it is frozen.

Every scenario has the same shape. Engine A's writer asks to store blocks and gets its pages,
but its copy is held back (``gate``: a D2H copy queued behind the model's compute; or the whole
process SIGSTOPped). Then whatever makes the daemon lose sight of A happens, engine B stores its
own blocks, and only then do A's bytes land. Engine C (or B) loads B's blocks into clobbered
KV-cache blocks, and every block must hold exactly its key's bytes (``key_content``): a block
carrying A's bytes (foreign) or a mix (torn) fails. Before the fence, B was given A's pages and
every one of B's blocks came back with A's bytes, with ok=True. Finally the fenced pages must come
back once A finishes (its commit or re-attach) or dies.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtierd.contract.codes import StoreOutcome

from .ranks import CacheSpec, RankProcess
from .test_faults import adopt_line, layout_of, wait_for
from .test_kvtierctl import ctl_json
from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

N = 32                                                                          # blocks per engine
ONE_PAGE = CacheSpec(layers=2, num_blocks=2 * N, row_shape=(16, 1024), dtype="bfloat16")   # 64 KiB: 1 page


def connect(proc: RankProcess, daemon, engine: str, timeout: float = 10.0) -> dict:
    return proc.call("connect", socket=daemon.socket, engine=engine, rank=0, world_size=1, spec=ONE_PAGE,
                     layout=layout_of(ONE_PAGE, "replicated"), seed=1, timeout=timeout)


def hold_a_store(proc: RankProcess, keys: list[bytes]) -> None:
    """The writer fills its blocks with its keys' bytes and asks to store them: it gets the pages,
    its copy waits at the gate."""
    proc.call("fill_keys", keys=keys, block_ids=list(range(N)))
    proc.call("gate")
    held = proc.call("store_hold", job=1, keys=keys, block_ids=list(range(N)))
    assert held["outcomes"] == [StoreOutcome.WRITE] * N


def store(proc: RankProcess, job: int, keys: list[bytes]) -> None:
    proc.call("fill_keys", keys=keys, block_ids=list(range(N)))
    result = proc.call("store", job=job, keys=keys, block_ids=list(range(N)))
    assert result["ok"] and result["outcomes"] == [StoreOutcome.WRITE] * N, result


def load_and_count_foreign(proc: RankProcess, job: int, keys: list[bytes]) -> int:
    """Load ``keys`` into blocks N..2N-1 (clobbered first); how many hold other bytes than their key's."""
    dst = list(range(N, 2 * N))
    proc.call("fill", block_ids=dst, seed=99)
    result = proc.call("load", job=job, keys=keys, block_ids=dst)
    assert result["ok"] and result["hits"] == len(keys), result
    return proc.call("verify_keys", keys=keys, block_ids=dst).count(False)


def fence_settles(daemon, cause: str, pages: int = N) -> dict:
    """Wait until no page is fenced; ``pages`` of them came back for ``cause``."""
    stats = wait_for(lambda: (s := daemon.stats())["pages_fenced"] == 0 and s, what="the fenced pages to come back")
    assert stats["fence_released_pages"][cause] >= pages, stats["fence_released_pages"]
    assert stats["pages_used"] == sum(ns["entries"] * ns["entry_pages"] for ns in stats["namespace_list"])
    return stats


def restart(daemon, how: str) -> None:
    daemon.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    daemon.proc.wait(30)
    daemon.start()


# ---------------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("end", ["writer_finishes", "writer_dies"])
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_restart_with_a_store_copy_in_flight_serves_no_foreign_bytes(start_daemon, ranks, how, end):
    """A's copy is still in flight when the daemon stops (SIGTERM whose drain runs out, or
    SIGKILL) and comes back; B stores right after the restart; then A's copy lands. The
    restarted daemon parked A's pages (A's pid and start time in the region say it lives), so B
    got others: B's blocks load with B's bytes. A's pages come back when A re-attaches after its
    copy, or when it dies (its copy landed, its commit never sent)."""
    daemon = start_daemon("--drain-timeout", "1", size="16MiB")
    a, b = ranks(2)
    connect(a, daemon, "engine-a")
    connect(b, daemon, "engine-b")
    ka, kb = keys_for("fence-a", N), keys_for("fence-b", N)
    hold_a_store(a, ka)

    restart(daemon, how)
    store(b, 2, kb)                                  # B re-attaches by itself and stores
    during = daemon.stats()
    if end == "writer_finishes":
        a.call("open_gate")                          # A's bytes land now
        (result,) = a.call("finish", jobs=[1])
        assert not result["ok"] and result["error_type"] == "DaemonUnavailable", result
        cause = "reattached"
    else:
        a.call("open_gate", wait=True)               # A's bytes land, then A dies before its commit
        a.kill()
        cause = "died"
    assert load_and_count_foreign(b, 3, kb) == 0
    assert during["pages_fenced"] == N and during["fenced_pages"]["restart_recovery"] == N, during
    assert f"{N} pages fenced for writers not proven gone" in adopt_line(daemon)
    fence_settles(daemon, cause)
    assert ctl_json(daemon, "check")["ok"]


def test_sigterm_drains_store_copies_in_flight(start_daemon, ranks):
    """A SIGTERM drain waits for open store jobs too: A's copy completes during the drain, its
    commit is accepted, the daemon stops cleanly and A's blocks are there after the restart."""
    daemon = start_daemon("--drain-timeout", "60", size="16MiB")
    a, b = ranks(2)
    connect(a, daemon, "engine-a")
    connect(b, daemon, "engine-b")
    ka = keys_for("drain-a", N)
    hold_a_store(a, ka)
    daemon.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping" in daemon.log(), what="the drain to start")
    a.call("open_gate")
    (result,) = a.call("finish", jobs=[1])
    assert result["ok"], result                      # the draining daemon took A's commit
    assert daemon.proc.wait(30) == 0 and "stopped cleanly" in daemon.log()
    daemon.start()
    assert "0 unfinished" in adopt_line(daemon)
    assert load_and_count_foreign(b, 1, ka) == 0     # B loads A's blocks: all there, all A's


def b_stores_while_a_is_frozen(daemon, a: RankProcess, b: RankProcess, prefix: str, given_up) -> tuple:
    """A (the writer) holds a store of its blocks and is frozen (SIGSTOP) until ``given_up()``
    says the daemon gave up on it; B stores its own blocks meanwhile; then A thaws and its copy
    lands. Returns (the stats taken while A was frozen, B's keys, A's job result)."""
    ka, kb = keys_for(f"{prefix}-a", N), keys_for(f"{prefix}-b", N)
    hold_a_store(a, ka)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        given_up()
        store(b, 1, kb)
        during = daemon.stats()
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a.call("open_gate")
    (result,) = a.call("finish", jobs=[1])
    return during, kb, result


# ---------------------------------------------------------------------------------- item 2
@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "checksums"])
def test_a_writer_stalled_past_two_job_timeouts_keeps_its_pages(start_daemon, ranks, checksums):
    """In the daemon's PID namespace: A is handed pages, then stalls (SIGSTOP) past twice the job
    timeout — when the old quarantine gave its pages away while it lived. The job aborts, the pages
    stay fenced for as long as A lives; B stores, A resumes and its copy lands, C loads B's
    blocks: all B's bytes, with checksums on or off."""
    job_timeout = 2.0
    daemon = start_daemon(*(["--checksums"] if checksums else []), job_timeout=job_timeout, size="16MiB")
    a, b, c = ranks(3)
    assert connect(a, daemon, "engine-a")["watched"]
    connect(b, daemon, "engine-b")
    connect(c, daemon, "engine-c")

    def past_two_job_timeouts():
        wait_for(lambda: daemon.stats()["aborted_jobs"].get("timeout"), what="A's job to time out")
        time.sleep(1.5 * job_timeout)                # past 2 x job_timeout since the job opened

    during, kb, result = b_stores_while_a_is_frozen(daemon, a, b, "stall", past_two_job_timeouts)
    assert not result["ok"] and result["error_type"] == "JobTimeout", result
    assert load_and_count_foreign(c, 1, kb) == 0
    assert during["fenced_pages"]["writer_alive"] == N, during
    fence_settles(daemon, "committed")
    if checksums:
        assert ctl_json(daemon, "check", "--checksums")["ok"]


# ---------------------------------------------------------------------------------- item 3
def test_a_writer_frozen_past_the_heartbeat_timeout_keeps_its_pages(start_daemon, ranks):
    """A lost heartbeat is not death. The daemon runs in a PID namespace of its own, so it cannot
    see its clients (the default of deploy/kubernetes/daemonset.yaml: every engine pod is another
    PID namespace): A proves itself alive by heartbeats. A is frozen (SIGSTOP) mid-copy for longer
    than heartbeat_timeout: its session ends, its votes go, its pages stay fenced (the grace
    period). B stores, A thaws and its copy lands, C loads B's blocks: all B's bytes. A's next call
    finds its session gone, re-attaches naming it, and its pages come back."""
    daemon = start_daemon("--heartbeat-timeout", "1", size="16MiB", own_pid_namespace=True)
    a, b, c = ranks(3)
    assert not connect(a, daemon, "engine-a")["watched"]     # heartbeats, no pidfd
    connect(b, daemon, "engine-b")
    connect(c, daemon, "engine-c")
    during, kb, result = b_stores_while_a_is_frozen(
        daemon, a, b, "frozen", lambda: wait_for(lambda: daemon.stats()["aborted_jobs"].get("rank_heartbeat_lost"),
                                                 what="A's heartbeat to be lost"))
    assert not result["ok"], result                          # it learns: its session was dropped
    assert load_and_count_foreign(c, 1, kb) == 0
    assert during["fenced_pages"]["grace"] == N and during["sessions"] == 2, during
    fence_settles(daemon, "reattached")


def test_an_unwatchable_writer_that_never_comes_back_is_released_after_the_grace(start_daemon, ranks):
    """The residual risk's other side: a writer the daemon cannot watch, gone for good (SIGKILL
    in another PID namespace proves nothing here), holds its pages only for fence_grace."""
    daemon = start_daemon("--heartbeat-timeout", "1", "--fence-grace", "3", size="16MiB", own_pid_namespace=True)
    (a,) = ranks(1)
    connect(a, daemon, "engine-a")
    hold_a_store(a, keys_for("gone-a", N))
    a.kill()
    wait_for(lambda: daemon.stats()["fenced_pages"]["grace"] == N, what="A's heartbeat to be lost")
    fence_settles(daemon, "grace")

"""The client's restart path (issue 10, items 4 and 5): poll() and wait() never lose a finished
result nor raise on a restart they find half-way, and a live process is never locked out of its
own rank by a session it orphaned (a Client dropped without close(), a hello whose reply came
too late) — neither when it attaches anew nor in its re-attach loop.

The clients run in this test process (a real kvtier.Client, its real copier and socket); the
daemon is a real process.
"""

from __future__ import annotations

import gc
import os
import signal

import pytest
import zmq

from kvtier import Client, DaemonUnavailable
from kvtierd.contract import protocol as P

from .ranks import GatedCopier
from .test_jobs import wait_for
from .test_restart import make_client
from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def copies_done(client: Client) -> None:
    """Block until every copy the client has in flight completed (it has not voted yet)."""
    for pending in list(client._pending.values()):
        pending.handle.wait(30)


def kill_and_restart(daemon) -> None:
    daemon.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    daemon.start()


def assert_works(client: Client, kv, job: int) -> None:
    """A store and a load on the client, bytes compared."""
    keys = keys_for(f"works-{job}", 2)
    client.store(job, keys, [0, 1])
    assert client.wait([job])[0].ok
    assert client.load(job + 1, keys, [6, 7]) == 2 and client.wait([job + 1])[0].ok
    for t in kv:
        assert (t[6:8] == t[0:2]).all()


# ---------------------------------------------------------------------------------- item 4
def test_poll_with_two_pending_jobs_across_a_restart_reports_each_job_once(daemon):
    """Finishing the first job finds the restart and re-attaches, which settles the second as
    lost while poll() iterates: it raised KeyError, and the first job's result was lost."""
    client, kv = make_client(daemon)
    try:
        client.store(1, keys_for("poll-1", 2), [0, 1])
        client.store(2, keys_for("poll-2", 2), [2, 3])
        client.store(3, keys_for("poll-3", 1), [4])
        copies_done(client)
        kill_and_restart(daemon)
        results = client.poll()
        assert sorted(r.job for r in results) == [1, 2, 3]
        assert all(not r.ok and isinstance(r.error, DaemonUnavailable) for r in results), results
        assert client.poll() == []
        assert_works(client, kv, 10)
    finally:
        client.close()


def test_wait_across_a_restart_reports_every_job_once_in_order(daemon):
    client, kv = make_client(daemon)
    try:
        for job in (1, 2, 3):
            client.store(job, keys_for(f"wait-{job}", 1), [job])
        copies_done(client)
        kill_and_restart(daemon)
        results = client.wait([3, 1, 2])
        assert [r.job for r in results] == [3, 1, 2] and not any(r.ok for r in results)
        assert client.poll() == []
        assert_works(client, kv, 10)
    finally:
        client.close()


def test_a_wait_that_times_out_keeps_the_results_it_finished(daemon):
    """wait([1, 2]) finishes job 1 (its vote is accepted), then times out on job 2: job 1's
    result used to be dropped with the exception; now the next poll() returns it."""
    from concurrent.futures import TimeoutError as FutureTimeout

    client, kv = make_client(daemon)
    try:
        client.store(1, keys_for("timeout-1", 1), [0])
        copies_done(client)
        client.copier = GatedCopier(client.copier)
        client.copier.armed = True
        client.store(2, keys_for("timeout-2", 1), [1])          # its copy waits at the gate
        with pytest.raises(FutureTimeout):
            client.wait([1, 2], timeout=0.5)
        client.copier.gate.set()
        copies_done(client)
        results = {r.job: r for r in client.poll()}
        assert sorted(results) == [1, 2] and results[1].ok and results[2].ok
        assert client.poll() == []
    finally:
        client.close()


# ---------------------------------------------------------------------------------- item 5
def test_a_client_dropped_without_close_does_not_lock_its_rank(daemon):
    first, _ = make_client(daemon, engine="dropped")
    del first
    gc.collect()
    assert daemon.stats()["sessions"] == 1                      # only this process's death would end it
    second, kv = make_client(daemon, engine="dropped")          # the same process: it takes the rank over
    try:
        assert daemon.stats()["sessions"] == 1 and daemon.stats()["aborted_jobs"] == {}
        assert_works(second, kv, 1)
    finally:
        second.close()


def hello_without_reading_the_reply(daemon, engine: str, namespace: dict) -> zmq.Socket:
    """A hello whose reply comes after the client gave up: sent, never read. The socket is returned
    open (the caller closes it): a session ends with its connection, so the orphan stays only while
    the socket it said hello on is open — here, until the client under test has attached."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{daemon.socket}")
    sock.send(P.encode({"op": "hello", "rid": 1, "version": P.PROTOCOL_VERSION, "engine": engine, "rank": 0,
                        "world_size": 1, "namespace": namespace, "pid": os.getpid(),
                        "pidns": os.stat("/proc/self/ns/pid").st_ino}))
    wait_for(lambda: daemon.stats()["session_roles"]["rank"] >= 1, what="the late hello to attach")
    return sock


def test_a_hello_whose_reply_came_too_late_does_not_lock_its_rank(daemon):
    probe, _ = make_client(daemon, engine="probe")
    namespace = probe.namespace.to_wire()
    probe.close()
    orphan = hello_without_reading_the_reply(daemon, "late", namespace)
    client, kv = make_client(daemon, engine="late")
    try:
        assert daemon.stats()["sessions"] == 1
        assert_works(client, kv, 1)
    finally:
        client.close()
        orphan.close()


def test_the_reattach_loop_takes_over_an_orphan_of_its_own_process(daemon):
    """After a restart the first hello of the re-attach loop got no reply in time (here: one sent
    by hand, unread), but the daemon attached it: the loop's next hello finds the rank taken by
    that orphan. It used to fail the engine's call with LayoutMismatch."""
    client, kv = make_client(daemon, engine="loop")
    try:
        kill_and_restart(daemon)
        orphan = hello_without_reading_the_reply(daemon, "loop", client.namespace.to_wire())
        try:
            assert client.lookup(keys_for("loop", 1)) == 0          # re-attaches: takes its rank back
            assert daemon.stats()["sessions"] == 1
            assert_works(client, kv, 1)
        finally:
            orphan.close()
    finally:
        client.close()

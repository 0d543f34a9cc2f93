"""kvtierd.fence: the writer fence in the region's tables, and what a restarted daemon makes of it.

No sockets: a store over an in-memory region (``store_env``), restarted by building a new store
over the same bytes (``reopen``), and real child processes standing for writers, so that the
proofs (pidfd, /proc start time) are the kernel's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import select
import subprocess

import numpy as np
import pytest

from kvtierd.attachments import SessionEnd
from kvtierd.contract.codes import ErrorCode
from kvtierd.contract.region_format import FENCE_NONE, WriterState
from kvtierd.fence import RECHECK_SECONDS
from kvtierd.processes import Process, start_ticks

from .store_env import Env, err, keys, lay, pages, reopen


@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait(10)


def writer_of(env: Env, pid: int = 0, engine: str = "e", world_size: int = 2):
    """Rank sessions of a replicated engine whose rank 0 (the writer) runs as ``pid``."""
    ns = lay("replicated", world_size)
    process = Process(pid, start_ticks(pid) or 0) if pid else Process()
    ranks = [env.store.attach(engine, 0, world_size, ns, process)]
    ranks += [env.store.attach(engine, r, world_size, ns) for r in range(1, world_size)]
    return ranks


def handed(env: Env, sess, job: int, n: int, prefix: str = "k") -> list[int]:
    """The writer asks to store ``n`` keys and gets their pages (it is copying now)."""
    _, got = env.store.store(sess[0], job, keys(prefix, n))
    return pages(got)


def test_pages_are_fenced_in_the_region_before_the_reply_and_settled_by_the_commit():
    env = Env(16)
    sess = writer_of(env)
    held = handed(env, sess, 1, 3)
    row = sess[0].writer.row
    view = env.view
    assert view.fence[held].tolist() == [row] * 3 and int(view.writers["state"][row]) == WriterState.ATTACHED
    assert (np.delete(view.fence, held) == FENCE_NONE).all()
    assert int(view.writers["session"][row]) == sess[0].id and int(view.writers["token"][row]) == sess[0].token
    env.store.commit(sess[0], 1, True)
    assert (view.fence == FENCE_NONE).all()                  # committed: no fence, still WRITING until rank 1
    env.store.store(sess[1], 1, keys("k", 3))
    assert env.stats()["entries_ready"] == 3
    env.store.verify()


def test_a_restart_parks_a_living_writers_pages_and_frees_them_when_it_dies(child):
    """Issue 10 item 1 (SIGKILL): the old daemon freed the pages of WRITING records at once, so
    the next engine's store got them while the first writer still copied. Now they are parked
    until the writer's process, recorded by pid and start time, is gone."""
    env = Env(16)
    sess = writer_of(env, child.pid)
    held = handed(env, sess, 1, 4)
    restarted = reopen(env.view, env.clock)               # the daemon died and came back
    assert restarted.recovered["writing_discarded"] == 4 and restarted.recovered["pages_fenced"] == 4
    stats = restarted.stats()
    assert stats["fenced_pages"]["restart_recovery"] == 4 and stats["pages_free"] == 12
    other = [restarted.attach("b", 0, 1, lay("replicated", 1))]
    _, got = restarted.store(other[0], 1, keys("b", 12))
    assert not set(pages(got)) & set(held)                # nobody gets the fenced pages
    (fd,) = restarted.fence.pidfds
    assert select.select([fd], [], [], 0)[0] == []
    child.kill()
    child.wait(10)
    assert select.select([fd], [], [], 5)[0] == [fd]
    restarted.writer_died(fd)
    stats = restarted.stats()
    assert stats["pages_fenced"] == 0 and stats["fence_released_pages"]["died"] == 4 and stats["pages_free"] == 4
    assert restarted.fence.pidfds == {}
    restarted.verify()


def test_a_restart_frees_the_pages_of_a_writer_proven_gone(child):
    env = Env(16)
    sess = writer_of(env, child.pid)
    handed(env, sess, 1, 2)
    child.kill()
    child.wait(10)
    restarted = reopen(env.view, env.clock)
    assert restarted.recovered["pages_fenced"] == 0
    assert restarted.stats()["pages_free"] == 16 and restarted.stats()["fence_released_pages"]["died"] == 2
    assert (env.view.writers["state"] == WriterState.FREE).all() and (env.view.fence == FENCE_NONE).all()
    restarted.verify()


@pytest.mark.parametrize("field,change", [("start_ticks", 1), ("boot", 1)])
def test_a_reused_pid_or_another_boot_is_no_proof_of_life(child, field, change):
    """The pid lives, but not the recorded process: a later one got the pid (another start
    time), or the record is of another boot. Its pages are free."""
    env = Env(16)
    sess = writer_of(env, child.pid)
    handed(env, sess, 1, 2)
    env.view.writers[field][sess[0].writer.row] += change
    restarted = reopen(env.view, env.clock)
    assert restarted.recovered["pages_fenced"] == 0 and restarted.fence.pidfds == {}
    restarted.verify()


def test_a_writer_the_restarted_daemon_cannot_watch_waits_for_its_token_or_the_grace():
    env = Env(16)
    clock = env.clock
    sess = writer_of(env)                                    # pid 0: another PID namespace
    handed(env, sess, 1, 2, "a")
    handed(env, sess, 2, 3, "b")
    token, session = sess[0].token, sess[0].id
    first = reopen(env.view, clock)
    assert first.recovered["pages_fenced"] == 5 and first.stats()["fenced_pages"]["restart_recovery"] == 5
    first.reattached(session, token)                        # it came back, naming its session: settled
    assert first.stats()["pages_fenced"] == 0 and first.stats()["fence_released_pages"]["reattached"] == 5
    first.verify()

    env2 = Env(16)
    sess = writer_of(env2)
    handed(env2, sess, 1, 2)
    env2.clock.advance(5.0)
    env2.store.fence.stamp([(sess[0].writer, env2.clock())])  # the sweep's record of its last proof of life
    seen = env2.clock()
    second = reopen(env2.view, env2.clock)
    grace = second.fence.grace
    env2.clock.advance(grace - 1.0)
    assert second.expire() == pytest.approx(seen + grace)
    assert second.stats()["pages_fenced"] == 2
    env2.clock.advance(1.5)
    second.expire()
    assert second.stats()["pages_fenced"] == 0 and second.stats()["fence_released_pages"]["grace"] == 2
    second.verify()


def test_a_ready_entry_wins_over_a_stale_fence_and_a_fence_naming_no_writer_is_cleared():
    env = Env(16)
    sess = writer_of(env)
    env.put(sess, 1, keys("r", 2))
    index, ns = env.store.index, sess[0].engine.ns
    ready = pages(index.pages_of(ns, index.find(ns, keys("r", 2))))
    env.view.fence[ready[0]] = sess[0].writer.row           # a crash between READY and the settle
    env.view.fence[10] = 4000                               # names a row that is not in use
    restarted = reopen(env.view, env.clock)
    assert restarted.recovered["pages_fenced"] == 0 and restarted.stats()["entries_ready"] == 2
    assert (env.view.fence == FENCE_NONE).all() and restarted.stats()["pages_free"] == 14
    restarted.verify()


def test_a_clean_stop_keeps_the_fence_for_the_next_daemon(child):
    env = Env(16)
    sess = writer_of(env, child.pid)
    handed(env, sess, 1, 3)
    env.store.shutdown()                                    # the drain ran out: the job is still open
    restarted = reopen(env.view, env.clock)
    assert restarted.recovered["pages_fenced"] == 3 and len(restarted.fence.pidfds) == 1
    restarted.fence.close()


def test_writer_rows_run_out_with_a_clear_error(monkeypatch):
    env = Env(16)
    monkeypatch.setattr(env.store.fence._free_rows, "alloc", lambda n: None)
    with err(ErrorCode.NO_SPACE) as info:
        writer_of(env, world_size=1)
    assert "writer rows" in info.value.message
    assert env.store.jobs.engines == {} and env.store.attachments.sessions == {}
    env.store.verify()


def test_a_detached_watchable_writer_is_watched_until_it_dies(child):
    """Taken over (or re-helloed) while its process lives: its pages stay fenced, and the fence
    watches the process itself now that no session does."""
    env = Env(16)
    sess = writer_of(env, child.pid)
    handed(env, sess, 1, 2)
    env.store.detach(sess[0], SessionEnd.TAKEN_OVER)
    assert env.stats()["fenced_pages"]["writer_alive"] == 2
    (fd,) = env.store.fence.pidfds
    os.kill(child.pid, 9)
    child.wait(10)
    assert select.select([fd], [], [], 5)[0] == [fd]
    env.store.writer_died(fd)
    assert env.stats()["pages_fenced"] == 0 and env.stats()["writer_rows"] == 0
    env.store.verify()


@contextlib.contextmanager
def out_of_descriptors():
    """Every descriptor this process may open is taken while the block runs: the next open fails
    with EMFILE, as in a daemon at its open-files limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    taken = []
    try:
        while True:
            try:
                taken.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                break
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def pidfd_open_fails(monkeypatch, code: int):
    """pidfd_open fails with ``code`` (ENFILE, ENOMEM: what a full system answers) while the block runs."""
    def fail(pid, flags=0):
        raise OSError(code, os.strerror(code))
    with monkeypatch.context() as m:
        m.setattr(os, "pidfd_open", fail)
        yield


@pytest.mark.parametrize("how", ["emfile", "enfile", "enomem"])
def test_a_writer_whose_process_cannot_be_checked_keeps_its_pages_fenced(child, monkeypatch, how):
    """Issue 26 F: at EMFILE (ENFILE, ENOMEM) the fence took the failed pidfd_open of a gone
    writer's process for its death and gave back the pages that live process may still copy into.
    Only ESRCH or another start time proves death: the pages stay fenced (reason unproven), the
    check is made again every RECHECK_SECONDS, and counted."""
    failing = out_of_descriptors() if how == "emfile" else pidfd_open_fails(
        monkeypatch, {"enfile": errno.ENFILE, "enomem": errno.ENOMEM}[how])
    env = Env(16)
    sess = writer_of(env, child.pid)
    held = handed(env, sess, 1, 3)
    with failing:
        env.store.detach(sess[0], SessionEnd.TAKEN_OVER)     # its process lives on, copying
        env.clock.advance(RECHECK_SECONDS)
        env.store.expire()                                   # checked again: still cannot tell
    stats = env.stats()
    assert stats["pages_fenced"] == 3 and stats["fenced_pages"]["unproven"] == 3, stats["fenced_pages"]
    assert stats["fence_check_failures"] == 2 and stats["fence_released_pages"]["died"] == 0
    assert env.store.fence.pidfds == {} and (env.view.fence[held] == sess[0].writer.row).all()
    other = env.engine("o", 1, model="O")
    _, got = env.store.store(other[0], 1, keys("o", 13))
    assert not set(pages(got)) & set(held)                   # nobody gets its pages
    env.store.verify()
    env.clock.advance(RECHECK_SECONDS)
    assert env.store.expire() is not None                    # descriptors again: the process is watched
    (fd,) = env.store.fence.pidfds
    assert env.stats()["fenced_pages"]["writer_alive"] == 3
    child.kill()
    child.wait(10)
    assert select.select([fd], [], [], 5)[0] == [fd]
    env.store.writer_died(fd)
    assert env.stats()["pages_fenced"] == 0 and env.stats()["fence_released_pages"]["died"] == 3
    env.store.verify()


def test_a_writer_that_died_while_it_could_not_be_checked_is_released_at_the_next_check(child, monkeypatch):
    env = Env(16)
    sess = writer_of(env, child.pid)
    handed(env, sess, 1, 2)
    with pidfd_open_fails(monkeypatch, errno.ENOMEM):
        restarted = reopen(env.view, env.clock)              # a restart that cannot check the writer
    assert restarted.recovered["pages_fenced"] == 2 and restarted.fence.pidfds == {}
    assert restarted.stats()["fence_check_failures"] == 1
    child.kill()
    child.wait(10)
    env.clock.advance(RECHECK_SECONDS)
    assert restarted.expire() is None
    stats = restarted.stats()
    assert stats["pages_fenced"] == 0 and stats["fence_released_pages"]["died"] == 2 and stats["writer_rows"] == 0
    restarted.verify()

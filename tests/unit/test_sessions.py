"""kvtierd.sessions.SessionRegistry: identities, tokens, pidfd and heartbeat liveness, ending.

No sockets: the registry is driven directly, over a real store (``store_env``) whose ``detach``
it calls, and real processes for the pidfds. A session's process is what the kernel would say of
the socket's peer (``Process``): a pid the daemon sees is watched, pid 0 owes heartbeats.
"""

from __future__ import annotations

import os
import select
import subprocess

import pytest

from kvtierd.attachments import SessionEnd
from kvtierd.contract.codes import ErrorCode
from kvtierd.peers import Conn
from kvtierd.processes import Process, start_ticks
from kvtierd.sessions import SessionRegistry

from .store_env import Env, err, lay


class Registry:
    """A registry over a store, recording which fds it asked to watch and which sessions ended."""

    def __init__(self, heartbeat_timeout: float = 15.0):
        self.env = Env()
        self.ended: list[tuple[int, SessionEnd]] = []
        self.watching: set[int] = set()

        def end(session, cause, last_seen):
            self.ended.append((session.id, cause))
            self.env.store.detach(session, cause, last_seen)

        self.reg = SessionRegistry(end, heartbeat_timeout, watch=self.watching.add, unwatch=self.watching.remove,
                                   clock=self.env.clock, fence=self.env.store.fence)

    def attach(self, identity: bytes, rank: int = 0, world_size: int = 2, pid: int = 0):
        """A session whose socket peer is ``pid`` (0: a process the daemon cannot see)."""
        process = Process(pid, start_ticks(pid) or 0) if pid else Process()
        session = self.env.store.attach("e", rank, world_size, lay("replicated", world_size), process)
        watched = self.reg.register(identity, session)
        return session, watched, session.token


@pytest.fixture
def r():
    reg = Registry()
    yield reg
    reg.reg.close()
    reg.env.store.verify()


def test_identity_token_and_heartbeat(r):
    s, watched, token = r.attach(b"id-0")
    assert not watched and 0 <= token < (1 << 62)
    assert r.reg.session_of(b"id-0") is s and r.reg.session_of(b"other") is None
    assert r.reg.proven(s.id, token) is s
    assert r.reg.proven(s.id, token ^ 1) is None and r.reg.proven(s.id, None) is None
    assert r.reg.proven(s.id + 1, token) is None
    assert s.id in r.reg.heartbeats and not r.reg.watched(s) and len(r.reg) == 1
    assert r.reg.heartbeat(s.id, token) and not r.reg.heartbeat(s.id, token + 1)
    assert not r.reg.heartbeat(999, token)


def test_requests_and_heartbeats_keep_a_session_alive(r):
    s, _, token = r.attach(b"id-0")
    clock = r.env.clock
    r.reg.heartbeats[s.id] = clock() - 10.0
    r.reg.session_of(b"id-0")                                # any request proves it alive
    assert r.reg.heartbeats[s.id] == clock()
    r.reg.heartbeats[s.id] = clock() - 10.0
    assert r.reg.heartbeat(s.id, token)
    assert r.reg.heartbeats[s.id] == clock()


def test_sweep_ends_silent_sessions_only(r):
    quiet, _, _ = r.attach(b"quiet", rank=0)
    busy, _, _ = r.attach(b"busy", rank=1)
    r.env.store.store(quiet, 1, [b"k"])                      # rank 0 writes, rank 1 never votes
    now = r.env.clock()
    lost_at = now - r.reg.heartbeat_timeout - 1
    r.reg.heartbeats[quiet.id] = lost_at
    r.reg.sweep(now)
    assert r.ended == [(quiet.id, SessionEnd.HEARTBEAT_LOST)]
    assert r.reg.session_of(b"quiet") is None and r.reg.session_of(b"busy") is busy
    assert r.env.store.jobs.aborted["rank_heartbeat_lost"] == 1
    assert quiet.id not in r.reg.heartbeats and len(r.reg) == 1
    # Its rights ended, not its writer's fence: the page it may still copy into waits for the
    # grace period, counted from when it was last heard of.
    stats = r.env.stats()
    assert stats["entries_writing"] == 0 and stats["fenced_pages"]["grace"] == 1
    assert float(r.env.view.writers["last_seen"][quiet.writer.row]) == lost_at


def test_sweep_persists_the_writers_last_proof_of_life(r):
    writer, _, _ = r.attach(b"w", rank=0)
    r.attach(b"n", rank=1)
    heard = r.env.clock() - 3.0
    r.reg.heartbeats[writer.id] = heard
    r.reg.sweep(r.env.clock())
    assert float(r.env.view.writers["last_seen"][writer.writer.row]) == heard


def test_same_pid_namespace_is_watched_through_a_pidfd(r):
    child = subprocess.Popen(["sleep", "60"])
    try:
        s, watched, _ = r.attach(b"child", pid=child.pid)
        assert watched and r.reg.watched(s) and s.id not in r.reg.heartbeats
        (fd,) = r.reg.pidfds
        assert r.watching == {fd} and r.reg.pidfds[fd] is s
        assert select.select([fd], [], [], 0)[0] == []      # alive: not readable
        child.kill()
        child.wait(10)
        assert select.select([fd], [], [], 5)[0] == [fd]    # what the server's poller sees
        r.reg.died(fd)
        assert r.ended == [(s.id, SessionEnd.DIED)]
        assert r.watching == set() and r.reg.pidfds == {} and r.env.store.attachments.sessions == {}
        with pytest.raises(OSError):
            os.fstat(fd)                                     # closed
    finally:
        child.kill()
        child.wait(10)


def test_a_pid_gone_at_hello_ends_the_session_at_once(r):
    done = subprocess.Popen(["true"])
    done.wait(10)                                            # reaped: its pid names nothing now
    with err(ErrorCode.BAD_REQUEST) as info:
        r.attach(b"late", pid=done.pid)
    assert "does not exist" in info.value.message
    assert [cause for _, cause in r.ended] == [SessionEnd.DEAD_AT_HELLO]
    assert r.reg.session_of(b"late") is None and len(r.reg) == 0 and r.env.store.attachments.sessions == {}


def test_end_forgets_everything_and_close_ends_the_rest(r):
    a, _, token = r.attach(b"a", rank=0)
    b, _, _ = r.attach(b"b", rank=1)
    r.reg.end(a, SessionEnd.LEFT)
    assert r.reg.session_of(b"a") is None and r.reg.proven(a.id, token) is None
    assert a.id not in r.reg.heartbeats and a.id not in r.env.store.attachments.sessions
    r.reg.close()
    assert r.ended == [(a.id, SessionEnd.LEFT), (b.id, SessionEnd.DAEMON_STOPPED)]
    assert len(r.reg) == 0 and r.env.store.attachments.sessions == {} and r.env.store.jobs.engines == {}


def test_role():
    env = Env()
    coord = env.store.attach("e", None, 2, lay("replicated", 2))
    rank = env.store.attach("e", 1, 2, lay("replicated", 2))
    assert (coord.role, rank.role) == ("coordinator", "rank 1")


def test_a_pidfd_that_cannot_be_opened_for_want_of_descriptors_means_heartbeats_not_death(r):
    # Issue 11 item 2: EMFILE from pidfd_open was taken for "pid does not exist".
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    held = []
    try:
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        s, watched, _ = r.attach(b"id-emfile", pid=os.getpid())
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not watched and s.id in r.reg.heartbeats and r.ended == []


def test_a_session_ends_with_its_connection_and_is_not_its_identity_on_another():
    reg = Registry()
    reg.reg.max_sessions_per_peer = 2
    a, b = Conn(1, 10, 100, 0, 0), Conn(2, 11, 100, 0, 0)       # two connections of pid 100
    s = reg.env.store.attach("e", 0, 2, lay("replicated", 2))
    reg.reg.register(b"id-a", s, a)
    assert reg.reg.session_of(b"id-a", a) is s and reg.reg.session_of(b"id-a", b) is None
    assert reg.reg.session_of(b"id-a") is None          # no connection is not its connection either
    t = reg.env.store.attach("e", 1, 2, lay("replicated", 2))
    reg.reg.register(b"id-b", t, b)
    with pytest.raises(Exception) as limit:
        reg.reg.admit(Conn(3, 12, 100, 0, 0))
    assert limit.value.code == ErrorCode.LIMIT and "max_sessions_per_peer" in limit.value.message
    reg.reg.admit(Conn(4, 13, 101, 0, 0))                 # another peer
    reg.reg.disconnected(a)
    assert reg.ended == [(s.id, SessionEnd.DISCONNECTED)] and reg.reg.per_peer[a.peer] == 1
    reg.reg.admit(Conn(3, 12, 100, 0, 0))
    reg.reg.close()
    reg.env.store.verify()


def test_a_watched_session_whose_connection_ends_gets_a_moment_for_its_pidfd_to_tell_a_death(r):
    # A dying process closes its sockets a moment before its pidfd becomes readable: its session
    # ends as DIED (what proves a writer gone), not DISCONNECTED. A living one ends as DISCONNECTED.
    child = subprocess.Popen(["sleep", "60"])
    alive, dying = Conn(1, 10, child.pid, 0, 0), Conn(2, 11, child.pid, 0, 0)
    try:
        s_alive = r.env.store.attach("e", 0, 2, lay("replicated", 2), Process(child.pid, start_ticks(child.pid)))
        r.reg.register(b"alive", s_alive, alive)
        r.reg.disconnected(alive)
        assert r.ended == [] and r.reg.session_of(b"alive", alive) is None     # gone from its identity
        r.reg.sweep(r.env.clock() + 0.5)
        assert r.ended == []
        r.reg.sweep(r.env.clock() + 5)
        assert r.ended == [(s_alive.id, SessionEnd.DISCONNECTED)]
        s_dying = r.env.store.attach("e", 1, 2, lay("replicated", 2), Process(child.pid, start_ticks(child.pid)))
        r.reg.register(b"dying", s_dying, dying)
        child.kill()
        child.wait()
        r.reg.disconnected(dying)
        assert r.ended[-1] == (s_dying.id, SessionEnd.DIED)
    finally:
        child.kill()
        child.wait()


def test_a_process_taking_over_its_orphan_is_not_counted_twice_against_the_caps():
    # Issue 10 item 5 with issue 11's caps: the take-over replaces the orphan's session.
    reg = Registry()
    reg.reg.max_sessions, reg.reg.max_sessions_per_peer = 2, 1
    conn, later = Conn(1, 10, 100, 0, 0), Conn(2, 11, 100, 0, 0)    # two connections of pid 100
    orphan = reg.env.store.attach("e", 0, 2, lay("replicated", 2))
    reg.reg.register(b"old", orphan, conn)
    with pytest.raises(Exception) as limit:
        reg.reg.admit(later)                                     # a second session of that peer
    assert limit.value.code == ErrorCode.LIMIT
    reg.reg.admit(later, replacing=orphan)                       # its own orphan's place
    other = reg.env.store.attach("e", 1, 2, lay("replicated", 2))
    reg.reg.register(b"other", other, Conn(3, 12, 101, 0, 0))
    with pytest.raises(Exception) as limit:
        reg.reg.admit(Conn(4, 13, 102, 0, 0))                   # max_sessions: 2 of 2
    assert "max_sessions" in limit.value.message
    reg.reg.admit(later, replacing=orphan)
    reg.reg.close()
    reg.env.store.verify()

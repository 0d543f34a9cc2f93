"""kvtier.reach: the socket path's identity, its watch, and when an adapter asks kvtierd again.

Real files and real unix sockets in a temporary directory (what a daemon's bind leaves at the
path); the clock of ``Away`` is the test's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from kvtier.reach import Away, SocketWatch, socket_identity
from kvtierd.contract.errors import DaemonUnavailable, LayoutMismatch, ShuttingDown


def bind(path: str) -> socket.socket:
    """What a starting daemon does to the path: remove a dead one's file, bind a socket."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    return sock


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "kvtierd.sock")


def test_a_socket_bound_anew_at_the_same_path_is_another_one(path):
    first = bind(path)
    seen = socket_identity(path)
    assert seen is not None and socket_identity(path) == seen          # looking changes nothing
    second = bind(path)         # a restart: on ext4 the inode number may well be the same one
    assert socket_identity(path) != seen
    first.close(), second.close()
    os.unlink(path)
    assert socket_identity(path) is None


def test_the_watch_says_moved_only_for_a_socket_it_does_not_know(path):
    watch = SocketWatch(path)                 # nothing there yet
    assert watch.known is None and not watch.moved()
    sock = bind(path)
    assert watch.moved()                      # a daemon bound it
    watch.know(watch.look())
    assert not watch.moved()
    os.unlink(path)                           # a stopped daemon removed it: nothing to try
    assert not watch.moved()
    sock.close()
    bind(path).close()
    assert watch.moved()                      # the next daemon's


def test_waiting_returns_as_soon_as_a_daemon_binds(path):
    sock = bind(path)
    watch = SocketWatch(path)
    assert watch.wait(0.05) is False          # unchanged: the whole wait
    timer = threading.Timer(0.2, lambda: bind(path))
    timer.start()
    started = time.monotonic()
    try:
        assert watch.wait(30.0) is True
    finally:
        timer.join()
        sock.close()
    assert time.monotonic() - started < 29    # it did not sit out the timeout


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_away_asks_again_when_the_socket_moves_or_retry_s_passed(path, caplog):
    clock = Clock()
    old = bind(path)
    away = Away(path, 10.0, "rank 0 of engine e", "it serves misses", logging.getLogger("test.reach"), clock)
    assert away.due() and not away.down
    tried = away.look()
    away.back()                               # attached through the socket there
    with caplog.at_level(logging.WARNING, logger="test.reach"):
        away.lost(DaemonUnavailable("kvtierd closed the connection"))
        away.lost(DaemonUnavailable("again"))             # one warning per outage
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "rank 0 of engine e" in caplog.text and "it serves misses" in caplog.text
    assert away.down and not away.due()       # the same (dead) daemon's socket: not yet
    clock.now += 9.9
    assert not away.due()
    clock.now += 0.2
    assert away.due()                         # retry_s passed: the same daemon may answer again
    away.lost(ShuttingDown("stopping"), tried)
    assert not away.due()
    os.unlink(path)
    old.close()
    assert not away.due()                     # stopped: no socket, nothing to try
    bind(path).close()
    assert away.due()                         # a restarted daemon bound it: at once
    away.back()
    assert not away.down and away.due()


def test_an_attempt_that_failed_waits_for_another_socket_than_the_one_it_tried(path, caplog):
    clock = Clock()
    bind(path).close()
    away = Away(path, 10.0, "coordinator", "misses", logging.getLogger("test.reach"), clock)
    tried = away.look()
    with caplog.at_level(logging.WARNING, logger="test.reach"):
        away.lost(LayoutMismatch("rank 0 is taken"), tried)      # a refusal, not an outage: an error line
    assert caplog.records[0].levelno == logging.ERROR
    assert not away.due()
    bind(path).close()                        # another daemon since the attempt
    assert away.due()

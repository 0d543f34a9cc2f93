"""Hostile clients (issue 11): each attack against a real daemon while a well-behaved engine (its own
process, every block's bytes a function of its key) keeps being served correct bytes.

| issue 11 item | attack | test |
|---|---|---|
| 1 | an op nested 1,000 deep; a 4 MB op | test_one_frame_cannot_end_the_daemon_nor_grow_its_reply |
| 2 | idle connections past the open-files limit (prlimit) | test_idle_connections_* |
| 3 | hello claiming pid 1 then vanishing; pid 2^31; a session flood | test_sessions_* |

The attacks themselves are ``tests/attacks.py`` (the hostile soak cycles through the same ones).
"""

from __future__ import annotations

import os

import pytest

from tests import attacks
from tests.keyed import KeyedEngine, keys_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def engine():
    """Factory: engine(daemon, name) → a connected KeyedEngine (closed and stopped after the test)."""
    started: list[KeyedEngine] = []

    def make(daemon, name: str = "good", **kwargs) -> KeyedEngine:
        e = KeyedEngine()
        started.append(e)
        e.call("connect", socket=daemon.socket, engine=name, **kwargs)
        return e

    yield make
    for e in started:
        e.stop()


def served_correctly(engine: KeyedEngine, prefix: str, n: int = 8) -> dict:
    """Two rounds of the same keys: the first stores them, the second must load every one, right."""
    keys = keys_of(prefix, n)
    engine.call("round", keys=keys)
    totals = engine.call("round", keys=keys)
    assert totals.get("wrong", 0) == 0, totals
    assert totals.get("errors", 0) == 0, totals
    return totals


def fds_of(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def assert_alive(daemon) -> dict:
    assert daemon.proc.poll() is None, f"kvtierd exited with {daemon.proc.returncode}:\n{daemon.log()[-3000:]}"
    stats = daemon.stats()
    assert stats["errors"].get("INTERNAL", 0) == 0, stats["errors"]
    return stats


# ------------------------------------------------------------------ item 1
def test_one_frame_cannot_end_the_daemon_nor_grow_its_reply(daemon, engine):
    good = engine(daemon)
    before = served_correctly(good, "item1-before")
    for depth in (999, 1000, 1023):
        attacks.nested_op(daemon.socket, depth)
        assert_alive(daemon)
    out = attacks.huge_op(daemon.socket)
    assert out["reply_bytes"] < 2048
    after = served_correctly(good, "item1-after")
    assert after["verified"] >= before["verified"] + 8
    assert_alive(daemon)

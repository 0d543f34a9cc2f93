"""kvtierd.tier without engines: extents of page chains, tier keys, seals, settings, the disk
tier's record checksums, the guard's breaker and its log.

The guard is driven by a scripted backend (a plain object answering the interface as told): it
checks the guard's own state machine; the backends themselves are tested against real engines
in tests/tier/.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtierd.tier.backend import (Backend, CircuitOpen, TierRejected, TierTimeout, TierUnavailable, check_settings,
                                  error_from, page_extents)
from kvtierd.tier.guard import CLOSED, HALF_OPEN, OPEN, Guard
from kvtierd.tier.keys import Keyspace


def test_extents_merge_contiguous_pages_and_trim_the_last():
    pages = np.array([[4, 5, 6], [9, 3, 4], [7, 7 + 1, 2]])
    assert page_extents(pages, 100, 250, base=1000) == [
        [(1400, 250)], [(1900, 100), (1300, 150)], [(1700, 200), (1200, 50)]]


def test_extents_refuse_a_length_the_pages_do_not_fit():
    with pytest.raises(ValueError):
        page_extents(np.array([[0, 1]]), 100, 201)
    with pytest.raises(ValueError):
        page_extents(np.array([[0, 1]]), 100, 100)     # the second page would be unused


def test_keyspaces_of_two_identities_never_share_a_key():
    a, b = Keyspace(b"model-a|bf16|16|replicated"), Keyspace(b"model-b|bf16|16|replicated")
    assert a.names([b"\x00\x01"]) == [a.prefix + "0001"]
    assert a.prefix != b.prefix and a.prefix.startswith("kvt2/")
    assert Keyspace(b"model-a|bf16|16|replicated").prefix == a.prefix     # stable across processes
    with pytest.raises(ValueError):
        Keyspace(b"")


def test_error_codes_round_trip():
    for cls in (TierUnavailable, CircuitOpen, TierTimeout, TierRejected):
        assert type(error_from(cls.code, "x")) is cls
    assert error_from("something-new", "x").code == "failed"


class Scripted(Backend):
    """Answers ``exists`` with what the test queued: a value, an exception, or an Event to wait on."""

    name = "scripted"

    def __init__(self):
        self.script: list = []

    def exists(self, keys):
        step = self.script.pop(0)
        if isinstance(step, threading.Event):
            step.wait(10)
            return [True]
        if isinstance(step, Exception):
            raise step
        return step

    def attach(self, memory, owner): pass
    def put(self, keys, blocks, seals): return []
    def get(self, keys, blocks, seals): return []
    def remove(self, keys): return 0
    def clear(self, prefix): return 0
    def health(self): pass
    def info(self): return {}
    def close(self): pass


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_breaker_opens_after_failures_then_half_opens_and_closes():
    b, clock = Scripted(), Clock()
    g = Guard(b, timeout=1.0, failures=2, cooldown=5.0, clock=clock)
    b.script = [TierUnavailable("down"), TierUnavailable("down"), [True]]
    for _ in range(2):
        with pytest.raises(TierUnavailable):
            g.call("exists", ["k"])
    assert g.state == OPEN
    with pytest.raises(CircuitOpen):
        g.call("exists", ["k"])            # not passed to the backend: the script still has [True]
    clock.t = 5.0
    assert g.call("exists", ["k"]) == [True]
    assert g.state == CLOSED and g.counters["opened"] == 1 and g.counters["rejected"] == 1
    g.close()


def test_a_failed_probe_reopens_and_rejections_do_not_trip():
    b, clock = Scripted(), Clock()
    g = Guard(b, timeout=1.0, failures=1, cooldown=1.0, clock=clock)
    b.script = [TierRejected("too big"), TierUnavailable("down"), TierUnavailable("still down")]
    with pytest.raises(TierRejected):
        g.call("exists", ["k"])
    assert g.state == CLOSED
    with pytest.raises(TierUnavailable):
        g.call("exists", ["k"])
    clock.t = 1.0
    with pytest.raises(TierUnavailable):   # the half-open probe fails: open again
        g.call("exists", ["k"])
    assert g.state == OPEN and g.open_until == 2.0
    g.close()


def test_a_call_past_its_deadline_is_abandoned_and_blocks_others_until_it_returns():
    b = Scripted()
    release = threading.Event()
    g = Guard(b, timeout=0.05, failures=5, cooldown=0.0)
    b.script = [release, [False]]
    with pytest.raises(TierTimeout):
        g.call("exists", ["k"])
    assert g.stuck_for() > 0
    with pytest.raises(CircuitOpen, match="has not returned"):
        g.call("exists", ["k"])
    release.set()
    for _ in range(100):                   # the abandoned call returns; the guard serves again
        if not g.stuck_for():
            break
        time.sleep(0.01)
    assert g.call("exists", ["k"]) == [False]
    assert g.state in (CLOSED, HALF_OPEN) and g.snapshot()["errors_timeout"] == 1
    g.close()


def test_a_call_abandoned_can_be_waited_for():
    b = Scripted()
    release = threading.Event()
    g = Guard(b, timeout=0.05, failures=5, cooldown=0.0)
    b.script = [release]
    with pytest.raises(TierTimeout):
        g.call("exists", ["k"])
    assert g.wait_abandoned(0.05) is False           # still running
    release.set()
    assert g.wait_abandoned(10) is True and g.stuck_for() == 0
    g.close()


def test_the_guard_logs_the_first_failure_and_each_breaker_change(caplog):
    b, clock = Scripted(), Clock()
    g = Guard(b, timeout=1.0, failures=2, cooldown=1.0, clock=clock, lane="meta")
    b.script = [TierUnavailable("node down")] * 2 + [[True]]
    caplog.set_level("INFO", logger="kvtierd.tier")
    for _ in range(3):
        with pytest.raises(TierUnavailable):
            g.call("exists", ["k"])
        clock.t += 0.4                              # the third call is still refused: not logged again
    clock.t = 10.0
    assert g.call("exists", ["k"]) == [True]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["scripted meta lane: node down",
                     "scripted meta lane: breaker open for 1.0 s after 2 consecutive failures (last: node down)",
                     "scripted meta lane: exists succeeded after 2 failures; breaker closed"], lines
    g.close()


def test_settings_a_backend_does_not_take_are_refused_with_the_ones_it_does():
    check_settings("redis", {"ttl_s": 60, "timeout": 1.0})
    with pytest.raises(ValueError, match="unknown key 'ttl' for the redis backend; its keys are timeout, "
                                         "node_cooldown, ttl_s"):
        check_settings("redis", {"ttl": 60})
    with pytest.raises(ValueError, match="set the disk backend's address with tier_address"):
        check_settings("disk", {"address": "/x"})
    with pytest.raises(ValueError, match="unknown tier backend 'nfs'"):
        check_settings("nfs", {})

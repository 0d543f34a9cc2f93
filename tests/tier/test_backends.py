"""Each backend against its real engine on loopback (the disk: a real directory): bytes, seals,
batches, namespaces, faults, timeouts.

The backend runs in the test process with a region-like mapping attached; blocks are written
with content derived from their key, sealed, stored, scrubbed from the mapping, fetched back into
other (non-contiguous) pages and compared byte for byte. The engine-fault tests (engine killed,
frozen, unreachable) are for the networked engines; the disk's faults are in test_disk.py.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvtierd.tier.backend import (CircuitOpen, TierError, TierTimeout, TierUnavailable, open_backend,
                                  page_extents)
from kvtierd.tier.guard import CLOSED, OPEN, Guard
from kvtierd.tier.keys import Keyspace

from .conftest import OWNER, kill_engine, move, restart_engine, seals, settings_for, start_engine

pytestmark = pytest.mark.timeout(120)

PAGE = 16 << 10
LENGTH = 3 * PAGE - 123          # three pages, the last one partly used


def opened(kind, e, make_region):
    b = open_backend(kind, **settings_for(kind, e, timeout=1.0))
    region = make_region(pages=512, page_size=PAGE)
    b.attach(region.memory, OWNER)
    return b, region


@pytest.fixture
def backend(store, make_region):
    """Every backend, its engine (or directory) and a region attached."""
    kind, e = store
    b, region = opened(kind, e, make_region)
    yield kind, e, b, region
    b.close()


@pytest.fixture
def networked(engine, make_region):
    """The networked backends only (their engine can be killed and frozen)."""
    kind, e = engine
    b, region = opened(kind, e, make_region)
    yield kind, e, b, region
    b.close()


def layout(n: int, first: int, shuffle: bool, seed: int = 0) -> np.ndarray:
    """n blocks of 3 pages from page ``first`` on; shuffled pages are not contiguous."""
    pages = np.arange(first, first + 3 * n)
    if shuffle:
        pages = np.random.default_rng(seed).permutation(pages)
    return pages.reshape(n, 3)


def test_put_get_byte_exact_across_page_layouts(backend):
    _, _, b, region = backend
    ks = Keyspace(b"model-a")
    keys = [b"block-%d" % i for i in range(32)]
    src = layout(32, 0, shuffle=False)
    for k, p in zip(keys, src):
        region.write(k, p.tolist(), LENGTH)
    assert move(b, "put", ks, keys, region, src, LENGTH) == [True] * 32
    region.scrub()
    dst = layout(32, 100, shuffle=True)          # scattered pages: extents of one page each
    assert move(b, "get", ks, keys, region, dst, LENGTH) == [True] * 32
    assert all(region.holds(k, p.tolist(), LENGTH) for k, p in zip(keys, dst))


def test_batched_exists_and_remove(backend):
    _, _, b, region = backend
    ks = Keyspace(b"model-a")
    stored = [b"s%d" % i for i in range(20)]
    src = layout(20, 0, shuffle=False)
    for k, p in zip(stored, src):
        region.write(k, p.tolist(), LENGTH)
    assert all(move(b, "put", ks, stored, region, src, LENGTH))
    asked = [b"s3", b"missing", b"s19", b"s0", b"other"]
    assert b.exists(ks.names(asked)) == [True, False, True, True, False]
    assert b.remove(ks.names([b"s3", b"missing"])) == 1
    assert b.exists(ks.names([b"s3", b"s4"])) == [False, True]
    assert move(b, "get", ks, [b"s3"], region, layout(1, 200, False), LENGTH) == [False]


def test_namespaces_never_meet(backend):
    _, _, b, region = backend
    a, other = Keyspace(b"model-a|bf16|16|49152|replicated"), Keyspace(b"model-b|bf16|16|49152|replicated")
    key = [b"same-key"]
    region.write(b"a" + key[0], [0, 1, 2], LENGTH)
    assert move(b, "put", a, key, region, [[0, 1, 2]], LENGTH) == [True]
    assert b.exists(other.names(key)) == [False]
    assert move(b, "get", other, key, region, [[10, 11, 12]], LENGTH) == [False]
    # The other model stores its own block under the same key; each reads back its own.
    region.write(b"b" + key[0], [20, 21, 22], LENGTH)
    assert move(b, "put", other, key, region, [[20, 21, 22]], LENGTH) == [True]
    region.scrub()
    assert move(b, "get", a, key, region, [[30, 31, 32]], LENGTH) == [True]
    assert move(b, "get", other, key, region, [[40, 41, 42]], LENGTH) == [True]
    assert region.holds(b"a" + key[0], [30, 31, 32], LENGTH)
    assert region.holds(b"b" + key[0], [40, 41, 42], LENGTH)
    # Clearing one namespace leaves the other's block.
    assert b.clear(a.prefix) == 1
    assert b.exists(a.names(key) + other.names(key)) == [False, True]


def test_wrong_length_is_a_miss(backend):
    _, _, b, region = backend
    ks = Keyspace(b"model-a")
    region.write(b"k", [0, 1, 2], LENGTH)
    assert move(b, "put", ks, [b"k"], region, [[0, 1, 2]], LENGTH) == [True]
    # A reader of another geometry (two pages) never gets a truncated or overlong block.
    assert move(b, "get", ks, [b"k"], region, [[5, 6]], 2 * PAGE) == [False]


def test_big_batches(backend):
    kind, _, b, region = backend
    ks = Keyspace(b"model-big")
    n = 4096
    keys = [b"big-%d" % i for i in range(n)]
    # One-page blocks, 4 KiB each, written into the first 256 pages over and over: the bytes are
    # checked on a sample, the batch sizes are the point.
    length = 4096
    pages = (np.arange(n) % 256).reshape(n, 1)
    for k, p in zip(keys, pages):
        region.write(k, p.tolist(), length)
    assert all(move(b, "put", ks, keys, region, pages, length))
    present = b.exists(ks.names(keys) + ks.names([b"absent-%d" % i for i in range(n)]))
    assert present == [True] * n + [False] * n
    got = move(b, "get", ks, keys, region, (np.arange(n) % 256 + 256).reshape(n, 1), length)
    assert all(got)
    # The pages were written over: each holds the content of the last of its keys, and so do the
    # blocks got back for those keys.
    assert all(region.holds(k, [256 + i % 256], length) for i, k in enumerate(keys[-256:], n - 256))
    assert b.remove(ks.names(keys)) == n


@pytest.fixture
def guard_for(networked):
    """Factory of guards around the test's backend. At teardown every guard's worker must have
    returned from its engine call before the backend is closed and the region unmapped: an
    abandoned call still runs in the engine's client, and closing or unmapping under it crashes
    the process (seen with Mooncake: the reason the daemon runs its tier in a companion process)."""
    made: list[Guard] = []

    def make(timeout=1.0, failures=2, cooldown=1.0) -> Guard:
        made.append(Guard(networked[2], timeout=timeout, failures=failures, cooldown=cooldown))
        return made[-1]

    yield make
    for g in made:
        g.close(timeout=60)
        assert not g._thread.is_alive(), "an engine call did not return within 60 s"


FAULTS = Keyspace(b"model-faults")


def stored_block(b, region, name: bytes) -> list[str]:
    region.write(name, [0, 1, 2], LENGTH)
    assert move(b, "put", FAULTS, [name], region, [[0, 1, 2]], LENGTH) == [True]
    return FAULTS.names([name])


def guarded(guard, op: str, name: bytes, region, pages) -> list[bool]:
    """A sealed put or get of one block through the guard."""
    ext = page_extents(np.array([pages]), PAGE, LENGTH)
    return guard.call(op, FAULTS.names([name]), ext, seals(FAULTS, [name], region.memory, ext))


def test_engine_killed_fails_fast_opens_breaker_and_recovers(networked, guard_for):
    kind, e, b, region = networked
    names = stored_block(b, region, b"before")
    guard = guard_for()
    assert guard.call("exists", names) == [True]
    kill_engine(kind, e)
    ext = page_extents(np.array([[10, 11, 12]]), PAGE, LENGTH)
    sealed = seals(FAULTS, [b"before"], region.memory, ext)
    started = time.monotonic()
    for op, args in (("exists", (names,)), ("get", (names, ext, sealed)), ("put", (names, ext, sealed))):
        with pytest.raises(TierError) as err:
            guard.call(op, *args)
        assert isinstance(err.value, (TierUnavailable, TierTimeout)), err.value
        if guard.state == OPEN:
            break
    assert guard.state == OPEN
    with pytest.raises(CircuitOpen):        # refused without touching the engine
        guard.call("exists", names)
    # Every call returned within its deadline (1 s each) plus the breaker's refusals.
    assert time.monotonic() - started < 3 * guard.timeout + 1.0
    assert guard.snapshot()["rejected"] >= 1
    restart_engine(kind, e)
    # The engine is back (empty: neither engine persists here); after the cooldown a probe closes
    # the breaker and blocks flow again. A guard still waiting on an abandoned call refuses until it
    # returns, so wait for that too.
    deadline = time.monotonic() + 60
    while True:
        try:
            region.write(b"after", [20, 21, 22], LENGTH)
            if guarded(guard, "put", b"after", region, [20, 21, 22]) == [True]:
                break
        except TierError:
            pass
        assert time.monotonic() < deadline, "the tier did not recover after the engine came back"
        time.sleep(0.5)
    assert guard.state == CLOSED
    region.scrub()
    assert guarded(guard, "get", b"after", region, [30, 31, 32]) == [True]
    assert region.holds(b"after", [30, 31, 32], LENGTH)


def frozen_pids(kind: str, e) -> list[int]:
    return [e.master.pid] if kind == "mooncake" else [p.pid for p in e.procs]


def test_frozen_engine_times_out_without_stalling_the_caller(networked, guard_for):
    """SIGSTOP freezes the real engine (connections stay open, nothing answers): each call ends at
    its deadline with TierTimeout, the breaker opens, and SIGCONT brings it back."""
    kind, e, b, region = networked
    names = stored_block(b, region, b"frozen")
    guard = guard_for(timeout=0.5, failures=1, cooldown=0.5)
    pids = frozen_pids(kind, e)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises((TierTimeout, TierUnavailable)):
            guard.call("exists", names)
        assert time.monotonic() - started < 0.5 + 0.5
        assert guard.state == OPEN
        with pytest.raises(TierUnavailable):    # open, or still waiting on the abandoned call
            guard.call("exists", names)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if guard.call("exists", names) == [True]:
                break
        except TierError:
            pass
        assert time.monotonic() < deadline, "the tier did not recover after SIGCONT"
        time.sleep(0.3)
    assert guard.state == CLOSED


def test_unreachable_engine_is_a_typed_error_at_open(engine):
    kind, e = engine
    settings = settings_for(kind, e, timeout=0.5)
    e.stop()
    started = time.monotonic()
    with pytest.raises(TierUnavailable):
        open_backend(kind, **settings)
    assert time.monotonic() - started < 5


def test_redis_one_node_down_fails_only_its_keys(make_region):
    e = start_engine("redis")
    try:
        b = open_backend("redis", e.address, timeout=1.0)
        region = make_region(pages=64, page_size=PAGE)
        b.attach(region.memory, OWNER)
        ks = Keyspace(b"model-partial")
        keys = [b"p%d" % i for i in range(60)]
        pages = np.zeros((60, 1), dtype=np.int64)
        assert all(move(b, "put", ks, keys, region, pages, 1000))
        e.kill_node(0)
        present = b.exists(ks.names(keys))
        assert 0 < sum(present) < len(keys)       # the live nodes still answer for their slots
        assert b.info()["down"] == [f"127.0.0.1:{e.ports[0]}"]
        b.close()
    finally:
        e.stop()

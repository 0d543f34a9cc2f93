"""The tier companion process and the daemon's link to it, against real engines on loopback.

Two "nodes": two region files, each with its own companion (a real ``kvtierd.tier.service``
process started by a ``TierLink``, as the daemon will), sharing one real engine. Node A demotes
blocks written with content derived from their keys; node B finds and promotes them into other
pages of its own region, byte-exact. Then faults: the engine killed (typed errors, no hang,
recovery), the companion killed or frozen (the link's fence: every request ends with one final
outcome, a frozen companion is killed after ``kill_after``, then restarted).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvtierd.tier.link import LinkBusy, LinkDown, Outcome, TierLink

from .conftest import kill_engine, restart_engine, settings_for, write_key_file

pytestmark = pytest.mark.timeout(180)

PAGE = 16 << 10
LENGTH = 2 * PAGE + 1000
NS_A = b"model-a|bf16|16|33768|replicated"
NS_B = b"model-b|bf16|16|33768|replicated"


def pages_bytes(pages) -> bytes:
    return np.asarray(pages, dtype="<u4").tobytes()


class Node:
    """A region and the link to its companion."""

    def __init__(self, region, kind: str, settings: dict, **link_kwargs):
        self.region = region
        self.link = TierLink(f"ipc://{region.dir}/tier.sock", region.path, region.offset, region.data_bytes,
                             region.page_size, kind, settings, log_path=os.path.join(region.dir, "tier.log"),
                             key_file=write_key_file(region.dir), **link_kwargs)
        self.link.start()
        self.wait_state("ready", 60)

    def wait_state(self, state: str, timeout: float) -> list[Outcome]:
        seen = []
        deadline = time.monotonic() + timeout
        while self.link.state != state:
            seen += self.link.collect()
            assert time.monotonic() < deadline, f"link is {self.link.state}, not {state}: {self.link.status()}"
            time.sleep(0.02)
        return seen

    def outcomes(self, rid_contexts: set, timeout: float = 30, final: bool = True) -> dict:
        """Wait for the (final) outcomes of the requests whose context is in ``rid_contexts``."""
        got: dict = {}
        deadline = time.monotonic() + timeout
        while set(got) != rid_contexts:
            for o in self.link.collect():
                if o.context in rid_contexts and (o.final or not final):
                    got[o.context] = o
            assert time.monotonic() < deadline, f"no outcome for {rid_contexts - set(got)}: {self.link.status()}"
            time.sleep(0.005)
        return got

    def call(self, op: str, timeout: float = 30, **fields) -> Outcome:
        ctx = object()
        self.link.submit(op, ctx, **fields)
        return self.outcomes({ctx}, timeout)[ctx]

    def close(self) -> None:
        self.link.stop()


@pytest.fixture
def nodes(engine, make_region):
    kind, e = engine
    made: list[Node] = []

    def make(settings: dict | None = None, **link_kwargs) -> Node:
        made.append(Node(make_region(pages=128, page_size=PAGE), kind,
                         settings_for(kind, e, **(settings or {"timeout": 1.0})), **link_kwargs))
        return made[-1]

    yield kind, e, make
    for n in made:
        n.close()


def demote(node: Node, ns: bytes, keys: list[bytes], first_page: int) -> list[list[int]]:
    chains = [[first_page + 2 * i + 1, first_page + 2 * i] + [first_page + 60 + i] for i in range(len(keys))]
    for k, pages in zip(keys, chains):
        node.region.write(k, pages, LENGTH)
    out = node.call("put", ns=ns, keys=keys, pages=pages_bytes(chains), length=LENGTH)
    assert out.ok and out.result["done"] == b"\x01" * len(keys), out
    return chains


def test_a_block_demoted_on_one_node_is_promoted_byte_exact_on_another(nodes):
    kind, _, make = nodes
    a, b = make(), make()
    keys = [b"prefix-%03d" % i for i in range(24)]
    demote(a, NS_A, keys, 0)
    asked = keys[:3] + [b"never-stored"] + keys[3:]
    out = b.call("exists", ns=NS_A, keys=asked)
    assert out.ok and list(out.result["present"]) == [1, 1, 1, 0] + [1] * 21
    # Another model's namespace never sees them.
    assert list(b.call("exists", ns=NS_B, keys=keys).result["present"]) == [0] * 24
    chains = [[120 - i, 30 + i, 60 + i] for i in range(24)]      # scattered, none shared
    got = b.call("get", ns=NS_A, keys=keys, pages=pages_bytes(chains), length=LENGTH)
    assert got.ok and got.result["done"] == b"\x01" * 24
    assert all(b.region.holds(k, c, LENGTH) for k, c in zip(keys, chains))
    stats = b.call("stats")
    assert stats.ok and stats.result["counters"]["get_blocks"] == 24
    assert stats.result["info"]["zero_copy"] is True
    # A namespace clear reaches the tier and says how many blocks it removed.
    assert a.call("clear", ns=NS_A).result["removed"] == 24
    assert list(b.call("exists", ns=NS_A, keys=keys[:2]).result["present"]) == [0, 0]


def test_the_engine_killed_mid_run_gives_typed_errors_and_recovers(nodes):
    kind, e, make = nodes
    a = make(failures=1, cooldown=1.0)
    keys = [b"k%d" % i for i in range(8)]
    demote(a, NS_A, keys[:4], 0)
    kill_engine(kind, e)
    started = time.monotonic()
    for op, fields in (("exists", {"keys": keys}),
                       ("put", {"keys": keys[4:], "pages": pages_bytes([[40, 41, 42]] * 4), "length": LENGTH}),
                       ("exists", {"keys": keys})):
        out = a.call(op, ns=NS_A, **fields)
        assert not out.ok and out.error.code in ("unavailable", "timeout", "circuit_open"), out
    # Every answer came within the companion's deadlines (1 s meta, 10 s data), most at once.
    assert time.monotonic() - started < 15
    guards = a.call("stats").result["guards"]
    assert guards["meta"]["state"] == "open" or guards["meta"].get("rejected", 0) >= 1
    restart_engine(kind, e)
    deadline = time.monotonic() + 60
    # Each lane's breaker half-opens after its cooldown and closes on its own: the data lane's put
    # may recover before the meta lane's exists does (its first call after the restart may still
    # fail or pass its 1 s deadline on a loaded machine), so both are asked until both answer.
    while True:
        put = a.call("put", ns=NS_A, keys=keys[4:], pages=pages_bytes([[40, 41, 42], [43, 44, 45], [46, 47, 48],
                                                                         [49, 50, 51]]), length=LENGTH)
        seen = a.call("exists", ns=NS_A, keys=keys[4:]) if put.ok and put.result["done"] == b"\x01" * 4 else None
        if seen is not None and seen.ok:
            break
        assert time.monotonic() < deadline, f"no recovery: {put} {seen}"
        time.sleep(0.5)
    assert list(seen.result["present"]) == [1] * 4


def test_a_killed_companion_ends_its_requests_and_is_restarted(nodes):
    _, _, make = nodes
    a = make(restart_backoff=0.2)
    pid = a.link.pid
    os.kill(pid, signal.SIGKILL)
    ctx = object()
    try:
        a.link.submit("exists", ctx, ns=NS_A, keys=[b"x"])
        out = a.outcomes({ctx})[ctx]       # final: an error (it died) or, if it raced, an answer
        assert out.final
    except (LinkDown, LinkBusy):
        pass                               # the link already knew, or the dead peer's socket took nothing
    a.wait_state("ready", 60)
    assert a.link.pid != pid and a.link.counters["died"] == 1
    assert a.call("exists", ns=NS_A, keys=[b"x"]).ok


def test_a_frozen_companion_is_fenced_then_killed_and_restarted(nodes):
    """A put outlives its deadline: the caller hears TierTimeout at once (not final: the pages stay
    fenced); after kill_after the link kills the companion, and only then is the outcome final."""
    _, _, make = nodes
    a = make(data_timeout=0.5, kill_after=1.0, restart_backoff=0.2)
    a.region.write(b"frozen", [0, 1, 2], LENGTH)
    os.kill(a.link.pid, signal.SIGSTOP)
    ctx = object()
    a.link.submit("put", ctx, ns=NS_A, keys=[b"frozen"], pages=pages_bytes([[0, 1, 2]]), length=LENGTH)
    early = a.outcomes({ctx}, final=False)[ctx]
    assert not early.final and early.error.code == "timeout"
    final = a.outcomes({ctx}, timeout=30)[ctx]
    assert final.final and not final.ok and a.link.counters["killed"] == 1
    a.wait_state("ready", 60)
    assert a.call("exists", ns=NS_A, keys=[b"frozen"]).ok


def test_a_transfer_past_its_deadline_is_answered_only_once_it_returned(nodes):
    """The companion's guard gives up on a get at --data-timeout, but the engine's client still
    writes the request's pages until its call returns: the reply (the daemon's proof that the
    pages are free again) waits for that. Frozen engine: the daemon hears a non-final timeout at
    its own deadline, no final outcome while the engine stays frozen, and the final one after."""
    kind, e, make = nodes
    region_timeout = {"timeout": 30.0}             # the engine's own socket waits outlast the freeze
    a = make(data_timeout=0.5, kill_after=60, settings=region_timeout)
    demote(a, NS_A, [b"late"], 0)
    pids = [e.master.pid] if kind == "mooncake" else [p.pid for p in e.procs]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        ctx = object()
        a.link.submit("get", ctx, ns=NS_A, keys=[b"late"], pages=pages_bytes([[90, 91, 92]]), length=LENGTH)
        early = a.outcomes({ctx}, final=False)[ctx]
        assert not early.final and early.error.code == "timeout"
        time.sleep(2.0)
        assert not [o for o in a.link.collect() if o.context is ctx], "answered while the get still ran"
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    final = a.outcomes({ctx}, timeout=60)[ctx]
    assert final.final
    assert a.call("exists", ns=NS_A, keys=[b"late"]).ok


def test_requests_beyond_max_inflight_are_refused_not_queued(nodes):
    _, _, make = nodes
    a = make(max_inflight=2)
    contexts = {object(), object()}
    for c in contexts:
        a.link.submit("exists", c, ns=NS_A, keys=[b"x"])
    with pytest.raises(LinkBusy):
        a.link.submit("exists", object(), ns=NS_A, keys=[b"x"])
    assert a.link.counters["busy"] == 1
    a.outcomes(contexts)
    assert a.call("exists", ns=NS_A, keys=[b"x"]).ok


def test_a_companion_that_cannot_reach_its_engine_says_so(make_region):
    region = make_region(pages=16, page_size=PAGE)
    link = TierLink(f"ipc://{region.dir}/tier.sock", region.path, region.offset, region.data_bytes, PAGE, "redis",
                    {"address": "127.0.0.1:1", "timeout": 0.5}, restart_backoff=60, key_file=write_key_file(region.dir),
                    log_path=os.path.join(region.dir, "tier.log"))
    try:
        link.start()
        deadline = time.monotonic() + 30
        while link.state not in ("failed", "down"):
            link.collect()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert link.last_error.code == "unavailable" and "CLUSTER SLOTS" in str(link.last_error)
        with pytest.raises(LinkDown):
            link.submit("exists", None, ns=NS_A, keys=[b"x"])
        # The companion's own log says so too (it was silent: issue 27).
        with open(os.path.join(region.dir, "tier.log")) as f:
            assert "cannot open the redis backend" in f.read()
    finally:
        link.stop()

"""kvtier.integrations.offload: the scheduler side's bookkeeping (requests' lookups and leases, the
kvtier jobs of transfers), engine-free and without sockets.

``Lookups`` and ``Jobs`` talk to kvtierd only through the link thread: they hand it a function and
get a Future. Here the link is ``AnsweringLink``: it keeps what they hand it, and the test answers
each batched lookup as kvtierd would, from the set of keys it holds ready (``answer``). The link
thread's own functions and the daemon are covered by tests/integration/test_offload.py and the
vLLM suite.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future

import pytest

from kvtier.integrations.offload import jobs as jobs_module
from kvtier.integrations.offload import lookups as lookups_module
from kvtier.integrations.offload.jobs import Jobs, JobPart
from kvtier.integrations.offload.keys import group_of, grouped, kvtier_key
from kvtier.integrations.offload.lookups import GIVE_UP_S, LEASE_RENEW, Answers, Lookups
from kvtier.integrations.offload.stats import ManagerStats
from kvtierd.contract import protocol as P
from kvtierd.contract.errors import DaemonUnavailable

HIT, MISS, RETRY, PENDING = "hit", "miss", "retry", "pending"
ANSWERS = Answers(HIT, MISS, RETRY, PENDING)     # an engine's own answer values


def keys(prefix: str, n: int, group: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}{i}".encode()).digest() + group.to_bytes(4, "little") for i in range(n)]


class AnsweringLink:
    """The link as Lookups and Jobs see it, without a thread or a daemon (module docstring)."""

    def __init__(self):
        self.up = True
        self.replies = 0
        self.epoch = 1
        self.requests = 0
        self.submitted: list[tuple] = []       # (fn, future)
        self.sent: list = []                   # fire-and-forget functions

    def submit(self, fn) -> Future:
        future: Future = Future()
        self.submitted.append((fn, future))
        return future

    def send(self, fn) -> None:
        self.sent.append(fn)

    def answer(self, ready: set, ttl: float | None = 5.0, pending: int = 0) -> None:
        """Answer the oldest batch as kvtierd holding ``ready`` would (leasing every hit for ``ttl``
        seconds when the batch asks for leases); ``pending``: keys after each prefix being promoted."""
        fn, future = self.submitted.pop(0)
        groups, leases = fn.args
        prefixes, held = [], []
        for index, group in enumerate(groups):
            hits = next((i for i, k in enumerate(group) if k not in ready), len(group))
            prefixes.append((hits, min(pending, len(group) - hits)))
            held.append([(leases[index][0], 0, hits)] if leases is not None and hits else [])
        self.replies += 1
        future.set_result((prefixes, held, ttl if leases is not None else None, self.epoch))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env():
    link, clock, stats = AnsweringLink(), Clock(), ManagerStats()
    positions: dict = {}

    def make(wait_s: float = 0.0, lease_ttl: float | None = 5.0, num_groups: int = 1) -> Lookups:
        return Lookups(link, stats, num_groups, wait_s, lease_ttl, lambda request: positions.get(request),
                       ANSWERS, clock)

    class Env:
        pass

    e = Env()
    e.link, e.clock, e.stats, e.positions, e.make = link, clock, stats, positions, make
    return e


def ask(lookups: Lookups, request, ks: list[bytes], engine_request=None) -> list:
    """The engine's prefix scan of one step: key after key until a MISS (or RETRY's MISS)."""
    out = []
    for key in ks:
        out.append(lookups.lookup(key, request, engine_request))
        if out[-1] == MISS:
            break
    return out


def new_request(env, lookups: Lookups, name: str, ks: list[bytes]):
    env.positions[name] = {k: (i + 1) * 16 for i, k in enumerate(ks)}
    return lookups.track(name)


def test_one_batch_answers_every_key_of_the_request_in_the_engines_own_values(env):
    lookups = env.make()
    ks = keys("a", 5)
    request = new_request(env, lookups, "r", ks)
    assert lookups.lookup(ks[0], request, "r") == RETRY      # the answer is not there yet
    assert len(env.link.submitted) == 1 and env.stats.batches == 1
    (fn, _), = env.link.submitted
    assert fn.args[0] == [ks]                                 # every key from the first one on, one group
    env.link.answer(set(ks[:3]))
    lookups.schedule_end()
    assert ask(lookups, request, ks, "r") == [HIT, HIT, HIT, MISS]
    assert env.stats.batches == 1                             # no more kvtierd requests for this request
    assert request.lease_of == dict.fromkeys(ks[:3], 1)       # the hits are leased under lease 1


def test_keys_kvtierd_promotes_are_pending_for_this_step_then_asked_again(env):
    lookups = env.make()
    ks = keys("p", 4)
    request = new_request(env, lookups, "r", ks)
    lookups.lookup(ks[0], request, "r")
    env.link.answer(set(ks[:1]), pending=2)
    lookups.schedule_end()
    assert [lookups.lookup(k, request, "r") for k in ks] == [HIT, PENDING, PENDING, MISS]
    lookups.schedule_end()
    assert lookups.lookup(ks[0], request, "r") == RETRY       # next step: kvtierd is asked again
    assert env.stats.batches == 2


def test_a_late_answer_defers_the_request_and_a_silent_kvtierd_costs_one_wait(env):
    lookups = env.make(wait_s=0.0)
    a, b = keys("late-a", 2), keys("late-b", 2)
    ra, rb = new_request(env, lookups, "a", a), new_request(env, lookups, "b", b)
    assert ask(lookups, ra, a, "a") == [RETRY, MISS]          # RETRY once per group, then MISS: deferred
    assert env.stats.late == 1 and lookups.stalled()
    assert ask(lookups, rb, b, "b") == [RETRY, MISS]          # stalled: asked, not waited for
    assert env.stats.late == 1
    env.clock.now += GIVE_UP_S
    assert lookups.given_up() and ask(lookups, rb, b, "b") == [MISS]   # silent too long: misses
    env.link.answer(set(a))
    assert not lookups.stalled()                              # an answer came: waiting is allowed again
    lookups.schedule_end()
    assert ask(lookups, ra, a, "a") == [HIT, HIT]


def test_while_the_link_is_down_every_lookup_is_a_miss_without_asking(env):
    lookups = env.make()
    ks = keys("down", 2)
    request = new_request(env, lookups, "r", ks)
    env.link.up = False
    assert ask(lookups, request, ks, "r") == [MISS]
    assert env.link.submitted == [] and env.stats.down == 1


def test_a_waiting_request_renews_its_leases_in_the_background(env):
    lookups = env.make()
    ks = keys("renew", 3)
    request = new_request(env, lookups, "r", ks)
    lookups.lookup(ks[0], request, "r")
    env.link.answer(set(ks), ttl=4.0)
    lookups.schedule_end()
    assert ask(lookups, request, ks, "r") == [HIT] * 3
    env.clock.now += 4.0 * LEASE_RENEW
    lookups.schedule_end()
    assert ask(lookups, request, ks, "r") == [HIT] * 3        # answered from the verdict meanwhile...
    assert env.stats.renewals == 1 and len(env.link.submitted) == 1
    (fn, _), = env.link.submitted
    assert fn.args == ([ks], [[1]])                           # ...the same lease id again: renewed


def test_an_answer_from_an_earlier_session_is_asked_again(env):
    lookups = env.make()
    ks = keys("epoch", 2)
    request = new_request(env, lookups, "r", ks)
    lookups.lookup(ks[0], request, "r")
    env.link.answer(set(ks))
    lookups.schedule_end()
    assert ask(lookups, request, ks, "r") == [HIT, HIT]
    env.link.epoch += 1                                       # kvtierd restarted: its leases went with it
    lookups.schedule_end()
    assert lookups.lookup(ks[0], request, "r") == RETRY and env.stats.batches == 2


def test_a_lost_link_answer_is_asked_again_and_a_refusal_is_a_miss(env):
    lookups = env.make()
    ks = keys("lost", 2)
    request = new_request(env, lookups, "r", ks)
    lookups.lookup(ks[0], request, "r")
    env.link.submitted.pop(0)[1].set_exception(DaemonUnavailable("gone"))
    lookups.schedule_end()
    assert lookups.lookup(ks[0], request, "r") == RETRY and env.stats.batches == 2
    env.link.submitted.pop(0)[1].set_exception(ValueError("refused"))
    lookups.schedule_end()
    assert ask(lookups, request, ks, "r") == [MISS]


def test_several_kv_cache_groups_are_asked_as_prefixes_of_their_own(env):
    lookups = env.make(num_groups=2)
    g0, g1 = keys("g", 3, group=0), keys("g", 3, group=1)
    interleaved = [k for pair in zip(g0, g1) for k in pair]
    request = new_request(env, lookups, "r", interleaved)
    lookups.lookup(g0[0], request, "r")
    (fn, _), = env.link.submitted
    assert fn.args[0] == [g0, g1] and fn.args[1] == [[1], [2]]
    env.link.answer(set(g0) | set(g1[:1]))
    lookups.schedule_end()
    assert [lookups.lookup(k, request, "r") for k in g0] == [HIT] * 3
    assert [lookups.lookup(k, request, "r") for k in g1] == [HIT, MISS, MISS]


def test_without_key_positions_retried_keys_are_batched_at_the_end_of_the_step(env):
    lookups = env.make()
    ks = keys("public", 3)
    request = lookups.track("r")                              # the engine shows no key positions
    assert [lookups.lookup(k, request, "r") for k in ks] == [RETRY] * 3
    assert env.link.submitted == []
    lookups.schedule_end()
    (fn, _), = env.link.submitted
    assert fn.args[0] == [ks]
    env.link.answer(set(ks))
    lookups.schedule_end()
    assert [lookups.lookup(k, request, "r") for k in ks] == [HIT] * 3


def answered(env, lookups: Lookups, request, ks: list[bytes], ready: set) -> list:
    """Ask, let kvtierd answer (holding ``ready``), and scan again next step."""
    lookups.lookup(ks[0], request, request.req_id)
    env.link.answer(ready)
    lookups.schedule_end()
    return ask(lookups, request, ks, request.req_id)


def test_the_load_consumes_its_leases_and_a_later_lookup_leases_anew(env):
    lookups = env.make()
    ks = keys("load", 4)
    request = new_request(env, lookups, "r", ks)
    assert answered(env, lookups, request, ks, set(ks)) == [HIT] * 4
    assert request.held == {1}
    lookups.loading(request, {1})                              # the load's job names lease 1
    assert env.link.sent == [] and request.verdict is None and request.lease_ids == {}
    assert answered(env, lookups, request, ks, set(ks)) == [HIT] * 4   # recompute, preemption: asked again...
    assert request.held == {2}                                 # ...under a new lease id
    lookups.finished("r")
    (unlease,) = env.link.sent
    assert unlease.args == ([2],)                              # released in the background


def test_a_failed_load_makes_the_request_miss_from_then_on(env):
    lookups = env.make()
    ks = keys("failed", 2)
    request = new_request(env, lookups, "r", ks)
    assert answered(env, lookups, request, ks, set(ks)) == [HIT, HIT]
    lookups.loads_failed(["r", "unknown"])
    assert ask(lookups, request, ks, "r") == [MISS]
    assert env.stats.load_failures == 1
    (unlease,) = env.link.sent
    assert unlease.args == ([1],)                              # its lease released


# ------------------------------------------------------------------------------ jobs and keys
def test_transfers_become_jobs_of_at_most_part_keys_and_of_one_lease_each(monkeypatch):
    monkeypatch.setattr(jobs_module, "PART_KEYS", 3)
    link, stats = AnsweringLink(), ManagerStats()
    jobs = Jobs(link, stats)
    ks = keys("parts", 8)
    stored, parts = jobs.prepare_store(ks + ks[:2], may_ask=True)
    assert stored == ks and [len(p.keys) for p in parts] == [3, 3, 2] and [p.job for p in parts] == [1, 2, 3]
    assert all(jobs.writing[k] == 1 + i // 3 for i, k in enumerate(ks))
    assert len(link.sent) == 1                                 # opened in the background
    lease_of = {**dict.fromkeys(ks[:4], 7), **dict.fromkeys(ks[4:6], 8)}
    loads = jobs.prepare_load(ks, lease_of)
    assert [(len(p.keys), p.lease) for p in loads] == [(3, 7), (1, 7), (2, 8), (2, None)]
    assert stats.leased_loads == 3 and isinstance(loads[0], JobPart)


def test_stores_are_not_offered_while_kvtierd_may_not_be_asked_and_failed_ones_are_aborted():
    link, stats = AnsweringLink(), ManagerStats()
    jobs = Jobs(link, stats)
    ks = keys("s", 2)
    assert jobs.prepare_store(ks, may_ask=False) == ([], []) and stats.stores_skipped == 1
    assert jobs.prepare_store([], may_ask=True) == ([], [])
    _, parts = jobs.prepare_store(ks, may_ask=True)
    jobs.complete_store(ks, success=False)
    assert jobs.writing == {}
    assert link.sent[-1].args == ([parts[0].job],)             # the failed store's job is aborted


def test_vllm_keys_too_long_for_kvtierd_are_shortened_per_group():
    long = b"h" * (P.MAX_KEY_BYTES + 8) + (3).to_bytes(4, "little")
    short = kvtier_key(long)
    assert len(short) == 36 and group_of(short) == group_of(long)
    assert kvtier_key(keys("k", 1)[0]) == keys("k", 1)[0]
    assert grouped([b"a" * 32 + b"\0\0\0\0", b"b" * 32 + b"\1\0\0\0", b"c" * 32 + b"\0\0\0\0"]) == [
        [b"a" * 32 + b"\0\0\0\0", b"c" * 32 + b"\0\0\0\0"], [b"b" * 32 + b"\1\0\0\0"]]


def test_lookups_split_long_requests_into_leases_of_part_keys(env, monkeypatch):
    monkeypatch.setattr(lookups_module, "PART_KEYS", 2)
    lookups = env.make()
    ks = keys("long", 5)
    request = new_request(env, lookups, "r", ks)
    lookups.lookup(ks[0], request, "r")
    (fn, _), = env.link.submitted
    assert fn.args[1] == [[1, 2, 3]]                           # one lease per chunk of PART_KEYS keys


# ---------------------------------------------------------------------------- KV events: the feed
def test_the_event_feed_polls_once_at_a_time_paced_and_stops_while_the_engine_does_not_drain():
    from kvtier.integrations.offload.events import EventFeed
    from kvtierd.contract.events import Kind
    from kvtierd.contract.replies import EventsReply

    now = [100.0]
    feed = EventFeed(key_bytes=36, num_groups=1, max_pending_keys=3, interval_s=0.01, clock=lambda: now[0])
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(4)]
    replies = iter([EventsReply(7, 1, True, [[1, int(Kind.STORED), None, 36, b"".join(keys[:2])]], [], None, 0),
                    EventsReply(7, 2, False, [[2, int(Kind.REMOVED), "evicted", 36, keys[0]]], [], None, 0)])
    asked = []

    def read(**request):
        asked.append(request)
        return next(replies)

    assert feed.claim() and not feed.claim()            # one poll in flight at a time
    feed.poll(read)
    assert not feed.claim()                             # paced: not within interval_s of the last
    now[0] += 0.01
    assert feed.claim()
    feed.released(Future())                             # the link refused it (kvtierd away): claimable again
    now[0] += 0.01
    assert feed.claim()
    feed.poll(read)
    assert asked == [{"epoch": None, "cursor": None, "snapshot_from": None}, {"epoch": 7, "cursor": 1,
                                                                               "snapshot_from": None}]
    now[0] += 0.01
    assert feed.pending and not feed.claim()            # 3 keys queued, none taken: the polls stop
    assert [(removed, sorted(ks)) for removed, ks in feed.take()] == [(False, keys[:2]), (True, keys[:1])]
    assert not feed.pending
    assert feed.claim() and feed.announced == 3

"""Nothing frees a page that a writer or a reader may still touch (DESIGN.md invariant 12; issue
26 case E): a namespace taken over while the tier companion reads its blocks (a demote) or writes
them (a promote), and a randomized run interleaving namespace churn, demotes, promotes, stores,
aborts and engine exits. The region's pages hold real bytes (``tier_env.page_content``, derived
from the namespace and the key): every load and every block the companion reads is checked by
content, so a page handed to two owners at once cannot pass.
"""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest

from kvtierd.attachments import SessionEnd
from kvtierd.contract.codes import ErrorCode, RequestError, StoreOutcome
from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import NS_SLOTS
from kvtierd.tier.backend import TierTimeout

from .store_env import err, keys, lay, per_entry
from .tier_env import TierEnv, identity, page_content


def churn(tenv: TierEnv, count: int, prefix: str = "churn") -> None:
    """``count`` engines, each of its own model, each storing one block and leaving (what
    tests/attacks.py's fill_namespaces does to a daemon): namespaces nobody uses, each newer
    than the ones before."""
    for i in range(count):
        (s,) = tenv.engine(f"{prefix}{i}", model=f"{prefix}{i}")
        tenv.fill([s], 1, [b"k"])
        tenv.store.detach(s)


def chain_pages(tenv: TierEnv, sessions: list) -> set[int]:
    """Every page of every entry of the sessions' namespaces (whole chains)."""
    index = tenv.store.index
    return {p for s in sessions
            for p in np.frombuffer(index.pages_of(s.engine.ns, index.slots_of(s.engine.ns)), PAGES_DTYPE).tolist()}


# ------------------------------------------------------------------------------------------ case E
def test_a_namespace_taken_over_mid_demote_keeps_the_pages_the_put_reads():
    """Issue 26 E, demote: the blocks a put is reading stay theirs whatever happens to the
    namespace table; their namespace is not taken over while the put runs."""
    tenv = TierEnv(num_pages=2048, companion=True, low_watermark=0.5)
    (old,) = tenv.engine("old", model="old")
    tenv.fill([old], 1, keys("o", 1100))            # 948 pages free: 76 short of the reserve
    tenv.store.detach(old)
    tenv.pump()
    rid, put = tenv.link.last("put")
    reading = set(np.frombuffer(put["pages"], PAGES_DTYPE).tolist())
    assert len(reading) == 76
    churn(tenv, NS_SLOTS - 1)                       # the table is full; "old" was used least recently
    (new,) = tenv.engine("new", model="new")        # a new model takes a namespace slot over
    tenv.fill([new], 1, keys("n", 1500))
    handed_away = len(chain_pages(tenv, [new]) & reading)
    tenv.link.finish(rid)                           # the companion reads the blocks now
    foreign = tenv.link.foreign
    assert (handed_away, foreign) == (0, 0), f"{handed_away} pages under a put handed to a new engine, " \
                                             f"{foreign} foreign blocks demoted"
    tenv.pump()
    tenv.store.verify()


def test_a_namespace_taken_over_mid_promote_keeps_the_pages_the_get_writes():
    """Issue 26 E, promote: the pages a get is writing stay fenced for the companion whatever
    happens to the namespace table; nothing READY of another engine ever gets the tier's bytes."""
    tenv = TierEnv(num_pages=2048, companion=True, low_watermark=0.01)
    (old,) = tenv.engine("old", model="old")
    ident = identity(old.engine.ns.id)
    wanted = keys("t", 4)
    for key in wanted:                              # another node demoted them
        tenv.link.tier[(ident, key)] = [page_content(ident, key, 0)]
    assert tenv.lookup(old, wanted) == (0, 4)
    tenv.link.finish(tenv.link.last("exists")[0])
    tenv.pump()
    rid, get = tenv.link.last("get")
    writing = set(np.frombuffer(get["pages"], PAGES_DTYPE).tolist())
    tenv.store.detach(old)
    churn(tenv, NS_SLOTS - 1)
    (new,) = tenv.engine("new", model="new")
    stored = keys("n", 100)
    tenv.fill([new], 1, stored)
    handed_away = len(chain_pages(tenv, [new]) & writing)
    tenv.link.finish(rid)                           # the companion's get lands now
    tenv.pump()
    wrong = 0
    for r, start in enumerate(range(0, len(stored), 20)):
        batch = stored[start:start + 20]
        hits, pages = tenv.store.load(new, 10 + r, batch)
        wrong += sum(not tenv.holds_own_bytes(new, k, p) for k, p in zip(batch[:hits], per_entry(pages, hits)))
        tenv.store.release(new, 10 + r)
    assert (handed_away, wrong) == (0, 0), f"{handed_away} pages under a get handed to a new engine, " \
                                           f"{wrong} of its blocks loaded with foreign bytes"
    tenv.store.verify()


def test_a_full_table_whose_unused_namespaces_the_tier_still_moves_says_retry_then_takes_one():
    tenv = TierEnv(num_pages=64, companion=True, ns_slots=2, low_watermark=0.5)
    (old,) = tenv.engine("old", model="old")
    tenv.fill([old], 1, keys("o", 40))
    tenv.store.detach(old)
    tenv.pump()                                      # a put reads old's victims: its namespace is busy
    rid, _ = tenv.link.last("put")
    tenv.engine("stays", model="stays")              # the other slot: an attached engine's
    with err(ErrorCode.NO_SPACE) as info:
        tenv.engine("new", model="new")
    assert "the second tier is moving" in info.value.message and "retry" in info.value.message
    tenv.link.finish(rid)
    tenv.pump()                                      # the put ended: nothing of "old" is touched now
    (new,) = tenv.engine("new", model="new")
    assert new.engine.ns.slot == 0 and tenv.link.foreign == 0
    assert list(tenv.fill([new], 1, keys("n", 8))) == [StoreOutcome.WRITE] * 8


# ------------------------------------------------------------------------------------------ randomized
class World:
    """One node: engines of a few models coming and going, storing (their writers copying now,
    late, or never) and loading (every block checked by content), namespaces churned through a
    table of a few slots, and a companion demoting, checking and promoting — answering
    in time, late, failed, or dying — all in an order the seed decides."""

    MODELS = ("r0", "r1", "s2", "r3", "s4", "r5")       # r: replicated, s: sharded (TP=2)
    NS_SLOTS = 4                                       # of the namespace table: the models and the churn share them

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.tenv = TierEnv(num_pages=64, companion=True, ns_slots=self.NS_SLOTS, low_watermark=0.5)
        self.store, self.link, self.clock = self.tenv.store, self.tenv.link, self.tenv.clock
        self.engines: dict[str, list] = {}              # model -> its attached engine's sessions
        self.deferred: list[tuple] = []                 # (sessions, job, keys, handed): copies not done yet
        self.orphans: list[tuple] = []                  # (deadline, session, keys, handed): late copies of the living
        self.ids = itertools.count(1)
        self.wrong = self.loads = self.refused = 0

    # -------------------------------------------------------------- engines
    def attach(self) -> None:
        model = self.rng.choice([m for m in self.MODELS if m not in self.engines])
        sharded = model.startswith("s")
        tp = 2 if sharded else self.rng.choice((1, 2))
        layout = lay("sharded" if sharded else "replicated", tp, model=model)
        engine = f"{model}-{next(self.ids)}"
        try:
            self.engines[model] = [self.store.attach(engine, r, tp, layout) for r in range(tp)]
        except RequestError:
            self.refused += 1

    def leave(self) -> None:
        model = self.rng.choice(list(self.engines))
        sessions = self.engines.pop(model)
        end = self.rng.choice((SessionEnd.LEFT, SessionEnd.DIED, SessionEnd.HEARTBEAT_LOST, SessionEnd.DISCONNECTED))
        mine = [d for d in self.deferred if d[0] is sessions]
        self.deferred = [d for d in self.deferred if d[0] is not sessions]
        if end is SessionEnd.LEFT:                      # the client waits for its copies before bye
            for _, _, ks, handed in mine:
                for s, (written, pages) in handed.items():
                    self.tenv.copy(s, written, pages)
        elif end is not SessionEnd.DIED:                # alive: its copies may land later (within the grace)
            for _, _, ks, handed in mine:
                for s, (written, pages) in handed.items():
                    self.orphans.append((self.clock() + 60, s, written, pages))
        for s in sessions:
            self.store.detach(s, end)

    def churn(self) -> None:
        try:
            (s,) = self.tenv.engine(f"churn{next(self.ids)}", model=f"churn{next(self.ids)}")
        except RequestError:
            self.refused += 1
            return
        self.tenv.fill([s], 1, [b"k"])
        self.store.detach(s)

    # -------------------------------------------------------------- jobs
    def sample(self, model: str) -> list[bytes]:
        """A run of the model's keys (an engine's requests share prefixes)."""
        start = self.rng.randrange(20)
        return keys(model, self.rng.randint(1, 5), start)

    def store_job(self) -> None:
        model = self.rng.choice(list(self.engines))
        sessions, ks, job = self.engines[model], self.sample(model), next(self.ids)
        handed = {}
        try:
            for s in self.rng.sample(sessions, len(sessions)):
                outcomes, pages = self.store.store(s, job, ks)
                if s.rank in s.engine.writers:
                    handed[s] = ([k for k, o in zip(ks, outcomes) if o == StoreOutcome.WRITE], pages)
        except RequestError:
            return
        how = self.rng.random()
        if how < 0.2:                                   # the copies are still running
            self.deferred.append((sessions, job, ks, handed))
            if how < 0.05:
                self._try(self.store.abort, sessions[0], job)
            return
        self.finish((sessions, job, ks, handed))

    def finish(self, job) -> None:
        sessions, job_id, ks, handed = job
        for s, (written, pages) in handed.items():
            self.tenv.copy(s, written, pages)
            self._try(self.store.commit, s, job_id, True)

    def load_job(self) -> None:
        model = self.rng.choice(list(self.engines))
        sessions, ks, job = self.engines[model], self.sample(model), next(self.ids)
        hits = self.store.lookup(sessions[0], ks)
        self.store.pending(sessions[0], ks, hits)
        for s in sessions:
            try:
                found, pages = self.store.load(s, job, ks)
            except RequestError:
                return
            self.loads += found
            self.wrong += sum(not self.tenv.holds_own_bytes(s, k, p)
                              for k, p in zip(ks[:found], per_entry(pages, found)))
        for s in sessions:
            self._try(self.store.release, s, job)

    # -------------------------------------------------------------- the companion and the clock
    def companion(self) -> None:
        link = self.link
        if link.state != "ready":
            if self.rng.random() < 0.3:                 # restarted
                link.state, link.pid = "ready", os.getpid()
            return
        if self.rng.random() < 0.02:
            link.die()
            return
        for rid in list(link.inflight):
            roll = self.rng.random()
            if roll < 0.5:
                link.finish(rid)
            elif roll < 0.55:
                link.finish(rid, ok=False)
            elif roll < 0.6 and not link.inflight[rid].timed_out:
                link.inflight[rid].timed_out = True     # past its deadline: the late answer comes later
                link.answer(rid, ok=False, final=False, error=TierTimeout("late"))

    def late_copies(self) -> None:
        due = [o for o in self.orphans if self.rng.random() < 0.3 or o[0] <= self.clock()]
        self.orphans = [o for o in self.orphans if o not in due]
        for _, s, written, pages in due:
            self.tenv.copy(s, written, pages)           # a living writer's copy, after its session ended

    def step(self) -> None:
        actions = [self.companion] * 4 + [self.late_copies, self.churn]
        if len(self.engines) < len(self.MODELS):
            actions += [self.attach]
        if self.engines:
            actions += [self.store_job] * 4 + [self.load_job] * 4 + [self.leave]
        if self.deferred:
            actions += [lambda: self.finish(self.deferred.pop(self.rng.randrange(len(self.deferred))))]
        self.rng.choice(actions)()
        self.clock.advance(self.rng.choice((0.0, 0.0005, 0.05, 0.5, 3.0)))
        self.tenv.pump()

    @staticmethod
    def _try(fn, *args) -> None:
        try:
            fn(*args)
        except RequestError:
            pass


@pytest.mark.parametrize("seed", range(12))
def test_churn_demotes_promotes_and_exits_interleaved_never_serve_foreign_bytes(seed):
    world = World(seed)
    for _ in range(600):
        world.step()
    stats = world.tenv.tier.stats()
    assert (world.wrong, world.link.foreign) == (0, 0), \
        f"{world.wrong} blocks loaded with foreign bytes, {world.link.foreign} demoted with foreign bytes"
    assert world.loads > 30 and stats["promoted_blocks"] and stats["demoted_blocks"], (world.loads, stats)
    world.store.verify()

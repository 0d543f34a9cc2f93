"""kvtierd.store.Store: engines and sessions attaching and detaching, and a randomized state
machine over every operation against a model of invariants 1 and 5.

No sockets, no files: the region is a RegionView over an in-memory buffer (``store_env``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtierd.attachments import SessionEnd
from kvtierd.contract.codes import ErrorCode, RequestError
from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import EntryState
from kvtierd.processes import Process
from kvtierd.store import Store

from .store_env import TIMEOUT, FakeClock, P, W, err, lay, make_view, reopen

# ---------------------------------------------------------------------------- sessions
def test_dead_rank_aborts_unvoted_jobs_and_drops_pins(env):
    sess = env.engine("e", 2)
    st_ = env.store
    env.put(sess, 1, [b"a"])
    st_.load(sess[0], 2, [b"a"])
    st_.load(sess[1], 2, [b"a"])
    st_.release(sess[0], 2)
    st_.store(sess[0], 3, [b"b"])                    # rank 1 has not voted
    assert env.stats()["entries_pinned"] == 1 and env.stats()["entries_writing"] == 1
    st_.detach(sess[1], SessionEnd.DIED)
    stats = env.stats()
    assert stats["entries_pinned"] == 0 and stats["entries_writing"] == 0 and stats["open_jobs"] == 0
    assert stats["pages_fenced"] == 1          # rank 0 is alive and holds b's pages
    assert st_.jobs.aborted["rank_died"] == 2
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 3, True)
    assert env.stats()["pages_used"] == 1            # only a
    st_.verify()


def test_rank_leaving_after_its_vote_does_not_abort(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[1], 1, [b"a"])
    st_.detach(sess[1])
    assert env.stats()["open_jobs"] == 1
    st_.store(sess[0], 1, [b"a"])
    st_.commit(sess[0], 1, True)
    assert st_.lookup(sess[0], [b"a"]) == 1
    st_.verify()


def test_engine_removed_when_last_session_leaves(env):
    layout = lay("replicated", 2)
    coord = env.store.attach("e", None, 2, layout)
    sess = env.ranks("e", 2, layout)
    st_ = env.store
    env.put(sess, 1, [b"a"])
    st_.store(coord, 2, [b"b"])
    st_.store(sess[0], 2, [b"b"])
    st_.store(sess[1], 2, [b"b"])                    # voted; rank 0 copying
    st_.detach(sess[1])
    assert "e" in st_.jobs.engines and env.stats()["open_jobs"] == 1
    st_.detach(sess[0])                              # writer gone before its vote: abort, free
    assert env.stats()["open_jobs"] == 0 and env.stats()["pages_fenced"] == 0
    assert "e" in st_.jobs.engines                        # the coordinator is still there
    st_.detach(coord)
    assert "e" not in st_.jobs.engines and st_.attachments.sessions == {}
    st_.detach(coord)                                # idempotent
    # a restarted engine may change its world size, and reuse job ids
    sess = env.engine("e", 4)
    out, _ = env.put(sess, 1, [b"a", b"c"])
    assert list(out) == [P, W]
    st_.verify()


def test_the_last_writers_bye_releases_its_fenced_pages(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.abort(sess[1], 1)
    assert env.stats()["pages_fenced"] == 1
    st_.detach(sess[1])
    assert env.stats()["pages_fenced"] == 1
    st_.detach(sess[0])
    assert env.stats()["pages_fenced"] == 0 and env.stats()["pages_used"] == 0
    st_.verify()


def test_attach_validation(env):
    st_ = env.store
    layout = lay("replicated", 2)
    s0 = st_.attach("e", 0, 2, layout)
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", 0, 2, layout)                # rank taken
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", 1, 4, layout)                # world size
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", 1, 2, lay("replicated", 2, model="other"))
    with err(ErrorCode.LAYOUT_MISMATCH):
        st_.attach("e", None, 2, lay("sharded", 2))
    with err(ErrorCode.BAD_REQUEST):
        st_.attach("e", 2, 2, layout)
    assert set(st_.attachments.sessions) == {s0.id}
    s1 = st_.attach("e", 1, 2, layout)
    assert s1.id != s0.id
    st_.detach(s0)
    s0b = st_.attach("e", 0, 2, layout)              # a rank may attach again after leaving
    assert s0b.id not in (s0.id, s1.id)
    st_.verify()


def test_bad_rank_leaves_no_engine_behind(env):
    st_ = env.store
    with err(ErrorCode.BAD_REQUEST):
        st_.attach("e", 4, 4, lay("replicated", 4))
    assert st_.jobs.engines == {} and st_.attachments.sessions == {}
    st_.attach("e", 0, 2, lay("replicated", 2))      # not held to the refused world size

# ---------------------------------------------------------------------------- randomized
def run_bytes(session) -> int:
    """The bytes of one entry's run in the session's store or load reply: its shard's pages."""
    return np.dtype(PAGES_DTYPE).itemsize * session.engine.ns.pages_per_shard


ENGINES = {
    "r2": ("replicated", 2, "M"),
    "s2": ("sharded", 2, "M"),
    "r1": ("replicated", 1, "M"),          # shares its namespace with r2
    "r3": ("replicated", 3, "N"),
}
KEYS = [bytes([i]) for i in range(5)]
JOBS = st.integers(0, 5)
KEYLISTS = st.lists(st.sampled_from(KEYS), unique=True, max_size=4)


class StoreMachine(RuleBasedStateMachine):
    """Random interleavings of every store operation over a few engines and a small region.

    After every step: ``verify()`` and the counters agree, and every READY entry was either
    recovered at the last restart or written by a job that every rank of its engine voted on
    (the writers with a successful commit) -- invariants 1 and 5, checked against a model.
    Only RequestError may come out of the store.
    """

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.view = make_view(12)
        self.store = Store(self.view, job_timeout=TIMEOUT, clock=self.clock)
        self.sessions: list = []
        self.jobs: dict = {}            # (engine, generation, job) -> {"writes", "votes", "ws", "layout"}
        self.gen: dict = {}             # engine id -> how many times it was (re)created
        self.recovered: set = set()     # (layout, key) READY at the last restart

    # -- operations, recorded in the model when the store accepts them
    def job_model(self, session, job):
        e = session.engine
        return self.jobs.setdefault((e.id, self.gen.get(e.id, 0), job), {
            "writes": set(), "votes": set(), "ws": e.world_size, "layout": e.ns.id})

    def do_store(self, s, job, ks):
        try:
            outcomes, pgs = self.store.store(s, job, ks)
        except RequestError:
            return
        assert len(outcomes) == len(ks)
        m = self.job_model(s, job)
        m["writes"] = {k for k, o in zip(ks, outcomes) if o == W}
        if s.rank is not None and s.rank in s.engine.writers:
            assert len(pgs) == len(m["writes"]) * run_bytes(s)     # its shard of each WRITE key
            event("writer got pages" if pgs else "writer got nothing to write")
        else:
            assert pgs == b""
            if s.rank is not None:
                m["votes"].add(s.rank)

    def do_commit(self, s, job, ok):
        try:
            self.store.commit(s, job, ok)
        except RequestError as exc:
            event(f"commit refused: {exc.code.name}")
            return
        if ok:
            self.job_model(s, job)["votes"].add(s.rank)

    def do_load(self, s, job, ks):
        try:
            hits, pgs = self.store.load(s, job, ks)
        except RequestError:
            return
        assert 0 <= hits <= len(ks)
        assert len(pgs) == (0 if s.rank is None else hits) * run_bytes(s)
        if hits:
            event("load hit")

    def call(self, fn, *args):
        try:
            return fn(*args)
        except RequestError:
            return None

    def pick(self, data):
        return data.draw(st.sampled_from(self.sessions))

    def engine_sessions(self, data):
        engine = data.draw(st.sampled_from(sorted({s.engine.id for s in self.sessions})))
        group = [s for s in self.sessions if s.engine.id == engine]
        return data.draw(st.permutations(group))

    # -- rules
    @initialize(coordinators=st.sets(st.sampled_from(sorted(ENGINES))))
    def attach_everyone(self, coordinators):
        for engine, (kind, ws, model) in sorted(ENGINES.items()):
            self.gen[engine] = 1
            ranks = ([None] if engine in coordinators else []) + list(range(ws))
            for rank in ranks:
                self.sessions.append(self.store.attach(engine, rank, ws, lay(kind, ws, model=model)))

    @rule(engine=st.sampled_from(sorted(ENGINES)), data=st.data())
    def attach(self, engine, data):
        kind, ws, model = ENGINES[engine]
        rank = data.draw(st.integers(-1, ws))         # ws itself is out of range
        res = self.call(self.store.attach, engine, None if rank < 0 else rank, ws, lay(kind, ws, model=model))
        if res is not None:
            if not any(s.engine.id == engine for s in self.sessions):
                self.gen[engine] = self.gen.get(engine, 0) + 1      # a new engine: job ids restart
            self.sessions.append(res)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def detach(self, data):
        s = self.pick(data)
        self.store.detach(s, data.draw(st.sampled_from([SessionEnd.LEFT, SessionEnd.DIED])))
        self.sessions.remove(s)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS)
    def store_one(self, data, job, ks):
        self.do_store(self.pick(data), job, ks)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ok=st.booleans())
    def commit_one(self, data, job, ok):
        self.do_commit(self.pick(data), job, ok)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS)
    def store_all(self, data, job, ks):
        """The whole store protocol by every attached session of one engine, in a random order."""
        group = self.engine_sessions(data)
        for s in group:
            self.do_store(s, job, ks)
        for s in group:
            if s.rank is not None and s.rank in s.engine.writers:
                self.do_commit(s, job, data.draw(st.sampled_from([True, True, True, False])))

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS, release=st.booleans())
    def load_all(self, data, job, ks, release):
        group = self.engine_sessions(data)
        for s in group:
            self.do_load(s, job, ks)
        if release:
            for s in group:
                self.call(self.store.release, s, job)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS.filter(bool))
    def roundtrip(self, data, job, ks):
        """Store then load the same keys by one engine (a READY-rich path)."""
        group = self.engine_sessions(data)
        for s in group:
            self.do_store(s, job, ks)
        for s in group:
            if s.rank is not None and s.rank in s.engine.writers:
                self.do_commit(s, job, True)
        for s in group:
            self.do_load(s, job + 6, ks)
        for s in group:
            self.call(self.store.release, s, job + 6)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS)
    def load_one(self, data, job, ks):
        self.do_load(self.pick(data), job, ks)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS)
    def release(self, data, job):
        self.call(self.store.release, self.pick(data), job)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS)
    def abort(self, data, job):
        self.call(self.store.abort, self.pick(data), job)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), ks=KEYLISTS)
    def lookup(self, data, ks):
        assert 0 <= self.store.lookup(self.pick(data), ks) <= len(ks)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), lease=st.integers(0, 3), ks=KEYLISTS, ttl=st.sampled_from([None, 0.5, TIMEOUT * 2]))
    def lease(self, data, lease, ks, ttl):
        found = self.store.lease(self.pick(data), lease, ks, ttl)
        assert 0 <= found.leased <= found.hits <= len(ks) and (found.lease is None) == (found.leased == 0)
        if found.leased:
            event("leased")

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), leases=st.lists(st.integers(0, 4), max_size=3))
    def unlease(self, data, leases):
        self.store.unlease(self.pick(data), leases)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), job=JOBS, ks=KEYLISTS, lease=st.integers(0, 3), force=st.booleans())
    def lease_survives_pressure(self, data, job, ks, lease, force):
        """Invariant 10: between a leasing lookup and the load that names its lease, other engines
        fill the region and the operator clears it: the load gets at least the leased prefix (a
        forced clear revokes the lease, and then nothing is promised)."""
        group = self.engine_sessions(data)
        found = self.store.lease(group[0], lease, ks)
        for other in {s.engine.id for s in self.sessions} - {group[0].engine.id}:
            for s in [s for s in self.sessions if s.engine.id == other]:
                self.do_store(s, job, [bytes([200 + i]) for i in range(4)])
        evicted = self.store.evict(None, None, force).evicted
        if evicted:
            event("operator cleared around a lease")
        fresh = job + 12 not in group[0].engine.jobs       # else the job's decision was fixed before
        for s in group:
            try:
                hits, _ = self.store.load(s, job + 12, ks, lease)
            except RequestError:
                return
            if fresh and not force:
                assert hits >= found.leased, (hits, found)
                event("leased load after pressure")
        for s in group:
            self.call(self.store.release, s, job + 12)

    @rule(data=st.data())
    def job_states(self, data):
        if self.sessions:
            states = self.store.job_states(self.pick(data), list(range(12)))
            assert all(x["state"] in ("open", "done", "aborted", "unknown") for x in states)

    @rule(dt=st.sampled_from([1.0, TIMEOUT / 2, TIMEOUT + 1]))
    def expire(self, dt):
        self.clock.advance(dt)
        nxt = self.store.expire()
        assert nxt is None or nxt > self.clock()

    @rule(clean=st.booleans())
    def restart(self, clean):
        if clean:
            self.store.shutdown()
        self.store = reopen(self.view, self.clock)
        assert self.store.recovered["corrupt_discarded"] == 0
        self.sessions = []
        self.jobs = {}
        index = self.store.index
        self.recovered = {(ns.id, k) for ns in index.namespaces.values() for k in index.keys_of(index.slots_of(ns))}
        assert self.store.stats()["entries_writing"] == 0

    # -- invariants
    @invariant()
    def consistent(self):
        self.store.verify()
        stats = self.store.stats()
        assert stats["pages_free"] + stats["pages_used"] == stats["pages_total"]
        index = self.store.index
        assert stats["entries_ready"] + stats["entries_writing"] == sum(
            len(index.slots_of(ns)) for ns in index.namespaces.values())
        assert stats["entries_pinned"] == sum(
            1 for ns in index.namespaces.values() for slot in index.slots_of(ns).tolist() if index.holds.of(slot)[0])
        if stats["pages_fenced"]:
            event("pages fenced")
        if stats["evictions"]:
            event("evictions")

    @invariant()
    def ready_only_after_every_vote(self):
        """Invariant 1/5: a READY entry was recovered, or some job wrote it and every rank voted."""
        done = set()
        for m in self.jobs.values():
            if len(m["votes"]) >= m["ws"]:
                done |= {(m["layout"], k) for k in m["writes"]}
        index = self.store.index
        for ns in index.namespaces.values():
            slots = index.slots_of(ns)
            for k, state in zip(index.keys_of(slots), index.states(slots).tolist()):
                if state == EntryState.READY:
                    event("ready entries")
                    assert (ns.id, k) in done | self.recovered, k


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_an_engines_later_sessions_must_come_from_its_uid_with_its_secret(env):
    # Issue 11 item 5: sessions of an engine are bound together by the uid of its first session
    # (the kernel's word for the peer) and the secret it presented, if any.
    st_, ns = env.store, lay("replicated", 3)
    first = st_.attach("e", 0, 3, ns, process=Process(uid=1000), secret=b"s" * 16)
    with err(ErrorCode.FORBIDDEN):
        st_.attach("e", 1, 3, ns, process=Process(uid=1001), secret=b"s" * 16)     # another uid
    with err(ErrorCode.FORBIDDEN):
        st_.attach("e", None, 3, ns, process=Process(uid=1000))                    # no secret
    with err(ErrorCode.FORBIDDEN):
        st_.attach("e", 1, 3, ns, process=Process(uid=1000), secret=b"t" * 16)     # another secret
    second = st_.attach("e", 1, 3, ns, process=Process(uid=1000), secret=b"s" * 16)
    assert second.engine is first.engine and len(st_.attachments.sessions) == 2
    st_.detach(first)
    st_.detach(second)                                                            # gone: the id is free again
    st_.attach("e", 0, 3, ns, process=Process(uid=1001))
    with err(ErrorCode.FORBIDDEN):
        st_.attach("e", 1, 3, ns, process=Process(uid=1001), secret=b"s" * 16)     # its first had none
    st_.verify()

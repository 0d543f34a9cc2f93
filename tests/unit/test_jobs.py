"""kvtierd.jobs through the store: votes and readiness (replicated and sharded), coordinators,
agreement on a job's decision, aborts, timeouts, tombstones and the page fence.

The scenarios drive ``Store`` (the front the server calls) over a region in memory
(``store_env``); every one ends with ``verify()``.
"""

from __future__ import annotations

import pytest

from kvtierd.attachments import SessionEnd
from kvtierd.contract.codes import ErrorCode

from .store_env import PAGE, TIMEOUT, Env, N, P, W, err, keys, lay, pages, per_entry, slot_pages, small

# ---------------------------------------------------------------------------- replicated
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("writer_first", [True, False])
def test_replicated_one_writer_ready_after_all_votes(env, tp, writer_first):
    block = 2 * PAGE + 100              # 3 pages per block
    sess = env.engine("e", tp, block_bytes=block)
    ks = keys("k", 3)
    st_ = env.store
    order = sess if writer_first else sess[1:] + sess[:1]
    rank0_pages = None
    for s in order:
        out, pg = st_.store(s, 1, ks)
        assert list(out) == [W, W, W]
        if s.rank == 0:
            assert len(pages(pg)) == 3 * 3  # 3 entries' runs of 3 pages
            rank0_pages = pg
        else:
            assert pg == b""            # a non-writer's store is its vote
        assert st_.lookup(sess[-1], ks) == 0
    assert env.stats()["entries_writing"] == 3
    assert len(set(pages(rank0_pages))) == 9
    st_.verify()
    st_.commit(sess[0], 1, True)        # the writer's vote, after its copy: the last one
    for s in sess:
        assert st_.lookup(s, ks) == 3
    stats = env.stats()
    assert stats["entries_ready"] == 3 and stats["entries_writing"] == 0
    assert stats["bytes_written"] == 3 * block                 # one copy, not TP copies
    assert stats["bytes_saved_dedup"] == 3 * block * (tp - 1)
    assert stats["pages_used"] == 9
    assert st_.job_states(sess[0], [1]) == [{"job": 1, "kind": "store", "state": "done", "cause": ""}]
    # every rank loads rank 0's single copy
    hits, got = env.get(sess, 2, ks + [b"missing"])
    assert hits == 3
    for r in range(tp):
        assert got[r] == rank0_pages
    assert env.stats()["entries_pinned"] == 0
    st_.verify()


def test_replicated_ready_waits_for_last_non_writer(env):
    sess = env.engine("e", 4)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.commit(sess[0], 1, True)
    st_.store(sess[1], 1, [b"a"])
    st_.store(sess[2], 1, [b"a"])
    assert st_.lookup(sess[0], [b"a"]) == 0
    assert st_.job_states(sess[0], [1])[0]["waiting"] == 1
    st_.store(sess[3], 1, [b"a"])
    assert st_.lookup(sess[0], [b"a"]) == 1
    st_.verify()


def test_replicated_namespace_shared_across_tp_sizes(env):
    """Replicated blocks do not depend on TP: an engine at TP=2 and one at TP=4 share entries."""
    a = env.engine("a", 2)
    b = env.engine("b", 4)
    assert a[0].engine.ns is b[0].engine.ns
    env.put(a, 1, [b"x"])
    assert env.store.lookup(b[0], [b"x"]) == 1
    out, _ = env.put(b, 1, [b"x", b"y"])
    assert list(out) == [P, W]
    assert env.store.lookup(a[1], [b"x", b"y"]) == 2

# ---------------------------------------------------------------------------- sharded
def test_sharded_every_rank_writes_its_own_shard(env):
    block = 2 * PAGE
    sess = env.engine("e", 4, "sharded", block_bytes=block)
    ks = keys("k", 3)
    st_ = env.store
    got = {}
    for s in sess:
        out, got[s.rank] = st_.store(s, 1, ks)
        assert list(out) == [W, W, W]
        assert len(pages(got[s.rank])) == 3 * 2         # 3 entries' runs of a 2-page shard
    runs = {r: per_entry(got[r], 3) for r in range(4)}
    for i in range(3):
        shards = [set(pages(runs[r][i])) for r in range(4)]
        union = set().union(*shards)
        assert len(union) == 8                          # disjoint shards
        _, chain = slot_pages((st_.index, sess[0].engine.ns), ks[i])
        assert chain == [p for r in range(4) for p in pages(runs[r][i])]   # rank order
    all_pages = [p for r in range(4) for p in pages(got[r])]
    assert len(set(all_pages)) == 24
    # storing is not voting for a writer: every rank must commit
    for s in sess[:3]:
        st_.commit(s, 1, True)
        assert st_.lookup(s, ks) == 0
    st_.commit(sess[3], 1, True)
    assert st_.lookup(sess[0], ks) == 3
    stats = env.stats()
    assert stats["bytes_written"] == 3 * 4 * block
    assert stats["bytes_saved_dedup"] == 0
    hits, loaded = env.get(sess, 2, ks)
    assert hits == 3
    for r in range(4):
        assert loaded[r] == got[r]
    st_.verify()


def test_sharded_namespaces_differ_by_tp(env):
    a = env.engine("a", 2, "sharded")
    b = env.engine("b", 4, "sharded")
    assert a[0].engine.ns is not b[0].engine.ns
    env.put(a, 1, [b"x"])
    assert env.store.lookup(b[0], [b"x"]) == 0


def test_sharded_writer_commit_before_store_is_conflict(env):
    sess = env.engine("e", 2, "sharded")
    env.store.store(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.commit(sess[1], 1, True)
    env.store.store(sess[1], 1, [b"a"])
    env.store.commit(sess[0], 1, True)
    env.store.commit(sess[1], 1, True)
    assert env.store.lookup(sess[0], [b"a"]) == 1

# ---------------------------------------------------------------------------- coordinator
@pytest.mark.parametrize("kind", ["replicated", "sharded"])
def test_coordinator_opens_jobs_ranks_copy_and_vote(env, kind):
    layout = lay(kind, 2)
    coord = env.store.attach("e", None, 2, layout)
    sess = env.ranks("e", 2, layout)
    st_ = env.store
    ks = keys("k", 2)
    assert st_.lookup(coord, ks) == 0
    out, pg = st_.store(coord, 7, ks)
    assert list(out) == [W, W] and pg == b""
    with err(ErrorCode.FORBIDDEN):
        st_.commit(coord, 7, True)
    assert env.stats()["entries_writing"] == 2
    outs, got = env.put(sess, 7, ks)
    assert list(outs) == [W, W]
    assert all(len(pages(got[r])) == 2 for r in sess[0].engine.writers)   # a run of one page per entry
    assert st_.lookup(coord, ks) == 2
    assert st_.job_states(coord, [7])[0]["state"] == "done"
    hits, pg = st_.load(coord, 8, ks)
    assert hits == 2 and pg == b""
    assert env.stats()["entries_pinned"] == 2
    with err(ErrorCode.FORBIDDEN):
        st_.release(coord, 8)
    hits, loaded = env.get(sess, 8, ks)
    assert hits == 2
    assert env.stats()["entries_pinned"] == 0
    assert st_.job_states(coord, [8])[0]["state"] == "done"
    # the coordinator leaving does not disturb the ranks' jobs
    st_.store(coord, 9, [b"z"])
    st_.detach(coord)
    env.put(sess, 9, [b"z"])
    assert st_.lookup(sess[0], [b"z"]) == 1
    st_.verify()


def test_coordinator_may_abort(env):
    layout = lay("replicated", 2)
    coord = env.store.attach("e", None, 2, layout)
    sess = env.ranks("e", 2, layout)
    env.store.store(coord, 1, [b"a"])
    env.store.store(sess[1], 1, [b"a"])
    env.store.abort(coord, 1)
    assert env.stats()["pages_used"] == 0
    with err(ErrorCode.ABORTED):
        env.store.store(sess[0], 1, [b"a"])
    env.store.abort(coord, 1)       # aborting an aborted job is a no-op
    env.store.verify()

# ---------------------------------------------------------------------------- agreement
def test_store_decision_is_fixed_by_first_request():
    env = small(4)
    st_ = env.store
    other = env.engine("o", 1)
    env.put(other, 1, keys("p", 4))
    hits, _ = st_.load(other[0], 2, keys("p", 4))        # pin everything: no room
    assert hits == 4
    sess = env.engine("e", 2)
    out0, pg0 = st_.store(sess[0], 1, [b"p0", b"x"])
    assert list(out0) == [P, N] and pg0 == b""
    st_.release(other[0], 2)                               # room now, but the decision stands
    out1, _ = st_.store(sess[1], 1, [b"p0", b"x"])
    assert out1 == out0
    st_.commit(sess[0], 1, True)
    assert st_.lookup(sess[0], [b"x"]) == 0
    st_.verify()


def test_load_decision_is_fixed_by_first_request(env):
    sess = env.engine("e", 2)
    env.put(sess, 1, [b"a"])
    hits, pg0 = env.store.load(sess[0], 2, [b"a", b"b"])
    assert hits == 1
    env.put(sess, 3, [b"b"])
    hits1, pg1 = env.store.load(sess[1], 2, [b"a", b"b"])
    assert hits1 == 1 and pg1 == pg0
    env.store.release(sess[0], 2)
    env.store.release(sess[1], 2)
    env.store.verify()


@pytest.mark.parametrize("how", ["keys", "order", "kind_load", "fewer"])
def test_conflicting_request_aborts_job(env, how):
    sess = env.engine("e", 2)
    st_ = env.store
    ks = keys("k", 3)
    out, pg = st_.store(sess[0], 1, ks)
    assert list(out) == [W] * 3 and len(pages(pg)) == 3            # an entry is a page
    assert env.stats()["pages_used"] == 3
    with err(ErrorCode.CONFLICT):
        if how == "keys":
            st_.store(sess[1], 1, keys("z", 3))
        elif how == "order":
            st_.store(sess[1], 1, ks[::-1])
        elif how == "fewer":
            st_.store(sess[1], 1, ks[:2])
        else:
            st_.load(sess[1], 1, ks)
    # entries gone at once; pages fenced until the writer that holds them answers
    assert env.stats()["entries_writing"] == 0
    assert st_.lookup(sess[0], ks) == 0
    assert (st_.index.find(sess[0].engine.ns, ks) == -1).all()
    assert env.stats()["pages_fenced"] == 3
    st_.verify()
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    assert env.stats()["pages_used"] == 0 and env.stats()["pages_fenced"] == 0
    assert st_.job_states(sess[0], [1])[0] == {"job": 1, "kind": "store", "state": "aborted", "cause": "conflict"}
    assert env.store.jobs.aborted["conflict"] == 1
    # the keys can be stored again by a new job
    out, _ = env.put(sess, 2, ks)
    assert list(out) == [W] * 3
    st_.verify()


def test_conflicting_load_aborts_and_unpins(env):
    sess = env.engine("e", 2)
    env.put(sess, 1, [b"a", b"b"])
    env.store.load(sess[0], 2, [b"a", b"b"])
    assert env.stats()["entries_pinned"] == 2
    with err(ErrorCode.CONFLICT):
        env.store.load(sess[1], 2, [b"a"])
    assert env.stats()["entries_pinned"] == 0
    with err(ErrorCode.ABORTED):
        env.store.release(sess[0], 2)
    with err(ErrorCode.CONFLICT):
        env.store.store(sess[0], 1, [b"a", b"b"])   # finished store job: id not reused


def test_job_kind_mismatch_on_commit_release(env):
    sess = env.engine("e", 1)
    env.store.store(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.release(sess[0], 1)
    env.store.commit(sess[0], 1, True)
    env.store.load(sess[0], 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.commit(sess[0], 2, True)
    env.store.release(sess[0], 2)

# ---------------------------------------------------------------------------- aborts and timeouts
def test_failed_vote_aborts_and_frees(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[1], 1, [b"a", b"b"])
    st_.store(sess[0], 1, [b"a", b"b"])
    assert env.stats()["pages_used"] == 2
    st_.commit(sess[0], 1, False)
    assert env.stats()["pages_used"] == 0 and env.stats()["entries_writing"] == 0
    assert st_.lookup(sess[0], [b"a"]) == 0
    assert st_.job_states(sess[1], [1])[0]["cause"] == "vote_failed"
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    with err(ErrorCode.ABORTED):
        st_.store(sess[1], 1, [b"a", b"b"])
    st_.verify()


def test_non_writer_failed_vote_fences_until_writer_commits(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.store(sess[1], 1, [b"a"])
    st_.commit(sess[1], 1, False)                    # a non-writer may vote no
    assert env.stats()["pages_fenced"] == 1
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    assert env.stats()["pages_used"] == 0


def test_store_job_timeout_aborts_and_fences_the_writers_pages(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a", b"b"])              # the writer holds pages, rank 1 never votes
    env.clock.advance(TIMEOUT - 0.5)
    st_.expire()
    assert st_.job_states(sess[0], [1])[0]["state"] == "open"
    env.clock.advance(1.0)
    nxt = st_.expire()
    assert st_.job_states(sess[0], [1])[0] == {"job": 1, "kind": "store", "state": "aborted", "cause": "timeout"}
    assert st_.jobs.aborted["timeout"] == 1
    assert env.stats()["entries_writing"] == 0 and env.stats()["pages_fenced"] == 2
    assert nxt is None                               # no timer on pages a living writer holds
    st_.verify()
    with err(ErrorCode.TIMEOUT):
        st_.store(sess[1], 1, [b"a", b"b"])
    with err(ErrorCode.TIMEOUT):
        st_.commit(sess[0], 1, True)                 # late writer: told, and its pages freed
    assert env.stats()["pages_used"] == 0 and env.stats()["pages_fenced"] == 0
    with err(ErrorCode.TIMEOUT):
        st_.commit(sess[0], 1, True)                 # still a precise error from the tombstone
    st_.verify()


def test_store_job_timeout_without_writer_frees_at_once(env):
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[1], 1, [b"a"])                    # the vote, but the writer never came
    assert env.stats()["pages_used"] == 1
    env.clock.advance(TIMEOUT + 1)
    st_.expire()
    assert env.stats()["pages_used"] == 0
    with err(ErrorCode.TIMEOUT):
        st_.store(sess[0], 1, [b"a"])


def test_an_attached_writers_pages_stay_fenced_however_long_it_stalls(env):
    """Issue 10 item 2: the old quarantine ended one job_timeout after the abort, while the writer
    lived; its late copy then landed in another entry. Now only its commit (or bye, or death)
    gives the pages back."""
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    env.clock.advance(TIMEOUT + 1)
    st_.expire()
    for _ in range(5):
        env.clock.advance(TIMEOUT)
        assert st_.expire() is None
        assert env.stats()["pages_fenced"] == 1 and env.stats()["fenced_pages"]["writer_alive"] == 1
    assert env.stats()["fence_oldest_seconds"] >= 5 * TIMEOUT
    with err(ErrorCode.TIMEOUT):
        st_.commit(sess[0], 1, True)
    stats = env.stats()
    assert stats["pages_fenced"] == 0 and stats["pages_used"] == 0
    assert stats["fence_released_pages"]["committed"] == 1 and stats["fence_oldest_seconds"] == 0
    st_.verify()


def test_load_job_timeout_drops_pins(env):
    sess = env.engine("e", 2)
    st_ = env.store
    env.put(sess, 1, [b"a", b"b"])
    st_.load(sess[0], 2, [b"a", b"b"])
    st_.load(sess[1], 2, [b"a", b"b"])
    st_.release(sess[1], 2)
    assert env.stats()["entries_pinned"] == 2
    env.clock.advance(TIMEOUT + 1)
    st_.expire()
    assert env.stats()["entries_pinned"] == 0 and env.stats()["evictable"] == 2
    with err(ErrorCode.TIMEOUT):
        st_.release(sess[0], 2)
    assert st_.lookup(sess[0], [b"a", b"b"]) == 2    # the entries themselves stay
    st_.verify()


def test_job_ids_are_not_reused(env):
    sess = env.engine("e", 1)
    st_ = env.store
    env.put(sess, 1, [b"a"])
    env.get(sess, 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.store(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.load(sess[0], 1, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.load(sess[0], 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        st_.commit(sess[0], 1, True)
    with err(ErrorCode.CONFLICT):
        st_.release(sess[0], 2)
    with err(ErrorCode.CONFLICT):
        st_.abort(sess[0], 1)
    with err(ErrorCode.UNKNOWN_JOB):
        st_.commit(sess[0], 99, True)
    with err(ErrorCode.UNKNOWN_JOB):
        st_.release(sess[0], 99)
    with err(ErrorCode.UNKNOWN_JOB):
        st_.abort(sess[0], 99)
    assert st_.job_states(sess[0], [1, 2, 99]) == [
        {"job": 1, "kind": "store", "state": "done", "cause": ""},
        {"job": 2, "kind": "load", "state": "done", "cause": ""},
        {"job": 99, "state": "unknown"},
    ]
    # job ids are per engine
    other = env.engine("o", 1)
    out, _ = env.put(other, 1, [b"b"])
    assert list(out) == [W]


def test_a_fenced_job_id_stays_taken_after_its_tombstone_is_dropped(env):
    env.store.jobs.max_tombstones = 2
    sess = env.engine("e", 2)
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.abort(sess[1], 1)                            # fenced: rank 0 may still be copying
    for j in range(2, 6):                            # push job 1's tombstone out
        env.put(sess, j, [f"x{j}".encode()])
    assert (sess[0].engine.serial, 1) not in st_.jobs.tombstones
    with err(ErrorCode.ABORTED):
        st_.store(sess[1], 1, [b"b"])                # not a new job over the fenced one
    with err(ErrorCode.ABORTED):
        st_.load(sess[1], 1, [b"b"])
    st_.verify()
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, True)
    assert env.stats()["pages_fenced"] == 0
    st_.verify()


def test_a_writer_cannot_store_a_job_again_after_its_commit():
    """Issue 26 A: a writer's store after its own commit re-handed its pages (fenced again for a
    job about to be READY); the settled job stayed in the engine's table waiting for a second
    commit, its cost already returned to the bounds (a leak), and a later request naming it
    answered INTERNAL ('NoneType' object has no attribute 'value')."""
    env = small(512)
    sess = env.engine("e", 2)
    st_ = env.store
    for job in range(1, 101):
        ks = keys(f"j{job}_", 4)
        st_.store(sess[0], job, ks)
        st_.commit(sess[0], job, True)
        with err(ErrorCode.CONFLICT) as refused:
            st_.store(sess[0], job, ks)
        assert "already committed" in refused.value.message
        st_.store(sess[1], job, ks)                  # rank 1 votes last: the job is done
        st_.verify()                                 # no fence mark left on the READY pages
        with err(ErrorCode.CONFLICT):
            st_.commit(sess[0], job, True)
        with err(ErrorCode.CONFLICT):
            st_.store(sess[0], job, ks)
    stats = env.stats()
    assert (stats["jobs_held"], stats["open_jobs"], stats["open_job_keys"]) == (0, 0, 0)
    assert stats["entries_ready"] == 400 and stats["pages_fenced"] == 0
    assert not sess[0].engine.jobs


def test_release_before_load_is_conflict(env):
    sess = env.engine("e", 2)
    env.put(sess, 1, [b"a"])
    env.store.load(sess[0], 2, [b"a"])
    with err(ErrorCode.CONFLICT):
        env.store.release(sess[1], 2)
    env.get(sess, 2, [b"a"])

# ---------------------------------------------------------------------------- the page fence
def fence_setup(num_pages=8):
    env = small(num_pages)
    sess = env.engine("e", 2)
    _, pg = env.store.store(sess[0], 1, keys("q", 3))   # the writer has its pages, is copying
    held = set(pages(pg))
    env.store.abort(sess[1], 1)
    assert env.stats()["pages_fenced"] == 3
    return env, sess, held


def fill_other(env: Env, job: int, n: int) -> tuple[bytes, set]:
    other = env.store.jobs.engines.get("o")
    other = list(other.ranks.values()) if other else env.engine("o", 1, model="O")
    out, got = env.put(other, job, keys(f"o{job}_", n))
    return out, set(pages(got[0]))


def test_fenced_pages_not_reused_until_writer_commits():
    env, sess, held = fence_setup()
    out, used = fill_other(env, 1, 8)
    assert list(out) == [W] * 5 + [N] * 3
    assert not used & held
    env.store.verify()
    with err(ErrorCode.ABORTED):
        env.store.commit(sess[0], 1, True)
    assert env.stats()["pages_fenced"] == 0 and env.stats()["pages_free"] == 3
    out, used = fill_other(env, 2, 3)
    assert list(out) == [W] * 3 and used == held
    env.store.verify()


@pytest.mark.parametrize("end", [SessionEnd.DIED, SessionEnd.LEFT, SessionEnd.REATTACHED])
def test_fenced_pages_freed_when_the_writer_ends_with_a_proof(end):
    env, sess, held = fence_setup()
    env.store.detach(sess[0], end)
    stats = env.stats()
    assert stats["pages_fenced"] == 0 and stats["pages_free"] == 8
    assert stats["fence_released_pages"][{SessionEnd.REATTACHED: "reattached"}.get(end, end.value)] == 3
    env.store.verify()


@pytest.mark.parametrize("end", [SessionEnd.HEARTBEAT_LOST, SessionEnd.TAKEN_OVER, SessionEnd.REHELLO,
                                 SessionEnd.DAEMON_STOPPED])
def test_a_writer_that_cannot_be_watched_keeps_its_pages_until_the_grace_period(end):
    """A lost heartbeat is not a proof of death (issue 10 item 3): the session's votes and pins
    end, its pages stay fenced until it re-attaches or the grace period passes since it was last
    seen. (The unit store's writers have no pid the daemon can see.)"""
    env, sess, held = fence_setup()
    grace = env.store.fence.grace
    seen = env.clock() - 2.0
    env.store.detach(sess[0], end, last_seen=seen)
    assert env.stats()["fenced_pages"] == {"writer_alive": 0, "restart_recovery": 0, "grace": 3, "unproven": 0}
    env.clock.advance(grace - 3.0)
    assert env.store.expire() == pytest.approx(seen + grace)
    assert env.stats()["pages_fenced"] == 3
    out, used = fill_other(env, 1, 8)
    assert not used & held
    env.clock.advance(1.5)
    env.store.expire()
    stats = env.stats()
    assert stats["pages_fenced"] == 0 and stats["fence_released_pages"]["grace"] == 3 and stats["writer_rows"] == 1
    env.store.verify()


def test_a_gone_writer_that_re_attaches_with_its_token_gets_its_pages_released():
    env, sess, held = fence_setup()
    session, token = sess[0].id, sess[0].token
    env.store.detach(sess[0], SessionEnd.HEARTBEAT_LOST)
    env.store.reattached(session, token ^ 1)         # someone else's guess: nothing
    assert env.stats()["pages_fenced"] == 3
    env.store.reattached(session, token)
    assert env.stats()["pages_fenced"] == 0 and env.stats()["fence_released_pages"]["reattached"] == 3
    env.store.verify()


def test_only_uncommitted_sharded_writers_keep_their_shard_fenced():
    env = small(16)
    sess = env.engine("e", 2, "sharded")
    st_ = env.store
    st_.store(sess[0], 1, [b"a"])
    st_.store(sess[1], 1, [b"a"])
    st_.commit(sess[1], 1, True)                     # rank 1 finished copying and voted
    st_.abort(sess[0], 1)
    assert env.stats()["pages_fenced"] == 1          # rank 0's shard: it may still be copying
    assert env.stats()["pages_used"] == 1            # rank 1's shard is free at once
    with err(ErrorCode.ABORTED):
        st_.commit(sess[0], 1, False)
    assert env.stats()["pages_fenced"] == 0
    st_.verify()


# ---------------------------------------------------------------------------- bounds (issue 11)
def test_open_job_keys_are_bounded_per_engine_and_in_all(env):
    jobs = env.store.jobs
    jobs.max_job_keys_per_engine, jobs.max_job_keys = 25, 40
    a, b = env.engine("a", 1), env.engine("b", 1)
    st_ = env.store
    st_.load(a[0], 1, keys("x", 9))              # costs 10
    st_.load(a[0], 2, keys("y", 9))              # 20
    with err(ErrorCode.LIMIT) as info:
        st_.load(a[0], 3, keys("z", 9))          # 30 > 25: refused before anything is allocated
    assert "max_job_keys_per_engine" in info.value.message
    st_.load(b[0], 1, keys("x", 14))             # 35 in all
    with err(ErrorCode.LIMIT) as info:
        st_.load(b[0], 2, keys("w", 5))          # 41 > 40
    assert "max_job_keys " in info.value.message
    assert env.stats()["open_job_keys"] == 35 and env.stats()["open_jobs"] == 3
    st_.release(a[0], 1)                         # a finished job gives its keys back
    st_.load(a[0], 3, keys("z", 9))
    st_.abort(b[0], 1)                           # so does an aborted one
    st_.load(b[0], 2, keys("w", 5))
    assert env.stats()["open_job_keys"] == 10 + 10 + 6
    for s, j in ((a[0], 2), (a[0], 3), (b[0], 2)):
        st_.release(s, j)
    assert env.stats()["open_job_keys"] == 0
    st_.verify()


def test_tombstones_are_bounded_in_all_and_go_with_their_engine(env):
    env.store.jobs.max_tombstones = 5
    a, b = env.engine("a", 1), env.engine("b", 1)
    for j in range(1, 5):
        env.get(a, j, [b"k"])
    for j in range(1, 4):
        env.get(b, j, [b"k"])
    assert env.stats()["tombstones"] == 5
    assert env.store.job_states(a[0], [1, 2, 3, 4])[:2] == [{"job": 1, "state": "unknown"},
                                                           {"job": 2, "state": "unknown"}]
    with err(ErrorCode.CONFLICT):
        env.store.load(b[0], 3, [b"k"])          # b's latest is remembered
    env.store.detach(a[0])                       # a leaves: its tombstones are never matched again
    a = env.engine("a", 1)
    hits, _ = env.get(a, 4, [b"k"])              # a restarted engine may count job ids from 0
    assert hits == 0
    env.store.verify()


def test_the_deadline_heap_does_not_keep_every_finished_job(env):
    s = env.engine("e", 1)
    for j in range(20_000):
        env.get(s, j, [b"k"])
    assert len(env.store.jobs._deadlines) <= 4096 + 1
    env.store.load(s[0], 10 ** 6, [b"k"])
    env.clock.advance(TIMEOUT + 1)
    env.store.expire()
    assert env.store.job_states(s[0], [10 ** 6])[0]["state"] == "aborted"
    env.store.verify()

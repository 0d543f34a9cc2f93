"""kvtierd.tiering without a companion: the daemon's side of demote and promote, step by step.

The tier runs over a real store (``store_env``: a region in memory, a fake clock) and a scripted
link standing in for ``TierLink`` (``tier_env``): it records what the daemon asks and lets the
test answer — in time, late, failed, or with the companion gone. The companion, the engines and
the bytes are tested for real in tests/tier/. Every scenario checks the store's own consistency
(``verify``: pages, the policy, the fence table against the companion's writer row).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.protocol import PAGES_DTYPE, encode
from kvtierd.tier.backend import TierTimeout, TierUnavailable
from kvtierd.tier.keys import identity
from kvtierd.tiering.promote import ABSENT_SECONDS, CHECK_DELAY, PATIENCE

from .store_env import keys, pages
from .tier_env import TierEnv

W, P = StoreOutcome.WRITE, StoreOutcome.PRESENT


def slots(tenv, s, ks: list[bytes]) -> np.ndarray:
    """The entry slots of ``ks`` in ``s``'s namespace (each key must have an entry)."""
    found = tenv.store.index.find(s.engine.ns, ks)
    assert (found >= 0).all(), ks
    return found


def entry_pages(tenv, s) -> set[int]:
    """Every page of every entry of ``s``'s namespace."""
    index = tenv.store.index
    return set(pages(index.pages_of(s.engine.ns, index.slots_of(s.engine.ns))))


@pytest.fixture
def tenv():
    e = TierEnv()
    yield e
    e.store.verify()
    encode(e.store.stats())                 # the stats reply's part: plain values the wire can carry


# ------------------------------------------------------------------------------------------ demote
def test_victims_are_demoted_before_their_pages_are_reused_then_freed(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 26))             # 26 of 32 pages: below the 25 % reserve (8 pages)
    tenv.pump()
    rid, put = tenv.link.last("put")
    victims = put["keys"]                        # the policy's first two (a chain: its tail first)
    assert len(victims) == 2 and put["length"] == 4096 and put["shards"] == 1
    assert put["ns"] == identity(s.engine.ns.id)
    assert pages(put["pages"]) == pages(tenv.store.index.pages_of(s.engine.ns, slots(tenv, s, victims)))
    stats = tenv.tier.stats()
    assert stats["demoting_blocks"] == 2 and tenv.stats()["entries_pinned"] == 2
    # Pinned for the demote: still READY and loadable, but no store takes their pages.
    assert tenv.lookup(s, victims[:1]) == (1, 0)
    tenv.put([s], 2, keys("n", 10))              # needs room now: evicts other victims, not the pinned
    assert tenv.ready(s, victims[0]) and tenv.ready(s, victims[1])
    assert tenv.tier.stats()["demote_dropped_blocks"]["pressure"] == 4
    tenv.link.answer(rid, done=b"\x01\x01")
    tenv.pump()
    # The first was looked up meanwhile (used: it stays); the other was not: freed, and in the tier.
    assert tenv.ready(s, victims[0]) and not tenv.ready(s, victims[1])
    assert tenv.tier.copies.held[slots(tenv, s, victims[:1])].all()
    stats = tenv.tier.stats()
    assert stats["demoted_blocks"] == 2 and stats["demoted_bytes"] == 2 * 4096
    assert stats["demoting_blocks"] == len(tenv.link.last("put")[1]["keys"])     # the next pass is under way


def test_a_block_the_tier_holds_is_freed_without_a_second_put(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 26))
    tenv.tier.copies.held[tenv.store.index.slots_of(s.engine.ns)] = True    # promoted, or demoted before
    tenv.pump()
    assert [op for _, op, _ in tenv.link.sent] == ["stats"]             # no put
    assert tenv.store.index.pages.free_count == 8                       # the reserve, freed ahead of need
    assert tenv.stats()["evictions"] == 2


def test_a_failed_put_drops_its_blocks_and_pauses_demotes(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 26))
    tenv.pump()
    rid, _ = tenv.link.last("put")
    tenv.link.answer(rid, ok=False, error=TierUnavailable("down"))
    tenv.pump()
    stats = tenv.tier.stats()
    assert stats["demote_dropped_blocks"]["failed"] == 2 and stats["demoted_blocks"] == 0
    assert stats["errors"] == [{"op": "put", "code": "unavailable", "calls": 1}]
    sent = len(tenv.link.sent)
    tenv.put([s], 2, keys("n", 4))
    tenv.pump()
    assert len(tenv.link.sent) == sent           # paused for the cooldown
    tenv.clock.advance(5.1)
    tenv.pump()
    assert "put" in [op for _, op, _ in tenv.link.sent[sent:]]


def test_a_put_past_its_deadline_keeps_its_pins_until_its_end(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 26))
    tenv.pump()
    rid, _ = tenv.link.last("put")
    tenv.link.answer(rid, ok=False, final=False, error=TierTimeout("late"))
    tenv.pump()
    assert tenv.stats()["entries_pinned"] == 2                # the companion may still read them
    tenv.link.answer(rid, done=b"\x01\x01")
    tenv.pump()
    assert tenv.stats()["entries_pinned"] == 0 and tenv.tier.stats()["demoted_blocks"] == 2
    assert tenv.tier.stats()["errors"] == [{"op": "put", "code": "timeout", "calls": 1}]


@pytest.mark.parametrize("commit_first", [False, True])
def test_a_demote_pass_takes_the_policy_s_first_ready_victims_not_the_oldest_blocks(commit_first):
    """What ``kvtierbench.tier`` relies on (its fourth 64 KiB Mooncake repetition once waited 300 s
    for a block node A never demoted). A region of 2N pages with a 50 % reserve holds X (N blocks);
    a store of N more takes the last free pages, and the next pass demotes N victims. slru puts a
    block whose key its sketch remembers (here: stored and evicted before; in the bench, a false
    positive of the sketch for a fresh key) in protected, after probation's. While the store is
    WRITING, X are the only READY blocks: the pass takes all of X. Committed before the pass, the
    store's blocks are victims too, and one of them goes to the tier instead of that block of X."""
    tenv = TierEnv(low_watermark=0.5)
    (s,) = tenv.engine("e")
    x, trigger = keys("x", 16), keys("t", 16)
    tenv.put([s], 1, x[5:6])
    assert tenv.store.index.evict(None, None) == 1          # gone, but the policy remembers its key
    tenv.put([s], 2, x)
    assert tenv.store.index.pages.free_count == 16 and not [op for _, op, _ in tenv.link.sent if op == "put"]
    assert list(tenv.store.store(s, 3, trigger)[0]) == [W] * 16     # the last free pages
    if commit_first:
        tenv.store.commit(s, 3, True)
    tenv.pump()
    rid, put = tenv.link.last("put")
    if commit_first:
        assert x[5] not in put["keys"] and len(set(put["keys"]) & set(trigger)) == 1
    else:
        assert sorted(put["keys"]) == sorted(x)
        tenv.store.commit(s, 3, True)
    tenv.link.answer(rid, done=b"\x01" * 16)
    tenv.pump()
    assert tenv.tier.stats()["demoted_blocks"] == 16
    assert tenv.ready(s, x[5]) == commit_first               # the block of X the tier never got


def test_evictions_while_the_tier_is_down_or_busy_are_counted_so(tenv):
    (s,) = tenv.engine("e")
    tenv.link.state = "down"
    tenv.put([s], 1, keys("k", 32))
    tenv.put([s], 2, keys("n", 2))
    assert tenv.tier.stats()["demote_dropped_blocks"]["down"] == 2
    tenv.link.state = "ready"
    tenv.link.max_inflight = 0
    tenv.put([s], 3, keys("m", 2))
    assert tenv.tier.stats()["demote_dropped_blocks"]["busy"] == 2


def test_an_excluded_model_is_never_demoted_nor_checked():
    tenv = TierEnv(exclude=frozenset({"private"}))
    (s,) = tenv.engine("e", model="private")
    tenv.put([s], 1, keys("k", 30))
    tenv.pump()
    assert tenv.link.sent == [(1, "stats", {})]
    assert tenv.lookup(s, keys("x", 3)) == (0, 0)
    tenv.put([s], 2, keys("n", 4))
    assert sum(tenv.tier.stats()["demote_dropped_blocks"].values()) == 0


def test_a_sharded_entry_is_demoted_whole_shards_back_to_back():
    tenv = TierEnv(num_pages=64)
    sess = tenv.engine("e", 2, kind="sharded", block_bytes=4096 + 100)    # 2 pages per shard, 4 per entry
    tenv.put(sess, 1, keys("k", 14))
    tenv.pump()
    _, put = tenv.link.last("put")
    assert put["shards"] == 2 and put["length"] == 4096 + 100
    assert len(put["pages"]) == len(put["keys"]) * 4 * 4


# ------------------------------------------------------------------------------------------ promote
def test_a_miss_is_checked_then_promoted_and_reported_pending_until_ready(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 2))
    ks = keys("k", 2) + keys("t", 4) + [b"absent"] + keys("u", 2)
    assert tenv.lookup(s, ks) == (2, 7)                      # checking the 7 after the hits
    rid, exists = tenv.link.last("exists")
    assert exists["keys"] == ks[2:]
    assert tenv.lookup(s, ks) == (2, 7)                      # still being checked: no second check
    assert len([x for x in tenv.link.sent if x[1] == "exists"]) == 1
    tenv.link.answer(rid, present=b"\x01\x01\x01\x01\x00\x01\x01")
    tenv.pump()
    rid, get = tenv.link.last("get")
    assert get["keys"] == keys("t", 4)                       # the leading run the tier holds
    assert tenv.tier.stats()["promoting_blocks"] == 4 and tenv.stats()["pages_fenced"] == 0
    fence = tenv.store.fence
    row = tenv.tier.companion.writer.row
    assert sorted(np.flatnonzero(fence.table == row).tolist()) == sorted(
        np.frombuffer(get["pages"], PAGES_DTYPE).tolist())  # fenced for the companion before it was asked
    assert tenv.lookup(s, ks) == (2, 4)                      # promoting; "absent" ends the run
    # An engine storing a key being promoted finds it present (one writer at a time).
    (w,) = tenv.engine("w")
    assert list(tenv.store.store(w, 1, [b"t0"])[0]) == [P]
    tenv.link.answer(rid, done=b"\x01\x01\x01\x01")
    tenv.pump()
    assert tenv.lookup(s, ks) == (6, 0)                      # "absent" is remembered: no new check
    assert tenv.tier.copies.held[slots(tenv, s, keys("t", 4))].all()
    assert not (fence.table == row).any()
    stats = tenv.tier.stats()
    assert stats["promoted_blocks"] == 4 and stats["lookup_keys"] == {"hit": 6, "miss": 1}
    tenv.clock.advance(ABSENT_SECONDS + 0.01)
    assert tenv.lookup(s, ks) == (6, 3)                      # checked again once forgotten


def promoting(tenv, s, ks: list[bytes]) -> tuple[int, np.ndarray]:
    """A miss of ``ks`` the tier holds, checked and sent to it as a get: the get's id and pages."""
    tenv.lookup(s, ks)
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, present=b"\x01" * len(ks))
    tenv.pump()
    rid, get = tenv.link.last("get")
    return rid, np.frombuffer(get["pages"], PAGES_DTYPE)


def test_a_promote_past_its_deadline_is_a_miss_and_its_pages_stay_fenced_until_the_end(tenv):
    (s,) = tenv.engine("e")
    ks = keys("t", 3)
    rid, fenced = promoting(tenv, s, ks)
    tenv.link.answer(rid, ok=False, final=False, error=TierTimeout("late"))
    tenv.pump()
    assert tenv.lookup(s, ks) == (0, 0)                      # aborted: gone, and not asked again soon
    stats = tenv.stats()
    assert stats["pages_fenced"] == 3 and stats["fenced_pages"]["writer_alive"] == 3
    assert tenv.tier.stats()["promote_aborted"] == {"tier_timeout": 1}
    # The region fills: no store gets the fenced pages.
    (w,) = tenv.engine("w")
    tenv.put([w], 1, keys("f", 40))
    assert not entry_pages(tenv, w) & set(fenced.tolist())
    tenv.link.answer(rid, done=b"\x01\x01\x01")               # it answered after all: the pages are free
    tenv.pump()
    assert tenv.stats()["pages_fenced"] == 0 and not tenv.ready(s, b"t0")


def test_the_companion_gone_mid_promote_releases_the_pages_and_a_new_one_gets_a_new_row(tenv):
    (s,) = tenv.engine("e")
    tenv.lookup(s, keys("t", 2))
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, present=b"\x01\x01")
    tenv.pump()
    first_row = tenv.tier.companion.writer.row
    tenv.link.die()
    tenv.pump()
    assert tenv.tier.companion.writer is None and tenv.stats()["pages_fenced"] == 0
    assert not tenv.ready(s, b"t0") and tenv.tier.stats()["promote_failed_blocks"] == 2
    assert tenv.lookup(s, keys("t", 2)) == (0, 0)             # no companion: nothing checked
    tenv.link.state, tenv.link.pid = "ready", os.getpid()
    tenv.pump()
    assert tenv.tier.companion.writer is not None and tenv.store.fence.writers[tenv.tier.companion.writer.row] is tenv.tier.companion.writer
    assert first_row not in tenv.store.fence.writers or tenv.tier.companion.writer.row == first_row


def test_a_killed_companion_keeps_its_row_and_pages_until_it_is_reaped(tenv):
    """Killed for not answering but not gone yet (stuck in the kernel on a hung disk): the link
    says ``killed`` and ends nothing; its row and the pages of its promote stay fenced, whatever
    the loop does meanwhile, and come back only once it is reaped."""
    (s,) = tenv.engine("e")
    rid, fenced = promoting(tenv, s, keys("t", 3))
    tenv.link.answer(rid, ok=False, final=False, error=TierTimeout("late"))
    row = tenv.tier.companion.writer.row
    tenv.link.state = "killed"                               # SIGKILLed, not reaped: same pid
    for _ in range(3):
        tenv.pump()
    assert tenv.tier.companion.writer.row == row and row in tenv.store.fence.writers
    assert tenv.stats()["pages_fenced"] == 3 and (tenv.store.fence.table[fenced] == row).all()
    (w,) = tenv.engine("w")
    tenv.put([w], 1, keys("f", 40))                          # the region fills: no store gets them
    assert not entry_pages(tenv, w) & set(fenced.tolist())
    tenv.link.die()                                          # reaped
    tenv.pump()
    assert tenv.tier.companion.writer is None and tenv.stats()["pages_fenced"] == 0


def test_a_failed_or_slow_check_costs_lookups_nothing(tenv):
    (s,) = tenv.engine("e")
    assert tenv.lookup(s, keys("a", 2)) == (0, 2)
    tenv.clock.advance(PATIENCE + 0.01)
    assert tenv.lookup(s, keys("a", 2)) == (0, 0)             # a slow check is not waited for
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, ok=False, error=TierUnavailable("down"))
    tenv.pump()
    assert tenv.lookup(s, keys("b", 2)) == (0, 0)             # checks pause for the cooldown
    tenv.clock.advance(5.1)
    assert tenv.lookup(s, keys("b", 2)) == (0, 2)


def test_a_busy_link_checks_nothing_and_promises_nothing(tenv):
    (s,) = tenv.engine("e")
    tenv.link.max_inflight = 0
    assert tenv.lookup(s, keys("a", 3)) == (0, 0)


def test_clear_reaches_the_tier_and_says_how_it_went(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 2))
    tenv.tier.copies.held[tenv.store.index.slots_of(s.engine.ns)] = True
    replies = []
    tenv.store.clear_tier(s.engine.ns.id.name(), lambda tier, n: replies.append((tier, n)))
    rid, fields = tenv.link.last("clear")
    assert fields == {"ns": identity(s.engine.ns.id)} and replies == []
    assert not tenv.tier.copies.held[tenv.store.index.slots_of(s.engine.ns)].any()     # their copies are going
    tenv.link.answer(rid, removed=5)
    tenv.pump()
    assert replies == [("removed", 5)] and tenv.tier.stats()["cleared_blocks"] == 5
    tenv.link.state = "down"
    tenv.store.clear_tier(None, lambda tier, n: replies.append((tier, n)))
    assert replies[-1] == ("failed", 0)


def test_close_releases_what_the_companion_was_handed(tenv):
    (s,) = tenv.engine("e")
    tenv.lookup(s, keys("t", 2))
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, present=b"\x01\x01")
    tenv.pump()
    tenv.store.shutdown()
    assert tenv.stats()["pages_fenced"] == 0 and not tenv.store.fence.writers
    assert tenv.store.index.pages.free_count == tenv.store.index.pages.total


def test_a_promoted_block_is_not_freed_ahead_of_need_before_an_engine_used_it(tenv):
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 22))
    tenv.lookup(s, keys("k", 22))                 # used: out of the first victims' segment
    tenv.lookup(s, keys("t", 2))
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, present=b"\x01\x01")
    tenv.pump()
    rid, _ = tenv.link.last("get")
    tenv.link.answer(rid, done=b"\x01\x01")
    tenv.pump()
    tenv.put([s], 2, keys("n", 6))                # 2 pages free: short of the reserve
    tenv.pump()
    # t0, t1 are the policy's first victims and in the tier, but nobody loaded them yet: they stay.
    assert tenv.ready(s, b"t0") and tenv.ready(s, b"t1")
    _, put = tenv.link.last("put")
    assert not {b"t0", b"t1"} & set(put["keys"])


def test_the_check_goes_out_after_the_reply(tenv):
    (s,) = tenv.engine("e")
    ks = keys("a", 3)
    assert tenv.store.pending(s, ks, tenv.store.lookup(s, ks)) == 3
    assert "exists" not in [op for _, op, _ in tenv.link.sent]        # the reply first
    assert tenv.tier.pump(tenv.clock()) == pytest.approx(CHECK_DELAY)   # the loop's next turn: not yet
    assert "exists" not in [op for _, op, _ in tenv.link.sent]
    assert tenv.store.pending(s, keys("b", 2), 0) == 2                # promised meanwhile: goes with it
    tenv.clock.advance(CHECK_DELAY)
    tenv.pump()
    assert [f["keys"] for _, op, f in tenv.link.sent if op == "exists"] == [ks, keys("b", 2)]


def test_the_data_file_replaced_ends_what_the_companion_had_and_restarts_it(tenv):
    # Server._replace_data: sessions end, then the tier (its companion maps the old file), then
    # Store.drop_all, whose Fence.reset needs no writer attached.
    from kvtierd.attachments import SessionEnd
    (s,) = tenv.engine("e")
    tenv.put([s], 1, keys("k", 4))
    tenv.lookup(s, keys("t", 2) + keys("u", 2))
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, present=b"\x01\x01\x01\x01")
    tenv.pump()
    late, _ = tenv.link.last("get")                          # a promote timed out: its pages stay parked
    tenv.link.answer(late, ok=False, final=False, error=TierTimeout("late"))
    tenv.pump()
    tenv.lookup(s, keys("v", 2))
    rid, _ = tenv.link.last("exists")
    tenv.link.answer(rid, present=b"\x01\x01")
    tenv.pump()                                              # and another one in flight
    assert tenv.stats()["pages_fenced"] == 4 and tenv.tier.stats()["promoting_blocks"] == 2
    row = tenv.tier.companion.writer.row
    tenv.store.detach(s, SessionEnd.REGION_REPLACED)
    tenv.tier.data_replaced()                                # the companion killed, not reaped yet
    assert tenv.tier.companion.writer is None and not tenv.tier.promotes.jobs
    assert tenv.store.drop_all() == 4                        # Fence.reset: nothing attached
    assert not (tenv.store.fence.table == row).any() and row not in tenv.store.fence.writers
    assert tenv.tier.stats()["promote_failed_blocks"] == 6 and tenv.stats()["pages_fenced"] == 0
    tenv.link.die()                                          # reaped: the link starts the next one
    tenv.pump()
    tenv.link.state, tenv.link.pid = "ready", os.getpid()    # the new companion, on the new file
    tenv.pump()
    assert tenv.tier.companion.writer is not None and tenv.store.fence.writers[tenv.tier.companion.writer.row] is tenv.tier.companion.writer

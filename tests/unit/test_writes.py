"""kvtierd.writes: invariant 9 proved once for every kind of writer — a page handed to a writer
goes to nobody else until that writer settled (said its copy is over), or is proven unable to
write — whoever the writer is (``WriterKind``: a rank copying its shard, the tier companion
copying whole entries) and whatever the namespace's layout.

Each scenario drives ``Writes`` over a real index and fence (a region in memory) and checks the
fence's table, the pages another write gets, and the store's own consistency (``verify``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.region_format import FENCE_NONE, EntryState
from kvtierd.fence import Release
from kvtierd.processes import Process
from kvtierd.writes import WriterKind

from .store_env import Env, keys, lay

W = StoreOutcome.WRITE
_IDS = itertools.count(1)


@pytest.fixture(params=list(WriterKind), ids=lambda k: k.value)
def kind(request) -> WriterKind:
    return request.param


@pytest.fixture(params=["replicated", "sharded"])
def env(request):
    """A store over a 32-page region and a namespace of the layout (2 pages per entry either way)."""
    e = Env(32)
    world = 2 if request.param == "sharded" else 1
    e.ns = e.store.index.namespace(lay(request.param, world, block_bytes=4096 * (1 if world == 2 else 2)))
    yield e
    e.store.verify()


def writer(env):
    return env.store.writes.add_writer(next(_IDS), 7, Process(), "writer", 0)


def handed(env, kind: WriterKind, ks: list[bytes]):
    """A write of ``ks`` and its writer, handed its pages: a rank its shard (rank 0: the whole entry
    of a replicated namespace, the first of two shards of a sharded one), the companion every shard."""
    writes = env.store.writes
    write, outcomes, _ = writes.begin(kind, next(_IDS), env.ns, ks)
    assert list(outcomes) == [W] * len(ks)
    w = writer(env)
    pages = writes.hand(write, 0, w, 0 if kind is WriterKind.RANK else None)
    return write, w, np.frombuffer(pages, PAGES_DTYPE)


def all_pages(env, write) -> np.ndarray:
    """Every page of the write's entries, every shard."""
    return np.frombuffer(env.store.index.pages_of(write.ns, write.slots), PAGES_DTYPE)


def entries(env) -> np.ndarray:
    """The slots of the namespace's live (WRITING or READY) entries."""
    return env.store.index.slots_of(env.ns)


def fenced_for(env, w) -> list[int]:
    return sorted(np.flatnonzero(env.store.fence.table == w.row).tolist())


def fill(env) -> set[int]:
    """Another write takes every page it can get (evicting everything evictable); its pages."""
    write, outcomes, _ = env.store.writes.begin(WriterKind.RANK, next(_IDS), env.ns, keys(f"fill{next(_IDS)}-", 16))
    got = set(all_pages(env, write).tolist())
    env.store.writes.complete(write)
    return got


def test_a_writer_s_pages_are_fenced_for_it_from_the_hand_until_it_settles(env, kind):
    writes = env.store.writes
    write, w, pages = handed(env, kind, keys("k", 3))
    assert fenced_for(env, w) == sorted(pages.tolist())      # before anyone named them to it
    whole = kind is WriterKind.TIER or env.ns.shards == 1
    assert len(pages) == (6 if whole else 3)                   # its share: the whole entries, or its shard
    env.store.verify()
    writes.settle(write, 0)
    assert fenced_for(env, w) == [] and (env.store.fence.table == FENCE_NONE).all()
    writes.complete(write)
    assert (env.store.index.states(entries(env)) == EntryState.READY).all()


def test_an_aborted_write_keeps_its_writer_s_pages_until_its_late_final(env, kind):
    writes = env.store.writes
    write, w, pages = handed(env, kind, keys("k", 3))
    others = sorted(set(all_pages(env, write).tolist()) - set(pages.tolist()))
    writes.abort(write)                                        # a timeout, a conflict, the tier's deadline...
    assert not len(entries(env)) and fenced_for(env, w) == sorted(pages.tolist())
    assert sorted(env.store.fence.parked_pages().tolist()) == sorted(pages.tolist())
    env.store.verify()
    got = fill(env)                                            # the region fills: none of its pages
    assert not got & set(pages.tolist()) and set(others) <= got  # (the shard nobody was handed is free at once)
    writes.settle(write, 0)                                    # the writer's copy is over after all
    assert fenced_for(env, w) == [] and len(env.store.fence.parked_pages()) == 0
    assert set(pages.tolist()) <= fill(env)


@pytest.mark.parametrize("proof", [None, Release.DIED, Release.LEFT])
def test_a_gone_writer_keeps_its_pages_without_a_proof_and_frees_them_with_one(env, kind, proof):
    writes = env.store.writes
    write, w, pages = handed(env, kind, keys("k", 3))
    writes.abort(write)
    assert writes.drop_writer(write, 0)                        # its session ended: no late final comes
    writes.writer_ended(w, proof, env.clock())
    if proof is None:                                          # a lost heartbeat, a closed socket: no proof
        assert fenced_for(env, w) == sorted(pages.tolist()) and writes.holds(w)
        assert not fill(env) & set(pages.tolist())
        env.clock.advance(env.store.fence.grace + 1)           # unwatchable: the grace is the last word
        env.store.expire()
    assert fenced_for(env, w) == [] and not writes.holds(w)
    assert set(pages.tolist()) <= fill(env)


def test_a_write_that_lands_in_part_frees_the_rest_at_once(env, kind):
    writes = env.store.writes
    write, w, pages = handed(env, kind, keys("k", 4))
    index = env.store.index
    lost = index.pages_of(env.ns, write.slots[[1, 3]])
    writes.settle(write, 0)
    ready = writes.complete(write, b"\x01\x00\x01\x00")
    assert index.keys_of(ready) == [b"k0", b"k2"] and sorted(index.keys_of(entries(env))) == [b"k0", b"k2"]
    assert set(np.frombuffer(lost, PAGES_DTYPE).tolist()) <= set(index.pages.free_ids().tolist())


def test_written_by_names_the_entries_each_open_write_of_a_kind_writes(env):
    """``written_by`` (what a lookup asks of every key it reports pending): True exactly for the
    WRITING entries of open writes of that kind — not another kind's, not once a write completed."""
    writes = env.store.writes
    tier, _, _ = writes.begin(WriterKind.TIER, next(_IDS), env.ns, keys("t", 3))
    rank, _, _ = writes.begin(WriterKind.RANK, next(_IDS), env.ns, keys("r", 2))
    unused = np.setdiff1d(np.arange(16), np.concatenate((tier.slots, rank.slots)))[:1]     # no entry's
    slots = np.concatenate((tier.slots, rank.slots, unused))
    assert writes.written_by(slots, WriterKind.TIER).tolist() == [True] * 3 + [False] * 3
    assert writes.written_by(slots, WriterKind.RANK).tolist() == [False] * 3 + [True] * 2 + [False]
    writes.complete(tier)
    assert not writes.written_by(tier.slots, WriterKind.TIER).any()       # READY now: no write's
    assert writes.written_by(rank.slots, WriterKind.RANK).all()
    writes.complete(rank)

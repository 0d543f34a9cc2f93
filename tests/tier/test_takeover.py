"""A namespace taken over while the tier companion still touches its pages (issue 26 case E), end
to end: real daemons sharing a real Redis Cluster (3 primaries), real rank processes, public
interfaces only (the namespace table is filled as an attacker would: tests/attacks.py).

The companion is frozen (SIGSTOP) with a put reading, or a get writing, pages of a namespace no
engine uses any more; the namespace table is filled up; a new model's engine attaches (its hello
takes a namespace slot over) and stores; then the companion resumes. Every block is checked by
content (tests/integration/ranks.py: a block's bytes derive from its key):

| what | test |
|---|---|
| a put reading: the blocks another node promotes from the tier hold their own bytes, not the new engine's | test_a_namespace_taken_over_mid_demote_never_puts_foreign_bytes_in_the_tier |
| a get writing: the new engine's READY blocks hold their own bytes, not the tier's | test_a_namespace_taken_over_mid_promote_never_gives_an_engine_the_tier_s_bytes |
"""

from __future__ import annotations

import math
import os
import signal

import pytest

from tests import attacks
from tests.integration.conftest import _rank_pool, ranks  # noqa: F401  (fixtures)
from tests.integration.ranks import RankProcess, all_call
from tests.integration.test_faults import wait_for
from tests.integration.test_tp_roundtrip import keys_for

from .daemons import BIG, connect, region_check, store, tier_stats
from .test_nodes import catch_promote, nodes  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tier():
    """A 3-primary Redis Cluster (the issue's reproduction) shared by the module's tests."""
    from .conftest import start_engine
    engine = start_engine("redis")
    yield "redis", engine
    engine.stop()


def fill_namespace_table(daemon, prefix: str) -> None:
    """Namespaces nobody uses, each holding a block, until the table is full."""
    left = 1024 - daemon.stats()["namespaces"]
    assert attacks.fill_namespaces(daemon.socket, left, prefix) == {"attached": left, "no_space": 0}


def wrong_blocks(procs: list[RankProcess], job: int, keys: list[bytes], first_block: int) -> int:
    """Load ``keys`` (every one must hit) and count the blocks that do not hold their own bytes."""
    procs[0].call("fill", block_ids=list(range(first_block, first_block + len(keys))), seed=999)
    (result,) = all_call(procs, "load", job=job, keys=keys, block_ids=list(range(first_block, first_block + len(keys))))
    assert result["ok"] and result["hits"] == len(keys), result
    held = procs[0].call("verify_keys", keys=keys, block_ids=list(range(first_block, first_block + len(keys))))
    return held.count(False)


def store_in_jobs(procs: list[RankProcess], keys: list[bytes], first_job: int, per: int = 16) -> int:
    job = first_job
    for start in range(0, len(keys), per):
        store(procs, job, keys[start:start + per], list(range(min(per, len(keys) - start))))
        job += 1
    return job


def test_a_namespace_taken_over_mid_demote_never_puts_foreign_bytes_in_the_tier(nodes, ranks):
    a = nodes("--tier-data-timeout", "60", "--tier-kill-after", "60", size="128MiB", low_watermark=0.5)
    b = nodes()
    ra, rb = ranks(1), ranks(1)
    connect(ra, a, "old-a", BIG, "takeover-old")
    pid = tier_stats(a)["pid"]
    old = keys_for("takeover-demote-old", math.ceil(a.stats()["pages_total"] / 2 / 16) + 8)
    os.kill(pid, signal.SIGSTOP)                        # frozen before the demote: its put stays in flight
    try:
        store_in_jobs(ra, old, 1)
        wait_for(lambda: tier_stats(a)["demoting_blocks"] > 0, 30, "a demote to be sent")
        all_call(ra, "close")                           # no engine uses the old model's namespace now
        fill_namespace_table(a, "takeover-demote")
        connect(ra, a, "new-a", BIG, "takeover-new")    # its hello takes a namespace slot over
        store_in_jobs(ra, keys_for("takeover-demote-new", 32), 100)
    finally:
        os.kill(pid, signal.SIGCONT)                    # the companion reads the pages of its put now
    wait_for(lambda: tier_stats(a)["demoting_blocks"] == 0 and tier_stats(a)["demoted_blocks"] > 0, 60,
             "the demote to finish")
    # Node B, an engine of the old model: every block of it the tier holds holds its own bytes.
    connect(rb, b, "old-b", BIG, "takeover-old")
    promoted = wrong = 0
    for job, key in enumerate(old, 1000):
        found = wait_for(lambda: (d := rb[0].call("lookup_detail", keys=[key]))["pending"] == 0 and d, 30,
                         "the tier's answer", every=0.01)
        if found["hits"]:                               # promoted: load it at once (B's region is small)
            promoted += 1
            wrong += wrong_blocks(rb, job, [key], 0)
    assert promoted, "no block of the old model was demoted"
    assert wrong == 0, f"{wrong} of {promoted} blocks promoted from the tier held another engine's bytes"
    for d in (a, b):
        assert region_check(d)["ok"] and d.stats()["pages_fenced"] == 0


def test_a_namespace_taken_over_mid_promote_never_gives_an_engine_the_tier_s_bytes(nodes, ranks):
    seeder = nodes(size="64MiB", low_watermark=0.5)
    b = nodes("--tier-data-timeout", "60", "--tier-kill-after", "60", "--no-tier-demote", size="128MiB")
    rs, rb = ranks(1), ranks(1)
    connect(rs, seeder, "seeder", BIG, "takeover-promote-old")
    connect(rb, b, "old-b", BIG, "takeover-promote-old")
    x, pid, _ = catch_promote(seeder, rs, b, rb, "takeover-promote")   # b's companion frozen mid-get
    new = keys_for("takeover-promote-new", 32)
    try:
        assert tier_stats(b)["promoting_blocks"] == 16
        all_call(rb, "close")                           # no engine uses the old model's namespace now
        fill_namespace_table(b, "takeover-promote")
        connect(rb, b, "new-b", BIG, "takeover-promote-new")   # its hello takes a namespace slot over
        store_in_jobs(rb, new, 100)
    finally:
        os.kill(pid, signal.SIGCONT)                    # the companion's get lands now
    wait_for(lambda: tier_stats(b)["promoting_blocks"] == 0, 60, "the promote to end")
    wrong = wrong_blocks(rb, 200, new[:16], 0) + wrong_blocks(rb, 201, new[16:], 0)
    assert wrong == 0, f"{wrong} of the new engine's {len(new)} READY blocks held the tier's bytes"
    stats = b.stats()
    assert region_check(b)["ok"] and stats["pages_fenced"] == 0, stats

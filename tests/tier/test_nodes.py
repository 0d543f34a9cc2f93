"""Two nodes sharing one second tier: real daemons, real rank processes, real engines on loopback.

Each node is a real kvtierd (its own directory and region) started with ``--tier-backend`` naming
one real engine (a Mooncake master and storage process, or a 3-node Redis Cluster) that both
nodes share; each engine is a real rank process (``tests/integration/ranks.py``: a kvtier.Client
with a CPU KV cache). Every block's bytes are derived from its key (and rank), so a block that
holds another key's bytes, or a mix, cannot pass.

| what | test |
|---|---|
| A stores, A's region fills, its blocks are demoted; B looks them up, they are promoted, B loads them byte-exact (replicated: TP=2 on A, TP=1 on B: one copy for every TP degree) | test_blocks_evicted_on_one_node_are_promoted_byte_exact_on_another |
| the same for a sharded namespace (every rank's shard travels in the one tier value) | test_a_sharded_entry_travels_whole |
| the tier killed mid-run: both nodes keep storing, loading and looking up; errors counted | test_the_tier_killed_mid_run_leaves_both_nodes_serving |
| node A restarted: its evicted blocks come back from the tier | test_a_restarted_node_finds_its_blocks_in_the_tier |
| another model's namespace never gets them; a namespace clear reaches the tier | test_another_namespace_never_gets_the_blocks_and_clear_reaches_the_tier |
| the companion SIGKILLed, frozen then resumed, frozen then killed by the daemon, mid-promote: no torn or foreign block becomes READY, nothing leaks | test_a_companion_fault_mid_promote_never_makes_a_torn_block_ready |
| the region's data file truncated (it is replaced) with the companion frozen mid-promote: the companion is killed, its job and fenced pages cleaned up, a new one maps the new file and promotes byte-exact into it | test_the_data_file_replaced_restarts_the_companion_on_the_new_file |
| values planted in the tier under a namespace's keys (the right bytes with a forged seal, a seal of another key, another namespace's sealed value) are never loaded; each is counted; a value sealed with the fleet's key is | test_values_planted_in_the_tier_are_never_loaded |
"""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import pytest

from kvtierbench.harness import HOLD_ALL
from kvtierd.contract.namespace import NamespaceId
from kvtierd.tier.backend import open_backend, page_extents
from kvtierd.tier.keys import Keyspace, identity
from kvtierd.tier.resp import command, key_slot, read_reply
from kvtierd.tier.seal import KEY_ID_BYTES, SealKey, Sealer
from tests.integration.conftest import _rank_pool, new_daemon, ranks  # noqa: F401  (fixtures)
from tests.integration.ranks import all_call, key_content
from tests.integration.test_faults import wait_for
from tests.integration.test_kvtierctl import ctl, ctl_json
from tests.integration.test_tp_roundtrip import keys_for

from .conftest import KEY, NETWORKED, OWNER, start_engine, write_key_file
from .daemons import (BIG, SMALL, connect, dropped, fill, layout, load_exact, promote, region_check, store, tier_stats,
                      wait_ready)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=NETWORKED)
def tier(request):
    """(kind, a real engine) shared by the module's tests of that backend."""
    engine = start_engine(request.param)
    yield request.param, engine
    engine.stop()


@pytest.fixture
def nodes(tier, tmp_path):
    """Factory: nodes(*extra_args, size=..., engine=...) → a ready daemon whose second tier is
    ``tier``'s engine (or the one given), all sealing with one key (as a fleet's nodes do). Their
    regions are sized to the tests' working sets, and one engine loads two fifths of one in a single
    job: like the bench's daemons, they let one engine hold the whole region (the shares of
    kvtierd.holds would cut those loads; tests/unit/test_holds.py and test_composition.py test them)."""
    kind, shared = tier
    started = []
    key = write_key_file(str(tmp_path))

    def start(*args: str, size: str = "16MiB", low_watermark: float = 0.25, engine=None):
        engine = engine or shared
        d = new_daemon("--tier-backend", kind, "--tier-address", engine.address, "--tier-low-watermark",
                       str(low_watermark), "--tier-timeout", "0.5", "--tier-cooldown", "1",
                       "--tier-restart-backoff", "0.5", "--tier-key-file", key, *HOLD_ALL, *args, size=size)
        started.append(d)
        d.start()
        wait_ready(d)
        return d

    yield start
    for d in started:
        d.cleanup()


# ------------------------------------------------------------------------------------------ the flow
def test_blocks_evicted_on_one_node_are_promoted_byte_exact_on_another(nodes, ranks):
    a, b = nodes(), nodes()
    ra, rb = ranks(2), ranks(1)
    connect(ra, a, "engine-a", SMALL, "tier-model")            # TP=2, replicated: one copy, rank 0 writes
    connect(rb, b, "engine-b", SMALL, "tier-model")            # TP=1: the same namespace
    x = keys_for("x", 8)
    store(ra, 1, x, list(range(8)))
    pages = a.stats()["pages_total"]
    fill(ra, a, "filler", 2 * pages, SMALL, 2)                 # twice the region: x are long evicted
    sa = tier_stats(a)
    assert sa["demoted_blocks"] >= 8 + 2 * pages - pages and dropped(sa) == 0, sa   # all but a region's worth
    first = rb[0].call("lookup_detail", keys=x + keys_for("never", 2))
    assert first == {"hits": 0, "pending": 10}                 # being checked: ask again
    answers = promote(rb[0], x)
    assert all(ans["hits"] + ans["pending"] == 8 for ans in answers[:-1]), answers   # never a miss meanwhile
    load_exact(rb, 100, x, list(range(8, 16)))
    sb = tier_stats(b)
    assert sb["promoted_blocks"] == 8 and sb["promote_failed_blocks"] == 0 and sb["lookup_keys"]["hit"] == 8
    assert sb["lookup_keys"]["miss"] == 2
    # The keys the tier does not hold are misses now (remembered: no new check, nothing pending).
    assert rb[0].call("lookup_detail", keys=x + keys_for("never", 2)) == {"hits": 8, "pending": 0}
    # Node A's engine, TP=2, gets them back too (promoted on A: every rank loads the one copy).
    promote(ra[0], x)
    load_exact(ra, 101, x, list(range(8, 16)))
    for d in (a, b):
        assert region_check(d)["ok"]
        assert d.stats()["pages_fenced"] == 0


def test_a_sharded_entry_travels_whole(nodes, ranks):
    a, b = nodes(low_watermark=0.5, size="8MiB"), nodes()       # half of a small region kept free
    procs = ranks(2)
    connect(procs, a, "engine-a", SMALL, "tier-sharded", "sharded")
    x = keys_for("sx", 6)
    store(procs, 1, x, list(range(6)), sharded=True)
    fill(procs, a, "filler", a.stats()["pages_total"] // 2, SMALL, 2, sharded=True)
    assert tier_stats(a)["demoted_blocks"] >= 6 and dropped(tier_stats(a)) == 0
    all_call(procs, "close")
    connect(procs, b, "engine-b", SMALL, "tier-sharded", "sharded")
    promote(procs[0], x)
    load_exact(procs, 2, x, list(range(6, 12)), sharded=True)     # each rank its own shard, exact
    assert tier_stats(b)["promoted_bytes"] == 6 * 2 * SMALL.block_bytes()


# ------------------------------------------------------------------------------------------ failures
def test_the_tier_killed_mid_run_leaves_both_nodes_serving(nodes, ranks, tier):
    engine = start_engine(tier[0])                             # its own: it is killed
    try:
        a = nodes("--tier-data-timeout", "2", "--tier-kill-after", "2", engine=engine)
        b = nodes(engine=engine)
        ra, rb = ranks(1), ranks(1)
        connect(ra, a, "engine-a", SMALL, "tier-down")
        connect(rb, b, "engine-b", SMALL, "tier-down")
        x = keys_for("before", 8)
        store(ra, 1, x, list(range(8)))
        engine.kill()                                          # the whole tier, mid-run
        # Both nodes keep serving from their regions: stores, loads, lookups, all answered.
        job = 2
        for round_ in range(3):
            for procs, d in ((ra, a), (rb, b)):
                keys = keys_for(f"during-{round_}-{d.name}-{d.dir}", 8)
                store(procs, job, keys, list(range(8)))
                load_exact(procs, job + 1, keys, list(range(8, 16)))
                job += 2
                ans = procs[0].call("lookup_detail", keys=keys + keys_for(f"unknown-{round_}", 4), timeout=20)
                assert ans["hits"] == 8, ans
        load_exact(ra, job, x, list(range(8, 16)))
        # A's region fills: its victims cannot be demoted; they are evicted and counted, never waited for.
        fill_fast(ra, a, "after", 2 * a.stats()["pages_total"], job + 1)
        # The errors are counted, the lookups stop checking (nothing stays pending), nothing is fenced.
        wait_for(lambda: tier_stats(a)["errors"] and tier_stats(b)["errors"], 30, "tier errors counted")
        wait_for(lambda: rb[0].call("lookup_detail", keys=keys_for("late", 4))["pending"] == 0, 30,
                 "lookups to stop waiting for a dead tier")
        sa = tier_stats(a)
        assert dropped(sa) > 0, sa
        for d in (a, b):
            assert d.stats()["pages_fenced"] == 0
            assert region_check(d)["ok"]
    finally:
        engine.stop()


def fill_fast(procs, daemon, prefix: str, blocks: int, first_job: int) -> None:
    """Store ``blocks`` new blocks without waiting for demotes (a dead tier gets none done)."""
    per = SMALL.num_blocks
    for i, start in enumerate(range(0, blocks, per)):
        store(procs, first_job + i, keys_for(f"{prefix}-{start}", per), list(range(per)))


def test_a_restarted_node_finds_its_blocks_in_the_tier(nodes, ranks):
    a = nodes()
    ra = ranks(1)
    connect(ra, a, "engine-a", SMALL, "tier-restart")
    x = keys_for("restart", 8)
    store(ra, 1, x, list(range(8)))
    pages = a.stats()["pages_total"]
    job = fill(ra, a, "filler", 2 * pages, SMALL, 2)
    kept = keys_for(f"filler-{(2 * pages - 1) // 16 * 16}", 2 * pages - (2 * pages - 1) // 16 * 16)
    all_call(ra, "close")
    a.stop()                                   # SIGTERM: a clean restart
    a.start()
    wait_ready(a)
    connect(ra, a, "engine-a", SMALL, "tier-restart")
    assert ra[0].call("lookup", keys=kept) == len(kept)      # the region's own blocks came through
    promote(ra[0], x)                                        # the evicted ones come from the tier
    load_exact(ra, job, x, list(range(8)))
    assert tier_stats(a)["promoted_blocks"] == 8


def test_another_namespace_never_gets_the_blocks_and_clear_reaches_the_tier(nodes, ranks):
    a, b = nodes(low_watermark=0.5, size="8MiB"), nodes()
    ra, rb = ranks(1), ranks(1)
    connect(ra, a, "engine-a", SMALL, "model-one")
    x, y = keys_for("ns-x", 8), keys_for("ns-y", 8)
    store(ra, 1, x, list(range(8)))
    store(ra, 2, y, list(range(8, 16)))
    fill(ra, a, "filler", a.stats()["pages_total"], SMALL, 3)   # x and y are the first victims
    assert tier_stats(a)["demoted_blocks"] >= 16 and dropped(tier_stats(a)) == 0
    # Another model with the very same keys and geometry: never a hit, never pending for long.
    connect(rb, b, "engine-b", SMALL, "model-two")
    answers = [rb[0].call("lookup_detail", keys=x) for _ in range(5)]
    wait_for(lambda: rb[0].call("lookup_detail", keys=x) == {"hits": 0, "pending": 0}, 10, "a plain miss")
    assert all(ans["hits"] == 0 for ans in answers)
    assert tier_stats(b)["promoted_blocks"] == 0 and tier_stats(b)["lookup_keys"]["hit"] == 0
    # The model's own engine on B gets them.
    all_call(rb, "close")
    connect(rb, b, "engine-b1", SMALL, "model-one")
    promote(rb[0], x)
    load_exact(rb, 3, x, list(range(8)))
    # A namespace clear (kvtierctl, admin socket) empties the namespace in the tier too, and says so.
    name = NamespaceId(**layout(SMALL, "model-one")).name()
    said = ctl(a, "clear", "--namespace", name)
    removed = re.search(r"; (\d+) blocks removed from the second tier", said)
    assert removed and int(removed.group(1)) >= 8, said
    evict = a.call("evict", admin=True, namespace=name, count=1)
    assert evict["tier"] == "local" and evict["tier_removed"] is None
    status = ctl_json(a, "status")["tier"]
    assert status["state"] == "ready" and status["demoted_blocks"] >= 16 and status["errors"] == 0, status
    time.sleep(1.2)                                          # past what B remembers as checked
    wait_for(lambda: rb[0].call("lookup_detail", keys=y) == {"hits": 0, "pending": 0}, 10, "y gone from the tier")
    assert tier_stats(b)["promoted_blocks"] == 8


FAULTS = ("kill", "freeze_resume", "freeze_killed")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_companion_fault_mid_promote_never_makes_a_torn_block_ready(nodes, ranks, fault):
    """The companion is handed a promote's pages, then: SIGKILLed (kill); SIGSTOPped past the get's
    deadline, the region refilled by an engine while the job's pages stay fenced, then resumed so
    that it writes into them after all (freeze_resume); SIGSTOPped until the daemon kills it
    (freeze_killed). Every block loaded afterwards holds its own key's bytes; nothing stays fenced."""
    kill_after = "60" if fault == "freeze_resume" else "1"
    seeder = nodes(size="64MiB", low_watermark=0.5)
    b = nodes("--tier-data-timeout", "1", "--tier-kill-after", kill_after, "--no-tier-demote", size="40MiB")
    rs, rb = ranks(1), ranks(1)
    connect(rs, seeder, "seeder", BIG, "tier-big")
    connect(rb, b, "engine-b", BIG, "tier-big")
    x, pid, promoted = catch_promote(seeder, rs, b, rb, f"fault-{fault}",
                                     signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        if fault == "freeze_resume":
            wait_for(lambda: tier_stats(b)["promote_aborted"].get("tier_timeout"), 30, "the promote to time out")
            st = b.stats()
            assert st["pages_fenced"] == 16 * 16 and st["fenced_pages"]["writer_alive"] == 16 * 16, st
            assert rb[0].call("lookup_detail", keys=x)["hits"] == 0      # aborted: a miss, not READY
            # Refill the region while the pages stay fenced: no store may get them.
            job = 100
            for i in range(3):
                keys = keys_for(f"refill-{i}", 16)
                store(rb, job, keys, list(range(16)))
                assert rb[0].call("lookup", keys=keys) == 16
                load_exact(rb, job + 1, keys, list(range(16, 32)))
                job += 2
            os.kill(pid, signal.SIGCONT)                 # its late copy lands in the fenced pages only
        else:                                            # dead, or killed by the daemon: a new one starts
            wait_for(lambda: tier_stats(b)["pid"] not in (None, pid), 30, "a new companion")
        wait_for(lambda: b.stats()["pages_fenced"] == 0, 30, "the fenced pages to be released")
        wait_ready(b)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if fault == "freeze_resume":
        for i in range(3):                               # what the refill stored is still exact
            keys = keys_for(f"refill-{i}", 16)
            hits = rb[0].call("lookup", keys=keys)
            if hits:
                load_exact(rb, 200 + i, keys[:hits], list(range(16, 16 + hits)))
    st = tier_stats(b)
    assert st["promote_failed_blocks"] == 16 and st["promoted_blocks"] == promoted, st
    if fault != "freeze_resume":
        assert st["restarts"] >= 1 and st["pid"] != pid
    # The blocks are promoted again by the next lookups, and exact.
    time.sleep(1.1)                                      # what B remembers as failed expires
    promote(rb[0], x, timeout=60)
    load_exact(rb, 300, x, list(range(16, 32)))
    assert b.stats()["pages_fenced"] == 0 and region_check(b)["ok"]


def catch_promote(seeder, rs: list[RankProcess], b, rb: list[RankProcess], prefix: str,
                  sig: int = signal.SIGSTOP) -> tuple[list[bytes], int, int]:
    """16 BIG blocks stored through ``seeder`` (its engine on ``rs``) and demoted, then looked up
    on ``b`` (its engine on ``rb``), and ``sig`` sent to b's companion while their get is in
    flight: its pages are fenced for the companion then. Up to 5 attempts (a get that finished
    before the signal does not count). Returns (the keys, the companion's pid, b's promoted
    blocks before them)."""
    job = 1
    for attempt in range(5):
        x = keys_for(f"{prefix}-{attempt}", 16)
        store(rs, job, x, list(range(16)))
        job = fill(rs, seeder, f"{prefix}-push-{attempt}", seeder.stats()["pages_total"] // 16, BIG,
                   job + 1)                                          # x demoted
        assert dropped(tier_stats(seeder)) == 0
        pid, promoted = tier_stats(b)["pid"], tier_stats(b)["promoted_blocks"]
        rb[0].call("lookup_detail", keys=x)
        if wait_promoting(b):
            os.kill(pid, sig)
            time.sleep(0.3)                            # a reply sent before the signal is taken in by now
            if tier_stats(b)["promoted_blocks"] == promoted:
                return x, pid, promoted
            os.kill(pid, signal.SIGCONT)               # it had finished already: try again
            wait_ready(b)
        promote(rb[0], x)
    raise AssertionError("no promote was caught in flight in 5 attempts")


def wait_promoting(daemon, timeout: float = 5.0) -> bool:
    """Whether a promote job was seen in flight (its get sent) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = tier_stats(daemon)
        if st["promoting_blocks"]:
            return True
        if st["promoted_blocks"]:
            return False
        time.sleep(0.0005)
    return False


def test_the_data_file_replaced_restarts_the_companion_on_the_new_file(nodes, ranks):
    """The companion maps the region's data file as a client does. When the file is truncated
    (any member of the client group can) the daemon replaces it; the companion, frozen here with a
    promote's pages fenced for it, is killed, its job and pages go (``Fence.reset`` needs no writer
    attached), and a new companion maps the new file: blocks are promoted into it, exact."""
    seeder = nodes(size="64MiB", low_watermark=0.5)
    b = nodes("--tier-data-timeout", "30", "--tier-kill-after", "60", "--no-tier-demote",
              "--region-check-interval", "0.2", size="40MiB")
    rs, rb = ranks(1), ranks(1)
    connect(rs, seeder, "seeder", BIG, "tier-replaced")
    connect(rb, b, "engine-b", BIG, "tier-replaced")
    x, pid, promoted = catch_promote(seeder, rs, b, rb, "replaced")
    try:
        assert tier_stats(b)["promoting_blocks"] == 16          # its pages handed to the frozen companion
        generation = b.stats()["generation"]
        os.truncate(b.region, 4096)
        stats = wait_for(lambda: (s := b.stats())["generation"] != generation and s, 30,
                         "the daemon to replace the truncated data file")
        assert stats["region_problem"] is None and stats["pages_fenced"] == 0 and stats["entries_ready"] == 0, stats
        wait_for(lambda: tier_stats(b)["pid"] not in (None, pid), 30, "a new companion")
        wait_ready(b)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    st = tier_stats(b)
    assert st["promoted_blocks"] == promoted and st["promote_failed_blocks"] == 16 and st["restarts"] >= 1, st
    rb2 = ranks(1)                                      # B's sessions ended with the old file
    connect(rb2, b, "engine-b2", BIG, "tier-replaced")
    time.sleep(1.1)                                     # what B remembers as failed expires
    promote(rb2[0], x, timeout=60)                      # into the new file, by the new companion
    load_exact(rb2, 300, x, list(range(16, 32)))
    assert b.stats()["pages_fenced"] == 0 and region_check(b)["ok"]
    assert "Traceback" not in b.log()


# ------------------------------------------------------------------------------------------ seals
class Forged:
    """Seals as an attacker with write access to the engine would make them (``Seals.parts``)."""

    def __init__(self, seals: list[bytes]):
        self.seals = seals

    def parts(self, ranges):
        return ((blocks, [self.seals[i] for i in blocks]) for blocks in ranges)


def test_values_planted_in_the_tier_are_never_loaded(nodes, ranks, tier, make_region):
    """Straight into the engine, under the namespace's own tier keys and with the right length:
    the right bytes with a forged seal (the key id is public: read off any value), the right bytes
    sealed with another key, another namespace's genuine value copied under this namespace's key,
    and the right bytes with no seal at all (what kvtierd before seals loaded). None is ever made
    READY; the sealed ones are counted by why. A value sealed with the fleet's key is promoted and
    loaded (the test is not vacuous)."""
    kind, engine = tier
    a = nodes()
    ra = ranks(1)
    connect(ra, a, "engine-a", SMALL, "planted")
    ks = Keyspace(identity(NamespaceId(**layout(SMALL, "planted"))))
    donor = Keyspace(identity(NamespaceId(**layout(SMALL, "donor"))))
    length = SMALL.block_bytes()
    keys = keys_for("planted", 5)
    region = make_region(pages=8, page_size=64 << 10)
    pages = [[i] for i in range(4)]
    for k, p in zip(keys, pages):
        region.data[p[0] * region.page_size:p[0] * region.page_size + length] = np.frombuffer(key_content(k, length),
                                                                                               np.uint8)
    extents = page_extents(pages, region.page_size, length)
    sealed = keys[:4]
    seals = [KEY.id + bytes(32 - KEY_ID_BYTES),                                        # forged tag
             Sealer(SealKey(b"another key, not the fleet's...."), ks.identity).seals(sealed, region.memory,
                                                                                      extents).make(1),
             Sealer(KEY, donor.identity).seals(sealed, region.memory, extents).make(2),  # another namespace's
             Sealer(KEY, ks.identity).seals(sealed, region.memory, extents).make(3)]     # genuine
    planter = open_backend(kind, engine.address, timeout=5.0)
    try:
        planter.attach(region.memory, OWNER)
        assert planter.put(ks.names(sealed), extents, Forged(seals)) == [True] * 4
        unsealed = ks.names(keys[4:])[0]
        if kind == "redis":
            assert planter.cluster.execute([(key_slot(unsealed.encode()), command("SET", unsealed,
                                             key_content(keys[4], length)), read_reply)]) == ["OK"]
        else:
            assert planter.store.put(unsealed, key_content(keys[4], length)) == 0
    finally:
        planter.close()
    for key in keys[:3] + keys[4:]:
        assert ra[0].call("lookup_detail", keys=[key]) == {"hits": 0, "pending": 1}
    wait_for(lambda: tier_stats(a)["seal_rejected_blocks"] == {"mismatch": 2, "other_key": 1}, 30,
             "the planted values to be refused")
    for key in keys[:3] + keys[4:]:
        wait_for(lambda: ra[0].call("lookup_detail", keys=[key]) == {"hits": 0, "pending": 0}, 10, "a plain miss")
    promote(ra[0], keys[3:4])
    load_exact(ra, 10, keys[3:4], [0])
    st = tier_stats(a)
    assert st["promoted_blocks"] == 1 and st["promote_failed_blocks"] == 4, st
    assert a.stats()["entries_ready"] == 1 and region_check(a)["ok"]

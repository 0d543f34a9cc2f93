"""The disk tier with real daemons and real rank processes: reboots, SIGKILLs mid-write, full,
read-only and slow disks, a companion that cannot die.

Each node is a real kvtierd started with ``--tier-backend disk`` on a directory that outlives it;
"a reboot" is a daemon stopped and its whole directory (region, metadata, sockets) removed, then
a fresh daemon in a new directory on the same disk directory. Every block's bytes are derived from
its key, so a torn, foreign or mixed block cannot pass ``load_exact``.

| what | test |
|---|---|
| two daemons in turns sharing nothing but the disk directory, the first "rebooted": every block promoted byte-exact; another namespace never gets them; kvtierctl status, /metrics and kvtierctl clear with the disk; a daemon of another name is refused, serves from RAM and says why | test_daemons_in_turns_share_only_the_directory_and_a_reboot_finds_every_block |
| the companion, or the daemon, SIGKILLed while demotes are being written: after a reboot every block is exact or gone (0 torn), and every block the daemon counted demoted is found | test_a_sigkill_mid_write_leaves_every_block_exact_or_dropped |
| a full disk (tmpfs with size=): demotes refused and counted, the node keeps storing and loading from RAM | test_a_full_disk_leaves_the_node_serving_from_ram |
| a read-only disk: promotes from it still work, demotes are refused and counted | test_a_read_only_disk_serves_promotes_and_refuses_demotes |
| a slow disk (a cgroup v1 blkio throttle at 512 KiB/s): slow I/Os counted, logged once; the node serves from RAM meanwhile; the slow blocks come back exact | test_a_slow_disk_is_counted_logged_once_and_the_node_keeps_serving |
| a companion that cannot die (a cgroup v1 freezer) killed mid-demote: the daemon answers and serves meanwhile, the pages stay pinned until it is reaped | test_a_companion_that_cannot_die_keeps_its_pages_and_the_daemon_serving |
| the daemon stopped (SIGTERM) while its companion cannot die: it exits cleanly after a bounded wait | test_a_daemon_stops_while_its_companion_cannot_die |
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
import urllib.request

import pytest

from kvtierbench.harness import HOLD_ALL
from kvtierbench.launcher import DaemonProcess
from kvtierd.contract.namespace import NamespaceId
from tests.integration.conftest import _rank_pool, new_daemon, ranks  # noqa: F401  (fixtures)
from tests.integration.ranks import RankProcess, all_call
from tests.integration.test_faults import wait_for
from tests.integration.test_kvtierctl import ctl, ctl_json
from tests.integration.test_tp_roundtrip import keys_for

from .daemons import (BIG, SMALL, connect, fill, layout, load_exact, promote, region_check, store, tier_stats,
                      wait_ready)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def disk_nodes():
    """Factory: disk_nodes(address, *extra_args, size=...) → a ready daemon whose second tier is
    the disk directory ``address``. Like the bench's daemons, they let one engine hold the whole
    region: the tests load a third of a region in one job, which the shares of kvtierd.holds would
    cut (tests/unit/test_holds.py tests those)."""
    started = []

    def start(address: str, *args: str, size: str = "16MiB", low_watermark: float = 0.25, wait: bool = True):
        d = new_daemon("--tier-backend", "disk", "--tier-address", address, "--tier-low-watermark",
                       str(low_watermark), "--tier-timeout", "2", "--tier-cooldown", "1",
                       "--tier-restart-backoff", "0.5", *HOLD_ALL, *args, size=size)
        started.append(d)
        d.start()
        if wait:
            wait_ready(d)
        return d

    yield start
    for d in started:
        d.cleanup()


def reboot(daemon, procs: list[RankProcess]) -> None:
    """The node goes down and its region with it: the daemon stopped, its directory removed."""
    all_call(procs, "close")
    daemon.cleanup()


def promote_each(proc: RankProcess, keys: list[bytes], timeout: float = 60.0) -> list[bytes]:
    """Look each key up on its own until none is pending; returns those that became hits."""
    deadline = time.monotonic() + timeout
    pending = list(keys)
    hits = []
    while pending:
        assert time.monotonic() < deadline, f"{len(pending)} keys still pending"
        still = []
        for key in pending:
            ans = proc.call("lookup_detail", keys=[key])
            if ans["hits"]:
                hits.append(key)
            elif ans["pending"]:
                still.append(key)
        pending = still
        time.sleep(0.05)
    return hits


# ------------------------------------------------------------------------------------------ reboots
def test_daemons_in_turns_share_only_the_directory_and_a_reboot_finds_every_block(disk, disk_nodes, ranks):
    a = disk_nodes(disk.address)
    ra = ranks(2)
    connect(ra, a, "engine-a", SMALL, "disk-model")             # TP=2, replicated: one copy
    x = keys_for("x", 12)
    store(ra, 1, x, list(range(12)))
    fill(ra, a, "filler", 2 * a.stats()["pages_total"], SMALL, 2)
    sa = tier_stats(a)
    assert sa["demoted_blocks"] >= 12 and sa["engine"]["engine"] == "disk" and sa["engine"]["direct"] is True
    reboot(a, ra)
    b = disk_nodes(disk.address)                                # a fresh node: nothing but the directory
    assert tier_stats(b)["engine"]["loaded_blocks"] >= 12
    rb = ranks(1)
    connect(rb, b, "engine-b", SMALL, "disk-model")             # TP=1: the same namespace
    assert rb[0].call("lookup_detail", keys=x) == {"hits": 0, "pending": 12}
    promote(rb[0], x)
    load_exact(rb, 100, x, list(range(12)))
    sb = tier_stats(b)
    assert sb["promoted_blocks"] == 12 and sb["promote_failed_blocks"] == 0
    assert sb["seal_rejected_blocks"] == {"mismatch": 0, "other_key": 0}
    # kvtierctl status and the metrics show the disk tier.
    wait_for(lambda: tier_stats(b)["engine"].get("blocks", 0) > 0, 10, "the companion's stats")
    status = ctl_json(b, "status")["tier"]
    assert status["backend"] == "disk" and status["disk_direct"] is True and status["disk_blocks"] >= 12, status
    assert re.fullmatch("[0-9a-f]{8}", status["seal_key_id"]) and "no_space:0" in status["disk_errors"], status
    page = urllib.request.urlopen(f"http://{b.stats()['metrics_address']}/metrics", timeout=10).read().decode()
    for line in ('kvtierd_tier_seal_rejected_blocks_total{reason="mismatch"} 0.0', 'kvtierd_tier_disk_bytes{kind="used"}',
                 'kvtierd_tier_disk_errors_total{cause="io_error"} 0.0', "kvtierd_tier_disk_blocks "):
        assert line in page, line
    # Another model with the same keys and geometry never gets them.
    rc = ranks(1)
    connect(rc, b, "engine-c", SMALL, "another-model")
    wait_for(lambda: rc[0].call("lookup_detail", keys=x) == {"hits": 0, "pending": 0}, 10, "a plain miss")
    assert tier_stats(b)["promoted_blocks"] == 12
    assert region_check(b)["ok"] and b.stats()["pages_fenced"] == 0
    # kvtierctl clear of the namespace empties it on the disk too, and says how many blocks went.
    name = NamespaceId(**layout(SMALL, "disk-model")).name()
    said = ctl(b, "clear", "--namespace", name)
    removed = re.search(r"; (\d+) blocks removed from the second tier", said)
    assert removed and int(removed.group(1)) >= 12, said
    time.sleep(1.1)                                             # past what B remembers as checked
    wait_for(lambda: rb[0].call("lookup_detail", keys=x) == {"hits": 0, "pending": 0}, 10, "x gone from the disk")
    reboot(b, rb + rc)
    # A daemon of another name on the same directory is refused; it serves from its region anyway
    # and says why, once.
    other = DaemonProcess(tempfile.mkdtemp(prefix="kvt-"), "--size", "16MiB", "--pin", "off", "--metrics-address",
                          "off", "--tier-backend", "disk", "--tier-address", disk.address, "--tier-restart-backoff",
                          "0.3", name="other")
    try:
        other.start()
        wait_for(lambda: tier_stats(other)["last_error"], 30, "the companion to be refused")
        assert "belongs to the daemon named 'kvtierd', not to 'other'" in tier_stats(other)["last_error"]
        rd = ranks(1)
        connect(rd, other, "engine-d", SMALL, "disk-model")
        keys = keys_for("local", 8)
        store(rd, 1, keys, list(range(8)))
        load_exact(rd, 2, keys, list(range(8, 16)))
        time.sleep(1.0)                                         # a few more refused restarts
        log = other.log()
        assert log.count("second tier down") == 1, log
        all_call(rd, "close")
    finally:
        other.cleanup()


# ------------------------------------------------------------------------------------------ crashes
def wait_demoting(daemon, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tier_stats(daemon)["demoting_blocks"]:
            return True
        time.sleep(0.0005)
    return False


@pytest.mark.parametrize("victim", ["companion", "daemon"])
def test_a_sigkill_mid_write_leaves_every_block_exact_or_dropped(disk, disk_nodes, ranks, victim):
    a = disk_nodes(disk.address, size="48MiB", low_watermark=0.5)
    ra = ranks(1)
    connect(ra, a, "engine-a", BIG, "disk-crash")
    stored: list[bytes] = []
    job, caught = 1, False
    for round_ in range(30):
        keys = keys_for(f"crash-{round_}", 16)
        store(ra, job, keys, list(range(16)))
        stored += keys
        job += 1
        if wait_demoting(a, 2.0):
            demoted_before = tier_stats(a)["demoted_blocks"]
            pid = tier_stats(a)["pid"] if victim == "companion" else a.pid
            os.kill(pid, signal.SIGKILL)
            caught = True
            break
    assert caught, "no demote was caught in flight"
    if victim == "companion":                  # the daemon goes on: a new companion, more demotes
        wait_for(lambda: tier_stats(a)["pid"] not in (None, pid), 30, "a new companion")
        wait_ready(a)
        for round_ in range(3):
            keys = keys_for(f"after-{round_}", 16)
            store(ra, job, keys, list(range(16)))
            stored += keys
            job += 1
    else:
        a.proc.wait(10)
    reboot(a, ra)
    b = disk_nodes(disk.address, size="48MiB")
    rb = ranks(1)
    connect(rb, b, "engine-b", BIG, "disk-crash")
    found = []
    for start in range(0, len(stored), 16):                     # in chunks the region holds
        hits = promote_each(rb[0], stored[start:start + 16])
        if hits:
            load_exact(rb, 1000 + start, hits, list(range(len(hits))))     # 0 torn: every one exact
        found += hits
    assert len(found) >= demoted_before, (len(found), demoted_before)  # what the daemon counted is there
    assert tier_stats(b)["promote_failed_blocks"] == tier_stats(b)["seal_rejected_blocks"]["mismatch"]
    assert region_check(b)["ok"]


# ------------------------------------------------------------------------------------------ bad disks
def serves_from_ram(procs: list[RankProcess], first_job: int, rounds: int = 3) -> None:
    for i in range(rounds):
        keys = keys_for(f"ram-{first_job}-{i}", 16)
        store(procs, first_job + 2 * i, keys, list(range(16)))
        load_exact(procs, first_job + 2 * i + 1, keys, list(range(16)))


def test_a_full_disk_leaves_the_node_serving_from_ram(mount, disk_nodes, ranks):
    fs = mount("tmpfs", 8)
    address = os.path.join(fs.path, "tier")
    a = disk_nodes(address, "--tier-settings", '{"capacity": "100%", "free_floor": 0}')
    with open(os.path.join(fs.path, "hog"), "wb") as f:        # someone else fills the disk
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    ra = ranks(1)
    connect(ra, a, "engine-a", SMALL, "disk-full")
    fill(ra, a, "filler", 2 * a.stats()["pages_total"], SMALL, 1)
    wait_for(lambda: (e := tier_stats(a)["engine"].get("errors", {})) and e["full"] + e["no_space"] > 0, 30,
             "the full disk to be counted")
    sa = tier_stats(a)
    assert sa["demoted_blocks"] == 0 and sum(sa["demote_dropped_blocks"].values()) > 0, sa
    assert sa["state"] == "ready"
    serves_from_ram(ra, 1000)
    assert a.stats()["pages_fenced"] == 0 and region_check(a)["ok"]
    with open(os.path.join(a.dir, f"{a.name}.tier.log")) as f:      # the companion said why, once
        said = [line for line in f if "no room for" in line or "No space left" in line]
    assert len(said) == 1, said


def test_a_read_only_disk_serves_promotes_and_refuses_demotes(mount, disk_nodes, ranks):
    fs = mount("tmpfs", 32)
    address = os.path.join(fs.path, "tier")
    a = disk_nodes(address)
    ra = ranks(1)
    connect(ra, a, "engine-a", SMALL, "disk-ro")
    x = keys_for("ro", 8)
    store(ra, 1, x, list(range(8)))
    fill(ra, a, "filler", 2 * a.stats()["pages_total"], SMALL, 2)
    assert tier_stats(a)["demoted_blocks"] >= 8
    reboot(a, ra)
    fs.remount("ro")
    b = disk_nodes(address)
    rb = ranks(1)
    connect(rb, b, "engine-b", SMALL, "disk-ro")
    promote(rb[0], x)
    load_exact(rb, 1, x, list(range(8)))
    fill(rb, b, "more", 2 * b.stats()["pages_total"], SMALL, 2)
    sb = tier_stats(b)
    assert sb["engine"]["writable"] is False and sb["engine"]["errors"]["read_only"] >= 1
    assert any(e["op"] == "put" and e["code"] == "rejected" for e in sb["errors"]), sb["errors"]
    serves_from_ram(rb, 1000)
    assert region_check(b)["ok"]


def test_a_slow_disk_is_counted_logged_once_and_the_node_keeps_serving(mount, throttle, disk_nodes, ranks):
    """ext4 on a loop device that the companion may only read and write at 512 KiB/s (a blkio
    throttle: the I/O is real and completes, slowly), so each of its I/Os takes longer than
    tier_timeout (0.2 s) and a demote batch seconds. While a slow demote is in flight the node
    stores, loads and looks up from RAM, byte-exact; every slow I/O is counted (``slow``) and the
    companion logs the first one only; the blocks demoted slowly are promoted back (slowly)
    byte-exact; nothing stays fenced."""
    fs = mount("ext4", 64)
    a = disk_nodes(os.path.join(fs.path, "tier"), "--tier-timeout", "0.2", "--tier-data-timeout", "60")
    slow = throttle(fs.loop, 512 << 10)
    slow.add(tier_stats(a)["pid"])                      # the companion: every thread of it
    ra = ranks(1)
    connect(ra, a, "engine-a", SMALL, "disk-slow")
    x = keys_for("slow", 16)
    store(ra, 1, x, list(range(16)))
    job = 2
    while not tier_stats(a)["demoting_blocks"]:         # fill until a demote starts (X its first victims)
        store(ra, job, keys_for(f"fill-{job}", 16), list(range(16)))
        job += 1
        assert job < 100, tier_stats(a)
    serves_from_ram(ra, 1000)                           # during the slow demote
    assert ra[0].call("lookup_detail", keys=keys_for(f"fill-{job - 1}", 16))["hits"] == 16
    assert tier_stats(a)["demoting_blocks"], "the demote ended before the node had served: not slow enough"
    wait_for(lambda: not tier_stats(a)["demoting_blocks"], 120, "the slow demote to finish")
    wait_for(lambda: tier_stats(a)["engine"].get("errors", {}).get("slow", 0) >= 2, 30, "slow I/Os counted")
    sa = tier_stats(a)
    assert sa["demoted_blocks"] >= 16 and sa["state"] == "ready" and sa["breaker"] == {"meta": "closed",
                                                                                       "data": "closed"}, sa
    all_call(ra, "close")
    rb = ranks(1)
    connect(rb, a, "engine-b", SMALL, "disk-slow")
    a.call("evict", admin=True, namespace=NamespaceId(**layout(SMALL, "disk-slow")).name(), count=1000)
    promote(rb[0], x, timeout=120)                      # read back through the slow disk
    load_exact(rb, 1, x, list(range(16)))
    with open(os.path.join(a.dir, f"{a.name}.tier.log")) as f:
        said = [line for line in f if "(slow; further ones are counted, not logged)" in line]
    assert len(said) == 1, said
    assert a.stats()["pages_fenced"] == 0 and region_check(a)["ok"]


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``Z``: a zombie, gone but not reaped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_companion_that_cannot_die_keeps_its_pages_and_the_daemon_serving(disk, disk_nodes, ranks, freezer):
    """The companion frozen (a cgroup v1 freezer: it sits in the kernel like a process on a hung
    disk, and a SIGKILL takes effect only once it is thawed) while demotes are in flight: they pass
    tier_data_timeout, then tier_kill_after, and the daemon SIGKILLs it. It cannot die, and the
    daemon does not wait for it: it answers pings, stores, loads byte-exact and looks up from RAM,
    says the companion is ``killed``, and keeps the demotes' pages pinned. Thawed, it dies; the
    daemon reaps it, the pins drop, and a new companion starts. (A blocking reap hung the daemon's
    loop until the thaw.)"""
    a = disk_nodes(disk.address, "--tier-data-timeout", "0.3", "--tier-kill-after", "0.3")
    ra = ranks(1)
    connect(ra, a, "engine-a", SMALL, "disk-frozen")
    pid = tier_stats(a)["pid"]
    freezer.add(pid)
    freezer.freeze()
    job = 1
    while not tier_stats(a)["demoting_blocks"]:          # fill until demotes go to the frozen companion
        store(ra, job, keys_for(f"fill-{job}", 16), list(range(16)))
        job += 1
        assert job < 100, tier_stats(a)
    wait_for(lambda: tier_stats(a)["state"] == "killed", 30, "the frozen companion killed")
    for _ in range(5):
        a.call("ping", timeout=2.0)
    serves_from_ram(ra, 1000)
    assert ra[0].call("lookup_detail", keys=keys_for(f"fill-{job - 1}", 16))["hits"] == 16
    sa = tier_stats(a)
    assert sa["state"] == "killed" and sa["pid"] == pid and sa["killed"] == 1 and sa["demoting_blocks"], sa
    assert process_state(pid) != "Z", "the companion died: the freezer did not hold it"
    freezer.thaw()
    wait_for(lambda: tier_stats(a)["state"] == "ready" and tier_stats(a)["pid"] != pid, 30, "a new companion")
    assert not os.path.exists(f"/proc/{pid}"), "the killed companion was not reaped"
    for job in range(3000, 3100):           # the new companion demotes what the next stores push out
        if tier_stats(a)["demoted_blocks"]:
            break
        store(ra, job, keys_for(f"after-{job}", 16), list(range(16)))
    wait_for(lambda: tier_stats(a)["demoted_blocks"], 30, "the new companion to demote")
    wait_for(lambda: tier_stats(a)["demoting_blocks"] == 0, 30, "the new companion's demotes to end")
    assert a.stats()["pages_fenced"] == 0 and region_check(a)["ok"]
    serves_from_ram(ra, 2000)


def test_a_daemon_stops_while_its_companion_cannot_die(disk, disk_nodes, freezer):
    """SIGTERM with the companion frozen (it cannot die until thawed): the daemon asks it to stop,
    kills it, waits a bounded time and exits cleanly; the companion is left to die when it can.
    (A blocking reap kept the daemon from exiting until the thaw.)"""
    a = disk_nodes(disk.address)
    pid = tier_stats(a)["pid"]
    freezer.add(pid)
    freezer.freeze()
    assert a.stop(timeout=30) == 0, a.log()[-3000:]
    assert process_state(pid) != "Z", "the companion died: the freezer did not hold it"
    freezer.thaw()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or process_state(pid) == "Z", 30, "the companion to die")

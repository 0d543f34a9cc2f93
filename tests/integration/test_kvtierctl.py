"""Every kvtierctl command, live and (where it reads the region file) with the daemon down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtierd.contract.region_format import RegionView
from kvtierd.contract.mapping import Mapping

from .ranks import CacheSpec
from .test_tp_roundtrip import connect, keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CTL = os.path.join(os.path.dirname(sys.executable), "kvtierctl")


def run(daemon, *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    out = subprocess.run([CTL, "--dir", daemon.dir, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == expect, (out.returncode, out.stdout, out.stderr)
    return out


def ctl(daemon, *args: str) -> str:
    return run(daemon, *args).stdout


def ctl_json(daemon, *args: str, expect: int = 0):
    return json.loads(run(daemon, *args, "--json", expect=expect).stdout)


@pytest.fixture
def populated(start_daemon, ranks):
    """Two namespaces: 5 entries of model-a and 3 of model-b (larger blocks). LRU, whose victims
    (kvtierctl evict) are the least recently used."""
    daemon = start_daemon("--policy", "lru")
    a, b = ranks(2)
    small, large = CacheSpec(num_blocks=8), CacheSpec(num_blocks=8, layers=6)
    connect([a], daemon, "eng-a", small, "replicated", seeds=[1], model="model-a")
    connect([b], daemon, "eng-b", large, "replicated", seeds=[2], model="model-b")
    keys_a, keys_b = keys_for("a", 5), keys_for("b", 3)
    assert a.call("store", job=1, keys=keys_a, block_ids=list(range(5)))["ok"]
    assert b.call("store", job=1, keys=keys_b, block_ids=list(range(3)))["ok"]
    assert a.call("lookup", keys=keys_a[:2]) == 2          # the first two are now the youngest of a
    return daemon, keys_a, keys_b, small, large


def test_live_commands(populated):
    daemon, keys_a, keys_b, small, large = populated
    status = ctl_json(daemon, "status")
    assert status["daemon"] == "running" and status["entries_ready"] == 8
    assert "pinned" in ctl(daemon, "status")
    assert ctl_json(daemon, "stats")["store_written_keys"] == 8

    namespaces = {ns["name"].split(":")[0]: ns for ns in ctl_json(daemon, "namespaces")}
    assert namespaces["model-a"]["entries"] == 5 and namespaces["model-b"]["entries"] == 3
    name_a = namespaces["model-a"]["name"]
    assert name_a in ctl(daemon, "namespaces")

    entries = ctl_json(daemon, "entries")
    assert len(entries) == 8 and all(e["state"] == "READY" for e in entries)
    only_a = ctl_json(daemon, "entries", "--namespace", name_a)
    assert {e["key"] for e in only_a} == {k.hex() for k in keys_a}
    assert [e["key"] for e in only_a[-2:]] == [k.hex() for k in keys_a[:2]]   # age: oldest first
    by_size = ctl_json(daemon, "entries", "--sort", "size", "--limit", "3")
    assert all(e["length"] == large.block_bytes() for e in by_size)
    assert keys_a[0].hex() in ctl(daemon, "entries")

    (entry,) = ctl_json(daemon, "inspect", "key", keys_b[0].hex())["entries"]
    assert entry["length"] == large.block_bytes() and len(entry["pages"]) == entry["page_count"]
    page = ctl_json(daemon, "inspect", "page", str(entry["pages"][0]))
    assert page["owner"]["key"] == keys_b[0].hex() and page["index_in_entry"] == 0
    assert "no READY entry" in ctl(daemon, "inspect", "key", "ab" * 36)
    assert "not hex" in run(daemon, "inspect", "key", "zz", expect=1).stderr

    check = ctl_json(daemon, "check")
    assert check["ok"] and check["entries_sound"] == 8 and check["daemon_running"]
    assert ctl(daemon, "check").startswith("OK")

    clients = ctl_json(daemon, "clients")["clients"]
    assert sorted(c["engine"] for c in clients) == ["eng-a", "eng-b"] and all(c["watched"] for c in clients)

    assert ctl_json(daemon, "evict", "--count", "2", "--namespace", name_a)["evicted"] == 2
    remaining = {e["key"] for e in ctl_json(daemon, "entries", "--namespace", name_a)}
    assert remaining == {k.hex() for k in keys_a[:2] + keys_a[4:]}          # the two oldest went
    assert "--all" in run(daemon, "clear", expect=1).stderr
    assert ctl_json(daemon, "clear", "--namespace", name_a)["evicted"] == 3
    assert ctl_json(daemon, "clear", "--all")["evicted"] == 3
    stats = ctl_json(daemon, "stats")
    assert stats["entries_ready"] == 0 and stats["operator_evictions"] == 8 and stats["evictions"] == 0


def test_offline_commands_and_damage_detection(populated):
    daemon, keys_a, keys_b, small, large = populated
    assert daemon.stop() == 0
    status = ctl_json(daemon, "status")
    assert status["daemon"] == "not running" and status["clean_shutdown"] and status["entries_ready"] == 8
    assert len(ctl_json(daemon, "entries")) == 8
    assert ctl_json(daemon, "inspect", "key", keys_a[3].hex())["entries"][0]["state"] == "READY"
    assert ctl_json(daemon, "check")["ok"]
    assert "is the daemon running" in run(daemon, "stats", expect=1).stderr   # live-only: says why

    # Damage the region: point one entry's chain at another entry's page.
    (victim,) = ctl_json(daemon, "inspect", "key", keys_b[1].hex())["entries"]
    (other,) = ctl_json(daemon, "inspect", "key", keys_b[0].hex())["entries"]
    mapping = Mapping.of_file(daemon.paths.meta)
    view = RegionView(mapping.buffer)
    view.chain[victim["pages"][0]] = other["pages"][1]
    del view
    mapping.close()
    report = ctl_json(daemon, "check", expect=1)
    assert not report["ok"]
    assert any(p["slot"] == victim["slot"] for p in report["problems"])
    out = run(daemon, "check", expect=1).stdout
    assert out.startswith("DAMAGED") and f"entry {victim['slot']}: record checksum mismatch" in out
    # A restarted daemon discards exactly that entry and serves the rest.
    daemon.start()
    assert daemon.stats()["entries_ready"] == 7
    assert ctl_json(daemon, "check")["entries_sound"] == 7

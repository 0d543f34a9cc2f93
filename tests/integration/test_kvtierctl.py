"""Every kvtierctl command, live and (where it reads the region file) with the daemon down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtierd.contract.region_view import RegionView
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


def bare(*args: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """kvtierctl with nothing pointing at a daemon but ``args`` and ``env`` (no --dir)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
    return subprocess.run([CTL, *args], capture_output=True, text=True, timeout=60, env={**environ, **(env or {})},
                          **kwargs)


@pytest.mark.parametrize("how", ["--socket", "KVTIERD_SOCKET", "--config"])
def test_every_command_reaches_the_daemon_the_flags_name(populated, tmp_path, how):
    # Issue 27 item 4: --socket and KVTIERD_SOCKET were ignored by status, namespaces, entries,
    # inspect and check, which read the default region; kvtierctl had no --config.
    daemon, keys_a, keys_b, small, large = populated
    config_file = tmp_path / "kvtierd.toml"
    config_file.write_text(f'dir = "{daemon.dir}"\nsize = "64MiB"\n')
    args, env = {"--socket": (["--socket", daemon.socket], None),
                 "KVTIERD_SOCKET": ([], {"KVTIERD_SOCKET": daemon.socket}),
                 "--config": (["--config", str(config_file)], None)}[how]

    def ctl_at(*command: str, expect: int = 0):
        out = bare(*args, *command, "--json", env=env)
        assert out.returncode == expect, (command, out.stdout, out.stderr)
        return json.loads(out.stdout)

    for stopped in (False, True):
        status = ctl_at("status")
        assert status["daemon"] == ("not running" if stopped else "running") and status["entries_ready"] == 8
        assert len(ctl_at("namespaces")) == 2 and len(ctl_at("entries")) == 8
        assert ctl_at("inspect", "key", keys_a[0].hex())["entries"][0]["state"] == "READY"
        assert ctl_at("check")["entries_sound"] == 8
        if not stopped:
            assert ctl_at("stats")["entries_ready"] == 8 and len(ctl_at("clients")["clients"]) == 2
            daemon.stop()


def test_output_to_a_reader_that_went_away_ends_quietly(daemon):
    # `kvtierctl status | head -1` ended in a BrokenPipeError traceback.
    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run([CTL, "--socket", daemon.socket, "status"], stdout=w, stderr=subprocess.PIPE, text=True,
                             timeout=60)
    finally:
        os.close(w)
    assert out.returncode == 141 and out.stderr == "", out.stderr


def test_stats_json_is_strict_json(daemon, ranks):
    # It carried the histograms' Infinity bound: not JSON (Node's JSON.parse rejects it).
    procs = ranks(1)
    connect(procs, daemon, "json", CacheSpec(num_blocks=4), "replicated", seeds=[1])
    procs[0].call("lookup", keys=keys_for("json", 2))

    def refuse(name):
        raise AssertionError(f"{name} in kvtierctl stats --json")
    stats = json.loads(run(daemon, "stats", "--json").stdout, parse_constant=refuse)
    assert stats["latency"]["lookup"]["buckets"][-1][0] == "+Inf"


def test_bad_arguments_are_usage_errors(populated, tmp_path):
    daemon, *_ = populated
    # --limit -1 used to drop the last entry (a Python slice); negative counts are refused.
    for command in (("entries", "--limit", "-1"), ("evict", "--count", "-2")):
        out = run(daemon, *command, expect=2)
        assert "is negative: give 0 or more" in out.stderr and "Traceback" not in out.stderr
    assert ctl_json(daemon, "entries", "--limit", "0") == []
    assert len(ctl_json(daemon, "entries", "--limit", "8")) == 8
    out = run(daemon, "inspect", "page", "abc", expect=1)
    assert out.stderr == "kvtierctl: page 'abc' is not a page number (0 .. pages_total - 1, as kvtierctl status " \
                         "shows)\n"
    kvtierd = os.path.join(os.path.dirname(sys.executable), "kvtierd")
    out = subprocess.run([kvtierd, "--config", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr == f"kvtierd: config file {tmp_path}: Is a directory (--config / " \
                                                 "KVTIERD_CONFIG names a TOML file)\n"

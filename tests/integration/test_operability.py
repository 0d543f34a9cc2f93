"""What an operator relies on: systemd notification, the metrics endpoint, socket modes."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.contract.channel import Channel

from .ranks import CacheSpec, RankError, all_call
from .test_tp_roundtrip import connect, keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "kvtierd.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this installation's kvtierd.
    unit = tmp_path / "kvtierd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/kvtierd", os.path.join(os.path.dirname(sys.executable),
                                                                                  "kvtierd")))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_sd_notify_ready_only_once_clients_can_connect(start_daemon):
    directory = tempfile.mkdtemp(prefix="kvt-notify-", dir="/tmp")
    path = os.path.join(directory, "notify")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)
    sink.settimeout(30)
    try:
        daemon = start_daemon(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}, wait=False)
        messages = []
        while True:
            msg = sink.recv(4096).decode()
            messages.append(msg)
            if "READY=1" in msg:
                # At the moment READY arrives, a client can already connect and be served.
                channel = Channel(daemon.socket, timeout=5)
                assert channel.call("ping")["ok"]
                channel.close()
                break
        assert any(m.startswith("STATUS=prefaulting region") for m in messages), messages
        assert "STATUS=serving" in messages[-1]
        watchdogs = 0
        while watchdogs < 2:                      # the loop pings the watchdog (every 0.1 s here)
            watchdogs += "WATCHDOG=1" in sink.recv(4096).decode()
        daemon.stop()
        rest = []
        try:
            while True:
                rest.append(sink.recv(4096).decode())
        except socket.timeout:
            pass
        assert any("STOPPING=1" in m for m in rest), rest
    finally:
        sink.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_without_notify_socket_nothing_is_sent(daemon):
    assert "NOTIFY_SOCKET" not in daemon.env
    assert "sd_notify failed" not in daemon.log()


def scrape(daemon) -> dict[tuple[str, tuple], float]:
    address = daemon.stats()["metrics_address"]
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_after_a_scripted_workload(daemon, ranks):
    spec = CacheSpec(num_blocks=16)
    procs = ranks(2)
    connect(procs, daemon, "metrics", spec, "replicated", seeds=[3, 3])
    keys = keys_for("metrics", 4)
    for s in all_call(procs, "store", job=1, keys=keys, block_ids=[0, 1, 2, 3]):
        assert s["ok"]
    for x in all_call(procs, "load", job=2, keys=keys + keys_for("absent", 2), block_ids=list(range(6))):
        assert x["hits"] == 4
    assert procs[0].call("lookup", keys=keys_for("absent", 3)) == 0
    assert procs[0].call("lookup", keys=keys) == 4
    # A conflict: rank 1 opens job 3 with some keys, rank 0 asks with others.
    procs[1].call("store", job=3, keys=keys_for("x", 1), block_ids=[0])
    with pytest.raises(RankError):
        procs[0].call("store", job=3, keys=keys_for("y", 1), block_ids=[0])

    m = scrape(daemon)
    block = spec.block_bytes()
    assert m[("kvtierd_written_bytes_total", ())] == 4 * block
    assert m[("kvtierd_dedup_saved_bytes_total", ())] == 4 * block
    assert m[("kvtierd_entries", (("state", "ready"),))] == 4
    assert m[("kvtierd_entries", (("state", "pinned"),))] == 0
    assert m[("kvtierd_lookup_keys_total", (("result", "hit"),))] == 4
    assert m[("kvtierd_lookup_keys_total", (("result", "miss"),))] == 3
    assert m[("kvtierd_load_keys_total", (("result", "hit"),))] == 4
    assert m[("kvtierd_load_keys_total", (("result", "miss"),))] == 2
    assert m[("kvtierd_store_keys_total", (("outcome", "written"),))] == 5      # 4 + job 3's key
    assert m[("kvtierd_store_keys_total", (("outcome", "aborted"),))] == 1
    assert m[("kvtierd_aborted_jobs_total", (("cause", "conflict"),))] == 1
    assert m[("kvtierd_jobs_completed_total", (("kind", "store"),))] == 1
    assert m[("kvtierd_jobs_completed_total", (("kind", "load"),))] == 1
    assert m[("kvtierd_errors_total", (("code", "CONFLICT"),))] == 1
    assert m[("kvtierd_sessions", (("role", "rank"),))] == 2
    assert m[("kvtierd_capacity_bytes", ())] == daemon.stats()["capacity_bytes"]
    assert m[("kvtierd_request_duration_seconds_count", (("op", "store"),))] == 4
    assert m[("kvtierd_request_duration_seconds_count", (("op", "load"),))] == 2
    assert m[("kvtierd_vote_wait_seconds_count", ())] == 1
    assert m[("kvtierd_pages", (("state", "used"),))] == 4
    info = [k for k in m if k[0] == "kvtierd_region_info"]
    assert info and dict(info[0][1])["path"] == daemon.region


def test_socket_and_region_modes_and_admin_separation(daemon):
    st = daemon.stats()
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(st["admin_socket"]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.region).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(daemon.dir).st_mode) & 0o077 == 0     # no group configured: user only
    channel = Channel(daemon.socket, timeout=5)
    try:
        with pytest.raises(Exception) as err:
            channel.call("clear")
        assert err.value.code.name == "FORBIDDEN"
    finally:
        channel.close()
    assert st["metrics_address"].startswith("127.0.0.1:")


def test_a_fresh_daemon_exports_every_labelled_series_at_zero(daemon):
    # Issue 27 item 2: labelled counters had no sample before their first event, so the series was
    # born at 1 and increase() saw nothing: KvtierdInternalErrors missed a first INTERNAL error. Every
    # series the code can emit (tests/unit/test_deploy.py reads them off the code's enums) exists
    # from the start, at 0.
    from kvtierd.policy import policy_class
    from tests.unit.test_deploy import Exported
    m = scrape(daemon)
    exported = Exported(tier=False)
    other_segments = {segment for _, labelsets in exported.series.items() for labels in labelsets
                      for label, segment in labels if label == "segment"} - set(
        policy_class(daemon.stats()["policy"]).segments)
    missing = []
    for name, labelsets in exported.series.items():
        if not name.endswith(("_total", "_count", "_bucket")):
            continue
        for labels in labelsets:
            if (name, labels) not in m and not {v for k, v in labels if k == "segment"} & other_segments:
                missing.append(f"{name}{dict(labels)}")
    assert not missing, f"series a fresh daemon does not export: {missing}"
    assert m[("kvtierd_errors_total", (("code", "INTERNAL"),))] == 0
    assert m[("kvtierd_aborted_jobs_total", (("cause", "timeout"),))] == 0
    assert m[("kvtierd_lease_ends_total", (("cause", "expired"),))] == 0
    assert m[("kvtierd_fence_released_pages_total", (("cause", "region_replaced"),))] == 0

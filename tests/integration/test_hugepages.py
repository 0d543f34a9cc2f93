"""Huge pages end to end: the daemon's refusal, and what it reports (start line, kvtierctl
status, metrics) on a filesystem without huge pages and on a huge tmpfs this test mounts (root
only: skipped, saying why, elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtierbench.harness import huge_tmpfs
from kvtierbench.launcher import DaemonProcess
from kvtierd import hugepages

from .test_operability import scrape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CTL = os.path.join(os.path.dirname(sys.executable), "kvtierctl")


def status(daemon) -> dict:
    out = subprocess.run([CTL, "--dir", daemon.dir, "status", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def reported(daemon) -> tuple[dict, dict]:
    """(kvtierctl status, the metrics' region_info labels and huge bytes) of a running daemon."""
    s = status(daemon)
    m = scrape(daemon)
    (info,) = [dict(labels) for name, labels in m if name == "kvtierd_region_info"]
    return s, {**info, "huge_bytes": m[("kvtierd_region_huge_bytes", ())]}


def test_without_huge_pages_auto_starts_and_on_refuses(start_daemon):
    found = hugepages.offer("/tmp")
    if found.kind != "none":
        pytest.skip(f"/tmp gives huge pages here ({found.fs_type} huge={found.huge})")
    daemon = start_daemon()                                 # auto: 4 KiB pages (or what the disk maps)
    s, metric = reported(daemon)
    assert s["hugepages"] == metric["hugepages"] in ("none", "thp")
    assert s["huge_bytes"] == metric["huge_bytes"] and str(s["huge_page_size"]) == metric["huge_page_size"]
    assert f"hugepages={s['hugepages']}" in daemon.log() and "hugepages=auto: the region uses" in daemon.log()

    refused = start_daemon("--hugepages", "on", wait=False)
    assert refused.proc.wait(60) == 1
    log = refused.log()
    assert "cannot start: hugepages=on, but" in log and "mount -t tmpfs -o huge=within_size" in log
    assert not os.path.exists(refused.region)


@pytest.fixture
def huge_dir(tmp_path):
    """A directory on a tmpfs mounted huge=within_size for the test (root only; skipped otherwise)."""
    mount_point = str(tmp_path / "huge")
    try:
        with huge_tmpfs(mount_point, 64 << 20, huge="within_size"):
            yield os.path.join(mount_point, "kvtierd")
    except OSError as exc:
        if "cannot mount" not in str(exc):
            raise
        pytest.skip(f"needs a tmpfs mounted huge=within_size, which only root can mount: {exc}")


def test_on_a_huge_tmpfs_status_and_metrics_report_huge_pages(huge_dir):
    daemon = DaemonProcess(huge_dir, "--size", "32MiB", "--pin", "off", "--hugepages", "on",
                           "--metrics-address", "127.0.0.1:0", start_timeout=30.0)
    os.makedirs(huge_dir)
    try:
        daemon.start()
        s, metric = reported(daemon)
        file_bytes = os.stat(daemon.region).st_size
        thp = hugepages.thp_page_size()
        assert s["hugepages"] == metric["hugepages"] == "thp"
        assert s["huge_page_size"] == thp and metric["huge_page_size"] == str(thp)
        assert s["huge_bytes"] == metric["huge_bytes"] == file_bytes
        assert f"hugepages=thp huge_page_size={thp >> 20}MiB huge_bytes={file_bytes >> 20}MiB" in daemon.log()
    finally:
        daemon.stop()

"""The hostile soak in its short CI form: every attack at least once while good engines verify every
block they load. The long form is ``make soak-hostile`` (≥ 60 s); both print the same figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.soak, pytest.mark.integration, pytest.mark.timeout(300)]

SOAK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_soak.py")


def test_short_hostile_soak(tmp_path):
    out_json = tmp_path / "hostile.json"
    proc = subprocess.run([sys.executable, SOAK, "--duration", "15", "--json", str(out_json)],
                          check=False, capture_output=True, text=True, timeout=280)
    print(proc.stdout)
    assert out_json.exists(), f"the soak wrote no figures (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    figures, failures = report["figures"], report["failures"]
    assert proc.returncode == 0 and not failures, f"{failures}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert figures["wrong_blocks"] == 0 and figures["loads_verified"] > 0 and figures["daemon_exit"] == 0
    assert figures["attack_cycles"] >= 1 and figures["misbehaved"] == []
    assert figures["fds_max"] <= 512 and figures["daemon_errors"].get("INTERNAL", 0) == 0

"""The soak in its short CI form: 16 client processes for a few seconds, every check enforced.

The long form is ``make soak`` (``python tests/soak/soak.py --duration 300``); both print the same
figures. This test fails with the soak's own list of failed checks and its figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.soak, pytest.mark.integration, pytest.mark.timeout(120)]

SOAK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.py")


def test_short_soak_16_clients_two_namespaces(tmp_path):
    out_json = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, SOAK, "--duration", "8", "--json", str(out_json)],
                          check=False, capture_output=True, text=True, timeout=110)
    print(proc.stdout)
    assert out_json.exists(), f"the soak wrote no figures (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    figures, failures = report["figures"], report["failures"]
    assert proc.returncode == 0 and not failures, f"{failures}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert figures["client_processes"] >= 16 and figures["namespaces"] == 2
    assert figures["torn_reads"] == 0 and figures["errors"] == 0 and figures["daemon_errors"] == {}
    assert figures["leaked_pins"] == 0 and figures["writing_left"] == 0
    assert figures["loads_verified"] > 0 and figures["evictions"] > 0
    assert figures["daemon_exit"] == 0 and figures["check_ok"]

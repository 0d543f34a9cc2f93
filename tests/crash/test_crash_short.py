"""The randomised crash test in its short CI form: the daemon SIGKILLed and SIGTERMed, clients
SIGKILLed and SIGSTOPped at random for a few seconds, every loaded block verified, every check
enforced; once with the daemon watching its clients' processes, once in a PID namespace of its
own (heartbeats, and the grace period for clients killed unseen).

``make crash`` runs both forms for 60 s each; all print the same totals. This test fails with the
crash driver's own list of failed checks and its totals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.crash, pytest.mark.integration, pytest.mark.timeout(240)]

CRASH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash.py")


@pytest.mark.parametrize("mode", ["watched", "pidns"])
def test_short_crash_run_serves_no_foreign_or_torn_bytes(tmp_path, mode):
    out_json = tmp_path / "crash.json"
    args = [sys.executable, CRASH, "--duration", "12", "--json", str(out_json)]
    if mode == "pidns":
        args += ["--pidns", "--fence-grace", "8"]
    proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=220)
    print(proc.stdout)
    assert out_json.exists(), f"the crash test wrote no totals (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    totals, failures = report["totals"], report["failures"]
    assert proc.returncode == 0 and not failures, f"{failures}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert totals["foreign_or_torn_blocks"] == 0 and totals["foreign_or_torn_bytes"] == 0
    assert totals["loads_verified"] > 0 and totals["daemon_restarts"] > 0 and totals["kills"] > 0
    assert totals["final_pages_fenced"] == 0 and totals["final_sessions"] == 0 and totals["check_ok"]

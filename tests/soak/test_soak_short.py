"""The soak in its short CI form: 16 client processes for a few seconds, every check enforced.

The long form is ``make soak`` (``python tests/soak/soak.py --duration 300``); both print the same
figures. This test fails with the soak's own list of failed checks and its figures.
"""

from __future__ import annotations


import pytest

from .report import run_script

pytestmark = [pytest.mark.soak, pytest.mark.integration, pytest.mark.timeout(120)]


def test_short_soak_16_clients_two_namespaces(tmp_path):
    figures = run_script("soak.py", tmp_path, "--duration", "8", timeout=110)
    assert figures["client_processes"] >= 16 and figures["namespaces"] == 2
    assert figures["torn_reads"] == 0 and figures["errors"] == 0 and figures["daemon_errors"] == {}
    assert figures["leaked_pins"] == 0 and figures["writing_left"] == 0
    assert figures["loads_verified"] > 0 and figures["evictions"] > 0
    assert figures["daemon_exit"] == 0 and figures["check_ok"]

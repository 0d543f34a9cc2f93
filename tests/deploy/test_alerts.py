"""deploy/prometheus through promtool: the rules and scrape config check, and every alert is unit
tested (tests/deploy/alerts_test.yml: it fires, it stays quiet, and a counter alert fires on its
counter's first events, the series being at 0 from the daemon's start as kvtierd/metrics.py exports
them).

promtool comes from Debian's prometheus package (``make deploy-install``); skipped with the reason
when it cannot be found.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SCRAPE = ROOT / "deploy" / "prometheus" / "scrape.yml"
TESTS = Path(__file__).with_name("alerts_test.yml")


def promtool() -> str:
    found = shutil.which("promtool") or shutil.which("promtool", path=os.path.dirname(sys.executable))
    if found is None:
        pytest.skip("promtool is not installed: make deploy-install (Debian's prometheus package)")
    return found


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def rules() -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}


def test_promtool_checks_the_rules_and_the_scrape_config():
    for args in (("check", "rules", str(ALERTS)), ("check", "config", str(SCRAPE))):
        proc = run(*args)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_of_every_alert_pass(tmp_path):
    # promtool compares the rendered annotations too; the tests hold labels and firing only, so
    # they run against the rules without their annotations (whose templates `check rules` checks).
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    proc = run("test", "rules", str(tmp_path / TESTS.name))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _cases() -> list[tuple[dict, dict]]:
    """(test group, alert_rule_test) pairs of alerts_test.yml."""
    return [(group, case) for group in yaml.safe_load(TESTS.read_text())["tests"]
            for case in group.get("alert_rule_test", [])]


def test_every_alert_is_tested_firing_and_quiet():
    firing = {c["alertname"] for _, c in _cases() if c["exp_alerts"]}
    quiet = {c["alertname"] for _, c in _cases() if not c["exp_alerts"]}
    assert set(rules()) <= firing, f"alerts no test makes fire: {sorted(set(rules()) - firing)}"
    assert set(rules()) <= quiet, f"alerts no test keeps quiet: {sorted(set(rules()) - quiet)}"


COUNTER = re.compile(r"\b(?:rate|increase)\((kvtierd_\w+?)(?:_total|_count|_bucket)?\b")


def test_every_counter_alert_fires_on_series_that_start_at_zero():
    # Issue 27 item 2: what makes a counter alert see its first events is a series present at 0
    # before them; every firing case of a counter alert starts its counters at 0 as kvtierd does.
    problems = []
    for name, rule in rules().items():
        counters = set(COUNTER.findall(rule["expr"]))
        if not counters:
            continue
        fired = [group for group, case in _cases() if case["alertname"] == name and case["exp_alerts"]]
        for group in fired:
            for series in group["input_series"]:
                metric = series["series"].split("{")[0]
                if any(metric.startswith(c) for c in counters) and not re.match(r"0(\b|[x+])", series["values"]):
                    problems.append(f"{name}: {series['series']} starts at {series['values'].split()[0]}, not 0")
        if not fired:
            problems.append(f"{name}: no firing case")
    assert not problems, problems

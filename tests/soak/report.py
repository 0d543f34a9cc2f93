"""What the soaks share: printing their figures and verdict, and running one from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def finish(title: str, figures: dict, failures: list[str], json_path: str | None, summary: str = "") -> int:
    """Print the figures (and ``summary``), write them to ``json_path``, print the verdict; the exit status."""
    width = max((len(k) for k in figures), default=0)
    print(title)
    for k, v in figures.items():
        print(f"  {k:<{width}}  {v}")
    if summary:
        print(f"  {summary}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"figures": figures, "failures": failures}, f, indent=1, default=str)
    if failures:
        print("FAILED:")
        for failure in failures:
            print(f"  - {failure}")
        return 1
    print("OK")
    return 0


def run_script(script: str, tmp_path, *args: str, timeout: float) -> dict:
    """Run a soak script (in this directory) with ``args``; its figures, asserting it passed."""
    out_json = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args, "--json", str(out_json)],
                          check=False, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout)
    assert out_json.exists(), f"the soak wrote no figures (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out_json.read_text())
    assert proc.returncode == 0 and not report["failures"], \
        f"{report['failures']}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return report["figures"]

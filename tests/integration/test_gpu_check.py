"""tools/gpu_check.py (make gpu-check) on a machine without CUDA: it runs, writes its JSON and
Markdown summaries, and reports every GPU step skipped with the reason (issue 27 item 9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
GPU_STEPS = ("gpu-tests", "sglang-gpu", "vllm-e2e", "gpu-bench")


def gpu_check(python: str, out: Path, *args: str) -> dict:
    proc = subprocess.run([python, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "gpu_check.md").read_text() in proc.stdout
    return json.loads((out / "gpu_check.json").read_text())


def steps(summary: dict) -> dict[str, dict]:
    return {s["name"]: s for s in summary["steps"]}


def test_without_cuda_every_gpu_step_is_skipped_with_its_reason(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check runs for real (make gpu-check)")
    summary = gpu_check(sys.executable, tmp_path)
    by_name = steps(summary)
    assert list(by_name) == ["environment", "install", *GPU_STEPS]
    assert summary["environment"]["cuda"] is False and summary["environment"]["importable"]["zmq"]
    for name in GPU_STEPS:
        assert by_name[name]["status"] == "skipped"
        assert by_name[name]["reason"].startswith("no CUDA device"), by_name[name]
    assert "vllm not importable" in by_name["vllm-e2e"]["reason"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| vllm-e2e | skipped |" in markdown and "vllm not importable" in markdown


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs a second, bare Python")
def test_a_bare_python_is_told_what_to_bring(tmp_path):
    # The system's Python (no pyzmq, maybe no torch): like a device image without the daemon's
    # dependencies. Nothing is installed without a wheel directory; every reason is recorded.
    bare = subprocess.run(["/usr/bin/python3", "-c", "import zmq"], capture_output=True)
    if bare.returncode == 0:
        pytest.skip("/usr/bin/python3 has pyzmq: not a bare Python")
    by_name = steps(gpu_check("/usr/bin/python3", tmp_path))
    assert by_name["install"]["status"] == "skipped" and "pyzmq" in by_name["install"]["reason"] \
        and "no --wheels directory" in by_name["install"]["reason"]
    for name in GPU_STEPS:
        assert by_name[name]["status"] == "skipped" and "not importable: " in by_name[name]["reason"]

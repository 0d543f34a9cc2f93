#!/usr/bin/env python3
"""One GPU check, for the first CUDA machine kvtierd meets: ``make gpu-check OUT=dir``.

Runs with the machine's own Python (torch and CuPy expected; no package registry needed) from a
bare checkout of this repository: the repository's packages are put on the path (``kvtier`` is
the ``client/`` folder, as pyproject's package-dir maps it), and the daemon's few pure-Python
dependencies come from ``--wheels DIR`` when the machine lacks them (``pip install --no-index``).
Steps, each in its own process with its own timeout, under one budget (``--budget-s``, default
450 s: under 8 minutes with the summary):

1. ``environment``: Python, torch, CUDA devices, CuPy, and which of the optional packages import.
2. ``install``: the missing dependencies from the wheel directory (skipped without one).
3. ``gpu-tests``: ``pytest -m cuda tests/gpu`` (the copy kernel and torch copier against the pinned
   region, huge-page pinning, TP=2 MLA on one GPU through a real daemon).
4. ``sglang-gpu``: tests/sglang/test_gpu_hicache.py, where SGLang imports.
5. ``vllm-e2e``: bench/vllm_e2e.py, where vLLM imports: a small MLA model with dummy weights run
   by vllm.LLM twice, engine B loading engine A's KV from kvtierd, greedy tokens compared (TP=2
   where two GPUs exist).
6. ``gpu-bench``: bench/gpu_bench.py (D2H/H2D GB/s per geometry — block sizes of 2.1 to 5 MiB —,
   kernel and torch copier against a contiguous cudaMemcpyAsync, cudaHostRegister s/GiB with
   4 KiB and 2 MiB pages, one-copy MLA at TP=N against TP=1: N = the GPUs, at least 2).

A step that cannot run here is recorded as skipped with the reason (no CUDA device, a package that
does not import); one that fails or runs out of time is recorded with its log's tail. The summary
(``gpu_check.json`` and ``gpu_check.md`` in the output directory, with each step's log beside
them) is rewritten after every step, so a run cut short still leaves one. The exit status is 1
when a step failed or timed out, else 0. docs/cuda.md says where the figures go.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the daemon and the tests import beyond torch and CuPy (pyproject.toml: dependencies, test).
NEEDED = {"zmq": "pyzmq", "msgpack": "msgpack", "numpy": "numpy", "xxhash": "xxhash",
          "prometheus_client": "prometheus-client", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
OPTIONAL = ("cupy", "vllm", "sglang")
# Each step's own limit in seconds (the budget left can cut it shorter).
LIMITS = {"install": 60, "gpu-tests": 180, "sglang-gpu": 120, "vllm-e2e": 180, "gpu-bench": 150}
RESERVE_S = 10          # kept for writing the summary


@dataclass
class Step:
    name: str
    status: str = "pending"        # passed | failed | timeout | skipped
    reason: str = ""
    seconds: float = 0.0
    details: dict = field(default_factory=dict)
    log: str = ""


class Check:
    def __init__(self, out: Path, budget_s: float, wheels: str | None):
        self.out, self.budget_s, self.wheels = out, budget_s, wheels
        self.started = time.monotonic()
        self.env: dict = {}
        self.steps: list[Step] = []
        self.shim = Path(tempfile.mkdtemp(prefix="kvtier-gpu-check-"))
        (self.shim / "kvtier").symlink_to(ROOT / "client")
        self.pythonpath = os.pathsep.join(filter(None, [str(self.shim), str(ROOT), os.environ.get("PYTHONPATH")]))

    # --- running -------------------------------------------------------------------------------
    def left(self) -> float:
        return self.budget_s - RESERVE_S - (time.monotonic() - self.started)

    def run(self, step: Step, argv: list[str], limit: float,
            env: dict | None = None) -> subprocess.CompletedProcess | None:
        """Run one step's command with its timeout; its output goes to <out>/<step>.log."""
        timeout = min(limit, self.left())
        if timeout < 5:
            step.status, step.reason = "skipped", "no time left in the budget"
            return None
        log = self.out / f"{step.name}.log"
        step.log = log.name
        began = time.monotonic()
        with open(log, "w") as f:
            f.write(f"$ {' '.join(argv)}  (timeout {timeout:.0f} s)\n")
            f.flush()
            try:
                proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                      env={**os.environ, "PYTHONPATH": self.pythonpath, **(env or {})},
                                      stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                proc = None
        step.seconds = round(time.monotonic() - began, 1)
        if proc is None:
            step.status, step.reason = "timeout", f"stopped after {timeout:.0f} s"
        else:
            step.status = "passed" if proc.returncode == 0 else "failed"
            if proc.returncode:
                step.reason = f"exit status {proc.returncode}: " + tail(log)
        return proc

    def add(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    def importable(self, module: str) -> bool:
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, timeout=120,
                               env={**os.environ, "PYTHONPATH": self.pythonpath})
        return probe.returncode == 0

    # --- steps ---------------------------------------------------------------------------------
    def environment(self) -> None:
        step = self.add(Step("environment"))
        code = ("import json, torch; c = torch.cuda.is_available(); "
                "print(json.dumps({'torch': torch.__version__, 'cuda': c, 'torch_cuda': torch.version.cuda, "
                "'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if c else []}))")
        probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        torch_env = json.loads(probe.stdout) if probe.returncode == 0 else {"torch": None, "cuda": False,
                                                                                "devices": [],
                                                                                "error": probe.stderr[-500:]}
        self.env = {"python": sys.version.split()[0], "platform": platform.platform(), **torch_env,
                    "importable": {m: self.importable(m) for m in (*OPTIONAL, *NEEDED)}}
        step.status, step.details = "passed", self.env

    def install(self) -> None:
        step = self.add(Step("install"))
        missing = [package for module, package in NEEDED.items() if not self.env["importable"][module]]
        if not missing:
            step.status, step.reason = "skipped", "every dependency imports"
            return
        if not self.wheels:
            step.status, step.reason = "skipped", (f"not importable: {', '.join(missing)}; no --wheels directory "
                                                   "given (this machine reaches no package registry)")
            return
        # The wheel directory may also hold vllm or sglang wheels (with their dependencies).
        extra = [p for p in ("vllm", "sglang") if any(Path(self.wheels).glob(f"{p}-*.whl"))]
        self.run(step, [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", self.wheels,
                        *missing, *extra], LIMITS["install"])
        for module in (*NEEDED, *OPTIONAL):
            self.env["importable"][module] = self.importable(module)

    def gpu_only(self, name: str, needs: str | None = None) -> Step | None:
        """The step, or None after recording it skipped, with every reason it cannot run here."""
        step = self.add(Step(name))
        imports = self.env["importable"]
        reasons = [] if self.env.get("cuda") else ["no CUDA device (torch.cuda.is_available() is False)"]
        gone = [NEEDED[m] for m in NEEDED if not imports[m]]
        if gone:
            reasons.append(f"not importable: {', '.join(gone)} (give --wheels DIR)")
        if needs and not imports[needs]:
            reasons.append(f"{needs} not importable")
        if not reasons:
            return step
        step.status, step.reason = "skipped", "; ".join(reasons)
        return None

    def pytest(self, name: str, paths: list[str], needs: str | None = None) -> None:
        step = self.gpu_only(name, needs)
        if step is None:
            return
        junit = self.out / f"{name}.xml"
        self.run(step, [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", *paths], LIMITS[name])
        step.details = junit_counts(junit)
        if step.status == "passed" and step.details.get("tests", 0) == step.details.get("skipped", 0):
            step.status, step.reason = "skipped", "every test skipped: " + tail(self.out / step.log, 400)

    def vllm_e2e(self) -> None:
        step = self.gpu_only("vllm-e2e", needs="vllm")
        if step is None:
            return
        result = self.out / "vllm_e2e.json"
        self.run(step, [sys.executable, "bench/vllm_e2e.py", "--out", str(result)], LIMITS["vllm-e2e"])
        if result.exists():
            step.details = json.loads(result.read_text())

    def gpu_bench(self) -> None:
        step = self.gpu_only("gpu-bench")
        if step is None:
            return
        bench_out = self.out / "gpu_bench"
        limit = min(LIMITS["gpu-bench"], self.left())
        self.run(step, [sys.executable, "bench/gpu_bench.py", "--out", str(bench_out),
                        "--budget-s", str(max(10, int(limit) - 30))], limit)
        if (bench_out / "gpu_bench.json").exists():
            step.details = {"results": "gpu_bench/gpu_bench.json", "table": "gpu_bench/gpu_bench.md"}

    # --- the summary ---------------------------------------------------------------------------
    def write(self) -> None:
        summary = {"repository": git_revision(), "seconds": round(time.monotonic() - self.started, 1),
                   "budget_s": self.budget_s, "environment": self.env, "steps": [asdict(s) for s in self.steps]}
        (self.out / "gpu_check.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        lines = ["# kvtierd GPU check", "",
                 f"Repository {summary['repository']}; Python {self.env.get('python')}, torch {self.env.get('torch')} "
                 f"(CUDA {self.env.get('torch_cuda')}), devices: {', '.join(self.env.get('devices') or []) or 'none'}; "
                 f"{summary['seconds']} s of a {self.budget_s:.0f} s budget.", "",
                 "| step | status | seconds | reason / details |", "|---|---|---:|---|"]
        for s in self.steps:
            text = s.reason or (json.dumps(s.details, sort_keys=True) if s.details and s.name != "environment" else "")
            lines.append(f"| {s.name} | {s.status} | {s.seconds} | {text.replace('|', '/')[:300]} |")
        bench_md = self.out / "gpu_bench" / "gpu_bench.md"
        if bench_md.exists():
            lines += ["", bench_md.read_text()]
        (self.out / "gpu_check.md").write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        shutil.rmtree(self.shim, ignore_errors=True)


def tail(path: Path, chars: int = 800) -> str:
    try:
        return " ".join(path.read_text(errors="replace")[-chars:].split())
    except OSError:
        return ""


def junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET
    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and the steps' logs")
    p.add_argument("--wheels", help="a directory of wheels to install what does not import (pip --no-index)")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time budget")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out.resolve(), args.budget_s, args.wheels)
    try:
        for step in (check.environment, check.install,
                     lambda: check.pytest("gpu-tests", ["tests/gpu"]),
                     lambda: check.pytest("sglang-gpu", ["tests/sglang/test_gpu_hicache.py"], needs="sglang"),
                     check.vllm_e2e, check.gpu_bench):
            step()
            check.write()
    finally:
        check.write()
        check.close()
    print((out / "gpu_check.md").read_text())
    return 1 if any(s.status in ("failed", "timeout") for s in check.steps) else 0


if __name__ == "__main__":
    sys.exit(main())

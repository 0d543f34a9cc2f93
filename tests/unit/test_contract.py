"""kvtierd.contract is the floor: the client library imports kvtierd through it alone, and it
imports nothing of kvtierd outside its folder, nor a daemon-only dependency."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DAEMON_ONLY = ("prometheus_client", "uvloop")


def imported_modules(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_client_imports_only_the_floor():
    modules = imported_modules("import kvtier, kvtier.api, kvtier.copy, kvtier.select, kvtier.kvcache")
    daemon = [m for m in modules if m.startswith("kvtierd") and m not in ("kvtierd", "kvtierd.contract")
              and not m.startswith("kvtierd.contract.")]
    assert daemon == [], f"the client imports daemon modules: {daemon}"
    assert not [m for m in modules if m.split(".")[0] in DAEMON_ONLY]


def test_the_floor_imports_only_itself():
    for path in sorted((ROOT / "kvtierd" / "contract").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
                assert node.level <= 1, f"{path.name} imports from above kvtierd/contract/"
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("kvtierd") and name.split(".")[0] not in DAEMON_ONLY, (path.name, name)

"""The README's example runs as written (against a test daemon's socket)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_two_rank_example_runs(daemon):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert '"/dev/shm/kvtierd/kvtierd.sock"' in code
    code = code.replace('"/dev/shm/kvtierd/kvtierd.sock"', repr(daemon.socket))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    stats = daemon.stats()
    assert stats["entries_ready"] == 1 and stats["bytes_saved_dedup"] == stats["bytes_written"] > 0

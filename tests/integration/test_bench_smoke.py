"""`kvtierctl bench --quick` runs every section end to end and reports ratios (the CI smoke test).

No timing is asserted: the machine CI runs on says nothing about kvtierd's speed. What must
hold is that the bench runs from a fresh install, starts and cleans up its own daemons, and
reports every section with finite, positive ratios (the redis section may be skipped only when
redis-server or the redis Python client is not installed, the tier section only when neither
second-tier engine is: `make tier-install`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from kvtierbench import SECTIONS
from kvtierbench.harness import workdir_base

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BIN = os.path.dirname(sys.executable)


@pytest.fixture
def base():
    """The run's own home for the bench's directories (``--workdir``), where it puts them by default
    (/dev/shm): other runs' kvtbench-* directories in the shared /dev/shm are none of this run's."""
    path = tempfile.mkdtemp(prefix="kvtsmoke-", dir=workdir_base())
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_bench_quick_reports_every_section_as_ratios(tmp_path, base):
    out = subprocess.run([os.path.join(BIN, "kvtierctl"), "bench", "--quick", "--json", "--out", str(tmp_path),
                          "--workdir", base], capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout)
    assert set(result["sections"]) == set(SECTIONS)
    redis_there = shutil.which("redis-server") is not None and importlib.util.find_spec("redis") is not None
    tier_there = redis_there or importlib.util.find_spec("mooncake") is not None
    for name, section in result["sections"].items():
        if "skipped" in section:
            assert (name == "redis" and not redis_there) or (name == "tier" and not tier_there), \
                (name, section["skipped"])
            continue
        assert section["rows"] and section["ratios"], name
        for key, value in section["ratios"].items():
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, key, value)
        for t in section["targets"]:
            assert isinstance(t["met"], bool) and math.isfinite(t["value"]), (name, t)
    assert json.loads((tmp_path / "bench.json").read_text())["sections"].keys() == result["sections"].keys()
    assert "== targets" in (tmp_path / "bench.txt").read_text()
    assert os.path.dirname(result["workdir"]) == base
    assert os.listdir(base) == []                                    # the bench cleaned up after itself

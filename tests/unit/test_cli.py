"""kvtierd.cli without a daemon: which daemon the command line names, and how values are printed."""

from __future__ import annotations

import json

import pytest

from kvtierd import cli
from kvtierd.contract.paths import DaemonPaths


def paths(argv: list[str], environ: dict[str, str]) -> DaemonPaths:
    return cli.daemon_paths(cli.ctl_parser().parse_args([*argv, "status"]), environ)


def test_one_way_to_name_the_daemon(tmp_path):
    conf = tmp_path / "kvtierd.toml"
    conf.write_text('dir = "/srv/kv"\nname = "a"\ngroup = "kvtier"\n')
    assert paths(["--socket", "/x/b.sock"], {}) == DaemonPaths("/x", "b")
    assert paths([], {"KVTIERD_SOCKET": "/y/c.sock"}) == DaemonPaths("/y", "c")
    assert paths(["--config", str(conf)], {}) == DaemonPaths("/srv/kv", "a")
    assert paths([], {"KVTIERD_CONFIG": str(conf)}) == DaemonPaths("/srv/kv", "a")
    # As the daemon reads its settings: the environment over the file, flags over both.
    assert paths(["--config", str(conf)], {"KVTIERD_NAME": "z"}) == DaemonPaths("/srv/kv", "z")
    assert paths(["--config", str(conf), "--dir", "/d"], {}) == DaemonPaths("/d", "a")
    assert paths(["--dir", "/d"], {"KVTIERD_SOCKET": "/y/c.sock"}) == DaemonPaths("/d", "kvtierd")
    assert paths(["--config", str(conf)], {"KVTIERD_SOCKET": "/y/c.sock"}) == DaemonPaths("/srv/kv", "a")
    assert paths(["--socket", "/x/b.sock", "--dir", "/d"], {"KVTIERD_SOCKET": "/y/c.sock"}) == DaemonPaths("/x", "b")
    with pytest.raises(ValueError, match="not found"):
        paths(["--config", str(tmp_path / "missing.toml")], {})


def test_floats_keep_their_precision():
    # stats printed every float with one decimal: low_watermark 0.05 showed 0.1.
    text = cli._pairs({"low_watermark": 0.05, "uptime_seconds": 12.345678, "fence_grace_seconds": 600.0})
    assert text.splitlines() == ["low_watermark        0.05", "uptime_seconds       12.3457",
                                 "fence_grace_seconds  600"]


def test_json_has_no_infinity():
    text = cli._json({"buckets": [[0.1, 1], [float("inf"), 2]], "x": float("nan")})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {"buckets": [[0.1, 1], ["+Inf", 2]],
                                                                         "x": "NaN"}

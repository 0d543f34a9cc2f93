"""Documentation generated from code stays in step with it."""

from __future__ import annotations

from pathlib import Path

from kvtierd import config
from kvtierd.cli import ctl_parser, daemon_parser

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_generated_from_the_settings_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config.markdown(), "docs/configuration.md is stale: run `make docs`"
    for s in config.SETTINGS:
        assert f"`{s.name}`" in doc and s.env in doc and s.flag in doc


def test_example_config_is_generated_and_parses():
    text = (ROOT / "deploy" / "kvtierd.example.toml").read_text()
    assert text == config.example_toml(), "deploy/kvtierd.example.toml is stale: run `make docs`"
    uncommented = "\n".join(line.removeprefix("# ") for line in text.splitlines() if " = " in line)
    path = ROOT / "build" / "example-uncommented.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(uncommented)
    cfg = config.load(None, str(path), environ={})
    assert all(src.startswith("file:") for src in cfg.sources.values())


def test_every_setting_has_a_flag_and_help():
    helptext = daemon_parser().format_help()
    for s in config.SETTINGS:
        assert s.flag in helptext and s.env in helptext


def test_kvtierctl_help_lists_its_commands():
    helptext = ctl_parser().format_help()
    assert "stats" in helptext


def test_the_security_section_names_every_limit_with_its_default():
    doc = (ROOT / "docs" / "reliability.md").read_text()
    security = doc[doc.index("## Security"):]
    limits = ("max_connections", "max_connections_per_peer", "max_sessions", "max_sessions_per_peer",
              "max_job_keys_per_engine", "max_job_keys", "max_tombstones", "metrics_cache_seconds")
    for name in limits:
        default = config.BY_NAME[name].default
        assert f"| `{name}` | {default} |" in security, f"docs/reliability.md, Security: {name} (default {default})"

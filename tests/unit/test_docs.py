"""Documentation generated from code stays in step with it."""

from __future__ import annotations

import re
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


def test_the_metadata_cost_in_the_sizing_section_is_the_region_formats():
    # Issue 27 item 7: the doc said 132 bytes per page plus 2.5 MiB, written before the fence table.
    from kvtierd.contract.region_format import Geometry
    doc = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    m = re.search(r"Metadata costs (\d+) bytes per page .*? plus ([\d.]+) MiB .*?: ([\d.]+) % of a region with "
                  r"64 KiB pages", doc)
    assert m, "docs/operations.md, Sizing: the metadata sentence is gone"
    page = 64 << 10
    small, large = Geometry.for_pages(1 << 20, page), Geometry.for_pages(2 << 20, page)
    per_page = (large.total_bytes - small.total_bytes) // (1 << 20) - page
    fixed = small.total_bytes - (1 << 20) * (page + per_page)
    assert int(m.group(1)) == per_page
    assert float(m.group(2)) == round(fixed / (1 << 20), 1)
    assert float(m.group(3)) == round(100 * per_page / page, 1)


def test_sizes_say_they_are_binary_everywhere():
    # "64GB" and "1TB" were read as binary units without a word: the docs, --help and the error say so.
    import pytest
    assert config.parse_size("64GB") == config.parse_size("64GiB") == 64 << 30
    assert config.parse_size("1TB") == 1 << 40
    said = "64GB = 64GiB = 64 × 2^30 bytes"
    assert said in (ROOT / "docs" / "configuration.md").read_text()
    assert said in " ".join(daemon_parser().format_help().split())
    with pytest.raises(ValueError, match=re.escape(said)):
        config.parse_size("64XB")

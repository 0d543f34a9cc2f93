"""kvtierd.config: one settings table; default < TOML file < KVTIERD_* env < flags; errors name the setting."""

from __future__ import annotations

import argparse
import math

import pytest

from kvtierd import config as C
from kvtierd.config import BY_NAME, SETTINGS, load, parse_size


@pytest.fixture(autouse=True)
def no_system_config(tmp_path, monkeypatch):
    # A machine's /etc/kvtierd/kvtierd.toml must not leak into these tests.
    monkeypatch.setattr(C, "DEFAULT_CONFIG_FILE", str(tmp_path / "absent.toml"))


def parse_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    C.add_flags(parser)
    return parser.parse_args(list(argv))


def toml(tmp_path, text: str, name="kvtierd.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- sizes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ("65536", 65536), ("0", 0), ("64KiB", 64 << 10), ("64kib", 64 << 10), ("64K", 64 << 10), ("64KB", 64 << 10),
    ("512MiB", 512 << 20), ("512 MiB", 512 << 20), (" 2G ", 2 << 30), ("64GiB", 64 << 30), ("1TiB", 1 << 40),
    ("3tb", 3 << 40), ("1.5GiB", 3 << 29), ("100b", 100), ("100B", 100), (4096, 4096), ("0.5KiB", 512),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "KiB", "64 KiBs", "64PiB", "-1", "1e9", "64 Ki B", "one", "0x100", "1,024"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_format_size_round_trips():
    for n in (4096, 65536, 512 << 20, 64 << 30, 3 << 40, 12345, 1536):
        assert parse_size(C.format_size(n)) == n
    assert C.format_size(65536) == "64KiB"
    assert C.format_size(12345) == "12345"


@pytest.mark.parametrize("text,value", [("true", True), ("Yes", True), ("1", True), ("on", True), (" off ", False),
                                        ("false", False), ("NO", False), ("0", False), (True, True), (False, False)])
def test_parse_bool(text, value):
    assert C.parse_bool(text) is value


@pytest.mark.parametrize("text", ["", "maybe", "2", "y"])
def test_parse_bool_rejects(text):
    with pytest.raises(ValueError):
        C.parse_bool(text)


# --- the table ----------------------------------------------------------------------------------
def test_every_setting_is_documented_and_has_env_and_flag():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    assert set(BY_NAME) == set(names)
    for s in SETTINGS:
        assert s.doc and len(s.doc) > 5 and s.doc.endswith("."), s.name
        assert s.env == "KVTIERD_" + s.name.upper()
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.type in ("size", "int", "float", "str", "bool", "choice", "json")
        if s.type == "choice":
            assert s.choices
        s.default_value()            # every default parses and passes its own bounds


def test_flags_exist_for_every_setting():
    parser = argparse.ArgumentParser()
    C.add_flags(parser)
    helptext = parser.format_help()
    for s in SETTINGS:
        assert s.flag in helptext
        assert s.env in helptext


def test_defaults(tmp_path):
    cfg = load(None, None, environ={})
    assert cfg.size == 512 << 20
    assert cfg.page_size == 64 << 10
    assert cfg.pin == "auto"
    assert cfg.name == "kvtierd"
    assert cfg.group == ""
    assert cfg.recreate is False
    assert cfg.job_timeout == 30.0
    assert cfg.prefault_threads == 4
    assert cfg.log_level == "info"
    assert cfg.dir == C.default_directory()
    assert set(cfg.values) == set(BY_NAME)
    assert all(src == "default" for src in cfg.sources.values())
    with pytest.raises(AttributeError):
        cfg.no_such_setting


def test_default_flags_change_nothing():
    cfg = load(parse_flags(), None, environ={})
    assert all(src == "default" for src in cfg.sources.values())


# --- precedence ----------------------------------------------------------------------------------
def test_precedence_default_file_env_flag(tmp_path):
    path = toml(tmp_path, 'size = "64MiB"\npage_size = "16KiB"\nname = "from-file"\njob_timeout = 5\n'
                          'pin = "off"\n')
    environ = {"KVTIERD_PAGE_SIZE": "32KiB", "KVTIERD_NAME": "from-env", "KVTIERD_RECREATE": "yes"}
    args = parse_flags("--name", "from-flag", "--no-recreate")
    cfg = load(args, path, environ=environ)
    assert cfg.size == 64 << 20 and cfg.sources["size"] == f"file:{path}"
    assert cfg.page_size == 32 << 10 and cfg.sources["page_size"] == "env:KVTIERD_PAGE_SIZE"
    assert cfg.name == "from-flag" and cfg.sources["name"] == "flag"
    assert cfg.recreate is False and cfg.sources["recreate"] == "flag"
    assert cfg.job_timeout == 5.0 and cfg.sources["job_timeout"] == f"file:{path}"
    assert cfg.pin == "off"
    assert cfg.sources["prefault_threads"] == "default"


def test_env_over_file(tmp_path):
    path = toml(tmp_path, "prefault_threads = 8\n")
    cfg = load(None, path, environ={"KVTIERD_PREFAULT_THREADS": "16"})
    assert cfg.prefault_threads == 16 and cfg.sources["prefault_threads"] == "env:KVTIERD_PREFAULT_THREADS"
    assert load(None, path, environ={}).prefault_threads == 8


def test_flag_over_env():
    args = parse_flags("--size", "1GiB", "--page-size", "131072", "--pin", "mlock", "--recreate",
                       "--job-timeout", "2.5", "--log-level", "debug")
    cfg = load(args, None, environ={"KVTIERD_SIZE": "2GiB", "KVTIERD_PIN": "off"})
    assert (cfg.size, cfg.page_size, cfg.pin, cfg.recreate, cfg.job_timeout, cfg.log_level) == (
        1 << 30, 131072, "mlock", True, 2.5, "debug")
    assert {cfg.sources[k] for k in ("size", "page_size", "pin", "recreate", "job_timeout", "log_level")} == {"flag"}


def test_config_file_from_env_variable(tmp_path):
    path = toml(tmp_path, 'group = "kvtier"\n')
    cfg = load(None, None, environ={"KVTIERD_CONFIG": path})
    assert cfg.group == "kvtier" and cfg.sources["group"] == f"file:{path}"


def test_explicit_config_file_wins_over_env_variable(tmp_path):
    a = toml(tmp_path, 'name = "a"\n', "a.toml")
    b = toml(tmp_path, 'name = "b"\n', "b.toml")
    assert load(None, a, environ={"KVTIERD_CONFIG": b}).name == "a"


def test_kvtierd_table_in_file(tmp_path):
    path = toml(tmp_path, '[kvtierd]\nsize = 134217728\ndir = "/var/tmp/x"\n')
    cfg = load(None, path, environ={})
    assert cfg.size == 128 << 20
    assert cfg.dir == "/var/tmp/x"


def test_system_config_file_used_when_present(tmp_path, monkeypatch):
    path = toml(tmp_path, 'name = "system"\n', "system.toml")
    monkeypatch.setattr(C, "DEFAULT_CONFIG_FILE", path)
    cfg = load(None, None, environ={})
    assert cfg.name == "system" and cfg.sources["name"] == f"file:{path}"


# --- errors ----------------------------------------------------------------------------------------
def test_unknown_toml_key(tmp_path):
    path = toml(tmp_path, 'size = "64MiB"\nsizee = "1GiB"\npage = 1\n')
    with pytest.raises(ValueError) as info:
        load(None, path, environ={})
    msg = str(info.value)
    assert "sizee" in msg and "page" in msg and path in msg


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load(None, str(tmp_path / "nope.toml"), environ={})
    bad = toml(tmp_path, "size = = 3\n")
    with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
        load(None, bad, environ={})


@pytest.mark.parametrize("name,raw", [
    ("size", "1MiB"), ("size", "7MiB"), ("size", "2PiB"), ("size", "lots"), ("size", "-5"),
    ("page_size", "1024"), ("page_size", "2GiB"),
    ("prefault_threads", "0"), ("prefault_threads", "257"), ("prefault_threads", "four"), ("prefault_threads", "2.5"),
    ("job_timeout", "0"), ("job_timeout", "0.01"), ("job_timeout", "86401"), ("job_timeout", "soon"),
    ("job_timeout", "inf"), ("job_timeout", "nan"), ("job_timeout", "-1"),
    ("pin", "always"), ("pin", "CUDA"), ("log_level", "trace"), ("recreate", "perhaps"),
])
def test_bound_violations_name_the_setting(name, raw, tmp_path):
    with pytest.raises(ValueError, match=name):
        BY_NAME[name].parse(raw)
    with pytest.raises(ValueError, match=name):
        load(None, None, environ={BY_NAME[name].env: raw})
    with pytest.raises(ValueError, match=name):
        load(parse_flags(BY_NAME[name].flag, raw) if BY_NAME[name].type != "bool" else
             argparse.Namespace(**{name: raw}), None, environ={})


@pytest.mark.parametrize("text,name", [('size = "1KiB"', "size"), ('pin = "sometimes"', "pin"),
                                       ("prefault_threads = 0", "prefault_threads"), ("job_timeout = -3", "job_timeout"),
                                       ('size = "big"', "size"), ("recreate = 3", "recreate")])
def test_bad_values_in_file_name_the_setting(tmp_path, text, name):
    with pytest.raises(ValueError, match=name):
        load(None, toml(tmp_path, text + "\n"), environ={})


def test_bounds_are_inclusive():
    assert BY_NAME["size"].parse("8MiB") == 8 << 20
    assert BY_NAME["prefault_threads"].parse("256") == 256
    assert BY_NAME["job_timeout"].parse("0.05") == 0.05
    assert BY_NAME["page_size"].parse("4096") == 4096
    assert math.isclose(BY_NAME["job_timeout"].parse(86400), 86400)


def test_bound_message_shows_sizes_readably():
    with pytest.raises(ValueError, match="8MiB"):
        BY_NAME["size"].parse("1MiB")


@pytest.mark.parametrize("text,name", [("prefault_threads = 2.5", "prefault_threads"),
                                       ("prefault_threads = true", "prefault_threads"),
                                       ("job_timeout = true", "job_timeout"), ("job_timeout = nan", "job_timeout")])
def test_toml_values_are_not_coerced_silently(tmp_path, text, name):
    with pytest.raises(ValueError, match=name):
        load(None, toml(tmp_path, text + "\n"), environ={})


def test_toml_native_types(tmp_path):
    path = toml(tmp_path, "size = 67108864\nrecreate = true\njob_timeout = 1.5\nprefault_threads = 2.0\n")
    cfg = load(None, path, environ={})
    assert (cfg.size, cfg.recreate, cfg.job_timeout, cfg.prefault_threads) == (64 << 20, True, 1.5, 2)
    assert type(cfg.prefault_threads) is int and type(cfg.job_timeout) is float
    assert load(None, toml(tmp_path, "job_timeout = 7\n"), environ={}).job_timeout == 7.0

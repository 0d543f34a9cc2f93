"""kvtier.integrations.common: the version gate, the settings reader and protocol-sized names that
the engine adapters share (each adapter's own use of them is tested with its engine: tests/vllm,
tests/sglang)."""

from __future__ import annotations

import logging

import pytest

from kvtier.integrations.common import check_engine_version, read_settings, shorten
from kvtierd.contract.paths import default_socket

KEYS = {"kvtier_socket": "socket", "kvtier_namespace": "namespace", "kvtier_timeout_s": "timeout_s",
        "kvtier_wait_ms": "wait_ms"}
NUMBERS = {"timeout_s": ("seconds", False), "wait_ms": ("milliseconds", True)}


class Unsupported(ImportError):
    pass


def check(installed: str, supported: bool) -> str:
    return check_engine_version(installed, supported, adapter="Engine plugin", engine="Engine", versions="1.x",
                                pin="engine==1.0", allow_env="KVTIER_TEST_ALLOW", error=Unsupported,
                                logger=logging.getLogger("test.kvtier"))


def test_an_unsupported_engine_fails_naming_the_supported_versions_unless_allowed(monkeypatch, caplog):
    monkeypatch.delenv("KVTIER_TEST_ALLOW", raising=False)
    assert check("1.2", True) == "1.2"
    with pytest.raises(Unsupported, match=r"kvtier's Engine plugin supports Engine 1\.x; this process has Engine 2\.0"
                                          r"\. Install a supported Engine \(pip install 'engine==1\.0'\)"):
        check("2.0", False)
    monkeypatch.setenv("KVTIER_TEST_ALLOW", "1")
    with caplog.at_level(logging.WARNING, logger="test.kvtier"):
        assert check("2.0", False) == "2.0"
    assert "KVTIER_TEST_ALLOW=1: continuing" in caplog.text


def test_settings_are_read_and_checked():
    assert read_settings({"kvtier_timeout_s": "2.5", "kvtier_wait_ms": 0, "kvtier_namespace": None,
                          "other_key": "engine's own"}, KEYS, NUMBERS, where="extra") == \
        {"socket": default_socket(), "timeout_s": 2.5, "wait_ms": 0.0}
    assert read_settings(None, KEYS, NUMBERS, where="extra") == {"socket": default_socket()}
    for extra, match in [({"kvtier_sockett": "/s"}, r"unknown extra keys \['kvtier_sockett'\]; kvtier's keys are "
                                                    r"\['kvtier_namespace', 'kvtier_socket', 'kvtier_timeout_s', "
                                                    r"'kvtier_wait_ms'\]"),
                         ({"kvtier_timeout_s": 0}, "kvtier_timeout_s must be > 0, got 0"),
                         ({"kvtier_wait_ms": -1}, "kvtier_wait_ms must be >= 0, got -1"),
                         ({"kvtier_timeout_s": "soon"}, "kvtier_timeout_s must be a number of seconds"),
                         ({"kvtier_namespace": 7}, "kvtier_namespace must be a non-empty string"),
                         ({"kvtier_socket": ""}, "kvtier_socket must be a non-empty string")]:
        with pytest.raises(ValueError, match=match):
            read_settings(extra, KEYS, NUMBERS, where="extra")


def test_a_name_too_long_is_shortened_and_stays_unique():
    assert shorten("short", 16) == "short"
    long = shorten("é" * 200, 64)
    assert len(long.encode()) <= 64 and long != shorten("é" * 201, 64) and long.startswith("é")

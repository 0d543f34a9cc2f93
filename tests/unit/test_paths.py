"""kvtierd.contract.paths: <dir>/<name>.{region,lock,sock,admin.sock,tier.sock,tier.log} and the default
directory."""

from __future__ import annotations

import os

from kvtierd import config
from kvtierd.contract import paths as paths_mod
from kvtierd.contract.paths import DEFAULT_NAME, DaemonPaths, admin_socket_for, default_directory, default_socket


def test_the_convention():
    p = DaemonPaths("/run/x", "cache")
    assert (p.region, p.lock, p.socket, p.admin_socket) == (
        "/run/x/cache.region", "/run/x/cache.lock", "/run/x/cache.sock", "/run/x/cache.admin.sock")
    assert (p.tier_socket, p.tier_log) == ("/run/x/cache.tier.sock", "/run/x/cache.tier.log")
    assert DaemonPaths("/d") == DaemonPaths("/d", DEFAULT_NAME) and DaemonPaths("/d").socket == "/d/kvtierd.sock"


def test_admin_socket_beside_any_client_socket():
    assert admin_socket_for("/a/b.sock") == "/a/b.admin.sock"
    assert admin_socket_for("/a/odd-name") == "/a/odd-name.admin.sock"


def test_default_directory_and_the_daemon_defaults_agree():
    directory = default_directory()
    if os.access("/dev/shm", os.W_OK | os.X_OK):
        assert directory == "/dev/shm/kvtierd"
    assert config.load(None, None, environ={}).dir == directory
    assert config.BY_NAME["name"].default == DEFAULT_NAME


def test_default_directory_without_dev_shm(monkeypatch, tmp_path):
    writable = {str(tmp_path)}
    monkeypatch.setattr(paths_mod.os, "access", lambda path, mode: path in writable)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_directory() == str(tmp_path / "kvtierd")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_directory() == f"/tmp/kvtierd-{os.getuid()}"


def test_default_socket(monkeypatch):
    monkeypatch.setenv("KVTIERD_SOCKET", "/x/y.sock")
    assert default_socket() == "/x/y.sock"
    monkeypatch.delenv("KVTIERD_SOCKET")
    assert default_socket() == DaemonPaths(default_directory()).socket

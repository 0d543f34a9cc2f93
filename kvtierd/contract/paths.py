"""Where a daemon's files live: the one place that spells the path convention.

All in one daemon-owned directory (mode 2750 with a client group: its members may enter and
read it, not create, rename or remove anything in it; 0700 without)::

    <dir>/<name>.region      the region's pages (mode 0660, the client group), mapped by every client
    <dir>/<name>.meta        the region's tables (mode 0600: the daemon's user alone)
    <dir>/<name>.lock        flock(LOCK_EX) held for the daemon's whole life; holds its pid
    <dir>/<name>.sock        the client socket (ZMQ ipc, mode 0660: the daemon's user and client group)
    <dir>/<name>.admin.sock  the admin socket (mode 0600: the daemon's user alone)
    <dir>/<name>.tier.sock   the second tier's companion's socket (mode 0600), with a second tier
    <dir>/<name>.tier.log    the companion's output

The default directory is /dev/shm/kvtierd when /dev/shm is writable (the region's home: tmpfs,
so the region lives in memory and a SIGKILLed daemon loses nothing it wrote), else
$XDG_RUNTIME_DIR/kvtierd, else /tmp/kvtierd-<uid>; the default name is ``kvtierd``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_NAME = "kvtierd"
SOCKET_SUFFIX = ".sock"
ADMIN_SOCKET_SUFFIX = ".admin.sock"


def default_directory() -> str:
    """/dev/shm/kvtierd when /dev/shm is writable, else $XDG_RUNTIME_DIR/kvtierd, else /tmp."""
    if os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm/kvtierd"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.access(runtime, os.W_OK | os.X_OK):
        return os.path.join(runtime, "kvtierd")
    return f"/tmp/kvtierd-{os.getuid()}"


def admin_socket_for(socket: str) -> str:
    """The admin socket beside a client socket (<dir>/<name>.admin.sock next to <dir>/<name>.sock)."""
    return socket.removesuffix(SOCKET_SUFFIX) + ADMIN_SOCKET_SUFFIX


def default_socket() -> str:
    """$KVTIERD_SOCKET, else the client socket of a default-configured daemon."""
    if "KVTIERD_SOCKET" in os.environ:
        return os.environ["KVTIERD_SOCKET"]
    return DaemonPaths(default_directory()).socket


@dataclass(frozen=True)
class DaemonPaths:
    directory: str
    name: str = DEFAULT_NAME

    def _path(self, suffix: str) -> str:
        return os.path.join(self.directory, self.name + suffix)

    @property
    def region(self) -> str:
        return self._path(".region")

    @property
    def meta(self) -> str:
        return self._path(".meta")

    @property
    def lock(self) -> str:
        return self._path(".lock")

    @property
    def socket(self) -> str:
        return self._path(SOCKET_SUFFIX)

    @property
    def admin_socket(self) -> str:
        return admin_socket_for(self.socket)

    @property
    def tier_socket(self) -> str:
        return self._path(".tier.sock")

    @property
    def tier_log(self) -> str:
        return self._path(".tier.log")

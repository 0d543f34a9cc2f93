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
    <dir>/<name>.tier.key    the second tier's seal key, generated (mode 0600) when tier_key_file is not set

The default directory is /dev/shm/kvtierd when /dev/shm is writable (the region's home: tmpfs,
so the region lives in memory and a SIGKILLed daemon loses nothing it wrote), else
$XDG_RUNTIME_DIR/kvtierd, else /tmp/kvtierd-<uid>; the default name is ``kvtierd``.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass

DEFAULT_NAME = "kvtierd"
SOCKET_SUFFIX = ".sock"
ADMIN_SOCKET_SUFFIX = ".admin.sock"
MAX_SOCKET_PATH = 107          # sun_path is 108 bytes with the terminating NUL


def check_socket_path(path: str) -> None:
    """ValueError naming the settings when ``path`` is too long for a unix socket."""
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {path} is {len(path.encode())} bytes; ipc paths are limited to "
                         f"{MAX_SOCKET_PATH}. Choose a shorter dir or name (settings dir, name)")


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


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def access_problem(path: str, write: bool = False) -> str | None:
    """Why this process may not open ``path`` (a socket, or with ``write`` False a file to read)
    of a daemon's directory, in words that name the fix; None when it may, or when it is missing.

    The directory (2750) admits the daemon's user and its client group; the admin socket and the
    metadata file (0600) the daemon's user alone (and root)."""
    directory = os.path.dirname(path) or "."
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except PermissionError:
        try:
            group = _group(os.stat(directory).st_gid)
        except OSError:
            group = "the daemon's client group"
        return (f"permission denied: {directory} admits only the daemon's user and the members of group {group}; "
                f"add this user to it (usermod -aG {group} USER, then log in again)")
    if os.access(path, os.W_OK if write else os.R_OK):
        return None
    owner = _user(st.st_uid)
    if stat.S_IMODE(st.st_mode) & 0o077 == 0:
        what = "the admin socket" if path.endswith(ADMIN_SOCKET_SUFFIX) else os.path.basename(path)
        return (f"permission denied: {what} ({path}) is the daemon user's ({owner}) alone; run this as {owner} "
                f"(sudo -u {owner} kvtierctl ...) or as root")
    group = _group(st.st_gid)
    return (f"permission denied: {path} is open to its owner {owner} and group {group} only; add this user to "
            f"{group} (usermod -aG {group} USER, then log in again)")


@dataclass(frozen=True)
class DaemonPaths:
    directory: str
    name: str = DEFAULT_NAME

    @classmethod
    def of_socket(cls, socket: str) -> DaemonPaths:
        """The paths of the daemon that serves the client socket ``socket`` (<dir>/<name>.sock)."""
        directory, base = os.path.split(os.path.abspath(socket))
        return cls(directory, base.removesuffix(SOCKET_SUFFIX))

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

    @property
    def tier_key(self) -> str:
        """The seal key's file when ``tier_key_file`` is not set and the tier is not on disk."""
        return self._path(".tier.key")

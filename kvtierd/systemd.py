"""sd_notify(3), implemented directly: READY, STATUS, STOPPING and WATCHDOG messages.

Does nothing at all when NOTIFY_SOCKET is unset (not started by systemd with Type=notify), so
the daemon behaves the same in a terminal, a container or a test. The socket may be a path or
an abstract name (leading '@').
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._sock: socket.socket | None = None
        self._address: str | bytes = ""
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # WATCHDOG_USEC applies only to the process systemd started (WATCHDOG_PID, when set).
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_interval: float | None = None
        if self._sock is not None and usec and (not pid or int(pid) == os.getpid()):
            self.watchdog_interval = int(usec) / 1e6 / 2   # ping twice per period, as systemd advises

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> None:
        """notify(READY=1, STATUS="...") sends 'READY=1\\nSTATUS=...'."""
        if self._sock is None:
            return
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(message, self._address)
        except OSError as exc:  # systemd gone or socket full: never fatal for the daemon
            log.debug("sd_notify failed: %s", exc)

    def status(self, text: str) -> None:
        self.notify(STATUS=text)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

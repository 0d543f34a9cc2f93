"""A kvtierd child process: start it, know when it serves, talk to it, stop it, clean up after it.

The one launcher for the places that run a real daemon next to their callers: ``kvtierctl bench``
(``kvtierbench``), the soak, the crash test and the integration tests; each passes its own
settings as flags. The daemon counts as ready when its socket answers a ping (it binds the socket
only after the region is adopted or created, so a ping answer means a serving daemon). Its output
goes to ``<dir>/daemon.log``.

``wrapper`` runs the daemon under another command; ``in_own_pid_namespace()`` is the one the tests
use: ``unshare`` puts the daemon in a PID namespace of its own, so that it cannot see its clients'
processes, as a daemon in one pod cannot see an engine in another. Signals then go to the daemon
itself (``pid``), not to the wrapper.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

from kvtierd.contract.paths import DEFAULT_NAME, DaemonPaths


class DaemonProcess:
    def __init__(self, directory: str, *args: str, name: str = DEFAULT_NAME, env: dict[str, str] | None = None,
                 start_timeout: float = 60.0, call_timeout: float = 30.0, wrapper: Sequence[str] = ()):
        self.dir = directory
        self.name = name
        self.paths = DaemonPaths(directory, name)
        self.socket = self.paths.socket
        self.admin_socket = self.paths.admin_socket
        self.region = self.paths.region
        self.log_path = os.path.join(directory, "daemon.log")
        self.args = ["--dir", directory, "--name", name, *args]
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout  # seconds from launch to serving before giving up
        self.call_timeout = call_timeout    # seconds a request waits for its reply
        self.wrapper = list(wrapper)        # a command the daemon runs under, e.g. ("prlimit", "--nofile=1024:1024", "--")
        self.proc: subprocess.Popen | None = None

    def launch(self) -> "DaemonProcess":
        """Start the process without waiting for it to serve."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.wrapper, sys.executable, "-m", "kvtierd", *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        return self

    @property
    def pid(self) -> int:
        """The daemon's pid (as this process sees it): the wrapper's child, if there is a wrapper."""
        if not self.wrapper:
            return self.proc.pid
        deadline = time.monotonic() + 10
        while True:
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    children = f.read().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the daemon under {self.wrapper[0]} has not started")
            time.sleep(0.01)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the daemon itself."""
        os.kill(self.pid, sig)

    def wait_ready(self, timeout: float | None = None) -> None:
        from kvtierd.contract.errors import KvtierError
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if os.path.exists(self.socket):
                try:
                    self.call("ping", timeout=1.0)
                    return
                except KvtierError:
                    pass
            time.sleep(0.002)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"kvtierd did not become ready in {timeout}s:\n{self.log()[-3000:]}")

    def start(self, timeout: float | None = None) -> float:
        """Launch and wait until it serves; returns the seconds from launch to serving."""
        started = time.perf_counter()
        self.launch()
        self.wait_ready(timeout)
        return time.perf_counter() - started

    def call(self, op: str, admin: bool = False, timeout: float | None = None, **fields):
        """One request on a fresh channel (the admin socket for admin operations)."""
        from kvtierd.contract.channel import Channel
        channel = Channel(self.admin_socket if admin else self.socket, timeout=timeout or self.call_timeout)
        try:
            return channel.call(op, **fields)
        finally:
            channel.close()

    def stats(self) -> dict:
        return self.call("stats")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def rss(self) -> dict[str, int]:
        """VmRSS, RssAnon, RssFile and RssShmem of the daemon, in bytes."""
        out = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signal the daemon (SIGTERM: drain and stop cleanly) and reap it; SIGKILL after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            self.send_signal(sig)
        except (ProcessLookupError, RuntimeError):
            pass                    # it is exiting already
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if self.wrapper:
                try:
                    self.send_signal(signal.SIGKILL)
                except (ProcessLookupError, RuntimeError):
                    pass
            self.proc.kill()
            return self.proc.wait(10)

    def cleanup(self) -> None:
        """Stop the daemon (if it runs) and remove its directory with everything in it."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def in_own_pid_namespace() -> list[str]:
    """A wrapper that runs the daemon in a new PID namespace (``unshare``; a user namespace too
    when not root), where its clients' pids read 0: it must treat every client as unwatchable.
    The daemon is pid 1 there: SIGKILL from outside still works, and it handles SIGTERM."""
    wrapper = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL"]
    if os.geteuid() != 0:
        wrapper[1:1] = ["--user", "--map-root-user"]
    return wrapper

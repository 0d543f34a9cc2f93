"""Fixtures that start real kvtierd processes and real rank processes, and clean up after them.

Every daemon gets its own short-lived directory under /tmp (never /dev/shm/kvtierd, never a
shared path); teardown stops the daemon (SIGTERM, then SIGKILL) and removes the directory with
its region, lock and socket. Rank processes come from a session-wide pool (spawning a process
that imports torch costs seconds) and are disconnected after each test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from kvtier.errors import KvtierError
from kvtier.session import Channel

from .ranks import RankProcess

pytestmark = pytest.mark.integration


class DaemonProcess:
    def __init__(self, *args: str, size: str = "32MiB", job_timeout: float = 20.0, page_size: str = "64KiB",
                 env: dict[str, str] | None = None, root: str = "/tmp"):
        # root="/dev/shm" for tests that pin the region with CUDA: since Linux 6.5 the kernel may
        # refuse to pin file-backed pages that are not on tmpfs.
        self.dir = tempfile.mkdtemp(prefix="kvt-", dir=root)
        self.name = "kvtierd"
        self.socket = os.path.join(self.dir, f"{self.name}.sock")
        self.region = os.path.join(self.dir, f"{self.name}.region")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.args = ["--dir", self.dir, "--name", self.name, "--size", size, "--page-size", page_size,
                     "--pin", "off", "--job-timeout", str(job_timeout), "--log-level", "debug",
                     "--metrics-address", "127.0.0.1:0", *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def launch(self) -> "DaemonProcess":
        """Start the process without waiting for it to serve."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtierd", *self.args], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
        return self

    def start(self, timeout: float = 30.0) -> "DaemonProcess":
        self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket):
                try:
                    self.call("ping")
                    return self
                except KvtierError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"kvtierd did not become ready in {timeout}s:\n{self.log()}")

    def call(self, op: str, **fields):
        channel = Channel(self.socket, timeout=5)
        try:
            return channel.call(op, **fields)
        finally:
            channel.close()

    def stats(self) -> dict:
        return self.call("stats")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def cleanup(self) -> None:
        self.stop()
        if self.proc is not None:
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def start_daemon():
    """Factory: start_daemon(*extra_args, size=..., job_timeout=...) → a ready DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(*args: str, wait: bool = True, **kwargs) -> DaemonProcess:
        d = DaemonProcess(*args, **kwargs)
        started.append(d)
        return d.start() if wait else d.launch()

    yield start
    for d in started:
        d.cleanup()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon()


@pytest.fixture(scope="session")
def _rank_pool():
    pool: list[RankProcess] = []
    yield pool
    for r in pool:
        r.stop()


@pytest.fixture
def ranks(_rank_pool):
    """Factory: ranks(n) → n live rank processes; they are disconnected after the test."""
    used: list[RankProcess] = []

    def get(n: int) -> list[RankProcess]:
        _rank_pool[:] = [r for r in _rank_pool if r.proc.is_alive()]
        while len(_rank_pool) < len(used) + n:
            _rank_pool.append(RankProcess())
        chosen = [r for r in _rank_pool if r not in used][:n]
        used.extend(chosen)
        return chosen

    yield get
    for r in used:
        if r.proc.is_alive():
            try:
                r.call("close", timeout=30)
            except Exception:
                r.proc.kill()
                r.proc.join(5)

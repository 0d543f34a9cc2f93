"""Fixtures that start real kvtierd processes and real rank processes, and clean up after them.

Every daemon gets its own short-lived directory under /tmp (never /dev/shm/kvtierd, never a
shared path); teardown stops the daemon (SIGTERM, then SIGKILL) and removes the directory with
its region, lock and socket. Rank processes come from a session-wide pool (spawning a process
that imports torch costs seconds) and are disconnected after each test.
"""

from __future__ import annotations

import tempfile

import pytest

from kvtierbench.launcher import DaemonProcess, in_own_pid_namespace

from .ranks import RankProcess

pytestmark = pytest.mark.integration


def new_daemon(*args: str, size: str = "32MiB", job_timeout: float = 20.0, page_size: str = "64KiB",
                env: dict[str, str] | None = None, root: str = "/tmp", own_pid_namespace: bool = False,
                wrapper: tuple[str, ...] = ()) -> DaemonProcess:
    """A test daemon in its own fresh directory (removed by ``cleanup``), small and unpinned.
    ``own_pid_namespace``: the daemon cannot see its clients' processes (as from another pod);
    ``wrapper``: another command it runs under (e.g. prlimit)."""
    # root="/dev/shm" for tests that pin the region with CUDA: since Linux 6.5 the kernel may
    # refuse to pin file-backed pages that are not on tmpfs.
    return DaemonProcess(tempfile.mkdtemp(prefix="kvt-", dir=root), "--size", size, "--page-size", page_size,
                         "--pin", "off", "--job-timeout", str(job_timeout), "--log-level", "debug",
                         "--metrics-address", "127.0.0.1:0", *args, env=env, start_timeout=30.0,
                         wrapper=(*in_own_pid_namespace(), *wrapper) if own_pid_namespace else wrapper)


@pytest.fixture
def start_daemon():
    """Factory: start_daemon(*extra_args, size=..., job_timeout=...) → a ready DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(*args: str, wait: bool = True, **kwargs) -> DaemonProcess:
        d = new_daemon(*args, **kwargs)
        started.append(d)
        if wait:
            d.start()
        else:
            d.launch()
        return d

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

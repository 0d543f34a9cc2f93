"""The command-line entry points as an operator uses them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from kvtierd import hugepages

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BIN = os.path.dirname(sys.executable)


@pytest.mark.parametrize("root", ["/tmp", "/dev/shm"])
def test_plain_kvtierd_starts_on_the_embedded_default_and_stops_on_sigterm(root):
    """`kvtierd` with no flags and no config file (directory redirected by env so that the
    test never touches /dev/shm/kvtierd) prints its socket, geometry and pages, serves, stops
    cleanly; on /dev/shm (`make run`'s) whether or not it gives huge pages (hugepages=auto)."""
    if not os.access(root, os.W_OK):
        pytest.skip(f"{root} is not writable here")
    found = hugepages.offer(root)
    directory = tempfile.mkdtemp(prefix="kvt-", dir=root)
    env = {**os.environ, "KVTIERD_DIR": directory, "KVTIERD_SIZE": "16MiB", "KVTIERD_PIN": "off",
           "KVTIERD_METRICS_ADDRESS": "127.0.0.1:0"}
    env.pop("KVTIERD_CONFIG", None)
    proc = subprocess.Popen([os.path.join(BIN, "kvtierd")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line, head = "", ""
        while "ready:" not in line:
            line = proc.stdout.readline()
            head += line
            assert line, "kvtierd exited before it was ready"
        socket = os.path.join(directory, "kvtierd.sock")
        assert f"socket={socket}" in line
        assert re.search(r"pages=\d+ page_size=64KiB capacity=\S+", line)
        assert re.search(r"hugepages=(none|thp|hugetlb) huge_page_size=\S+ huge_bytes=\S+", line)
        if found.kind == "none" and found.fs_type == "tmpfs":     # a tmpfs without huge pages: 4 KiB ones
            assert "hugepages=none" in line
        out = subprocess.run([os.path.join(BIN, "kvtierctl"), "--socket", socket, "stats", "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats["page_size"] == 65536 and stats["entries_ready"] == 0
        assert stats["region"] == os.path.join(directory, "kvtierd.region")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        rest = proc.stdout.read()
        assert "stopped cleanly" in rest
        if found.kind == "none":                                    # one info line says how to get them
            assert "hugepages=auto: the region uses" in head
        assert not os.path.exists(socket)
        assert os.path.exists(os.path.join(directory, "kvtierd.region"))  # the cache outlives the daemon
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def test_second_daemon_on_the_same_region_refuses_clearly(daemon):
    out = subprocess.run([sys.executable, "-m", "kvtierd", "--dir", daemon.dir, "--size", "32MiB", "--pin", "off"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert f"another kvtierd (pid {daemon.proc.pid}) holds" in out.stderr
    assert "--name" in out.stderr            # says how to fix it
    assert daemon.stats()["entries_ready"] == 0   # the first one is unharmed


def test_restart_adopts_the_region_and_keeps_ready_blocks(start_daemon, ranks):
    from .test_tp_roundtrip import CacheSpec, all_call, connect, keys_for
    daemon = start_daemon()
    procs = ranks(2)
    connect(procs, daemon, "restart", CacheSpec(), "replicated", seeds=[4, 4])
    keys = keys_for("restart", 3)
    for s in all_call(procs, "store", job=1, keys=keys, block_ids=[0, 1, 2]):
        assert s["ok"]
    src = procs[0].call("hashes", block_ids=[0, 1, 2])
    all_call(procs, "close")
    assert daemon.stop() == 0
    daemon.start()
    assert "3 ready entries recovered" in daemon.log()
    connect(procs, daemon, "restart", CacheSpec(), "replicated", seeds=[9, 9])
    for x in all_call(procs, "load", job=1, keys=keys, block_ids=[5, 6, 7]):
        assert x["hits"] == 3 and x["ok"]
    for hashes in all_call(procs, "hashes", block_ids=[5, 6, 7]):
        assert hashes == src


def test_bad_settings_fail_with_the_setting_named(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvtierd", "--dir", str(tmp_path), "--page-size", "1000"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "page_size" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvtierd", "--dir", str(tmp_path), "--size", "lots"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "setting size" in out.stderr


def test_kvtierctl_without_a_daemon_says_so(tmp_path):
    out = subprocess.run([os.path.join(BIN, "kvtierctl"), "--socket", str(tmp_path / "none.sock"), "stats"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "is the daemon running" in out.stderr


def test_kvtierctl_stats_table(daemon):
    out = subprocess.run([os.path.join(BIN, "kvtierctl"), "--dir", daemon.dir, "stats"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^capacity_bytes\s+\d+ \(", out.stdout, re.M)
    assert re.search(r"^pinned\s+off$", out.stdout, re.M)


def test_sigkill_leaves_an_adoptable_region_and_a_takeable_lock(daemon):
    os.kill(daemon.proc.pid, signal.SIGKILL)
    daemon.proc.wait(10)
    daemon.start()
    assert "last stop unclean" in daemon.log()
    assert daemon.stats()["daemon_pid"] == daemon.proc.pid


def failed_start(directory, *args: str, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    out = subprocess.run([*wrapper, sys.executable, "-m", "kvtierd", "--dir", str(directory), "--size", "32MiB",
                          "--pin", "off", *args], capture_output=True, text=True, timeout=50)
    assert out.returncode == 1 and "cannot start: " in out.stderr and "Traceback" not in out.stderr, out.stderr
    return out


def left_behind(directory) -> set[str]:
    """What a failed start left in its directory: the lock file only (released; harmless)."""
    return set(os.listdir(directory)) - {"kvtierd.lock"} if os.path.isdir(directory) else set()


def test_a_bad_or_taken_metrics_address_fails_before_the_region_is_touched(tmp_path):
    # Issue 27 item 5: 127.0.0.1:99999 ended in an OverflowError traceback and a taken port failed
    # only after the whole region was prefaulted (minutes for 64 GiB, repeated by Restart=on-failure),
    # leaving the sockets behind.
    out = failed_start(tmp_path / "a", "--metrics-address", "127.0.0.1:99999")
    assert "port of 0..65535" in out.stderr and "metrics_address" in out.stderr
    assert left_behind(tmp_path / "a") == set()
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = failed_start(tmp_path / "b", "--metrics-address", f"127.0.0.1:{port}")
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr
    assert left_behind(tmp_path / "b") == set(), "the region was created before the metrics address was checked"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("prlimit") is None or shutil.which("setpriv") is None,
                    reason="needs root, prlimit and setpriv (to drop CAP_IPC_LOCK, which lifts the memlock limit)")
def test_a_memlock_limit_too_low_for_pin_mlock_fails_before_the_prefault(tmp_path):
    no_ipc_lock = ("prlimit", "--memlock=1048576:1048576", "setpriv", "--bounding-set=-ipc_lock",
                   "--inh-caps=-ipc_lock")
    out = failed_start(tmp_path / "d", "--pin", "mlock", wrapper=no_ipc_lock)
    assert "exceed the memlock limit (RLIMIT_MEMLOCK soft limit 1048576)" in out.stderr and "LimitMEMLOCK" in out.stderr
    assert left_behind(tmp_path / "d") == set()


def test_a_start_that_fails_after_the_region_leaves_nothing_behind(tmp_path):
    # The admin socket cannot be bound (a directory holds its path): the region was made and the
    # client socket bound by then. Both go, and the lock is released: the next start serves.
    directory = tmp_path / "e"
    directory.mkdir()
    (directory / "kvtierd.admin.sock").mkdir()
    out = failed_start(directory, "--metrics-address", "127.0.0.1:0")
    assert "kvtierd.admin.sock" in out.stderr
    assert left_behind(directory) == {"kvtierd.admin.sock"}
    (directory / "kvtierd.admin.sock").rmdir()
    from kvtierbench.launcher import DaemonProcess
    daemon = DaemonProcess(str(directory), "--size", "32MiB", "--pin", "off", "--metrics-address", "127.0.0.1:0")
    try:
        daemon.start()
        assert daemon.stats()["entries_ready"] == 0
    finally:
        daemon.stop()

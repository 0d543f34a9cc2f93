"""deploy/systemd/kvtierd.service booted for real: systemd as PID 1 in a container (systemd-nspawn).

The container's root is an overlay of this machine's own root (nothing downloaded, nothing on the
host changed), its /dev/shm a fresh empty tmpfs, as after a reboot. The shipped unit, sysusers
file and example config are installed as docs/operations.md section 2 says; systemd creates the
users and starts kvtierd at boot (the unit is enabled); a probe unit ordered after it records what
systemd says of the service, checks the unit with ``systemd-analyze verify``, talks to the daemon
as a member of the client group through ``kvtierctl --config``, restarts it and powers off.

Needs root, overlayfs and systemd-nspawn (``make deploy-install`` installs Debian's
systemd-container); skipped with the reason when one is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "kvtierd.service"
SYSUSERS = ROOT / "deploy" / "systemd" / "kvtierd.sysusers.conf"
EXAMPLE = ROOT / "deploy" / "kvtierd.example.toml"
BOOT_TIMEOUT = 240

# kvtierd and kvtierctl for the container: the system's python3 (the unit's ProtectHome= hides a
# Python under /root) with this checkout and its virtual environment's packages on its path, both
# bound under /opt (the unit's PrivateTmp= hides a checkout under /tmp); ``kvtier`` is client/.
LIB = "/opt/kvtierd"
WRAPPER = f"""#!/bin/sh
exec /usr/bin/python3 -c 'import sys; sys.path[:0] = ["{LIB}/src", "{LIB}/shim", "{LIB}/site"]
from kvtierd.cli import {{main}}; sys.exit({{main}}())' "$@"
"""

PROBE = """#!/bin/sh
show() {{ systemctl show kvtierd -p ActiveState -p SubState -p Result -p ExecMainStatus \\
    -p NRestarts; }}
engine() {{ setpriv --reuid engine --regid engine --init-groups "$@"; }}
show > /probe/boot.txt
ls -la /dev/shm/kvtierd > /probe/ls.txt 2>&1
systemd-analyze verify /etc/systemd/system/kvtierd.service > /probe/verify.txt 2>&1
echo "rc=$?" >> /probe/verify.txt
engine /usr/local/bin/kvtierctl --config /etc/kvtierd/kvtierd.toml status --json > /probe/status.json 2> /probe/status.err
engine /usr/local/bin/kvtierctl --config /etc/kvtierd/kvtierd.toml stats --json > /probe/stats.json 2> /probe/stats.err
systemctl restart kvtierd
show > /probe/restart.txt
engine /usr/local/bin/kvtierctl --config /etc/kvtierd/kvtierd.toml status --json > /probe/status2.json 2>&1
journalctl -u kvtierd --no-pager > /probe/journal.txt 2>&1
systemctl poweroff
"""


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (an overlay mount and systemd-nspawn)"
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is not installed (make deploy-install: Debian's systemd-container)"
    if not Path("/lib/systemd/systemd").exists() or not Path("/usr/bin/python3").exists():
        return "the container is this machine's root: it needs /lib/systemd/systemd and /usr/bin/python3"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs"
    return None


def _write(root: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    target.write_text(text)
    target.chmod(mode)


def sources(tmp_path: Path) -> Path:
    """This checkout as the container's users (kvtierd, engine) can read it: a checkout in a
    directory others may not enter (``mktemp -d`` makes it 0700) is copied, its kvtierd/,
    client/ and kvtierbench/ (kvtierctl bench), into a directory they may."""
    if ROOT.stat().st_mode & 0o005 == 0o005:
        return ROOT
    src = tmp_path / "src"
    src.mkdir()
    src.chmod(0o755)
    for name in ("kvtierd", "client", "kvtierbench"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def boot(tmp_path: Path, unit: str, extra_config: str) -> dict[str, str]:
    """Boot a container with ``unit`` installed and enabled; returns the probe's files by name."""
    upper, work, root, probe = (tmp_path / d for d in ("upper", "work", "root", "probe"))
    for d in (upper, work, root, probe):
        d.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/,upperdir={upper},workdir={work}",
                    str(root)], check=True)
    try:
        for name, main in (("kvtierd", "daemon_main"), ("kvtierctl", "ctl_main")):
            _write(root, f"/usr/local/bin/{name}", WRAPPER.format(main=main), 0o755)
        shim = root / LIB.lstrip("/") / "shim"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "kvtier").unlink(missing_ok=True)
        (shim / "kvtier").symlink_to(f"{LIB}/src/client")
        _write(root, "/etc/systemd/system/kvtierd.service", unit)
        wants = root / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        for name in ("kvtierd.service", "kvtierd-probe.service"):
            (wants / name).unlink(missing_ok=True)
            (wants / name).symlink_to(f"/etc/systemd/system/{name}")
        _write(root, "/usr/lib/sysusers.d/kvtierd.conf", SYSUSERS.read_text())
        # An engine's user: a member of the client group, as docs/operations.md asks.
        _write(root, "/usr/lib/sysusers.d/engine.conf", "u engine - \"an engine\"\nm engine kvtier\n")
        _write(root, "/etc/kvtierd/kvtierd.toml", EXAMPLE.read_text() + extra_config)
        _write(root, "/probe.sh", PROBE.format(), 0o755)
        _write(root, "/etc/systemd/system/kvtierd-probe.service",
               "[Unit]\nAfter=kvtierd.service\nWants=kvtierd.service\n[Service]\nType=oneshot\n"
               "ExecStart=/probe.sh\n[Install]\nWantedBy=multi-user.target\n")
        (root / "etc/machine-id").unlink(missing_ok=True)
        proc = subprocess.run(["systemd-nspawn", "-D", str(root), "--register=no", "--keep-unit", "--boot",
                               "--console=pipe", "--link-journal=no", f"--bind={probe}:/probe",
                               f"--bind-ro={sources(tmp_path)}:{LIB}/src",
                               f"--bind-ro={sysconfig.get_paths()['purelib']}:{LIB}/site"],
                              capture_output=True, text=True, timeout=BOOT_TIMEOUT, stdin=subprocess.DEVNULL)
        files = {p.name: p.read_text() for p in probe.iterdir()}
        files["nspawn"] = proc.stdout + proc.stderr
        return files
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def booted(tmp_path_factory) -> dict[str, str]:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    # A small region; metrics on a port the kernel picks (the container shares this machine's network).
    return boot(tmp_path_factory.mktemp("boot"), UNIT.read_text(),
                '\nsize = "32MiB"\nmetrics_address = "127.0.0.1:0"\n')


def test_the_shipped_unit_starts_kvtierd_at_boot(booted):
    # Issue 27 item 1: ReadWritePaths=/dev/shm/kvtierd (no "-") failed with 226/NAMESPACE after a
    # boot, /dev/shm being empty; the unit never started.
    state = _props(booted.get("boot.txt", ""))
    assert state.get("ActiveState") == "active" and state.get("SubState") == "running", (
        state, booted.get("journal.txt"), booted["nspawn"][-3000:])
    assert state["NRestarts"] == "0"
    # The directory the daemon made: its user, the client group, 2750.
    assert "drwxr-s--- " in booted["ls.txt"] and " kvtierd kvtier " in booted["ls.txt"], booted["ls.txt"]


def test_systemd_analyze_verify_accepts_the_unit(booted):
    assert booted["verify.txt"].strip().endswith("rc=0"), booted["verify.txt"]


def test_an_engine_user_reaches_the_daemon_through_its_config_file(booted):
    # kvtierctl --config reads dir and name from the daemon's config file (issue 27 item 4).
    import json
    status = json.loads(booted["status.json"] or "{}")
    assert status.get("daemon") == "running", (booted.get("status.json"), booted.get("status.err"))
    assert status["socket"] == "/dev/shm/kvtierd/kvtierd.sock"
    stats = json.loads(booted["stats.json"] or "{}")
    assert stats.get("pages_total", 0) > 0, booted.get("stats.err")


def test_a_restart_adopts_the_region(booted):
    state = _props(booted.get("restart.txt", ""))
    assert state.get("ActiveState") == "active", booted.get("journal.txt")
    assert "adopted region" in booted["journal.txt"], booted["journal.txt"][-3000:]


if __name__ == "__main__":      # python tests/deploy/test_systemd_boot.py [UNIT]: boot one unit, print the probe
    import tempfile
    unit = Path(sys.argv[1]).read_text() if len(sys.argv) > 1 else UNIT.read_text()
    with tempfile.TemporaryDirectory() as d:
        for name, text in sorted(boot(Path(d), unit, '\nsize = "32MiB"\nmetrics_address = "127.0.0.1:0"\n').items()):
            print(f"== {name}\n{text}")

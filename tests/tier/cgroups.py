"""Real kernel controls over a process for the fault tests: a disk made slow for it (a blkio
throttle) and the process frozen so that it cannot even die (the freezer).

``Throttle(device, bps)``  a cgroup v1 ``blkio`` group whose members' reads and writes of one block
                           device (a loop device under a test filesystem, ``mounts.Mount``) run at
                           ``bps`` bytes per second: the I/O is real and completes, slowly (the
                           block layer holds each bio back until its share of the rate allows it)
``Freezer()``              a cgroup v1 ``freezer`` group: a frozen member sits in uninterruptible
                           sleep (``D``), like a process waiting on a hung device, and a SIGKILL
                           sent to it takes effect only once it is thawed — until then it cannot
                           be reaped (the v2 freezer lets a frozen process die, so only v1 will do)

Each group lives under its own fresh name and ``close`` moves its members back to the root group
and removes it. Both need root and the v1 controller mounted under /sys/fs/cgroup:
``CgroupUnavailable`` says why not, and the tests skip with that reason.
"""

from __future__ import annotations

import os
import time
import uuid

ROOT = "/sys/fs/cgroup"


class CgroupUnavailable(RuntimeError):
    pass


class _Group:
    controller = ""

    def __init__(self):
        base = os.path.join(ROOT, self.controller)
        if os.geteuid() != 0:
            raise CgroupUnavailable(f"a {self.controller} cgroup needs root")
        if not os.path.exists(os.path.join(base, "cgroup.procs")) or os.path.exists(
                os.path.join(base, "cgroup.controllers")):
            raise CgroupUnavailable(f"no cgroup v1 {self.controller} controller at {base}")
        self.path = os.path.join(base, f"kvt-test-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        self.base = base

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def add(self, pid: int) -> None:
        """Move the process (every thread of it) into the group."""
        self._write("cgroup.procs", str(pid))

    def members(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]

    def close(self) -> None:
        if not os.path.isdir(self.path):
            return
        for pid in self.members():
            try:
                with open(os.path.join(self.base, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError:
                pass                           # it exited meanwhile
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Throttle(_Group):
    controller = "blkio"

    def __init__(self, device: str, bps: int):
        super().__init__()
        rdev = os.stat(device).st_rdev
        self.rule = f"{os.major(rdev)}:{os.minor(rdev)}"
        try:
            self.set(bps)
        except OSError:
            self.close()
            raise

    def set(self, bps: int) -> None:
        """Reads and writes of the device at ``bps`` bytes/s (0: no limit)."""
        for name in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"):
            self._write(name, f"{self.rule} {bps}")


class Freezer(_Group):
    controller = "freezer"

    def _state(self) -> str:
        with open(os.path.join(self.path, "freezer.state")) as f:
            return f.read().strip()

    def freeze(self, timeout: float = 10.0) -> None:
        """Freeze every member; returns once the kernel says they are all frozen."""
        self._write("freezer.state", "FROZEN")
        deadline = time.monotonic() + timeout
        while self._state() != "FROZEN":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not freeze ({self._state()})")
            time.sleep(0.01)

    def thaw(self) -> None:
        self._write("freezer.state", "THAWED")

    def close(self) -> None:
        if os.path.isdir(self.path):
            self.thaw()
        super().close()

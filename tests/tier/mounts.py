"""Small real filesystems for the disk tier's fault tests: a tmpfs of a given size (a full disk),
remounted read-only (a read-only disk), or an ext4 image on a loop device that can be shrunk under
the filesystem (a dying disk: the block layer answers EIO past the device's new end).

Every mount lives under its own temporary directory and is unmounted, detached and removed by
``close``. Mounting needs root (and loop devices for ext4): ``MountUnavailable`` says why not,
and the tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile


class MountUnavailable(RuntimeError):
    pass


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise MountUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


class Mount:
    """A mounted filesystem at ``path``; ``close`` undoes everything."""

    def __init__(self, kind: str, size_mib: int):
        if os.geteuid() != 0:
            raise MountUnavailable("mounting a test filesystem needs root")
        self.root = tempfile.mkdtemp(prefix="kvt-mnt-")
        self.path = os.path.join(self.root, "fs")
        os.mkdir(self.path)
        self.loop: str | None = None
        self.image = os.path.join(self.root, "image")
        try:
            if kind == "tmpfs":
                _run("mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", self.path)
            else:
                with open(self.image, "wb") as f:
                    f.truncate(size_mib << 20)
                _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.image)
                self.loop = _run("losetup", "-f", "--show", self.image)
                _run("mount", "-t", "ext4", "-o", "errors=continue", self.loop, self.path)
        except BaseException:
            self.close()
            raise

    def remount(self, mode: str) -> None:
        _run("mount", "-o", f"remount,{mode}", self.path)

    def shrink_device(self, size_mib: int) -> None:
        """Cut the loop device to ``size_mib``: every I/O past it fails with EIO from the block layer."""
        os.truncate(self.image, size_mib << 20)
        _run("losetup", "-c", self.loop)

    def close(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["umount", "-l", self.path], capture_output=True, timeout=60)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

"""Who a client's process is, and whether it is still that process: what the daemon can prove.

A pid alone proves little: it may name another process after the first one died, and a pid from
another PID namespace names nothing here. So the daemon identifies a client's process by what
the kernel tells it, never by what the client claims:

- its pid in the daemon's PID namespace, from the socket's peer credentials (SO_PEERCRED, which
  ZMQ exposes as a frame's ``Peer-Address``); 0 when the process is not visible from here (a
  sibling PID namespace: another container or pod);
- its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), which tells it from a
  later process that got the same pid;
- the boot it runs in (``/proc/sys/kernel/random/boot_id``): every process of an earlier boot is
  dead.

``open_if_same`` is the proof of life a restarted daemon uses: it opens a pidfd on the pid and
then checks the start time, so the pidfd it keeps watches exactly the recorded process (or the
process is gone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Process:
    """A session's process as the daemon knows it.

    ``pid`` and ``start_ticks`` come from the kernel (0: the daemon cannot see the process, so it
    cannot watch it); ``claimed_pid``/``claimed_pidns`` are what the client said at hello and
    ``uid`` the socket peer's user, used only to recognise a process taking over its own orphaned
    session when it cannot be watched.
    """

    pid: int = 0
    start_ticks: int = 0
    claimed_pid: int | None = None
    claimed_pidns: int | None = None
    uid: int | None = None

    @property
    def watchable(self) -> bool:
        return self.pid != 0

    def same_as(self, other: "Process") -> bool:
        """Whether ``other`` is this very process: the same pid and start time when the daemon
        sees both; otherwise the same claimed pid, PID namespace and peer user."""
        if self.pid or other.pid:
            return self.pid == other.pid and self.start_ticks == other.start_ticks
        return (self.claimed_pid is not None and self.claimed_pidns is not None and self.uid is not None
                and (self.claimed_pid, self.claimed_pidns, self.uid)
                == (other.claimed_pid, other.claimed_pidns, other.uid))


def own_pid_namespace() -> int | None:
    """The inode of this process's PID namespace (None where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def boot_id() -> int:
    """64 bits of this boot's id (0 where the kernel does not tell). A failure to read it for want
    of descriptors or memory is raised: a 0 would make every recorded writer one of another boot,
    proven dead."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", "")[:16], 16)
    except (FileNotFoundError, ValueError):
        return 0


def start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None when there is none
    (or /proc could not be read)."""
    try:
        return _start_ticks(pid)
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """``start_ticks``, None only when /proc has no such process: any other failure to read it
    (EMFILE, ENFILE, ENOMEM, ...) says nothing of the process and is raised."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (comm) may hold spaces and parentheses: the fields after it start after the last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])            # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def open_if_same(pid: int, ticks: int) -> int | None:
    """A pidfd on ``pid`` if it is still the process that started at ``ticks``; None if it is
    proven gone: no such process (ESRCH), or another one with that pid (another start time).

    The pidfd is opened first and the start time read after: if the process died in between, the
    pid is free or another process's (another start time) and the pidfd is closed again. Any
    other failure (EMFILE, ENFILE, ENOMEM, ...) proves nothing about the process: it is raised
    as OSError, and the caller keeps what it holds for the process and asks again later.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        same = _start_ticks(pid) == ticks
    except BaseException:
        os.close(fd)
        raise
    if not same:
        os.close(fd)
        return None
    return fd

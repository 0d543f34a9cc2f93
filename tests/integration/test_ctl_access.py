"""kvtierctl run by users other than the daemon's: each is told what stands in its way and how to
get past it, at once (issue 27 item 6). Runs as root: kvtierctl runs in a forked child that dropped
to uid 65534, as tests/integration/test_access.py does (its ``as_uid``)."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

# Imported before the fork: uid 65534 may not read this interpreter's files (under /root here).
import kvtierd.cli  # noqa: F401
import kvtierd.offline  # noqa: F401
import kvtierd.recovery  # noqa: F401

from .test_access import NOBODY, as_uid, client_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: drops to uid 65534 to run kvtierctl")]

NOT_A_MEMBER = 64999        # a gid no file of the daemon carries


def ctl_as(gid: int, *argv: str) -> dict:
    """kvtierctl ``argv`` as uid 65534 with primary group ``gid``: exit status, stdout, stderr."""
    def run() -> dict:
        from kvtierd.cli import ctl_main
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = ctl_main(list(argv))
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (print(exc.code, file=err) or 1)
        return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}
    return as_uid(run, NOBODY, gid)


def test_a_non_member_is_told_which_group_admits_it(start_daemon):
    # It used to read "no kvtierd socket ...; is the daemon running?" of a daemon that ran.
    gid, group = client_group()
    daemon = start_daemon("--group", group)
    for command in ("stats", "status", "namespaces"):
        r = ctl_as(NOT_A_MEMBER, "--socket", daemon.socket, "--timeout", "30", command)
        assert r["rc"] != 0 and f"permission denied: {daemon.dir} admits only the daemon's user and the members " \
            f"of group {group}" in r["err"] and "is the daemon running" not in r["err"], (command, r)


def test_admin_commands_of_a_member_are_refused_at_once(start_daemon):
    # A member used to wait for the whole timeout (5 s by default, 30 here) for a reply from an
    # admin socket it could never open.
    gid, group = client_group()
    daemon = start_daemon("--group", group)
    for command in (("clients",), ("evict", "--count", "1"), ("clear", "--all")):
        r = ctl_as(gid, "--socket", daemon.socket, "--timeout", "30", *command)
        assert r["rc"] == 1 and "permission denied: the admin socket" in r["err"] \
            and "is the daemon user's (root) alone" in r["err"] and "did not answer" not in r["err"], (command, r)
    for command in ("stats", "status"):            # the client socket and the lock are open to it
        assert ctl_as(gid, "--socket", daemon.socket, command)["rc"] == 0


def test_offline_commands_of_a_member_explain_the_metadata_file(start_daemon):
    gid, group = client_group()
    daemon = start_daemon("--group", group)
    daemon.stop()
    for command in (("status",), ("namespaces",), ("entries",), ("check",), ("inspect", "page", "0")):
        r = ctl_as(gid, "--socket", daemon.socket, *command)
        assert r["rc"] != 0 and "kvtierd.meta) is the daemon user's (root) alone; run this as root" in r["err"] \
            and "Errno" not in r["err"], (command, r)

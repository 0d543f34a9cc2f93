"""Nobody else gets in (invariant 11): another uid can neither reach the daemon nor map its region.

Runs only as root: the daemon is started by the fixture as root, and a child process drops to
uid/gid 65534 (``nobody``) before it tries anything. The child is a fork of the test process,
which then calls setgroups([]), setgid, setuid — the same as a ``preexec_fn`` would — rather than
a freshly exec'd interpreter: the interpreter of this virtual environment may live under a
directory that ``nobody`` cannot enter (/root/.pyenv here), and the fork already has kvtier
imported. Each attempt is reported as "allowed" or "denied:<errno>" over a pipe.

With ``--group <nobody's primary group>`` (nogroup on Debian) the same uid can reach the socket
and map the region, while the admin socket (mode 0600) stays closed to it. That uses no
group the system does not already have; the part is skipped when there is no such user or group.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import socket as pysocket
import traceback

import pytest

from .test_faults import assert_settled, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: drops to uid 65534 to try access")]

NOBODY = 65534


def nobody_gid() -> int | None:
    try:
        return pwd.getpwuid(NOBODY).pw_gid
    except KeyError:
        return None


def as_uid(fn, uid: int = NOBODY, gid: int = NOBODY) -> dict:
    """Run ``fn()`` in a forked child that dropped to ``uid``/``gid`` (no supplementary groups);
    return its dict, or raise with the child's traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            assert os.getuid() == uid and os.geteuid() == uid and os.getegid() == gid
            payload = {"result": fn()}
        except BaseException as exc:
            payload = {"error": repr(exc), "traceback": traceback.format_exc()}
        try:
            os.write(w, json.dumps(payload).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    payload = json.loads(b"".join(chunks) or b'{"error": "the child wrote nothing"}')
    if "error" in payload:
        raise AssertionError(f"child failed: {payload['error']}\n{payload.get('traceback', '')}")
    return payload["result"]


def attempt(fn) -> str:
    try:
        fn()
        return "allowed"
    except OSError as exc:
        return f"denied:{errno.errorcode.get(exc.errno, exc.errno)}"
    except Exception as exc:       # kvtier errors: the daemon could not be reached
        return f"denied:{type(exc).__name__}"


def unix_connect(path: str) -> None:
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        s.connect(path)
    finally:
        s.close()


def ping(path: str) -> None:
    from kvtierd.contract.channel import Channel
    channel = Channel(path, timeout=1.0)
    try:
        channel.call("ping")
    finally:
        channel.close()


def paths(daemon) -> dict[str, str]:
    stats = daemon.stats()
    return {"dir": daemon.dir, "region": daemon.region, "socket": daemon.socket,
            "admin": stats["admin_socket"], "lock": daemon.paths.lock}


def test_another_uid_can_neither_connect_nor_map_the_region(daemon):
    p = paths(daemon)

    def probe() -> dict:
        from kvtierd.contract.mapping import Mapping
        return {
            "list dir": attempt(lambda: os.listdir(p["dir"])),
            "enter dir": attempt(lambda: os.chdir(p["dir"])),
            "stat region": attempt(lambda: os.stat(p["region"])),
            "open region": attempt(lambda: open(p["region"], "rb").close()),
            "map region": attempt(lambda: Mapping.of_file(p["region"]).close()),
            "open lock": attempt(lambda: open(p["lock"], "rb").close()),
            "connect socket": attempt(lambda: unix_connect(p["socket"])),
            "ping over socket": attempt(lambda: ping(p["socket"])),
            "connect admin socket": attempt(lambda: unix_connect(p["admin"])),
            "ping admin socket": attempt(lambda: ping(p["admin"])),
        }

    result = as_uid(probe)
    allowed = {k: v for k, v in result.items() if not v.startswith("denied")}
    assert not allowed, f"uid {NOBODY} got in: {allowed} (all: {result})"
    assert result["open region"] == "denied:EACCES" and result["connect socket"] == "denied:EACCES", result
    assert result["ping over socket"] in ("denied:DaemonUnavailable", "denied:EACCES"), result
    stats = daemon.stats()
    assert stats["sessions"] == 0 and stats["errors"] == {}, stats      # nothing reached the daemon


def test_client_group_member_reaches_socket_and_region_but_not_admin(start_daemon):
    gid = nobody_gid()
    if gid is None:
        pytest.skip(f"no user with uid {NOBODY}")
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        pytest.skip(f"uid {NOBODY}'s primary gid {gid} has no group entry")
    daemon = start_daemon("--group", group)
    p = paths(daemon)
    st = os.stat(p["dir"])
    assert st.st_gid == gid and st.st_mode & 0o070 == 0o070 and st.st_mode & 0o007 == 0
    assert os.stat(p["region"]).st_gid == gid and os.stat(p["socket"]).st_gid == gid

    def probe() -> dict:
        from kvtier import Client, NamespaceId

        from kvtierd.contract.region_format import RegionView
        out = {
            "list dir": attempt(lambda: os.listdir(p["dir"])),
            "connect socket": attempt(lambda: unix_connect(p["socket"])),
            "ping over socket": attempt(lambda: ping(p["socket"])),
            "connect admin socket": attempt(lambda: unix_connect(p["admin"])),
            "ping admin socket": attempt(lambda: ping(p["admin"])),
        }
        layout = NamespaceId("group-model", "bfloat16", 16, 8192, "replicated")
        client = Client(p["socket"], engine_id="group-member", rank=0, world_size=1, namespace=layout, pin="off",
                        timeout=5)
        view = RegionView(client.mapping.buffer)
        out["mapped generation"] = int(view.header["generation"])
        del view
        out["lookup"] = client.lookup([b"some-key"])
        client.close()
        return out

    result = as_uid(probe)
    assert result["list dir"] == "allowed" and result["connect socket"] == "allowed", result
    assert result["ping over socket"] == "allowed", result
    assert result["connect admin socket"] == "denied:EACCES", result
    assert result["ping admin socket"].startswith("denied"), result
    assert result["mapped generation"] == daemon.stats()["generation"] and result["lookup"] == 0, result
    wait_for(lambda: daemon.stats()["sessions"] == 0, what="the group member's session to end")
    assert_settled(daemon)

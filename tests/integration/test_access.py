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
import zmq

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
    return {"dir": daemon.dir, "region": daemon.region, "meta": daemon.paths.meta, "socket": daemon.socket,
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
            "open metadata": attempt(lambda: open(p["meta"], "rb").close()),
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
    # The channel says so before ZMQ waits (issue 27): AccessDenied, a DaemonUnavailable.
    assert result["ping over socket"] == "denied:AccessDenied", result
    stats = daemon.stats()
    assert stats["sessions"] == 0 and stats["errors"] == {}, stats      # nothing reached the daemon


def client_group() -> tuple[int, str]:
    gid = nobody_gid()
    if gid is None:
        pytest.skip(f"no user with uid {NOBODY}")
    try:
        return gid, grp.getgrgid(gid).gr_name
    except KeyError:
        pytest.skip(f"uid {NOBODY}'s primary gid {gid} has no group entry")


def test_client_group_member_reaches_socket_and_region_but_not_admin(start_daemon):
    gid, group = client_group()
    daemon = start_daemon("--group", group)
    p = paths(daemon)
    st = os.stat(p["dir"])
    assert st.st_gid == gid and st.st_mode & 0o070 == 0o050 and st.st_mode & 0o007 == 0
    assert os.stat(p["region"]).st_gid == gid and os.stat(p["socket"]).st_gid == gid

    def probe() -> dict:
        from kvtier import Client, NamespaceId

        from kvtierd.contract.region_format import HEADER_BYTES
        from kvtierd.contract.region_view import DataHeader
        out = {
            "list dir": attempt(lambda: os.listdir(p["dir"])),
            "connect socket": attempt(lambda: unix_connect(p["socket"])),
            "ping over socket": attempt(lambda: ping(p["socket"])),
            "connect admin socket": attempt(lambda: unix_connect(p["admin"])),
            "ping admin socket": attempt(lambda: ping(p["admin"])),
            "open metadata": attempt(lambda: open(p["meta"], "rb").close()),
        }
        layout = NamespaceId("group-model", "bfloat16", 16, 8192, "replicated")
        client = Client(p["socket"], engine_id="group-member", rank=0, world_size=1, namespace=layout, pin="off",
                        timeout=5)
        out["mapped generation"] = DataHeader.read(bytes(client.mapping.buffer[:HEADER_BYTES])).generation
        out["lookup"] = client.lookup([b"some-key"])
        client.close()
        return out

    result = as_uid(probe)
    assert result["list dir"] == "allowed" and result["connect socket"] == "allowed", result
    assert result["ping over socket"] == "allowed", result
    assert result["connect admin socket"] == "denied:EACCES", result
    assert result["ping admin socket"].startswith("denied"), result
    assert result["open metadata"] == "denied:EACCES", result
    assert result["mapped generation"] == daemon.stats()["generation"] and result["lookup"] == 0, result
    wait_for(lambda: daemon.stats()["sessions"] == 0, what="the group member's session to end")
    assert_settled(daemon)


# ------------------------------------------------------------------ issue 11 item 7: files
def test_a_group_member_can_pull_no_file_away(start_daemon):
    # The directory was 2770 without a sticky bit: any member could rename or remove the client
    # socket, the admin socket, the lock and the region.
    gid, group = client_group()
    daemon = start_daemon("--group", group)
    p = paths(daemon)

    def probe() -> dict:
        out = {}
        for name in ("socket", "admin", "lock", "region", "meta"):
            out[f"rename {name}"] = attempt(lambda: os.rename(p[name], p[name] + ".x"))
            out[f"remove {name}"] = attempt(lambda: os.unlink(p[name]))
        out["create a file"] = attempt(lambda: open(os.path.join(p["dir"], "squat"), "w").close())
        out["truncate metadata"] = attempt(lambda: os.truncate(p["meta"], 0))
        return out

    result = as_uid(probe)
    assert all(v == "denied:EACCES" for v in result.values()), result
    for name in ("socket", "admin", "lock", "region", "meta"):
        assert os.path.exists(p[name])
    assert daemon.stats()["region_problem"] is None


def test_a_region_made_without_the_group_gets_it_on_a_restart_with_it(start_daemon):
    # A region created without --group kept its old group after a restart with --group, so every
    # member got EACCES on mmap.
    gid, group = client_group()
    daemon = start_daemon()
    daemon.stop()
    daemon.args += ["--group", group]
    daemon.start()
    p = paths(daemon)

    def probe() -> dict:
        from kvtierd.contract.mapping import Mapping
        return {"map region": attempt(lambda: Mapping.of_file(p["region"]).close())}

    assert as_uid(probe) == {"map region": "allowed"}
    assert os.stat(p["region"]).st_gid == gid


@pytest.mark.parametrize("length", [0, 4096], ids=["to-0-then-stop", "to-4KiB-then-lookup"])
def test_a_group_member_truncating_the_region_cannot_kill_the_daemon(start_daemon, length):
    # Truncating the region killed the daemon with SIGBUS: to 0 while idle, during the clean
    # stop's header write; to 4 KiB, at the next lookup. The daemon never touches the data file
    # while it serves: it replaces it (a new generation) and the engines re-attach to the new one.
    from tests import attacks
    from tests.keyed import KeyedEngine, keys_of
    gid, group = client_group()
    daemon = start_daemon("--group", group, "--region-check-interval", "0.2")
    engine = KeyedEngine()
    try:
        engine.call("connect", socket=daemon.socket, engine="good")
        keys = keys_of(f"trunc-{length}", 8)
        engine.call("round", keys=keys)
        assert engine.call("round", keys=keys)["verified"] == 8
        generation = daemon.stats()["generation"]
        p = paths(daemon)
        assert as_uid(lambda: attempt(lambda: os.truncate(p["region"], length))) == "allowed"
        if length == 0:
            assert daemon.stop() == 0, daemon.log()[-3000:]      # the clean stop writes only the metadata
            daemon.start()                                      # adopts it; a fresh region file
        else:                                    # a lookup at once (copying pages would SIGBUS the client)
            raw = attacks.Raw(daemon.socket)
            try:
                assert raw.ask(attacks.hello(engine="looker"))["ok"]
                assert raw.ask({"op": "lookup", "rid": 2, "keys": keys})["ok"]
            finally:
                raw.close()
        stats = wait_for(lambda: (s := daemon.stats())["generation"] != generation and s,
                         what="the daemon to replace the truncated region file")
        assert stats["region_problem"] is None
        assert os.stat(p["region"]).st_size == stats["file_bytes"] and os.stat(p["region"]).st_gid == gid
        engine.call("round", keys=keys)                  # re-attaches, remaps, misses, stores again
        totals = engine.call("round", keys=keys)
        assert totals.get("wrong", 0) == 0 and totals["verified"] >= 16, totals
    finally:
        engine.stop()
    assert daemon.stop() == 0, daemon.log()[-3000:]
    assert "Traceback" not in daemon.log()


def test_another_uid_cannot_join_an_engine_even_in_the_group(start_daemon):
    # Issue 11 item 5: an engine's later sessions must come from the uid of its first one.
    from tests import attacks
    gid, group = client_group()
    daemon = start_daemon("--group", group)
    owner = attacks.Raw(daemon.socket)
    try:
        assert owner.ask(attacks.hello(engine="roots", rank=0, world_size=2))["ok"]
        socket = daemon.socket

        def probe() -> dict:
            raw = attacks.Raw(socket, zmq.Context())
            try:
                reply = raw.ask(attacks.hello(engine="roots", rank=None, world_size=2))
                return {"code": reply.get("code"), "message": reply.get("message", "")}
            finally:
                raw.close()

        result = as_uid(probe)
        assert result["code"] == attacks.ErrorCode.FORBIDDEN and "uid 0" in result["message"], result
    finally:
        owner.close()

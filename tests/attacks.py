"""Hostile clients, as an attacker on the node would be: raw DEALER frames built from the protocol,
raw unix connections, and edits of files a member of the client group can reach.

Each attack is a function of the daemon's socket path (and what else it needs) that runs the
attack to its end, checks what the daemon answered, and returns what it observed; it raises
``AssertionError`` when the daemon answered in a way it must not. ``in_child`` runs one in a
process of its own (another peer to the daemon), which keeps what it opened until told to exit.
The integration tests (tests/integration/test_hostile.py for issue 11, test_composition.py for
issue 26) run each once; the hostile soak (tests/soak/hostile_soak.py) cycles through them while
good engines verify every block they load.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket as pysocket
import subprocess
import sys
import time

import msgpack
import zmq

from kvtierd.contract import protocol as P
from kvtierd.contract.codes import ErrorCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACE = {"model": "attacker", "dtype": "uint8", "block_tokens": 16, "block_bytes": 4096,
             "sharding": "replicated"}


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def other_pidns() -> int:
    """The inode of a PID namespace that is not ours (nor the daemon's): a pod's, as the daemon sees it."""
    return pidns() + 1


def hello(engine: str = "attacker", rank: int | None = 0, world_size: int = 1, namespace: dict | None = None,
          **fields) -> dict:
    msg = {"op": "hello", "rid": 1, "version": P.PROTOCOL_VERSION, "engine": engine, "rank": rank,
           "world_size": world_size, "namespace": dict(namespace or NAMESPACE)}
    msg.update(fields)
    return msg


class Raw:
    """One DEALER socket speaking raw frames to the daemon; ``ask`` sends and waits for the reply."""

    def __init__(self, socket_path: str, ctx: zmq.Context | None = None, timeout: float = 20.0):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
            self.sock.setsockopt(opt, 0)
        self.sock.connect(f"ipc://{socket_path}")
        self.timeout_ms = int(timeout * 1000)

    def send(self, frame_or_msg, *more: bytes) -> None:
        frame = frame_or_msg if isinstance(frame_or_msg, bytes) else pack(frame_or_msg)
        self.sock.send_multipart([frame, *more])

    def reply(self) -> tuple[dict, int]:
        """The next reply and its size in bytes."""
        if not self.sock.poll(self.timeout_ms):
            raise AssertionError("the daemon did not answer")
        raw = self.sock.recv()
        return msgpack.unpackb(raw, raw=False, strict_map_key=False), len(raw)

    def ask(self, frame_or_msg, *more: bytes) -> dict:
        self.send(frame_or_msg, *more)
        return self.reply()[0]

    def close(self) -> None:
        self.sock.close(linger=0)


def refused(reply: dict, *codes: ErrorCode) -> int:
    """The reply's error code, which must be one of ``codes``."""
    assert reply.get("ok") is False, f"the daemon accepted a hostile request: {reply}"
    assert reply["code"] in {int(c) for c in codes}, reply
    return reply["code"]


# ------------------------------------------------------------------ item 1: one frame must not kill
def nested_op(socket_path: str, depth: int = 1000) -> dict:
    """``{"op": [[[... nil ...]]], "rid": 5}`` nested ``depth`` deep (msgpack's own limit is 1024)."""
    raw = Raw(socket_path)
    try:
        frame = b"\x82\xa2op" + b"\x91" * depth + b"\xc0" + b"\xa3rid\x05"
        reply, size = (raw.send(frame), raw.reply())[1]
        refused(reply, ErrorCode.BAD_REQUEST)
        return {"code": reply["code"], "reply_bytes": size}
    finally:
        raw.close()


def huge_op(socket_path: str) -> dict:
    """A 4 MB op: its error reply must stay small (it used to be its repr: 16 MB)."""
    raw = Raw(socket_path)
    try:
        reply, size = (raw.send({"op": b"\x00" * (P.MAX_FRAME_BYTES - 64), "rid": 6}), raw.reply())[1]
        refused(reply, ErrorCode.BAD_REQUEST)
        assert size < 2048, f"a {size}-byte error reply"
        return {"code": reply["code"], "reply_bytes": size}
    finally:
        raw.close()


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests import attacks
print(json.dumps(getattr(attacks, sys.argv[2])(*json.loads(sys.argv[3]))), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def in_child(attack: str, *args):
    """Run ``attacks.<attack>(*args)`` in a process of its own — to the daemon, another peer —
    which then lives on, holding what it opened, until the block ends; yields what it returned."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, ROOT, attack, json.dumps(args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"attack {attack} failed in its child process (exit {proc.wait(30)})")
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------ item 2: descriptors
def _raise_nofile(n: int) -> None:
    """Let this process hold ``n`` more descriptors (up to its hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))


def _connect(socket_path: str, n: int) -> list[pysocket.socket]:
    """``n`` raw unix connections to the client socket (fewer if connecting fails), sending nothing."""
    _raise_nofile(n)
    socks = []
    for _ in range(n):
        s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        try:
            s.connect(socket_path)
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


_HELD: list = []        # what a child process (``in_child``) holds until it exits


def hold_connections(socket_path: str, n: int) -> dict:
    """``n`` idle connections, kept open until this process exits (run it ``in_child``)."""
    _HELD.extend(_connect(socket_path, n))
    return {"opened": len(_HELD)}


def idle_connections(socket_path: str, n: int, during=lambda: None) -> dict:
    """Open ``n`` raw unix connections to the client socket and send nothing; report how many the
    daemon closed at once (those past its per-peer cap) and what ``during()`` returned while they
    were held. Closes them all before returning."""
    socks = _connect(socket_path, n)
    try:
        time.sleep(1.0)
        seen = during()
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                # ZMTP: the daemon sends its greeting at once; a connection it closed reads EOF.
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        closed += 1
                        break
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return {"opened": len(socks), "closed_by_daemon": closed, "during": seen}
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------------ item 3: sessions that never end
def hello_and_vanish(socket_path: str, rounds: int, pid: int = 1, ns: int | None = None) -> dict:
    """Connect, say hello claiming ``pid`` (1 lives forever) in PID namespace ``ns`` (default: our
    own), close without bye; ``rounds`` times. In the daemon's own namespace a claim that is not
    the peer's pid is refused outright; from a namespace the daemon cannot see (``other_pidns()``,
    as from another pod) it is the client's word."""
    ctx = zmq.Context()
    ok = limited = 0
    try:
        for i in range(rounds):
            raw = Raw(socket_path, ctx)
            reply = raw.ask(hello(engine=f"vanish-{i}", pid=pid, pidns=pidns() if ns is None else ns))
            if reply["ok"]:
                ok += 1
            else:       # sessions of closed connections are ended a moment later: until then they count
                refused(reply, ErrorCode.LIMIT)
                limited += 1
            raw.close()
    finally:
        ctx.term()
    return {"rounds": rounds, "attached": ok, "limit": limited}


def pid_out_of_range(socket_path: str) -> dict:
    raw = Raw(socket_path)
    try:
        code = refused(raw.ask(hello(engine="pid-overflow", pid=1 << 31, pidns=pidns())), ErrorCode.BAD_REQUEST)
        return {"code": code}
    finally:
        raw.close()


def session_flood(socket_path: str, n: int) -> dict:
    """``n`` sessions from one process (each its own connection); count the LIMIT refusals."""
    ctx = zmq.Context()
    raws, codes = [], []
    try:
        for i in range(n):
            raw = Raw(socket_path, ctx)
            raws.append(raw)
            reply = raw.ask(hello(engine=f"flood-{i}", pid=os.getpid(), pidns=pidns()))
            codes.append(0 if reply["ok"] else refused(reply, ErrorCode.LIMIT))
        return {"attached": codes.count(0), "limit": codes.count(int(ErrorCode.LIMIT))}
    finally:
        for raw in raws:
            raw.close()
        ctx.term()


# ------------------------------------------------------------------ item 4: memory one client can pin
def open_jobs_flood(socket_path: str, jobs: int, keys: int = P.MAX_KEYS_PER_REQUEST, engine: str = "hoarder") -> dict:
    """Open ``jobs`` load jobs of ``keys`` keys each from one session and never release them;
    count how many the daemon took and how many it refused with LIMIT. The session ends (and its
    jobs abort) when the connection closes."""
    raw = Raw(socket_path, timeout=60)
    try:
        assert raw.ask(hello(engine=engine, pid=os.getpid(), pidns=pidns()))["ok"]
        taken = limited = 0
        for j in range(jobs):
            ks = [j.to_bytes(4, "little") + i.to_bytes(4, "little") for i in range(keys)]
            reply = raw.ask({"op": "load", "rid": 10 + j, "job": j, "keys": ks})
            if reply["ok"]:
                taken += 1
            else:
                refused(reply, ErrorCode.LIMIT)
                limited += 1
        return {"taken": taken, "limited": limited}
    finally:
        raw.close()


def many_parts(socket_path: str, parts: int = 40, part_bytes: int = 8 << 20) -> dict:
    """One message of ``parts`` frames of ``part_bytes`` (MAXMSGSIZE bounds a frame, not a message)."""
    raw = Raw(socket_path, timeout=60)
    try:
        blob = b"\x00" * (part_bytes - 16)
        code = refused(raw.ask(pack({"op": "ping", "rid": 3}), *[blob] * (parts - 1)), ErrorCode.BAD_REQUEST)
        return {"code": code, "sent_bytes": parts * part_bytes}
    finally:
        raw.close()


# ------------------------------------------------------------------ item 5: borrowed identity
def borrow_identity(socket_path: str, engine: str, world_size: int, namespace: dict, ranks=(None,)) -> dict:
    """Try to attach as ``engine`` (its coordinator, or a rank slot), without its secret and with a
    wrong one; every attempt must get FORBIDDEN."""
    raw = Raw(socket_path)
    try:
        codes = []
        for rank in ranks:
            for extra in ({}, {"secret": os.urandom(32)}):
                reply = raw.ask(hello(engine=engine, rank=rank, world_size=world_size, namespace=namespace,
                                      pid=os.getpid(), pidns=pidns(), **extra))
                codes.append(refused(reply, ErrorCode.FORBIDDEN))
        return {"attempts": len(codes)}
    finally:
        raw.close()


# ------------------------------------------------------------------ item 8: namespace slots
def fill_namespaces(socket_path: str, n: int, prefix: str = "squat") -> dict:
    """``n`` engines, each of its own model, each storing one block and leaving: the namespace
    table fills with namespaces nobody uses. Counts the hellos that got NO_SPACE."""
    ctx = zmq.Context()
    attached = refused_ = 0
    try:
        for i in range(n):
            raw = Raw(socket_path, ctx)
            try:
                reply = raw.ask(hello(engine=f"{prefix}-{i}", namespace=dict(NAMESPACE, model=f"{prefix}-{i}")))
                if not reply["ok"]:
                    refused(reply, ErrorCode.NO_SPACE)
                    refused_ += 1
                    continue
                attached += 1
                assert raw.ask({"op": "store", "rid": 2, "job": 1, "keys": [b"k"]})["ok"]
                assert raw.ask({"op": "commit", "rid": 3, "job": 1, "ok": True})["ok"]
                assert raw.ask({"op": "bye", "rid": 4})["ok"]
            finally:
                raw.close()
    finally:
        ctx.term()
    return {"attached": attached, "no_space": refused_}


def scrape(address: str) -> bytes:
    import urllib.request
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read()


# ------------------------------------------------------------------ issue 26: trust under composition
def watched_disconnects(socket_path: str, n: int) -> dict:
    """``n`` sessions of this process, each on its own connection closed without bye. In the
    daemon's PID namespace each is watched through a pidfd, which the daemon checks when the
    connection ends (issue 26 C: select() on a pidfd past descriptor 1,023 ended the daemon)."""
    ctx = zmq.Context()
    watched = 0
    try:
        for i in range(n):
            raw = Raw(socket_path, ctx)
            try:
                reply = raw.ask(hello(engine=f"watched-{os.getpid()}-{i}", rank=None, pid=os.getpid(), pidns=pidns()))
                assert reply["ok"], reply
                watched += reply["watched"]
            finally:
                raw.close()
    finally:
        ctx.term()
    return {"sessions": n, "watched": watched}


def crowded_disconnects(socket_path: str, connections: int = 1100, peers: int = 5, sessions: int = 8,
                        during=lambda: None) -> dict:
    """Issue 26 C: ``connections`` idle connections from ``peers`` processes (each under
    max_connections_per_peer), so that the daemon holds more than 1,024 descriptors; meanwhile
    ``watched_disconnects`` (whose pidfds are then past 1,023) and ``during()``."""
    with contextlib.ExitStack() as held:
        opened = sum(held.enter_context(in_child("hold_connections", socket_path, -(-connections // peers)))["opened"]
                     for _ in range(peers))
        out = watched_disconnects(socket_path, sessions)
        seen = during()
    return {"connections": opened, **out, "during": seen}


def store_after_commit(socket_path: str, jobs: int, keys: int = 16, engine: str = "recommit") -> dict:
    """Issue 26 A: rank 0 (the writer) of a replicated world of 2 stores, commits, then stores the
    same job again; rank 1 votes last. The second store must be refused (CONFLICT), and so must
    every later request naming the finished job (it answered INTERNAL)."""
    ctx = zmq.Context()
    r0, r1 = Raw(socket_path, ctx), Raw(socket_path, ctx)
    try:
        for rank, raw in enumerate((r0, r1)):
            assert raw.ask(hello(engine=engine, rank=rank, world_size=2, pid=os.getpid(), pidns=pidns()))["ok"]
        for job in range(1, jobs + 1):
            ks = [job.to_bytes(4, "little") + i.to_bytes(4, "little") for i in range(keys)]
            store = {"op": "store", "rid": 2, "job": job, "keys": ks}
            assert r0.ask(store)["ok"] and r0.ask({"op": "commit", "rid": 3, "job": job, "ok": True})["ok"]
            again = r0.ask(store)
            refused(again, ErrorCode.CONFLICT)
            assert "already committed" in again["message"], again
            assert r1.ask(store)["ok"]                              # the last vote: the job is done
            refused(r0.ask({"op": "commit", "rid": 4, "job": job, "ok": True}), ErrorCode.CONFLICT)
            refused(r0.ask(store), ErrorCode.CONFLICT)
        for raw in (r0, r1):
            assert raw.ask({"op": "bye", "rid": 5})["ok"]
        return {"jobs": jobs}
    finally:
        r0.close()
        r1.close()
        ctx.term()


def writer_rows_flood(socket_path: str, rounds: int, ns: int | None = None) -> dict:
    """Issue 26 B: hello as a writer, store one key, close the socket (no commit, no bye),
    ``rounds`` times. Each leaves a writer row whose page stays fenced (the daemon cannot know the
    copy stopped): for fence_grace when it cannot watch this process (``ns``: another PID
    namespace), for this process's life when it can. Past max_writer_rows_per_peer the hello must
    be refused, naming the setting. A refusal because this process's sessions of closed
    connections still count (max_sessions_per_peer, for DISCONNECT_GRACE) is retried."""
    ctx = zmq.Context()
    attached = limited = 0
    try:
        for i in range(rounds):
            while True:
                raw = Raw(socket_path, ctx)
                try:
                    reply = raw.ask(hello(engine=f"rows-{os.getpid()}-{i}", pid=os.getpid(),
                                          pidns=pidns() if ns is None else ns))
                    if reply["ok"]:
                        key = f"{os.getpid()}-{i}".encode()     # a key of its own: pages of its own
                        assert raw.ask({"op": "store", "rid": 2, "job": 1, "keys": [key]})["ok"]
                        attached += 1
                        break
                    refused(reply, ErrorCode.LIMIT)
                    if "max_writer_rows_per_peer" in reply["message"]:
                        limited += 1
                        break
                    assert "max_sessions_per_peer" in reply["message"], reply
                finally:
                    raw.close()
                time.sleep(0.2)
    finally:
        ctx.term()
    return {"rounds": rounds, "attached": attached, "limit": limited}


def lease_the_region(socket_path: str, seconds: float = 3.0, engine: str = "hoard") -> dict:
    """Issue 26 D: store one block per page of the region, lease every one and renew the lease
    every 0.5 s for ``seconds``. The daemon must hold well under half of the region for it,
    answering each renewal with how many keys it holds (``leased``)."""
    raw = Raw(socket_path, timeout=60)
    try:
        welcome = raw.ask(hello(engine=engine, pid=os.getpid(), pidns=pidns()))
        assert welcome["ok"], welcome
        pages = welcome["num_pages"]
        ks = [i.to_bytes(4, "little") + b"hoard" for i in range(min(pages, P.MAX_KEYS_PER_REQUEST))]
        stored = raw.ask({"op": "store", "rid": 2, "job": 1, "keys": ks})
        assert stored["ok"] and raw.ask({"op": "commit", "rid": 3, "job": 1, "ok": True})["ok"]
        hits = leased = 0
        deadline = time.monotonic() + seconds
        while True:
            reply = raw.ask({"op": "lookup", "rid": 4, "keys": ks, "lease": 1, "ttl_ms": 2000})
            assert reply["ok"], reply
            assert reply["leased"] <= pages // 2 < len(ks), f"{reply['leased']} of {pages} pages leased"
            hits, leased = max(hits, reply["hits"]), max(leased, reply["leased"])
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert raw.ask({"op": "bye", "rid": 5})["ok"]
        return {"pages": pages, "hits": hits, "leased": leased}
    finally:
        raw.close()

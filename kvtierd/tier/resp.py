"""A minimal RESP2 client for Valkey/Redis Cluster, written to move blocks without copies.

Why not redis-py's cluster client: its replies arrive as Python ``bytes`` (one copy of every
block) that must then be copied into the region (a second), and a value must be one buffer, so
a block spread over non-contiguous pages is joined first (a third). Here a SET is gathered
straight from the block's extents with ``sendmsg`` and a GET reply's payload is received straight
into them with ``recv_into``: the only copies left are the kernel's socket copies.

What it implements, and nothing more:
- key → slot: CRC16/XMODEM (``binascii.crc_hqx`` with seed 0) of the key, or of its ``{hash
  tag}``, modulo 16384; the slot → node map from ``CLUSTER SLOTS``, refreshed after a ``MOVED``
  reply or a node's failure;
- ``ASK`` redirections (``ASKING`` then the command, on the named node), ``MOVED`` (the map is
  refreshed and the command retried, twice at most);
- pipelines: the commands of one call are grouped by node; every node's commands are sent before
  any reply is read, so the nodes work in parallel;
- bounded waits: every socket operation has the client's ``timeout``; a node that failed (refused,
  reset, timed out) is *down* for ``node_cooldown`` seconds: its keys fail at once instead of
  costing a connect timeout per call, while the other nodes keep serving theirs.

A command's result is its reply, or an exception *object* for that command alone (``RespError``
for an error reply, ``TierUnavailable``/``TierTimeout`` when its node failed): the caller decides
per key. ``Cluster`` raises only when it cannot learn the slot map from any node.
"""

from __future__ import annotations

import binascii
import socket
import time
from typing import Callable, Iterable, Sequence

from .backend import TierError, TierTimeout, TierUnavailable

SLOTS = 16384
CRLF = b"\r\n"
IOV_MAX = 1024            # buffers per sendmsg (Linux's UIO_MAXIOV)
SMALL = 16 << 10          # pieces below this are joined before sending (fewer iovecs)


def key_slot(key: bytes) -> int:
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) % SLOTS


class RespError(Exception):
    """An error reply (``-ERR ...``, ``-MOVED ...``): the message as the server sent it."""


def command(*args: bytes | str | int) -> list:
    """One command as RESP pieces (a list of bytes-like objects to send)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return out


def bulk_from(views: Sequence[memoryview]) -> list:
    """A bulk-string argument gathered from several buffers (not joined: sent as they are)."""
    return [b"$%d\r\n" % sum(v.nbytes for v in views), *views, CRLF]


class Connection:
    """One socket to one node, with a receive buffer that bulk payloads can bypass."""

    def __init__(self, host: str, port: int, timeout: float):
        self.address = (host, port)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.pos = 0

    def close(self) -> None:
        self.sock.close()

    def send(self, pieces: Iterable) -> None:
        """Send the pieces in order: small ones joined, big ones (block extents) as they are."""
        iov, small = [], []
        for p in pieces:
            if len(p) < SMALL and not isinstance(p, memoryview):
                small.append(p)
                continue
            if small:
                iov.append(b"".join(small))
                small = []
            iov.append(p)
        if small:
            iov.append(b"".join(small))
        views = [memoryview(p).cast("B") for p in iov]
        while views:
            sent = self.sock.sendmsg(views[:IOV_MAX])
            while sent:
                if sent >= views[0].nbytes:
                    sent -= views.pop(0).nbytes
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    # ------------------------------------------------------------------ replies
    def _fill(self) -> None:
        if self.pos and self.pos >= len(self.buf) // 2:
            del self.buf[:self.pos]
            self.pos = 0
        data = self.sock.recv(1 << 18)
        if not data:
            raise ConnectionError(f"node {self.address[0]}:{self.address[1]} closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(CRLF, self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos:end])
                self.pos = end + 2
                return line
            self._fill()

    def _take_into(self, view: memoryview) -> None:
        """Fill ``view``: first from the buffer, the rest straight from the socket."""
        have = min(len(self.buf) - self.pos, view.nbytes)
        if have:
            view[:have] = self.buf[self.pos:self.pos + have]
            self.pos += have
        filled = have
        while filled < view.nbytes:
            n = self.sock.recv_into(view[filled:])
            if not n:
                raise ConnectionError(f"node {self.address[0]}:{self.address[1]} closed the connection")
            filled += n

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            step = min(n, scratch.nbytes)
            self._take_into(scratch[:step])
            n -= step

    def read(self):
        """One reply: str (simple string), int, bytes or None (bulk), list (array), RespError."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self._take_into(memoryview(out))
            self._skip(2)
            return bytes(out)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise ConnectionError(f"node {self.address[0]}:{self.address[1]} sent a malformed reply {line[:40]!r}")

    def read_into(self, views: Sequence[memoryview]):
        """A bulk reply received into ``views`` when its length is exactly theirs: returns that
        length; None for a missing key; the length (bytes discarded) when it differs; RespError."""
        line = self._line()
        if line[:1] == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ConnectionError(f"node {self.address[0]}:{self.address[1]} answered a GET with {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        if n != sum(v.nbytes for v in views):
            self._skip(n + 2)
            return n
        for v in views:
            self._take_into(v)
        self._skip(2)
        return n


Reader = Callable[[Connection], object]


def read_reply(conn: Connection):
    return conn.read()


class Cluster:
    def __init__(self, seeds: Sequence[tuple[str, int]], timeout: float = 2.0, node_cooldown: float = 2.0,
                 clock=time.monotonic):
        if not seeds:
            raise ValueError("a cluster needs at least one seed address")
        self.seeds = list(seeds)
        self.timeout = timeout
        self.node_cooldown = node_cooldown
        self.clock = clock
        self.slots: list[tuple[str, int]] = []
        self.conns: dict[tuple[str, int], Connection] = {}
        self.down: dict[tuple[str, int], float] = {}
        self.stale = False               # a node failed since the map was learnt
        self.next_refresh = 0.0

    # ------------------------------------------------------------------ topology
    def nodes(self) -> list[tuple[str, int]]:
        """The primaries of the slot map (after learning it)."""
        if not self.slots:
            self.refresh()
        return sorted(set(self.slots))

    def refresh(self) -> None:
        """Learn the slot map from the first node that answers CLUSTER SLOTS."""
        failures = []
        for addr in list(dict.fromkeys([*set(self.slots), *self.seeds])):
            try:
                reply = self.roundtrip(addr, command("CLUSTER", "SLOTS"))
            except (OSError, TierError) as exc:
                failures.append(f"{addr[0]}:{addr[1]}: {exc}")
                continue
            if isinstance(reply, RespError) or not reply:
                failures.append(f"{addr[0]}:{addr[1]}: {reply or 'no slots assigned'}")
                continue
            slots = [addr] * SLOTS       # a slot no range names stays with the node that answered
            for start, end, primary, *_ in reply:
                owner = (primary[0].decode() or addr[0], int(primary[1]))
                slots[start:end + 1] = [owner] * (end - start + 1)
            self.slots = slots
            return
        raise TierUnavailable("no cluster node answered CLUSTER SLOTS (" + "; ".join(failures) + ")")

    def _connection(self, addr: tuple[str, int]) -> Connection:
        conn = self.conns.get(addr)
        if conn is None:
            until = self.down.get(addr, 0.0)
            if self.clock() < until:
                raise TierUnavailable(f"node {addr[0]}:{addr[1]} is down (retried in {until - self.clock():.1f} s)")
            try:
                conn = self.conns[addr] = Connection(*addr, timeout=self.timeout)
            except OSError as exc:
                self._node_failed(addr)
                raise TierUnavailable(f"node {addr[0]}:{addr[1]}: {exc}") from None
            self.down.pop(addr, None)
        return conn

    def _node_failed(self, addr: tuple[str, int]) -> None:
        conn = self.conns.pop(addr, None)
        if conn is not None:
            conn.close()
        self.down[addr] = self.clock() + self.node_cooldown
        # Its slots may have failed over to a replica at another address: ask the others.
        self.stale = True

    def roundtrip(self, addr: tuple[str, int], pieces: list, reader: Reader = read_reply):
        """One command on one node (not pipelined): its reply, or a raised TierError."""
        conn = self._connection(addr)
        try:
            conn.send(pieces)
            return reader(conn)
        except (OSError, ValueError) as exc:
            self._node_failed(addr)
            raise self._error(addr, exc) from None

    def _error(self, addr: tuple[str, int], exc: Exception) -> TierError:
        if isinstance(exc, socket.timeout):
            return TierTimeout(f"node {addr[0]}:{addr[1]} did not answer within {self.timeout} s")
        return TierUnavailable(f"node {addr[0]}:{addr[1]}: {exc}")

    # ------------------------------------------------------------------ pipelines
    def execute(self, calls: Sequence[tuple[int, list, Reader]]) -> list:
        """Run (slot, pieces, reader) commands, pipelined per node; one result per command."""
        if not self.slots:
            self.refresh()
        elif self.stale and self.clock() >= self.next_refresh:
            self.next_refresh = self.clock() + self.node_cooldown     # at most once per cooldown
            try:
                self.refresh()
                self.stale = False
            except TierUnavailable:
                pass                     # every node failed: each command will say so
        results: list = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(3):
            moved = self._run(calls, todo, results)
            if not moved:
                break
            self.refresh()
            todo = moved
        return results

    def _run(self, calls, todo: list[int], results: list) -> list[int]:
        """One pass over ``todo``; returns the commands a MOVED reply sent elsewhere."""
        by_node: dict[tuple[str, int], list[int]] = {}
        for i in todo:
            by_node.setdefault(self.slots[calls[i][0]], []).append(i)
        sent = {}
        for addr, idx in by_node.items():          # every node gets its commands before any reply is read
            try:
                conn = self._connection(addr)
                conn.send([p for i in idx for p in calls[i][1]])
                sent[addr] = (conn, idx)
            except TierError as exc:
                for i in idx:
                    results[i] = exc
            except OSError as exc:            # socket.timeout is an OSError
                self._node_failed(addr)
                err = self._error(addr, exc)
                for i in idx:
                    results[i] = err
        moved, asked = [], []
        for addr, (conn, idx) in sent.items():
            for n, i in enumerate(idx):
                try:
                    reply = calls[i][2](conn)
                except (OSError, ValueError) as exc:      # ValueError: a reply that does not parse
                    self._node_failed(addr)
                    err = self._error(addr, exc)
                    for j in idx[n:]:
                        results[j] = err
                    break
                if isinstance(reply, RespError):
                    word, *rest = str(reply).split()
                    if word == "MOVED":
                        moved.append(i)
                        continue
                    if word == "ASK":
                        host, _, port = rest[1].rpartition(":")
                        asked.append((i, (host, int(port))))
                        continue
                results[i] = reply
        for i, addr in asked:                      # rare (a slot migrating): one round trip each
            try:
                def ask(conn, reader=calls[i][2]):
                    conn.read()                    # +OK to ASKING
                    return reader(conn)
                results[i] = self.roundtrip(addr, command("ASKING") + calls[i][1], ask)
            except TierError as exc:
                results[i] = exc
        for i in moved:                            # unless a retry answers them
            results[i] = TierUnavailable(f"slot {calls[i][0]} keeps moving")
        return moved

    def each_node(self, pieces: list, reader: Reader = read_reply) -> dict[tuple[str, int], object]:
        """The same command on every primary: its reply or exception per node."""
        out = {}
        for addr in self.nodes():
            try:
                out[addr] = self.roundtrip(addr, pieces, reader)
            except TierError as exc:
                out[addr] = exc
        return out

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

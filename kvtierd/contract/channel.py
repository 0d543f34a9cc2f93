"""One request/reply channel to kvtierd: a ZMQ DEALER socket speaking ``protocol``.

Synchronous by design: each call sends one frame and waits (bounded by ``timeout``) for the
reply with the same request id; a stale reply from an earlier timed-out call is discarded. A
channel belongs to one thread (ZMQ sockets are not thread-safe). The client library, kvtierctl
and the daemon launcher all talk through it.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import zmq

from . import protocol as P
from .errors import AccessDenied, DaemonUnavailable, LimitExceeded, from_reply
from .paths import access_problem
from .replies import decode_reply


class Channel:
    def __init__(self, socket_path: str, timeout: float = 10.0):
        # Checked first: ZMQ's connect to a socket this process may not open fails silently and
        # is retried, so the call would wait for its whole timeout and blame a daemon that runs.
        problem = access_problem(socket_path, write=True)
        if problem is not None:
            raise AccessDenied(problem)
        if not os.path.exists(socket_path):
            raise DaemonUnavailable(f"no kvtierd socket at {socket_path}; is the daemon running "
                                    "(systemctl status kvtierd), and is this the socket it printed at start?")
        self.socket_path = socket_path
        self.timeout_ms = int(timeout * 1000)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{socket_path}")
        self._rids = itertools.count(1)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request; return the reply's fields or raise its typed error."""
        rid = next(self._rids)
        frame = P.encode({"op": op, "rid": rid, **fields})
        if len(frame) > P.MAX_FRAME_BYTES:
            raise LimitExceeded(f"request of {len(frame)} bytes exceeds the {P.MAX_FRAME_BYTES}-byte frame limit; "
                                "split it")
        return self.call_raw(frame, rid)

    def call_raw(self, frame: bytes, rid: int = 0) -> dict[str, Any]:
        """Send an already encoded frame (also used by tests to send malformed ones)."""
        if self._sock is None:
            raise DaemonUnavailable("channel is closed")
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"kvtierd at {self.socket_path} does not accept requests") from None
        while True:
            if not self._sock.poll(self.timeout_ms, zmq.POLLIN):
                raise DaemonUnavailable(f"kvtierd at {self.socket_path} did not answer within "
                                        f"{self.timeout_ms / 1000:g}s")
            reply = decode_reply(self._sock.recv())
            if reply.get("rid") == rid:
                break
        if not reply["ok"]:
            raise from_reply(reply)
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

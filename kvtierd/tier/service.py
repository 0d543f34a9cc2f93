"""The tier companion: the process the daemon owns that talks to the second-tier engine.

Why a process (docs/tier.md): the daemon's loop must never block, and an engine client can — a
C++ client with threads of its own (Mooncake) may take seconds to fail when its master dies and
cannot be interrupted; a process boundary keeps its crashes, its threads and its GIL time out of
the daemon, and killing it is the one way to *prove* that an abandoned call no longer touches
the region's pages (the page fence).

It maps the daemon's region data file (``<name>.region``; the data area: ``--offset``/``--length``;
the daemon starts a new companion when it replaces that file), attaches it to the
backend (Mooncake registers it: zero-copy), connects a DEALER socket to the daemon's endpoint
and says ``ready`` (or ``failed`` with a typed error, then exits 1). Like a client, it populates
its mapping in the background (``Mapping.populate_in_background``): a get into pages this
process never touched would take a page fault per 4 KiB page on the transfer's path. Requests are msgpack maps
``{"op", "id", ...}`` and each gets exactly one reply ``{"id", "ok": True, ...}`` or
``{"id", "ok": False, "error": code, "message"}``:

``exists``  ns, keys                → present: one byte (0/1) per key
``put``     ns, keys, pages, length → done: one byte per key (the block is in the tier, sealed)
``get``     ns, keys, pages, length → done: one byte per key (the whole block landed in its pages
                                      and its seal held), rejected: {reason: blocks whose seal failed}
``remove``  ns, keys                → removed
``clear``   ns                      → removed (every key of the namespace)
``health``                          → the engine answered (an error reply otherwise)
``stats``                           → guards' states and counters, engine info
``stop``                            → replies, then the process exits

``ns`` is the namespace's identity (bytes, ``keys.Keyspace``); ``pages`` the blocks' pages as
little-endian uint32, ``len(keys) × pages_per_block``; ``length`` a block's bytes, or with
``shards`` (optional, default 1) the bytes of each of a block's ``shards`` equal runs of pages
(a sharded namespace's entry: every rank's shard starts on a page of its own; the tier's value
is the shards' bytes back to back, no padding). Two lanes,
each a thread with its own guard: ``meta`` (exists, remove, clear, health) and ``data`` (put,
get), so a lookup's existence check never queues behind a batch of block transfers. A reply to
a ``put``/``get`` means the backend call returned: the pages are no longer touched — also when
the guard gave up on it (past ``--data-timeout``): the lane then waits for the abandoned call to
return before it answers, and the daemon, which stops waiting at its own deadline, keeps the
pages fenced until this answer comes or it kills this process.

Seals (``seal``): every block put is sealed with the key in ``--key-file`` and every block got
is checked before it counts as landed. Failures are logged — a call's first failure after a
success, each breaker change — to stderr, which the daemon sends to ``<name>.tier.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import Counter, OrderedDict

import msgpack
import numpy as np
import zmq

from ..contract.mapping import Mapping
from .backend import Backend, Owner, TierError, TierTimeout, open_backend, page_extents
from .guard import Guard
from .keys import Keyspace
from .seal import SealKey, Sealer, load_key

log = logging.getLogger("kvtierd.tier")

OTHER_KEY_HINT = ("; they were sealed under another key than this node's (key id {}): give every node "
                  "that shares the tier the same tier_key_file")
LANES = {"exists": "meta", "remove": "meta", "clear": "meta", "health": "meta", "put": "data", "get": "data"}
KEYSPACES = 1024          # identities remembered (a daemon rarely serves more than a few namespaces)


class Service:
    def __init__(self, data: memoryview, page_size: int, backend: Backend, meta_backend: Backend,
                 timeout: float, data_timeout: float, failures: int, cooldown: float, key: SealKey):
        self.data = data
        self.page_size = page_size
        self.data_bytes = data.nbytes
        self.backend = backend
        self.key = key
        self.guards = {"meta": Guard(meta_backend, timeout, failures, cooldown, lane="meta"),
                       "data": Guard(backend, data_timeout, failures, cooldown, lane="data")}
        self.keyspaces: OrderedDict[bytes, tuple[Keyspace, Sealer]] = OrderedDict()
        self.counters: Counter = Counter()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        self.lanes = {name: queue.SimpleQueue() for name in self.guards}
        for name in self.lanes:
            threading.Thread(target=self._lane, args=(name,), name=f"lane-{name}", daemon=True).start()

    def keyspace(self, identity: bytes) -> tuple[Keyspace, Sealer]:
        """The namespace's tier keys and the sealer bound to its identity."""
        found = self.keyspaces.get(identity)
        if found is None:
            found = self.keyspaces[identity] = (Keyspace(identity), Sealer(self.key, identity))
            if len(self.keyspaces) > KEYSPACES:
                self.keyspaces.popitem(last=False)
        else:
            self.keyspaces.move_to_end(identity)
        return found

    # ------------------------------------------------------------------ lanes
    def _lane(self, name: str) -> None:
        guard, work = self.guards[name], self.lanes[name]
        while True:
            request = work.get()
            started = time.perf_counter()
            try:
                reply = {"ok": True, **self._run(guard, request)}
            except TierError as exc:
                if isinstance(exc, TierTimeout) and request.get("op") in ("put", "get"):
                    # The call still reads or writes the request's pages: answer once it returned.
                    guard.wait_abandoned()
                reply = {"ok": False, "error": exc.code, "message": str(exc)}
            except (KeyError, TypeError, ValueError) as exc:
                reply = {"ok": False, "error": "rejected", "message": f"bad {request.get('op')} request: {exc!r}"}
            reply["id"] = request.get("id")
            reply["seconds"] = time.perf_counter() - started
            self.outbox.put(reply)
            os.write(self.wake_w, b"x")

    def _extents(self, request: dict, n: int) -> list:
        pages = np.frombuffer(request["pages"], "<u4")
        shards = int(request.get("shards", 1))
        if n == 0 or shards < 1 or len(pages) % (n * shards):
            raise ValueError(f"{len(pages)} pages for {n} keys of {shards} shards")
        pages = pages.reshape(n * shards, -1)
        if pages.size and int(pages.max()) * self.page_size >= self.data_bytes:
            raise ValueError("a page lies outside the region's data area")
        runs = page_extents(pages, self.page_size, int(request["length"]))
        if shards == 1:
            return runs
        return [sum(runs[i:i + shards], []) for i in range(0, len(runs), shards)]

    def _run(self, guard: Guard, request: dict) -> dict:
        op = request["op"]
        if op == "health":
            guard.call("health")
            return {}
        keyspace, sealer = self.keyspace(request["ns"])
        if op == "clear":
            return {"removed": guard.call("clear", keyspace.prefix)}
        keys = keyspace.names(request["keys"])
        if op == "exists":
            present = guard.call("exists", keys)
            self.counters["exists_keys"] += len(keys)
            self.counters["exists_hits"] += sum(present)
            return {"present": bytes(present)}
        if op == "remove":
            return {"removed": guard.call("remove", keys)}
        if not keys:
            return {"done": b""}
        extents = self._extents(request, len(keys))
        shards = int(request.get("shards", 1))
        seals = sealer.seals(request["keys"], self.data, extents, shards)
        done = guard.call(op, keys, extents, seals)
        self.counters[f"{op}_blocks"] += sum(done)
        self.counters[f"{op}_bytes"] += sum(done) * int(request["length"]) * shards
        self.counters[f"{op}_failed_blocks"] += len(done) - sum(done)
        if op == "put":
            return {"done": bytes(done)}
        rejected = seals.rejected()
        for reason, n in rejected.items():
            if n:
                if not self.counters[f"seal_{reason}"]:
                    log.warning("%d promoted blocks failed their seal check (%s)%s", n, reason,
                                OTHER_KEY_HINT.format(self.key.id_hex) if reason == "other_key" else "")
                self.counters[f"seal_{reason}"] += n
        return {"done": bytes(done), "rejected": rejected}

    # ------------------------------------------------------------------ loop
    def info(self) -> dict:
        """The backend's own description and state, and the id of the key this companion seals with."""
        return {**self.backend.info(), "seal_key_id": self.key.id_hex}

    def stats(self) -> dict:
        return {"ok": True, "guards": {name: g.snapshot() for name, g in self.guards.items()},
                "counters": dict(self.counters), "info": self.info()}

    def serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if self.wake_r in events:
                os.read(self.wake_r, 1 << 16)
            while True:                       # replies the lanes finished
                try:
                    reply = self.outbox.get_nowait()
                except queue.Empty:
                    break
                sock.send(msgpack.packb(reply, use_bin_type=True))
            if sock not in events:
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    request = msgpack.unpackb(frame, raw=False)
                    op = request["op"]
                except Exception as exc:
                    sock.send(msgpack.packb({"id": None, "ok": False, "error": "rejected",
                                             "message": f"undecodable request: {exc!r}"}, use_bin_type=True))
                    continue
                if op == "stop":
                    sock.send(msgpack.packb({"id": request.get("id"), "ok": True}, use_bin_type=True))
                    return
                if op == "stats":
                    sock.send(msgpack.packb({"id": request.get("id"), **self.stats()}, use_bin_type=True))
                    continue
                lane = LANES.get(op)
                if lane is None:
                    sock.send(msgpack.packb({"id": request.get("id"), "ok": False, "error": "rejected",
                                             "message": f"unknown op {op!r}"}, use_bin_type=True))
                    continue
                self.lanes[lane].put(request)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtierd.tier.service", description="the kvtierd tier companion "
                                     "(started by the daemon, not by hand)")
    parser.add_argument("--endpoint", required=True, help="the daemon's tier socket (ipc://...)")
    parser.add_argument("--region", required=True, help="the region file")
    parser.add_argument("--offset", type=int, required=True, help="byte offset of the data area in the region")
    parser.add_argument("--length", type=int, required=True, help="bytes of the data area")
    parser.add_argument("--page-size", type=int, required=True)
    parser.add_argument("--backend", required=True, help="mooncake | redis | disk")
    parser.add_argument("--settings", default="{}", help="the backend's settings as JSON (its address included)")
    parser.add_argument("--key-file", required=True, help="the key that seals the tier's values (tier_key_file)")
    parser.add_argument("--owner", default="", help="the daemon's name (a disk tier refuses another daemon's data)")
    parser.add_argument("--timeout", type=float, default=1.0, help="deadline of an exists/remove/health call (s)")
    parser.add_argument("--data-timeout", type=float, default=10.0, help="deadline of a put/get batch (s)")
    parser.add_argument("--failures", type=int, default=3, help="consecutive failures that open the breaker")
    parser.add_argument("--cooldown", type=float, default=5.0, help="seconds the breaker stays open")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tier %(levelname)s %(message)s")

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.endpoint)

    def say(message: dict) -> None:
        sock.send(msgpack.packb({"id": None, "pid": os.getpid(), **message}, use_bin_type=True))

    try:
        key = load_key(args.key_file)
        mapping = Mapping.of_file(args.region)
        if mapping.size < args.offset + args.length:
            raise ValueError(f"{args.region} holds {mapping.size} bytes, not the data area's end "
                             f"{args.offset + args.length}")
        data = memoryview(mapping.buffer)[args.offset:args.offset + args.length]
        settings = json.loads(args.settings)
        backend = open_backend(args.backend, **settings)
        backend.attach(data, Owner(args.owner, key.id_hex))
        meta = backend if getattr(backend, "concurrent", False) else open_backend(args.backend, **settings)
    except TierError as exc:
        log.error("cannot open the %s backend: %s", args.backend, exc)
        say({"op": "failed", "error": exc.code, "message": str(exc)})
        return 1
    except (OSError, ValueError, TypeError) as exc:
        log.error("cannot open the %s backend: %s: %s", args.backend, type(exc).__name__, exc)
        say({"op": "failed", "error": "rejected", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    service = Service(data, args.page_size, backend, meta, args.timeout, args.data_timeout, args.failures,
                      args.cooldown, key)
    mapping.populate_in_background(threads=1)
    say({"op": "ready", "info": service.info()})
    log.info("serving %s for %s (seal key id %s)", args.backend, args.region, key.id_hex)
    service.serve(sock)
    for guard in service.guards.values():
        guard.close()
    sock.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())

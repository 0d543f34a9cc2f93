"""Hostile and malformed requests get typed errors; a well-behaved engine keeps being served."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kvtierd.contract import protocol as P
from kvtierd.contract.replies import decode_reply
from kvtierd.contract.codes import ErrorCode
from kvtierd.contract.channel import Channel

from .ranks import CacheSpec, all_call
from .test_tp_roundtrip import connect, keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NAMESPACE = {"model": "m", "dtype": "bfloat16", "block_tokens": 16, "block_bytes": 4096, "sharding": "replicated"}
SPEC = CacheSpec(num_blocks=16)
GOOD_NAMESPACE = {"model": "tiny-mla", "dtype": SPEC.dtype, "block_tokens": SPEC.row_shape[0],
                  "block_bytes": SPEC.block_bytes(), "sharding": "replicated"}     # the good engine's (connect)


def hello(**override):
    msg = {"op": "hello", "rid": 1, "version": P.PROTOCOL_VERSION, "engine": "hostile", "rank": 0,
           "world_size": 1, "namespace": dict(NAMESPACE)}
    msg.update(override)
    return msg


def error_code(channel: Channel, frame: bytes, rid: int) -> int:
    try:
        channel.call_raw(frame, rid)
    except Exception as exc:  # the typed client exception carries the wire code
        return int(exc.code)
    raise AssertionError("the daemon accepted a bad request")


# (name, frame, rid the reply should carry, expected code). Session-less cases come first.
BEFORE_HELLO = [
    ("invalid msgpack", b"\xc1\xc1\xc1", 0, ErrorCode.BAD_REQUEST),
    ("random bytes", bytes(range(256)) * 3, 0, ErrorCode.BAD_REQUEST),
    ("not a map", msgpack.packb([1, 2, 3]), 0, ErrorCode.BAD_REQUEST),
    ("unknown op", msgpack.packb({"op": "format_disk", "rid": 3}), 3, ErrorCode.BAD_REQUEST),
    ("op not a string", msgpack.packb({"op": 7, "rid": 4}), 4, ErrorCode.BAD_REQUEST),
    ("lookup before hello", msgpack.packb({"op": "lookup", "rid": 5, "keys": [b"k"]}), 5, ErrorCode.NOT_ATTACHED),
    ("commit before hello", msgpack.packb({"op": "commit", "rid": 6, "job": 1, "ok": True}), 6,
     ErrorCode.NOT_ATTACHED),
    ("wrong version", msgpack.packb(hello(version=99, rid=7)), 7, ErrorCode.VERSION),
    ("rank >= world_size", msgpack.packb(hello(rank=4, world_size=2, rid=8)), 8, ErrorCode.BAD_REQUEST),
    ("world_size wrong type", msgpack.packb(hello(world_size="2", rid=9)), 9, ErrorCode.BAD_REQUEST),
    ("rank is a bool", msgpack.packb(hello(rank=True, rid=10)), 10, ErrorCode.BAD_REQUEST),
    ("namespace sharding unknown", msgpack.packb(hello(namespace={**NAMESPACE, "sharding": "weird"}, rid=11)), 11,
     ErrorCode.BAD_REQUEST),
    ("negative block bytes", msgpack.packb(hello(namespace={**NAMESPACE, "block_bytes": -1}, rid=12)), 12,
     ErrorCode.BAD_REQUEST),
    ("frame over the limit", msgpack.packb({"op": "ping", "rid": 13, "pad": b"x" * P.MAX_FRAME_BYTES}), 13,
     ErrorCode.LIMIT),
]

AFTER_HELLO = [
    ("keys not bytes", msgpack.packb({"op": "lookup", "rid": 20, "keys": [1, 2]}), 20, ErrorCode.BAD_REQUEST),
    ("too many keys", msgpack.packb({"op": "lookup", "rid": 21,
                                     "keys": [i.to_bytes(4, "little") for i in range(P.MAX_KEYS_PER_REQUEST + 1)]}),
     21, ErrorCode.LIMIT),
    ("oversize key", msgpack.packb({"op": "lookup", "rid": 22, "keys": [b"k" * (P.MAX_KEY_BYTES + 1)]}), 22,
     ErrorCode.LIMIT),
    ("empty key", msgpack.packb({"op": "store", "rid": 23, "job": 1, "keys": [b""]}), 23, ErrorCode.LIMIT),
    ("duplicate keys", msgpack.packb({"op": "store", "rid": 24, "job": 1, "keys": [b"a", b"a"]}), 24,
     ErrorCode.BAD_REQUEST),
    ("negative job id", msgpack.packb({"op": "load", "rid": 25, "job": -1, "keys": [b"a"]}), 25,
     ErrorCode.BAD_REQUEST),
    ("job id too large", msgpack.packb({"op": "release", "rid": 26, "job": 2 ** 64 - 1}), 26, ErrorCode.BAD_REQUEST),
    ("commit unknown job", msgpack.packb({"op": "commit", "rid": 27, "job": 424242, "ok": True}), 27,
     ErrorCode.UNKNOWN_JOB),
    ("release unknown job", msgpack.packb({"op": "release", "rid": 28, "job": 424243}), 28, ErrorCode.UNKNOWN_JOB),
    ("abort unknown job", msgpack.packb({"op": "abort", "rid": 29, "job": 424244}), 29, ErrorCode.UNKNOWN_JOB),
    ("ok not a bool", msgpack.packb({"op": "commit", "rid": 30, "job": 1, "ok": 1}), 30, ErrorCode.BAD_REQUEST),
    # Rank 0 of the good engine is another process's (the same process would take its own orphan over).
    ("second rank 0", msgpack.packb(hello(rid=31, engine="good", world_size=2, namespace=GOOD_NAMESPACE)), 31,
     ErrorCode.LAYOUT_MISMATCH),
]


def test_each_bad_request_gets_its_typed_error_while_an_engine_is_served(daemon, ranks):
    procs = ranks(2)
    connect(procs, daemon, "good", SPEC, "replicated", seeds=[11, 11])
    src = procs[0].call("hashes", block_ids=list(range(16)))
    bad = Channel(daemon.socket, timeout=10)
    squatter = Channel(daemon.socket, timeout=10)
    job = 0

    def good_engine_round_trip():
        # Between every bad request: the well-behaved TP=2 engine stores and loads correctly.
        nonlocal job
        job += 2
        keys = keys_for(f"good-{job}", 2)
        for s in all_call(procs, "store", job=job, keys=keys, block_ids=[job % 8, job % 8 + 1]):
            assert s["ok"], s
        for x in all_call(procs, "load", job=job + 1, keys=keys, block_ids=[14, 15]):
            assert x["hits"] == 2 and x["ok"], x
        for hashes in all_call(procs, "hashes", block_ids=[14, 15]):
            assert hashes == src[job % 8: job % 8 + 2]

    try:
        for name, frame, rid, code in BEFORE_HELLO:
            assert error_code(bad, frame, rid) == code, name
            good_engine_round_trip()
        bad.call("hello", **{k: v for k, v in hello().items() if k not in ("op", "rid")})
        for name, frame, rid, code in AFTER_HELLO:
            channel = squatter if name == "second rank 0" else bad
            assert error_code(channel, frame, rid) == code, name
            good_engine_round_trip()
        # A multi-frame message is refused as well (clients send exactly one frame).
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"ipc://{daemon.socket}")
        raw.send_multipart([msgpack.packb({"op": "ping", "rid": 1}), b"extra"])
        assert raw.poll(10000)
        assert decode_reply(raw.recv())["code"] == ErrorCode.BAD_REQUEST
        raw.close()
        good_engine_round_trip()
    finally:
        bad.close()
        squatter.close()
    stats = daemon.stats()
    assert stats["errors"]["BAD_REQUEST"] >= 10 and stats["errors"]["LIMIT"] >= 4
    assert stats["errors"].get("INTERNAL", 0) == 0
    assert daemon.proc.poll() is None

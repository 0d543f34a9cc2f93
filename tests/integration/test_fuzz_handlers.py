"""Property test over the whole request path of a live daemon: decoder, validation, every handler.

One daemon serves the whole test. Hypothesis sends frames over a raw DEALER socket: random bytes,
random msgpack structures, crafted hostile frames (nesting bombs, huge declared lengths, frames
just over ``MAX_FRAME_BYTES``, multi-part messages), and — most of all — valid requests of every
op in ``kvtierd.contract.protocol.REQUESTS`` (built from its field specs, so new ops are covered without
touching this file) with fields replaced by random types, huge ints, huge strings, long lists,
removed, or joined by unknown ones. The socket holds a session (a valid ``hello``, renewed when a
frame ended it), so the session handlers run too, not only the validator.

For every frame: exactly one reply comes back (a ``ping`` sent behind it is answered next),
it is a map with ``ok``; an error names a known code, never INTERNAL, under the frame's ``rid``
when the frame carried a readable one. Afterwards the daemon's error counters hold no INTERNAL,
its log no traceback, nothing is left pinned or WRITING once the fuzz session said bye, and a
well-behaved TP=1 engine still stores and loads correct bytes.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtierd.contract import protocol as P
from kvtierd.contract.codes import ErrorCode

from .ranks import CacheSpec
from .test_faults import assert_settled, attach, clobber, load_and_verify, store_all
from .test_tp_roundtrip import keys_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

EXAMPLES = 500
NAMESPACE = {"model": "fuzz-model", "dtype": "bfloat16", "block_tokens": 16, "block_bytes": 8192, "sharding": "replicated"}
KNOWN_CODES = {int(c) for c in ErrorCode}


def pidns() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def canonical_hello() -> dict:
    # Watched through a pidfd (this process), so the daemon expects no heartbeats from it.
    return {"op": "hello", "version": P.PROTOCOL_VERSION, "engine": "fuzz", "rank": 0, "world_size": 1,
            "namespace": dict(NAMESPACE), "pid": os.getpid(), "pidns": pidns()}


def valid_value(op: str, name: str, spec: P.Field):
    """A value that passes ``spec`` (and makes sense for the op)."""
    if op == "hello":
        return canonical_hello().get(name, 1)
    if spec.kind == "int":
        return spec.lo if spec.lo is not None else 0
    if spec.kind == "str":
        return spec.choices[0] if spec.choices else "x"
    if spec.kind == "bool":
        return True
    if spec.kind == "keys":
        return [b"fuzz-key-1", b"fuzz-key-2"]
    if spec.kind == "ints":
        return [1, 2]
    if spec.kind == "map":
        return {}
    return b"x"


def valid_requests() -> dict[str, dict]:
    out = {}
    for op, fields in P.REQUESTS.items():
        msg = {"op": op}
        for name, spec in fields.items():
            if spec.required or op == "hello":
                msg[name] = valid_value(op, name, spec)
        out[op] = msg
    out["hello"] = canonical_hello()
    return out


TEMPLATES = valid_requests()

# Values built once (hypothesis would spend its whole budget generating megabytes).
HUGE = [
    2 ** 63, 2 ** 64 - 1, -(2 ** 63), 2 ** 31, 2 ** 31 - 1, -1, 0, 1 << 40,
    "x" * (P.MAX_STR_BYTES - 1), "x" * P.MAX_STR_BYTES, "x" * (P.MAX_STR_BYTES + 1), "é" * 200, "x" * 100_000,
    b"k" * P.MAX_KEY_BYTES, b"k" * (P.MAX_KEY_BYTES + 1), b"k" * 2_000_000, b"",
    [b"k%d" % i for i in range(P.MAX_KEYS_PER_REQUEST)],
    [b"k%d" % i for i in range(P.MAX_KEYS_PER_REQUEST + 1)],
    [i for i in range(P.MAX_JOBS_PER_QUERY + 1)],
    [b"same", b"same"], [b""], [None], [[b"nested"]], [2 ** 64 - 1],
    {"model": "m"}, {f"f{i}": i for i in range(33)}, {"a": {"b": {"c": {"d": [1, [2, [3]]]}}}},
    float("nan"), float("inf"), -0.0, True, False, None,
]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 63), 2 ** 64 - 1), st.floats(),
                    st.text(max_size=40), st.binary(max_size=80))
short_keys = st.one_of(st.text(max_size=12), st.binary(max_size=12), st.integers(-1000, 1000))
structures = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                           st.dictionaries(short_keys, inner, max_size=6)),
                          max_leaves=25)
nasty = st.one_of(scalars, structures, st.sampled_from(HUGE))
field_names = st.sampled_from(sorted({name for fields in P.REQUESTS.values() for name in fields}
                                     | set(P.NAMESPACE_FIELDS) | {"op", "rid", "unknown_field"}))


KEY_POOL = [b"fuzz-key-%d" % i for i in range(24)]     # shared, so jobs meet each other's keys


def spec_value(name: str, spec: P.Field):
    """Values judged by ``spec``: mostly valid (random within range, or from small pools so that
    stores, commits, loads and releases meet the same jobs and keys), and its boundaries ±1."""
    if spec.kind == "int":
        lo, hi = spec.lo or 0, spec.hi if spec.hi is not None else 2 ** 63 - 1
        small = [st.integers(0, 20)] if name in ("job", "session", "rid") else []
        return st.one_of(*small, st.integers(lo, hi), st.sampled_from([lo, hi, lo - 1, hi + 1]))
    if spec.kind == "str":
        if spec.choices:
            return st.one_of(st.sampled_from(spec.choices), st.text(max_size=12))
        return st.one_of(st.text(min_size=spec.lo or 0, max_size=spec.hi or P.MAX_STR_BYTES),
                         st.sampled_from(["", "a" * (spec.hi or P.MAX_STR_BYTES), "a" * ((spec.hi or 0) + 1)]))
    if spec.kind == "bool":
        return st.booleans()
    if spec.kind == "keys":
        return st.one_of(st.lists(st.sampled_from(KEY_POOL), unique=True, max_size=12),
                         st.lists(st.binary(min_size=0, max_size=P.MAX_KEY_BYTES + 1), max_size=8))
    if spec.kind == "ints":
        return st.lists(st.integers(spec.lo or 0, spec.hi if spec.hi is not None else 2 ** 63), max_size=8)
    if spec.kind == "map":
        return st.fixed_dictionaries({k: spec_value(k, f) for k, f in P.NAMESPACE_FIELDS.items()})
    return nasty


@st.composite
def mutated_request(draw) -> dict:
    op = draw(st.sampled_from(sorted(TEMPLATES)))
    msg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TEMPLATES[op].items()}
    msg["rid"] = draw(st.integers(1, 2 ** 62))
    fields = P.REQUESTS[op]
    for name, spec in fields.items():          # valid values of every field, drawn per spec
        if name in msg and name not in ("version", "pid", "pidns") and draw(st.booleans()):
            msg[name] = draw(spec_value(name, spec))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["replace", "spec", "spec", "delete", "add", "namespace", "op"]))
        if action == "replace" and len(msg) > 1:
            msg[draw(st.sampled_from(sorted(msg)))] = draw(nasty)
        elif action == "spec" and fields:
            name = draw(st.sampled_from(sorted(fields)))
            msg[name] = draw(spec_value(name, fields[name]))
        elif action == "delete" and len(msg) > 1:
            msg.pop(draw(st.sampled_from(sorted(msg))))
        elif action == "add":
            msg[draw(field_names)] = draw(nasty)
        elif action == "namespace" and isinstance(msg.get("namespace"), dict):
            namespace = msg["namespace"]
            name = draw(st.sampled_from(sorted(P.NAMESPACE_FIELDS)))
            choice = draw(st.integers(0, 2))
            if choice == 0:
                namespace[name] = draw(nasty)
            elif choice == 1:
                namespace[name] = draw(spec_value(name, P.NAMESPACE_FIELDS[name]))
            else:
                namespace.pop(name, None)
        elif action == "op":
            msg["op"] = draw(st.one_of(st.sampled_from(sorted(P.REQUESTS) + sorted(P.ADMIN_REQUESTS)), nasty))
    if draw(st.integers(0, 9)) == 0:          # the same request with its fields in another order
        items = list(msg.items())
        msg = dict(draw(st.permutations(items)))
    return msg


def crafted() -> list[bytes]:
    over = P.encode({"rid": 77, "op": "ping", "pad": b"x" * P.MAX_FRAME_BYTES})
    return [
        b"", b"\xc1", b"\x91" * 100_000 + b"\xc0", b"\x81\xa2op" + b"\x91" * 5000 + b"\xc0",
        b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
        b"\xc7\x05\x01abcde", b"\xd4\x01\x00", over[: P.MAX_FRAME_BYTES + 1], over,
        P.encode({"op": "hello", "rid": 5})[:-1], P.encode({"op": "store", "rid": 6, "job": 1, "keys": [b"a"]}) + b"\x00",
    ]


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def message(draw) -> tuple[list[bytes], object]:
    """(frames, the object packed into the first frame or None when it is not a packed object)."""
    kind = draw(st.sampled_from(["request"] * 6 + ["structure", "bytes", "crafted", "multipart"]))
    if kind == "request":
        obj = draw(mutated_request())
        return [pack(obj)], obj
    if kind == "structure":
        obj = draw(st.one_of(structures, st.dictionaries(short_keys, structures, max_size=8)))
        return [pack(obj)], obj
    if kind == "bytes":
        return [draw(st.binary(max_size=600))], None
    if kind == "crafted":
        return [draw(st.sampled_from(CRAFTED))], None
    obj = draw(mutated_request())
    return [pack(obj)] + draw(st.lists(st.binary(max_size=20), min_size=1, max_size=3)), None


CRAFTED = crafted()
LIMIT_EXAMPLES = [
    ([pack(m)], m) for m in (
        {"op": "lookup", "rid": 31, "keys": [b"k" * (P.MAX_KEY_BYTES + 1)]},
        {"op": "store", "rid": 32, "job": 1, "keys": [b"%d" % i for i in range(P.MAX_KEYS_PER_REQUEST + 1)]},
        {"rid": 33, "op": "ping", "pad": b"x" * P.MAX_FRAME_BYTES},
    )
]


def expected_rid(frames: list[bytes], obj) -> int | None:
    """The rid the reply must carry, or None when the frame gives no reliable one."""
    if len(frames) != 1:
        return 0                                       # multi-part: refused before decoding
    if not isinstance(obj, dict) or len(frames[0]) > P.MAX_FRAME_BYTES or len(obj) > 32:
        return None
    rid = obj.get("rid", 0)
    return rid if type(rid) is int and 0 <= rid < (1 << 63) else 0


class Raw:
    """A bare DEALER socket speaking frames, with a ping sentinel to count replies."""

    def __init__(self, path: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{path}")
        self.sentinel = 1 << 62

    def recv(self) -> dict:
        assert self.sock.poll(15_000), "no reply within 15 s"
        parts = self.sock.recv_multipart()
        assert len(parts) == 1, f"a reply of {len(parts)} frames"
        reply = msgpack.unpackb(parts[0], raw=False, strict_map_key=False)
        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
        return reply

    def exchange(self, frames: list[bytes]) -> tuple[dict, dict]:
        """Send ``frames`` as one message, then a ping; return (the one reply, the ping's)."""
        self.sentinel += 1
        self.sock.send_multipart(frames)
        self.sock.send(pack({"op": "ping", "rid": self.sentinel}))
        reply = self.recv()
        ping = self.recv()
        assert ping.get("rid") == self.sentinel and ping["ok"], f"more than one reply, or lost: {reply}, {ping}"
        return reply, ping

    def call(self, msg: dict) -> dict:
        self.sentinel += 1
        self.sock.send(pack({**msg, "rid": self.sentinel}))
        reply = self.recv()
        assert reply.get("rid") == self.sentinel, reply
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)


def test_random_and_mutated_frames_get_one_typed_reply_each(daemon, ranks):
    raw = Raw(daemon.socket)
    bare = Raw(daemon.socket)                        # never attached on purpose (sessionless path)
    hello = raw.call(canonical_hello())
    assert hello["ok"], hello
    seen_codes: dict[str, int] = {}
    oks = [0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(msg=message(), sessionless=st.integers(0, 4).map(lambda n: n == 0))
    @example(msg=LIMIT_EXAMPLES[0], sessionless=False)     # every run covers the limits
    @example(msg=LIMIT_EXAMPLES[1], sessionless=False)
    @example(msg=LIMIT_EXAMPLES[2], sessionless=True)
    def one_frame(msg, sessionless):
        frames, obj = msg
        sock = bare if sessionless else raw
        reply, ping = sock.exchange(frames)
        assert type(reply.get("rid")) is int, reply
        if reply["ok"]:
            oks[0] += 1
        else:
            assert reply.get("code") in KNOWN_CODES, reply
            assert reply["code"] != ErrorCode.INTERNAL, reply
            assert reply.get("error") == ErrorCode(reply["code"]).name and isinstance(reply.get("message"), str)
            seen_codes[reply["error"]] = seen_codes.get(reply["error"], 0) + 1
        rid = expected_rid(frames, obj)
        if rid is not None:
            assert reply["rid"] == rid, (rid, reply)
        if len(frames) != 1:
            assert not reply["ok"] and reply["code"] == ErrorCode.BAD_REQUEST, reply
        if ping.get("attached") is not (not sessionless):   # restore: bare detached, raw attached
            again = sock.call({"op": "bye"} if sessionless else canonical_hello())
            assert again["ok"], again

    try:
        one_frame()
        assert daemon.proc.poll() is None, "kvtierd died"
        # The fuzz reached past the validator: session and job handlers answered too.
        assert oks[0] > 0 and {"BAD_REQUEST", "LIMIT"} <= set(seen_codes), (oks, seen_codes)
        stats = daemon.stats()
        assert stats["errors"].get("INTERNAL", 0) == 0, stats["errors"]
        assert sum(stats["errors"].values()) >= sum(seen_codes.values())
        raw.call({"op": "bye"})                      # its open jobs abort, its pages come back
    finally:
        raw.close()
        bare.close()
    log = daemon.log()
    assert "Traceback" not in log and "internal error" not in log

    # A well-behaved engine round-trips correct bytes on the same daemon.
    spec = CacheSpec(num_blocks=8)
    (good,) = ranks(1)
    attach([good], daemon, "well-behaved", 1, [0], seeds=[21], spec=spec)
    keys = keys_for("after-fuzz", 4)
    source = good.call("hashes", block_ids=[0, 1, 2, 3])
    store_all([good], 1, keys, [0, 1, 2, 3])
    clobber([good], [4, 5, 6, 7])
    load_and_verify([good], 2, keys, [4, 5, 6, 7], source)
    good.call("close")
    # Sessions of this process the fuzz re-helloed or took over with a store in flight keep their
    # pages fenced while this process lives (they might still copy): living writers.
    assert_settled(daemon, living_writers=True)

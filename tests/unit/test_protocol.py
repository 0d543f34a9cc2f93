"""kvtierd.contract.protocol: encode/decode round trips, every validation failure, and a fuzz property:
decode_request returns a dict or raises RequestError, never anything else."""

from __future__ import annotations

import copy

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtierd.contract import protocol as P
from kvtierd.contract.events import MAX_EVENT_KEYS
from kvtierd.contract.replies import LoadReply, decode_reply, error_reply, ok_reply
from kvtierd.contract.namespace import MAX_BLOCK_BYTES
from kvtierd.contract.codes import ErrorCode, RequestError

NAMESPACE = {"model": "deepseek-ai/DeepSeek-V3", "dtype": "bfloat16", "block_tokens": 16, "block_bytes": 1152 * 61,
             "sharding": "replicated"}
KEYS = [bytes([i]) * 32 + b"\x00\x00\x00\x01" for i in range(5)]

VALID: dict[str, dict] = {
    "hello": {"op": "hello", "rid": 1, "version": P.PROTOCOL_VERSION, "engine": "engine-a", "rank": 0,
              "world_size": 4, "namespace": NAMESPACE, "pid": 1234, "pidns": 4026531836},
    "ping": {"op": "ping", "rid": 2},
    "bye": {"op": "bye", "rid": 3},
    "lookup": {"op": "lookup", "rid": 4, "keys": KEYS, "lease": 3, "ttl_ms": 2000},
    "store": {"op": "store", "rid": 5, "job": 7, "keys": KEYS},
    "commit": {"op": "commit", "rid": 6, "job": 7, "ok": True},
    "load": {"op": "load", "rid": 7, "job": 8, "keys": KEYS[:2], "lease": 3},
    "unlease": {"op": "unlease", "rid": 12, "leases": [3, 4]},
    "release": {"op": "release", "rid": 8, "job": 8},
    "abort": {"op": "abort", "rid": 9, "job": 9},
    "jobs": {"op": "jobs", "rid": 10, "jobs": [1, 2, 3]},
    "stats": {"op": "stats", "rid": 11},
    "events": {"op": "events", "rid": 13, "epoch": 5, "cursor": 9, "snapshot_from": None, "max_keys": 4096},
}


def req(op: str, **changes) -> dict:
    msg = copy.deepcopy(VALID[op])
    msg.update(changes)
    return msg


def without(op: str, field: str) -> dict:
    msg = copy.deepcopy(VALID[op])
    del msg[field]
    return msg


def fails(msg_or_frame, code: ErrorCode, *words: str) -> RequestError:
    frame = msg_or_frame if isinstance(msg_or_frame, (bytes, bytearray)) else P.encode(msg_or_frame)
    with pytest.raises(RequestError) as info:
        P.decode_request(frame)
    assert info.value.code == code, info.value.message
    for w in words:
        assert w in info.value.message, (w, info.value.message)
    return info.value


# --- round trips ------------------------------------------------------------------------------
def test_valid_covers_every_op():
    assert set(VALID) == set(P.REQUESTS)


@pytest.mark.parametrize("op", sorted(P.REQUESTS))
def test_round_trip_every_op(op):
    msg = VALID[op]
    assert P.decode_request(P.encode(msg)) == msg


def test_round_trip_optional_and_nullable_fields():
    coord = without("hello", "pid")
    del coord["pidns"]
    coord["rank"] = None   # a coordinator session
    assert P.decode_request(P.encode(coord)) == coord
    sharded = req("hello", namespace=dict(NAMESPACE, sharding="sharded"))
    assert P.decode_request(P.encode(sharded))["namespace"]["sharding"] == "sharded"


def test_round_trip_limits_inclusive():
    keys = [i.to_bytes(4, "little") for i in range(P.MAX_KEYS_PER_REQUEST)]
    assert len(P.decode_request(P.encode(req("lookup", keys=keys)))["keys"]) == P.MAX_KEYS_PER_REQUEST
    big = [b"k" * P.MAX_KEY_BYTES, b"\x00"]
    assert P.decode_request(P.encode(req("store", keys=big)))["keys"] == big
    assert P.decode_request(P.encode(req("store", job=P.MAX_JOB_ID)))["job"] == P.MAX_JOB_ID
    assert P.decode_request(P.encode(req("store", job=0, keys=[])))["keys"] == []
    assert P.decode_request(P.encode(req("jobs", jobs=list(range(P.MAX_JOBS_PER_QUERY)))))
    top = req("hello", rank=P.MAX_WORLD_SIZE - 1, world_size=P.MAX_WORLD_SIZE, engine="e" * P.MAX_STR_BYTES,
              namespace=dict(NAMESPACE, block_bytes=MAX_BLOCK_BYTES, dtype="d" * 32))
    assert P.decode_request(P.encode(top)) == top


def test_rid_defaults_and_extra_fields_are_ignored():
    msg = {"op": "ping"}
    assert P.decode_request(P.encode(msg)) == msg
    fwd = req("commit", future_field=[1, 2, {"x": b"y"}])
    assert P.decode_request(P.encode(fwd))["future_field"] == [1, 2, {"x": b"y"}]


def test_keys_come_back_as_bytes_and_pages_dtype():
    out = P.decode_request(P.encode(VALID["store"]))
    assert all(type(k) is bytes for k in out["keys"])
    assert P.PAGES_DTYPE == "<u4"


def test_replies():
    ok = ok_reply(5, LoadReply(1, b"\x01\x00\x00\x00"))
    assert ok == {"rid": 5, "ok": True, "hits": 1, "pages": b"\x01\x00\x00\x00"}
    assert decode_reply(P.encode(ok)) == ok
    err = error_reply(6, ErrorCode.CONFLICT, "other keys", job=3)
    assert err == {"rid": 6, "ok": False, "code": 5, "error": "CONFLICT", "message": "other keys", "job": 3}
    assert decode_reply(P.encode(err)) == err
    with pytest.raises(ValueError):
        decode_reply(P.encode([1, 2]))
    with pytest.raises(ValueError):
        decode_reply(P.encode({"rid": 1}))


def test_error_codes_are_stable():
    assert [(c.name, int(c)) for c in ErrorCode] == [
        ("BAD_REQUEST", 1), ("VERSION", 2), ("NOT_ATTACHED", 3), ("LAYOUT_MISMATCH", 4), ("CONFLICT", 5),
        ("UNKNOWN_JOB", 6), ("NO_SPACE", 7), ("TIMEOUT", 8), ("SHUTTING_DOWN", 9), ("ABORTED", 10),
        ("LIMIT", 11), ("FORBIDDEN", 12), ("INTERNAL", 13)]
    assert RequestError(7, "x").code is ErrorCode.NO_SPACE


# --- validation failures ----------------------------------------------------------------------
REQUIRED = sorted((op, name) for op, spec in P.REQUESTS.items() for name, f in spec.items() if f.required)


@pytest.mark.parametrize("op,field", REQUIRED)
def test_missing_required_field(op, field):
    fails(without(op, field), ErrorCode.BAD_REQUEST, "missing", repr(field))


@pytest.mark.parametrize("field", sorted(P.NAMESPACE_FIELDS))
def test_missing_namespace_field(field):
    namespace = dict(NAMESPACE)
    del namespace[field]
    fails(req("hello", namespace=namespace), ErrorCode.BAD_REQUEST, "hello.namespace", repr(field))


INT_FIELDS = sorted((op, name) for op, spec in P.REQUESTS.items() for name, f in spec.items() if f.kind == "int")
WRONG_FOR_INT = [True, False, 1.0, "1", b"1", [1], {"a": 1}]


@pytest.mark.parametrize("op,field", INT_FIELDS)
@pytest.mark.parametrize("value", WRONG_FOR_INT, ids=repr)
def test_wrong_type_for_int_fields(op, field, value):
    fails(req(op, **{field: value}), ErrorCode.BAD_REQUEST, field)


@pytest.mark.parametrize("op,field", [(op, f) for op, f in INT_FIELDS if not P.REQUESTS[op][f].nullable])
def test_none_for_non_nullable_int(op, field):
    fails(req(op, **{field: None}), ErrorCode.BAD_REQUEST, field)


@pytest.mark.parametrize("field", ["block_tokens", "block_bytes"])
@pytest.mark.parametrize("value", [True, 1.5, "16", None])
def test_wrong_type_for_namespace_ints(field, value):
    fails(req("hello", namespace=dict(NAMESPACE, **{field: value})), ErrorCode.BAD_REQUEST, field)


@pytest.mark.parametrize("op,field,value", [
    ("store", "job", -1), ("store", "job", P.MAX_JOB_ID + 1), ("load", "job", -5),
    ("release", "job", (1 << 64) - 1), ("commit", "job", -(1 << 63)),
    ("hello", "version", -1), ("hello", "version", (1 << 31) + 1),
    ("hello", "world_size", 0), ("hello", "world_size", P.MAX_WORLD_SIZE + 1), ("hello", "world_size", -1),
    ("hello", "rank", -1), ("hello", "rank", P.MAX_WORLD_SIZE),
    ("hello", "pid", -1), ("hello", "pid", (1 << 31) + 1), ("hello", "pidns", -1),
    ("events", "max_keys", 0), ("events", "max_keys", MAX_EVENT_KEYS + 1), ("events", "cursor", -1),
    ("events", "epoch", (1 << 63) + 1), ("events", "snapshot_from", -1),
])
def test_out_of_range_ints(op, field, value):
    fails(req(op, **{field: value}), ErrorCode.BAD_REQUEST, field)


@pytest.mark.parametrize("field,value", [
    ("block_tokens", 0), ("block_tokens", (1 << 20) + 1), ("block_bytes", 0), ("block_bytes", -4096),
    ("block_bytes", MAX_BLOCK_BYTES + 1),
])
def test_out_of_range_namespace_ints(field, value):
    fails(req("hello", namespace=dict(NAMESPACE, **{field: value})), ErrorCode.BAD_REQUEST, field)


@pytest.mark.parametrize("rank,world_size", [(1, 1), (4, 4), (5, 4), (63, 2)])
def test_rank_must_be_below_world_size(rank, world_size):
    fails(req("hello", rank=rank, world_size=world_size), ErrorCode.BAD_REQUEST, "rank", "world_size")


@pytest.mark.parametrize("rank,world_size", [(0, 1), (3, 4), (None, 8), (63, 64)])
def test_rank_fields_accepted(rank, world_size):
    out = P.decode_request(P.encode(req("hello", rank=rank, world_size=world_size)))
    assert (out["rank"], out["world_size"]) == (rank, world_size)


@pytest.mark.parametrize("rank,ranks", [(8, list(range(8, 16))), (None, [8, 9]), (0, [0]), (15, [15, 3])])
def test_node_ranks_accepted(rank, ranks):
    out = P.decode_request(P.encode(req("hello", rank=rank, world_size=16, node_ranks=ranks)))
    assert out["node_ranks"] == ranks


@pytest.mark.parametrize("rank,ranks,words", [
    (8, list(range(8)), ("node_ranks", "rank 8", "its own node")),        # its own rank missing
    (0, [0, 16], ("node_ranks", "world_size 16")),                       # past the world
    (0, [0, 0, 1], ("node_ranks", "distinct")),
    (None, [], ("node_ranks", "at least one")),
    (0, [0, -1], ("node_ranks",)), (0, [0, 1.5], ("node_ranks",)), (0, "0-7", ("node_ranks",)),
    (0, [0, True], ("node_ranks",)),
])
def test_wrong_node_ranks(rank, ranks, words):
    fails(req("hello", rank=rank, world_size=16, node_ranks=ranks), ErrorCode.BAD_REQUEST, *words)


def test_node_ranks_are_bounded():
    fails(req("hello", world_size=P.MAX_WORLD_SIZE, node_ranks=list(range(P.MAX_WORLD_SIZE)) * 2), ErrorCode.LIMIT)


@pytest.mark.parametrize("field,value", [
    ("engine", ""), ("engine", 5), ("engine", b"engine"), ("engine", None), ("engine", ["e"]),
    ("engine", "e" * (P.MAX_STR_BYTES + 1)),                 # refused by the bounded decoder
    ("engine", "é" * (P.MAX_STR_BYTES // 2 + 1)),             # bytes, not characters, count
    ("namespace", "replicated"), ("namespace", [NAMESPACE]), ("namespace", None),
])
def test_wrong_hello_fields(field, value):
    fails(req("hello", **{field: value}), ErrorCode.BAD_REQUEST)


@pytest.mark.parametrize("field,value", [
    ("model", ""), ("model", 3), ("dtype", "x" * 33), ("dtype", b"bf16"), ("sharding", "mixed"),
    ("sharding", "REPLICATED"), ("sharding", 0), ("sharding", None),
])
def test_wrong_namespace_fields(field, value):
    fails(req("hello", namespace=dict(NAMESPACE, **{field: value})), ErrorCode.BAD_REQUEST, field)


@pytest.mark.parametrize("value", ["m\0", "\0m", "m\n", "m\t", "m\x7f", "m\x85"])
@pytest.mark.parametrize("where", ["engine", "model", "dtype"])
def test_control_characters_in_strings_are_refused(where, value):
    """A restarted daemon reads names back from fixed-width fields that drop trailing NULs: "m\\0"
    would become "m", another engine's namespace (issue 10 item 6)."""
    msg = req("hello", engine=value) if where == "engine" else req("hello", namespace=dict(NAMESPACE, **{where: value}))
    fails(msg, ErrorCode.BAD_REQUEST, where, "control character")


def test_printable_strings_pass():
    P.decode_request(P.encode(req("hello", engine="engine a/β-1", namespace=dict(NAMESPACE, model="org/m v2 (β)"))))


@pytest.mark.parametrize("value", [1, 0, None, "true", 1.0, b"\x01"])
def test_commit_ok_must_be_bool(value):
    fails(req("commit", ok=value), ErrorCode.BAD_REQUEST, "ok")


def test_commit_ok_false_is_valid():
    assert P.decode_request(P.encode(req("commit", ok=False)))["ok"] is False


@pytest.mark.parametrize("op", ["lookup", "store", "load"])
@pytest.mark.parametrize("value", [b"k" * 32, "abc", 5, None, {"k": b"v"}, [b"a", "b"], [b"a", 1], [[b"a"]],
                                   [None], [True]], ids=repr)
def test_keys_wrong_type(op, value):
    fails(req(op, keys=value), ErrorCode.BAD_REQUEST, "keys")


@pytest.mark.parametrize("op", ["lookup", "store", "load"])
def test_too_many_keys_is_limit(op):
    keys = [i.to_bytes(4, "little") for i in range(P.MAX_KEYS_PER_REQUEST + 1)]
    fails(req(op, keys=keys), ErrorCode.LIMIT)
    fails(req(op, keys=keys * 3), ErrorCode.LIMIT)


@pytest.mark.parametrize("op", ["lookup", "store", "load"])
def test_oversize_key_is_limit(op):
    fails(req(op, keys=[b"a", b"k" * (P.MAX_KEY_BYTES + 1)]), ErrorCode.LIMIT, str(P.MAX_KEY_BYTES + 1))
    fails(req(op, keys=[b"k" * 100_000]), ErrorCode.LIMIT)


@pytest.mark.parametrize("op", ["lookup", "store", "load"])
def test_empty_key_is_limit(op):
    fails(req(op, keys=[b"a", b""]), ErrorCode.LIMIT, "0 bytes")


@pytest.mark.parametrize("op", ["lookup", "store", "load"])
def test_duplicate_keys(op):
    fails(req(op, keys=[b"a", b"b", b"a"]), ErrorCode.BAD_REQUEST, "duplicate")
    many = [i.to_bytes(2, "little") for i in range(100)] + [b"\x05\x00"]
    fails(req(op, keys=many), ErrorCode.BAD_REQUEST, "duplicate")


@pytest.mark.parametrize("value", [5, None, [1, "2"], [True], [-1], [P.MAX_JOB_ID + 1], [1.0], "1,2", b"\x01"])
def test_jobs_field(value):
    fails(req("jobs", jobs=value), ErrorCode.BAD_REQUEST, "jobs")


def test_too_many_jobs_is_limit():
    fails(req("jobs", jobs=list(range(P.MAX_JOBS_PER_QUERY + 1))), ErrorCode.LIMIT)
    fails(req("jobs", jobs=list(range(P.MAX_KEYS_PER_REQUEST + 1))), ErrorCode.LIMIT)


@pytest.mark.parametrize("op", ["nope", "", "HELLO", "hello "], ids=repr)
def test_unknown_op(op):
    fails({"op": op, "rid": 1}, ErrorCode.BAD_REQUEST, "unknown op")


@pytest.mark.parametrize("op", [1, None, True, b"hello", ["ping"]], ids=repr)
def test_op_not_a_string(op):
    fails({"op": op, "rid": 1}, ErrorCode.BAD_REQUEST, "field 'op' must be a string")


def test_missing_op():
    fails({"rid": 1, "keys": KEYS}, ErrorCode.BAD_REQUEST, "field 'op' must be a string, got NoneType")


@pytest.mark.parametrize("depth", [999, 1000, 1023])
def test_an_op_nested_a_thousand_deep_is_refused_without_walking_it(depth):
    # Issue 11: repr() of such an op raised RecursionError and ended the daemon.
    frame = b"\x82\xa2op" + b"\x91" * depth + b"\xc0" + b"\xa3rid\x05"
    err = fails(frame, ErrorCode.BAD_REQUEST, "got list")
    assert len(err.message) < 100


def test_an_error_never_quotes_an_unbounded_value():
    # A 4 MB op used to come back as a 16 MB reply (its repr).
    huge = b"\x00" * (P.MAX_FRAME_BYTES - 64)
    err = fails({"op": huge, "rid": 9}, ErrorCode.BAD_REQUEST, "got bytes")
    assert len(err.message) < 100
    reply = error_reply(9, ErrorCode.INTERNAL, "x" * 10_000)
    assert len(reply["message"]) == P.MAX_ERROR_CHARS and reply["message"].endswith("...")


@pytest.mark.parametrize("rid", [-1, 1 << 63, True, "1", 1.0, None, [1]], ids=repr)
def test_bad_rid(rid):
    fails(req("ping", rid=rid), ErrorCode.BAD_REQUEST, "rid")


@pytest.mark.parametrize("obj", [[], [1, 2], "ping", b"ping", 5, None, True, 1.5, ["op", "ping"]], ids=repr)
def test_non_map_frame(obj):
    fails(msgpack.packb(obj, use_bin_type=True), ErrorCode.BAD_REQUEST, "map")


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x81", b"\x82\xa2op\xa4ping", b"\xdf\xff\xff\xff\xff",
    b"\xff\xff\xff", b"\x91" * 100_000 + b"\xc0",                 # nesting deeper than the decoder's stack
    P.encode(VALID["ping"]) + b"\x00",                             # trailing bytes
    P.encode(VALID["ping"])[:-1],                                  # truncated
    b"\x81\xa2op\xa3\xff\xfe\xfd",                                 # invalid UTF-8 string
    msgpack.packb({"op": "ping", "x": msgpack.ExtType(1, b"zz")}),  # ext types are refused
    msgpack.packb({1: "ping"}),                                    # non-string map key
], ids=lambda f: repr(f[:12]))
def test_garbage_bytes(frame):
    fails(frame, ErrorCode.BAD_REQUEST)


def test_array_header_claiming_too_many_items_is_limit():
    fails(b"\xdd\xff\xff\xff\xff", ErrorCode.LIMIT)
    fails(msgpack.packb({"op": "lookup", "keys": [None] * (P.MAX_KEYS_PER_REQUEST + 1)}), ErrorCode.LIMIT)


def test_too_many_map_entries():
    msg = dict(VALID["ping"], **{f"f{i}": i for i in range(40)})
    fails(msg, ErrorCode.BAD_REQUEST)


def test_frame_over_max_bytes_is_refused_undecoded():
    frame = P.encode(req("ping", pad=b"x" * P.MAX_FRAME_BYTES))
    assert len(frame) > P.MAX_FRAME_BYTES
    fails(frame, ErrorCode.LIMIT, str(len(frame)))
    fails(b"\x00" * (P.MAX_FRAME_BYTES + 1), ErrorCode.LIMIT)
    # Just under the limit, the same padding decodes.
    ok = P.encode(req("ping", pad=b"x" * (P.MAX_FRAME_BYTES - 64)))
    assert len(ok) <= P.MAX_FRAME_BYTES
    assert P.decode_request(ok)["op"] == "ping"


# --- admin socket ---------------------------------------------------------------------------------
ADMIN_VALID = [{"op": "stats", "rid": 1}, {"op": "ping", "rid": 2}, {"op": "clients", "rid": 3},
               {"op": "evict", "rid": 4, "count": 10}, {"op": "evict", "rid": 5, "count": 1, "namespace": "m:bf16"},
               {"op": "evict", "rid": 6, "count": 1 << 40, "namespace": None}, {"op": "clear", "rid": 7},
               {"op": "clear", "rid": 8, "namespace": "m:bf16:16t:1024B:replicated"}]


@pytest.mark.parametrize("msg", ADMIN_VALID, ids=lambda m: f"{m['op']}-{m['rid']}")
def test_admin_round_trip(msg):
    assert P.decode_request(P.encode(msg), P.ADMIN_REQUESTS) == msg


@pytest.mark.parametrize("msg", [{"op": "evict"}, {"op": "evict", "count": 0}, {"op": "evict", "count": True},
                                 {"op": "evict", "count": (1 << 40) + 1}, {"op": "evict", "count": 1, "namespace": ""},
                                 {"op": "evict", "count": 1, "namespace": 5}, {"op": "clear", "namespace": b"ns"}],
                         ids=repr)
def test_admin_validation(msg):
    with pytest.raises(RequestError) as info:
        P.decode_request(P.encode(msg), P.ADMIN_REQUESTS)
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_admin_ops_are_forbidden_on_the_client_socket():
    for op in sorted(set(P.ADMIN_REQUESTS) - set(P.REQUESTS)):
        fails({"op": op, "rid": 1, "count": 1}, ErrorCode.FORBIDDEN, "admin")
    for op in sorted(set(P.REQUESTS) - set(P.ADMIN_REQUESTS)):
        with pytest.raises(RequestError) as info:
            P.decode_request(P.encode(VALID[op]), P.ADMIN_REQUESTS)
        assert info.value.code == ErrorCode.BAD_REQUEST


# --- request_id ---------------------------------------------------------------------------------
def test_request_id_of_valid_and_invalid_requests():
    assert P.request_id(P.encode(VALID["store"])) == 5
    assert P.request_id(P.encode({"op": "nope", "rid": 42})) == 42
    assert P.request_id(P.encode(req("store", rid=43, job="x"))) == 43
    assert P.request_id(P.encode({"keys": KEYS, "rid": 44})) == 44
    assert P.request_id(P.encode({"op": "ping", "rid": (1 << 63) - 1})) == (1 << 63) - 1


def test_request_id_of_requests_refused_for_size():
    # The error reply of a request refused by a limit must reach its sender under its own rid.
    many = [i.to_bytes(4, "little") for i in range(P.MAX_KEYS_PER_REQUEST + 1)]
    assert P.request_id(P.encode(req("store", rid=50, keys=many))) == 50
    assert P.request_id(P.encode(req("store", rid=51, keys=[b"k" * 1000]))) == 51
    dup = [i.to_bytes(4, "little") for i in range(100)] * 2
    assert P.request_id(P.encode(req("load", rid=52, keys=dup))) == 52
    big = P.encode(req("ping", rid=53, pad=b"x" * P.MAX_FRAME_BYTES))
    assert len(big) > P.MAX_FRAME_BYTES
    assert P.request_id(big) == 53


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb(7), msgpack.packb({"rid": -3}), msgpack.packb({"rid": True}),
    msgpack.packb({"rid": "12"}), msgpack.packb({"rid": 1.0}), msgpack.packb({"op": "ping"}),
    msgpack.packb({"rid": 1 << 63}), b"\x91" * 10000,
], ids=lambda f: repr(f[:12]))
def test_request_id_falls_back_to_zero(frame):
    assert P.request_id(frame) == 0


# --- property: decode_request never raises anything but RequestError ----------------------------
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_total(frame: bytes, ops=P.REQUESTS):
    try:
        out = P.decode_request(frame, ops) if ops is not P.REQUESTS else P.decode_request(frame)
    except RequestError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert exc.code in (ErrorCode.BAD_REQUEST, ErrorCode.LIMIT, ErrorCode.FORBIDDEN)
        assert isinstance(exc.message, str) and exc.message
        return None
    assert isinstance(out, dict)
    assert out["op"] in ops
    return out


def _rid_total(frame: bytes) -> None:
    rid = P.request_id(frame)
    assert type(rid) is int and 0 <= rid < (1 << 63)


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes(frame):
    _decode_total(frame)
    _rid_total(frame)


scalars = (st.none() | st.booleans()
           | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)   # every msgpack int, huge ones too
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=40) | st.binary(max_size=80)
           | st.sampled_from(sorted(set(P.REQUESTS) | set(P.ADMIN_REQUESTS))) | st.sampled_from([P.MAX_JOB_ID, P.MAX_JOB_ID + 1, -1, 0]))
structures = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8),
                                                                      children, max_size=6),
    max_leaves=30)


@FUZZ
@given(structures)
def test_fuzz_arbitrary_msgpack_structures(obj):
    frame = msgpack.packb(obj, use_bin_type=True)
    _decode_total(frame)
    _decode_total(frame, P.ADMIN_REQUESTS)
    _rid_total(frame)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["op", "rid", "job", "keys", "ok", "jobs", "rank", "world_size", "namespace",
                                        "engine", "version", "pid", "count", "epoch", "cursor", "snapshot_from",
                                        "max_keys"]),
                       scalars | st.lists(scalars, max_size=4),
                       max_size=6),
       st.sampled_from(sorted(set(P.REQUESTS) | set(P.ADMIN_REQUESTS))))
def test_fuzz_maps_with_known_field_names(fields, op):
    fields.setdefault("op", op)
    _decode_total(msgpack.packb(fields, use_bin_type=True))
    _decode_total(msgpack.packb(fields, use_bin_type=True), P.ADMIN_REQUESTS)


FIELD_NAMES = sorted({(op, name) for op, spec in P.REQUESTS.items() for name in list(spec) + ["op", "rid"]}
                     | {("hello", f"namespace.{name}") for name in P.NAMESPACE_FIELDS})
msgpack_ints = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
wild = structures | st.lists(st.binary(max_size=70), max_size=20) | st.lists(msgpack_ints, max_size=20)


@FUZZ
@given(st.sampled_from(FIELD_NAMES), wild, st.booleans())
def test_fuzz_mutated_valid_requests(op_field, value, delete):
    op, name = op_field
    msg = copy.deepcopy(VALID[op])
    target, key = (msg["namespace"], name.split(".", 1)[1]) if name.startswith("namespace.") else (msg, name)
    if delete:
        target.pop(key, None)
    else:
        target[key] = value
    frame = msgpack.packb(msg, use_bin_type=True)
    out = _decode_total(frame)
    if out is not None:
        assert msgpack.packb(out, use_bin_type=True) == frame   # validated, not altered
    _rid_total(frame)


@FUZZ
@given(st.sampled_from(sorted(VALID)), st.data())
def test_fuzz_corrupted_valid_frames(op, data):
    frame = bytearray(P.encode(VALID[op]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _decode_total(bytes(frame[:cut]))
    _rid_total(bytes(frame[:cut]))

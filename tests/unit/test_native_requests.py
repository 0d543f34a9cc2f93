"""kvtierd._native.Requests (the server's decoder of hot requests) only ever answers what the
protocol's decoder answers, or None (leaving the frame to it): on every valid request of its ops
it answers, and equals ``P.decode_request``; on random, damaged and hostile frames it says None or
the same map."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtierd.contract import protocol as P
from kvtierd.contract.protocol import MAX_KEY_BYTES, RequestError
from kvtierd.server import _decode_hot, _hot_requests, _keys_ok

HOT = {op: fields for op, fields in P.REQUESTS.items()
       if all(f.kind in ("int", "bool", "keys", "ints") for f in fields.values())}
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def protocol(frame: bytes):
    """The protocol decoder's answer: the map, or the RequestError."""
    try:
        return P.decode_request(frame, keys_ok=_keys_ok)
    except RequestError as exc:
        return exc


def same_or_none(frame: bytes) -> None:
    fast = _decode_hot(frame)
    if fast is not None:
        assert fast == protocol(frame)
        assert {type(v) for v in fast.values()} <= {str, int, bool, list, type(None)}


def value_of(field: P.Field) -> st.SearchStrategy:
    if field.kind == "int":
        values = st.integers(field.lo, field.hi)
    elif field.kind == "bool":
        values = st.booleans()
    elif field.kind == "keys":
        values = st.lists(st.binary(min_size=1, max_size=MAX_KEY_BYTES), max_size=40, unique=True)
    else:
        values = st.lists(st.integers(field.lo, field.hi), max_size=min(field.max_items, 20))
    return st.one_of(values, st.none()) if field.nullable else values


@st.composite
def requests(draw) -> dict:
    op = draw(st.sampled_from(sorted(HOT)))
    msg = {"op": op}
    if draw(st.booleans()):
        msg["rid"] = draw(st.integers(0, P.MAX_REQUEST_ID))
    for name, field in HOT[op].items():
        if field.required or draw(st.booleans()):
            msg[name] = draw(value_of(field))
    return msg


def test_every_op_but_hello_is_hot():
    """hello (strings, a map) stays with the protocol's decoder; every other op is decoded here."""
    assert set(P.REQUESTS) - set(HOT) == {"hello"}


@FUZZ
@given(requests())
def test_a_valid_request_decodes_to_the_protocols_map(msg):
    frame = P.encode(msg)
    assert protocol(frame) == msg
    assert _decode_hot(frame) == msg


@pytest.mark.parametrize("width,fmt", [(0xd0, ">b"), (0xd1, ">h"), (0xd2, ">i"), (0xd3, ">q"),
                                       (0xcc, ">B"), (0xcd, ">H"), (0xce, ">I"), (0xcf, ">Q")])
def test_every_msgpack_int_form_of_a_non_negative_value_reads_as_the_value(width, fmt):
    """Another encoder may write a small int in a wider or signed form; msgpack reads its value."""
    frame = (b"\x83\xa2op\xa7release\xa3rid" + bytes([width]) + struct.pack(fmt, 7)
             + b"\xa3job" + bytes([width]) + struct.pack(fmt, 9))
    assert _decode_hot(frame) == protocol(frame) == {"op": "release", "rid": 7, "job": 9}


@pytest.mark.parametrize("msg", [
    {"op": "lookup", "keys": [b"a", b"a"]},                          # duplicate keys
    {"op": "lookup", "keys": [b"x" * (MAX_KEY_BYTES + 1)]},          # a key too long
    {"op": "lookup", "keys": [b""]},                                 # an empty key
    {"op": "lookup", "keys": ["text"]},                              # a str key
    {"op": "store", "job": -1, "keys": []},                          # out of range
    {"op": "release", "job": P.MAX_JOB_ID + 1},
    {"op": "lookup", "keys": [b"a"], "ttl_ms": 1 << 41},
    {"op": "release", "job": 1, "rid": P.MAX_REQUEST_ID + 1},
    {"op": "commit", "job": 1, "ok": True, "checksums": [0] * (P.MAX_KEYS_PER_REQUEST + 1)},
    {"op": "store", "job": 1, "keys": [], "chain": 1},               # an int for a bool
    {"op": "commit", "job": 1},                                      # a required field missing
    {"op": "release", "job": True},                                  # a bool for an int
    {"op": "release", "job": 1, "rid": -5},                          # a negative rid
    {"op": "release", "job": None},                                  # null where not nullable
    {"op": "hello"},                                                 # not a hot op
    {"op": "evict", "count": 1},                                     # an admin op
    {"op": "nothing"},
])
def test_a_request_the_protocol_refuses_goes_to_it(msg):
    frame = P.encode(msg)
    assert _decode_hot(frame) is None
    assert isinstance(protocol(frame), RequestError)


@pytest.mark.parametrize("msg", [{"op": "commit", "job": 1, "ok": True, "extra": 1},   # an unknown field
                                 {"job": 1, "op": "release"}])                        # a field before the op
def test_an_unusual_request_the_protocol_accepts_goes_to_it(msg):
    frame = P.encode(msg)
    assert _decode_hot(frame) is None
    assert protocol(frame) == msg


def test_trailing_bytes_a_repeated_field_and_an_oversize_frame_go_to_the_protocol():
    frame = P.encode({"op": "release", "job": 1})
    assert _decode_hot(frame + b"\x00") is None
    assert _decode_hot(b"\x83\xa2op\xa7release\xa3job\x01\xa3job\x02") is None
    big = P.encode({"op": "lookup", "keys": [i.to_bytes(8, "big") for i in range(P.MAX_KEYS_PER_REQUEST + 1)]})
    assert _decode_hot(big) is None and isinstance(protocol(big), RequestError)
    assert _decode_hot(b"\x81\xa2op\xa7release" + b"\x00" * P.MAX_FRAME_BYTES) is None


@FUZZ
@given(requests(), st.data())
def test_a_damaged_request_is_refused_or_read_as_the_protocol_reads_it(msg, data):
    frame = bytearray(P.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    same_or_none(bytes(frame))
    same_or_none(bytes(frame[:cut]))


ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                             st.binary(max_size=70), st.text(max_size=8)),
                   lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                   max_leaves=20)


@FUZZ
@given(st.dictionaries(st.sampled_from(["op", "rid", "job", "keys", "ok", "lease", "ttl_ms", "chain", "cold_tail",
                                        "checksums", "jobs", "leases", "epoch", "cursor", "x"]),
                       ANY, max_size=6),
       st.sampled_from(sorted(HOT)))
def test_any_map_is_refused_or_read_as_the_protocol_reads_it(fields, op):
    same_or_none(msgpack.packb(fields, use_bin_type=True))
    same_or_none(msgpack.packb({"op": op, **fields}, use_bin_type=True))


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_are_refused_or_read_as_the_protocol_reads_them(frame):
    same_or_none(frame)


def test_the_decoder_is_set_once_and_refuses_fields_it_cannot_read():
    decoder = _hot_requests()
    with pytest.raises(RuntimeError):
        decoder.__init__({}, 1, 1, 1, 1, 1)
    from kvtierd._native import Requests
    with pytest.raises(ValueError):
        Requests({"hello": P.REQUESTS["hello"]}, 1, 1, 1, 1, 1)

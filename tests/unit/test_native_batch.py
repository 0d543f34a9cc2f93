"""kvtierd._native's whole-request passes: ``keys_ok`` (the daemon's faster proof that a keys field
is valid) says True exactly when the protocol's own check accepts, and decoding with it gives the
same message or the same error; ``hold`` counts holds as the index's NumPy passes did, and ``any_held`` says what they said."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd._native import any_held, hold, keys_ok
from kvtierd.contract import protocol as P
from kvtierd.contract.protocol import MAX_KEYS_PER_REQUEST, MAX_KEY_BYTES, RequestError


def fast(value) -> bool:
    return keys_ok(value, MAX_KEY_BYTES, MAX_KEYS_PER_REQUEST)


def accepted(value) -> bool:
    try:
        P._check_keys("keys", value)
    except RequestError:
        return False
    return True


class Bytes(bytes):
    """A bytes subclass: msgpack never decodes one, and the protocol refuses it."""


ITEMS = st.one_of(st.binary(min_size=0, max_size=MAX_KEY_BYTES + 2), st.sampled_from([b"a", b"b", b"a" * 64]),
                  st.text(max_size=3), st.integers(-2**63, 2**64 - 1), st.none(),
                  st.builds(Bytes, st.binary(min_size=1, max_size=4)))


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(ITEMS, max_size=12), st.lists(st.binary(min_size=1, max_size=3), max_size=40),
                 st.tuples(st.binary(min_size=1, max_size=3)), st.text(max_size=4)))
def test_keys_ok_says_true_exactly_when_the_protocol_accepts(value):
    """(A bytes subclass, which no decoded frame holds, is left to the protocol's check.)"""
    if fast(value):
        assert accepted(value)
    elif accepted(value):
        assert any(type(k) is Bytes for k in value)


def test_keys_ok_on_big_lists():
    keys = [i.to_bytes(36, "little") for i in range(MAX_KEYS_PER_REQUEST)]
    assert fast(keys) and accepted(keys)
    assert not fast(keys + [b"x"])                                   # one too many
    assert not fast(keys[:-1] + [keys[0]])                          # a duplicate, far apart
    colliding = [bytes([i]) * 8 for i in range(200)] * 1            # distinct, hashes spread
    assert fast(colliding)


@settings(max_examples=200, deadline=None)
@given(st.lists(ITEMS, max_size=10), st.sampled_from(["lookup", "store", "load"]))
def test_decoding_with_keys_ok_is_decoding_without(keys, op):
    frame = P.encode({"op": op, "rid": 7, "keys": keys, **({"job": 1} if op != "lookup" else {})}) \
        if all(not isinstance(k, Bytes) for k in keys) else None
    if frame is None:
        return
    outcomes = []
    for check in (None, fast):
        try:
            outcomes.append(("ok", P.decode_request(frame, keys_ok=check)))
        except RequestError as exc:
            outcomes.append(("error", exc.code, exc.message))
    assert outcomes[0] == outcomes[1]


def test_hold_counts_holds_and_names_the_slots_that_change_hands():
    mine, other = np.zeros(8, np.uint32), np.zeros(8, np.uint32)
    other[2] = 1
    changed, moved = hold(mine, other, np.array([1, 2, 3], np.int32), 1)
    assert (changed, np.frombuffer(moved, np.int32).tolist()) == (3, [1, 3])      # 2: the other kind holds it
    changed, moved = hold(mine, other, np.array([1, 4], np.int32), 1)
    assert (changed, np.frombuffer(moved, np.int32).tolist(), mine.tolist()) == (1, [4], [0, 2, 1, 1, 1, 0, 0, 0])
    changed, moved = hold(mine, other, np.array([1, 2, 3], np.int32), -1)
    assert (changed, np.frombuffer(moved, np.int32).tolist()) == (2, [3])         # 1 still held once; 2 by other
    with pytest.raises(ValueError, match="nothing to let go"):
        hold(mine, other, np.array([5], np.int32), -1)
    assert mine.tolist() == [0, 1, 0, 0, 1, 0, 0, 0]                                # (refused: nothing changed)
    with pytest.raises(ValueError, match="out of range"):
        hold(mine, other, np.array([8], np.int32), 1)


@settings(max_examples=100, deadline=None)
@given(pins=st.lists(st.integers(0, 2), min_size=1, max_size=12), data=st.data())
def test_any_held_says_whether_numpy_finds_a_hold(pins, data):
    n = len(pins)
    leases = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    slots = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=n)), np.int32)
    p, l = np.array(pins, np.uint32), np.array(leases, np.uint32)
    assert any_held(p, l, slots) == bool(((p[slots] != 0) | (l[slots] != 0)).any())
    with pytest.raises(ValueError, match="out of range"):
        any_held(p, l, np.array([n], np.int32))

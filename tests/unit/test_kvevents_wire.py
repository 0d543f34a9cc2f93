"""kvtierd.kvevents_wire: a KVEventBatch written from key blobs by the compiled encoder is, byte for
byte, msgpack's packing of the same events as maps, one event at a time (what vLLM's msgspec
structs encode to: tests/vllm/test_kvevents.py checks that part against vLLM itself), whatever the
keys: any hash length, hashes small enough for msgpack's short int forms, any group index."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd import kvevents_wire as wire
from kvtierd.contract.protocol import MAX_KEY_BYTES

_pack = msgpack.Packer(use_bin_type=True).pack


def event_hash(key: bytes, form: wire.HashForm):
    block_hash = key[:-4]
    return int.from_bytes(block_hash[-8:], "big") if form is wire.HashForm.INT else block_hash


def packed_events(kind: str, keys: list[bytes], form: wire.HashForm) -> list[bytes]:
    """The obvious encoder: msgpack packs each event's map (BlockStored under msgspec's map16
    header), one event per KV-cache group of the keys, in the order the groups first come."""
    if kind == "cleared":
        return [_pack({"type": "AllBlocksCleared"})]
    by_group: dict[int, list] = {}
    for key in keys:
        by_group.setdefault(int.from_bytes(key[-4:], "big"), []).append(event_hash(key, form))
    if kind == "stored":
        return [b"\xde\x00\x09" + _pack({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                                         "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
                                         "lora_name": None, "group_idx": g})[1:]
                for g, hashes in by_group.items()]
    return [_pack({"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU", "group_idx": g})
            for g, hashes in by_group.items()]


def packed_batch(ts: float, events: list[bytes]) -> bytes:
    n = len(events)
    header = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")
    return b"\x93" + _pack(ts) + header + b"".join(events) + _pack(0)


# A hash's last 8 bytes: random, or a value at one of msgpack's int form boundaries.
EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
GROUPS = st.one_of(st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]), st.integers(0, 2**32 - 1))


@st.composite
def key_runs(draw):
    key_len = draw(st.sampled_from([5, 8, 11, 12, 13, 20, 36, MAX_KEY_BYTES]))
    hash_len = key_len - 4
    groups = draw(st.lists(GROUPS, min_size=1, max_size=3))
    keys = []
    for _ in range(draw(st.integers(1, 40))):
        block_hash = draw(st.binary(min_size=hash_len, max_size=hash_len))
        if hash_len >= 8 and draw(st.booleans()):
            block_hash = block_hash[:-8] + draw(st.sampled_from(EDGES)).to_bytes(8, "big")
        keys.append(block_hash + draw(st.sampled_from(groups)).to_bytes(4, "big"))
    return keys


@settings(max_examples=300, deadline=None)
@given(form=st.sampled_from(list(wire.HashForm)), ts=st.floats(0, 2e9),
       parts=st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]), key_runs()), max_size=5))
def test_a_batch_is_msgpacks_packing_of_its_events(form, ts, parts):
    batch, events = wire.Batch(form), []
    for kind, keys in parts:
        if kind == "cleared":
            batch.all_cleared()
        else:
            getattr(batch, kind)(len(keys[0]), b"".join(keys))
        events += packed_events(kind, keys, form)
    assert batch.encode(ts) == (packed_batch(ts, events), len(events))


def test_a_batch_of_many_events_and_many_groups():
    """Array headers past 16 and 65,536 events; a store and a removal whose every key has a group
    of its own (a namespace whose keys are not vLLM's)."""
    keys = [i.to_bytes(32, "big") + (i % 70_000).to_bytes(4, "big") for i in range(70_000)]
    batch = wire.Batch()
    batch.stored(36, b"".join(keys))
    batch.removed(36, b"".join(keys))
    events = packed_events("stored", keys, wire.HashForm.INT) + packed_events("removed", keys, wire.HashForm.INT)
    assert batch.encode(1.5) == (packed_batch(1.5, events), 70_000 * 2)


def test_keys_no_longer_than_their_group_make_no_event():
    batch = wire.Batch()
    batch.stored(4, b"abcd" * 3)
    batch.removed(4, b"abcd")
    batch.stored(36, b"")
    assert not batch and batch.encode(0.0) == (packed_batch(0.0, []), 0)


def test_a_part_that_is_not_whole_keys_is_refused():
    with pytest.raises(ValueError):
        wire.kv_events(b"", [(0, 36, b"x" * 37)], b"", True, wire._STORED_TEMPLATE, wire._REMOVED_TEMPLATE)
    with pytest.raises(ValueError):
        wire.kv_events(b"", [(1, 36, b"x" * 37)], b"", True, wire._STORED_TEMPLATE, wire._REMOVED_TEMPLATE)

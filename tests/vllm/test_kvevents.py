"""The daemon's KV events stream (kvtierd.kvevents_wire, kvtierd.kvevents_pub) read the way a
router reads vLLM's: real ZMQ sockets, vLLM 0.33's own msgspec types and decoder
(vllm.distributed.kv_events), vLLM's own mapping of a block hash into an event
(``maybe_convert_block_hash``) and of an OffloadKey into hash and group.

The log behind the stream is fed by the index model of tests/eventlog.py; whatever it does (stores,
evictions, clears, a namespace slot taken over, a publisher that falls behind, a restart), a
subscriber that fills its gaps through the replay socket holds, per topic, exactly the (hash,
group) of the namespace's READY keys.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import defaultdict

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,  # noqa: E402
                                        ZmqEventPublisher)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx, make_offload_key  # noqa: E402

from kvtierd import kvevents_wire as wire  # noqa: E402
from kvtierd.contract.events import Cause  # noqa: E402
from kvtierd.kvevents_pub import KvEventsPublisher  # noqa: E402
from tests.eventlog import Table  # noqa: E402

TOPICS = {0: "kv@node-a@tiny-llama", 1: "kv@node-a@tiny-mla"}


def offload_keys(n: int, seed: int, groups: int = 1, hash_bytes: int = 32) -> list[bytes]:
    """vLLM OffloadKeys (block hash ‖ group) of n blocks, each in every group."""
    hashes = [hashlib.sha256(f"{seed}/{i}".encode()).digest()[:hash_bytes] for i in range(n)]
    return [make_offload_key(h, g) for h in hashes for g in range(groups)]


def event_id(key: bytes) -> tuple:
    """How a vLLM engine names this OffloadKey's block in an event: (hash, group)."""
    return maybe_convert_block_hash(BlockHash(get_offload_block_hash(key))), get_offload_group_idx(key)


def expected_events(keys: list[bytes], removed: bool) -> list:
    """The events the daemon's stream publishes for these keys: what vLLM's OffloadingConnector
    says of its CPU tier, one event per KV-cache group (the connector sends a BlockStored per key,
    and a BlockRemoved per group)."""
    by_group: dict = {}
    for h, g in map(event_id, keys):
        by_group.setdefault(g, []).append(h)
    if not removed:
        return [BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                            medium="CPU", lora_name=None, group_idx=g) for g, hs in by_group.items()]
    return [BlockRemoved(block_hashes=hs, medium="CPU", group_idx=g) for g, hs in by_group.items()]


@pytest.mark.parametrize("form", [wire.HashForm.INT, wire.HashForm.BYTES])
@pytest.mark.parametrize("keys", [
    pytest.param(offload_keys(300, 1, groups=3), id="sha256-3-groups"),
    pytest.param(offload_keys(40, 2, hash_bytes=16), id="xxhash"),
    pytest.param(offload_keys(2, 3) + [make_offload_key(bytes(28) + b"\0\0\0\7", 0)], id="small-int-hash"),
    pytest.param(offload_keys(3, 4) + [make_offload_key(b"h" * 32, 200)], id="group-200"),
])
def test_the_batches_are_vllms_own_bytes_and_decode_with_its_decoder(form, keys, monkeypatch):
    """Stored, removed and cleared events of any keys are byte for byte what msgspec encodes for
    vLLM's structs (any hash length, short int forms, any group), and vLLM's decoder reads them."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if form is wire.HashForm.INT else "0")
    blob = b"".join(keys)
    batch = wire.Batch(form)
    batch.stored(len(keys[0]), blob)
    batch.removed(len(keys[0]), blob)
    batch.all_cleared()
    ours, count = batch.encode(12.5)
    events = expected_events(keys, False) + expected_events(keys, True) + [AllBlocksCleared()]
    theirs = KVEventBatch(ts=12.5, events=events, data_parallel_rank=0)
    assert ours == msgspec.msgpack.encode(theirs) and count == len(events)
    assert msgspec.msgpack.Decoder(type=KVEventBatch).decode(ours) == theirs


class Subscriber:
    """A router's subscriber, as vLLM's example subscriber works: a SUB socket on the stream and a
    DEALER on the replay socket; a gap in the sequence numbers (or a lower one: the publisher
    restarted) is filled by asking the replay socket; every batch is decoded with vLLM's decoder
    and applied to the topic's set of (hash, group). A subscriber of one topic asks its replays
    with the topic as prefix (the stream's extension), so that it gets only its topic's batches;
    the gaps the other topics leave in its sequence numbers cost it a replay request each.
    ``serve``: lets an in-process publisher answer the replay request (a daemon answers its own)."""

    def __init__(self, context: zmq.Context, endpoint: str, replay_endpoint: str, topic: str = "",
                 serve=lambda: None):
        self.serve = serve
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.topic = topic.encode()
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last = -1
        self.state: dict[str, set] = defaultdict(set)
        self.skip: set[int] = set()         # sequence numbers to drop once, as a lossy network would
        self.cleared = 0

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        state = self.state[topic.decode()]
        for event in self.decoder.decode(payload).events:
            if isinstance(event, AllBlocksCleared):
                state.clear()
                self.cleared += 1
            elif isinstance(event, BlockStored):
                assert event.medium == "CPU" and event.token_ids == [] and event.parent_block_hash is None
                state.update((h, event.group_idx) for h in event.block_hashes)
            else:
                state.difference_update((h, event.group_idx) for h in event.block_hashes)
        self.last = seq

    def _live(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq in self.skip:
            self.skip.discard(seq)
            return
        if seq <= self.last:                  # a new publisher (the daemon restarted): from its start
            self.last = -1
            self.replay(0)
        elif seq > self.last + 1:
            self.replay(self.last + 1)         # what it lacks before this batch (of its topic)
        if seq > self.last:
            self._apply(topic, seq, payload)

    def replay(self, start: int) -> None:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")] + ([self.topic] if self.topic else []))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.serve()
            if not self.dealer.poll(5):
                continue
            _, topic, seq_bytes, payload = self.dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return
            if seq > self.last:
                self._apply(topic, seq, payload)
        raise AssertionError("the replay socket did not answer")

    def sync(self) -> None:
        """Take what the stream has, then ask for anything after the last batch seen (a batch
        published before the subscription reached the publisher, a dropped one)."""
        while self.sub.poll(50):
            self._live(*self._recv())
        self.replay(self.last + 1)

    def _recv(self) -> tuple[bytes, int, bytes]:
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), payload


@pytest.fixture
def stream(tmp_path):
    """A table, its log and a publisher on ipc endpoints; subscribers made with ``subscribe``."""
    context = zmq.Context()
    made = []

    class Stream:
        table = Table(256, 1 << 20, scan_slots=64)

        def publisher(self, **kw) -> KvEventsPublisher:
            pub = KvEventsPublisher(context, self.table.log, lambda: dict(TOPICS), f"ipc://{tmp_path}/ev.pub",
                                    f"ipc://{tmp_path}/ev.replay", **kw)
            made.append(pub)
            return pub

        def subscribe(self, pub: KvEventsPublisher, topic: str = "") -> Subscriber:
            sub = Subscriber(context, pub.endpoint, pub.replay_endpoint, topic, serve=pub.serve_replay)
            made.append(sub)
            return sub

        def truth(self, ns: int) -> set:
            return set(map(event_id, self.table.ready(ns)))

    yield Stream()
    for thing in made:
        thing.close()
    context.term()


def test_a_subscriber_holds_exactly_the_ready_blocks_of_each_namespace(stream):
    pub = stream.publisher()
    everything = stream.subscribe(pub)
    only_mla = stream.subscribe(pub, TOPICS[1])
    a, b = offload_keys(50, 10, groups=2), offload_keys(30, 11)
    stream.table.store(0, a[:60])
    stream.table.store(1, b)
    pub.flush()
    stream.table.store(0, a[60:])
    stream.table.remove(0, a[:20])
    stream.table.remove(1, b[:5], Cause.CLEARED)
    pub.flush()
    stream.table.remove(0, list(stream.table.ready(0)), Cause.CLEARED)
    stream.table.store(0, a[:4])
    pub.flush()
    for sub in (everything, only_mla):
        sub.sync()
    assert everything.state[TOPICS[0]] == stream.truth(0) == set(map(event_id, a[:4]))
    assert everything.state[TOPICS[1]] == only_mla.state[TOPICS[1]] == stream.truth(1)
    assert TOPICS[0] not in only_mla.state


def test_a_late_subscriber_and_a_lost_batch_recover_through_the_replay_socket(stream):
    pub = stream.publisher()
    keys = offload_keys(120, 20)
    for i in range(0, 120, 10):
        stream.table.store(0, keys[i:i + 10])
        pub.flush()
    stream.table.remove(0, keys[:30])
    pub.flush()
    late = stream.subscribe(pub)
    late.sync()                                # everything from the buffer, batch 0 on
    assert late.state[TOPICS[0]] == stream.truth(0)
    late.skip = {pub.seq + 1, pub.seq + 2}     # the next two batches are lost on the way
    for i in range(3):
        stream.table.store(1, offload_keys(5, 30 + i))
        pub.flush()
    late.sync()
    assert late.state[TOPICS[1]] == stream.truth(1) and not late.skip


def test_a_subscriber_older_than_the_buffer_gets_the_contents_again_on_the_stream(stream):
    """The buffer holds the last 4 batches only: a replay from 0 gets those, and the stream then
    carries every namespace again (AllBlocksCleared and its READY keys)."""
    pub = stream.publisher(buffer_batches=4, resync_interval=0)
    keys = offload_keys(100, 40)
    for i in range(0, 100, 10):
        stream.table.store(0, keys[i:i + 10])
        pub.flush()
    stream.table.remove(0, keys[50:70])
    pub.flush()
    late = stream.subscribe(pub)
    late.replay(0)                             # gets batches 7..10: not the first stores
    assert late.state[TOPICS[0]] != stream.truth(0)
    pub.flush()                                # the resync the replay asked for
    late.sync()
    assert late.state[TOPICS[0]] == stream.truth(0) and late.cleared >= 1


def test_a_publisher_that_fell_behind_the_log_resyncs_its_subscribers(stream):
    stream.table.restart(log_budget=2000)      # room for a few records only
    pub = stream.publisher(flush_keys=8)
    sub = stream.subscribe(pub)
    keys = offload_keys(200, 50)
    pub.flush()
    for i in range(0, 200, 8):                 # no flush: the log drops what the publisher did not read
        stream.table.store(0, keys[i:i + 8])
    stream.table.remove(0, keys[:16])
    for _ in range(100):
        pub.flush()
    sub.sync()
    assert sub.state[TOPICS[0]] == stream.truth(0) and pub.counters["resyncs"] >= 1


def test_a_busy_namespace_does_not_starve_another(stream):
    """With a flush budget smaller than one namespace's backlog, the other namespace's blocks still
    go out within a few flushes (each flush starts one namespace further)."""
    pub = stream.publisher(flush_keys=4)
    sub = stream.subscribe(pub)
    pub.flush()
    keys = offload_keys(40, 55)
    for i in range(0, 40, 4):                    # ten records of 4 keys: ten flushes' worth
        stream.table.store(0, keys[i:i + 4])
    stream.table.store(1, offload_keys(2, 56))
    pub.flush()
    pub.flush()
    sub.sync()
    assert sub.state[TOPICS[1]] == stream.truth(1) and sub.state[TOPICS[0]] != stream.truth(0)


def test_a_daemon_restart_gives_all_cleared_then_the_recovered_contents(stream):
    """The old publisher's subscriber knew blocks that the restarted daemon does not hold (evicted
    while nobody published, or not recovered): the new stream, whose sequence numbers go on past
    the old one's, starts with AllBlocksCleared and what the region holds, and the subscriber
    replays it from its start when it sees the gap."""
    pub = stream.publisher()
    sub = stream.subscribe(pub)
    keys = offload_keys(64, 60)
    stream.table.store(0, keys)
    pub.flush()
    sub.sync()
    assert sub.state[TOPICS[0]] == stream.truth(0)
    pub.close()
    stream.table.remove(0, random.Random(1).sample(keys, 20))   # lost with the old daemon
    stream.table.restart(log_budget=1 << 20, scan_slots=64)
    old_seq = pub.seq
    pub = stream.publisher()
    sub.serve = pub.serve_replay
    pub.flush()                                  # its first batch: likely lost while the SUB reconnects
    stream.table.store(1, offload_keys(2, 61))
    deadline = time.monotonic() + 10
    while sub.state[TOPICS[0]] != stream.truth(0) and time.monotonic() < deadline:
        pub.flush()
        sub.sync()                               # the SUB reconnects to the new socket on its own
    assert sub.state[TOPICS[0]] == stream.truth(0) and sub.cleared >= 1 and pub.seq > old_seq


def test_a_namespace_whose_slot_is_taken_over_publishes_its_removals_first(stream):
    pub = stream.publisher()
    sub = stream.subscribe(pub)
    keys = offload_keys(10, 70)
    stream.table.store(1, keys)
    pub.flush()
    stream.table.remove(1, keys, Cause.RECLAIMED)
    stream.table.log.forget(1)                   # no flush in between: the publisher takes them first
    sub.sync()
    assert sub.state[TOPICS[1]] == set()


def test_vllms_own_publisher_and_ours_frame_the_same_way(tmp_path):
    """The same subscriber code reads vLLM's ZmqEventPublisher: the frames and the replay protocol
    this test's Subscriber speaks are vLLM's."""
    publisher = ZmqEventPublisher(0, f"ipc://{tmp_path}/v.pub", f"ipc://{tmp_path}/v.replay", topic="kv@x@m")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/v.replay")
    try:
        keys = offload_keys(3, 80)
        publisher.publish(KVEventBatch(ts=1.0, events=expected_events(keys, False)))
        time.sleep(0.3)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(5000)
        _, topic, seq, payload = dealer.recv_multipart()
        ours = wire.Batch()
        ours.stored(36, b"".join(keys))
        assert (topic, int.from_bytes(seq, "big"), payload) == (b"kv@x@m", 0, ours.encode(1.0)[0])
        assert dealer.poll(5000) and dealer.recv_multipart()[2] == ZmqEventPublisher.END_SEQ
    finally:
        dealer.close(linger=0)
        publisher.shutdown()
        context.term()



# --- the plugin's side: an engine's feed of its namespace, through vLLM's own event translation

def engine_events(feed, tracker) -> tuple[set, set]:
    """What vLLM's OffloadingConnector publishes for the feed's OffloadingEvents (vLLM's own
    OffloadingEventsTracker, self-describing events off: its default): (stored, removed) (hash, group)."""
    from vllm.v1.kv_offload.base import Medium, OffloadingEvent
    offloading = [OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed) for removed, keys in feed.take()]
    stored, removed = set(), set()
    for event in tracker.take_events(offloading):
        assert event.medium == "CPU"
        (stored if isinstance(event, BlockStored) else removed).update((h, event.group_idx) for h in event.block_hashes)
    return stored, removed


def test_every_engine_of_the_namespace_announces_what_any_of_them_stored(stream):
    """Engine A stores; engine B of the same namespace announces exactly those blocks (medium CPU)
    without having stored them; removals (eviction, clear) come from both; an engine of another
    namespace announces nothing; an engine hashing with xxhash in the same namespace ignores the
    sha256 keys. A feed that fell behind, or a restarted daemon, announces exactly the difference."""
    import msgpack
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    from kvtier.integrations.offload.events import EventFeed
    from kvtierd.contract.replies import EventsReply
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker

    table = stream.table
    table.restart(log_budget=4000, scan_slots=64)        # a small log: the idle feed falls behind
    config = OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=False)

    def engine(ns: int, key_bytes: int = 36, groups: int = 2):
        feed = EventFeed(key_bytes, groups)
        def read(**req) -> EventsReply:     # one events request, through msgpack as the wire sends it
            read = table.log.read(ns, max_keys=64, **req)
            return EventsReply.from_wire(msgpack.unpackb(msgpack.packb(read.to_wire())))
        return feed, read, OffloadingEventsTracker(config)

    a, b, other, xx = engine(0), engine(0), engine(1), engine(0, key_bytes=20)
    keys = offload_keys(40, 90, groups=2)
    table.store(0, keys[:50])
    table.store(1, offload_keys(5, 91))
    for feed, read, tracker in (a, b, other, xx):
        feed.poll(read)
    stored_b, _ = engine_events(b[0], b[2])
    assert stored_b == set(map(event_id, keys[:50])) == engine_events(a[0], a[2])[0]
    assert engine_events(xx[0], xx[2]) == (set(), set())
    assert engine_events(other[0], other[2])[0] == stream.truth(1)

    evicted = table.remove(0, keys[:10])
    cleared = table.remove(0, keys[10:20], Cause.CLEARED)
    for feed, read, tracker in (a, b, other):
        feed.poll(read)
    for feed, _, tracker in (a, b):
        assert engine_events(feed, tracker) == (set(), set(map(event_id, evicted + cleared)))
    assert engine_events(other[0], other[2]) == (set(), set())

    for i in range(50, 80, 2):                         # b polls, a does not: a falls behind the log
        table.store(0, keys[i:i + 2])
        b[0].poll(b[1])
    table.remove(0, keys[20:25])
    a[0].poll(a[1])
    assert engine_events(b[0], b[2]) == (set(map(event_id, keys[50:80])), set())
    assert a[0].view.resets == 2
    stored_a, removed_a = engine_events(a[0], a[2])
    assert stored_a == set(map(event_id, keys[50:80])) and removed_a == set(map(event_id, keys[20:25]))

    gone = table.ready(0)
    table.remove(0, random.Random(2).sample(sorted(gone), 7))   # lost with the daemon
    lost = gone - table.ready(0)
    table.restart(log_budget=1 << 20, scan_slots=64)
    b[0].poll(b[1])                                      # b last read before keys[20:25] went
    assert engine_events(b[0], b[2]) == (set(), set(map(event_id, keys[20:25] + sorted(lost))))
    assert b[0].view.keys == table.ready(0)


def test_the_loop_publishes_the_news_at_most_once_per_flush_interval(stream):
    """``pump`` (the daemon loop's call): the stores of one interval go out as one batch per
    namespace; with no news it asks for no wake-up; a replay request is served at once."""
    now = [50.0]
    pub = stream.publisher(flush_interval=0.002, monotonic=lambda: now[0])
    sub = stream.subscribe(pub)
    assert pub.pump(now[0]) == 1.0                        # at start: every namespace from AllBlocksCleared,
    batches, pub_events = pub.counters["batches"], pub.counters["events"]   # then nothing new: the loop may sleep
    assert batches == len(TOPICS) and pub.pump(now[0]) == 1.0
    keys = offload_keys(30, 12)
    for i in range(0, 30, 3):                             # ten stores within one interval
        stream.table.store(0, keys[i:i + 3])
        assert pub.pump(now[0]) == pytest.approx(0.002)   # too soon: the loop comes back then
    assert pub.counters["batches"] == batches
    now[0] += 0.002
    assert pub.pump(now[0]) == 1.0
    # one batch: a BlockStored per store (its three keys are of one KV-cache group)
    assert pub.counters["batches"] == batches + 1 and pub.counters["events"] == pub_events + 10
    sub.sync()
    assert sub.state[TOPICS[0]] == stream.truth(0)

"""The daemon's own KV events stream: the node's view of the shared tier, published on a ZMQ PUB
socket in vLLM's KVEventBatch format (kvtierd.kvevents_wire), with vLLM's replay socket, for
routers that index per node (docs/events.md). Off unless ``kv_events_endpoint`` is set.

**One stream, tagged.** One PUB socket carries every namespace; a batch's topic names its
namespace (``kv@<node>@<model>`` by default: llm-d's indexer reads the pod and the model from
that form), and one sequence number counts the batches of the whole stream. vLLM's replay
request names only a sequence number, so one sequence per socket pair is what lets vLLM's own
subscriber protocol (and its decoder) work unchanged; a subscriber that wants some namespaces
subscribes to their topics and reads the sequence numbers of the others as gaps it may ignore.

**Frames**, as vLLM's ZmqEventPublisher sends them (vllm/distributed/kv_events.py): PUB
``[topic, seq (8 bytes, big-endian), payload]``; the ROUTER answers a request ``[b"", start seq
(8 bytes)]`` with ``[b"", topic, seq, payload]`` for every buffered batch from that seq on, then
``[b"", b"", -1 (8 bytes), b""]``. A kvtier extension: a request may add a frame, a topic prefix,
and then gets only the batches of the topics it starts (a subscriber of some topics asks for
what it lacks of those, not for the whole stream; the answer's sequence numbers keep their gaps).

**What it sends, and when.** The publisher is a reader of the event log (kvtierd.eventlog) like
any coordinator session, without the wire: ``flush`` (through ``pump``, below) reads each
namespace whose log moved since its last read from its cursor and publishes one batch per
namespace with what came: ``BlockStored`` for keys that became READY, ``BlockRemoved`` for keys
that left. A
namespace it reads for the first time, or whose log dropped records it had not read yet, starts
with ``AllBlocksCleared`` followed by its READY keys (snapshot pages, interleaved with the
changes in stream order): so a daemon start, a restart, and a publisher that fell behind all
give subscribers a stream that converges on the exact contents. A replay request older than the
buffer cannot be answered from it: it is answered with what the buffer has, and every namespace
is then resynced on the live stream (at most once per ``resync_interval``), which is how a
subscriber that connects late or lost more than the buffer recovers.

No call blocks: PUB drops what a slow subscriber cannot take (ZMQ's high-water mark; the
subscriber sees the gap in the sequence numbers), replays are sent ``replay_batches`` messages per
call, and a replay that meets the ROUTER's high-water mark is cut short (its subscriber asks
again).

**In the daemon's loop** (``pump``, once per loop iteration, like the second tier's): replay
requests are served at once; the log's news is published at most once per ``flush_interval``
(``kv_events_flush_ms``), so that the stores of a busy loop go out as one batch per namespace
and interval instead of one per store (what a batch costs besides its keys is most of a small
store's cost). ``NoStream`` stands in when ``kv_events_endpoint`` is empty.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

import zmq
from zmq.backend import zmq_poll

from . import kvevents_wire as wire
from .eventlog import EventLog

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
IDLE_S = 1.0                  # how long the loop may sleep, as far as the stream goes, with no news
_MORE = int(zmq.SNDMORE)


def topic_of(template: str, node: str, name: str, model: str) -> str:
    """A namespace's topic (setting ``kv_events_topic``): {node}, {namespace} (``name``) and
    {model} (the model name up to its first "@": llm-d splits a topic on "@" into three parts)."""
    return template.format(node=node, namespace=name, model=model.split("@", 1)[0])


class NoStream:
    """No KV events stream (``kv_events_endpoint`` empty): nothing to pump, no sockets."""

    def pump(self, now: float) -> float:
        return IDLE_S

    def sockets(self) -> Iterable[zmq.Socket]:
        return ()

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@dataclass
class _Cursor:
    epoch: int | None = None
    seq: int | None = None
    snapshot_from: int | None = None
    topic: bytes = b""
    topic_str: str | bytes | None = None   # the topic as ``namespaces`` gave it (``topic`` is its bytes)
    settled_at: tuple | None = None        # the log's (epoch, seq) it read to the end at, nothing pending


@dataclass
class _Replay:
    identity: bytes
    start: int
    prefix: bytes = b""           # only batches of topics starting with it (the extension frame)
    sent_through: int = -1        # the last seq sent to it


class KvEventsPublisher:
    """The stream (see the module docstring): ``flush`` and ``serve_replay`` from the server loop."""

    def __init__(self, context: zmq.Context, events: EventLog, namespaces: Callable[[], dict[Hashable, str]],
                 endpoint: str, replay_endpoint: str | None = None, hash_form: wire.HashForm = wire.HashForm.INT,
                 buffer_batches: int = 10_000, buffer_bytes: int = 64 << 20, hwm: int = 100_000,
                 flush_keys: int = 65_536, replay_batches: int = 256, resync_interval: float = 10.0,
                 flush_interval: float = 0.005, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.events = events
        self.namespaces = namespaces              # ns -> its topic, for every namespace the index holds
        self.hash_form = wire.HashForm(hash_form)
        self.buffer_batches, self.buffer_bytes = buffer_batches, buffer_bytes
        self.flush_keys, self.replay_batches, self.resync_interval = flush_keys, replay_batches, resync_interval
        self._clock, self._monotonic = clock, monotonic
        self._cursors: dict[Hashable, _Cursor] = {}
        self._turn = 0
        self._buffer: deque[tuple[int, bytes, bytes]] = deque()   # (seq, topic, payload) as sent, oldest first
        self._buffered_bytes = 0      # of the payloads
        self._replays: deque[_Replay] = deque()
        self._last_resync = float("-inf")
        self.flush_interval = flush_interval
        self._last_flush = float("-inf")
        self._mark = -1               # the log's appends at the last flush (EventLog.news): news when it moved
        self._unsettled = True        # a snapshot, a resync or a cut flush is in progress (and at start)
        # The last batch's sequence number. The stream starts at the wall clock in microseconds, not at
        # 0 as a vLLM engine's does: a subscriber of the previous daemon sees the restart as a gap
        # (never as numbers it has seen already) and asks the replay socket, which answers from the
        # new stream's start (AllBlocksCleared first).
        self.seq = int(clock() * 1e6) - 1
        self._first_seq = self.seq + 1
        self.counters = {"batches": 0, "events": 0, "bytes": 0, "resyncs": 0, "replays": 0, "replay_batches": 0,
                         "replays_cut": 0, "bad_replay_requests": 0}
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = None
        try:
            self.pub.bind(endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self.replay = context.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 1))
                self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(replay_endpoint)
                self._replay_ready = [(self.replay, zmq.POLLIN)]
                self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self.close()
            raise
        events.forgetting = self._flush_namespace

    # ------------------------------------------------------------------ the loop's side
    def pump(self, now: float) -> float:
        """Serve the replay requests; publish the log's news if the last flush is
        ``flush_interval`` old. Returns the seconds until the stream needs the loop again."""
        self.serve_replay()
        if not self._unsettled and self.events.news == self._mark:
            return IDLE_S if not self._replays else 0.0
        wait = self._last_flush + self.flush_interval - now
        if wait > 0:
            return wait
        self._mark = self.events.news
        self._last_flush = now
        self.flush()
        return self.flush_interval if self._unsettled or self._replays else IDLE_S

    def sockets(self) -> Iterable[zmq.Socket]:
        """The sockets the loop polls for the stream: the replay ROUTER."""
        return () if self.replay is None else (self.replay,)

    # ------------------------------------------------------------------ publishing
    def flush(self) -> int:
        """Publish what the log holds past each namespace's cursor, up to ``flush_keys`` keys in
        all (the rest waits for the next call). Returns how many batches went out."""
        topics = self.namespaces()
        if self._cursors.keys() - topics.keys():
            for ns in self._cursors.keys() - topics.keys():
                del self._cursors[ns]               # gone from the index (its log was flushed when it ended)
        sent, budget = 0, self.flush_keys
        order = list(topics.items())
        if len(order) > 1:                          # each call starts one namespace further: none starves
            self._turn = (self._turn + 1) % len(order)
            order = order[self._turn:] + order[:self._turn]
        for ns, topic in order:
            if budget <= 0:
                break
            count, keys = self._publish_namespace(ns, topic, budget)
            sent += count
            budget -= keys
        self._unsettled = budget <= 0 or any(c.seq is None or c.snapshot_from is not None
                                             for c in self._cursors.values())
        return sent

    def _flush_namespace(self, ns: Hashable) -> None:
        """The log of ``ns`` is about to end: publish the rest of it under the topic it had."""
        cursor = self._cursors.get(ns)
        if cursor is not None and cursor.topic:
            while self._publish_namespace(ns, cursor.topic, self.flush_keys)[1]:
                pass

    def _publish_namespace(self, ns: Hashable, topic: str | bytes, budget: int) -> tuple[int, int]:
        """One read of the namespace's log, one batch of what it gave. Returns (batches, keys)."""
        cursor = self._cursors.get(ns)
        if cursor is None:
            cursor = self._cursors[ns] = _Cursor()
        if cursor.topic_str != topic:           # its topic as bytes, encoded once
            cursor.topic_str, cursor.topic = topic, topic if type(topic) is bytes else topic.encode()
        topic = cursor.topic
        if cursor.settled_at is not None and cursor.settled_at == self.events.head(ns):
            return 0, 0                             # nothing new in its log since the last read
        got = self.events.read(ns, cursor.epoch, cursor.seq, cursor.snapshot_from, budget)
        if got.reset and cursor.seq is not None:       # fell behind the log (resync() clears the cursor first)
            self.counters["resyncs"] += 1
            log.warning("KV events: the stream fell behind the event log of topic %s; resyncing it", topic.decode())
        cursor.epoch, cursor.seq, cursor.snapshot_from = got.epoch, got.seq, got.snapshot_next
        # Read to the end with no snapshot in progress: the next flush skips it while its log's
        # head stays (one comparison, not a read, for a namespace without news).
        cursor.settled_at = (got.epoch, got.seq) if not got.behind and got.snapshot_next is None else None
        batch = wire.Batch(self.hash_form)
        if got.reset:
            batch.all_cleared()
        records = got.records
        # A record's kind is the batch's part kind (Kind.STORED 0, REMOVED 1); its keys' count is
        # that of every record up to it (``upto``) less that before the first.
        batch.changes([(record.kind, record.key_len, record.keys) for record in records])
        keys = records[-1].upto - records[0].upto + records[0].count if records else 0
        for key_len, blob in got.snapshot:
            batch.stored(key_len, blob)
            keys += len(blob) // key_len
        if batch:
            self._send(topic, batch)
        return bool(batch), keys

    def _send(self, topic: bytes, batch: wire.Batch) -> None:
        """Publish the batch under the next sequence number and keep its payload for replays: ~9
        bytes a key, against the 36 of a vLLM key's blob (0.3.4 kept the batch's blobs and encoded
        them again for a replay; holding them kept 64 MiB of key blobs alive, each written by a
        store job and read by a flush, where the log's budget alone would have let them go)."""
        self.seq += 1
        ts = self._clock()
        payload, events = batch.encode(ts)
        # One frame at a time with an int flag: send_multipart's Python per frame and its flag
        # enums took 17 µs a batch against 6 (measured), most of what a small flush costs.
        self.pub.send(topic, _MORE)
        self.pub.send(self.seq.to_bytes(8, "big"), _MORE)
        self.pub.send(payload)
        self._buffer.append((self.seq, topic, payload))
        self._buffered_bytes += len(payload)
        while len(self._buffer) > self.buffer_batches or self._buffered_bytes > self.buffer_bytes:
            self._buffered_bytes -= len(self._buffer.popleft()[2])
        self.counters["batches"] += 1
        self.counters["events"] += events
        self.counters["bytes"] += len(payload)

    def resync(self) -> None:
        """Publish every namespace again from scratch: AllBlocksCleared, then its READY keys."""
        self._last_resync = self._monotonic()
        self._unsettled = True
        self.counters["resyncs"] += len(self._cursors)
        for cursor in self._cursors.values():
            cursor.seq = cursor.settled_at = None

    # ------------------------------------------------------------------ replay
    def serve_replay(self) -> None:
        """Take the replay requests waiting on the ROUTER and send up to ``replay_batches``
        buffered batches of the replays in progress. Never blocks."""
        if self.replay is None:
            return
        # zmq_poll itself: Socket.poll builds a Poller per call, 4.4 µs against 2.7 (measured),
        # and this runs at every turn of the daemon's loop.
        while zmq_poll(self._replay_ready, 0):
            frames = self.replay.recv_multipart()
            if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
                self.counters["bad_replay_requests"] += 1
                continue
            self._replays.append(_Replay(frames[0], int.from_bytes(frames[2], "big"), *frames[3:]))
            self.counters["replays"] += 1
        budget = self.replay_batches
        while self._replays and budget > 0:
            budget -= self._serve_one(self._replays[0], budget)

    def _serve_one(self, replay: _Replay, budget: int) -> int:
        """Send the next buffered batches of one replay; at its end the end marker. Returns how
        many messages went."""
        oldest = self._buffer[0][0] if self._buffer else None
        # Older than the buffer, which no longer starts with the stream's first batch: what it
        # lacks is gone from the buffer, so the live stream carries the contents again.
        if replay.sent_through < 0 and oldest is not None and replay.start < oldest != self._first_seq \
                and self._monotonic() - self._last_resync >= self.resync_interval:
            log.info("KV events: a subscriber asked for batches from %d, the buffer starts at %d: resyncing the "
                     "stream", replay.start, self._buffer[0][0])
            self.resync()
        sent = 0
        try:
            for seq, topic, payload in self._buffer:
                if seq < replay.start or seq <= replay.sent_through or not topic.startswith(replay.prefix):
                    continue
                if sent == budget:
                    return sent
                self.replay.send_multipart((replay.identity, b"", topic, seq.to_bytes(8, "big"), payload),
                                           flags=zmq.NOBLOCK)
                replay.sent_through = seq
                sent += 1
                self.counters["replay_batches"] += 1
            self.replay.send_multipart((replay.identity, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError:            # gone, or at its high-water mark: cut short, it asks again
            self.counters["replays_cut"] += 1
        self._replays.popleft()
        return sent + 1

    def stats(self) -> dict:
        """The stream's part of ``StatsReply.events`` (``stream``; kvtierd_kvevents_*)."""
        return {**self.counters, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "seq": self.seq,
                "buffered_batches": len(self._buffer), "buffered_bytes": self._buffered_bytes,
                "replays_pending": len(self._replays)}

    def close(self) -> None:
        if self.events.forgetting == self._flush_namespace:
            self.events.forgetting = None
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)

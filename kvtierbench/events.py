"""``events``: the event log (kvtierd.eventlog) and the daemon's KV events stream
(kvtierd.kvevents_pub) in isolation, with the daemon's job sizes, in this process and one
subscriber process.

- **cost**: per key, appending a store job's B keys to the log, and publishing them (one log read,
  vLLM's wire form, the PUB send), against the obvious encoder of the same events (msgpack packing
  the event's map, its hashes converted in Python): CPU ns per key, median of rounds.
- **latency**: from a job's append to the moment a subscriber process has the batch, with the
  publisher flushed right after every append (as the server loop will flush after each
  iteration): p50 and p99 of ``rounds`` jobs (one clock: CLOCK_MONOTONIC is the machine's).
- **sustained**: 200,000 blocks/s offered for some seconds (jobs of 256 keys, paced), through the
  log, the publisher and a subscriber process that decodes every batch; the blocks it received and this
  process's memory after the first second and at the end (the log, the replay buffer and ZMQ's
  queues are bounded: it must not grow).

The issue's goals are measured through real daemons (``kvtierbench.eventsd``): store throughput
with the stream on against off, commit to subscriber, 200,000 blocks/s with memory flat.
"""

from __future__ import annotations

import resource
import statistics
import time

import msgpack
import numpy as np
import zmq

from kvtierd.contract.region_format import ENTRY_DTYPE
from kvtierd.eventlog import EventLog, TableSnapshot
from kvtierd.kvevents_pub import KvEventsPublisher

from . import eventsd
from .harness import Context, pct, ratio, say, target

BATCHES = (256, 1024)
TOPIC = "kv@bench@model"
RATE = 200_000                      # blocks/s offered in the sustained run


def make_keys(seed: int, n: int) -> list[bytes]:
    """n vLLM OffloadKeys of KV-cache group 0: a random 32-byte block hash and the group index."""
    raw = np.zeros((n, 36), np.uint8)
    raw[:, :32] = np.random.default_rng(seed).integers(0, 256, size=(n, 32), dtype=np.uint8)
    return raw.view("V36").ravel().tolist()


def _counted(seq: int, now: float, payload: bytes) -> tuple:
    """(sequence number, receive time, blocks its BlockStored events name) of a batch, for the
    subscriber process (tests/vllm/test_kvevents.py decodes the stream with vLLM's decoder)."""
    _, events, _ = msgpack.unpackb(payload)
    return seq, now, sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")


class _Stream:
    """A log and a publisher over an empty entry table, and a subscriber process. The log and the
    replay buffer hold 8 MiB each: at 200,000 keys/s they are full within a second or two, so that
    a run of some seconds shows whether memory stays put once they are."""

    def __init__(self, ctx: Context, name: str):
        context = zmq.Context.instance()
        self.log = EventLog(TableSnapshot(np.zeros(1024, ENTRY_DTYPE)), 8 << 20)
        self.pub = KvEventsPublisher(context, self.log, lambda: {0: TOPIC}, f"ipc://{ctx.path(name)}.pub",
                                     buffer_bytes=8 << 20, flush_keys=1 << 20)
        self.proc, self.conn = eventsd.start_subscriber([self.pub.endpoint], _counted)
        deadline = time.monotonic() + 10      # until the subscription reached the publisher
        self.pub.flush()
        while not self.conn.poll(0.05):
            if time.monotonic() > deadline:
                raise RuntimeError("events bench: the subscriber process received nothing in 10 s")
            self.log.stored(0, [b"\x01" * 36])
            self.pub.flush()
        self.conn.recv()

    def close(self) -> list:
        """Stop; (sequence number, receive time, events) of every batch the subscriber took."""
        seen = eventsd.stop_subscriber(self.proc, self.conn)
        self.pub.close()
        return seen


def _cost(batch: int, rounds: int) -> dict:
    """CPU ns per key: log append, publish (read + encode + send), and the per-key msgpack floor."""
    log = EventLog(TableSnapshot(np.zeros(16, ENTRY_DTYPE)), 256 << 20)
    context = zmq.Context.instance()
    pub = KvEventsPublisher(context, log, lambda: {0: TOPIC}, f"inproc://kvtbench-events-cost-{batch}")
    jobs = [make_keys(seed, batch) for seed in range(rounds)]
    pub.flush()
    append, publish, naive = [], [], []
    try:
        for keys in jobs:
            t0 = time.thread_time_ns()
            log.stored(0, keys)
            log.settle()                  # the daemon's loop takes the queued append after the reply
            t1 = time.thread_time_ns()
            pub.flush()
            t2 = time.thread_time_ns()
            event = {"type": "BlockStored", "block_hashes": [int.from_bytes(k[24:32], "big") for k in keys],
                     "parent_block_hash": None, "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
                     "lora_name": None, "group_idx": 0}      # make_keys: one group
            msgpack.packb([time.time(), [event], 0])
            t3 = time.thread_time_ns()
            append.append((t1 - t0) / batch)
            publish.append((t2 - t1) / batch)
            naive.append((t3 - t2) / batch)
    finally:
        pub.close()
    row = {"keys": batch, "append_ns_per_key": statistics.median(append),
           "publish_ns_per_key": statistics.median(publish), "naive_encode_ns_per_key": statistics.median(naive)}
    row["publish_vs_naive"] = ratio(row["publish_ns_per_key"], row["naive_encode_ns_per_key"])
    return row


def _latency(ctx: Context, batch: int, rounds: int) -> dict:
    stream = _Stream(ctx, f"events-latency-{batch}")
    sent = {}
    try:
        for seed in range(rounds):
            keys = make_keys(10_000 + seed, batch)
            t0 = time.monotonic()
            stream.log.stored(0, keys)
            stream.pub.flush()
            sent[stream.pub.seq] = t0
            time.sleep(0.002)
    finally:
        seen = stream.close()
    lat = np.array([t - sent[seq] for seq, t, _ in seen if seq in sent])
    return {"keys": batch, "batches": len(lat), "p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def _sustained(ctx: Context, seconds: float) -> dict:
    """RATE blocks/s offered in jobs of 256 for ``seconds``; this process's RSS a third of the way
    in (the log and the buffer are full by then) and at the end."""
    stream = _Stream(ctx, "events-sustained")
    batch = 256
    start = time.monotonic()
    rss_third, sent, seed = None, 0, 0
    try:
        while (now := time.monotonic()) - start < seconds:
            if rss_third is None and now - start >= seconds / 3:
                rss_third = _rss_kib()
            stream.log.stored(0, make_keys(20_000_000 + seed, batch))
            stream.pub.flush()
            seed += 1
            sent += batch
            time.sleep(max(0.0, start + sent / RATE - time.monotonic()))
        elapsed = time.monotonic() - start
        rss_end = _rss_kib()
    finally:
        seen = stream.close()
    received = sum(n for _, _, n in seen)
    return {"offered_per_s": RATE, "published_per_s": sent / elapsed, "received_per_s": received / elapsed,
            "rss_third_kib": rss_third or rss_end, "rss_end_kib": rss_end, "log_bytes": stream.log.bytes}


def run(ctx: Context) -> dict:
    quick = ctx.plan.duration < 0.5
    rounds = 20 if quick else 200
    rows = [_cost(batch, rounds) for batch in BATCHES]
    for row in rows:
        say(f"events: B={row['keys']:<5} append {row['append_ns_per_key']:.0f} ns/key, publish "
            f"{row['publish_ns_per_key']:.0f} ns/key (x{row['publish_vs_naive']:.2f} msgpack's packing)")
    latency = [_latency(ctx, batch, rounds) for batch in BATCHES]
    for row in latency:
        say(f"events: B={row['keys']:<5} append -> subscriber p50 {row['p50_us']:.0f} us, p99 {row['p99_us']:.0f} us")
    sustained = _sustained(ctx, 3.0 if quick else 15.0)
    say(f"events: {sustained['published_per_s']:,.0f} blocks/s published, {sustained['received_per_s']:,.0f} "
        f"received; RSS {sustained['rss_third_kib']:,} KiB a third of the way in, {sustained['rss_end_kib']:,} KiB "
        "at the end")
    daemon = eventsd.run(ctx, quick)
    throughput, commit, kept = daemon["throughput"], daemon["latency"], daemon["sustained"]
    targets = [*(target(f"events: store keys/s publishing / not (B={row['keys']}, daemons alternating)",
                        row["on_vs_off"], 0.95, "higher") for row in throughput),
               target("events: commit -> subscriber p99 ms (B=256, the daemon's stream)", commit["p99_us"] / 1e3, 10,
                      "lower"),
               target("events: blocks/s the daemon kept of 200,000 offered, publishing", kept["stored_per_s"],
                      0.95 * eventsd.RATE, "higher"),
               target("events: the daemon's RssAnon growth over the last two thirds of that run (KiB)",
                      kept["rss_anon_end_kib"] - kept["rss_anon_third_kib"], 16 << 10, "lower")]
    notes = ["cost, latency and sustained rows: the log and the publisher in this process with a subscriber "
             "process (isolation); daemon rows: real daemons, a subscriber process on the stream"]
    ratios = {f"publish_vs_msgpack_B{row['keys']}": row["publish_vs_naive"] for row in rows}
    ratios.update({f"store_on_vs_off_B{row['keys']}": row["on_vs_off"] for row in throughput})
    return {"rows": rows, "more": {"latency": latency, "sustained": [sustained], "daemon throughput": throughput,
                                   "daemon latency": [commit], "daemon sustained": [kept]},
            "ratios": ratios, "targets": targets, "notes": notes}

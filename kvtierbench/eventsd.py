"""``events``' daemon part: issue 23's goals measured through real daemons (kvtierbench.events
holds the log and the stream in isolation).

- **throughput**: store jobs of B = 256 and 1,024 fresh keys (store + commit from one rank session,
  as ``control`` measures the control plane; the region full, so every store also evicts B) on
  daemons publishing their KV events streams to a subscriber process (which reads every batch off
  its sockets, as a router does, without decoding it), against the same on daemons without it:
  two of each (``PAIRS``), taking turns in slices of 1.5 s so that all see the same machine (four
  rounds, each daemon first in one, the order rotated a round): keys/s, the median slice on / the
  median slice off, in each of ``TRIALS`` sets of fresh daemons, and the median of the sets'
  ratios (goal >= 0.95x). Two daemons of one build and settings differ by
  1-2% (where their memory happens to lie), and the daemons of one run by up to 4% from those of
  another: with one set, the ratio said as much of which daemons were started as of the stream.
  Before the slices every daemon stores untimed for ``WARM_S``: the publishing daemons' event
  log and replay buffer (~35 MiB here) fill to their bounds in their first seconds, a one-time
  cost of the stream, not its steady one, that fell in the first slices and pulled their median
  down. Each slice also measures the daemon's CPU a job (all its threads, schedstat): what the
  stream costs a daemon whose loop has no idle time, which keys/s alone does not say. In this
  one-client ping-pong a daemon that works on after its reply (the stream's log and flushes,
  since 0.3.8 nearly all of its work) takes the next request without sleeping first; one that goes idle
  pays a wake-up each request (measured: a daemon without the stream, made to spin 30 µs after
  every reply, stored 1.08x the keys/s of one that did not), so on / off can exceed 1.
- **latency**: jobs of B = 256 paced every 5 ms; from the moment the commit returns (the commit
  made the keys READY) to the subscriber process holding the batch whose last BlockStored ends with
  the job's last key: p50 and p99 (goal p99 <= 10 ms; one clock, CLOCK_MONOTONIC).
- **sustained**: 200,000 blocks/s offered (jobs of 1,024, paced) to the publishing daemon with
  the subscriber reading, for some seconds: the rate kept, and the daemon's anonymous memory
  (RssAnon: the region is a shared mapping) a third of the way in and at the end (the event log,
  8 MiB here, and the replay buffer are bounded: it must not grow).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import msgpack
import numpy as np
import zmq

from .harness import CONTROL_PAGE, Context, KeyStream, RankChannel, bench_daemon, cpu_ns, pct, ratio, region_size, say

BATCHES = (256, 1024)
PAIRS = 2                          # daemons publishing, and as many not, in a trial
TRIALS = 3                         # sets of fresh daemons: the ratio is the median of theirs
RATE = 200_000
PAGES = 1 << 16                    # the region: 65,536 one-page blocks, filled before the slices
WARM_S = 2.5                       # untimed stores per daemon: the replay buffer's 500 batches, one per 5 ms


def _last_event(payload: bytes):
    """The last event of a KVEventBatch ``[ts, [events], dp rank]``, the others skipped undecoded
    (the subscriber shares the machine's two CPUs with the daemons: decoding every event would
    take them from the daemon being measured)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(payload)
    unpacker.read_array_header()
    unpacker.skip()
    n = unpacker.read_array_header()
    for _ in range(n - 1):
        unpacker.skip()
    return unpacker.unpack() if n else None


def subscriber(endpoints: list[str], conn, describe, describing: bool = True) -> None:
    """A subscriber process (the bench's router): takes batches; says "ready" once connected,
    "joined" at its first batch; keeps ``describe(seq, receive time, payload)`` of every batch
    while ``describing`` (from the start, or from a "describe" message on, which it acknowledges
    with "describing"); when told to "stop" (then until the stream is quiet), sends them."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    for endpoint in endpoints:
        sub.connect(endpoint)
    conn.send("ready")
    seen, joined, stopping = [], False, False
    while sub.poll(200 if stopping else 20) or not stopping:
        if sub.poll(0):
            _, seq, payload = sub.recv_multipart()
            if describing:
                seen.append(describe(int.from_bytes(seq, "big"), time.monotonic(), payload))
            if not joined:
                joined = True
                conn.send("joined")
        if not stopping and conn.poll():
            stopping = conn.recv() == "stop"
            if not stopping:
                describing = True
                conn.send("describing")
    conn.send(seen)
    sub.close(linger=0)
    context.term()


def last_stored(seq: int, now: float, payload: bytes) -> tuple:
    """(receive time, the int hash the batch's last event ends with when that is a BlockStored: a
    store's batch, whose removals come first)."""
    last = _last_event(payload)
    return now, last["block_hashes"][-1] if last and last["type"] == "BlockStored" else None


def _event_hash(key: bytes) -> int:
    """How the stream names a key's block (kv_events_hash int): its hash's last 8 bytes."""
    return int.from_bytes(key[-12:-4], "big")


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


class _Node:
    """A daemon (publishing or not) with a rank session, its region filled."""

    def __init__(self, ctx: Context, name: str, publish: bool, seed: int):
        # An event log of 8 MiB and a replay buffer of 500 batches (~2.5 s of them): both full
        # within the sustained run's first third, so that the memory measured after it shows
        # growth, not them filling their bounds (64 MiB and 10,000 batches by default).
        flags = ("--kv-events-endpoint", f"ipc://{ctx.path(name)}.pub", "--events-log-bytes", "8MiB",
                 "--kv-events-buffer-batches", "500") if publish else ()
        self.daemon = bench_daemon(ctx.path(name), region_size(PAGES, CONTROL_PAGE), CONTROL_PAGE, *flags)
        self.daemon.start()
        self.endpoint = flags[1] if publish else None
        self.rank = RankChannel(self.daemon, f"events-{name}")
        self.keys = {b: KeyStream(seed * 10_000 + b, b) for b in BATCHES}
        for _ in range(PAGES // 1024):
            self.rank.store(self.keys[1024].next())

    def slice(self, batch: int, seconds: float) -> tuple[float, float]:
        """(keys/s, the daemon's CPU µs a job: all its threads) of back-to-back store jobs of
        ``batch`` for ``seconds``."""
        stream, jobs = self.keys[batch], 0
        cpu, start = cpu_ns(self.daemon.pid), time.monotonic()
        while time.monotonic() - start < seconds:
            self.rank.store(stream.next())
            jobs += 1
        elapsed, cpu = time.monotonic() - start, cpu_ns(self.daemon.pid) - cpu
        return jobs * batch / elapsed, cpu / 1e3 / jobs

    def close(self) -> None:
        self.rank.close()
        self.daemon.stop()


def start_subscriber(endpoints: list[str], describe, describing: bool = True):
    """(process, pipe) of a ``subscriber`` process, connected to the endpoints."""
    conn, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=subscriber, args=(endpoints, child, describe, describing),
                                           daemon=True)
    proc.start()
    child.close()                 # the subscriber's end: a subscriber that dies ends the pipe (EOFError)
    _recv(conn)
    return proc, conn


def _recv(conn, timeout: float = 60.0):
    """The subscriber's next message; an error, not a hang, when it does not answer."""
    if not conn.poll(timeout):
        raise RuntimeError(f"events bench: the subscriber process did not answer in {timeout:.0f} s")
    return conn.recv()


def start_describing(conn) -> None:
    """Have a subscriber started with ``describing=False`` describe every batch from now on."""
    conn.send("describe")
    while _recv(conn) != "describing":                        # past its "joined"
        pass


def stop_subscriber(proc, conn) -> list:
    """What the subscriber saw (``describe`` of each batch)."""
    try:
        conn.send("stop")
        while not isinstance(seen := _recv(conn), list):     # past its "joined"
            pass
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return seen


def _latency(node: _Node, rounds: int) -> dict:
    committed, stream = {}, KeyStream(77, 256)
    for _ in range(rounds):
        keys = stream.next()
        node.rank.store(keys)
        committed[_event_hash(keys[-1])] = time.monotonic()
        time.sleep(0.005)
    return committed


def _start_nodes(ctx: Context, trial: int) -> list[_Node]:
    """PAIRS daemons not publishing and as many publishing, fresh: off, on, off, on, ..."""
    nodes: list[_Node] = []
    try:
        for i in range(PAIRS):
            seed = 2 * (trial * PAIRS + i)
            nodes += [_Node(ctx, f"events-off{trial}-{i}", False, seed + 1),
                      _Node(ctx, f"events-on{trial}-{i}", True, seed + 2)]
    except BaseException:                                       # one did not start: stop those that did
        for node in nodes:
            node.close()
        raise
    return nodes


def _throughput(nodes: list[_Node], batch: int, seconds: float) -> dict[str, list[tuple[float, float]]]:
    """(keys/s, daemon CPU µs a job) of each slice, by side: as many rounds as daemons, each round
    one slice of each daemon, the order rotated by one a round (every daemon takes every place in
    the round once)."""
    turns = [("on" if i % 2 else "off", node) for i, node in enumerate(nodes)]
    slices: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for i in range(len(turns)):
        for side, node in turns[i:] + turns[:i]:
            slices[side].append(node.slice(batch, seconds))
    return slices


def _sustained(on: _Node, seconds: float) -> dict:
    """Jobs of 1,024 paced at RATE blocks/s for ``seconds``: what was kept, the RssAnon."""
    pid = on.daemon.pid
    stream, sent, rss_third = KeyStream(99, 1024), 0, None
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        if rss_third is None and now - start >= seconds / 3:
            rss_third = _rss_anon_kib(pid)
        on.rank.store(stream.next())
        sent += 1024
        time.sleep(max(0.0, start + sent / RATE - time.monotonic()))
    elapsed = time.monotonic() - start
    rss_end = _rss_anon_kib(pid)
    events = on.daemon.stats()["events"]
    return {"offered_per_s": RATE, "stored_per_s": sent / elapsed, "rss_anon_third_kib": rss_third or rss_end,
            "rss_anon_end_kib": rss_end, "log_bytes": events["log_bytes"], "published_events": events["stream"]["events"]}


def run(ctx: Context, quick: bool) -> dict:
    trials, seconds = (1, 0.25) if quick else (TRIALS, 1.5)
    rates = {batch: {"off": [], "on": [], "trials": [], "cpu_off": [], "cpu_on": []} for batch in BATCHES}
    for trial in range(trials):
        nodes = _start_nodes(ctx, trial)
        ons = nodes[1::2]
        # Through the throughput slices the subscriber only reads the socket, as a router's does:
        # what it does with the events is the router's cost (decoding them in this bench's Python
        # took 0.3-0.5 µs of the two CPUs per event, a third of a store's whole cost at B = 1,024).
        # In the last trial it describes the batches (decodes their last event) from the latency
        # run on, which runs on that trial's first publishing daemon, and the sustained run after it.
        proc = conn = None
        try:
            proc, conn = start_subscriber([node.endpoint for node in ons], last_stored, describing=False)
            time.sleep(0.3)                                     # the subscription reaches the daemons
            for node in nodes:                                  # warm up, untimed (the module docstring)
                node.slice(BATCHES[-1], WARM_S / 3 if quick else WARM_S)
            for batch in BATCHES:
                got = _throughput(nodes, batch, seconds)
                for side in ("off", "on"):
                    rates[batch][side] += [keys for keys, _ in got[side]]
                    rates[batch]["cpu_" + side] += [cpu for _, cpu in got[side]]
                rates[batch]["trials"].append(ratio(statistics.median(keys for keys, _ in got["on"]),
                                                    statistics.median(keys for keys, _ in got["off"])))
            if trial == trials - 1:
                start_describing(conn)
                committed = _latency(ons[0], 100 if quick else 600)
                sustained = _sustained(ons[0], 3.0 if quick else 15.0)
        finally:
            try:
                if proc is not None:
                    seen = stop_subscriber(proc, conn)
            finally:
                for node in nodes:
                    node.close()
    rows = []
    for batch in BATCHES:
        got = rates[batch]
        cpu_off, cpu_on = statistics.median(got["cpu_off"]), statistics.median(got["cpu_on"])
        rows.append({"keys": batch, "off_keys_per_s": statistics.median(got["off"]),
                     "on_keys_per_s": statistics.median(got["on"]), "on_vs_off": statistics.median(got["trials"]),
                     "trials": [round(r, 3) for r in got["trials"]], "off_cpu_us_per_job": cpu_off,
                     "on_cpu_us_per_job": cpu_on, "cpu_on_vs_off": ratio(cpu_on, cpu_off)})
        say(f"events: B={batch:<5} stores {rows[-1]['on_keys_per_s']:,.0f} keys/s publishing, "
            f"{rows[-1]['off_keys_per_s']:,.0f} not (x{rows[-1]['on_vs_off']:.3f}, the median of "
            + ", ".join(f"{r:.3f}" for r in got["trials"]) + f"); the daemon's CPU a job {cpu_on:,.0f} µs "
            f"publishing, {cpu_off:,.0f} not (x{rows[-1]['cpu_on_vs_off']:.3f})")
    lat = np.array([t - committed[h] for t, h in seen if h in committed])
    latency = {"keys": 256, "batches": len(lat), "p50_us": pct(lat, 50) * 1e6, "p99_us": pct(lat, 99) * 1e6}
    say(f"events: commit -> subscriber p50 {latency['p50_us']:.0f} us, p99 {latency['p99_us']:.0f} us "
        f"({len(lat)} jobs)")
    say(f"events: the daemon stored {sustained['stored_per_s']:,.0f} blocks/s publishing; RssAnon "
        f"{sustained['rss_anon_third_kib']:,} KiB a third of the way in, {sustained['rss_anon_end_kib']:,} KiB at the end")
    return {"throughput": rows, "latency": latency, "sustained": sustained}

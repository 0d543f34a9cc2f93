"""KV events of the shared tier through vLLM 0.33's real Scheduler (harness.py says what is real):
each engine runs with ``--kv-events-config`` on, its own ZMQ publisher, and a real SUB socket
decodes what it publishes with vLLM's own msgspec types.

- engine A serves a prompt: its blocks go to kvtierd. Engine B of the same namespace, which never
  stored them, publishes a ``BlockStored`` (medium CPU) for exactly the blocks A published as its
  own GPU blocks; so does A, for what it put in kvtierd;
- ``kvtierctl evict`` then ``kvtierctl clear``: both publish ``BlockRemoved`` (medium CPU) for
  exactly those blocks;
- engine C of another namespace publishes no CPU event at all;
- vLLM's own offloading stats count kvtier's transfers once: the store and load bytes in the
  scheduler's ``OffloadingConnectorStats`` are kvtierd's own counts (the manager adds none);
- the daemon's own stream (``kv_events_endpoint``), read by a router that subscribes after the
  stores (the replay socket gives it the stream from its start), follows ``kvtierctl evict`` and
  a SIGKILLed and restarted daemon (AllBlocksCleared, then the blocks the region kept, then an
  evict before any store).
"""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from .harness import BLOCK_TOKENS, EngineRecipe, prompt_blocks, running  # noqa: E402
from .test_engines import kvtierctl  # noqa: E402
from .test_kvevents import Subscriber as StreamSubscriber  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = [(3 * i + 11) % 250 + 3 for i in range(6 * BLOCK_TOKENS + 5)]     # 6 full blocks + 5 tokens
FULL = len(PROMPT) // BLOCK_TOKENS


class Subscriber:
    """A router's view of one engine's stream: vLLM's decoder over a real SUB socket."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.sock = context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def take(self) -> list:
        while self.sock.poll(0):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events += self.decoder.decode(payload).events
        return self.events

    def hashes(self, kind: type, medium: str) -> list:
        return [h for e in self.take() if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def events_config(path, name: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}/{name}.pub",
            "topic": f"kv@node@{name}"}


def step_until(engines, predicate, timeout: float = 30.0, what: str = "events") -> None:
    """Step the (idle) engines until ``predicate()``: an engine announces what its link read only
    when it steps (docs/events.md)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        for engine in engines:
            engine.step()
        time.sleep(0.01)


def test_every_engine_of_the_namespace_announces_what_any_stored_and_what_left(start_daemon, tmp_path):
    daemon = start_daemon(page_size="4KiB")
    context = zmq.Context()
    a_recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "engine-a", kv_events=events_config(tmp_path, "a"))
    b_recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "engine-b", kv_events=events_config(tmp_path, "b"))
    c_recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "engine-c", kv_events=events_config(tmp_path, "c"),
                            extra={"kvtier_namespace": "another-model"})
    try:
        with running(a_recipe) as (a, _), running(b_recipe) as (b, b_ranks), running(c_recipe) as (c, _):
            subs = {name: Subscriber(context, f"ipc://{tmp_path}/{name}.pub") for name in "abc"}
            time.sleep(0.2)                                    # the SUB sockets' subscriptions reach the publishers
            a.serve("a", PROMPT)
            gpu = subs["a"].hashes(BlockStored, "GPU")         # vLLM's own events of A's prompt blocks
            assert len(gpu) == FULL and daemon.stats()["entries_ready"] == FULL
            stored = a.connector_counters.get("vllm:kv_offload_store_bytes", 0)
            assert stored == daemon.stats()["bytes_written"] > 0          # counted once, by vLLM

            step_until([a, b, c], lambda: len(subs["b"].hashes(BlockStored, "CPU")) >= FULL, what="B's BlockStored")
            assert sorted(subs["b"].hashes(BlockStored, "CPU")) == sorted(gpu)
            step_until([a], lambda: len(subs["a"].hashes(BlockStored, "CPU")) >= FULL, what="A's BlockStored")
            assert sorted(subs["a"].hashes(BlockStored, "CPU")) == sorted(gpu)

            assert kvtierctl(daemon, "evict", "--count", "2")["evicted"] == 2
            step_until([a, b], lambda: all(len(subs[n].hashes(BlockRemoved, "CPU")) >= 2 for n in "ab"),
                       what="BlockRemoved after kvtierctl evict")
            evicted = sorted(subs["b"].hashes(BlockRemoved, "CPU"))
            assert len(evicted) == 2 and set(evicted) < set(gpu) and sorted(subs["a"].hashes(BlockRemoved, "CPU")) \
                == evicted

            # B loads what is left (A stored it): vLLM counts the load once, as kvtierd moved it.
            b.forget_prefix_cache()
            request, blocks = b.serve("b", PROMPT)
            hits = b.first_computed["b"] // BLOCK_TOKENS           # the prefix before the first block evicted
            expected = [b_ranks[0].call("expected", token_ids=t) for t in prompt_blocks(PROMPT)[:hits]]
            assert hits > 0 and b_ranks[0].call("digests", block_ids=blocks[:hits]) == expected
            loaded = b.connector_counters.get("vllm:kv_offload_load_bytes", 0)
            assert loaded == daemon.stats()["load_hit_keys"] * (stored // FULL)

            # B computed the 2 evicted blocks again and stored them: both announce them again.
            kvtierctl(daemon, "clear", "--all")

            def all_left(name: str) -> bool:
                return sorted(subs[name].hashes(BlockStored, "CPU")) == sorted(subs[name].hashes(BlockRemoved, "CPU"))
            step_until([a, b], lambda: all_left("a") and all_left("b"), what="BlockRemoved after kvtierctl clear")
            assert sorted(subs["b"].hashes(BlockStored, "CPU")) == sorted(gpu + evicted)

            for _ in range(20):
                c.step()
            assert [e for e in subs["c"].take() if getattr(e, "medium", None) == "CPU"] == []
    finally:
        context.destroy(linger=0)


def test_the_daemons_stream_holds_the_nodes_blocks_across_a_late_start_an_evict_and_a_restart(start_daemon,
                                                                                               tmp_path):
    daemon = start_daemon("--kv-events-endpoint", f"ipc://{tmp_path}/node.pub", "--kv-events-replay-endpoint",
                          f"ipc://{tmp_path}/node.replay", "--kv-events-node", "node-a", page_size="4KiB")
    context = zmq.Context()
    try:
        recipe = EngineRecipe("tiny-llama", 1, daemon.socket, "engine-a", kv_events=events_config(tmp_path, "a"))
        with running(recipe) as (engine, _):
            own = Subscriber(context, f"ipc://{tmp_path}/a.pub")
            time.sleep(0.2)
            engine.serve("a", PROMPT)
            gpu = set(own.hashes(BlockStored, "GPU"))
            assert len(gpu) == FULL

        router = StreamSubscriber(context, f"ipc://{tmp_path}/node.pub", f"ipc://{tmp_path}/node.replay")
        time.sleep(0.2)

        def view() -> set:
            router.sync()
            return {h for state in router.state.values() for h, _ in state}
        assert view() == gpu and router.cleared == 1  # late: everything came from the replay socket
        assert [topic.split("@")[:2] for topic in router.state] == [["kv", "node-a"]]

        assert kvtierctl(daemon, "evict", "--count", "2")["evicted"] == 2
        left = view()
        assert len(left) == FULL - 2 and left < gpu

        daemon.stop(signal.SIGKILL)                 # the blocks stay in the region; a new daemon adopts them
        daemon.start()
        deadline = time.monotonic() + 20            # a new stream: its numbers jump; replayed from its start
        while router.cleared < 2 and time.monotonic() < deadline:
            view()
        assert view() == left and router.cleared == 2
        # Before any store into it: the namespace the restarted daemon found is followed already,
        # so what leaves it is announced (0.3.7's stream followed it only from its next store).
        assert kvtierctl(daemon, "evict", "--count", "1")["evicted"] == 1
        deadline = time.monotonic() + 10
        while len(view()) != FULL - 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(view()) == FULL - 3 and view() < left
        stats = daemon.stats()["events"]["stream"]
        assert stats["replays"] >= 1 and stats["batches"] >= 1
    finally:
        context.destroy(linger=0)

"""Valkey/Redis Cluster as the second tier, through the RESP client in ``resp``.

Each block is one string value under its tier key (``keys.Keyspace``): the block's bytes, then
its seal (``seal.SEAL_BYTES``). ``SET`` is gathered from the block's extents in the attached
region and the seal (no join, no staging buffer), ``GET`` received straight into the extents
and a seal buffer (no Python ``bytes``), the seal checked before the block counts as landed.
The copies that remain are the kernel's: region → socket on a put, socket → region on a get,
and the server's own copy of the value.

Keys spread over the cluster's slots by their own hash (no hash tags: one namespace's blocks
must not pile onto one node); a call's commands are pipelined per node and the nodes work in
parallel. A dead node fails only its own keys (``cluster-require-full-coverage no`` on the
servers; tools run them that way): put/get/exists report False for those keys, and the call
raises ``TierUnavailable``/``TierTimeout`` only when no node served any key. The servers should
run with ``maxmemory`` and ``maxmemory-policy allkeys-lru`` so the tier evicts by itself;
``ttl_s`` (optional) gives every block an expiry as well.
"""

from __future__ import annotations

from typing import Sequence

from .backend import Backend, Block, Owner, TierError, TierRejected, TierUnavailable
from .resp import Cluster, RespError, bulk_from, command, key_slot, read_reply
from .seal import SEAL_BYTES, Seals, pipeline


def parse_nodes(nodes: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"h:p,h:p"`` (or a list of ``"h:p"``) → seed addresses."""
    items = nodes.split(",") if isinstance(nodes, str) else list(nodes)
    out = []
    for item in filter(None, (i.strip() for i in items)):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"cluster node {item!r} is not HOST:PORT")
        out.append((host, int(port)))
    if not out:
        raise ValueError("the redis tier needs at least one cluster node address (HOST:PORT)")
    return out


class RedisClusterBackend(Backend):
    name = "redis"
    concurrent = False       # one Cluster's connections serve one thread

    def __init__(self, address: str | Sequence[str], timeout: float = 2.0, node_cooldown: float = 2.0,
                 ttl_s: int = 0):
        """``address``: the cluster's nodes (seeds), ``HOST:PORT,HOST:PORT``."""
        self.seeds = parse_nodes(address)
        self.ttl = [b"EX", b"%d" % ttl_s] if ttl_s > 0 else []
        self.cluster = Cluster(self.seeds, timeout=timeout, node_cooldown=node_cooldown)
        self.cluster.refresh()
        self.memory: memoryview | None = None

    def attach(self, memory: memoryview, owner: Owner) -> None:
        if memory.readonly or not memory.contiguous:
            raise ValueError("the tier's memory must be writable and contiguous")
        self.memory = memory.cast("B")

    def _views(self, block: Block) -> list[memoryview]:
        mem = self.memory
        if mem is None:
            raise TierRejected("redis: attach() the region before moving blocks")
        if any(off < 0 or n <= 0 or off + n > mem.nbytes for off, n in block):
            raise TierRejected(f"an extent of {block} lies outside the attached {mem.nbytes} bytes")
        return [mem[off:off + n] for off, n in block]

    @staticmethod
    def _outcome(results: list, what: str) -> list:
        """The per-key results, unless the engine as a whole failed the call (then raise)."""
        if results and all(isinstance(r, (TierError, RespError)) for r in results):
            first = results[0]
            if isinstance(first, TierError):
                raise first
            raise TierUnavailable(f"redis {what}: every node refused: {first}")
        return results

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        calls = [(key_slot(k), command("EXISTS", k), read_reply) for k in map(str.encode, keys)]
        return [r == 1 for r in self._outcome(self.cluster.execute(calls), "exists")]

    def put(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        if not keys:
            return []
        argc = 3 + len(self.ttl)
        tail = command(*self.ttl)[1:] if self.ttl else []
        results = []
        for part, sealed in seals.parts(pipeline(blocks, len(keys))):    # the next part hashed meanwhile
            calls = []
            for i, seal in zip(part, sealed):
                k = keys[i].encode()
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n" % (argc, len(k), k)
                calls.append((key_slot(k), [head, *bulk_from([*self._views(blocks[i]), memoryview(seal)]), *tail],
                              read_reply))
            results += self.cluster.execute(calls)
        return [r == "OK" for r in self._outcome(results, "put")]

    def get(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        if not keys:
            return []
        trailers = memoryview(bytearray(SEAL_BYTES * len(keys)))
        results, checks = [], []
        for part in pipeline(blocks, len(keys)):
            calls, want = [], []
            for i in part:
                k = keys[i].encode()
                views = [*self._views(blocks[i]), trailers[i * SEAL_BYTES:(i + 1) * SEAL_BYTES]]
                want.append(sum(n for _, n in blocks[i]) + SEAL_BYTES)
                calls.append((key_slot(k), command("GET", k), lambda conn, v=views: conn.read_into(v)))
            got = self.cluster.execute(calls)
            whole = [i for i, r, w in zip(part, got, want) if r == w]
            # Checked while the next part transfers.
            checks.append((whole, seals.checking([(i, trailers[i * SEAL_BYTES:(i + 1) * SEAL_BYTES]) for i in whole])))
            results += got
        self._outcome(results, "get")
        landed = [False] * len(keys)
        for whole, held in checks:
            for i, ok in zip(whole, held):
                landed[i] = ok
        return landed

    def remove(self, keys: list[str]) -> int:
        if not keys:
            return 0
        calls = [(key_slot(k), command("UNLINK", k), read_reply) for k in map(str.encode, keys)]
        return sum(r == 1 for r in self._outcome(self.cluster.execute(calls), "remove"))

    def clear(self, prefix: str) -> int:
        """SCAN each primary for the prefix and UNLINK what it finds there (keys live on one node)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        removed, failed = 0, []
        for addr in self.cluster.nodes():
            cursor = b"0"
            try:
                while True:
                    reply = self.cluster.roundtrip(addr, command("SCAN", cursor, "MATCH", pattern, "COUNT", 1000))
                    if isinstance(reply, RespError):
                        raise TierUnavailable(f"node {addr[0]}:{addr[1]}: {reply}")
                    cursor, found = reply
                    if found:       # one UNLINK per key: a multi-key command must stay in one slot
                        done = self.cluster.execute([(key_slot(k), command("UNLINK", k), read_reply) for k in found])
                        removed += sum(r == 1 for r in done)
                    if cursor == b"0":
                        break
            except TierError as exc:
                failed.append(str(exc))
        if failed and len(failed) == len(self.cluster.nodes()):
            raise TierUnavailable("redis clear: " + "; ".join(failed))
        return removed

    def health(self) -> None:
        replies = self.cluster.each_node(command("PING"))
        if not any(r == "PONG" for r in replies.values()):
            raise TierUnavailable("redis: no cluster node answers PING (" +
                                  "; ".join(f"{a[0]}:{a[1]}: {r}" for a, r in replies.items()) + ")")

    def info(self) -> dict:
        return {"engine": "redis", "nodes": [f"{h}:{p}" for h, p in self.cluster.nodes()], "zero_copy": True,
                "down": [f"{h}:{p}" for (h, p), until in self.cluster.down.items()
                         if until > self.cluster.clock()]}

    def close(self) -> None:
        self.cluster.close()
        self.memory = None

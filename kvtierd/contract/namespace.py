"""The namespace identity, declared once: what makes two engines' cached blocks interchangeable.

Keys live in a namespace (invariant 8: namespaces never mix). Engines with equal NamespaceIds
share entries; different ones never see each other's keys. The identity is the model
(and whatever of its weights, revision or quantization the engine puts in the name), the KV dtype,
tokens per block, bytes one rank holds of one block, the ``Sharding``, and — for a sharded
namespace only — the world size and which of its ranks' shards an entry holds: rank r's shard at
TP=4 holds other bytes than at TP=2, but a replicated block is the same whatever the TP degree, so
a TP=4 and a TP=8 engine of one MLA model share entries.

**Node slices.** An engine whose ranks span nodes attaches each node's ranks to that node's
daemon (``node_ranks``: the ranks of its world that share a daemon; by default all of them). A
replicated namespace does not change: one copy per node, the same for every node and TP degree.
A sharded entry holds the shards of the node's ranks only, so the slice is part of the identity
(``node_ranks``, empty for the whole world): a TP=16 engine's node half (ranks 8-15) never meets
a TP=8 single-node engine's entries, nor the other half's.

Everything else is derived from the fields below: the wire form (hello's ``namespace`` map,
validated by ``protocol.NAMESPACE_FIELDS``, built from the ``wire`` metadata), the region's
namespace record (``region_view.namespace_record``), and the name that stats, logs and
``kvtierctl`` show (``name()``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

MAX_MODEL_BYTES = 256                  # the model name (with weights/revision/quantization)
MAX_DTYPE_BYTES = 32
MAX_BLOCK_TOKENS = 1 << 20
MAX_BLOCK_BYTES = 1 << 34              # 16 GiB per rank and block: far above any real model
MAX_RANKS = 64                         # ranks in one world (protocol.MAX_WORLD_SIZE; a node slice is a 64-bit mask)


class Sharding(str, enum.Enum):
    REPLICATED = "replicated"  # every rank holds identical bytes (MLA): one copy, rank 0 writes
    SHARDED = "sharded"        # each rank holds its own shard (GQA heads split): each rank writes


def _wire(kind: str, lo: int | None = None, hi: int | None = None,
          choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's check on the wire (the keyword arguments of ``protocol.Field``)."""
    return {"wire": {"kind": kind, "lo": lo, "hi": hi, "choices": choices}}


@dataclass(frozen=True)
class NamespaceId:
    model: str = field(metadata=_wire("str", 1, MAX_MODEL_BYTES))
    dtype: str = field(metadata=_wire("str", 1, MAX_DTYPE_BYTES))
    block_tokens: int = field(metadata=_wire("int", 1, MAX_BLOCK_TOKENS))
    block_bytes: int = field(metadata=_wire("int", 1, MAX_BLOCK_BYTES))       # bytes one rank holds of one block
    sharding: Sharding = field(default=Sharding.REPLICATED,
                               metadata=_wire("str", choices=tuple(s.value for s in Sharding)))
    # Part of a sharded namespace's identity only; 0 for a replicated one. Not in the wire map:
    # the daemon takes it from hello's world_size (a client may leave it 0).
    world_size: int = 0
    # A sharded namespace's node slice: the ranks whose shards its entries hold, ascending; empty
    # for the whole world (and always for a replicated one). From hello's node_ranks, like world_size.
    node_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        sharding = Sharding(self.sharding)      # accepts "replicated" / "sharded"; raises on anything else
        object.__setattr__(self, "sharding", sharding)
        ranks = tuple(sorted(self.node_ranks))
        if len(set(ranks)) != len(ranks) or (ranks and not 0 <= ranks[0] <= ranks[-1] < MAX_RANKS):
            raise ValueError(f"node ranks {list(self.node_ranks)} must be distinct ranks in 0..{MAX_RANKS - 1}")
        if self.world_size and ranks and ranks[-1] >= self.world_size:
            raise ValueError(f"node ranks {format_ranks(ranks)} are not all ranks of a world of {self.world_size}")
        if sharding is Sharding.REPLICATED:
            object.__setattr__(self, "world_size", 0)
        if sharding is Sharding.REPLICATED or ranks == tuple(range(self.world_size)):
            ranks = ()                          # the whole world: the identity a single node always had
        object.__setattr__(self, "node_ranks", ranks)

    # --- the wire form --------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in WIRE_FIELDS} | {"sharding": self.sharding.value}

    @classmethod
    def from_wire(cls, wire: dict[str, Any], world_size: int, node_ranks: Sequence[int] = ()) -> "NamespaceId":
        """The identity from hello's (validated) namespace map, the session's world size and the
        ranks of it that share this daemon (empty: all)."""
        return cls(**{name: wire[name] for name in WIRE_FIELDS}, world_size=world_size, node_ranks=tuple(node_ranks))

    @classmethod
    def for_kv_caches(cls, tensors: Sequence, model: str, block_tokens: int,
                      sharding: Sharding | str = Sharding.REPLICATED) -> "NamespaceId":
        """The identity of these per-layer KV-cache tensors (block bytes and dtype from them)."""
        block_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
        dtype = str(tensors[0].dtype).removeprefix("torch.")
        return cls(model, dtype, block_tokens, block_bytes, sharding)

    # --- what follows from it -------------------------------------------------------------------
    @property
    def shards(self) -> int:
        """How many rank shards one entry holds: 1 for replicated; for sharded, one per rank of
        its node slice (the world size when the slice is the whole world)."""
        if self.sharding is Sharding.REPLICATED:
            return 1
        return len(self.node_ranks) if self.node_ranks else self.world_size

    def shard_of(self, rank: int) -> int:
        """Which of an entry's shards ``rank`` copies: 0 when replicated (the one copy), else its
        place in the node slice."""
        if self.sharding is Sharding.REPLICATED:
            return 0
        return self.node_ranks.index(rank) if self.node_ranks else rank

    def pages_per_shard(self, page_size: int) -> int:
        return math.ceil(self.block_bytes / page_size)

    def entry_pages(self, page_size: int) -> int:
        return self.shards * self.pages_per_shard(page_size)

    @property
    def entry_bytes(self) -> int:
        return self.shards * self.block_bytes

    def name(self) -> str:
        shard = f"/tp{self.world_size}" if self.sharding is Sharding.SHARDED else ""
        if self.node_ranks:
            shard += f"[{format_ranks(self.node_ranks)}]"
        return f"{self.model}:{self.dtype}:{self.block_tokens}t:{self.block_bytes}B:{self.sharding.value}{shard}"


def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as runs, ascending: ``8-15``, ``0-3,8-11``, ``5``."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_ranks(text: str) -> tuple[int, ...]:
    """The ranks ``format_ranks`` wrote (``8-15``, ``0-3,8-11``, ``5``), ascending; ValueError for
    anything else, or a rank named twice."""
    ranks: list[int] = []
    for run in text.replace(" ", "").split(","):
        first, sep, last = run.partition("-")
        if not first.isdigit() or (sep and not (last.isdigit() and int(last) >= int(first))):
            raise ValueError(f"{text!r} is not a list of ranks such as 8-15 or 0-3,8-11")
        ranks.extend(range(int(first), int(last if sep else first) + 1))
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"{text!r} names a rank twice, or none")
    return tuple(sorted(ranks))


# The fields of hello's namespace map, in declaration order, with their checks.
WIRE_FIELDS: dict[str, dict[str, Any]] = {
    f.name: f.metadata["wire"] for f in NamespaceId.__dataclass_fields__.values() if "wire" in f.metadata}

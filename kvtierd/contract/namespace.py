"""The namespace identity, declared once: what makes two engines' cached blocks interchangeable.

Keys live in a namespace (invariant 8: namespaces never mix). Engines with equal NamespaceIds
share entries; different ones never see each other's keys. The identity is the model
(and whatever of its weights, revision or quantization the engine puts in the name), the KV dtype,
tokens per block, bytes one rank holds of one block, the ``Sharding``, and — for a sharded
namespace only — the world size: rank r's shard at TP=4 holds other bytes than at TP=2, but a
replicated block is the same whatever the TP degree, so a TP=4 and a TP=8 engine of one MLA model
share entries.

Everything else is derived from the fields below: the wire form (hello's ``namespace`` map,
validated by ``protocol.NAMESPACE_FIELDS``, built from the ``wire`` metadata), the region's
namespace record (``region_view.namespace_record``), and the name that stats, logs and
``kvtierctl`` show (``name()``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

MAX_MODEL_BYTES = 256                  # the model name (with weights/revision/quantization)
MAX_DTYPE_BYTES = 32
MAX_BLOCK_TOKENS = 1 << 20
MAX_BLOCK_BYTES = 1 << 34              # 16 GiB per rank and block: far above any real model


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

    def __post_init__(self) -> None:
        sharding = Sharding(self.sharding)      # accepts "replicated" / "sharded"; raises on anything else
        object.__setattr__(self, "sharding", sharding)
        if sharding is Sharding.REPLICATED:
            object.__setattr__(self, "world_size", 0)

    # --- the wire form --------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in WIRE_FIELDS} | {"sharding": self.sharding.value}

    @classmethod
    def from_wire(cls, wire: dict[str, Any], world_size: int) -> "NamespaceId":
        """The identity from hello's (validated) namespace map and the session's world size."""
        return cls(**{name: wire[name] for name in WIRE_FIELDS}, world_size=world_size)

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
        """How many rank shards one entry holds: 1 for replicated, world_size for sharded."""
        return self.world_size if self.sharding is Sharding.SHARDED else 1

    def pages_per_shard(self, page_size: int) -> int:
        return math.ceil(self.block_bytes / page_size)

    def entry_pages(self, page_size: int) -> int:
        return self.shards * self.pages_per_shard(page_size)

    @property
    def entry_bytes(self) -> int:
        return self.shards * self.block_bytes

    def name(self) -> str:
        shard = f"/tp{self.world_size}" if self.sharding is Sharding.SHARDED else ""
        return f"{self.model}:{self.dtype}:{self.block_tokens}t:{self.block_bytes}B:{self.sharding.value}{shard}"


# The fields of hello's namespace map, in declaration order, with their checks.
WIRE_FIELDS: dict[str, dict[str, Any]] = {
    f.name: f.metadata["wire"] for f in NamespaceId.__dataclass_fields__.values() if "wire" in f.metadata}

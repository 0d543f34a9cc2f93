"""Tier keys: the namespace's identity folded into every key, so two models never meet.

A block's key in the region is only unique inside its namespace (vLLM's keys are hashes of the
tokens, not of the model that produced the KV). In the second tier, which every node and every
model of a fleet shares, a block's key is therefore

    kvt2/<24 hex: blake2b-96 of the namespace identity>/<block key as hex>

where the identity (``identity``) is the namespace's canonical form (model and weights, dtype,
tokens per block, bytes per block, sharding, and the world size for a sharded namespace only). Because a
replicated (MLA) namespace's identity carries no world size, every TP degree of the same model
reads and writes the same tier keys: one copy in the tier for all of them. A sharded namespace's
entry is stored whole (every rank's shard, in rank order) under one key of its own world size.

``kvt2`` versions the scheme: a change of the value format or of the digest gets a new prefix,
so old values are never misread (``kvt1`` values held the block alone; ``kvt2`` values carry
its seal, ``seal.py``). 96 bits of digest make an accidental meeting of two identities
vanishingly unlikely across any fleet (birthday bound ~2^48 namespaces).
"""

from __future__ import annotations

import hashlib

import msgpack

from ..contract.namespace import NamespaceId

SCHEME = "kvt2"


def identity(ns_id: NamespaceId) -> bytes:
    """The namespace identity folded into its tier keys: fixed fields in a fixed order, so every
    daemon of a fleet derives the same bytes."""
    return msgpack.packb(["kvtierd-namespace", ns_id.model, ns_id.dtype, ns_id.block_tokens, ns_id.block_bytes,
                          ns_id.sharding.value, ns_id.world_size])


class Keyspace:
    """The tier keys of one namespace."""

    __slots__ = ("identity", "prefix")

    def __init__(self, identity: bytes):
        if not isinstance(identity, (bytes, bytearray)) or not identity:
            raise ValueError("a keyspace needs the namespace's identity as non-empty bytes")
        self.identity = bytes(identity)
        self.prefix = f"{SCHEME}/{hashlib.blake2b(self.identity, digest_size=12).hexdigest()}/"

    def names(self, keys: list[bytes]) -> list[str]:
        """The tier key of each block key (C-level passes: jobs carry thousands of keys)."""
        return list(map(self.prefix.__add__, map(bytes.hex, keys)))

    def __repr__(self) -> str:
        return f"Keyspace({self.prefix!r})"

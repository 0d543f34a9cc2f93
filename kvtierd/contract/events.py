"""The event stream's wire form: what a record of a namespace's event log says (the events op's
reply, kvtierd.eventlog), shared by the daemon that writes it and the readers that apply it
(``kvtier.events``).

A record is ``[seq, kind, cause, key_len, keys]``: the namespace log's sequence number, ``Kind``,
the ``Cause`` of a removal (None for a store), and its keys as one blob of ``key_len``-byte keys.
A snapshot page is a list of ``[key_len, keys]`` runs.
"""

from __future__ import annotations

import enum

import numpy as np

# Keys one events reply may carry (records and a snapshot page each; ~0.6 MiB of vLLM keys).
MAX_EVENT_KEYS = 16384


class Kind(enum.IntEnum):
    STORED = 0      # the keys became READY: loadable
    REMOVED = 1     # the keys left: evicted, cleared, reclaimed, the region file replaced


class Cause(str, enum.Enum):
    """Why READY keys left (a removal record's ``cause``). WRITING entries that abort were never
    announced, so their end is no removal."""

    EVICTED = "evicted"                   # room for a store, or ahead of need (the second tier)
    CLEARED = "cleared"                   # kvtierctl evict or clear
    RECLAIMED = "reclaimed"               # the namespace's table slot was taken over
    REGION_REPLACED = "region_replaced"   # the region file was truncated and replaced


def split_keys(key_len: int, blob: bytes) -> list[bytes]:
    """The keys of a blob of ``key_len``-byte keys, in order (one C-level pass: a void view, not a
    bytes dtype, which would drop a key's trailing zero bytes)."""
    if key_len <= 0 or len(blob) % key_len:
        raise ValueError(f"a blob of {len(blob)} bytes does not hold {key_len}-byte keys")
    return np.frombuffer(blob, np.dtype((np.void, key_len))).tolist()

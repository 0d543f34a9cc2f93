"""The key table: (namespace, key) → entry slot, the compiled core's ``KeyTable`` over the region's
entry table, whose records hold the keys (bound here to the record layout of ``region_format``).

An open-addressing hash table of 8-byte buckets (twice as many as entry slots: at most half
full), each a slot and 32 bits of its key's hash, plus each slot's 64-bit key fingerprint
(Python's ``hash`` of the key's bytes, which the eviction policies' sketch counts). A lookup
compares the namespace, length and bytes of the key in the record a bucket names, so it can never
return another key's entry whatever the hashes do (``hash_mask`` lets tests make every key
collide). Batch operations take a whole request's keys (a list of bytes) and return int32 slots:
one compiled pass, no Python per key. native/README.md has the design and its measurements.
"""

from __future__ import annotations

from ._native import KeyTable
from .contract.protocol import MAX_KEY_BYTES
from .contract.region_format import ENTRY_DTYPE
from .contract.region_view import RegionView

_AT = {name: ENTRY_DTYPE.fields[name][1] for name in ("state", "key_len", "ns", "key", "first_page", "page_count")}
ALL_BITS = (1 << 64) - 1


def key_table(view: RegionView, hash_mask: int = ALL_BITS) -> KeyTable:
    """An empty key table over ``view``'s entry table (``rebuild`` or ``insert`` fill it)."""
    return KeyTable(view.entries, ENTRY_DTYPE.itemsize, _AT["state"], _AT["key_len"], _AT["ns"], _AT["key"],
                    MAX_KEY_BYTES, _AT["first_page"], _AT["page_count"], hash_mask)


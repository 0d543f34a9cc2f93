"""The keys of the READY entries of the namespaces the KV events log follows, copied out of their
records by entry slot: what an entry that left was called, readable after its record is reused.

An eviction frees its victims' records, and the store that needed the room writes its own keys
into them in the same request. The log's removal records name the keys that left: read from the
victims' records, they had to be read before the store's reply, from cold memory (the victims are
the policy's oldest entries, anywhere in the table): ~11 µs of a 1,024-key store job, 2% of its
keys/s on the events bench's machine (0.3.7). Copied when the entries' READY is recorded, from
records still in cache, and read back by slot when the log takes the removal (after the reply:
``kvtierd.eventlog``), the keys cost neither request a cold read.

The copies cost 65 bytes an entry slot (a key field and its length; the region's records take
128), allocated at the first namespace followed and touched only where entries are.
"""

from __future__ import annotations

import numpy as np

from ._native import copied_keys
from .contract.protocol import MAX_KEY_BYTES
from .contract.region_view import RegionView
from .records import copy_keys, ready_slots

# Entry slots a scan for READY entries takes at a time: its temporary arrays stay ~5 MiB.
SCAN_SLOTS = 1 << 20


class KeyCopies:
    """One key field and its length per entry slot, written by ``put`` and ``put_ready``, read
    by ``runs``. A slot's copy is the key of the entry it held when it was last put."""

    def __init__(self, view: RegionView):
        self.view = view
        self.rows: np.ndarray | None = None        # [entry slot, MAX_KEY_BYTES]
        self.lengths: np.ndarray | None = None     # [entry slot]; 0: never put

    def put(self, slots: np.ndarray) -> list[tuple[int, bytes]]:
        """Copy the keys of the entries at ``slots`` from their records; returns them as ``runs``
        gives them (one run: gathered in the same pass)."""
        if self.rows is None:
            count = len(self.view.entries)
            self.rows, self.lengths = np.zeros((count, MAX_KEY_BYTES), np.uint8), np.zeros(count, np.uint8)
        one = copy_keys(self.view, slots, self.rows, self.lengths)
        return [one] if one is not None else self.runs(slots)

    def put_ready(self, ns: int | None) -> None:
        """Copy the keys of every READY entry of the namespace in table slot ``ns`` (None: of every
        namespace): a scan of the entry table, SCAN_SLOTS at a time (~35 ms a million slots)."""
        entries = self.view.entries
        for start in range(0, len(entries), SCAN_SLOTS):
            self.put(ready_slots(entries, ns, start, start + SCAN_SLOTS))

    def runs(self, slots: np.ndarray) -> list[tuple[int, bytes]]:
        """The copies at ``slots`` as (key length, blob) runs, one per distinct length in the order
        the lengths first come, in slot order within a length (one run, in one compiled pass: the
        usual case; NumPy's gather of the rows took ~29 µs for 1,024 cold ones)."""
        if not len(slots) or self.lengths is None:
            return []
        one = copied_keys(self.rows, self.lengths, slots)
        if one is not None:
            return [one]
        lengths = self.lengths[slots]
        distinct, at = np.unique(lengths, return_index=True)
        return [(int(n), self.rows[slots[lengths == n], :int(n)].tobytes()) for n in distinct[np.argsort(at)]]

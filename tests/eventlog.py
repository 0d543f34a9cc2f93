"""A model of the index for the event log's tests: entries in a region-format entry table, filled
and emptied slot by slot, with the log told of every change as the index's observer tells it.

Used by tests/unit/test_events.py (the log and a reader's view) and tests/vllm/test_kvevents.py
(the daemon's KV events stream, decoded by vLLM).
"""

from __future__ import annotations

import numpy as np

from kvtierd.contract.events import Cause
from kvtierd.contract.region_format import ENTRY_DTYPE, EntryState
from kvtierd.eventlog import EventLog, TableSnapshot


class Table:
    """Entries of namespaces (by slot number) in an entry table, and the event log they feed."""

    def __init__(self, slots: int, log_budget: int, scan_slots: int = 8):
        self.entries = np.zeros(slots, ENTRY_DTYPE)
        self.slot_of: dict[tuple[int, bytes], int] = {}
        self.log = EventLog(TableSnapshot(self.entries, scan_slots=scan_slots, max_scan_slots=4 * scan_slots),
                            log_budget)

    def ready(self, ns: int) -> set:
        return {key for (n, key) in self.slot_of if n == ns}

    def store(self, ns: int, keys: list[bytes]) -> list[bytes]:
        """The keys not held yet become READY, as many as there are free slots. Returns them."""
        keys = [k for k in dict.fromkeys(keys) if (ns, k) not in self.slot_of]
        free = np.flatnonzero(self.entries["state"] == EntryState.FREE)[::-1][:len(keys)].tolist()
        keys = keys[:len(free)]
        for key, slot in zip(keys, free):
            rec = self.entries[slot]
            rec["ns"], rec["key_len"] = ns, len(key)
            rec["key"][:len(key)] = np.frombuffer(key, np.uint8)
            rec["state"] = EntryState.READY
            self.slot_of[(ns, key)] = slot
        self.log.stored(ns, keys)
        return keys

    def remove(self, ns: int, keys: list[bytes], cause: Cause = Cause.EVICTED) -> list[bytes]:
        keys = [k for k in dict.fromkeys(keys) if (ns, k) in self.slot_of]
        for key in keys:
            self.entries[self.slot_of.pop((ns, key))]["state"] = EntryState.FREE
        self.log.removed(ns, keys, cause)
        return keys

    def restart(self, log_budget: int, scan_slots: int = 8) -> None:
        """A new daemon on the same table: a new log (new epochs), the entries as they are."""
        self.log = EventLog(TableSnapshot(self.entries, scan_slots=scan_slots, max_scan_slots=4 * scan_slots),
                            log_budget)

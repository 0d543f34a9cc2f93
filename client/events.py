"""``EventView``: a reader's copy of one namespace's READY keys, kept equal to kvtierd's through the
events op, and the changes to announce as it moves.

A reader (the vLLM plugin's manager, on its link thread) asks with ``request()``'s fields
(``Coordinator.events(**view.request())``) and hands each reply to ``apply``, which returns what
changed in the view, in order: lists of keys stored and removed, ready to become an engine's KV
events. The view never jumps silently:

- a reply that continues the cursor gives records, applied in sequence order; a key is
  announced as stored only when it was not in the view, as removed only when it was;
- a reply that says ``reset`` (the reader fell behind the daemon's log, the daemon restarted, or
  it is the first read) starts a new view from empty, built from the records and snapshot pages
  of the replies that follow; when the last page came (``snapshot_next`` None) the new view
  replaces the old one, and the difference is announced (keys gone first, then keys new).

``keep`` chooses which keys of a run the view holds (default: all): an engine keeps the keys it
can load, so that a key it could never produce costs it nothing (the vLLM plugin keeps keys of
its own hash length and KV-cache groups).
"""

from __future__ import annotations

from typing import Callable

from kvtierd.contract.events import Kind, split_keys
from kvtierd.contract.replies import EventsReply

# A change to announce: (removed, keys) — removed False: the keys became loadable.
Change = tuple[bool, list]


class EventView:
    def __init__(self, keep: Callable[[int, bytes], list] = split_keys):
        self.keep = keep
        self.keys: set = set()            # the keys announced: the namespace's READY keys as last applied
        self.epoch: int | None = None
        self.cursor: int | None = None    # None: no read yet (the first one resets)
        self.snapshot_from: int | None = None
        self._building: set | None = None   # the new view while a reset's snapshot is in progress
        self.resets = 0

    @property
    def resyncing(self) -> bool:
        return self._building is not None

    def request(self) -> dict:
        """The events op's fields for the next read."""
        return {"epoch": self.epoch, "cursor": self.cursor, "snapshot_from": self.snapshot_from}

    def apply(self, reply: EventsReply) -> list[Change]:
        """Apply one events reply; returns the changes of the view, in order."""
        if reply.reset:
            self._building = set()
            self.resets += 1
        self.epoch, self.cursor, self.snapshot_from = reply.epoch, reply.seq, reply.snapshot_next
        building = self._building
        changes: list[Change] = []
        for _seq, kind, _cause, key_len, blob in reply.records:
            keys = self.keep(key_len, blob)
            if building is not None:
                (building.update if kind == Kind.STORED else building.difference_update)(keys)
            elif kind == Kind.STORED:
                new = [k for k in keys if k not in self.keys]
                if new:
                    self.keys.update(new)
                    changes.append((False, new))
            else:
                gone = [k for k in keys if k in self.keys]
                if gone:
                    self.keys.difference_update(gone)
                    changes.append((True, gone))
        if building is not None:
            for key_len, blob in reply.snapshot:
                building.update(self.keep(key_len, blob))
            if self.snapshot_from is None:
                changes = self._replace(building)
        return changes

    def _replace(self, new: set) -> list[Change]:
        """The reset's view is complete: it becomes the view; announce the difference."""
        gone, added = list(self.keys - new), list(new - self.keys)
        self.keys, self._building = new, None
        return [change for change in ((True, gone), (False, added)) if change[1]]

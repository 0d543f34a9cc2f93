"""The KV events of an engine's kvtier namespace: kvtierd's event log, read on the link thread,
queued for the scheduler as (removed, OffloadKeys) pairs, which
``KvtierOffloadingManager.take_events`` hands to vLLM as OffloadingEvents (medium CPU), so that
vLLM's own publisher announces every block of the shared tier this engine can load — stored by
any engine of the namespace, removed for any cause (docs/events.md).

- ``poll(read)`` (link thread): reads the log from the feed's cursor (``read``, e.g.
  ``Coordinator.events``, sends one events request and returns its reply), a few replies at
  most until it caught up, and queues the changes of its ``kvtier.events.EventView``. A feed that fell behind the daemon's log (or a
  restarted daemon) is reset there: its next changes are exactly the difference between what
  it announced and what kvtierd holds.
- ``take()`` (scheduler thread, ``take_events``): the queued changes; never waits on kvtierd.
- ``due()``: whether to send a poll now: none in flight, and the queue below
  ``max_pending_keys`` (an engine that does not step, and so does not drain it, stops the
  polls; kvtierd's log keeps or drops the history, and the feed resyncs when it reads again).
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

from kvtier.events import EventView
from kvtierd.contract.protocol import EventsReply

from .keys import offload_keys

# Replies one poll reads at most (each up to kvtierd's MAX_EVENT_KEYS keys) before it lets the
# link serve other calls.
POLL_REPLIES = 8


class EventFeed:
    def __init__(self, key_bytes: int, num_groups: int, max_pending_keys: int = 1 << 20):
        self.view = EventView(keep=functools.partial(offload_keys, key_bytes=key_bytes, num_groups=num_groups))
        self.max_pending_keys = max_pending_keys
        self._lock = threading.Lock()
        self._pending: list[tuple[bool, list[bytes]]] = []       # (removed, keys), in order
        self._pending_keys = 0
        self._polling = False
        self.announced = 0                # keys handed to vLLM (stored + removed)

    def due(self) -> bool:
        return not self._polling and self._pending_keys < self.max_pending_keys

    def poll(self, read: Callable[..., EventsReply]) -> None:
        """(link thread) Read the log until caught up (``POLL_REPLIES`` replies at most) and queue
        the view's changes."""
        self._polling = True
        try:
            for _ in range(POLL_REPLIES):
                reply = read(**self.view.request())
                changes = list(self.view.apply(reply))
                if changes:
                    with self._lock:
                        self._pending.extend(changes)
                        self._pending_keys += sum(len(keys) for _, keys in changes)
                if not reply.behind and not self.view.resyncing:
                    break
        finally:
            self._polling = False

    def take(self) -> list[tuple[bool, list[bytes]]]:
        """(scheduler thread) The changes queued since the last call, in order: (removed, keys)."""
        with self._lock:
            changes, self._pending, self._pending_keys = self._pending, [], 0
        self.announced += sum(len(keys) for _, keys in changes)
        return changes

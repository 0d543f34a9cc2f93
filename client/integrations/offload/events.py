"""The KV events of an engine's kvtier namespace: kvtierd's event log, read on the link thread,
queued for the scheduler as (removed, OffloadKeys) pairs, which
``KvtierOffloadingManager.take_events`` hands to vLLM as OffloadingEvents (medium CPU), so that
vLLM's own publisher announces every block of the shared tier this engine can load — stored by
any engine of the namespace, removed for any cause (docs/events.md).

- ``claim()`` (scheduler thread, at the end of a step): whether to send a poll now — none in
  flight, the last one at least ``interval_s`` ago, and fewer than ``max_pending_keys`` queued
  (an engine that does not step, and so does not drain the queue, stops the polls; kvtierd's
  log keeps or drops the history, and the feed resyncs when it reads again). A claimed poll is
  handed to the link (``Link.submit``) and ends in ``poll`` or, when the link refused it, in
  ``released``.
- ``poll(read)`` (link thread): reads the log from the feed's cursor (``read``, e.g.
  ``Coordinator.events``, sends one events request and returns its reply), a few replies at
  most until it caught up, and queues the changes of its ``kvtier.events.EventView``. A feed
  that fell behind the daemon's log (or a restarted daemon) is reset there: its next changes
  are exactly the difference between what it announced and what kvtierd holds.
- ``take()`` (scheduler thread, ``take_events``): the queued changes; never waits on kvtierd.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

from kvtier.events import EventView
from kvtierd.contract.replies import EventsReply

from .keys import offload_keys

# Replies one poll reads at most (each up to kvtierd's MAX_EVENT_KEYS keys) before it lets the
# link serve other calls.
POLL_REPLIES = 8
# Polls at most this often: one events request per engine step would be a request per few
# milliseconds per engine to the daemon's one loop; routers see events within this much more.
POLL_INTERVAL_S = 0.01


class EventFeed:
    def __init__(self, key_bytes: int, num_groups: int, max_pending_keys: int = 1 << 20,
                 interval_s: float = POLL_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.view = EventView(keep=functools.partial(offload_keys, key_bytes=key_bytes, num_groups=num_groups))
        self.max_pending_keys = max_pending_keys
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[tuple[bool, list[bytes]]] = []       # (removed, keys), in order
        self._pending_keys = 0
        self._polling = False
        self._last = float("-inf")
        self.announced = 0                # keys handed to the engine (stored + removed)
        self.polls = 0                    # polls that reached kvtierd

    @property
    def pending(self) -> bool:
        """Changes are queued that the engine has not taken yet."""
        return self._pending_keys > 0

    def claim(self) -> bool:
        """(scheduler thread) Whether a poll is due now; if so, it is in flight from now on."""
        now = self._clock()
        if self._polling or now - self._last < self.interval_s or self._pending_keys >= self.max_pending_keys:
            return False
        self._polling, self._last = True, now
        return True

    def released(self, _result=None) -> None:
        """The claimed poll ended (ran, failed, or was refused by a link that is down)."""
        self._polling = False

    def poll(self, read: Callable[..., EventsReply]) -> None:
        """(link thread) Read the log until caught up (``POLL_REPLIES`` replies at most) and queue
        the view's changes."""
        try:
            for _ in range(POLL_REPLIES):
                reply = read(**self.view.request())
                self.polls += 1
                changes = self.view.apply(reply)
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

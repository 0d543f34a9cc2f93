"""The public client API, in the engine's terms.

A ``Client`` is one session with kvtierd, in one of two roles, each a class of its own with only
its own methods: a ``Rank`` (one per TP rank: registers its KV cache, copies, votes;
``kvtier.rank``) or a ``Coordinator`` (the engine's scheduler process, which looks up and opens
jobs that its ranks then carry out; ``kvtier.coordinator``). ``Client(..., rank=r)`` builds a
``Rank`` and ``Client(..., rank=None)`` a ``Coordinator``; both are ``Client`` subclasses
(``kvtier.session``: what they share). Engines whose ranks each issue the same jobs need no
coordinator: the first request of a job fixes its decision for everybody.

Rank usage::

    client = Client(socket, engine_id="e1", rank=r, world_size=n, namespace=namespace_id)
    client.register_kv_caches(per_layer_tensors)
    hits = client.lookup(keys)                      # leading keys that are cached
    client.lookup_detail(keys).pending              # keys after them being promoted from a second tier
    client.store(job, keys, block_ids)              # returns the per-key decision at once
    client.load(job2, keys[:hits], block_ids2)      # returns how many blocks will arrive
    for result in client.wait([job, job2]): ...     # or poll() from the engine's loop

Leases (invariant 10): ``lookup(keys, lease=L)`` also holds the hits for the engine until a load
names the lease (``load(..., lease=L)``, or the coordinator's ``open_load``), ``unlease([L])``,
or the lease's ttl passes; ``lease_held(L)`` says how many it holds. A load of leased keys cannot
come back short. Any session of the engine may consume the lease: a coordinator leases, its
ranks' load job consumes.

A store job finishes on this rank once its copy (if it is a writer) completed and its vote was
accepted; a load job once its copy completed and its release was accepted. ``JobResult.ok`` is
False when the daemon aborted the job (then loaded blocks must be treated as a miss).

Daemon restarts: when the daemon stops answering or no longer knows the session (it restarted, or
dropped a session that stopped heartbeating), the client re-attaches on its own (same engine, rank
and namespace; for up to ``reconnect_timeout`` seconds), remapping the region when its path or
generation changed; while it waits, it tries again within 10 ms of a daemon binding the socket
(``kvtier.reach``), whether the old one stopped (SIGTERM) or died. Before it re-attaches it waits
for every copy in flight, and its hello names the old session and token: that tells the daemon the
pages it was handed are free again (the page fence, invariant 9). Then it re-issues its live leases
(leases are session state, lost with the daemon) and redoes its loads in flight (a load's first
copy may have read pages the new daemon gave to someone else; READY blocks survive a restart, so
the load job is opened again and the same blocks copied again: the engine sees latency only; if
fewer blocks are cached now, the job finishes ``ok=False``). Stores in flight across the restart
finish with ``ok=False`` and a ``DaemonUnavailable`` error (not cached); the call that discovered
the restart is retried once on the new daemon, except commit/release, whose jobs died with the old
one — so a client never commits into pages that were given to someone else meanwhile (a load whose
release found the restart is redone as above). ``poll`` and ``wait`` report every job exactly once,
whatever restart they find on the way. A session the daemon cannot watch through a pidfd (another
PID namespace) gets a heartbeat thread with its own socket. A daemon that is stopping answers new
sessions and new jobs with ``ShuttingDown``, raised to the caller (its open jobs are still served:
their commits and releases go through).

First touch: a rank populates its mapping of the region in the background at attach
(``Rank.populating``; ``kvtier.rank`` says why and what it costs).

The API's log lines go to the logger ``kvtier.api``.
"""

from .coordinator import Coordinator
from .rank import Rank
from .results import JobResult, Lease, StoreDecision
from .session import SECRET_ENV, Client

__all__ = ["Client", "Coordinator", "Rank", "JobResult", "Lease", "StoreDecision", "SECRET_ENV"]

"""``Client``: one session with kvtierd, what both roles share — attaching and re-attaching,
liveness, lookups and leases, stats, aborts. ``kvtier.api`` describes the public API.

``Client(...)`` builds the role its ``rank`` names: a ``Rank`` (``kvtier.rank``: a TP rank that
registers its KV cache, copies and votes) or, with ``rank=None``, a ``Coordinator``
(``kvtier.coordinator``: the engine's scheduler process, which opens the jobs its ranks carry out).
Both are ``Client`` subclasses, so code written against ``Client`` keeps working; each role has
only its own methods.

Re-attaching (after a restart, or when the daemon dropped the session) waits for the daemon to
serve again on ``kvtier.reach.SocketWatch``: a daemon that answered (``NOT_ATTACHED``) is tried at
once; one that did not is tried again as soon as its socket path holds a new socket (a restarted
daemon binds one: within ``reach.POLL_S``), else after a pause that grows from
``UNCHANGED_RETRY_S`` to 1 s (the same daemon may resume). A request after ``IDLE_LOOK_S`` of
silence looks at the socket first, so that the first request after a restart re-attaches at once
instead of going through the old connection. The role's hooks run around it: a rank waits for its
copies first and redoes its loads after.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Iterable, Sequence

from kvtierd.contract import protocol as P
from kvtierd.contract.channel import Channel
from kvtierd.contract.errors import DaemonUnavailable, KvtierError, NotAttached
from kvtierd.contract.namespace import NamespaceId, format_ranks, parse_ranks
from kvtierd.contract.paths import default_socket
from kvtierd.contract.replies import HelloReply, JobsReply, LookupReply, StatsReply, UnleaseReply

from .reach import AWAY_ERRORS, SocketWatch
from .results import Lease

log = logging.getLogger("kvtier.api")

SECRET_ENV = "KVTIER_ENGINE_SECRET"      # the engine secret when Client(engine_secret=) is not given
NODE_RANKS_ENV = "KVTIER_NODE_RANKS"      # the node's ranks when Client(node_ranks=) is not given, e.g. "8-15"

# Ops that may be sent again after re-attaching: they do not refer to a job of the old daemon (an
# events cursor of the old daemon names its epoch: the new one resets the reader).
_RETRYABLE = frozenset({"lookup", "stats", "jobs", "store", "load", "abort", "unlease", "events"})

# A daemon that did not answer and whose socket is unchanged is dead (a stale socket file: a hello
# would wait for whoever binds it next) or hung: the next attempt on it waits this long at first.
UNCHANGED_RETRY_S = 0.25

# A request after this long without one first looks at the socket path (one stat, about 2 us): if
# a daemon bound it anew meanwhile (a restart), the client re-attaches at once on a fresh channel,
# where the old connection would wait for ZMQ to reconnect it (every 100 ms) and for NOT_ATTACHED.
IDLE_LOOK_S = 0.1


class _Heartbeat(threading.Thread):
    """Proves a session alive from its own socket while the engine's thread is busy elsewhere."""

    def __init__(self, socket_path: str, session: int, token: int, interval: float):
        super().__init__(name="kvtier-heartbeat", daemon=True)
        self._args = (socket_path, session, token, interval)
        self._stop_event = threading.Event()

    def run(self) -> None:
        socket_path, session, token, interval = self._args
        channel = None
        try:
            while not self._stop_event.wait(interval):
                try:
                    channel = channel or Channel(socket_path, timeout=interval)
                    channel.call("ping", session=session, token=token)
                except KvtierError:
                    pass   # the engine's next call finds out and re-attaches
        finally:
            if channel is not None:
                channel.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


def _node_ranks(given: Iterable[int] | None, rank: int | None, world_size: int) -> tuple[int, ...]:
    """The ranks of the world that share this client's kvtierd (its node's): ``given``, else
    ``$KVTIER_NODE_RANKS`` (e.g. ``8-15``), else all of them. ValueError naming where they came
    from when they are not ranks of the world, or leave out ``rank``."""
    where = "node_ranks"
    if given is None and os.environ.get(NODE_RANKS_ENV):
        where, given = NODE_RANKS_ENV, parse_ranks(os.environ[NODE_RANKS_ENV])
    ranks = tuple(sorted(range(world_size) if given is None else given))
    if not ranks or len(set(ranks)) != len(ranks) or not 0 <= ranks[0] <= ranks[-1] < world_size:
        raise ValueError(f"{where} must be distinct ranks of the world of {world_size}, at least one; got {list(ranks)}")
    if rank is not None and rank not in ranks:
        raise ValueError(f"{where} ({format_ranks(ranks)}) must hold this client's rank {rank}: every rank attaches "
                         "to the kvtierd of its own node")
    return ranks


class Client:
    """One session with kvtierd (module docstring); ``Client(..., rank=r)`` is a ``Rank``,
    ``Client(..., rank=None)`` a ``Coordinator``.

    ``node_ranks``: the ranks of the world that attach to this kvtierd — the engine's ranks on
    this node when its TP group spans nodes, each node running its own kvtierd (default
    ``$KVTIER_NODE_RANKS``, else every rank: one node). The daemon then counts the votes of
    these ranks only, the lowest of them writes a replicated block (one copy per node), and a
    sharded entry holds their shards. Every session of the engine on one daemon names the same
    ranks; a coordinator names those of the node it runs on."""

    _roles: dict[str, type] = {}             # "rank" / "coordinator" -> the class (they register)
    is_writer = False                        # a rank that copies D2H (from each hello's reply)

    def __init_subclass__(cls, role: str | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if role is not None:
            Client._roles[role] = cls

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is Client:
            cls = Client._roles["coordinator" if kwargs.get("rank") is None else "rank"]
        return super().__new__(cls)

    def __init__(self, socket_path: str | None = None, *, engine_id: str, rank: int | None, world_size: int,
                 namespace: NamespaceId, timeout: float = 10.0, reconnect_timeout: float = 30.0,
                 engine_secret: bytes | str | None = None, node_ranks: Iterable[int] | None = None):
        self.socket_path = socket_path or default_socket()
        self.node_ranks = _node_ranks(node_ranks, rank, world_size)
        # The engine's sessions are bound together: the daemon lets a session join engine_id only
        # from the uid of its first session and, when that one presented a secret, with the same
        # secret. Every process of an engine passes the same one (or sets KVTIER_ENGINE_SECRET).
        secret = engine_secret if engine_secret is not None else os.environ.get(SECRET_ENV) or None
        self.engine_secret = secret.encode() if isinstance(secret, str) else secret
        if self.engine_secret is not None and not P.MIN_SECRET_BYTES <= len(self.engine_secret) <= P.MAX_SECRET_BYTES:
            raise ValueError(f"an engine secret is {P.MIN_SECRET_BYTES}..{P.MAX_SECRET_BYTES} bytes "
                             f"(engine_secret / {SECRET_ENV}); got {len(self.engine_secret)}")
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.engine_id = engine_id
        self.timeout = timeout
        self.reconnect_timeout = reconnect_timeout
        self.channel: Channel | None = None
        self.info: HelloReply | None = None       # the last hello's reply
        self.socket_watch = SocketWatch(self.socket_path)   # which socket the session last tried
        self._heartbeat: _Heartbeat | None = None
        self._leases: dict[int, Lease] = {}
        self._prune_at = 1024                     # lease records kept before lapsed ones are dropped
        self.attachments = 0                      # successful hellos so far (a restart makes it move)
        self._last_reply = 0.0                    # time.monotonic() of the last answer
        self._attach()

    # ------------------------------------------------------------------ attaching
    def _attach(self) -> None:
        """hello on a fresh channel, then the role's ``_attached``."""
        try:
            pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            pidns = None
        fields = dict(version=P.PROTOCOL_VERSION, engine=self.engine_id, rank=self.rank, world_size=self.world_size,
                      namespace=self.namespace.to_wire(), pid=os.getpid())
        if len(self.node_ranks) < self.world_size:       # an engine that spans nodes: this node's ranks
            fields["node_ranks"] = list(self.node_ranks)
        if pidns is not None:        # unknown: the daemon cannot watch us and expects heartbeats
            fields["pidns"] = pidns
        if self.engine_secret is not None:
            fields["secret"] = self.engine_secret
        previous = self.info
        if previous is not None:   # re-attaching: the daemon may still hold our old session (a lost reply)
            fields.update(replaces=previous.session, replaces_token=previous.token)
        tried = self.socket_watch.look()
        try:
            channel = Channel(self.socket_path, self.timeout)
        except BaseException:
            self.socket_watch.know(tried)
            raise
        try:
            info = HelloReply.from_wire(channel.call("hello", **fields))
        except BaseException:
            channel.close()
            self.socket_watch.know(tried)        # that socket failed us: wait for another
            raise
        # The socket that served the hello (looked at now: a daemon answers only once it bound
        # and set up its socket file).
        self.socket_watch.know(self.socket_watch.look())
        self._last_reply = time.monotonic()
        self.channel, self.info = channel, info
        self.attachments += 1
        self.session = info.session
        self.page_size = info.page_size
        self.pages_per_shard = info.pages_per_shard
        self._attached(previous)
        if info.heartbeat_interval:
            self._heartbeat = _Heartbeat(self.socket_path, info.session, info.token, info.heartbeat_interval)
            self._heartbeat.start()

    def _attached(self, previous: HelloReply | None) -> None:
        """The role's part of a (re-)attach, after the hello (``previous``: the one before)."""

    def _quiesce(self, cause: KvtierError) -> Any:
        """Before re-attaching: settle what the role has in flight; returns what ``_resume`` redoes."""
        return None

    def _resume(self, held: Any, cause: KvtierError, attached: bool) -> None:
        """After re-attaching (``attached``), or giving up: redo or settle what ``_quiesce`` held."""

    def _reattach(self, cause: KvtierError, patience: float | None = None, at_once: bool = False) -> None:
        """The daemon restarted, stopped, or dropped us: attach again (for ``patience`` seconds,
        default reconnect_timeout) and re-issue the live leases; the role's hooks settle and redo
        what was in flight. A daemon that answered (``cause`` not DaemonUnavailable) or
        ``at_once`` is tried at once; else the next attempt waits for the socket to move (a
        restarted daemon) or a pause. Raises DaemonUnavailable when none serves in time."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        held = self._quiesce(cause)
        self.channel.close()
        patience = self.reconnect_timeout if patience is None else patience
        deadline = time.monotonic() + patience
        pause = UNCHANGED_RETRY_S
        ready = at_once or not isinstance(cause, DaemonUnavailable) or self.socket_watch.moved()
        while True:
            if ready:
                try:
                    self._attach()
                    break
                except AWAY_ERRORS as exc:     # none serves yet, or a stopping daemon: the next one
                    cause = exc
            left = deadline - time.monotonic()
            if left <= 0:
                self._resume(held, cause, False)
                raise DaemonUnavailable(f"kvtierd did not come back within {patience:g}s: {cause}") from None
            ready = True
            if not self.socket_watch.wait(min(pause, left)):
                pause = min(pause * 2, 1.0)
        self._reissue_leases()
        self._resume(held, cause, True)

    def reconnect(self) -> None:
        """Attach again now, one attempt, after kvtierd restarted or dropped this session (as
        any call does on its own, with retries for ``reconnect_timeout``): for a caller that
        watches the connection and paces its attempts itself. Re-issues the live leases.
        Raises DaemonUnavailable when kvtierd does not answer."""
        self._reattach(DaemonUnavailable("reconnect"), patience=0.0, at_once=True)

    def _call(self, op: str, **fields) -> dict:
        """One request; after a restart (no answer, session unknown, or after a pause a socket
        bound anew), re-attach and retry once."""
        try:
            if time.monotonic() - self._last_reply >= IDLE_LOOK_S and self.socket_watch.moved():
                raise NotAttached("kvtierd's socket was bound anew: it restarted")
            reply = self.channel.call(op, **fields)
        except (DaemonUnavailable, NotAttached) as exc:
            if self.channel is None:
                raise
            self._reattach(exc)
            if op not in _RETRYABLE:
                raise DaemonUnavailable(f"kvtierd restarted: the {op} of job {fields.get('job')} is lost") from exc
            reply = self.channel.call(op, **fields)
        self._last_reply = time.monotonic()
        return reply

    def _call_quietly(self, op: str, **fields) -> None:
        try:
            self._call(op, **fields)
        except KvtierError:
            pass

    # ------------------------------------------------------------------ queries
    def lookup(self, keys: Sequence[bytes], lease: int | None = None, ttl: float | None = None) -> int:
        """How many leading keys are cached and ready (they count as recently used).

        ``lease``: an id of your choice, unique among the engine's live leases. kvtierd then also
        holds those hits for the engine: no eviction takes them until a load names the lease
        (``load``/``open_load`` of any session of the engine), ``unlease``, or ``ttl`` seconds
        pass (kvtierd clamps it to [10 ms, its max_lease_ttl]; None: its lease_ttl). The same id
        again renews it (replaces it at once). ``lease_held(lease)`` says how many hits it holds
        (fewer past kvtierd's caps) and until when. A lease belongs to this session: it ends with
        it, and after a daemon restart this client leases again what is left of it."""
        return self.lookup_detail(keys, lease, ttl).hits

    def lookup_detail(self, keys: Sequence[bytes], lease: int | None = None, ttl: float | None = None) -> LookupReply:
        """``lookup``'s whole answer: ``hits`` leading keys are ready (``lease``, ``leased``,
        ``ttl_ms``: what a lease holds of them); the ``pending`` keys after them are being promoted
        from the daemon's second tier (ask again shortly rather than compute them; 0 without a tier)."""
        if lease is None:
            return LookupReply.from_wire(self._call("lookup", keys=list(keys)))
        return self._lookup_leased(tuple(keys), lease, ttl, self._call)

    def _lookup_leased(self, keys: tuple, lease: int, ttl: float | None, call) -> LookupReply:
        fields: dict = {"keys": list(keys), "lease": lease}
        if ttl is not None:
            fields["ttl_ms"] = max(0, round(ttl * 1000))
        sent = time.monotonic()
        reply = LookupReply.from_wire(call("lookup", **fields))
        self._leases.pop(lease, None)
        if reply.lease is not None:
            self._leases[lease] = Lease(lease, keys, reply.hits, reply.leased, reply.ttl_ms / 1000,
                                        sent + reply.ttl_ms / 1000)
            if len(self._leases) > self._prune_at:    # leases another session consumed linger until they lapse
                self._drop_lapsed()
                self._prune_at = max(1024, 2 * len(self._leases))
        return reply

    def _drop_lapsed(self) -> None:
        now = time.monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires <= now]:
            del self._leases[lease_id]

    def _reissue_leases(self) -> None:
        """After re-attaching: lease again, for what is left of their ttl, the leases the old
        session held (kvtierd lost them with it). A lease that now holds fewer keys says so."""
        now = time.monotonic()
        leases, self._leases = self._leases, {}
        for lease in leases.values():
            left = lease.expires - now
            if left <= 0:
                continue
            try:
                self._lookup_leased(lease.keys, lease.id, left, self.channel.call)
            except KvtierError as exc:      # kvtierd went again: the next call finds out
                log.info("kvtier: re-issuing lease %d after re-attaching failed: %s", lease.id, exc)
                return

    def _consume(self, lease: int | None) -> dict:
        """A load's lease field: the job's first request consumes the lease, whichever session
        sends it, so this client no longer holds it either way."""
        if lease is None:
            return {}
        self._leases.pop(lease, None)
        return {"lease": lease}

    def lease_held(self, lease: int) -> Lease | None:
        """The lease of this id this client holds, unless it lapsed (what its lookup reported)."""
        held = self._leases.get(lease)
        return held if held is not None and held.expires > time.monotonic() else None

    @property
    def leases(self) -> dict[int, Lease]:
        """The leases this client holds and that have not lapsed, by id. (A lease another session
        of the engine consumed, e.g. the ranks' load of a coordinator's lease, stays listed until
        it lapses: the client cannot know.)"""
        self._drop_lapsed()
        return dict(self._leases)

    def unlease(self, leases: Iterable[int]) -> int:
        """End these leases of the engine (ids that name none are ignored); returns how many
        were live in kvtierd."""
        ids = list(dict.fromkeys(leases))
        for lease_id in ids:
            self._leases.pop(lease_id, None)
        released = 0
        for begin in range(0, len(ids), P.MAX_LEASES_PER_UNLEASE):
            chunk = ids[begin:begin + P.MAX_LEASES_PER_UNLEASE]
            released += UnleaseReply.from_wire(self._call("unlease", leases=chunk)).released
        return released

    def stats(self) -> StatsReply:
        return StatsReply.from_wire(self._call("stats"))

    def job_status(self, jobs: Iterable[int]) -> list[dict]:
        return JobsReply.from_wire(self._call("jobs", jobs=list(jobs))).jobs

    def abort(self, job: int) -> None:
        self._call("abort", job=job)

    @staticmethod
    def _store_hints(chain: bool, cold_tail: int) -> dict:
        """The store request's optional fields, sent only when they differ from the defaults."""
        hints: dict = {} if chain else {"chain": False}
        if cold_tail:
            hints["cold_tail"] = cold_tail
        return hints

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Finish what is in flight (the role's ``_finish_all``), say bye, let go of everything."""
        if self.channel is None:
            return
        try:
            self._finish_all()
            self.channel.call("bye")
        except KvtierError:
            pass
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            self._release_resources()
            self.channel.close()
            self.channel = None

    def _finish_all(self) -> None:
        """Before bye: finish the role's jobs in flight."""

    def _release_resources(self) -> None:
        """After bye: the role's resources (copier, mapping)."""

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Attachments: the engines attached to the daemon and their sessions — the one table of each —
and the rules by which a session joins an engine. No sockets, no liveness (``kvtierd.sessions``
watches the sessions' processes and connections), no jobs (``kvtierd.jobs`` keeps an engine's
jobs on it).

A ``Session`` is one attached client: a rank of an engine (copies and votes) or the engine's
coordinator (rank None: looks up and opens jobs). An ``Engine`` is what its sessions share: its
id, world size and namespace — fixed by its first session, which later ones must match — and who
may join it: the uid of its first session and the digest of the secret it presented, if any.
A writer rank's session has a row in the fence's writer table (``kvtierd.writes``).

An engine whose last session leaves is forgotten (``forget``): a new session of the same id is a
new engine (its job ids may start from 0 again: ``Engine.serial`` keys its tombstones).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .contract.codes import ErrorCode, RequestError
from .contract.namespace import NamespaceId, Sharding
from .namespaces import Namespace
from .processes import Process

if TYPE_CHECKING:
    from .fence import Writer

_ENGINE_SERIALS = itertools.count(1)


class SessionEnd(str, enum.Enum):
    """How a session ended; a rank that ends before it voted aborts the job with ``rank_<end>``."""

    LEFT = "left"                       # bye
    DIED = "died"                       # its pidfd said the process died
    HEARTBEAT_LOST = "heartbeat_lost"   # no request nor heartbeat for heartbeat_timeout
    REHELLO = "rehello"                 # the same socket said hello again
    REATTACHED = "reattached"           # a new hello replaced it, proving it with its token
    TAKEN_OVER = "taken_over"           # the same process attached as the same rank again (an orphan)
    DEAD_AT_HELLO = "dead_at_hello"     # its pid was gone by the time of its hello
    DISCONNECTED = "disconnected"       # the connection it said hello on ended (its process may live on)
    REGION_REPLACED = "region_replaced"  # the data file was truncated under the daemon and replaced
    DAEMON_STOPPED = "daemon_stopped"


@dataclass(eq=False)
class Engine:
    """An attached engine: its sessions by role, and its jobs (the job machine's)."""

    id: str
    world_size: int
    ns: Namespace
    ranks: dict[int, "Session"] = field(default_factory=dict)
    coordinators: set = field(default_factory=set)
    jobs: dict = field(default_factory=dict)        # job id → kvtierd.jobs.Job
    # Who may attach more sessions to it: the uid its first session came from (None without a
    # socket, as in unit tests) and the digest of the secret that session presented, if any.
    uid: int | None = None
    secret: bytes | None = None
    open_keys: int = 0                  # keys (+1 per job) of its open jobs
    # Its tombstones are keyed by this serial, not the id: they go with the engine, since a
    # restarted engine (new sessions, same id) may count job ids from 0 again.
    serial: int = field(default_factory=lambda: next(_ENGINE_SERIALS))

    @property
    def writers(self) -> frozenset[int]:
        if self.ns.id.sharding is Sharding.REPLICATED:
            return frozenset({0})
        return frozenset(range(self.world_size))

    @property
    def sessions(self) -> list["Session"]:
        return [*self.ranks.values(), *self.coordinators]


@dataclass(eq=False)
class Session:
    id: int
    engine: Engine
    rank: int | None            # None: a coordinator (the engine's scheduler process)
    token: int = 0              # proves the session in heartbeats and in a later hello's ``replaces``
    process: Process = Process()
    writer: "Writer | None" = None   # its row in the fence (writer ranks)
    attached_at: float = field(default_factory=time.monotonic)

    @property
    def role(self) -> str:
        return "coordinator" if self.rank is None else f"rank {self.rank}"

    @property
    def pid(self) -> int | None:
        """The pid the daemon sees, else the one the client claimed (for people to read)."""
        return self.process.pid or self.process.claimed_pid


class Attachments:
    """The engines by id and the sessions by id."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.sessions: dict[int, Session] = {}
        self._session_ids = itertools.count(1)

    def attach(self, engine_id: str, rank: int | None, world_size: int, ns_id: NamespaceId, process: Process,
               secret: bytes | None, namespace: Callable[[NamespaceId], Namespace],
               writer: Callable[[int, int, Process, str, int], "Writer"]) -> Session:
        """A new session of ``engine_id`` (a rank, or the coordinator when ``rank`` is None). A new
        engine's namespace comes from ``namespace(ns_id)``; a writer rank's row from
        ``writer(session, token, process, engine, rank)``. Nothing is recorded unless it succeeds."""
        if rank is not None and rank >= world_size:   # before anything is created for the engine
            raise RequestError(ErrorCode.BAD_REQUEST, f"rank {rank} >= world_size {world_size}")
        engine = self.engines.get(engine_id)
        if engine is None:
            engine = Engine(engine_id, world_size, namespace(ns_id), uid=process.uid, secret=_digest(secret))
        else:
            self.may_join(engine_id, process, secret)
        if engine.world_size != world_size or engine.ns.id != ns_id:
            raise RequestError(ErrorCode.LAYOUT_MISMATCH,
                               f"engine {engine_id!r} is attached with world size {engine.world_size} and namespace "
                               f"{engine.ns.id.name()}; this session asks for world size {world_size} and "
                               f"{ns_id.name()}")
        if rank is not None and rank in engine.ranks:
            other = engine.ranks[rank]
            raise RequestError(ErrorCode.LAYOUT_MISMATCH,
                               f"engine {engine_id!r} rank {rank} is already attached (session {other.id}, "
                               f"pid {other.pid}); every rank attaches once")
        session_id, token = next(self._session_ids), secrets.randbits(62)
        row = writer(session_id, token, process, engine_id, rank) if rank in engine.writers else None
        if engine_id not in self.engines:
            self.engines[engine_id] = engine
            engine.ns.users += 1
        session = Session(session_id, engine, rank, token, process, row)
        if rank is None:
            engine.coordinators.add(session)
        else:
            engine.ranks[rank] = session
        self.sessions[session.id] = session
        return session

    def may_join(self, engine_id: str, process: Process, secret: bytes | None) -> None:
        """Raise FORBIDDEN unless a session of ``process`` presenting ``secret`` may join engine
        ``engine_id`` (if attached): it must come from the uid of the engine's first session (the
        peer's, as the kernel reports it) and present the same secret (or none, if the first had
        none). A process taking over its own orphaned rank passes this first, like any other."""
        engine = self.engines.get(engine_id)
        if engine is None:
            return
        if engine.uid != process.uid:
            raise RequestError(ErrorCode.FORBIDDEN, f"engine {engine_id!r} is attached from uid {engine.uid}; a "
                                                    f"session from uid {process.uid} cannot join it (choose another "
                                                    "engine id)")
        digest = _digest(secret)
        if not hmac.compare_digest(engine.secret or b"", digest or b""):
            raise RequestError(ErrorCode.FORBIDDEN, f"engine {engine_id!r} was attached with "
                               f"{'a secret' if engine.secret else 'no secret'} and this session presents "
                               f"{'another' if digest else 'none'}: every session of an engine presents the same "
                               "one (Client(engine_secret=...), KVTIER_ENGINE_SECRET)")

    def rank_holder(self, engine_id: str, rank: int | None) -> Session | None:
        """The session attached as ``rank`` of ``engine_id``, if any."""
        engine = self.engines.get(engine_id)
        return None if engine is None or rank is None else engine.ranks.get(rank)

    def leave(self, session: Session) -> bool:
        """The session leaves its engine; False if it had left already."""
        if self.sessions.pop(session.id, None) is None:
            return False
        if session.rank is None:
            session.engine.coordinators.discard(session)
        else:
            session.engine.ranks.pop(session.rank, None)
        return True

    def forget(self, engine: Engine) -> None:
        """An engine whose last session left (its jobs are over)."""
        assert not engine.sessions, "forgetting an engine with sessions"
        del self.engines[engine.id]
        engine.ns.users -= 1

    # ------------------------------------------------------------------ what is going on
    def roles(self) -> dict[str, int]:
        """Sessions by role (``StatsReply.session_roles``)."""
        coordinators = sum(len(e.coordinators) for e in self.engines.values())
        return {"rank": len(self.sessions) - coordinators, "coordinator": coordinators}

    def verify(self, namespaces: list[Namespace]) -> None:
        """The tables against each other and the namespaces' user counts (tests)."""
        engines = self.engines.values()
        for engine in engines:
            assert all(self.sessions.get(s.id) is s and s.engine is engine for s in engine.sessions)
        assert len(self.sessions) == sum(len(e.sessions) for e in engines)
        for ns in namespaces:
            assert ns.users == sum(1 for e in engines if e.ns is ns), f"namespace {ns.slot} user count"


def _digest(secret: bytes | None) -> bytes | None:
    return None if secret is None else hashlib.sha256(secret).digest()

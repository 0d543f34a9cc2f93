"""The wire contract between kvtierd and its clients: the one place that defines it.

Transport: a ZMQ ROUTER socket in the daemon, one DEALER socket per client session, over
``ipc://``. Every message is exactly one frame holding one msgpack map (the ROUTER adds and
strips the routing identity frame; clients never see it).

Request::

    {"op": <str>, "rid": <int, echoed back>, ...fields of the op...}

Reply::

    {"rid": <int>, "ok": True, ...result fields...}
    {"rid": <int>, "ok": False, "code": <ErrorCode int>, "error": <name>, "message": <str>}

Every op's result fields are declared here too, as a ``Reply`` dataclass per op (``REPLIES``,
``ADMIN_REPLIES``): the daemon builds its replies from them and the clients (``kvtier``,
``kvtierctl``, the metrics endpoint) read them through them, so a field renamed on one side
fails at once on the other instead of reading ``None``.

Replies carry page indices, never block bytes: the bytes move through the shared region.
A key's pages travel as ``bytes`` holding little-endian uint32 page indices (``PAGES_DTYPE``),
so that the client turns them into a NumPy array without a Python loop.

Validation happens here, before any handler runs and before anything is allocated for a request:
the frame size is checked before decoding, the decoder is bounded (``decode_request``), and every
field of every op is checked against its ``Field`` spec (type, range, length). A request that
fails any check gets a ``BAD_REQUEST``/``LIMIT`` error naming the field; the daemon keeps serving.
Error texts never quote a value the decoder did not bound (only strings of at most MAX_STR_BYTES
and ints), and ``error_reply`` cuts every message to MAX_ERROR_CHARS: a hostile frame cannot make
the daemon build a reply larger than a few hundred bytes, nor walk a structure it nested 1,000
deep (issue 11: ``repr`` of such an op raised RecursionError).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

import msgpack

from .namespace import MAX_MODEL_BYTES, WIRE_FIELDS

# 2: hello's "layout" map became "namespace", its "kind" field "sharding".
# 3: stats: pages_quarantined became pages_fenced, with fenced_pages by reason, fence releases, the
#    oldest fence's age, the grace and the writer rows (the page fence, issue 10). The region is two
#    files: hello's "region" is the data file, whose header the client checks
#    (region_format.DataHeader); "file_bytes" is that file's size. hello takes a "secret" (issue 11).
# 4: leases (issue 13): lookup may ask for one (lease, ttl_ms) and its reply says what it holds
#    (lease, leased, ttl_ms); load may name one; unlease; admin clear's force, and evict/clear's
#    skipped_leased and revoked_leases; the lease counters in stats, leases per session in clients.
# 5: lookup replies say how many keys after the hits are being promoted from the second tier
#    (pending); evict/clear replies say whether they reached it; stats carry the tier (issue 16).
PROTOCOL_VERSION = 5

# --- limits (enforced before any allocation) ------------------------------------------------
MAX_FRAME_BYTES = 4 * 1024 * 1024      # a request frame larger than this is refused undecoded
MAX_KEYS_PER_REQUEST = 8192            # keys in one lookup/store/load
MAX_KEY_BYTES = 64                     # vLLM keys are 32-byte hashes + a 4-byte group index
MAX_STR_BYTES = 256                    # engine ids, model names, dtype names
MAX_WORLD_SIZE = 64
MAX_JOB_ID = (1 << 63) - 1
MAX_JOBS_PER_QUERY = 4096
MAX_ERROR_CHARS = 512                  # an error reply's message is cut to this many characters
MAX_PID = 1 << 22                      # the kernel's largest pid_max (PID_MAX_LIMIT on 64-bit)
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 16, 64   # an engine secret (hello's ``secret``)
MAX_LEASE_ID = (1 << 63) - 1
MAX_LEASES_PER_UNLEASE = 4096

PAGES_DTYPE = "<u4"                    # page indices on the wire and in the region's chain table


class ErrorCode(enum.IntEnum):
    """Stable error codes. Numbers never change meaning; new codes are appended."""

    BAD_REQUEST = 1       # malformed frame, unknown op, wrong field type or range
    VERSION = 2           # protocol version not supported
    NOT_ATTACHED = 3      # request before hello (or after the session ended)
    LAYOUT_MISMATCH = 4   # engine's sessions disagree on namespace/world size, or rank taken
    CONFLICT = 5          # a job asked with different keys/kind than its first request
    UNKNOWN_JOB = 6       # commit/release/status of a job the daemon does not know
    NO_SPACE = 7          # the region (or its namespace table) cannot take the request at all
    TIMEOUT = 8           # the job ran past its deadline and was aborted
    SHUTTING_DOWN = 9     # the daemon stopped accepting new jobs
    ABORTED = 10          # the job was aborted (failed vote, conflict, dead rank, ...)
    LIMIT = 11            # a protocol limit was exceeded (frame size, keys, key length)
    FORBIDDEN = 12        # the session's role may not do this (e.g. a coordinator voting)
    INTERNAL = 13         # a bug in the daemon; the request was dropped, the daemon lives on


class RequestError(Exception):
    """A request that cannot be served: validation, state or capacity. Becomes an error reply."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


# --- per-key outcomes of a store decision ---------------------------------------------------
class StoreOutcome(enum.IntEnum):
    WRITE = 0      # the job writes this key (the writer ranks get pages for it)
    PRESENT = 1    # already READY, or being written by another job: nothing to do
    NO_SPACE = 2   # did not fit; nor did any later key that needed writing


class JobKind(str, enum.Enum):
    STORE = "store"
    LOAD = "load"
    PROMOTE = "promote"     # the daemon's own: blocks fetched from the second tier (kvtierd.tiering)


class JobState(str, enum.Enum):
    OPEN = "open"
    DONE = "done"
    ABORTED = "aborted"


class AbortCause(str, enum.Enum):
    """Why a job was aborted: the ``cause`` of the jobs reply and of kvtierd_aborted_jobs_total."""

    ABORTED_BY_CLIENT = "aborted_by_client"   # a session of the engine sent abort
    TIMEOUT = "timeout"                       # open past job_timeout
    CONFLICT = "conflict"                     # a request named another kind or other keys
    VOTE_FAILED = "vote_failed"               # a rank committed with ok=False
    ENGINE_LEFT = "engine_left"               # the engine's last session ended
    # A rank's session ended before it voted or released, by how it ended:
    RANK_LEFT = "rank_left"                   # bye
    RANK_DIED = "rank_died"                   # its process died (pidfd)
    RANK_HEARTBEAT_LOST = "rank_heartbeat_lost"
    RANK_REHELLO = "rank_rehello"             # the same socket said hello again
    RANK_REATTACHED = "rank_reattached"       # a new hello replaced the session (with its token)
    RANK_TAKEN_OVER = "rank_taken_over"       # the same process attached as the same rank again
    RANK_DEAD_AT_HELLO = "rank_dead_at_hello"
    RANK_DISCONNECTED = "rank_disconnected"   # its connection ended without bye
    RANK_REGION_REPLACED = "rank_region_replaced"   # the region file was truncated and replaced
    RANK_DAEMON_STOPPED = "rank_daemon_stopped"
    # A promote job (the second tier's companion is its writer):
    TIER_FAILED = "tier_failed"               # the tier's get failed, or the companion died
    TIER_TIMEOUT = "tier_timeout"             # the get was not answered within tier_data_timeout


# --- field specs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field of a request: its type and the check it must pass."""

    kind: str                     # "int", "str", "bool", "bytes", "keys", "map", "ints"
    required: bool = True
    lo: int | None = None         # inclusive bounds for ints / lengths for str and bytes
    hi: int | None = None
    choices: tuple[str, ...] | None = None
    nullable: bool = False
    max_items: int = MAX_JOBS_PER_QUERY   # for "ints" lists


def _int(lo: int, hi: int, **kw: Any) -> Field:
    return Field("int", lo=lo, hi=hi, **kw)


def _str(lo: int = 1, hi: int = MAX_STR_BYTES, **kw: Any) -> Field:
    return Field("str", lo=lo, hi=hi, **kw)


# hello's namespace map: NamespaceId's fields, with the checks it declares for them.
NAMESPACE_FIELDS: dict[str, Field] = {name: Field(**check) for name, check in WIRE_FIELDS.items()}
assert MAX_MODEL_BYTES <= MAX_STR_BYTES, "the bounded decoder must accept a model name of the longest kind"

JOB = _int(0, MAX_JOB_ID)
KEYS = Field("keys")
LEASE = _int(0, MAX_LEASE_ID, required=False)

REQUESTS: dict[str, dict[str, Field]] = {
    # rank is None for a coordinator session (the engine's scheduler: looks up, opens jobs).
    "hello": {
        "version": _int(0, 1 << 31),
        "engine": _str(),
        "rank": _int(0, MAX_WORLD_SIZE - 1, nullable=True),
        "world_size": _int(1, MAX_WORLD_SIZE),
        "namespace": Field("map"),
        # The client's pid and PID-namespace inode: a claim, checked against the socket's peer
        # credentials (a pid in the daemon's own namespace must be the peer's).
        "pid": _int(1, MAX_PID, required=False),
        "pidns": _int(0, 1 << 63, required=False),
        # Binds the engine's sessions together: the first session of an engine fixes it, every
        # later one must present the same (docs/reliability.md, Security).
        "secret": Field("bytes", lo=MIN_SECRET_BYTES, hi=MAX_SECRET_BYTES, required=False),
        # Re-attaching (a lost reply, a daemon restart, a dropped session): end this earlier
        # session, proved by its token, first. It also says that no copy of that session is in
        # flight any more (the client waits for them), so the pages it was handed are free.
        "replaces": _int(0, 1 << 63, required=False),
        "replaces_token": _int(0, 1 << 63, required=False),
    },
    # A heartbeat may come from any socket: session + token (from the hello reply) name the
    # session whose liveness it proves (clients the daemon cannot watch through a pidfd).
    "ping": {"session": _int(0, 1 << 63, required=False), "token": _int(0, 1 << 63, required=False)},
    # bye: the session ends; it says that no copy of the session is in flight (the client waits).
    "bye": {},
    # lease: hold the ready prefix this lookup reports for the engine (kvtierd.leases), under this
    # id (the client's choice, unique per engine while live; a live id is renewed: replaced at once);
    # ttl_ms: for how long (the daemon clamps it; default its lease_ttl setting).
    "lookup": {"keys": KEYS, "lease": LEASE, "ttl_ms": _int(0, 1 << 40, required=False)},
    # chain (default true): the keys are a prefix chain in the order given, each extending the one
    # before (the eviction policy evicts a chain's tail before its head); false for unrelated keys.
    # cold_tail: how many of the last keys the client expects no reuse of (a partial last block,
    # decode-phase blocks of a finished request): the policy may place them first in line for
    # eviction. Only a job's first request sets them, as it sets the decision (invariant 4).
    "store": {"job": JOB, "keys": KEYS, "chain": Field("bool", required=False),
              "cold_tail": _int(0, MAX_KEYS_PER_REQUEST, required=False)},
    # checksums: with the daemon's checksums setting on, a writer sends the xxh64 of its shard of
    # each WRITE key (in key order) after its copy (region_format.shard_checksum).
    "commit": {"job": JOB, "ok": Field("bool"), "checksums": Field("ints", lo=0, hi=(1 << 64) - 1, required=False,
                                                                      max_items=MAX_KEYS_PER_REQUEST)},
    # lease: a lease of the engine this job consumes; its first request pins the job's ready prefix,
    # then ends the lease (its keys were held all along, so a load of leased keys is never short).
    "load": {"job": JOB, "keys": KEYS, "lease": LEASE},
    # Ends the engine's leases of these ids (those not live are ignored).
    "unlease": {"leases": Field("ints", lo=0, hi=MAX_LEASE_ID, max_items=MAX_LEASES_PER_UNLEASE)},
    "release": {"job": JOB},
    "abort": {"job": JOB},
    "jobs": {"jobs": Field("ints", lo=0, hi=MAX_JOB_ID)},
    "stats": {},
}

# Ops that need an attached session (everything but hello and stats).
SESSIONLESS_OPS = frozenset({"hello", "stats", "ping"})

# Operator operations, served only on the admin socket (<dir>/<name>.admin.sock, mode 0600: the
# daemon's user alone). A namespace is named as in stats (NamespaceId.name()); None = all.
ADMIN_REQUESTS: dict[str, dict[str, Field]] = {
    "stats": {},
    "ping": {},
    "clients": {},
    # Evict up to `count` evictable entries (of one namespace, or any), the policy's first victims.
    "evict": {"namespace": _str(nullable=True, required=False), "count": _int(1, 1 << 40)},
    # Evict every evictable entry of a namespace (or of all); pinned, leased and WRITING ones stay.
    # force: revoke the leases in it first (their loads then come back short), so leased ones go too.
    "clear": {"namespace": _str(nullable=True, required=False), "force": Field("bool", required=False)},
}


# --- encode / decode ------------------------------------------------------------------------
_packer = msgpack.Packer(use_bin_type=True)


def encode(message: dict[str, Any]) -> bytes:
    return _packer.pack(message)


KeysCheck = Callable[[Any], bool]


def decode_request(frame: bytes, ops: dict[str, dict[str, Field]] = REQUESTS,
                   keys_ok: KeysCheck | None = None) -> dict[str, Any]:
    """Decode one request frame with every msgpack length bounded, then validate it against
    ``ops`` (REQUESTS on the client socket, ADMIN_REQUESTS on the admin socket).

    ``keys_ok``: a faster proof that a keys field is valid (a list of at most
    MAX_KEYS_PER_REQUEST distinct bytes of 1..MAX_KEY_BYTES), which may only say True of lists
    that ``_check_keys`` accepts; when it says False, ``_check_keys`` judges and names the fault.
    The daemon passes its compiled one (kvtierd._native.keys_ok); this module stays pure Python.

    Raises RequestError; never anything else for any input bytes.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise RequestError(ErrorCode.LIMIT, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=max(MAX_KEYS_PER_REQUEST, MAX_JOBS_PER_QUERY),
            max_map_len=32,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, ...)
        if isinstance(exc, ValueError) and "exceeds max_array_len" in str(exc):
            # Too many keys/jobs: the bounded decoder refuses the array before the field check can.
            raise RequestError(ErrorCode.LIMIT, f"too many items: a request holds at most {MAX_KEYS_PER_REQUEST} "
                               f"keys ({MAX_JOBS_PER_QUERY} jobs)") from None
        raise RequestError(ErrorCode.BAD_REQUEST, f"undecodable msgpack frame: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, "request must be a msgpack map")
    try:
        return _validate(msg, ops, keys_ok)
    except RequestError:
        raise
    except Exception as exc:  # a check that failed in a way nobody foresaw: the request's error, nothing more
        raise RequestError(ErrorCode.BAD_REQUEST, f"malformed request ({type(exc).__name__})") from None


def _validate(msg: dict[str, Any], ops: dict[str, dict[str, Field]], keys_ok: KeysCheck | None = None) -> dict[str, Any]:
    op = msg.get("op")
    if type(op) is not str:
        # Never repr() the value: it may be a structure nested 1,000 deep, or megabytes long.
        raise RequestError(ErrorCode.BAD_REQUEST, f"field 'op' must be a string, got {type(op).__name__}")
    if op not in ops:
        if ops is REQUESTS and op in ADMIN_REQUESTS:
            raise RequestError(ErrorCode.FORBIDDEN, f"{op} is an admin operation: use the admin socket")
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown op {op!r}")   # a str of <= MAX_STR_BYTES
    rid = msg.get("rid", 0)
    if type(rid) is not int or not 0 <= rid < (1 << 63):
        raise RequestError(ErrorCode.BAD_REQUEST, "field 'rid' must be a non-negative int")
    validate_fields(op, msg, ops[op], keys_ok)
    if op == "hello":
        validate_fields("hello.namespace", msg["namespace"], NAMESPACE_FIELDS)
        if msg["rank"] is not None and msg["rank"] >= msg["world_size"]:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"field 'hello.rank'={msg['rank']} must be < world_size {msg['world_size']}")
    return msg


def request_id(frame: bytes) -> int:
    """Best-effort request id of a frame that failed validation, so the error can be matched.

    Reads the top-level map one entry at a time and skips (without building) every value but
    ``rid``, so a request refused for its size (too many keys, an oversize key, a frame over
    MAX_FRAME_BYTES) still gets its error back under its own id. 0 when none can be read.
    """
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME_BYTES, max_str_len=MAX_STR_BYTES,
                                    max_bin_len=MAX_KEY_BYTES, max_array_len=16, max_map_len=32, max_ext_len=0)
        unpacker.feed(frame[:MAX_FRAME_BYTES])
        for _ in range(min(unpacker.read_map_header(), 32)):
            if unpacker.unpack() == "rid":
                rid = unpacker.unpack()
                return rid if type(rid) is int and 0 <= rid < (1 << 63) else 0
            unpacker.skip()
        return 0
    except Exception:
        return 0


def _check_int(name: str, value: Any, lo: int | None, hi: int | None) -> None:
    # bool is a subclass of int in Python; a bool is not a valid integer field.
    if type(value) is not int:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be an int, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r}={value} out of range [{lo}, {hi}]")


def _all_bytes(items: list) -> bool:
    """Whether every item is bytes-like, in one C-level pass."""
    try:
        b"".join(items)
    except TypeError:
        return False
    return True


def _check_keys(name: str, value: Any) -> None:
    if not isinstance(value, list):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a list of bytes")
    if len(value) > MAX_KEYS_PER_REQUEST:
        raise RequestError(ErrorCode.LIMIT, f"{len(value)} keys exceed the limit of {MAX_KEYS_PER_REQUEST}")
    # The common case (every key bytes, of a valid length) is proved by C-level passes over the
    # list: a per-key Python loop was a third of a 256-key lookup's time in the daemon. b"".join
    # accepts only bytes-like items, and bytes is the only bytes-like type msgpack decodes to.
    # Only a list that fails is walked key by key, to name the first bad key.
    if value and not (_all_bytes(value) and 0 < min(lengths := set(map(len, value)))
                      and max(lengths) <= MAX_KEY_BYTES):
        for key in value:
            if type(key) is not bytes:
                raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must hold only bytes keys")
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise RequestError(ErrorCode.LIMIT, f"key of {len(key)} bytes; keys must be 1..{MAX_KEY_BYTES} bytes")
    if len(set(value)) != len(value):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} holds duplicate keys")


_CHECKS: dict[str, Callable[[str, Any, Field], None]] = {}


def _register(kind: str) -> Callable[[Callable[[str, Any, Field], None]], Callable[[str, Any, Field], None]]:
    def deco(fn: Callable[[str, Any, Field], None]) -> Callable[[str, Any, Field], None]:
        _CHECKS[kind] = fn
        return fn
    return deco


@_register("int")
def _(name: str, value: Any, spec: Field) -> None:
    _check_int(name, value, spec.lo, spec.hi)


@_register("str")
def _(name: str, value: Any, spec: Field) -> None:
    if type(value) is not str:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a string")
    if spec.choices is not None and value not in spec.choices:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r}={value!r} not one of {list(spec.choices)}")
    # The region's fixed-width fields drop trailing NULs, so "m\0" would come back from a restart
    # as "m", another engine's namespace: no control characters in any protocol string.
    if not value.isprintable():
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} holds a control character (NUL, newline, "
                                                  "...); protocol strings are printable text")
    n = len(value.encode())
    if spec.lo is not None and not spec.lo <= n <= (spec.hi or MAX_STR_BYTES):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be {spec.lo}..{spec.hi} bytes long")


@_register("bytes")
def _(name: str, value: Any, spec: Field) -> None:
    if type(value) is not bytes:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be bytes")
    if not spec.lo <= len(value) <= spec.hi:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be {spec.lo}..{spec.hi} bytes long")


@_register("bool")
def _(name: str, value: Any, spec: Field) -> None:
    if type(value) is not bool:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a bool")


@_register("map")
def _(name: str, value: Any, spec: Field) -> None:
    if not isinstance(value, dict):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a map")


@_register("keys")
def _(name: str, value: Any, spec: Field) -> None:
    _check_keys(name, value)


@_register("ints")
def _(name: str, value: Any, spec: Field) -> None:
    if not isinstance(value, list):
        raise RequestError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a list of ints")
    if len(value) > spec.max_items:
        raise RequestError(ErrorCode.LIMIT, f"{len(value)} items exceed the limit of {spec.max_items}")
    for item in value:
        _check_int(name, item, spec.lo, spec.hi)


def validate_fields(op: str, msg: dict[str, Any], spec: dict[str, Field], keys_ok: KeysCheck | None = None) -> None:
    """Check every declared field of ``msg``; unknown extra fields are ignored (forward compat).
    ``keys_ok``: see ``decode_request``."""
    for name, field in spec.items():
        if name not in msg:
            if field.required:
                raise RequestError(ErrorCode.BAD_REQUEST, f"{op}: missing field {name!r}")
            continue
        value = msg[name]
        if value is None and field.nullable:
            continue
        if field.kind == "keys" and keys_ok is not None and keys_ok(value):
            continue
        _CHECKS[field.kind](f"{op}.{name}", value, field)


# --- replies --------------------------------------------------------------------------------
R = TypeVar("R", bound="Reply")


class Reply:
    """A declared reply shape: its dataclass fields are exactly the op's result fields.

    ``to_wire`` gives the map of its fields (``ok_reply`` adds rid and ok); ``from_wire``
    reads one on the client side, refusing a reply that lacks a declared field.
    """

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        """The fields as a map (each shape gets its own, generated by ``_shape``)."""
        raise NotImplementedError

    @classmethod
    def from_wire(cls: type[R], reply: dict[str, Any]) -> R:
        try:
            return cls(**{name: reply[name] for name in cls.FIELDS})
        except KeyError as exc:
            raise ValueError(f"malformed reply from kvtierd: {cls.__name__} lacks field {exc.args[0]!r} "
                             "(client and daemon speak different protocols)") from None


def _shape(cls: type[R]) -> type[R]:
    cls = dataclass(slots=True)(cls)
    cls.FIELDS = tuple(f.name for f in dataclasses.fields(cls))
    # The daemon builds one reply per request: a generated to_wire (a dict display of the fields,
    # as dataclass generates __init__) takes 0.12 µs where a loop over FIELDS took 0.55 (measured).
    body = ", ".join(f"{name!r}: self.{name}" for name in cls.FIELDS)
    code: dict[str, Any] = {}
    exec(f"def to_wire(self):\n    return {{{body}}}\n", code)
    cls.to_wire = code["to_wire"]
    return cls


@_shape
class EmptyReply(Reply):
    """bye, commit, release, abort: success carries nothing."""


@_shape
class HelloReply(Reply):
    session: int                      # the session id (heartbeats and a later hello's ``replaces`` name it)
    version: int                      # PROTOCOL_VERSION
    daemon_pid: int
    region: str                       # the region file to map
    generation: int                   # changes whenever the region is rebuilt: remap when it does
    file_bytes: int
    page_size: int
    num_pages: int
    data_offset: int
    namespace: str                    # NamespaceId.name() of the engine's namespace
    pages_per_shard: int              # pages of one rank's shard of one block
    writers: list                     # the ranks that copy into the region (rank 0, or all when sharded)
    job_timeout: float
    watched: bool                     # True: the daemon watches the pid; False: send heartbeats
    token: int                        # proves the session in heartbeats and in ``replaces_token``
    heartbeat_interval: float | None  # seconds between heartbeats (None when watched)
    checksums: bool                   # writers send the checksum of their shards with commit


@_shape
class PingReply(Reply):
    generation: int
    attached: bool                    # the request came from (or named) an attached session


@_shape
class LookupReply(Reply):
    hits: int                         # how many leading keys are READY
    lease: int | None                 # the lease now holding them (None: none asked, or none held)
    leased: int                       # how many leading hits the lease holds (fewer: the caps)
    ttl_ms: int                       # for how long from now (0: no lease)
    pending: int                      # how many keys after them are being promoted from the second tier:
                                      # ask again later instead of computing them (0 without a tier)


@_shape
class UnleaseReply(Reply):
    released: int                     # how many of the ids named a live lease


@_shape
class StoreReply(Reply):
    outcomes: bytes                   # one StoreOutcome byte per key
    pages: bytes                      # PAGES_DTYPE: this rank's pages of every WRITE key, in key order


@_shape
class LoadReply(Reply):
    hits: int                         # the leading READY keys, pinned for the job
    pages: bytes                      # PAGES_DTYPE: this rank's pages of every hit, in key order


@_shape
class JobsReply(Reply):
    jobs: list                        # per job: {job, state[, kind, waiting | cause]}


@_shape
class StatsReply(Reply):
    """Everything ``kvtierctl stats`` and the metrics endpoint show (docs/operations.md)."""

    # occupancy
    capacity_bytes: int
    page_size: int
    pages_total: int
    pages_free: int
    pages_used: int                   # held by entries or fenced
    pages_fenced: int                 # held by no entry, kept for a writer that may still copy into them
    fenced_pages: dict                # fence.Reason value (writer_alive, restart_recovery, grace) → pages
    fence_released_pages: dict        # fence.Release value (committed, left, reattached, died, grace) → pages
    fence_oldest_seconds: float       # since the longest-fenced writer's pages were fenced (0: none)
    fence_grace_seconds: float        # the fence_grace setting
    writer_rows: int                  # rows in the writer table: writers attached or gone with pages fenced
    used_bytes: int
    entries_ready: int
    entries_writing: int
    entries_pinned: int
    evictable: int
    namespaces: int
    engines: int
    sessions: int
    open_jobs: int
    open_job_keys: int                # keys (+1 per job) of the open jobs (bounded by max_job_keys)
    tombstones: int                   # finished job ids remembered (bounded by max_tombstones)
    aborted_jobs: dict                # AbortCause value → jobs
    # leases (kvtierd.leases)
    leases_open: int
    entries_leased: int               # READY entries held by at least one lease
    leased_keys: int                  # entries in open leases, counted per lease (what the caps count, less 1 each)
    leases_granted: int               # leases granted or renewed
    lease_ends: dict                  # leases.LeaseEnd value (consumed, released, replaced, ...) → leases
    lease_missed_loads: int           # load jobs that named a lease that was not live
    lease_capped_keys: int            # hits not leased because of max_leased_keys(_per_engine)
    vote_wait: dict                   # histogram snapshot: first request of a store job → its last vote
    # monotonic counters
    lookup_hit_keys: int
    lookup_miss_keys: int
    store_written_keys: int
    store_present_keys: int
    store_no_space_keys: int
    store_aborted_keys: int           # keys a store job was writing when it aborted
    store_jobs_done: int
    load_hit_keys: int
    load_miss_keys: int
    load_jobs_done: int
    evictions: int                    # entries evicted to make room for a store
    operator_evictions: int           # entries evicted by kvtierctl evict/clear
    # the eviction policy (setting policy; kvtierd.policy.PolicyStats)
    policy: str                       # its name
    policy_admitted_keys: int         # stored keys that entered the policy as any other
    policy_refused_keys: int          # stored keys placed first in line for eviction instead
    policy_segments: dict             # segment -> evictable entries in it now
    policy_evictions: dict            # segment -> entries evicted from it (room and operator)
    policy_extra: dict                # the policy's own counters (promotions, sketch bytes, ...)
    bytes_written: int                # bytes copied into the region (D2H), all shards
    bytes_saved_dedup: int            # bytes replicated ranks did not have to copy
    # the server and the region
    namespace_list: list              # per namespace: {slot, name, entries, entry_pages}
    session_roles: dict               # {"rank": n, "coordinator": n}
    requests: dict                    # op → requests
    errors: dict                      # ErrorCode name → error replies
    latency: dict                     # op → histogram snapshot of the time to handle one request
    clients_watched: int
    uptime_seconds: float
    region: str
    socket: str
    admin_socket: str
    metrics_address: str | None
    generation: int
    pinned: str                       # cuda | mlock | off
    hugepages: str                    # hugetlb | thp | none: the region's pages in the daemon's mapping at start
    huge_page_size: int               # bytes of one of its huge pages (the OS page when none)
    huge_bytes: int                   # bytes of the region mapped by huge pages at start
    file_bytes: int
    daemon_pid: int
    stopping: bool
    region_problem: str | None        # removed | replaced by another file | truncated
    sessions_heartbeat: int
    checksums: bool
    connections: int                  # open connections to the client socket
    connections_refused: dict         # why connections were closed at once (total | per_peer) → count
    tier: dict                        # the second tier: {"backend": "off"} or its state and counters
                                      # (kvtierd.tiering.Tiering.stats; docs/operations.md)


@_shape
class AdminPingReply(Reply):
    generation: int


@_shape
class ClientsReply(Reply):
    clients: list                     # per session: {session, engine, role, rank, pid, world_size, namespace,
                                      #   watched, attached_seconds, leases, leased_keys}


@_shape
class EvictReply(Reply):
    evicted: int
    skipped_leased: int               # leased entries in scope that were left (when evictable ones ran out)
    revoked_leases: int               # leases ended first (clear --force)
    tier: str                         # whether it reached the second tier: off | local (evict never does) |
                                      # excluded | removed | failed
    tier_removed: int | None          # blocks the second tier removed (clear, tier "removed"), else None


REPLIES: dict[str, type[Reply]] = {
    "hello": HelloReply, "ping": PingReply, "bye": EmptyReply, "lookup": LookupReply, "store": StoreReply,
    "commit": EmptyReply, "load": LoadReply, "unlease": UnleaseReply, "release": EmptyReply, "abort": EmptyReply,
    "jobs": JobsReply, "stats": StatsReply,
}
ADMIN_REPLIES: dict[str, type[Reply]] = {
    "stats": StatsReply, "ping": AdminPingReply, "clients": ClientsReply, "evict": EvictReply, "clear": EvictReply,
}
assert REPLIES.keys() == REQUESTS.keys() and ADMIN_REPLIES.keys() == ADMIN_REQUESTS.keys()


def ok_reply(rid: int, reply: Reply) -> dict[str, Any]:
    fields = reply.to_wire()
    fields["rid"] = rid
    fields["ok"] = True
    return fields


def error_reply(rid: int, code: ErrorCode, message: str, **fields: Any) -> dict[str, Any]:
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS - 3] + "..."
    fields.update(rid=rid, ok=False, code=int(code), error=ErrorCode(code).name, message=message)
    return fields


def decode_reply(frame: bytes) -> dict[str, Any]:
    """Decode a reply on the client side (the daemon is trusted, but a reply must be a map)."""
    msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    if not isinstance(msg, dict) or "ok" not in msg:
        raise ValueError("malformed reply from kvtierd")
    return msg

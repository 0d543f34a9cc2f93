"""The wire between kvtierd and its clients: transport, version, limits, the requests and their checks.

Transport: a ZMQ ROUTER socket in the daemon, one DEALER socket per client session, over
``ipc://``. Every message is exactly one frame holding one msgpack map (the ROUTER adds and
strips the routing identity frame; clients never see it).

Request::

    {"op": <str>, "rid": <int, echoed back>, ...fields of the op...}

Reply::

    {"rid": <int>, "ok": True, ...result fields...}
    {"rid": <int>, "ok": False, "code": <ErrorCode int>, "error": <name>, "message": <str>}

Each op's result fields are declared in ``replies`` (a ``Reply`` dataclass per op), the error
codes and the other enumerations of the wire in ``codes``; this module holds the version, the
limits, the request side (each op's fields and their checks) and the framing.

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

from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from .codes import ErrorCode, RequestError
from .events import MAX_EVENT_KEYS
from .namespace import MAX_MODEL_BYTES, MAX_RANKS, WIRE_FIELDS, format_ranks

# 2: hello's "layout" map became "namespace", its "kind" field "sharding".
# 3: stats: pages_quarantined became pages_fenced, with fenced_pages by reason, fence releases, the
#    oldest fence's age, the grace and the writer rows (the page fence, issue 10). The region is two
#    files: hello's "region" is the data file, whose header the client checks
#    (region_view.DataHeader); "file_bytes" is that file's size. hello takes a "secret" (issue 11).
# 4: leases (issue 13): lookup may ask for one (lease, ttl_ms) and its reply says what it holds
#    (lease, leased, ttl_ms); load may name one; unlease; admin clear's force, and evict/clear's
#    skipped_leased and revoked_leases; the lease counters in stats, leases per session in clients.
# 5: lookup replies say how many keys after the hits are being promoted from the second tier
#    (pending); evict/clear replies say whether they reached it; stats carry the tier (issue 16).
# 6: hello's node_ranks: the ranks of the world that share this daemon (an engine that spans
#    nodes); the hello reply echoes them (issue 25). The events op: a coordinator session reads
#    its namespace's event log after a cursor (what became READY and what left,
#    kvtierd.eventlog); stats carry the log's counters (issue 23).
PROTOCOL_VERSION = 6
# The oldest protocol a daemon still serves. A version-5 client sends no node_ranks (every rank
# of its world is on this node) and never asks for events: it is served as before, for one
# release, so that daemons can be upgraded before their engines (it is logged as outdated).
MIN_PROTOCOL_VERSION = 5

# --- limits (enforced before any allocation) ------------------------------------------------
MAX_FRAME_BYTES = 4 * 1024 * 1024      # a request frame larger than this is refused undecoded
MAX_KEYS_PER_REQUEST = 8192            # keys in one lookup/store/load
MAX_KEY_BYTES = 64                     # vLLM keys are 32-byte hashes + a 4-byte group index
MAX_STR_BYTES = 256                    # engine ids, model names, dtype names
MAX_WORLD_SIZE = MAX_RANKS
MAX_JOB_ID = (1 << 63) - 1
MAX_JOBS_PER_QUERY = 4096
MAX_ERROR_CHARS = 512                  # an error reply's message is cut to this many characters
MAX_PID = 1 << 22                      # the kernel's largest pid_max (PID_MAX_LIMIT on 64-bit)
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 16, 64   # an engine secret (hello's ``secret``)
MAX_LEASE_ID = (1 << 63) - 1
MAX_LEASES_PER_UNLEASE = 4096
MAX_REQUEST_FIELDS = 32                # entries in a request's map
MAX_REQUEST_ID = (1 << 63) - 1

PAGES_DTYPE = "<u4"                    # page indices on the wire and in the region's chain table


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
        # The ranks of the world that attach to this daemon: the engine's ranks on this node, when
        # it spans nodes (each node's daemon serves its own ranks; absent: all of them). Every
        # session of the engine on this daemon names the same ones; a rank session is one of them.
        "node_ranks": Field("ints", lo=0, hi=MAX_WORLD_SIZE - 1, required=False, max_items=MAX_WORLD_SIZE),
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
    # each WRITE key (in key order) after its copy (region_sums.shard_checksum).
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
    # A coordinator session reads its namespace's event log (kvtierd.eventlog): the records after
    # ``cursor`` of log ``epoch`` (both None, or a cursor the log cannot continue: the reply resets
    # the reader onto a snapshot), the snapshot page from entry slot ``snapshot_from`` while one is
    # in progress, at most about ``max_keys`` keys of records and as many of snapshot.
    "events": {"epoch": _int(0, 1 << 63, nullable=True, required=False),
               "cursor": _int(0, 1 << 63, nullable=True, required=False),
               "snapshot_from": _int(0, 1 << 32, nullable=True, required=False),
               "max_keys": _int(1, MAX_EVENT_KEYS, required=False)},
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
            max_map_len=MAX_REQUEST_FIELDS,
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
    if type(rid) is not int or not 0 <= rid <= MAX_REQUEST_ID:
        raise RequestError(ErrorCode.BAD_REQUEST, "field 'rid' must be a non-negative int")
    validate_fields(op, msg, ops[op], keys_ok)
    if op == "hello":
        validate_fields("hello.namespace", msg["namespace"], NAMESPACE_FIELDS)
        if msg["rank"] is not None and msg["rank"] >= msg["world_size"]:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"field 'hello.rank'={msg['rank']} must be < world_size {msg['world_size']}")
        if "node_ranks" in msg:
            _check_node_ranks(msg["node_ranks"], msg["rank"], msg["world_size"])
    return msg


def _check_node_ranks(ranks: list[int], rank: int | None, world_size: int) -> None:
    """hello's node_ranks: distinct ranks of the world, the session's own among them."""
    if not ranks or len(set(ranks)) != len(ranks) or max(ranks) >= world_size:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field 'hello.node_ranks' must name distinct ranks below "
                                                  f"world_size {world_size}, at least one")
    if rank is not None and rank not in ranks:
        raise RequestError(ErrorCode.BAD_REQUEST, f"field 'hello.node_ranks'={format_ranks(ranks)} does not hold "
                                                  f"this session's rank {rank}: a rank attaches to its own node's "
                                                  "kvtierd")


def request_id(frame: bytes) -> int:
    """Best-effort request id of a frame that failed validation, so the error can be matched.

    Reads the top-level map one entry at a time and skips (without building) every value but
    ``rid``, so a request refused for its size (too many keys, an oversize key, a frame over
    MAX_FRAME_BYTES) still gets its error back under its own id. 0 when none can be read.
    """
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME_BYTES, max_str_len=MAX_STR_BYTES,
                                    max_bin_len=MAX_KEY_BYTES, max_array_len=16, max_map_len=MAX_REQUEST_FIELDS, max_ext_len=0)
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

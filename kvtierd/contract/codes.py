"""The wire's enumerations: numbers and strings whose meaning never changes once shipped.

The error codes of error replies (``ErrorCode``; ``RequestError`` carries one through the daemon
until it becomes an error reply; the client's typed exceptions in ``errors`` map them back), the
per-key outcomes of a store decision, and the kinds, states and abort causes of jobs. New members
are appended; none is renumbered or renamed.
"""

from __future__ import annotations

import enum


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
    SHUTTING_DOWN = 9     # the daemon is stopping: no new sessions, jobs or leases
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

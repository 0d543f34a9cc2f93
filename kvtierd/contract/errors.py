"""Typed exceptions: one per protocol error code, and a distinct one when the daemon is gone.

``KvtierError`` is the base of everything the client raises on purpose (``kvtier`` re-exports
them all). Errors the daemon sent
are ``DaemonError`` subclasses carrying the wire ``code``; ``DaemonUnavailable`` means no answer
came at all (daemon stopped, crashed or unreachable), which an engine treats as a cache miss.
"""

from __future__ import annotations

from .codes import ErrorCode


class KvtierError(Exception):
    """Base of all kvtier client errors."""


class DaemonUnavailable(KvtierError):
    """kvtierd did not answer (not running, crashed, or the socket is unreachable)."""


class AccessDenied(DaemonUnavailable):
    """This process may not open the socket: not a member of the daemon's client group, or the
    admin socket of another user."""


class DaemonError(KvtierError):
    """kvtierd answered with an error; ``code`` is the wire ErrorCode."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadRequest(DaemonError):
    code = ErrorCode.BAD_REQUEST


class VersionMismatch(DaemonError):
    code = ErrorCode.VERSION


class NotAttached(DaemonError):
    code = ErrorCode.NOT_ATTACHED


class LayoutMismatch(DaemonError):
    code = ErrorCode.LAYOUT_MISMATCH


class Conflict(DaemonError):
    code = ErrorCode.CONFLICT


class UnknownJob(DaemonError):
    code = ErrorCode.UNKNOWN_JOB


class NoSpace(DaemonError):
    code = ErrorCode.NO_SPACE


class JobTimeout(DaemonError):
    code = ErrorCode.TIMEOUT


class ShuttingDown(DaemonError):
    code = ErrorCode.SHUTTING_DOWN


class JobAborted(DaemonError):
    code = ErrorCode.ABORTED


class LimitExceeded(DaemonError):
    code = ErrorCode.LIMIT


class Forbidden(DaemonError):
    code = ErrorCode.FORBIDDEN


class InternalError(DaemonError):
    code = ErrorCode.INTERNAL


BY_CODE: dict[int, type[DaemonError]] = {cls.code: cls for cls in DaemonError.__subclasses__()}
assert set(BY_CODE) == set(ErrorCode), "every ErrorCode needs its exception class"


def from_reply(reply: dict) -> DaemonError:
    code = reply.get("code")
    cls = BY_CODE.get(code, DaemonError)
    try:
        code = ErrorCode(code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return cls(f"{reply.get('error', code.name)}: {reply.get('message', '')}", code)

"""kvtierd.contract.errors (re-exported by kvtier): one exception class per wire ErrorCode; 'daemon
gone' is a different kind of error."""

from __future__ import annotations

import pytest

import kvtier
from kvtierd.contract import errors as E
from kvtierd.contract import protocol as P
from kvtierd.contract.replies import decode_reply, error_reply
from kvtierd.contract.codes import ErrorCode

EXPECTED = {
    ErrorCode.BAD_REQUEST: E.BadRequest, ErrorCode.VERSION: E.VersionMismatch, ErrorCode.NOT_ATTACHED: E.NotAttached,
    ErrorCode.LAYOUT_MISMATCH: E.LayoutMismatch, ErrorCode.CONFLICT: E.Conflict, ErrorCode.UNKNOWN_JOB: E.UnknownJob,
    ErrorCode.NO_SPACE: E.NoSpace, ErrorCode.TIMEOUT: E.JobTimeout, ErrorCode.SHUTTING_DOWN: E.ShuttingDown,
    ErrorCode.ABORTED: E.JobAborted, ErrorCode.LIMIT: E.LimitExceeded, ErrorCode.FORBIDDEN: E.Forbidden,
    ErrorCode.INTERNAL: E.InternalError,
}


def test_every_code_has_its_own_class():
    assert set(EXPECTED) == set(ErrorCode)
    classes = [E.BY_CODE[c] for c in ErrorCode]
    assert len(set(classes)) == len(classes)
    for code, cls in EXPECTED.items():
        assert E.BY_CODE[code] is cls
        assert cls.code is code


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_from_reply(code):
    reply = decode_reply(P.encode(error_reply(9, code, "what went wrong")))
    exc = E.from_reply(reply)
    assert type(exc) is EXPECTED[code]
    assert isinstance(exc, E.DaemonError) and isinstance(exc, E.KvtierError)
    assert exc.code is code
    assert code.name in str(exc) and "what went wrong" in str(exc)
    with pytest.raises(EXPECTED[code]):
        raise exc


def test_from_reply_with_an_unknown_or_missing_code():
    exc = E.from_reply({"ok": False, "code": 999, "message": "from the future"})
    assert type(exc) is E.DaemonError
    assert exc.code is ErrorCode.INTERNAL
    assert "from the future" in str(exc)
    exc = E.from_reply({"ok": False})
    assert type(exc) is E.DaemonError and exc.code is ErrorCode.INTERNAL


def test_daemon_unavailable_is_not_a_daemon_error():
    exc = E.DaemonUnavailable("no answer")
    assert isinstance(exc, E.KvtierError)
    assert not isinstance(exc, E.DaemonError)
    assert not issubclass(E.DaemonUnavailable, E.DaemonError)
    assert E.DaemonUnavailable not in E.BY_CODE.values()
    with pytest.raises(E.DaemonUnavailable):
        try:
            raise exc
        except E.DaemonError:          # a handler for daemon errors must not swallow it
            pytest.fail("DaemonUnavailable caught as DaemonError")


def test_daemon_error_code_override():
    assert E.Conflict("x").code is ErrorCode.CONFLICT
    assert E.DaemonError("x", ErrorCode.LIMIT).code is ErrorCode.LIMIT
    assert E.DaemonError("x").code is ErrorCode.INTERNAL


def test_exported_from_package():
    for cls in list(EXPECTED.values()) + [E.DaemonUnavailable, E.DaemonError, E.KvtierError]:
        assert getattr(kvtier, cls.__name__) is cls

"""kvtier: the client library that inference workers link in to use a kvtierd shared KV tier.

It needs pyzmq, msgpack, numpy and (for the tensor API) torch; it never imports the daemon-only
dependencies (prometheus-client). See ``kvtier.api`` for the API.
"""

from kvtierd.protocol import ErrorCode, LayoutKind, StoreOutcome

from .api import Client, JobResult, Layout, StoreDecision, default_socket
from .errors import (BadRequest, Conflict, DaemonError, DaemonUnavailable, Forbidden, InternalError, JobAborted,
                     JobTimeout, KvtierError, LayoutMismatch, LimitExceeded, NoSpace, NotAttached, ShuttingDown,
                     UnknownJob, VersionMismatch)

__all__ = [
    "Client", "Layout", "JobResult", "StoreDecision", "StoreOutcome", "LayoutKind", "ErrorCode", "default_socket",
    "KvtierError", "DaemonUnavailable", "DaemonError", "BadRequest", "VersionMismatch", "NotAttached",
    "LayoutMismatch", "Conflict", "UnknownJob", "NoSpace", "JobTimeout", "ShuttingDown", "JobAborted",
    "LimitExceeded", "Forbidden", "InternalError",
]

"""kvtier: the client library that inference workers link in to use a kvtierd shared KV tier.

It needs pyzmq, msgpack, numpy and (for the tensor API) torch; it never imports the daemon-only
dependencies (prometheus-client). Of the daemon's package it imports only the floor both sides
share, ``kvtierd.contract``. See ``kvtier.api`` for the API.
"""

from kvtierd.contract.codes import ErrorCode, StoreOutcome
from kvtierd.contract.errors import (AccessDenied, BadRequest, Conflict, DaemonError, DaemonUnavailable, Forbidden,
                                     InternalError, JobAborted, JobTimeout, KvtierError, LayoutMismatch, LimitExceeded,
                                     NoSpace, NotAttached, ShuttingDown, UnknownJob, VersionMismatch)
from kvtierd.contract.namespace import NamespaceId, Sharding
from kvtierd.contract.paths import default_socket

from .api import Client, Coordinator, JobResult, Lease, Rank, StoreDecision

__all__ = [
    "Client", "Rank", "Coordinator", "NamespaceId", "JobResult", "Lease", "StoreDecision", "StoreOutcome", "Sharding", "ErrorCode",
    "default_socket",
    "KvtierError", "DaemonUnavailable", "AccessDenied", "DaemonError", "BadRequest", "VersionMismatch", "NotAttached",
    "LayoutMismatch", "Conflict", "UnknownJob", "NoSpace", "JobTimeout", "ShuttingDown", "JobAborted",
    "LimitExceeded", "Forbidden", "InternalError",
]

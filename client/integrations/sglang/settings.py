"""The backend's settings: the ``kvtier_*`` keys of SGLang's storage-backend extra config.

SGLang passes ``--hicache-storage-backend-extra-config`` (a JSON string or ``@file``) to the
backend as ``HiCacheStorageConfig.extra_config``, after popping its own keys (prefetch threshold
and timeouts, ``tp_lcm_size``, ...). The keys SGLang's dynamic factory reads (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``) stay in it; every ``kvtier_*`` key is ours, and
a misspelt one is an error at start-up rather than silently ignored. docs/sglang.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..common import read_settings


@dataclass(frozen=True)
class KvtierSettings:
    socket: str                      # kvtierd's IPC socket
    namespace: str | None = None     # replaces the model identity part of the namespace
    engine_id: str | None = None     # the kvtier engine id of this SGLang instance (default: per parent pid)
    timeout_s: float = 2.0           # bound on one request to kvtierd (and on re-attaching)
    retry_s: float = 10.0            # after kvtierd was unreachable: serve misses this long, then try again
    lease_ttl_s: float = 5.0         # how long batch_exists' hits are held for the batch_get after it (0: no leases)
    interface_v1: bool = False       # SGLang's own key: zero-copy batch_get_v1/batch_set_v1

    KEYS = {"kvtier_socket": "socket", "kvtier_namespace": "namespace", "kvtier_engine_id": "engine_id",
            "kvtier_timeout_s": "timeout_s", "kvtier_retry_s": "retry_s", "kvtier_lease_ttl_s": "lease_ttl_s"}
    NUMBERS = {"timeout_s": ("seconds", False), "retry_s": ("seconds", False),   # (unit, may be 0)
               "lease_ttl_s": ("seconds", True)}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "KvtierSettings":
        """Read and check the settings; raises ValueError naming the key at fault."""
        values = read_settings(extra, cls.KEYS, cls.NUMBERS, where="--hicache-storage-backend-extra-config")
        values["interface_v1"] = bool((extra or {}).get("interface_v1", False))
        return cls(**values)

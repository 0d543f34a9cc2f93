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

from kvtierd.contract.paths import default_socket


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

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "KvtierSettings":
        """Read and check the settings; raises ValueError naming the key at fault."""
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k.startswith("kvtier_") and k not in cls.KEYS)
        if unknown:
            raise ValueError(f"unknown --hicache-storage-backend-extra-config keys {unknown}; kvtier's keys "
                             f"are {sorted(cls.KEYS)}")
        values: dict[str, Any] = {attr: extra[key] for key, attr in cls.KEYS.items() if extra.get(key) is not None}
        values.setdefault("socket", default_socket())
        for name in ("timeout_s", "retry_s", "lease_ttl_s"):
            if name in values:
                try:
                    values[name] = float(values[name])
                except (TypeError, ValueError):
                    raise ValueError(f"kvtier_{name} must be a number of seconds, got {values[name]!r}") from None
                if not (values[name] >= 0 if name == "lease_ttl_s" else values[name] > 0):
                    raise ValueError(f"kvtier_{name} must be {'>=' if name == 'lease_ttl_s' else '>'} 0, "
                                     f"got {values[name]}")
        for name in ("socket", "namespace", "engine_id"):
            if name in values and not (isinstance(values[name], str) and values[name]):
                raise ValueError(f"kvtier_{name} must be a non-empty string, got {values[name]!r}")
        values["interface_v1"] = bool(extra.get("interface_v1", False))
        return cls(**values)

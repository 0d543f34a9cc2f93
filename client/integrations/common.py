"""What the engine adapters share and nothing else: the engine version gate, the reader of the
``kvtier_*`` settings in an engine's extra config, protocol-sized names, and the size of the
kvtier jobs and lookups they send (``PART_KEYS``).

Engine-agnostic: importing it imports no engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Mapping

from kvtierd.contract import protocol as P
from kvtierd.contract.paths import default_socket

# Keys per kvtier job or lookup an adapter sends: a transfer or a lookup with more keys is split.
# (SGLang batches 128 pages; vLLM's long prompts are thousands of blocks.)
PART_KEYS = min(4096, P.MAX_KEYS_PER_REQUEST)


def check_engine_version(installed: str, supported: bool, *, adapter: str, engine: str, versions: str, pin: str,
                         allow_env: str, error: type[ImportError], logger: logging.Logger) -> str:
    """``installed`` when ``supported``; else raise ``error`` with a message naming the supported
    ``versions`` and how to install one (``pip install 'pin'``), or, with ``allow_env``=1 in the
    environment, only log it as a warning and return ``installed``."""
    if supported:
        return installed
    message = (f"kvtier's {adapter} supports {engine} {versions}; this process has {engine} {installed}. Install a "
               f"supported {engine} (pip install '{pin}') or a kvtierd release that supports {engine} {installed}; "
               f"{allow_env}=1 tries anyway.")
    if os.environ.get(allow_env) == "1":
        logger.warning("%s (%s=1: continuing)", message, allow_env)
        return installed
    raise error(message)


def read_settings(extra: Mapping[str, Any] | None, keys: Mapping[str, str], numbers: Mapping[str, tuple[str, bool]],
                  *, where: str) -> dict[str, Any]:
    """The ``kvtier_*`` settings in an engine's extra config ``extra`` (named ``where`` in errors),
    as {attribute: value} for the keys that are set: ``keys`` maps each key to its attribute,
    ``numbers`` maps the numeric attributes to (unit, whether 0 is allowed); every other setting
    is a non-empty string. The socket defaults to the default daemon's. Raises ValueError naming
    the key at fault; a ``kvtier_*`` key that is not in ``keys`` is one (the error lists them)."""
    extra = extra or {}
    unknown = sorted(k for k in extra if k.startswith("kvtier_") and k not in keys)
    if unknown:
        raise ValueError(f"unknown {where} keys {unknown}; kvtier's keys are {sorted(keys)}")
    values: dict[str, Any] = {}
    for key, attr in keys.items():
        value = extra.get(key)
        if value is None:
            continue
        if attr in numbers:
            unit, zero_ok = numbers[attr]
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{key} must be a number of {unit}, got {value!r}") from None
            if not (value >= 0 if zero_ok else value > 0):
                raise ValueError(f"{key} must be {'>=' if zero_ok else '>'} 0, got {value:g}")
        elif not (isinstance(value, str) and value):
            raise ValueError(f"{key} must be a non-empty string, got {value!r}")
        values[attr] = value
    values.setdefault("socket", default_socket())
    return values


def shorten(text: str, limit: int) -> str:
    """``text`` if it fits ``limit`` bytes, else a prefix plus a hash of the whole (stays unique)."""
    if len(text.encode()) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return text.encode()[: limit - 17].decode(errors="ignore") + "~" + digest

"""kvtierd as SGLang's HiCache L3 storage: a ``HiCacheStorage`` loaded through SGLang's ``dynamic``
storage backend, without patching SGLang (docs/sglang.md has the whole launch line)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierStorage",
        "interface_v1": 1, "kvtier_socket": "/dev/shm/kvtierd/kvtierd.sock"}'

Importing this package imports SGLang and checks its version (``SUPPORTED_SGLANG``): SGLang's
storage and host-pool internals change between releases. Importing ``kvtier`` alone never imports
SGLang.

Modules: ``backend`` (the ``KvtierStorage`` class and its per-method contract), ``pages`` (SGLang's
host pool pages as kvtier blocks), ``identity`` (namespace, fingerprint and kvtier engine of a
scheduler process), ``settings`` (the ``kvtier_*`` extra-config keys).
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from ..common import check_engine_version

SUPPORTED_SGLANG = ("0.5.23",)         # the storage interface and host pools it was tested against
ALLOW_UNSUPPORTED_ENV = "KVTIER_SGLANG_ALLOW_UNSUPPORTED"


class UnsupportedSglangVersion(ImportError):
    """The installed SGLang is not a version this backend supports."""


def check_sglang_version(installed: str | None = None) -> str:
    """Raise ``UnsupportedSglangVersion`` unless ``installed`` (default: the installed SGLang's
    version) is supported; ``KVTIER_SGLANG_ALLOW_UNSUPPORTED=1`` turns the error into a warning."""
    if installed is None:
        try:
            installed = version("sglang")
        except PackageNotFoundError:
            installed = "not installed"
    return check_engine_version(
        installed, installed in SUPPORTED_SGLANG, adapter="SGLang backend", engine="SGLang",
        versions=", ".join(SUPPORTED_SGLANG), pin=f"sglang=={SUPPORTED_SGLANG[-1]}", allow_env=ALLOW_UNSUPPORTED_ENV,
        error=UnsupportedSglangVersion, logger=logging.getLogger("sglang.kvtier"))


check_sglang_version()

from .backend import KvtierStorage, kvtier_key  # noqa: E402
from .pages import HostPages  # noqa: E402
from .settings import KvtierSettings  # noqa: E402

__all__ = ["KvtierStorage", "KvtierSettings", "HostPages", "kvtier_key", "check_sglang_version",
           "SUPPORTED_SGLANG", "UnsupportedSglangVersion"]

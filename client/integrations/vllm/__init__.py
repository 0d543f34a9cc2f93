"""kvtierd as vLLM's KV-cache offloading tier: an out-of-tree spec and connector for vLLM's
OffloadingConnector.

Turn it on with one ``--kv-transfer-config`` (docs/vllm.md has the whole line and every setting)::

    {"kv_connector": "KvtierOffloadingConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm",
                                   "kvtier_socket": "/dev/shm/kvtierd/kvtierd.sock"}}

(``"kv_connector": "OffloadingConnector"`` with the same extra config works too, but cannot
report a failed load to vLLM and warns so at start-up.)

This module owns what vLLM loads (``KvtierOffloadingConnector``, ``KvtierOffloadingSpec``) and
the version check: importing it imports vLLM and checks its version (``SUPPORTED_VLLM_SERIES``)
before any version-specific vLLM module is imported; importing ``kvtier`` alone never imports
vLLM. The rest is split the way vLLM splits its own offloading code (vllm/v1/kv_offload, 0.33):

- ``settings``: the ``kvtier_*`` settings, and how vLLM's keys, namespaces and engine ids map
  onto kvtierd's;
- ``identity``: vLLM's config mapped onto the model fingerprint in the namespace (what the KV
  bytes depend on; the digest is ``kvtier.integrations.fingerprint``);
- ``spec``: ``KvtierOffloadingSpec``, which builds the two sides;
- ``manager``: the scheduler side, ``KvtierOffloadingManager``, a kvtierd *coordinator* session;
  its bookkeeping and its link thread are engine-free (``kvtier.integrations.offload``);
- ``worker``: the worker side, ``KvtierOffloadingWorker``, the kvtierd *rank* session of one TP
  rank;
- ``transfer``: the spec that carries a transfer's kvtier jobs from the manager to the workers;
- ``connector``: ``KvtierOffloadingConnector``, which reports failed loads to vLLM.

All sessions of one vLLM engine (one per DP rank) form one kvtier engine, with world size =
vLLM's world size.

**Replicated (MLA) namespaces.** ``KvtierOffloadingSpec.replicated_layout`` (vLLM's flag) stays
False on purpose, even when the kvtier namespace is replicated: when True, vLLM's worker
acknowledges non-writer ranks' stores without calling ``submit_store``, but kvtierd needs those
ranks' votes (a block is ready only when every rank of the job voted), so every rank must see
every store. The deduplication happens in kvtierd instead (only rank 0 copies).

Supported: one KV-cache group, or several groups that use the same per-block byte ranges (vLLM's
hybrid allocator), ``blocks_per_chunk`` = 1, TP (and DCP/PCP, sharded) within one node. Not
supported: PP > 1, ``canonical_layout``, per-group layouts with different block sizes — the spec
raises at start-up naming the setting.

When kvtierd restarts, every session re-attaches on its own; transfers in flight across the
restart fail (a store is then simply not cached; a load is reported failed).
"""

from __future__ import annotations

import logging

import vllm

from ..common import check_engine_version

SUPPORTED_VLLM_SERIES = ("0.33",)      # vLLM's offloading plugin API is experimental: pinned per minor
TESTED_VLLM_VERSIONS = ("0.33.0",)
ALLOW_UNSUPPORTED_ENV = "KVTIER_VLLM_ALLOW_UNSUPPORTED"


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not a version this plugin supports."""


def check_vllm_version(version: str | None = None) -> str:
    """Raise ``UnsupportedVllmVersion`` unless ``version`` (default: the installed vLLM's) is in a
    supported series; returns the version. ``KVTIER_VLLM_ALLOW_UNSUPPORTED=1`` turns the error into
    a warning (at your own risk: the plugin API changes between vLLM minor releases)."""
    from packaging.version import InvalidVersion, Version

    version = vllm.__version__ if version is None else version
    try:
        parsed = Version(version)
        series = f"{parsed.major}.{parsed.minor}"
    except InvalidVersion:
        series = None
    versions = f"{', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)} (tested with {', '.join(TESTED_VLLM_VERSIONS)})"
    return check_engine_version(
        version, series in SUPPORTED_VLLM_SERIES, adapter="vLLM plugin", engine="vLLM", versions=versions,
        pin=f"vllm=={TESTED_VLLM_VERSIONS[-1]}", allow_env=ALLOW_UNSUPPORTED_ENV, error=UnsupportedVllmVersion,
        logger=logging.getLogger("vllm.kvtier"))


check_vllm_version()

# Only now the version-specific vLLM modules (a wrong version fails above with a clear message).
from .connector import KvtierOffloadingConnector  # noqa: E402
from .spec import KvtierOffloadingSpec  # noqa: E402

__all__ = ["KvtierOffloadingConnector", "KvtierOffloadingSpec", "check_vllm_version", "SUPPORTED_VLLM_SERIES",
           "TESTED_VLLM_VERSIONS", "ALLOW_UNSUPPORTED_ENV", "UnsupportedVllmVersion"]

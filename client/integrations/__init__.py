"""Adapters that plug kvtier into inference engines.

Each adapter lives in its own module or package and imports its engine only when it is imported:
``import kvtier`` never imports an engine. Available:

- ``kvtier.integrations.vllm``: an out-of-tree offloading spec for vLLM's ``OffloadingConnector``
  (see docs/vllm.md).
- ``kvtier.integrations.sglang``: a HiCache storage backend (SGLang's L3 tier), loaded through
  SGLang's ``dynamic`` storage backend (see docs/sglang.md).
- ``kvtier.integrations.offload``: the scheduler side of an offloading engine (vLLM's), engine-free:
  the link thread that owns the coordinator session, requests' batched and leased lookups, the
  kvtier jobs of a transfer.
- ``kvtier.integrations.fingerprint``: the model fingerprint in the namespace (cache identity),
  engine-agnostic: both adapters map their engine's config onto it.
- ``kvtier.integrations.common``: what else the adapters share (the engine version gate, the
  ``kvtier_*`` settings reader, protocol-sized names, the keys per job ``PART_KEYS``).
"""

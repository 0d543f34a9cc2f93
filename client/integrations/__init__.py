"""Adapters that plug kvtier into inference engines.

Each adapter lives in its own module and imports its engine only when that module is imported:
``import kvtier`` never imports an engine. Available:

- ``kvtier.integrations.vllm``: an out-of-tree offloading spec for vLLM's ``OffloadingConnector``
  (see docs/vllm.md).
"""

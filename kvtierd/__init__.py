"""kvtierd: a per-node shared, pinned host-memory KV-cache tier for LLM inference.

The package holds the daemon and the modules that daemon and clients share (``protocol``,
``layout``, ``mapping``). Importing it, or those shared modules, pulls in no daemon-only
dependency, so the client library (``kvtier``) can import them in an inference worker.
"""

__version__ = "0.1.0"

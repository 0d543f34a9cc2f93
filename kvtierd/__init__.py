"""kvtierd: a per-node shared, pinned host-memory KV-cache tier for LLM inference.

The package holds the daemon and, in ``kvtierd.contract``, the floor that daemon and clients share
(protocol, namespace identity, region format, paths, mapping, errors, channel). Importing it, or
the floor, pulls in no daemon-only dependency, so the client library (``kvtier``) can import the
floor in an inference worker.
"""

__version__ = "0.3.8"

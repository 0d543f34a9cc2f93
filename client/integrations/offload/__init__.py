"""The scheduler side of an offloading engine, engine-free: what vLLM's ``OffloadingManager`` does
with kvtierd, without importing vLLM, so that its bookkeeping runs (and ``tests/unit`` test it)
anywhere ``kvtier`` runs. ``kvtier.integrations.vllm.manager`` maps vLLM's calls onto it.

Keys are vLLM's ``OffloadKey`` format (a block hash ‖ a 4-byte KV-cache group index), the one
engine shape this package knows. Modules (each imports no engine; this one imports nothing):

- ``link``: the thread that owns the coordinator session, so that the scheduler never waits on a
  socket; away and back again through ``kvtier.reach``;
- ``lookups``: each request's batched, leased lookup and the verdict that answers its per-key
  lookups, renewals, the bounded wait;
- ``jobs``: the kvtier store and load jobs of a transfer (``JobPart``), opened in the background;
- ``keys``: vLLM's keys as kvtier keys, and their KV-cache group;
- ``events``: the namespace's KV events, read on the link thread (``EventFeed``);
- ``stats``: the counters the scheduler side keeps.
"""

"""The second tier: a distributed KV store behind the node's region (docs/tier.md).

``backend``   the interface every second-tier engine implements, its typed errors, and how a
              block's bytes are described (extents of a registered region)
``keys``      tier keys: a namespace's identity folded into every key, so two models never meet
``guard``     deadlines and a circuit breaker around a backend, so a down or slow tier never
              stalls its caller
``mooncake``  Mooncake Store (zero-copy register_buffer + batch put_from / get_into)
``resp``      a minimal RESP2 cluster client (slot map, redirections, pipelines per node)
``redis``     Valkey/Redis Cluster through ``resp`` (gather-write puts, scatter-read gets)
``service``   the companion process the daemon owns: maps the region, runs a guarded backend
``link``      the daemon's side of the companion: start, non-blocking requests, replies, stop

Nothing here imports the daemon's store or server, and importing the package imports no engine
client: ``mooncake`` and ``redis`` are loaded by name (``backend.open_backend``).
"""

"""The floor: what the daemon and its clients agree on, and the only kvtierd modules a client imports.

- ``protocol``       the wire: ops, request fields, reply shapes, limits, error codes, the version
- ``namespace``      ``NamespaceId``, the namespace identity, declared once; ``Sharding``
- ``region_format``  the region file's bytes: header, namespace/entry/chain tables, checksums
- ``paths``          where a daemon's files live: <dir>/<name>.{region,lock,sock,admin.sock}
- ``mapping``        mapping a file at a known address, prefault, pinning
- ``errors``         the typed exceptions, one per error code, and ``DaemonUnavailable``
- ``channel``        ``Channel``: one DEALER request/reply channel to a daemon

Nothing here imports from kvtierd outside this folder, nor a daemon-only dependency
(prometheus-client, uvloop): the client library (``kvtier``) imports these modules inside an
inference worker. Importing the package itself imports nothing.
"""

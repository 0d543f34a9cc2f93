"""The floor: what the daemon and its clients agree on, and the only kvtierd modules a client imports.

- ``protocol``       the wire: transport, the version, limits, ops and their request fields, validation
- ``codes``          the wire's enumerations: error codes, store outcomes, job kinds, states, abort causes
- ``replies``        every op's declared reply shape, and the reply envelope
- ``namespace``      ``NamespaceId``, the namespace identity, declared once; ``Sharding``
- ``region_format``  the region's layout: constants, record dtypes, ``Geometry``
- ``region_view``    a mapped region read and written: ``RegionView``, namespace records, ``DataHeader``
- ``region_sums``    the region's integrity sums: record sums and data checksums
- ``paths``          where a daemon's files live: <dir>/<name>.{region,lock,sock,admin.sock}
- ``mapping``        mapping a file at a known address, prefault, pinning
- ``errors``         the typed exceptions, one per error code, and ``DaemonUnavailable``
- ``channel``        ``Channel``: one DEALER request/reply channel to a daemon

Nothing here imports from kvtierd outside this folder, nor a daemon-only dependency
(prometheus-client, uvloop): the client library (``kvtier``) imports these modules inside an
inference worker. Importing the package itself imports nothing.
"""

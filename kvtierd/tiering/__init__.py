"""The second tier in the daemon (docs/tier.md): blocks demoted before their pages are reused,
lookup misses promoted, both under the page fence — behind a small, non-blocking interface.

``interface``  ``Tier`` (what the store and the server ask of a tier), ``NoTier`` (none), the
               factory type and ``TierConfig``
``companion``  the companion process's life: the link, its writer row, the calls' bookkeeping
``demote``     demote ahead of need; what this node knows the tier holds (``Copies``)
``promote``    lookup misses checked, then promoted as fenced writes whose writer is the companion
``tier``       ``CompanionTier``: the interface over the three, clears, stats; ``check`` (the
               settings, before the region is touched) and ``build`` (settings → factory)

The modules import each other in that order and nothing above the store; the companion process
itself and the daemon's link to it are ``kvtierd.tier``.
"""

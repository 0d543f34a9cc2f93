"""The eviction policies over flat per-slot arrays, in compiled code (``kvtierd._native.Policy``).

The same four policies as ``lru``, ``slru``, ``s3fifo`` and ``tinylfu`` of this package, decision
for decision (tests/unit/test_native_policy.py replays the bundled request traces through both
and compares every victim), with the hooks batch-shaped: each takes a whole job's slots as one
int32/int64 vector (a NumPy array; a list also works) and runs as one compiled pass, and a key is
given by its 64-bit fingerprint (Python's ``hash`` of its bytes, which the key table keeps per
slot), not its bytes:

``inserted(slots, fingerprints, chain=True, cold=0)``  the entries became READY
``accessed(slots)`` / ``pinned(slots)`` / ``unpinned(slots)`` / ``removed(slots)``
``recovered(slots_oldest_first, fingerprints)``         the set after a restart
``victims(need=-1, exclude=(), weights=None)``          the victims, best first, as int32 bytes:
    until their weights (``weights[slot]``: the entry's pages; 1 each without) reach ``need``,
    every evictable slot not in ``exclude`` when ``need`` < 0. Choosing frees nothing; the walk's
    own moves (slru's promotions, s3fifo's second rounds) are those the Python policies' lazy
    walks made when closed after the same victims.

Each list (segment) is an intrusive doubly linked list over the slots (two int32 per slot), so a
slot costs 10 bytes plus the sketch's 64-128 instead of an OrderedDict node (~100 bytes) and a
set entry per flag; docs/design.md has the measurements.
"""

from __future__ import annotations

from typing import ClassVar

from .._native import Policy as _Policy
from . import DEFAULT, PolicyStats, policy_class
from .s3fifo import SMALL_SHARE
from .slru import PROTECTED_SHARE as SLRU_PROTECTED_SHARE
from .tinylfu import PROTECTED_SHARE as TINYLFU_PROTECTED_SHARE
from .tinylfu import WINDOW_SHARE


class NativePolicy(_Policy):
    name: ClassVar[str] = ""
    segments: ClassVar[tuple[str, ...]] = ()

    def stats(self) -> PolicyStats:
        admitted, refused, remembered, promoted, won, lost, pinned, sketch, sizes, evicted = self.counts()
        extra = {} if self.name == "lru" else {"remembered": remembered, "promoted": promoted}
        if self.name == "tinylfu":
            extra.update(window_won=won, window_lost=lost)
        if self.name != "lru":
            extra.update(pinned=pinned, sketch_bytes=sketch)
        return {"admitted": admitted, "refused": refused, "segments": dict(zip(self.segments, sizes)),
                "evicted": dict(zip(self.segments, evicted)), "extra": extra}


class LRU(NativePolicy):
    name = "lru"
    segments = ("lru",)

    def __init__(self) -> None:
        super().__init__("lru")


class SLRU(NativePolicy):
    name = "slru"
    segments = ("probation", "protected")

    def __init__(self, protected_share: float = SLRU_PROTECTED_SHARE) -> None:
        super().__init__("slru", protected_share)


class S3FIFO(NativePolicy):
    name = "s3fifo"
    segments = ("small", "main")

    def __init__(self, small_share: float = SMALL_SHARE) -> None:
        super().__init__("s3fifo", small_share)


class TinyLFU(NativePolicy):
    name = "tinylfu"
    segments = ("window", "probation", "protected")

    def __init__(self, window_share: float = WINDOW_SHARE,
                 protected_share: float = TINYLFU_PROTECTED_SHARE) -> None:
        super().__init__("tinylfu", window_share, protected_share)


NATIVE: dict[str, type[NativePolicy]] = {cls.name: cls for cls in (LRU, SLRU, S3FIFO, TinyLFU)}


def create(name: str = DEFAULT) -> NativePolicy:
    """A new, empty policy of the given name as the daemon runs it."""
    if name not in NATIVE:
        policy_class(name)                  # raises the error that names the known policies
    return NATIVE[name]()

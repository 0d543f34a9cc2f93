"""What the client's calls return: a store's decision, a finished job, a lease held.

Plain values, shared by both roles (``kvtier.session``, ``kvtier.rank``, ``kvtier.coordinator``)
and re-exported by ``kvtier``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.errors import KvtierError


@dataclass
class StoreDecision:
    outcomes: list[StoreOutcome]

    @property
    def written(self) -> int:
        return sum(1 for o in self.outcomes if o is StoreOutcome.WRITE)


@dataclass
class JobResult:
    job: int
    kind: str                 # "store" | "load"
    ok: bool
    hits: int = 0             # load: blocks copied into the KV cache
    error: KvtierError | None = None


@dataclass(frozen=True)
class Lease:
    """A lease this client holds (``Client.leases``): what its leasing lookup reported."""

    id: int
    keys: tuple               # the keys that lookup asked (a re-issue asks them again)
    hits: int
    leased: int               # the leading hits kvtierd holds (fewer than hits: its caps)
    ttl: float                # seconds kvtierd granted
    expires: float            # time.monotonic() by which it has lapsed (counted from the request)

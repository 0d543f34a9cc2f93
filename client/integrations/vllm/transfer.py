"""What the scheduler hands the workers for one vLLM transfer: its kvtier jobs.

vLLM numbers a transfer only *after* ``prepare_store``/``prepare_load`` returned, so the manager
cannot name a kvtier job after vLLM's id. It numbers kvtier jobs with its own counter and hands
their ids to the workers inside a ``KvtierLoadStoreSpec`` (one ``JobPart`` per kvtier job; a
transfer with more keys than one job takes becomes several); each worker maps vLLM's transfer
job id to those kvtier jobs and reports vLLM's id back.

A kvtier job is decided by whichever of its requests reaches kvtierd first, the manager's (sent
in the background) or a rank's: for a store, which keys are written (the others are present
already or find no room); for a load, the ready prefix it pins. Every rank gets that same
decision; a load job also consumes the lease its part names (kvtierd.leases), so that the keys
the scheduler's lookup found cannot have been evicted meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from vllm.v1.kv_offload.base import LoadStoreSpec


@dataclass(frozen=True)
class JobPart:
    """One kvtier job of a transfer: its id and its keys, in the order of the transfer's GPU
    block ids (every rank must name the same keys); for a load, the lease of the engine that
    holds those keys (the job's first request consumes it), if any."""

    job: int
    keys: tuple[bytes, ...]
    lease: int | None = None


class KvtierLoadStoreSpec(LoadStoreSpec):
    """Where a transfer's blocks live in kvtierd: the kvtier jobs that carry it out.

    Travels from the scheduler to every worker inside vLLM's connector metadata (pickled).
    """

    def __init__(self, parts: Sequence[JobPart] = ()):
        self.parts: tuple[JobPart, ...] = tuple(parts)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.keys) for p in self.parts)

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec(jobs={[p.job for p in self.parts]}, blocks={self.num_blocks})"

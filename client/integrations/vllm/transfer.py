"""What the scheduler hands the workers for one vLLM transfer: the kvtier jobs it opened.

vLLM numbers a transfer only *after* ``prepare_store``/``prepare_load`` returned, so the manager
cannot open a kvtier job under vLLM's id. It opens kvtier jobs under its own counter and hands
their ids to the workers inside a ``KvtierLoadStoreSpec`` (one ``JobPart`` per kvtier job; a
transfer with more keys than one job takes becomes several); each worker maps vLLM's transfer
job id to those kvtier jobs and reports vLLM's id back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


@dataclass
class JobPart:
    """One kvtier job of a transfer.

    ``keys`` is the job's key list exactly as the manager opened it (every rank must name the same
    keys). ``select`` indexes the keys this transfer moves, in the order of the GPU spec's block
    ids: for a store the keys kvtierd decided to WRITE, for a load all of them. ``hits`` is the
    ready prefix the manager pinned for a load (-1 for a store); ``job`` is -1 when the manager
    could not open the job at all.
    """

    job: int
    keys: tuple[bytes, ...]
    select: np.ndarray
    hits: int = -1


class KvtierLoadStoreSpec(LoadStoreSpec):
    """Where a transfer's blocks live in kvtierd: the kvtier jobs that the manager opened.

    Travels from the scheduler to every worker inside vLLM's connector metadata (pickled).
    """

    def __init__(self, parts: Sequence[JobPart] = ()):
        self.parts: tuple[JobPart, ...] = tuple(parts)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.select) for p in self.parts)

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec(jobs={[p.job for p in self.parts]}, blocks={self.num_blocks})"

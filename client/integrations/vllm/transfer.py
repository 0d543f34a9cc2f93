"""What the scheduler hands the workers for one vLLM transfer: its kvtier jobs, in a
``KvtierLoadStoreSpec``.

vLLM numbers a transfer only *after* ``prepare_store``/``prepare_load`` returned, so the manager
numbers kvtier jobs itself (``kvtier.integrations.offload.jobs``: one ``JobPart`` per kvtier job)
and hands their ids to the workers inside the spec; each worker maps vLLM's transfer job id to
those kvtier jobs and reports vLLM's id back.
"""

from __future__ import annotations

from typing import Sequence

from vllm.v1.kv_offload.base import LoadStoreSpec

from ..offload.jobs import JobPart


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

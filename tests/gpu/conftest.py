"""Fixtures for the GPU tests (every test module here is marked ``cuda`` and skipped without CUDA).

``pinned_region(nbytes)`` maps a fresh file on tmpfs and registers the mapping with CUDA exactly as
a client does (kvtierd.contract.mapping.Mapping.pin_cuda: portable + mapped, chunked), so the tests
copy through the same UVA path as production. tmpfs because since Linux 6.5 the kernel refuses
long-term writable pins of file-backed pages other than shmem/hugetlbfs; /dev/shm (where kvtierd
keeps its region) is tmpfs.

The TP=2 test runs a real daemon: the ``daemon`` / ``start_daemon`` fixtures come from
tests/integration/conftest.py.
"""

from __future__ import annotations


import pytest

from kvtierd.contract.mapping import Mapping
from tests.integration.conftest import daemon, start_daemon  # noqa: F401  (fixtures, re-exported)


class PinnedRegion:
    """Scratch memory mapped and CUDA-registered in this process; ``tensor`` is a uint8 CPU view."""

    def __init__(self, nbytes: int):
        from kvtier.torch_copy import host_view
        self.mapping = Mapping.anonymous(nbytes, "kvtier-gpu-test")
        self.mapping.pin_cuda(required=True)
        self.address, self.size = self.mapping.address, nbytes
        self.tensor = host_view(self.address, nbytes)

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(self.address, self.size)]

    def close(self) -> None:
        self.tensor = None
        self.mapping.close()


@pytest.fixture
def pinned_region():
    made: list[PinnedRegion] = []

    def make(nbytes: int) -> PinnedRegion:
        made.append(PinnedRegion(nbytes))
        return made[-1]

    yield make
    for r in made:
        r.close()

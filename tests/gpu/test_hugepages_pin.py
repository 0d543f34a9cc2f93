"""A CUDA client on a region of 2 MiB pages: it populates its mapping, then pins it with
cudaHostRegister (which then finds every page present), and copies through it byte for byte.

Needs a CUDA device and a tmpfs mounted huge=always, which the test mounts itself as root (and
unmounts); skipped, saying why, otherwise. The cost per GiB is bench/gpu_bench.py's (register
table), not a test's.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import Client, NamespaceId
from kvtierbench.harness import huge_tmpfs
from kvtierd import hugepages

pytestmark = [pytest.mark.cuda, pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def huge_root(tmp_path):
    mount_point = str(tmp_path / "huge")
    try:
        with huge_tmpfs(mount_point, 256 << 20):
            yield mount_point
    except OSError as exc:
        if "cannot mount" not in str(exc):
            raise
        pytest.skip(f"needs a tmpfs mounted huge=always, which only root can mount: {exc}")


def test_cuda_client_pins_a_populated_huge_page_mapping_and_copies_through_it(start_daemon, huge_root):
    daemon = start_daemon("--hugepages", "on", size="128MiB", root=huge_root)
    assert daemon.stats()["hugepages"] == "thp"
    kv = [torch.randint(0, 255, (16, 16, 1024), dtype=torch.uint8, device="cuda") for _ in range(4)]
    namespace = NamespaceId.for_kv_caches(kv, "huge-gpu", 16)
    client = Client(daemon.socket, engine_id="huge-gpu", rank=0, world_size=1, namespace=namespace, pin="cuda")
    try:
        client.register_kv_caches(kv)
        assert client.pinned == "cuda" and client.populating.finished      # populated before it was pinned
        assert hugepages.backing(client.mapping.address).huge_bytes == client.mapping.size
        keys = [bytes([i]) * 36 for i in range(4)]
        client.store(1, keys, [0, 1, 2, 3])
        assert client.wait([1])[0].ok
        assert client.load(2, keys, [8, 9, 10, 11]) == 4
        assert client.wait([2])[0].ok
        torch.cuda.synchronize()
        for t in kv:
            assert torch.equal(t[8:12], t[0:4])
    finally:
        client.close()

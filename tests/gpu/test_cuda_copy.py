"""The device copiers on a real GPU: bytes equal to a torch reference, in both directions.

- every KV-cache layout of the CPU tests, random block lists, store (D2H) then load (H2D);
- exactly 1 descriptor, and 1,000,000 descriptors in one launch (aligned and misaligned);
- ordering after the compute stream (the current one, and an explicit one);
- automatic selection, and the kernel copier refusing an unregistered host span.

Both copiers are exercised: ``cuda`` (the kernel, needs CuPy) and ``torch`` (copy_ per piece).
"""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch

from kvtier.copy import CopierUnavailable
from kvtier.kvcache import Descriptors, KVCacheLayout
from kvtier.select import select_copier
from tests.unit.test_copiers import LAYOUTS

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
COPIERS = [pytest.param("cuda", marks=pytest.mark.skipif(not HAVE_CUPY, reason="the kernel copier needs CuPy")),
           "torch"]
DEVICE = torch.device("cuda", 0)
PAGE = 64 << 10


@pytest.fixture
def make_copier():
    copiers = []

    def make(name, tensors, region, **kwargs):
        copiers.append(select_copier(name, DEVICE, kv_tensors=tensors, host_spans=region.spans, **kwargs))
        return copiers[-1]

    yield make
    for e in copiers:      # before pinned_region's teardown unmaps the region (fixture order)
        e.close()


def to_device(tensors):
    """The CPU-built layout on the GPU, keeping views as views (FlashInfer's K/V share a storage)."""
    bases = {}
    out = []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in bases:
            whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
            bases[key] = whole.to(DEVICE)
        out.append(bases[key].as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


def block_rows(tensors, blocks) -> torch.Tensor:
    """Torch reference: [len(blocks), block_bytes] uint8, the logical bytes of each block."""
    idx = torch.as_tensor(np.asarray(blocks), device=DEVICE)
    # uint8 views: index_select does not cover every dtype (fp8), bytes are what is compared.
    return torch.cat([t.view(torch.uint8).index_select(0, idx).reshape(len(idx), -1) for t in tensors], dim=1)


def entry_bytes(region, pages: np.ndarray, block_bytes: int) -> torch.Tensor:
    """[K, block_bytes] uint8: each entry's pages concatenated, as the region holds them."""
    rows = region.tensor[: (int(pages.max()) + 1) * PAGE].view(-1, PAGE)
    return rows[torch.as_tensor(pages)].reshape(len(pages), -1)[:, :block_bytes]


def run(copier, desc: Descriptors) -> None:
    handle = copier.submit(desc)
    handle.wait(120)
    assert handle.done() and handle.error() is None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("copier_name", COPIERS)
def test_random_block_lists_both_directions(layout, copier_name, pinned_region, make_copier):
    gen = torch.Generator().manual_seed(11)
    tensors = to_device(LAYOUTS[layout](gen))
    kv = KVCacheLayout(tensors, PAGE)
    rng = np.random.default_rng(sorted(LAYOUTS).index(layout))
    k = kv.num_blocks // 3
    per_block = -(-kv.block_bytes // PAGE)
    region = pinned_region((k * per_block + 3) * PAGE)
    copier = make_copier(copier_name, tensors, region)
    blocks = rng.choice(kv.num_blocks, size=k, replace=False)
    pages = rng.permutation(k * per_block + 3)[:k * per_block].reshape(k, per_block)

    run(copier, kv.descriptors(blocks, pages, region.address, to_region=True))
    assert torch.equal(entry_bytes(region, pages, kv.block_bytes), block_rows(tensors, blocks).cpu())

    targets = rng.permutation(np.setdiff1d(np.arange(kv.num_blocks), blocks))[:k]
    for t in tensors:
        t.view(torch.uint8).index_fill_(0, torch.as_tensor(targets, device=DEVICE), 0)
    others = np.setdiff1d(np.arange(kv.num_blocks), targets)
    untouched = block_rows(tensors, others).clone()
    run(copier, kv.descriptors(targets, pages, region.address, to_region=False))
    assert torch.equal(block_rows(tensors, targets), block_rows(tensors, blocks))
    assert torch.equal(block_rows(tensors, others), untouched)


@pytest.mark.parametrize("to_region", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("copier_name", COPIERS)
def test_exactly_one_descriptor(copier_name, to_region, pinned_region, make_copier):
    t = torch.randint(0, 256, (8, 16, 576), dtype=torch.uint8, device=DEVICE).view(torch.bfloat16)  # 9 KiB rows
    kv = KVCacheLayout([t], PAGE)
    region = pinned_region(4 * PAGE)
    region.tensor.copy_(torch.randint(0, 256, (4 * PAGE,), dtype=torch.uint8))
    desc = kv.descriptors([5], np.array([[2]]), region.address, to_region=to_region)
    assert len(desc) == 1
    run(make_copier(copier_name, [t], region), desc)
    host = region.tensor[2 * PAGE: 2 * PAGE + kv.block_bytes]
    assert torch.equal(t[5].reshape(-1).view(torch.uint8).cpu(), host)


def slot_descriptors(n: int, slot: int, dev_base: int, host_base: int, perm: np.ndarray, to_host: bool):
    """n pieces of ``slot`` bytes: device slot perm[i] ↔ host slot i."""
    dev = np.uint64(dev_base) + perm.astype(np.uint64) * np.uint64(slot)
    host = np.uint64(host_base) + np.arange(n, dtype=np.uint64) * np.uint64(slot)
    nbytes = np.full(n, slot, dtype=np.uint64)
    return Descriptors(dev, host, nbytes) if to_host else Descriptors(host, dev, nbytes)


@pytest.mark.parametrize("slot,dev_skew,host_skew", [(64, 0, 0), (37, 3, 8), (48, 8, 8)],
                         ids=["16-aligned", "misaligned", "8-aligned"])
@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("copier_name,n", [
    pytest.param("cuda", 1_000_000, marks=pytest.mark.skipif(not HAVE_CUPY, reason="the kernel copier needs CuPy")),
    # one cudaMemcpyAsync per piece: a million would take minutes; the kernel is what must scale
    ("torch", 20_000),
])
def test_many_descriptors_one_job(copier_name, n, to_host, slot, dev_skew, host_skew, pinned_region, make_copier):
    total = n * slot
    dev = torch.randint(0, 256, (total + 16,), dtype=torch.uint8, device=DEVICE)
    region = pinned_region(total + 4096)
    region.tensor.copy_(torch.randint(0, 256, (total + 4096,), dtype=torch.uint8))
    copier = make_copier(copier_name, [dev], region)
    perm = np.random.default_rng(n + slot).permutation(n)
    desc = slot_descriptors(n, slot, dev.data_ptr() + dev_skew, region.address + host_skew, perm, to_host)
    assert len(desc) == n
    host_rows = lambda: region.tensor[host_skew: host_skew + total].view(n, slot)  # noqa: E731
    dev_rows = lambda: dev[dev_skew: dev_skew + total].view(n, slot)  # noqa: E731
    before_dev = dev.clone()
    run(copier, desc)
    idx = torch.as_tensor(perm, device=DEVICE)
    if to_host:
        assert torch.equal(host_rows(), dev_rows().index_select(0, idx).cpu())
        assert torch.equal(dev, before_dev)
    else:
        assert torch.equal(dev_rows().index_select(0, idx).cpu(), host_rows())
        assert torch.equal(dev[:dev_skew], before_dev[:dev_skew])
        assert torch.equal(dev[dev_skew + total:], before_dev[dev_skew + total:])


@pytest.mark.parametrize("explicit_stream", [False, True], ids=["current-stream", "given-stream"])
@pytest.mark.parametrize("copier_name", COPIERS)
def test_store_waits_for_the_compute_stream(copier_name, explicit_stream, pinned_region, make_copier):
    """The model's last write is still queued (behind a ~0.2 s spin) when the store is submitted."""
    t = torch.zeros((4, 64, 576), dtype=torch.bfloat16, device=DEVICE)
    kv = KVCacheLayout([t], PAGE)
    region = pinned_region(8 * PAGE)
    compute = torch.cuda.Stream(DEVICE) if explicit_stream else torch.cuda.current_stream(DEVICE)
    copier = make_copier(copier_name, [t], region, stream=compute if explicit_stream else None)
    desc = kv.descriptors([1], np.array([[3, 4]]), region.address, to_region=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(int(2e8))
        t[1].fill_(1.5)
    handle = copier.submit(desc)       # submitted from the default stream's context in both cases
    handle.wait(60)
    expected = torch.full((64, 576), 1.5, dtype=torch.bfloat16).view(-1).view(torch.uint8)
    assert torch.equal(region.tensor[3 * PAGE: 3 * PAGE + kv.block_bytes], expected)


@pytest.mark.parametrize("copier_name", COPIERS)
def test_jobs_complete_in_submission_order(copier_name, pinned_region, make_copier):
    t = torch.randint(0, 256, (64, 16, 576), dtype=torch.uint8, device=DEVICE).view(torch.bfloat16)
    kv = KVCacheLayout([t], PAGE)
    region = pinned_region(64 * PAGE)
    copier = make_copier(copier_name, [t], region)
    handles = [copier.submit(kv.descriptors([b], np.array([[b]]), region.address, to_region=True))
               for b in range(64)]
    handles[-1].wait(60)
    assert all(h.done() and h.error() is None for h in handles)
    assert torch.equal(entry_bytes(region, np.arange(64)[:, None], kv.block_bytes), block_rows([t], range(64)).cpu())


def test_auto_selection_and_unregistered_host_memory(pinned_region, caplog):
    t = torch.zeros((4, 16, 576), dtype=torch.bfloat16, device=DEVICE)
    region = pinned_region(4 * PAGE)
    copier = select_copier("auto", DEVICE, kv_tensors=[t], host_spans=region.spans)
    assert copier.name == ("cuda" if HAVE_CUPY else "torch")
    copier.close()

    pageable = np.zeros(4 * PAGE, dtype=np.uint8)      # never registered with CUDA
    spans = [(pageable.ctypes.data, pageable.nbytes)]
    if HAVE_CUPY:
        with pytest.raises(CopierUnavailable, match="not registered"):
            select_copier("cuda", DEVICE, kv_tensors=[t], host_spans=spans)
    with caplog.at_level(logging.WARNING, logger="kvtier.select"):
        copier = select_copier("auto", DEVICE, kv_tensors=[t], host_spans=spans)
    assert copier.name == "torch"
    assert [r.getMessage() for r in caplog.records if "torch fallback" in r.getMessage()]
    # The torch copier copies pageable memory correctly (staged by the driver).
    kv = KVCacheLayout([t], PAGE)
    t[2].fill_(3.0)
    run(copier, kv.descriptors([2], np.array([[1]]), pageable.ctypes.data, to_region=True))
    assert np.array_equal(pageable[PAGE: PAGE + kv.block_bytes],
                          t[2].reshape(-1).view(torch.uint8).cpu().numpy())
    copier.close()

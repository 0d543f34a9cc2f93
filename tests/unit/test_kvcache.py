"""kvtier.kvcache (piece templates, descriptors) and kvtier.copy's CPU copier, checked on bytes.

A numpy array stands in for the region's data area: descriptors built for CPU torch KV caches are
executed with memmove into it, and the region must then hold each block's layer rows in layer
order over its (possibly shuffled) pages; loading them back into other block ids must reproduce
the tensors exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.copy import CopyHandle, CPUCopier, run_memmove
from kvtier.kvcache import Descriptors, KVCacheLayout, PieceTemplate
from kvtier.select import select_copier

NUM_BLOCKS = 12


# --- piece template ------------------------------------------------------------------------------
def check_template(row_bytes: list[int], page_size: int) -> None:
    t = PieceTemplate.build(row_bytes, page_size)
    starts = np.concatenate([[0], np.cumsum(row_bytes)]).astype(np.int64)
    block = int(starts[-1])
    n = t.nbytes.astype(np.int64)
    assert len(t) == len(n)
    if block == 0:
        assert len(t) == 0
        return
    assert (n > 0).all()
    begin = starts[t.layer] + t.row_offset.astype(np.int64)
    # Pieces tile [0, block) exactly once, in order.
    assert begin[0] == 0
    assert np.array_equal(begin[1:], begin[:-1] + n[:-1])
    assert begin[-1] + n[-1] == block
    assert n.sum() == block
    # The page side names the same logical bytes.
    assert np.array_equal(t.page_index * page_size + t.page_offset.astype(np.int64), begin)
    # No piece crosses a layer row or a page.
    rows = np.asarray(row_bytes, dtype=np.int64)
    assert (t.row_offset.astype(np.int64) + n <= rows[t.layer]).all()
    assert (t.page_offset.astype(np.int64) + n <= page_size).all()
    assert (rows[t.layer] > 0).all()
    # And it is the fewest such pieces: every cut is a layer or a page boundary.
    cuts = set(starts.tolist()) | set(range(0, block, page_size))
    assert len(t) == len({c for c in cuts if 0 <= c < block})


@pytest.mark.parametrize("rows,page", [
    ([18432] * 3, 4096), ([18432] * 3, 65536), ([9216] * 61, 65536), ([100, 200, 300], 128), ([65536], 65536),
    ([65536] * 2, 4096), ([1], 4096), ([5000, 3000], 4096), ([4096, 4096], 8192), ([7], 3),
])
def test_template_examples(rows, page):
    check_template(rows, page)


def test_template_cuts_at_both_boundaries():
    t = PieceTemplate.build([6, 6], 4)
    # cuts at 0, 4, 6 (layer), 8, 12
    assert t.layer.tolist() == [0, 0, 1, 1]
    assert t.row_offset.tolist() == [0, 4, 0, 2]
    assert t.page_index.tolist() == [0, 1, 1, 2]
    assert t.page_offset.tolist() == [0, 0, 2, 0]
    assert t.nbytes.tolist() == [4, 2, 2, 4]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50_000), min_size=1, max_size=12), st.integers(1, 70_000))
def test_template_property(rows, page):
    check_template(rows, page)


# --- helpers ----------------------------------------------------------------------------------------
def rand_tensor(shape, dtype, seed) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern; compared as bytes, never as values)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def row(t: torch.Tensor, b: int) -> bytes:
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def block_bytes_of(tensors, b: int) -> bytes:
    return b"".join(row(t, b) for t in tensors)


def snapshot(tensors) -> list[bytes]:
    return [b"".join(row(t, b) for b in range(t.shape[0])) for t in tensors]


def page_bytes(region: np.ndarray, pages, page_size: int, n: int) -> bytes:
    return b"".join(region[p * page_size:(p + 1) * page_size].tobytes() for p in pages)[:n]


def caches():
    """Several registrations: per-layer MLA-like, bf16, cross-layer, and strided views."""
    out = {}
    out["mla-uint8-3layers"] = [rand_tensor((NUM_BLOCKS, 16, 576), torch.uint8, i) for i in range(3)]
    out["mla-bf16-3layers"] = [rand_tensor((NUM_BLOCKS, 16, 576), torch.bfloat16, 10 + i) for i in range(3)]
    out["cross-layer-f16"] = [rand_tensor((NUM_BLOCKS, 4, 16, 64), torch.float16, 20)]
    kv = rand_tensor((2, NUM_BLOCKS, 16, 8, 64), torch.float32, 30)         # vLLM-style [2, blocks, ...]
    kv2 = rand_tensor((2, NUM_BLOCKS, 16, 8, 64), torch.float32, 31)
    out["kv0-kv1-views"] = [kv[0], kv[1], kv2[0], kv2[1]]
    inter = rand_tensor((NUM_BLOCKS, 2, 16, 40), torch.float16, 40)          # K/V interleaved per block
    out["strided-rows"] = [inter[:, 0], inter[:, 1]]
    out["mixed-dtypes"] = [rand_tensor((NUM_BLOCKS, 3, 100), torch.int8, 50),
                           rand_tensor((NUM_BLOCKS, 7), torch.float64, 51),
                           rand_tensor((NUM_BLOCKS, 16, 576), torch.bfloat16, 52)]
    return out


CACHES = sorted(caches())
PAGE_SIZES = [4096, 16384, 65536, 1 << 20]


# --- descriptors: store into the region, load back ----------------------------------------------------
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", CACHES)
def test_store_then_load_round_trip(name, page_size):
    tensors = caches()[name]
    kv = KVCacheLayout(tensors, page_size)
    assert kv.num_blocks == NUM_BLOCKS
    assert kv.block_bytes == sum(t[0].numel() * t.element_size() for t in tensors)
    per_block = math.ceil(kv.block_bytes / page_size)

    store_blocks = [3, 0, 7, 11, 5]
    k = len(store_blocks)
    num_region_pages = k * per_block + 5
    rng = np.random.default_rng(page_size + len(name))
    perm = rng.permutation(num_region_pages)[:k * per_block]          # shuffled, non-contiguous pages
    pages = perm.reshape(k, per_block).astype(np.uint32)
    region = np.full(num_region_pages * page_size, 0xA5, dtype=np.uint8)
    before = region.copy()

    desc = kv.descriptors(store_blocks, pages, region.ctypes.data, to_region=True)
    assert desc.src.dtype == desc.dst.dtype == desc.nbytes.dtype == np.uint64
    assert desc.total_bytes == k * kv.block_bytes
    assert run_memmove(desc) == k * kv.block_bytes

    for i, b in enumerate(store_blocks):
        assert page_bytes(region, pages[i], page_size, kv.block_bytes) == block_bytes_of(tensors, b), (i, b)
    # Nothing outside the blocks' logical bytes was written: last-page tails and unused pages.
    written = np.zeros(len(region), dtype=bool)
    for i in range(k):
        logical = np.arange(kv.block_bytes)
        written[pages[i][logical // page_size].astype(np.int64) * page_size + logical % page_size] = True
    assert np.array_equal(region[~written], before[~written])

    # Load into other block ids (and in another order).
    load_blocks = [1, 9, 2, 6, 10]
    orig = snapshot(tensors)
    expected = {b: block_bytes_of(tensors, s) for s, b in zip(store_blocks, load_blocks)}
    back = kv.descriptors(load_blocks, pages, region.ctypes.data, to_region=False)
    assert back.total_bytes == k * kv.block_bytes
    run_memmove(back)
    for b in range(NUM_BLOCKS):
        want = expected.get(b) or b"".join(o[b * len(o) // NUM_BLOCKS:(b + 1) * len(o) // NUM_BLOCKS] for o in orig)
        assert block_bytes_of(tensors, b) == want, b
    for s, b in zip(store_blocks, load_blocks):
        for t in tensors:
            assert torch.equal(t[b].view(torch.uint8), t[s].view(torch.uint8))


@pytest.mark.parametrize("name", CACHES)
def test_pages_as_wire_bytes(name):
    tensors = caches()[name]
    kv = KVCacheLayout(tensors, 4096)
    per_block = math.ceil(kv.block_bytes / 4096)
    pages = np.arange(2 * per_block, dtype=np.uint32)[::-1].copy()
    wire = pages.astype("<u4").tobytes()                      # how pages travel in replies
    region = np.zeros(2 * per_block * 4096, dtype=np.uint8)
    run_memmove(kv.descriptors([4, 8], np.frombuffer(wire, "<u4"), region.ctypes.data, to_region=True))
    assert page_bytes(region, pages[:per_block], 4096, kv.block_bytes) == block_bytes_of(tensors, 4)
    assert page_bytes(region, pages[per_block:], 4096, kv.block_bytes) == block_bytes_of(tensors, 8)


def test_page_larger_than_block_holds_one_block_per_page():
    tensors = caches()["cross-layer-f16"]
    kv = KVCacheLayout(tensors, 1 << 20)
    region = np.zeros(4 << 20, dtype=np.uint8)
    run_memmove(kv.descriptors([2, 3], [[3], [1]], region.ctypes.data, to_region=True))
    assert region[3 << 20:][:kv.block_bytes].tobytes() == block_bytes_of(tensors, 2)
    assert region[1 << 20:][:kv.block_bytes].tobytes() == block_bytes_of(tensors, 3)
    assert not region[:1 << 20].any() and not region[2 << 20:3 << 20].any()


def test_descriptor_addresses():
    t0 = rand_tensor((NUM_BLOCKS, 8), torch.uint8, 1)
    t1 = rand_tensor((NUM_BLOCKS, 4), torch.int32, 2)     # 16-byte rows
    kv = KVCacheLayout([t0, t1], 16)                      # block of 24 bytes: pages of 16
    d = kv.descriptors([5], [[7, 2]], 1 << 20, to_region=True)
    # layer0 row (8 B) -> page 7 [0,8); layer1 row first 8 B -> page 7 [8,16); last 8 B -> page 2 [0,8)
    assert d.src.tolist() == [t0.data_ptr() + 5 * 8, t1.data_ptr() + 5 * 16, t1.data_ptr() + 5 * 16 + 8]
    assert d.dst.tolist() == [(1 << 20) + 7 * 16, (1 << 20) + 7 * 16 + 8, (1 << 20) + 2 * 16]
    assert d.nbytes.tolist() == [8, 8, 8]
    r = kv.descriptors([5], [[7, 2]], 1 << 20, to_region=False)
    assert (r.src.tolist(), r.dst.tolist(), r.nbytes.tolist()) == (d.dst.tolist(), d.src.tolist(), d.nbytes.tolist())


def test_contiguous_job_coalesces_to_one_copy():
    # Cross-layer tensor, block == page, consecutive blocks into consecutive pages: one memmove.
    t = rand_tensor((NUM_BLOCKS, 4, 16, 64), torch.uint8, 3)       # 4096-byte blocks
    kv = KVCacheLayout([t], 4096)
    region = np.zeros(16 * 4096, dtype=np.uint8)
    d = kv.descriptors([2, 3, 4, 5], [[6], [7], [8], [9]], region.ctypes.data, to_region=True)
    assert len(d) == 1
    assert d.nbytes.tolist() == [4 * 4096]
    run_memmove(d)
    assert region[6 * 4096:10 * 4096].tobytes() == b"".join(row(t, b) for b in (2, 3, 4, 5))


def test_empty_job():
    kv = KVCacheLayout(caches()["mla-uint8-3layers"], 4096)
    d = kv.descriptors([], np.zeros((0, 14), np.uint32), 0, to_region=True)
    assert len(d) == 0 and d.total_bytes == 0
    assert run_memmove(d) == 0


@pytest.mark.parametrize("bad", [[-1], [NUM_BLOCKS], [0, NUM_BLOCKS + 5], [2, -3]])
def test_out_of_range_block_ids(bad):
    kv = KVCacheLayout(caches()["mla-uint8-3layers"], 4096)
    per = math.ceil(kv.block_bytes / 4096)
    with pytest.raises(ValueError, match="block ids"):
        kv.descriptors(bad, np.zeros((len(bad), per), np.uint32), 0, to_region=True)


def test_registration_errors():
    with pytest.raises(ValueError):
        KVCacheLayout([], 4096)
    with pytest.raises(ValueError, match="number of blocks"):
        KVCacheLayout([torch.zeros(4, 8), torch.zeros(5, 8)], 4096)
    transposed = torch.zeros(4, 16, 8).transpose(1, 2)             # rows not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        KVCacheLayout([transposed], 4096)


def test_layout_properties():
    tensors = caches()["strided-rows"]
    kv = KVCacheLayout(tensors, 4096)
    assert kv.row_bytes.tolist() == [16 * 40 * 2, 16 * 40 * 2]
    assert kv.row_stride.tolist() == [2 * 16 * 40 * 2] * 2         # rows interleave
    assert kv.base.tolist() == [t.data_ptr() for t in tensors]
    assert kv.device == torch.device("cpu")


# --- coalescing -------------------------------------------------------------------------------------
def D(src, dst, n) -> Descriptors:
    u = lambda x: np.asarray(x, dtype=np.uint64)  # noqa: E731
    return Descriptors(u(src), u(dst), u(n))


def test_coalesced_merges_runs_contiguous_on_both_sides():
    d = D([0, 10, 20, 100, 105, 110], [1000, 1010, 1020, 2000, 3000, 3005], [10, 10, 5, 5, 5, 5])
    c = d.coalesced()
    assert c.src.tolist() == [0, 100, 105]
    assert c.dst.tolist() == [1000, 2000, 3000]
    assert c.nbytes.tolist() == [25, 5, 10]
    assert c.total_bytes == d.total_bytes


def test_coalesced_trivial_cases():
    assert len(Descriptors.empty().coalesced()) == 0
    one = D([5], [6], [7])
    assert one.coalesced().nbytes.tolist() == [7]
    none_merge = D([0, 20], [0, 40], [10, 10])
    assert len(none_merge.coalesced()) == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.booleans(), st.booleans()), min_size=1, max_size=40))
def test_coalesced_property(spec):
    # Build pieces that sometimes continue the previous one on the source and/or destination side;
    # the coalesced copy must move exactly the same bytes to the same places.
    src_buf = np.random.default_rng(len(spec)).integers(0, 256, 8192, dtype=np.uint8)
    total = sum(n for n, _, _ in spec)
    src, dst, nb = [], [], []
    s = d = 0
    for n, same_src, same_dst in spec:
        s = s if same_src else s + 3
        d = d if same_dst else d + 5
        src.append(s)
        dst.append(d)
        nb.append(n)
        s += n
        d += n
    assert s < len(src_buf) and d < 8192 + total
    base_s = src_buf.ctypes.data
    out_a = np.zeros(8192 * 2, dtype=np.uint8)
    out_b = np.zeros(8192 * 2, dtype=np.uint8)
    da = D(np.add(src, base_s), np.add(dst, out_a.ctypes.data), nb)
    db = D(np.add(src, base_s), np.add(dst, out_b.ctypes.data), nb)
    c = db.coalesced()
    assert c.total_bytes == da.total_bytes == total
    assert len(c) == 1 + sum(1 for _, ss, sd in spec[1:] if not (ss and sd))
    run_memmove(da)
    run_memmove(c)
    assert np.array_equal(out_a, out_b)


# --- CPU copier ---------------------------------------------------------------------------------------
def test_cpu_copier_submit_wait_done():
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    copier = CPUCopier()
    try:
        h = copier.submit(D([src.ctypes.data], [dst.ctypes.data], [len(src)]))
        h.wait(timeout=30)
        assert h.done()
        assert h.error() is None
        assert np.array_equal(src, dst)
    finally:
        copier.close()


def test_cpu_copier_copies_complete_in_submission_order():
    a = np.full(4096, 1, dtype=np.uint8)
    b = np.full(4096, 2, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    copier = CPUCopier()
    try:
        handles = [copier.submit(D([(a if i % 2 == 0 else b).ctypes.data], [dst.ctypes.data], [4096]))
                   for i in range(9)]
        handles[-1].wait(timeout=30)
        assert all(h.done() for h in handles)        # earlier copies finished before the last
        assert (dst == 1).all()                       # the 9th copy (from a) landed last
    finally:
        copier.close()


def test_cpu_copier_empty_copy_is_done_at_once():
    copier = CPUCopier()
    try:
        h = copier.submit(Descriptors.empty())
        assert h.done() and h.error() is None
        h.wait()
    finally:
        copier.close()
    assert CopyHandle().done()


def test_cpu_copier_reports_a_failed_copy():
    copier = CPUCopier()
    try:
        broken = Descriptors(None, None, np.ones(1, dtype=np.uint64))   # .tolist() fails in the worker
        h = copier.submit(broken)
        with pytest.raises(AttributeError):
            h.wait(timeout=30)
        assert h.done()
        assert isinstance(h.error(), AttributeError)
        ok = np.zeros(8, np.uint8)
        copier.submit(D([np.ones(8, np.uint8).ctypes.data], [ok.ctypes.data], [0])).wait(timeout=30)  # still serves
    finally:
        copier.close()


def test_cpu_copier_full_job_round_trip():
    tensors = caches()["mla-bf16-3layers"]
    kv = KVCacheLayout(tensors, 16384)
    per = math.ceil(kv.block_bytes / 16384)
    region = np.zeros(4 * per * 16384, dtype=np.uint8)
    pages = np.random.default_rng(9).permutation(4 * per)[:2 * per].reshape(2, per)
    copier = CPUCopier()
    try:
        copier.submit(kv.descriptors([1, 2], pages, region.ctypes.data, to_region=True)).wait(timeout=30)
        copier.submit(kv.descriptors([8, 9], pages, region.ctypes.data, to_region=False)).wait(timeout=30)
    finally:
        copier.close()
    assert block_bytes_of(tensors, 8) == block_bytes_of(tensors, 1)
    assert block_bytes_of(tensors, 9) == block_bytes_of(tensors, 2)


def test_select_copier_for_cpu_tensors():
    for name in ("auto", "cpu"):
        copier = select_copier(name, torch.device("cpu"))
        assert isinstance(copier, CPUCopier)
        copier.close()
    with pytest.raises(ValueError):
        select_copier("bogus", torch.device("cpu"))
    with pytest.raises(ValueError):
        select_copier("cuda", torch.device("cpu"))
    with pytest.raises(ValueError):
        select_copier("cpu", torch.device("cuda"))

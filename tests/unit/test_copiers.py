"""Copiers and descriptors on the CPU: every KV-cache layout, copier selection, pinning.

What runs here without a GPU:
- descriptors for MLA per-layer tensors (bf16, fp8), the cross-layer layout, and head-sharded
  GQA shards (separate K/V tensors, and K/V interleaved per block as FlashInfer lays them out),
  executed by the CPU copier against a NumPy "region", store then load, compared byte for byte;
- the kernel copier's host-side pieces: chunk splitting, the span table of the torch copier,
  event handles, copier selection and its errors without CuPy or CUDA;
- the kernel's per-warp copy schedule, compiled by nvcc and run lane by lane on the host;
- per-process pinning of a mapping: chunking, rollback, one warning line, fallback.
The same copies on a real device are in tests/gpu/.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import subprocess
import sys
import types
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.copy import (AddressRanges, CopierUnavailable, CopyHandle, CPUCopier, EventCopyHandle,
                         storage_ranges, stream_handle)
from kvtier import cuda as cuda_mod
from kvtier.cuda import KERNEL_NAME, SPLIT_CHUNK_BYTES, kernel_source, split_descriptors
from kvtier.kvcache import Descriptors, KVCacheLayout
from kvtier.select import select_copier
from kvtier.torch_copy import SpanTable, host_view, storage_view
from kvtierd.contract import mapping as mapping_mod
from kvtierd.contract.mapping import Mapping

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# KV-cache layouts
# ---------------------------------------------------------------------------------------------

def random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random *bytes* (bf16/fp8 NaN patterns included: the tests compare bytes)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def mla_per_layer(dtype, layers=5, num_blocks=24, block_tokens=64, gen=None):
    """DeepSeek-style MLA: one latent [num_blocks, block_tokens, 576] tensor per layer."""
    return [random_tensor((num_blocks, block_tokens, 576), dtype, gen) for _ in range(layers)]


def mla_cross_layer(dtype, layers=5, num_blocks=24, block_tokens=64, gen=None):
    """All layers of a block contiguous: one tensor [num_blocks, layers, block_tokens, 576]."""
    return [random_tensor((num_blocks, layers, block_tokens, 576), dtype, gen)]


def gqa_shard(tp=2, layers=4, num_blocks=24, block_tokens=16, kv_heads=8, head_dim=128, gen=None):
    """One TP rank's head shard: per layer a K and a V tensor [num_blocks, block_tokens, heads/tp, head_dim]."""
    shape = (num_blocks, block_tokens, kv_heads // tp, head_dim)
    return [random_tensor(shape, torch.bfloat16, gen) for _ in range(2 * layers)]


def gqa_shard_interleaved(tp=2, layers=4, num_blocks=24, block_tokens=16, kv_heads=8, head_dim=128, gen=None):
    """FlashInfer-style [num_blocks, 2, block_tokens, heads/tp, head_dim] per layer, registered as
    the views K = kv[:, 0] and V = kv[:, 1]: one storage, rows strided by 2 × row bytes."""
    tensors = []
    for _ in range(layers):
        kv = random_tensor((num_blocks, 2, block_tokens, kv_heads // tp, head_dim), torch.bfloat16, gen)
        tensors += [kv[:, 0], kv[:, 1]]
    return tensors


LAYOUTS = {
    "mla-bf16": lambda g: mla_per_layer(torch.bfloat16, gen=g),
    "mla-fp8": lambda g: mla_per_layer(torch.float8_e4m3fn, gen=g),
    "mla-cross-layer-bf16": lambda g: mla_cross_layer(torch.bfloat16, gen=g),
    "mla-cross-layer-fp8": lambda g: mla_cross_layer(torch.float8_e4m3fn, gen=g),
    "gqa-tp2-shard": lambda g: gqa_shard(tp=2, gen=g),
    "gqa-tp8-shard": lambda g: gqa_shard(tp=8, gen=g),
    "gqa-flashinfer-tp2": lambda g: gqa_shard_interleaved(gen=g),
}


def block_bytes(tensors, b: int) -> bytes:
    """A block's logical bytes: its row of every registered tensor, in registration order."""
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def all_blocks(tensors) -> list[bytes]:
    return [block_bytes(tensors, b) for b in range(tensors[0].shape[0])]


class Region:
    """A NumPy stand-in for the mapped region: page p lives at data + p × page_size."""

    def __init__(self, pages: int, page_size: int):
        self.page_size = page_size
        self.buf = np.zeros(pages * page_size, dtype=np.uint8)
        self.data = self.buf.ctypes.data

    def entry(self, pages: np.ndarray, nbytes: int) -> bytes:
        ps = self.page_size
        return b"".join(self.buf[p * ps:(p + 1) * ps].tobytes() for p in pages)[:nbytes]


def store_and_load(tensors, page_size: int, rng: np.random.Generator, make_copy):
    """Store random blocks to random pages, load them into other blocks; check every byte.

    ``make_copy(tensors, region)`` returns the function that performs a Descriptors copy to completion.
    """
    kv = KVCacheLayout(tensors, page_size)
    nb = kv.num_blocks
    k = nb // 3
    per_block = -(-kv.block_bytes // page_size)
    region = Region(k * per_block + 5, page_size)
    blocks = rng.choice(nb, size=k, replace=False)
    pages = rng.permutation(k * per_block + 5)[:k * per_block].reshape(k, per_block)
    run_copy = make_copy(tensors, region)

    store = kv.descriptors(blocks, pages, region.data, to_region=True)
    assert store.total_bytes == k * kv.block_bytes
    assert np.all(store.nbytes > 0)
    run_copy(store)
    for i, b in enumerate(blocks):
        assert region.entry(pages[i], kv.block_bytes) == block_bytes(tensors, b), f"block {b} stored wrong"
    unused = np.setdiff1d(np.arange(k * per_block + 5), pages)
    for p in unused:
        assert not region.buf[p * page_size:(p + 1) * page_size].any(), "a store wrote outside its pages"

    targets = rng.permutation(np.setdiff1d(np.arange(nb), blocks))[:k]
    for t in tensors:
        for b in targets:
            t[b].view(torch.uint8).zero_()
    before = all_blocks(tensors)
    load = kv.descriptors(targets, pages, region.data, to_region=False)
    assert load.total_bytes == k * kv.block_bytes
    run_copy(load)
    after = all_blocks(tensors)
    loaded = dict(zip(targets.tolist(), blocks.tolist()))
    for b in range(nb):
        if b in loaded:
            assert after[b] == before[loaded[b]], f"block {b} did not receive block {loaded[b]}'s bytes"
        else:
            assert after[b] == before[b], f"block {b} changed but was not a load target"
    return store, load


def with_cpu_copier(tensors, region):
    return cpu_copy


def cpu_copy(desc: Descriptors) -> None:
    copier = CPUCopier()
    try:
        handle = copier.submit(desc)
        handle.wait(30)
        assert handle.done() and handle.error() is None
    finally:
        copier.close()


@pytest.mark.parametrize("page_size", [64 << 10, 4096, 3000])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_roundtrip_cpu_copier(layout, page_size):
    gen = torch.Generator().manual_seed(page_size + sorted(LAYOUTS).index(layout))
    store_and_load(LAYOUTS[layout](gen), page_size, np.random.default_rng(page_size), with_cpu_copier)


def test_mla_geometry_piece_counts():
    """DeepSeek-V3 rows (64 tokens × 576 × bf16 = 72 KiB) straddle 64 KiB pages; fp8 rows do not."""
    gen = torch.Generator().manual_seed(1)
    bf16 = KVCacheLayout(mla_per_layer(torch.bfloat16, layers=61, num_blocks=2, gen=gen), 64 << 10)
    fp8 = KVCacheLayout(mla_per_layer(torch.float8_e4m3fn, layers=61, num_blocks=2, gen=gen), 64 << 10)
    assert bf16.block_bytes == 61 * 64 * 576 * 2 and fp8.block_bytes == 61 * 64 * 576
    # Every cut is at a row end or a page boundary: pieces = rows + pages - coinciding cuts.
    assert len(bf16.template) <= 61 + math.ceil(bf16.block_bytes / (64 << 10))
    assert int(bf16.template.nbytes.max()) <= 64 << 10
    assert int(fp8.template.nbytes.max()) <= 576 * 64


def test_sharded_ranks_build_independent_descriptors():
    """Each GQA rank registers its own shard; descriptors of one rank never touch the other's."""
    gen = torch.Generator().manual_seed(2)
    shards = [gqa_shard(tp=2, gen=gen) for _ in range(2)]
    layouts = [KVCacheLayout(s, 64 << 10) for s in shards]
    assert layouts[0].block_bytes == layouts[1].block_bytes == 4 * 2 * 16 * 4 * 128 * 2
    pages = np.arange(4).reshape(2, 2)
    spans = [[(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in s] for s in shards]
    for r, kv in enumerate(layouts):
        desc = kv.descriptors([3, 7], pages, 1 << 40, to_region=True)
        own = np.zeros(len(desc), dtype=bool)
        for lo, hi in spans[r]:
            own |= (desc.src >= lo) & (desc.src + desc.nbytes <= hi)
        assert own.all()


# ---------------------------------------------------------------------------------------------
# The kernel copier's host side
# ---------------------------------------------------------------------------------------------

def test_kernel_source_is_found_and_exports_the_entry_point():
    src = kernel_source()
    assert f'extern "C" __global__ void {KERNEL_NAME}(' in src
    assert "#include" not in src.split("*/", 1)[1], "NVRTC compiles the file without host headers"


def random_descriptors(rng, count: int, max_bytes: int, buf_bytes: int):
    """Non-overlapping pieces: sources from one buffer, destinations in another, odd offsets included."""
    src_buf = rng.integers(0, 256, buf_bytes, dtype=np.uint8)
    sizes = rng.integers(0, max_bytes, count)
    dst_starts = np.concatenate([[0], np.cumsum(sizes + rng.integers(0, 40, count))[:-1]])
    dst_buf = np.zeros(int(dst_starts[-1] + sizes[-1]) + 64, dtype=np.uint8)
    src_starts = rng.integers(0, buf_bytes - max_bytes, count)
    desc = Descriptors((src_buf.ctypes.data + src_starts).astype(np.uint64),
                       (dst_buf.ctypes.data + dst_starts).astype(np.uint64), sizes.astype(np.uint64))
    return src_buf, dst_buf, desc


def test_split_descriptors_copies_the_same_bytes():
    rng = np.random.default_rng(5)
    src_buf, dst_buf, desc = random_descriptors(rng, 200, 300_000, 1 << 20)
    split = split_descriptors(desc)
    pieces = -(-desc.nbytes.astype(np.int64) // SPLIT_CHUNK_BYTES)       # per parent
    assert int(split.nbytes.max()) <= SPLIT_CHUNK_BYTES and split.total_bytes == desc.total_bytes
    assert len(split) == int(np.sum(pieces))
    # Cutting at multiples of 16 keeps each piece in its parent's alignment class.
    owner = np.searchsorted(np.cumsum(pieces), np.arange(len(split)), side="right")
    assert np.array_equal(split.src % 16, desc.src[owner] % 16)
    assert np.array_equal(split.dst % 16, desc.dst[owner] % 16)
    pristine = dst_buf.copy()
    cpu_copy(desc)
    reference = dst_buf.copy()
    dst_buf[:] = pristine
    cpu_copy(split)
    assert np.array_equal(dst_buf, reference)


def test_split_descriptors_small_pieces_unchanged_and_bad_chunk():
    rng = np.random.default_rng(6)
    _, _, desc = random_descriptors(rng, 50, 1000, 1 << 16)
    assert split_descriptors(desc) is desc
    assert split_descriptors(Descriptors.empty()).__len__() == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        split_descriptors(desc, 1000)


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_kernel_lane_schedule_on_host(tmp_path):
    """Compile csrc/kvtier_copy.cu (warnings are errors) with a host harness and run every lane."""
    exe = tmp_path / "harness"
    build = subprocess.run([NVCC, "-arch=sm_90", "-Werror", "all-warnings", "-Xcompiler", "-Wall",
                            "-I", str(REPO / "csrc"), str(Path(__file__).with_name("copy_kernel_harness.cu")),
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr


class FakeCupy:
    """Just enough of CuPy's API for CudaKernelCopier, executing the "kernel" on the CPU.

    It checks the copier's host-side protocol without a GPU: the descriptor table the kernel
    would read (rows src, dst, nbytes), the launch shape, the order of the calls on the streams
    (the copy stream waits for an event recorded on the compute stream before the launch, and the
    completion event follows it), and the refusal of unregistered host memory. The real API is
    exercised by tests/gpu/.
    """

    def __init__(self, registered: list[tuple[int, int]], sms: int = 2):
        self.calls: list[tuple] = []
        calls = self.calls

        class Ctx:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Device(Ctx):
            def __init__(self, index):
                self.attributes = {"MultiProcessorCount": sms}

        class Stream(Ctx):
            ptr = 0x5000

            def __init__(self, non_blocking=False):
                assert non_blocking, "the copy stream must not synchronise with the legacy default stream"

            def synchronize(self):
                calls.append(("stream-sync",))

        class Event:
            def __init__(self, block=False, disable_timing=False):
                self.ptr, self.recorded = 0x6000 + len(calls), False

            def record(self, stream):
                calls.append(("done-event", stream.ptr))
                self.recorded = True

            @property
            def done(self):
                return self.recorded

            def synchronize(self):
                pass

        class DeviceArray:
            def __init__(self, shape, dtype):
                self.host = np.zeros(shape, dtype)

            def set(self, arr, stream):
                calls.append(("upload", stream.ptr, arr.shape))
                self.host[...] = arr

            def __getitem__(self, i):
                return self.host[i]

        def launch(grid, block, args):
            src, dst, nbytes, count = args
            calls.append(("launch", grid, block, int(count)))
            for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist()):
                ctypes.memmove(d, s, n)

        def pointer_attributes(ptr):
            host = any(a <= ptr < a + n for a, n in registered)
            return types.SimpleNamespace(type=1 if host else 0, devicePointer=ptr if host else 0)

        runtime = types.SimpleNamespace(
            CUDARuntimeError=RuntimeError, memoryTypeHost=1, getDeviceCount=lambda: 1,
            pointerGetAttributes=pointer_attributes,
            eventRecord=lambda event, stream: calls.append(("order-record", event, stream)),
            streamWaitEvent=lambda stream, event, flags: calls.append(("order-wait", stream, event)))
        self.cupy = types.SimpleNamespace(
            cuda=types.SimpleNamespace(runtime=runtime, Device=Device, Stream=Stream, Event=Event),
            RawModule=lambda code, options: types.SimpleNamespace(
                get_function=lambda name: launch if name in code else None),
            empty=DeviceArray, uint64=np.uint64)
        self.cupyx = types.SimpleNamespace(empty_pinned=lambda shape, dtype: np.empty(shape, dtype))

    def install(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "cupy", self.cupy)
        monkeypatch.setitem(sys.modules, "cupyx", self.cupyx)
        monkeypatch.setattr(cuda_mod, "_kernels", {})


def test_kernel_copier_host_protocol_with_a_stand_in_cupy(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    tensors = mla_per_layer(torch.bfloat16, layers=3, num_blocks=12, gen=gen)
    fake = None

    def with_kernel_copier(tensors, region):
        nonlocal fake
        fake = FakeCupy([(region.data, region.buf.nbytes)])
        fake.install(monkeypatch)
        copier = cuda_mod.CudaKernelCopier(CUDA0, tensors, [(region.data, region.buf.nbytes)], stream=0x1234)

        def copy(desc):
            handle = copier.submit(desc)
            handle.wait(5)
            assert handle.done() and handle.error() is None
        return copy

    store, load = store_and_load(tensors, 64 << 10, np.random.default_rng(8), with_kernel_copier)
    launches = [c for c in fake.calls if c[0] == "launch"]
    assert [c[3] for c in launches] == [len(store), len(load)]          # one launch per job
    assert all(c[1] == (min(-(-c[3] // 8), 2 * cuda_mod.BLOCKS_PER_SM),) and c[2] == (256,) for c in launches)
    kinds = [c[0] for c in fake.calls]
    first = kinds.index("launch")
    assert kinds[first - 3:first + 2] == ["upload", "order-record", "order-wait", "launch", "done-event"]
    record, wait = fake.calls[first - 2], fake.calls[first - 1]
    assert record[2] == 0x1234 and wait[1] == 0x5000 and wait[2] == record[1]


def test_kernel_copier_refuses_unregistered_memory_and_stray_addresses(monkeypatch):
    region = np.zeros(1 << 20, dtype=np.uint8)
    kv = torch.zeros(8, 40960, dtype=torch.uint8)          # 320 KiB: one piece, split into 5 chunks
    FakeCupy(registered=[]).install(monkeypatch)
    with pytest.raises(CopierUnavailable, match="not registered"):
        cuda_mod.CudaKernelCopier(CUDA0, [kv], [(region.ctypes.data, region.nbytes)])

    fake = FakeCupy(registered=[(region.ctypes.data, region.nbytes)])
    fake.install(monkeypatch)
    copier = cuda_mod.CudaKernelCopier(CUDA0, [kv], [(region.ctypes.data, region.nbytes)], stream=0)
    stray = Descriptors(np.array([kv.data_ptr()], np.uint64), np.array([region.ctypes.data + region.nbytes - 8],
                                                                       np.uint64), np.array([16], np.uint64))
    with pytest.raises(ValueError, match="outside"):
        copier.submit(stray)
    big = Descriptors(np.array([region.ctypes.data], np.uint64), np.array([kv.data_ptr()], np.uint64),
                      np.array([kv.numel()], np.uint64))
    region[:kv.numel()] = np.arange(kv.numel()) % 251
    copier.submit(big).wait(5)
    assert [c[3] for c in fake.calls if c[0] == "launch"] == [-(-kv.numel() // SPLIT_CHUNK_BYTES)] == [5]
    assert np.array_equal(kv.numpy().ravel(), region[:kv.numel()])
    copier.close()
    assert fake.calls[-1] == ("stream-sync",)


# ---------------------------------------------------------------------------------------------
# The torch copier's span table (its copy loop runs on CPU tensors too)
# ---------------------------------------------------------------------------------------------

def with_span_table(tensors, region):
    """The torch copier's copy path on CPU tensors: resolve to (span, offset), copy_ per piece."""
    table = SpanTable.for_copier(tensors, [(region.data, region.buf.nbytes)])
    assert len(table.views) == len({t.untyped_storage().data_ptr() for t in tensors}) + 1

    def copy(desc: Descriptors) -> None:
        table.copy(table.plan(desc))
    return copy


@pytest.mark.parametrize("layout", ["mla-bf16", "gqa-flashinfer-tp2", "mla-cross-layer-fp8"])
def test_span_table_copies_like_the_cpu_copier(layout):
    gen = torch.Generator().manual_seed(9)
    store_and_load(LAYOUTS[layout](gen), 64 << 10, np.random.default_rng(3), with_span_table)


def test_span_table_rejects_addresses_outside_every_span():
    a = torch.zeros(1000, dtype=torch.uint8)
    table = SpanTable([storage_view(a)])
    base = a.data_ptr()
    ok = Descriptors(np.array([base], np.uint64), np.array([base + 500], np.uint64), np.array([500], np.uint64))
    table.copy(table.plan(ok))
    for src, n in [(base + 600, 500), (base - 1, 10), (base + 2000, 1)]:
        bad = Descriptors(np.array([src], np.uint64), np.array([base], np.uint64), np.array([n], np.uint64))
        with pytest.raises(ValueError, match="outside the registered KV-cache tensors and the region"):
            table.plan(bad)


def test_span_table_rejects_overlap_and_dedupes_shared_storage():
    kv = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert len(SpanTable([storage_view(kv[:, 0]), storage_view(kv[:, 1])]).views) == 1
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        SpanTable([host_view(buf.ctypes.data, 4096), host_view(buf.ctypes.data + 1024, 1024)])


def test_device_copiers_check_every_descriptor_against_their_ranges():
    """What the kernel copier runs before a launch: a stray address must never reach the GPU."""
    kv = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    region = np.zeros(4096, dtype=np.uint8)
    ranges = AddressRanges(storage_ranges([kv[:, 0], kv[:, 1]]) + [(region.ctypes.data, region.nbytes)])
    assert len(ranges.base) == 2                       # K and V views share one storage
    layout = KVCacheLayout([kv[:, 0], kv[:, 1]], 1024)
    ranges.check(layout.descriptors([1, 3], np.array([[0], [2]]), region.ctypes.data, to_region=True))
    with pytest.raises(ValueError, match="descriptor 1: .* lies outside"):
        ranges.check(layout.descriptors([1, 3], np.array([[0], [4]]), region.ctypes.data, to_region=True))
    with pytest.raises(ValueError, match="no memory was registered"):
        AddressRanges([]).check(Descriptors(np.array([1], np.uint64), np.array([2], np.uint64),
                                            np.array([1], np.uint64)))


# ---------------------------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------------------------

class FakeEvent:
    def __init__(self, polls_until_done=2, error=None):
        self.polls, self.error, self.synced = polls_until_done, error, 0

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.synced += 1
        if self.error is not None:
            raise self.error


def test_event_handle_polls_until_done():
    ev = FakeEvent(polls_until_done=2)
    h = EventCopyHandle(ev.query, ev.synchronize)
    assert not h.done() and not h.done() and h.error() is None
    assert h.done() and h.done() and h.error() is None
    h.wait(0)


def test_event_handle_device_error_is_a_finished_failure():
    boom = RuntimeError("cudaErrorIllegalAddress")
    ev = FakeEvent(error=boom)
    h = EventCopyHandle(ev.query, ev.synchronize)
    assert h.done() and h.error() is boom
    with pytest.raises(RuntimeError, match="IllegalAddress"):
        h.wait()
    h2 = EventCopyHandle(ev.query, ev.synchronize)
    with pytest.raises(RuntimeError):
        h2.wait(None)
    assert ev.synced == 1 and h2.error() is boom


def test_event_handle_wait_timeout_and_blocking_wait():
    never = FakeEvent(polls_until_done=10**9)
    h = EventCopyHandle(never.query, never.synchronize)
    with pytest.raises(FutureTimeout):
        h.wait(0.01)
    assert not h.done()
    h.wait(None)            # synchronize() returning means the event completed
    assert h.done() and never.synced == 1 and h.error() is None


def test_empty_handle_is_done():
    h = CopyHandle()
    assert h.done() and h.error() is None
    h.wait(0)


# ---------------------------------------------------------------------------------------------
# Copier selection
# ---------------------------------------------------------------------------------------------

CUDA0 = torch.device("cuda", 0)
SPAN = [(1 << 30, 1 << 20)]


@pytest.mark.parametrize("name", ["auto", "cpu"])
def test_cpu_tensors_get_the_cpu_copier(name):
    copier = select_copier(name, torch.device("cpu"))
    assert isinstance(copier, CPUCopier)
    copier.close()


@pytest.mark.parametrize("name", ["cuda", "torch"])
def test_device_copiers_refuse_cpu_tensors(name):
    with pytest.raises(ValueError, match="'cpu' copier"):
        select_copier(name, torch.device("cpu"))


def test_unknown_copier_and_device_mismatches():
    with pytest.raises(ValueError, match="auto, cpu, cuda, torch"):
        select_copier("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot reach KV caches on cuda:0"):
        select_copier("cpu", CUDA0, host_spans=SPAN)
    with pytest.raises(ValueError, match="host_spans"):
        select_copier("auto", CUDA0)
    with pytest.raises(ValueError, match="not supported"):
        select_copier("auto", torch.device("meta"))


def test_forced_cuda_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)     # import cupy → ImportError, whatever is installed
    with pytest.raises(CopierUnavailable, match="needs CuPy.*cupy-cuda12x or cupy-cuda13x"):
        select_copier("cuda", CUDA0, host_spans=SPAN)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_forced_torch_and_auto_without_cuda(monkeypatch):
    with pytest.raises(CopierUnavailable, match="is_available"):
        select_copier("torch", CUDA0, kv_tensors=[torch.zeros(2, 4)], host_spans=SPAN)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(CopierUnavailable, match="no copier can serve KV caches on cuda:0: cuda: .*; torch: "):
        select_copier("auto", CUDA0, kv_tensors=[torch.zeros(2, 4)], host_spans=SPAN)


def test_stream_handle_accepts_torch_cupy_and_raw_handles():
    class TorchLike:
        cuda_stream = 1234

    class CupyLike:
        ptr = 5678

    assert stream_handle(0) == 0
    assert stream_handle(TorchLike()) == 1234
    assert stream_handle(CupyLike()) == 5678
    with pytest.raises(TypeError, match="not a CUDA stream"):
        stream_handle("default")


# ---------------------------------------------------------------------------------------------
# Per-process pinning of the region mapping
# ---------------------------------------------------------------------------------------------

class FakeCudart:
    """Records cudaHostRegister/Unregister calls; fails the registration number ``fail_at``."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.registered, self.unregistered = fail_at, [], []

    def runtime(self):
        def reg(ptr, size, flags):
            if len(self.registered) == self.fail_at:
                raise RuntimeError("cudaErrorMemoryAllocation")
            self.registered.append((ptr, size, flags))

        return mapping_mod.CudaRuntime(reg, self.unregistered.append)


@pytest.fixture
def small_mapping(tmp_path, monkeypatch):
    path = tmp_path / "region"
    size = 4 * mapping_mod.OS_PAGE + 100        # a partial last chunk
    path.write_bytes(b"\0" * size)
    # Shrink the 64 GiB chunk to one OS page so that a small file exercises the chunking.
    monkeypatch.setattr(mapping_mod, "CUDA_REGISTER_CHUNK_BYTES", mapping_mod.OS_PAGE)
    m = Mapping.of_file(str(path))
    yield m
    m.close()


def test_pin_cuda_registers_page_aligned_chunks_and_unregisters_on_close(small_mapping, monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(mapping_mod.CudaRuntime, "load", classmethod(lambda cls: fake.runtime()))
    assert small_mapping.pin_cuda(required=True)
    page = mapping_mod.OS_PAGE
    assert [p for p, _, _ in fake.registered] == [small_mapping.address + i * page for i in range(5)]
    assert all(p % page == 0 for p, _, _ in fake.registered)
    assert [n for _, n, _ in fake.registered] == [page] * 4 + [100]
    assert {f for _, _, f in fake.registered} == {1 | 2}          # portable | mapped
    assert small_mapping.pinned == "cuda"
    small_mapping.close()
    assert fake.unregistered == [p for p, _, _ in fake.registered]


def test_pin_cuda_failure_rolls_back_and_warns_once(small_mapping, monkeypatch, caplog):
    fake = FakeCudart(fail_at=3)
    monkeypatch.setattr(mapping_mod.CudaRuntime, "load", classmethod(lambda cls: fake.runtime()))
    with caplog.at_level(logging.WARNING, logger="kvtierd.contract.mapping"):
        assert small_mapping.pin_cuda(required=False) is False
    assert fake.unregistered == [p for p, _, _ in fake.registered] and len(fake.registered) == 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "left unpinned" in warnings[0].getMessage()
    assert small_mapping.pinned == "off"
    fake.registered.clear()
    fake.unregistered.clear()
    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        small_mapping.pin_cuda(required=True)
    assert fake.unregistered == [p for p, _, _ in fake.registered]


def test_pin_cuda_without_cuda_is_quiet_unless_required(small_mapping, monkeypatch, caplog):
    monkeypatch.setattr(mapping_mod.CudaRuntime, "load", classmethod(lambda cls: None))
    with caplog.at_level(logging.WARNING, logger="kvtierd.contract.mapping"):
        assert small_mapping.pin_cuda(required=False) is False
    assert not caplog.records
    with pytest.raises(RuntimeError, match="no usable CUDA"):
        small_mapping.pin_cuda(required=True)


def test_daemon_pin_auto_falls_back_from_failed_cuda_to_mlock(small_mapping, monkeypatch):
    fake = FakeCudart(fail_at=0)
    monkeypatch.setattr(mapping_mod.CudaRuntime, "load", classmethod(lambda cls: fake.runtime()))
    monkeypatch.setattr(mapping_mod.resource, "getrlimit", lambda _: (mapping_mod.resource.RLIM_INFINITY,) * 2)
    monkeypatch.setattr(mapping_mod._libc, "mlock", lambda addr, size: 0)
    monkeypatch.setattr(mapping_mod._libc, "munlock", lambda addr, size: 0)
    assert small_mapping.pin("auto") == "mlock"
    with pytest.raises(RuntimeError, match="pin=cuda: cudaHostRegister failed"):
        small_mapping.pin("cuda")


def test_no_gpu_here_means_no_cuda_runtime():
    if os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    assert mapping_mod.CudaRuntime.load() is None


# ---------------------------------------------------------------------------------------------
# The GPU benchmark on a machine without CUDA
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_gpu_bench_exits_cleanly_without_cuda(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "no CUDA device is visible" in run.stderr and "nothing measured" in run.stderr
    assert "Traceback" not in run.stderr and not out.exists()

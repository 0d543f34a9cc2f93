#!/usr/bin/env python3
"""Store (D2H) and load (H2D) bandwidth of kvtier's device copiers, against the link's ceiling.

For each geometry, a job of ``--blocks-per-job`` blocks is copied between a paged GPU KV cache
and scattered pages of a pinned region (a /dev/shm file mapped and cudaHostRegister'ed exactly as
a client does), by:

- ``kernel``: the CUDA kernel copier (csrc/kvtier_copy.cu, one launch per job; needs CuPy);
- ``torch``: the torch fallback copier (one non_blocking copy_ per piece);
- ``ceiling``: one contiguous cudaMemcpyAsync of the same total bytes between a device buffer and
  the same pinned region: what the host link gives a single large copy.

Reported per job: GB/s (10^9 bytes/s, median over ``--iters`` timed jobs after one warm-up,
timed from submit to the completion event on the host, as the client sees it), the ratio of each
copier to the ceiling, the number of pieces, and the host time to build the descriptors. Every
measured copy is checked byte for byte once, so a fast wrong copy cannot pass.

Geometries: DeepSeek-V3 MLA (61 layers, [blocks, 64 tokens, 576] per layer, bf16 and fp8) and a
Llama-70B-like GQA shard at TP=1 (80 layers, 8 KV heads × 128, 16 tokens per block, K and V of
each layer as views of one [2, blocks, 16, 8, 128] tensor, vLLM's flash-attention layout).

Then the cost of pinning a client's mapping of the region (issue 15): cudaHostRegister (portable |
mapped, chunked, as ``Mapping.pin_cuda``) of a fresh mapping of a ``--register-gib`` file on
tmpfs, seconds per GiB, for 4 KiB pages (/dev/shm as mounted, unless it gives huge pages) and
2 MiB pages (a tmpfs mounted huge=always: /dev/shm when it is one, else mounted by this script
when it runs as root, and unmounted after); each on a mapping left unpopulated (the register
faults every page in itself) and on one the client's populate (MADV_POPULATE_WRITE on 2
threads, timed apart) filled first, which is what a kvtier client does before pinning. The
pages each mapping got are read from /proc/self/smaps, so a row never claims pages it did not get.

Then one copy at TP=N (``--tp``, default: every GPU, at least 2): a real daemon and N rank
processes (rank r on GPU r mod the GPUs there are; several on one GPU when there is one) storing
the same replicated DeepSeek-V3-like MLA jobs (61 layers × 576 bf16, 64 tokens per block), against
TP=1 in the same run: the job's time as the slowest rank saw it, the unique bytes stored per
second, and the bytes the daemon counted copied D2H per block (one block's bytes at any TP: only
rank 0 copies) and saved by the dedup.

Writes gpu_bench.json and gpu_bench.md under ``--out`` (default $OUT, else ./out, which git ignores) and
prints the table. Fits one device run: about a minute on an H100/H200-class machine with the
defaults; ``--budget-s`` (default 420) stops starting new cases after that many seconds. On a
machine without CUDA it prints why and exits 0 without measuring anything.

Usage: python bench/gpu_bench.py [--out DIR] [--blocks-per-job 32] [--iters 5] [--budget-s 420] [--register-gib 4]
       [--tp N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)             # tests.gpu.cuda_ranks: the TP=N section's rank processes

PAGE = 64 << 10      # kvtierd's default page size


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    block_tokens: int
    dtype: str                       # torch dtype name
    mla_width: int = 0               # MLA: latent width per token (576)
    kv_heads: int = 0                # GQA: KV heads of this rank's shard
    head_dim: int = 0

    def make(self, num_blocks: int, device):
        """The per-layer KV-cache tensors, filled with random bytes."""
        import torch
        dtype = getattr(torch, self.dtype)
        tensors = []
        for _ in range(self.layers):
            if self.mla_width:
                t = torch.empty((num_blocks, self.block_tokens, self.mla_width), dtype=dtype, device=device)
                t.view(torch.uint8).random_(0, 256)
                tensors.append(t)
            else:
                kv = torch.empty((2, num_blocks, self.block_tokens, self.kv_heads, self.head_dim), dtype=dtype,
                                 device=device)
                kv.view(torch.uint8).random_(0, 256)
                tensors += [kv[0], kv[1]]
        return tensors


GEOMETRIES = [
    Geometry("deepseek-v3 mla bf16", layers=61, block_tokens=64, dtype="bfloat16", mla_width=576),
    Geometry("deepseek-v3 mla fp8", layers=61, block_tokens=64, dtype="float8_e4m3fn", mla_width=576),
    Geometry("llama-70b gqa tp1 bf16", layers=80, block_tokens=16, dtype="bfloat16", kv_heads=8, head_dim=128),
]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "out", help="directory for JSON + markdown")
    p.add_argument("--blocks-per-job", type=int, default=32)
    p.add_argument("--iters", type=int, default=5, help="timed jobs per case (after one warm-up)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new case after this many seconds")
    p.add_argument("--register-gib", type=float, default=4.0,
                   help="GiB of region mapping whose cudaHostRegister is timed per page size (0: skip)")
    p.add_argument("--tp", type=int, default=0, help="ranks of the one-copy TP=N section (default: the GPUs, "
                                                     "at least 2; 1: skip it)")
    return p.parse_args(argv)


def one_copy_tp(tp: int, args) -> list[dict]:
    """Replicated MLA stores at TP=1 and TP=``tp`` through a real daemon: time and D2H bytes per block."""
    import hashlib

    import torch

    from kvtierbench.launcher import DaemonProcess
    from tests.gpu.cuda_ranks import CudaRank, GpuCacheSpec, all_call
    spec = GpuCacheSpec(layers=61, num_blocks=args.blocks_per_job, block_tokens=64)
    gpus = torch.cuda.device_count()
    region = max(1 << 30, 4 * args.blocks_per_job * spec.block_bytes)
    rows = []
    for world in (1, tp):
        daemon = DaemonProcess(tempfile.mkdtemp(prefix="kvtier-bench-tp-", dir="/dev/shm"), "--size", str(region),
                               "--pin", "off", "--metrics-address", "off")
        ranks = []
        try:
            daemon.start()
            ranks = [CudaRank(daemon.socket, f"bench-tp{world}", r, world, spec, seed=r + 1, device=r % gpus)
                     for r in range(world)]
            [r.result() for r in ranks]
            blocks = list(range(args.blocks_per_job))
            times, before = [], daemon.stats()
            for job in range(args.iters + 1):           # the first one warms up
                keys = [hashlib.sha256(f"tp{world}-{job}-{b}".encode()).digest() for b in blocks]
                results = all_call(ranks, "store", job=job + 1, keys=keys, block_ids=blocks)
                assert all(r["ok"] for r in results), results
                if job:
                    times.append(max(r["seconds"] for r in results))
            after = daemon.stats()
            stored = (args.iters + 1) * len(blocks)
            seconds = statistics.median(times)
            rows.append({"tp": world, "gpus": min(world, gpus), "blocks_per_job": len(blocks),
                         "block_bytes": spec.block_bytes, "job_ms": seconds * 1e3,
                         "unique_gbps": len(blocks) * spec.block_bytes / seconds / 1e9,
                         "d2h_bytes_per_block": (after["bytes_written"] - before["bytes_written"]) / stored,
                         "saved_bytes_per_block": (after["bytes_saved_dedup"] - before["bytes_saved_dedup"]) / stored})
        finally:
            for r in ranks:
                r.stop()
            daemon.stop()
            daemon.cleanup()
    return rows


def tp_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = ["", "### One copy at TP=N (replicated MLA, 61 layers x 576 bf16, 64 tokens per block)", "",
             "| TP | GPUs | job ms (slowest rank) | unique GB/s | D2H bytes per block / block bytes | "
             "saved per block / block bytes |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['gpus']} | {r['job_ms']:.2f} | {r['unique_gbps']:.2f} | "
                     f"{r['d2h_bytes_per_block'] / r['block_bytes']:.2f} | "
                     f"{r['saved_bytes_per_block'] / r['block_bytes']:.2f} |")
    return "\n".join(lines) + "\n"


def register_cost(gib: float, register, workdir: str = "/dev/shm") -> tuple[list[dict], list[str]]:
    """cudaHostRegister per GiB of a fresh mapping of a tmpfs file, 4 KiB vs 2 MiB pages, on an
    unpopulated and on a populated mapping. ``register(address, size)`` pins and returns the
    function that unpins (CudaRuntime.register). Returns (rows, notes)."""
    import tempfile
    from contextlib import ExitStack

    from kvtierbench.harness import huge_tmpfs
    from kvtierd import hugepages
    from kvtierd.contract.mapping import Mapping

    nbytes = int(gib * (1 << 30)) // (2 << 20) * (2 << 20)
    rows, notes = [], []
    found = hugepages.offer(workdir)
    with ExitStack() as stack:
        places = []
        if found.kind == "none":
            places.append(("4 KiB", workdir))
        if found.kind == "thp":
            places.append(("2 MiB", workdir))
        else:
            mount_point = tempfile.mkdtemp(prefix="kvt-gpu-huge-")
            stack.callback(os.rmdir, mount_point)             # after the unmount (last in, first out)
            try:
                places.append(("2 MiB", stack.enter_context(huge_tmpfs(mount_point, nbytes + (64 << 20)))))
                notes.append("2 MiB pages: a tmpfs mounted huge=always by this script (unmounted after)")
            except OSError as exc:
                notes.append(f"2 MiB pages not measured: {found.why_not()} ({exc})")
        for label, directory in places:
            path = os.path.join(directory, f"kvt-register-{os.getpid()}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)          # the daemon's pages, allocated (4 KiB or huge)
            finally:
                os.close(fd)
            try:
                row = {"pages": label, "gib": nbytes / (1 << 30)}
                for populated in (False, True):
                    mapping = Mapping.of_file(path)
                    try:
                        if populated:
                            t0 = time.perf_counter()
                            mapping.populate_in_background(threads=2).wait()
                            row["populate_s_per_gib"] = (time.perf_counter() - t0) / row["gib"]
                        t0 = time.perf_counter()
                        unregister = register(mapping.address, mapping.size)
                        seconds = time.perf_counter() - t0
                        row["huge_bytes"] = hugepages.backing(mapping.address).huge_bytes
                        unregister()
                    finally:
                        mapping.close()
                    row["register_populated_s_per_gib" if populated else "register_s_per_gib"] = seconds / row["gib"]
                rows.append(row)
            finally:
                os.unlink(path)
        if "2 MiB" in {r["pages"] for r in rows} and "4 KiB" in {r["pages"] for r in rows}:
            small, huge = (next(r for r in rows if r["pages"] == p) for p in ("4 KiB", "2 MiB"))
            for key in ("register_s_per_gib", "register_populated_s_per_gib"):
                huge[f"{key}_vs_4KiB"] = huge[key] / small[key]
    return rows, notes


def register_markdown(rows: list[dict], notes: list[str]) -> str:
    lines = ["", "cudaHostRegister of a client's mapping of the region (s per GiB):", "",
             "| pages | GiB | huge bytes | register, unpopulated | populate (2 threads) | register, populated "
             "| 2 MiB / 4 KiB (unpop., pop.) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = (f"{r['register_s_per_gib_vs_4KiB']:.3f}, {r['register_populated_s_per_gib_vs_4KiB']:.3f}"
              if "register_s_per_gib_vs_4KiB" in r else "")
        lines.append(f"| {r['pages']} | {r['gib']:g} | {r['huge_bytes'] >> 20} MiB | {r['register_s_per_gib']:.4f} "
                     f"| {r['populate_s_per_gib']:.4f} | {r['register_populated_s_per_gib']:.4f} | {vs} |")
    lines += [f"\n{n}" for n in notes]
    return "\n".join(lines) + "\n"


class PinnedRegion:
    """Scratch host memory mapped and registered with CUDA the way a kvtier client registers the region."""

    def __init__(self, nbytes: int):
        from kvtier.torch_copy import host_view
        from kvtierd.contract.mapping import Mapping
        self.mapping = Mapping.anonymous(nbytes, "kvtier-bench")
        self.mapping.prefault()
        self.mapping.pin_cuda(required=True)
        self.address, self.size = self.mapping.address, nbytes
        self.tensor = host_view(self.address, nbytes)

    def close(self) -> None:
        self.tensor = None
        self.mapping.close()


def timed(submit_and_wait, iters: int) -> list[float]:
    import torch
    submit_and_wait()                         # warm-up: NVRTC load, pools, first-touch
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        submit_and_wait()
        out.append(time.perf_counter() - t0)
    return out


def block_rows(tensors, blocks):
    import torch
    idx = torch.as_tensor(np.asarray(blocks), device=tensors[0].device)
    return torch.cat([t.view(torch.uint8).index_select(0, idx).reshape(len(idx), -1) for t in tensors], dim=1)


def entry_bytes(region: PinnedRegion, pages: np.ndarray, block_bytes: int):
    import torch
    rows = region.tensor[: (int(pages.max()) + 1) * PAGE].view(-1, PAGE)
    return rows[torch.as_tensor(pages)].reshape(len(pages), -1)[:, :block_bytes]


def run_geometry(geo: Geometry, args, unavailable: dict, device) -> list[dict]:
    import torch

    from kvtier.kvcache import KVCacheLayout
    from kvtier.select import select_copier

    k = args.blocks_per_job
    tensors = geo.make(2 * k, device)
    kv = KVCacheLayout(tensors, PAGE)
    per_block = -(-kv.block_bytes // PAGE)
    rng = np.random.default_rng(0)
    src_blocks = rng.permutation(2 * k)[:k]
    dst_blocks = np.setdiff1d(np.arange(2 * k), src_blocks)
    pages = rng.permutation(k * per_block).reshape(k, per_block)    # scattered, as in a used region
    region = PinnedRegion(k * per_block * PAGE)
    job_bytes = k * kv.block_bytes
    results = []
    try:
        t0 = time.perf_counter()
        store = kv.descriptors(src_blocks, pages, region.address, to_region=True)
        build_ms = (time.perf_counter() - t0) * 1e3
        load = kv.descriptors(dst_blocks, pages, region.address, to_region=False)
        expected = block_rows(tensors, src_blocks).cpu()

        # The ceiling: one contiguous copy of the same bytes between device memory and the pinned region.
        flat = torch.empty(job_bytes, dtype=torch.uint8, device=device)
        host = region.tensor[:job_bytes]
        stream = torch.cuda.Stream(device)

        def contiguous(dst, src):
            def go():
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()
            return go

        ceiling = {"store": timed(contiguous(host, flat), args.iters),
                   "load": timed(contiguous(flat, host), args.iters)}
        del flat, host      # free the device buffer before the copiers run

        measured: dict[tuple[str, str], list[float] | str] = {}
        for label, name in (("kernel", "cuda"), ("torch", "torch")):
            if name in unavailable:
                measured[(label, "store")] = measured[(label, "load")] = unavailable[name]
                continue
            copier = select_copier(name, device, kv_tensors=tensors, host_spans=[(region.address, region.size)])
            try:
                for direction, desc in (("store", store), ("load", load)):
                    # Clear the destination first, so that bytes a copy failed to move show up.
                    if direction == "store":
                        region.tensor.zero_()
                    else:
                        for t in tensors:
                            t.view(torch.uint8).index_fill_(0, torch.as_tensor(dst_blocks, device=device), 0)
                    times = timed(lambda d=desc: copier.submit(d).wait(), args.iters)
                    # Every timed job rewrote the same bytes: check them once.
                    got = (entry_bytes(region, pages, kv.block_bytes) if direction == "store"
                           else block_rows(tensors, dst_blocks).cpu())
                    if not torch.equal(got, expected):
                        raise AssertionError(f"{geo.name}: {label} copier {direction} produced wrong bytes")
                    measured[(label, direction)] = times
            finally:
                copier.close()

        for direction, desc in (("store", store), ("load", load)):
            ceil_gbps = job_bytes / statistics.median(ceiling[direction]) / 1e9
            row = {"geometry": geo.name, "direction": direction, "job_blocks": k, "job_bytes": job_bytes,
                   "block_bytes": kv.block_bytes, "pieces": len(desc), "descriptor_build_ms": round(build_ms, 3),
                   "ceiling_gbps": round(ceil_gbps, 2), "ceiling_times_s": ceiling[direction]}
            for label in ("kernel", "torch"):
                times = measured[(label, direction)]
                if isinstance(times, str):
                    row[f"{label}_gbps"], row[f"{label}_unavailable"] = None, times
                    continue
                gbps = job_bytes / statistics.median(times) / 1e9
                row[f"{label}_gbps"] = round(gbps, 2)
                row[f"{label}_vs_ceiling"] = round(gbps / ceil_gbps, 3)
                row[f"{label}_times_s"] = times
            results.append(row)
    finally:
        region.close()
    return results


def markdown(env: dict, rows: list[dict], skipped: list[str]) -> str:
    def cell(row, label):
        g = row.get(f"{label}_gbps")
        return "n/a" if g is None else f"{g:.1f} ({row[f'{label}_vs_ceiling']:.2f}×)"

    lines = [f"GPU: {env['gpu']} · torch {env['torch']} (CUDA {env['torch_cuda']}) · CuPy {env['cupy']} · "
             f"{env['blocks_per_job']} blocks/job, page {PAGE // 1024} KiB, median of {env['iters']} jobs",
             "",
             "| geometry | direction | MiB/job | pieces | kernel GB/s (×ceiling) | torch GB/s (×ceiling) "
             "| ceiling GB/s | descriptors ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['geometry']} | {r['direction']} ({'D2H' if r['direction'] == 'store' else 'H2D'}) "
                     f"| {r['job_bytes'] / 2**20:.1f} | {r['pieces']} | {cell(r, 'kernel')} | {cell(r, 'torch')} "
                     f"| {r['ceiling_gbps']:.1f} | {r['descriptor_build_ms']:.2f} |")
    for reason in sorted({r.get('kernel_unavailable') for r in rows} - {None}):
        lines.append(f"\nkernel copier unavailable: {reason}")
    for s in skipped:
        lines.append(f"\nnot measured (time budget): {s}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_bench: torch is not installed; nothing measured.", file=sys.stderr)
        return 0
    if not torch.cuda.is_available():
        print(f"gpu_bench: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}); nothing measured.", file=sys.stderr)
        return 0

    from kvtier.copy import CopierUnavailable

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        import cupy
        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cupy": cupy_version or "not installed", "python": platform.python_version(), "host": platform.node(),
           "blocks_per_job": args.blocks_per_job, "iters": args.iters, "page_bytes": PAGE}
    unavailable: dict[str, str] = {}      # copier name -> why it cannot run here
    if cupy_version is None:
        unavailable["cuda"] = "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    else:
        # Compile once up front so that a failing NVRTC shows as a clear line, not a traceback.
        probe = PinnedRegion(PAGE)
        try:
            from kvtier.cuda import CudaKernelCopier
            CudaKernelCopier(device, [], [(probe.address, probe.size)]).close()
        except CopierUnavailable as exc:
            unavailable["cuda"] = str(exc)
        finally:
            probe.close()

    start = time.monotonic()
    register_rows, register_notes = [], []
    if args.register_gib > 0:
        from kvtierd.contract.mapping import CudaRuntime
        print(f"gpu_bench: cudaHostRegister of {args.register_gib:g} GiB, 4 KiB vs 2 MiB pages …", file=sys.stderr,
              flush=True)
        register_rows, register_notes = register_cost(args.register_gib, CudaRuntime.load().register)
    rows, skipped = [], []
    for geo in GEOMETRIES:
        if time.monotonic() - start > args.budget_s:
            skipped.append(geo.name)
            continue
        print(f"gpu_bench: {geo.name} …", file=sys.stderr, flush=True)
        rows += run_geometry(geo, args, unavailable, device)

    tp = args.tp or max(2, torch.cuda.device_count())
    tp_rows = []
    if tp > 1 and time.monotonic() - start <= args.budget_s:
        print(f"gpu_bench: one copy at TP={tp} …", file=sys.stderr, flush=True)
        tp_rows = one_copy_tp(tp, args)
    elif tp > 1:
        skipped.append(f"one copy at TP={tp}")

    os.makedirs(args.out, exist_ok=True)
    table = markdown(env, rows, skipped) + register_markdown(register_rows, register_notes) + tp_markdown(tp_rows)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump({"env": env, "results": rows, "skipped": skipped, "register": register_rows,
                   "register_notes": register_notes, "one_copy_tp": tp_rows, "seconds": time.monotonic() - start},
                  f, indent=2)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"gpu_bench: wrote {args.out}/gpu_bench.json and gpu_bench.md in {time.monotonic() - start:.0f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

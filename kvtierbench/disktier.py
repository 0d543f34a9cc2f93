"""``tier`` with the disk backend (``kvtierbench.tier`` runs it as its engine "disk"): one node
whose second tier is a directory on a local filesystem, against O_DIRECT on the same filesystem
in the same run.

The directory: ``$KVTIERBENCH_DISK_DIR`` (a fresh subdirectory made and removed there), else a
fresh one under the system's temporary directory — which must be on the disk to measure, not
tmpfs (the bench says which filesystem it measured). Per block size S, N blocks a repetition,
median of the repetitions after a warm-up, the floor and the node taking turns at going first:

``raw``      the same N blocks of S written with O_DIRECT into a preallocated file in that
             directory, one fdatasync at the end (the tier syncs each batch), then read back the
             same way: as one sequential stream, and as ``io_threads`` streams each over a
             contiguous share (what the tier's thread pool does); the faster of the two in each
             direction is the floor. From and into the very pages of the region that the
             promote just filled (X pinned by a load job; the read lands the bytes the write took
             from them, so X is unchanged, and checked): on a VM an O_DIRECT read's speed depends
             on which memory it lands in — here 0.8 GB/s into one part of a buffer and 2.8 GB/s
             into another, the same parts every time — so a floor read into other memory than
             the tier's measures that memory, not the tier. The same floor from and into one
             buffer of the bench's own (``raw_anon_*``) is measured too, taking turns with the
             node at going first, for comparison
``demote``   node A (a kvtierd whose region holds 2N blocks, ``tier_low_watermark`` 0.5) demotes
             its N blocks X in one put, timed by the daemon (``kvtierbench.tiernode.demote_x``)
``promote``  the store's blocks evicted locally (nothing else is written while X comes back), the
             first lookup of X (pending N: X is held only on disk) to all N READY, timed as the
             engine sees it; then X is loaded and checked
``lookup``   that first lookup of N keys held only on disk against a lookup of the same N keys
             once READY; and one key at a time: each key of X evicted locally, looked up alone
             (pending), then again once READY; p50 of each, each after the same short pause
``restart``  a directory holding R blocks (1,000,000 in the full plan: 64-byte blocks, a 4 KiB slot
             each, sealed and recorded as the tier writes them; the slots' bytes are a sparse file,
             the record file is dropped from the page cache as after a reboot): a fresh daemon on
             it, from its launch to the companion ready (the index loaded) and to the first of
             the R blocks READY on a lookup; the companion's own load time; the daemon's launch to
             serving from its region (which does not wait for the tier) for comparison
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
import time
import zlib

import numpy as np

from kvtierd.contract.protocol import PAGES_DTYPE
from kvtierd.contract.replies import LoadReply
from kvtierd.tier.backend import Owner, page_extents
from kvtierd.tier.diskformat import ALIGN, block_records, claim
from kvtierd.tier.keys import Keyspace
from kvtierd.tier.seal import SealKey, Sealer
from kvtierd.tier.slabs import Slab
from kvtierd.tier.keys import identity

from .harness import (DATA_PAGE, BlockBench, Context, bench_daemon, bench_namespace, make_keys, pct, region_size, say,
                      target)
from .tiernode import demote_x, promote_x, timed_lookup

IO_THREADS = 4                    # the disk tier's default io_threads
IDLE = 0.003                      # a pause before each timed lookup, as between scheduler steps
RESTART_BLOCK = 64                # bytes of the restart section's blocks: one 4 KiB slot each


def disk_root() -> str:
    base = os.environ.get("KVTIERBENCH_DISK_DIR") or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvtbench-disk-", dir=base)


def filesystem(path: str) -> str:
    """The type of the filesystem ``path`` is on (from /proc/mounts: its longest mount point)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            if path.startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


# ------------------------------------------------------------------------------------------ raw
class RawDirect:
    """O_DIRECT writes and reads of N blocks of S in a preallocated file: from and into one aligned
    buffer of its own, or from and into given blocks of memory (each block its iovec)."""

    def __init__(self, directory: str, n: int, size: int):
        self.n, self.size = n, size
        self.path = os.path.join(directory, "raw.floor")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, n * size)
        self.buf = mmap.mmap(-1, n * size)
        np.frombuffer(self.buf, np.uint8)[:] = np.random.default_rng(2).integers(0, 256, n * size, dtype=np.uint8)
        view = memoryview(self.buf)
        self.own = [[view[i * size:(i + 1) * size]] for i in range(n)]

    def _streams(self, call, streams: int, blocks: list[list[memoryview]]) -> float:
        share = -(-self.n // streams)

        def run(first: int) -> None:
            for i in range(first, min(first + share, self.n)):
                if call(self.fd, blocks[i], i * self.size) != self.size:
                    raise RuntimeError("a short O_DIRECT transfer in the raw floor")
        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(s * share,)) for s in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if call is os.pwritev:
            os.fdatasync(self.fd)
        return time.perf_counter() - t0

    def put_get(self, blocks: list[list[memoryview]] | None = None) -> tuple[float, float, dict]:
        """(write s, read s): the faster of one stream and IO_THREADS streams, each; and all four.
        Each read follows a write of the same blocks: it lands the bytes they held."""
        blocks = blocks or self.own
        got = {f"{op}_{streams}": self._streams(call, streams, blocks)
               for streams in (1, IO_THREADS) for op, call in (("write", os.pwritev), ("read", os.preadv))}
        return min(got["write_1"], got[f"write_{IO_THREADS}"]), min(got["read_1"], got[f"read_{IO_THREADS}"]), got

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def crcs(blocks: list[list[memoryview]]) -> list[int]:
    out = []
    for block in blocks:
        crc = 0
        for extent in block:
            crc = zlib.crc32(extent, crc)
        out.append(crc)
    return out


def floor_in_region(raw: RawDirect, bench: BlockBench, x: list[bytes]) -> tuple[float, float, dict]:
    """``raw.put_get`` from and into the pages of the region that hold X (pinned by a load job
    meanwhile, released after); raises if X's bytes there are not the same afterwards."""
    client = bench.client
    job = next(bench.jobs)
    reply = LoadReply.from_wire(client.channel.call("load", job=job, keys=x))
    try:
        if reply.hits != len(x):
            raise RuntimeError(f"only {reply.hits} of the {len(x)} promoted blocks could be pinned for the floor")
        pages = np.frombuffer(reply.pages, PAGES_DTYPE).reshape(reply.hits, client.pages_per_shard)
        region = memoryview(client.region_bytes)
        blocks = [[region[off:off + n] for off, n in block]
                  for block in page_extents(pages, client.page_size, raw.size)]
        before = crcs(blocks)
        got = raw.put_get(blocks)
        if crcs(blocks) != before:
            raise RuntimeError("the raw floor changed the bytes of the region's blocks it read into")
        return got
    finally:
        client.channel.call("release", job=job)


# ------------------------------------------------------------------------------------------ the node
def wait_ready(daemon, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while daemon.stats()["tier"]["state"] != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the tier companion did not start: {daemon.stats()['tier']}")
        time.sleep(0.001)


def rep(a, bench: BlockBench, raw: RawDirect, n: int, seed: int, ns_name: str) -> dict:
    """One repetition: X demoted (timed by the daemon), looked up while only on disk, promoted
    (timed), looked up READY, loaded and checked; then the raw floor in the pages X landed in."""
    x, ids, demote = demote_x(a, bench, n, seed, ns_name)
    a.call("evict", admin=True, namespace=ns_name, count=n)      # the trigger's blocks: local only
    got = promote_x(a, bench, x, ids, IDLE)
    write, read, floors = floor_in_region(raw, bench, x)
    return {"demote": demote, "promote": got["promote"], "pending_n": got["pending"], "local_n": got["local"], "x": x,
            "raw": (write, read), "floors": floors}


def single_key_lookups(a, bench: BlockBench, keys: list[bytes], ns_name: str) -> tuple[list, list]:
    """Each key evicted locally (held only on disk), looked up alone, then again once READY."""
    a.call("evict", admin=True, namespace=ns_name, count=len(keys))
    pending, local = [], []
    for key in keys:
        reply, took = timed_lookup(bench, [key], IDLE)
        if (reply.hits, reply.pending) != (0, 1):
            raise RuntimeError(f"a key held only on disk looked up alone answered {reply}")
        pending.append(took)
        while bench.client.lookup_detail([key]).pending:
            time.sleep(0.0002)
        reply, took = timed_lookup(bench, [key], IDLE)
        if reply.hits != 1:
            raise RuntimeError("a promoted key is not a hit")
        local.append(took)
    return pending, local


def size_figures(n: int, size: int, node: list[dict], anon: list[tuple]) -> dict:
    """One block size's row from its measured repetitions: medians, GB/s and ratios; ``raw`` the
    floor in the region's pages (the targets' floor), ``raw_anon`` the one in the bench's buffer."""
    med = {k: float(np.median([x[k] for x in node])) for k in ("demote", "promote", "pending_n", "local_n")}
    write, read = np.median(np.array([x["raw"] for x in node]), axis=0)
    anon_write, anon_read = np.median(np.array([a[:2] for a in anon]), axis=0)
    floors = {k: float(np.median([x["floors"][k] for x in node])) for k in node[0]["floors"]}
    gbps = n * size / 1e9
    return {"engine": "disk", "blocks": n, "block_bytes": size,
            "raw_put_gbps": gbps / write, "raw_get_gbps": gbps / read,
            "raw_anon_put_gbps": gbps / anon_write, "raw_anon_get_gbps": gbps / anon_read,
            "demote_gbps": gbps / med["demote"], "promote_gbps": gbps / med["promote"],
            "raw_put_blocks_per_s": n / write, "raw_get_blocks_per_s": n / read,
            "demote_blocks_per_s": n / med["demote"], "promote_blocks_per_s": n / med["promote"],
            "demote_vs_raw_put": write / med["demote"], "promote_vs_raw_get": read / med["promote"],
            "demote_vs_raw_anon_put": anon_write / med["demote"], "promote_vs_raw_anon_get": anon_read / med["promote"],
            **{f"raw_{k}_streams_gbps": gbps / v for k, v in floors.items()},
            "lookup_pending_us": med["pending_n"] * 1e6, "lookup_local_us": med["local_n"] * 1e6,
            "lookup_pending_vs_local": med["pending_n"] / med["local_n"]}


def size_row(ctx: Context, root: str, n: int, size: int) -> dict:
    per = -(-size // DATA_PAGE)
    name = f"tier-disk-{size}"
    tier_dir = os.path.join(root, name)
    a = bench_daemon(ctx.path(f"{name}-a"), region_size(2 * n * per, DATA_PAGE), DATA_PAGE, "--tier-backend", "disk",
                     "--tier-address", tier_dir, "--tier-data-timeout", "120", "--tier-kill-after", "60",
                     "--tier-timeout", "5", "--tier-low-watermark", "0.5")
    a.start()
    raw = RawDirect(root, n, size)
    bench = None
    try:
        wait_ready(a)
        bench = BlockBench(a, size, n, name)
        ns_name = bench_namespace(name, size).name()
        anon: list[tuple] = []
        node: list[dict] = []
        for r in range(ctx.plan.tier_reps + 1):
            def floor():
                anon.append(raw.put_get())

            def ours():
                node.append(rep(a, bench, raw, n, 1_000_000 * (r + 1) + size, ns_name))
            for step in ((floor, ours) if r % 2 else (ours, floor)):
                step()
        pending1, local1 = single_key_lookups(a, bench, node[-1]["x"], ns_name)
        row = size_figures(n, size, node[1:], anon[1:])
        row["lookup1_pending_p50_us"] = pct(np.array(pending1) * 1e6, 50)
        row["lookup1_local_p50_us"] = pct(np.array(local1) * 1e6, 50)
        row["lookup1_pending_vs_local"] = row["lookup1_pending_p50_us"] / row["lookup1_local_p50_us"]
        say(f"tier disk {n} x {size >> 10} KiB: raw write {row['raw_put_gbps']:.2f} read {row['raw_get_gbps']:.2f} "
            f"GB/s; demote x{row['demote_vs_raw_put']:.2f}, promote x{row['promote_vs_raw_get']:.2f} of raw "
            f"(of raw in the bench's own buffer, {row['raw_anon_put_gbps']:.2f} and {row['raw_anon_get_gbps']:.2f} "
            f"GB/s: x{row['demote_vs_raw_anon_put']:.2f}, x{row['promote_vs_raw_anon_get']:.2f}); "
            f"disk-only lookup x{row['lookup_pending_vs_local']:.2f} ({n} keys), "
            f"x{row['lookup1_pending_vs_local']:.2f} (1 key) of local")
        return row
    finally:
        if bench is not None:
            bench.close()
        raw.close()
        a.stop()
        shutil.rmtree(a.dir, ignore_errors=True)
        shutil.rmtree(tier_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------ restart
def write_directory(tier_dir: str, key: SealKey, count: int) -> list[bytes]:
    """A disk tier directory holding ``count`` blocks of RESTART_BLOCK bytes of one namespace,
    as the tier writes them (format, seals, records); the slots' bytes are zeros in a sparse file.
    Returns the blocks' keys."""
    ns = bench_namespace("tier-disk-restart", RESTART_BLOCK)
    keyspace, sealer = Keyspace(identity(ns)), Sealer(key, identity(ns))
    lock, _ = claim(tier_dir, Owner("kvtierd", key.id_hex))
    slab = Slab(tier_dir, ALIGN, direct=False, writable=True)
    try:
        os.ftruncate(slab.data_fd, count * ALIGN)
        os.ftruncate(slab.rec_fd, count * 80)
        keys = make_keys(77, count)
        zeros = memoryview(bytearray(RESTART_BLOCK))
        step = 1 << 16
        for first in range(0, count, step):
            part = keys[first:first + step]
            seals = sealer.seals(part, zeros, [[(0, RESTART_BLOCK)]] * len(part))
            records = block_records(keyspace.names(part), seals.sums(range(len(part))),
                                    [RESTART_BLOCK] * len(part), first + 1)
            slab.write_records(np.arange(first, first + len(part)), records)
        slab.sync_records()
        os.posix_fadvise(slab.rec_fd, 0, 0, os.POSIX_FADV_DONTNEED)     # as after a reboot: not cached
    finally:
        slab.close()
        os.close(lock)
    return keys


def restart_row(ctx: Context, root: str, count: int) -> dict:
    tier_dir = os.path.join(root, "restart")
    key_file = os.path.join(root, "restart.key")
    key = SealKey(os.urandom(32))
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key.secret.hex().encode())
    os.close(fd)
    t0 = time.perf_counter()
    keys = write_directory(tier_dir, key, count)
    say(f"tier disk restart: {count} blocks written in {time.perf_counter() - t0:.1f} s")
    d = bench_daemon(ctx.path("tier-disk-restart"), region_size(4096, 4096), 4096, "--tier-backend", "disk",
                     "--tier-address", tier_dir, "--tier-key-file", key_file, "--tier-timeout", "5")
    bench = None
    try:
        launched = time.perf_counter()
        serving = d.start()
        wait_ready(d)
        ready_s = time.perf_counter() - launched
        bench = BlockBench(d, RESTART_BLOCK, 1, "tier-disk-restart")
        probe = [keys[count // 2]]
        while bench.client.lookup_detail(probe).hits != 1:
            time.sleep(0.0005)
        first_s = time.perf_counter() - launched
        job = next(bench.jobs)
        if bench.client.load(job, probe, np.arange(1)) != 1 or not bench.client.wait([job])[0].ok \
                or bench.kv.numpy()[0].any():
            raise RuntimeError("the block promoted after the restart is not the one written")
        engine = d.stats()["tier"]["engine"]
        if engine.get("loaded_blocks") != count:
            raise RuntimeError(f"the restarted tier found {engine.get('loaded_blocks')} of {count} blocks")
        row = {"blocks": count, "daemon_serving_s": serving, "companion_ready_s": ready_s,
               "first_block_ready_s": first_s, "companion_load_s": engine["load_seconds"]}
        say(f"tier disk restart with {count} blocks: launch to companion ready {ready_s:.2f} s, to the first disk "
            f"block READY {first_s:.2f} s (index load {engine['load_seconds']:.2f} s; daemon serving at "
            f"{serving:.2f} s)")
        return row
    finally:
        if bench is not None:
            bench.close()
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


def rows(ctx: Context) -> tuple[list[dict], list[dict], str]:
    """(demote/promote rows per block size, [the restart row], what the bench measured on)."""
    plan = ctx.plan
    root = disk_root()
    try:
        fs = filesystem(root)
        if fs == "tmpfs":
            say(f"tier disk: {root} is on tmpfs; set KVTIERBENCH_DISK_DIR to a directory on the disk to measure")
        got = [size_row(ctx, root, plan.tier_blocks, size) for size in plan.tier_block_sizes]
        restart = restart_row(ctx, root, plan.tier_restart_blocks)
        return got, [restart], f"disk: {fs} at {root}, O_DIRECT, io_threads {IO_THREADS}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def targets(rows_: list[dict], restart: list[dict]) -> list[dict]:
    return [target("tier disk: demote vs raw O_DIRECT write, bytes/s (worst block size)",
                   min(r["demote_vs_raw_put"] for r in rows_), 0.8, "higher"),
            target("tier disk: promote vs raw O_DIRECT read, bytes/s (worst block size)",
                   min(r["promote_vs_raw_get"] for r in rows_), 0.8, "higher"),
            target("tier disk: lookup of keys held only on disk vs a local lookup, p50 (worst of N keys, 1 key)",
                   max(max(r["lookup_pending_vs_local"], r["lookup1_pending_vs_local"]) for r in rows_), 2, "lower"),
            target(f"tier disk: restart with {restart[0]['blocks']} blocks on disk, launch to the first disk block "
                   "READY (s)", restart[0]["first_block_ready_s"], 2, "lower")]

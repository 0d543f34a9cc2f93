"""What the bench sections share: the plan of a run, key streams, machine facts, targets and
ratios, the daemons they start (``kvtierbench.launcher.DaemonProcess``) and the stop of their worker
processes (``stop_processes``), a rank copying blocks through the client (``BlockBench``), a rank
storing at the protocol level (``RankChannel``), and the full region that eviction fills and
recovery restarts."""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from kvtierd.contract.namespace import NamespaceId
from kvtierd.contract.region_format import Geometry

from .launcher import DaemonProcess

KEY_BYTES = 36                     # a vLLM key: 32-byte block hash + 4-byte group index
MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """Sizes of one run."""

    control_region: int                   # control: region size in bytes
    batches: tuple[int, ...]              # control: keys per job
    clients: tuple[int, ...]              # control: client processes
    duration: float                       # control: seconds per (op, B, C) point and side
    block_sizes: tuple[int, ...]          # data/redis: bytes per block
    blocks_per_job: tuple[int, ...]       # data: blocks per job
    reps: int                             # data/redis: measured repetitions (after one warm-up)
    tp: tuple[int, ...]                   # capacity: world sizes
    budget: int                           # capacity: region size in bytes
    capacity_block: int                   # capacity: bytes per block and rank
    entries: int                          # eviction/recovery: one-page entries in the region
    eviction_batches: tuple[int, ...]     # eviction: keys per store job
    redis_blocks: int                     # redis: blocks per job
    attach_block: int                     # attach: bytes per block
    attach_blocks: int                    # attach: blocks per store job
    attach_reps: int                      # attach: cold jobs (= warm jobs) per client; attaches timed
    capacities: tuple[float, ...]         # policy: region sizes, as fractions of a trace's distinct blocks
    generated_requests: int               # policy: requests of the generated trace (when no trace is given)
    node_capacities: tuple[float, ...]    # nodes: region sizes (its four replays per size cost ~4x policy's one)
    cost_entries: int                     # policy: one-page entries of each cost daemon's region
    cost_batches: tuple[int, ...]         # policy: keys per job of the cost measurement
    cost_slices: int                      # policy: turns each policy takes per (op, B)
    tier_blocks: int                      # tier: blocks demoted and promoted per repetition
    tier_block_sizes: tuple[int, ...]     # tier: bytes per block
    tier_reps: int                        # tier: measured repetitions (after one warm-up)
    tier_lookup_batches: int              # tier: lookups timed per key count
    tier_lookup_keys: tuple[int, ...]     # tier: keys per lookup
    tier_restart_blocks: int              # tier (disk): blocks on disk when a daemon restarts


FULL = Plan(control_region=256 * MiB, batches=(1, 16, 256, 1024), clients=(1, 4, 16), duration=0.5,
            block_sizes=(MiB, 4 * MiB), blocks_per_job=(64, 256, 1024), reps=5, tp=(1, 2, 4, 8), budget=256 * MiB,
            capacity_block=256 << 10, entries=1_000_000, eviction_batches=(1, 1024), redis_blocks=64,
            attach_block=2 * MiB, attach_blocks=16, attach_reps=24,
            capacities=(0.02, 0.05, 0.1, 0.2), generated_requests=3000, node_capacities=(0.1,), cost_entries=65536,
            cost_batches=(1, 16, 256), cost_slices=9, tier_blocks=256, tier_block_sizes=(64 << 10, MiB), tier_reps=5,
            tier_lookup_batches=200, tier_lookup_keys=(1, 256), tier_restart_blocks=1_000_000)
QUICK = Plan(control_region=64 * MiB, batches=(1, 256, 1024), clients=(1, 4), duration=0.1, block_sizes=(MiB,),
             blocks_per_job=(64,), reps=2, tp=(1, 2, 4, 8), budget=16 * MiB, capacity_block=256 << 10,
             entries=20_000, eviction_batches=(1024,), redis_blocks=16, attach_block=MiB, attach_blocks=4,
             attach_reps=4, capacities=(0.05, 0.2), generated_requests=300, node_capacities=(0.2,), cost_entries=4096,
             cost_batches=(16,), cost_slices=2,
             tier_blocks=32, tier_block_sizes=(256 << 10,), tier_reps=2, tier_lookup_batches=10, tier_lookup_keys=(256,),
             tier_restart_blocks=20_000)

CONTROL_PAGE = 4096                # control/eviction/recovery: 4 KiB pages, one-page blocks
DATA_PAGE = 64 << 10               # data/capacity/redis: the default page size


def say(message: str) -> None:
    """Progress goes to stderr, so that ``--json`` output on stdout stays clean."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def make_keys(seed: int, n: int) -> list[bytes]:
    """n distinct random 36-byte keys, built without a Python loop per key."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, KEY_BYTES), dtype=np.uint8)
    return raw.view(f"V{KEY_BYTES}").ravel().tolist()


class KeyStream:
    """Fresh keys, B at a time: a random 28-byte prefix and a counter (vectorised)."""

    def __init__(self, seed: int, batch: int):
        self.raw = np.random.default_rng(seed).integers(0, 256, size=(batch, KEY_BYTES), dtype=np.uint8)
        self.counter = self.raw[:, KEY_BYTES - 8:].view("<u8")      # [batch, 1], a view into raw
        self.counter[:, 0] = np.arange(batch, dtype=np.uint64)
        self.batch = batch

    def next(self) -> list[bytes]:
        self.counter += np.uint64(self.batch)
        return self.raw.view(f"V{KEY_BYTES}").ravel().tolist()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "kernel": platform.release(), "loadavg_start": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            mem = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        info["mem_total"], info["mem_available"] = mem["MemTotal"], mem["MemAvailable"]
    except (OSError, StopIteration, KeyError, ValueError):
        pass
    return info


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def target(name: str, value: float, goal: float, better: str) -> dict:
    """A target of the issue: ``value`` against ``goal`` (better: "higher" or "lower")."""
    met = value >= goal if better == "higher" else value <= goal
    return {"name": name, "value": value, "goal": f"{'>=' if better == 'higher' else '<='} {goal:g}",
            "met": bool(met)}


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat's first field)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass                    # a thread that ended meanwhile
    return total


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# The bench's regions are sized to its working set and one engine loads all of it in one job: the
# shares of the region an engine may hold out of eviction (kvtierd.holds, there for a node shared
# by engines) would cut its loads, so its daemons let one engine hold the whole region.
HOLD_ALL = ("--max-held-share-per-engine", "1", "--max-held-share-per-namespace", "1", "--max-held-share", "1")


def bench_daemon(directory: str, size: int, page_size: int, *flags: str, job_timeout: float = 120.0) -> DaemonProcess:
    """A kvtierd for the bench in ``directory``, unpinned and without metrics, with more ``flags``
    (not started: ``start()`` returns the seconds from process start to serving)."""
    os.makedirs(directory, exist_ok=True)
    return DaemonProcess(directory, "--size", str(size), "--page-size", str(page_size), "--pin", "off",
                         "--metrics-address", "off", "--job-timeout", str(job_timeout), "--log-level", "info",
                         *HOLD_ALL, *flags, start_timeout=300.0, call_timeout=60.0)


def region_size(pages: int, page_size: int) -> int:
    """The --size that gives exactly ``pages`` pages of ``page_size``."""
    return Geometry.for_pages(pages, page_size).total_bytes


def bench_namespace(name: str, block_bytes: int, sharding: str = "replicated") -> NamespaceId:
    return NamespaceId(model=f"bench-{name}", dtype="uint8", block_tokens=16, block_bytes=block_bytes,
                       sharding=sharding)


class Context:
    """What sections share: the plan, the work directory, the options of the policy section, and
    the full region of eviction/recovery."""

    def __init__(self, plan: Plan, workdir: str, traces: tuple = (), capacities: tuple[float, ...] = (),
                 policies: tuple[str, ...] = (), job_keys: int | None = None):
        self.plan = plan
        self.workdir = workdir
        self.traces = traces                      # policy: the traces to replay (kvtierbench.traces.Trace)
        self.capacities = capacities or plan.capacities
        self.node_capacities = capacities or plan.node_capacities
        self.policies = policies                  # policy: which ones (all registered when empty)
        self.job_keys = job_keys                  # policy: store a request in jobs of at most this many keys
        self.big: DaemonProcess | None = None    # the N-entry region (eviction, then recovery)
        self.big_fresh_start: float | None = None
        self.big_memory: dict | None = None      # the daemon's memory before and after storing its N entries

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def close(self) -> None:
        if self.big is not None:
            self.big.stop()


@contextmanager
def huge_tmpfs(directory: str, size: int, huge: str = "always") -> Iterator[str]:
    """A tmpfs mounted ``huge=<huge>`` (always: 2 MiB pages) of ``size`` bytes at ``directory``
    for the block, unmounted after it. Needs root (CAP_SYS_ADMIN): raises OSError saying why it
    could not mount. Whatever the block leaves in it goes with the unmount."""
    os.makedirs(directory, exist_ok=True)
    size = -(-size // (2 * MiB)) * 2 * MiB
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge={huge},size={size},mode=0700", "tmpfs", directory],
                       check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise OSError(f"cannot mount a huge tmpfs at {directory}: {detail.strip()}") from None
    try:
        yield directory
    finally:
        if subprocess.run(["umount", directory], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", directory], capture_output=True, timeout=30)   # busy: detach it


def workdir_base() -> str:
    """/dev/shm when it is there (the region's production home), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


# ----------------------------------------------------------------------------------------------- ranks
class BlockBench:
    """One rank (TP=1, CPU copier) storing and loading K blocks of S bytes, timed end to end:
    the job's requests, the copy and the commit/release, as an engine sees them."""

    def __init__(self, daemon: DaemonProcess, block: int, num_blocks: int, name: str):
        import torch

        from kvtier import Client
        self.block = block
        self.kv = torch.empty((num_blocks, block), dtype=torch.uint8)
        rows = self.kv.numpy()
        rows[:] = 0x5A                                  # faults the KV cache in
        rows[:, :8] = np.arange(num_blocks, dtype="<u8")[:, None].view(np.uint8)
        self.client = Client(daemon.socket, engine_id=f"bench-{name}", rank=0, world_size=1,
                             namespace=bench_namespace(name, block), copier="cpu", pin="off", timeout=120)
        self.client.register_kv_caches([self.kv])
        # The client populates its mapping at attach (as every rank does; the attach section
        # measures what that costs and what it saves): wait for it, as an engine's start outlasts it.
        self.client.populating.wait()
        self.jobs = iter(range(1, 1 << 62))
        self.seed = 0

    def store_load(self, ids: np.ndarray) -> tuple[float, float]:
        """Store blocks ``ids`` under fresh keys, then load them back into the same blocks (whose
        first row bytes are cleared in between, so that a load that copied nothing fails)."""
        self.seed += 1
        keys = make_keys(self.seed * 1_000_003 + len(ids), len(ids))
        job = next(self.jobs)
        t0 = time.perf_counter()
        decision = self.client.store(job, keys, ids)
        (stored,) = self.client.wait([job])
        t1 = time.perf_counter()
        if not stored.ok or decision.written != len(ids):
            raise RuntimeError(f"bench store job failed: {stored}, {decision.written} of {len(ids)} written")
        rows = self.kv.numpy()
        rows[ids, :8] = 0
        job = next(self.jobs)
        t2 = time.perf_counter()
        hits = self.client.load(job, keys, ids)
        (loaded,) = self.client.wait([job])
        t3 = time.perf_counter()
        if not loaded.ok or hits != len(ids):
            raise RuntimeError(f"bench load job failed: {loaded}, {hits} of {len(ids)} hits")
        if not np.array_equal(rows[ids, :8].view("<u8").ravel(), ids.astype("<u8")):
            raise RuntimeError("bench load returned wrong bytes")
        return t1 - t0, t3 - t2

    def close(self) -> None:
        self.client.close()


class RankChannel:
    """A TP=1 rank session used at the protocol level: store + commit without copying (the
    control-plane cost of a store job; the data plane measures copies)."""

    def __init__(self, daemon: DaemonProcess, engine: str):
        from kvtier import Client
        self.client = Client(daemon.socket, engine_id=engine, rank=0, world_size=1,
                             namespace=bench_namespace("entries", CONTROL_PAGE), copier="cpu", pin="off",
                             timeout=300)
        self.jobs = iter(range(1, 1 << 62))

    def store(self, keys: list[bytes]) -> bytes:
        job = next(self.jobs)
        outcomes = self.client.channel.call("store", job=job, keys=keys)["outcomes"]
        self.client.channel.call("commit", job=job, ok=True)
        return outcomes

    def close(self) -> None:
        self.client.close()


def stop_processes(workers: list, stop_message, timeout: float) -> None:
    """Tell each worker process (``(process, its pipe)``) to stop, wait ``timeout`` for it, kill it
    if it is still there."""
    for _, conn in workers:
        try:
            conn.send(stop_message)
        except OSError:
            pass
    for proc, _ in workers:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()


def big_region(ctx: Context) -> DaemonProcess:
    """The region of N one-page entries, filled (shared by eviction and recovery); the daemon's
    memory is read before and after the fill (``ctx.big_memory``)."""
    if ctx.big is None:
        n = ctx.plan.entries
        daemon = bench_daemon(ctx.path("big"), region_size(n, CONTROL_PAGE), CONTROL_PAGE)
        say(f"starting a daemon on a fresh region of {n:,} pages")
        ctx.big_fresh_start = daemon.start()
        ctx.big = daemon
        rank = RankChannel(daemon, "bench-fill")
        try:
            before = daemon.rss()
            fill(rank, n, 1, 8192)
            ctx.big_memory = {"entries": daemon.stats()["entries_ready"], "before": before, "after": daemon.rss()}
        finally:
            rank.close()
    return ctx.big


def fill(rank: RankChannel, n: int, seed: int, batch: int) -> None:
    """Store n fresh keys in jobs of ``batch``."""
    stream = KeyStream(seed, batch)
    for _ in range(n // batch):
        rank.store(stream.next())
    if n % batch:
        rank.store(stream.next()[: n % batch])

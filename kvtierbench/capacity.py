"""``capacity``: TP = 1, 2, 4, 8 ranks on one region: blocks it holds and bytes the ranks' copiers
wrote (D2H) per stored block, replicated (one copy) against sharded (each rank its own)."""

from __future__ import annotations

import shutil

import numpy as np

from .harness import DATA_PAGE, Context, MiB, bench_daemon, bench_namespace, make_keys, say, target
from .launcher import DaemonProcess


class _CountingCopier:
    """Wraps a rank's copier to count the bytes it was asked to copy."""

    def __init__(self, copier):
        self.copier, self.name, self.bytes = copier, copier.name, 0

    def submit(self, desc):
        self.bytes += desc.total_bytes
        return self.copier.submit(desc)

    def close(self) -> None:
        self.copier.close()


def _capacity_case(daemon: DaemonProcess, world: int, kind: str, block: int, stored_goal: int, case: int) -> dict:
    import torch

    from kvtier import Client
    per_job = 16
    kv = torch.full((per_job, block), 0x33, dtype=torch.uint8)
    ranks = []
    try:
        for r in range(world):
            c = Client(daemon.socket, engine_id=f"bench-cap-{case}", rank=r, world_size=world,
                       namespace=bench_namespace("capacity", block, kind), copier="cpu", pin="off", timeout=120)
            ranks.append(c)
            c.register_kv_caches([kv])
            c.copier = _CountingCopier(c.copier)
        ids = np.arange(per_job)
        before = daemon.stats()
        job, keys = 0, []
        while True:
            job += 1
            keys = make_keys(case * 1_000_003 + job, per_job)
            for c in ranks:            # rank 0 opens the job; the others vote (or write, sharded)
                c.store(job, keys, ids)
            for c in ranks:
                (res,) = c.wait([job])
                if not res.ok:
                    raise RuntimeError(f"capacity store job failed: {res}")
            if job * per_job >= stored_goal:
                break
        d2h = sum(c.copier.bytes for c in ranks)
        after = daemon.stats()
        job += 1
        loaded = []
        for c in ranks:               # every rank loads the last job's blocks from the one copy
            c.copier.bytes = 0
            loaded.append(c.load(job, keys, ids))
        for c in ranks:
            (res,) = c.wait([job])
            if not res.ok:
                raise RuntimeError(f"capacity load job failed: {res}")
        h2d = [c.copier.bytes for c in ranks]
        written = after["store_written_keys"] - before["store_written_keys"]
        return {"tp": world, "kind": kind, "blocks_held": after["entries_ready"], "blocks_stored": written,
                "d2h_bytes_per_block": d2h / written, "d2h_per_block_vs_block": d2h / written / block,
                "daemon_bytes_written_per_block": (after["bytes_written"] - before["bytes_written"]) / written,
                "h2d_bytes_per_rank_per_block": max(h2d) / max(1, min(loaded))}
    finally:
        for c in ranks:
            c.close()


def run(ctx: Context) -> dict:
    plan = ctx.plan
    block = plan.capacity_block
    daemon = bench_daemon(ctx.path("capacity"), plan.budget, DATA_PAGE)
    daemon.start()
    rows, case = [], 0
    try:
        pages = daemon.stats()["pages_total"]
        for world in plan.tp:
            for kind in ("replicated", "sharded"):
                case += 1
                daemon.call("clear", admin=True)
                # Store twice what the replicated layout can hold, so that both layouts end full.
                rows.append(_capacity_case(daemon, world, kind, block, 2 * pages // (block // DATA_PAGE), case))
            rep, sh = rows[-2], rows[-1]
            rep["capacity_vs_sharded"] = rep["blocks_held"] / sh["blocks_held"]
            rep["d2h_vs_sharded"] = rep["d2h_bytes_per_block"] / sh["d2h_bytes_per_block"]
            say(f"capacity: TP={world}  replicated holds {rep['blocks_held']} blocks, sharded {sh['blocks_held']} "
                f"(x{rep['capacity_vs_sharded']:.2f}); D2H bytes/block {rep['d2h_per_block_vs_block']:.2f}x block "
                f"vs {sh['d2h_per_block_vs_block']:.2f}x")
    finally:
        daemon.stop()
        shutil.rmtree(daemon.dir, ignore_errors=True)
    reps = [r for r in rows if r["kind"] == "replicated"]
    ratios = {f"tp{r['tp']}_capacity_vs_sharded": r["capacity_vs_sharded"] for r in reps}
    ratios.update({f"tp{r['tp']}_d2h_per_block_vs_block": r["d2h_per_block_vs_block"] for r in reps})
    targets = [target("capacity at TP=N vs sharded, over N (worst TP)",
                      min(r["capacity_vs_sharded"] / r["tp"] for r in reps), 0.99, "higher"),
               target("D2H bytes per stored block vs block bytes (worst TP)",
                      max(r["d2h_per_block_vs_block"] for r in reps), 1.0, "lower")]
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": [
        f"budget {plan.budget // MiB} MiB of {DATA_PAGE >> 10} KiB pages, {block >> 10} KiB per block and rank; "
        "sharded with the same bytes per rank is what per-rank offloading of an MLA model stores"]}

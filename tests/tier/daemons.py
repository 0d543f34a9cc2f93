"""Real daemons with a second tier and real rank processes: what the node tests share.

Each engine is a real rank process (``tests/integration/ranks.py``: a kvtier.Client with a CPU
KV cache); every block's bytes are derived from its key (and rank, for a sharded namespace), so
a block that holds another key's bytes, or a mix, cannot pass ``load_exact``.
"""

from __future__ import annotations

from tests.integration.ranks import CacheSpec, RankProcess, all_call
from tests.integration.test_faults import wait_for
from tests.integration.test_kvtierctl import ctl_json
from tests.integration.test_tp_roundtrip import keys_for

SMALL = CacheSpec(num_blocks=16)                                         # 54 KiB blocks: one 64 KiB page
BIG = CacheSpec(layers=4, num_blocks=48, row_shape=(16, 8192))           # 1 MiB blocks: 16 pages


def wait_ready(daemon) -> None:
    wait_for(lambda: tier_stats(daemon)["state"] == "ready", 60, "the tier companion to be ready")


def tier_stats(daemon) -> dict:
    return daemon.stats()["tier"]


def layout(spec: CacheSpec, model: str, kind: str = "replicated") -> dict:
    return {"model": model, "dtype": spec.dtype, "block_tokens": spec.row_shape[0], "block_bytes": spec.block_bytes(),
            "sharding": kind}


def connect(procs: list[RankProcess], daemon, engine: str, spec: CacheSpec, model: str, kind: str = "replicated"):
    return all_call(procs, "connect", socket=daemon.socket, engine=engine, world_size=len(procs), spec=spec,
                    layout=layout(spec, model, kind), timeout=20.0,
                    per_rank=[{"rank": r, "seed": r} for r in range(len(procs))])


def content_keys(keys: list[bytes], rank: int, sharded: bool) -> list[bytes]:
    """The keys a rank's block content derives from: its shard differs per rank when sharded."""
    return [k + bytes([rank]) for k in keys] if sharded else keys


def store(procs: list[RankProcess], job: int, keys: list[bytes], block_ids: list[int], sharded: bool = False):
    all_call(procs, "fill_keys", per_rank=[{"keys": content_keys(keys, r, sharded), "block_ids": block_ids}
                                           for r in range(len(procs))])
    results = all_call(procs, "store", job=job, keys=keys, block_ids=block_ids)
    assert all(r["ok"] for r in results), results


def load_exact(procs: list[RankProcess], job: int, keys: list[bytes], block_ids: list[int],
               sharded: bool = False) -> None:
    """Every rank loads ``keys`` (all must hit) and holds exactly their bytes."""
    for r in range(len(procs)):                  # scrub the destination first
        procs[r].call("fill", block_ids=block_ids, seed=999)
    results = all_call(procs, "load", job=job, keys=keys, block_ids=block_ids)
    assert all(r["ok"] and r["hits"] == len(keys) for r in results), results
    for r, proc in enumerate(procs):
        assert proc.call("verify_keys", keys=content_keys(keys, r, sharded), block_ids=block_ids) == \
            [True] * len(keys), f"rank {r} loaded wrong bytes"


def fill(procs: list[RankProcess], daemon, prefix: str, blocks: int, spec: CacheSpec, first_job: int,
         sharded: bool = False, per: int = 16) -> int:
    """Store ``blocks`` new blocks in jobs of ``per``, each after the demotes of the one before
    finished (a region filling no faster than the tier takes its victims, and no job larger than
    the free-page reserve). Returns the next job id."""
    job = first_job
    for start in range(0, blocks, per):
        keys = keys_for(f"{prefix}-{start}", min(per, blocks - start))
        store(procs, job, keys, list(range(len(keys))), sharded)
        job += 1
        wait_for(lambda: tier_stats(daemon)["demoting_blocks"] == 0, 30, "demotes to finish")
    return job


def promote(proc: RankProcess, keys: list[bytes], timeout: float = 30.0) -> list[dict]:
    """Look ``keys`` up until they are all hits; returns every answer seen."""
    seen = []

    def hit():
        seen.append(proc.call("lookup_detail", keys=keys))
        return seen[-1]["hits"] == len(keys)
    wait_for(hit, timeout, f"{len(keys)} keys to be promoted", every=0.005)
    return seen


def region_check(daemon) -> dict:
    return ctl_json(daemon, "check")


def dropped(stats: dict) -> int:
    return sum(stats["demote_dropped_blocks"].values())

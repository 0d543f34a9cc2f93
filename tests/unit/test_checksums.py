"""Per-entry checksums: computed by writers, combined per entry, verified by scan."""

from __future__ import annotations

import numpy as np
import pytest

from kvtierd.contract.codes import ErrorCode, RequestError
from kvtierd.contract.region_sums import entry_checksum, shard_checksum
from kvtierd.recovery import scan
from kvtierd.store import Store

from .store_env import PAGE, TIMEOUT, FakeClock, W, keys, lay, make_view, pages, per_entry, slot_pages


def fill_and_commit(store, view, sessions, job, ks):
    """Store ``ks``; each writer writes random bytes into its pages and commits their checksums."""
    rng = np.random.default_rng(job)
    for s in sessions:
        outcomes, got = store.store(s, job, ks)
        if s.rank in s.engine.writers:
            rows = [pages(p) for p in per_entry(got, outcomes.count(W))]
            for row in rows:
                for page in row:
                    view.data[page * PAGE:(page + 1) * PAGE] = rng.integers(0, 256, PAGE, dtype=np.uint8)
            block = s.engine.ns.id.block_bytes
            store.commit(s, job, True, [shard_checksum(view.data, np.asarray(r), PAGE, block) for r in rows])


@pytest.mark.parametrize("kind,world_size", [("replicated", 2), ("sharded", 2)])
def test_checksums_recorded_and_verified_by_scan(kind, world_size):
    view = make_view(32)
    store = Store(view, job_timeout=TIMEOUT, clock=FakeClock(), checksums=True)
    sessions = [store.attach("e", r, world_size, lay(kind, world_size, block_bytes=PAGE + 100))
                for r in range(world_size)]
    fill_and_commit(store, view, sessions, 1, keys("k", 3))
    recorded = view.entries["checksum"][view.entries["state"] == 2]
    assert len(recorded) == 3 and (recorded != 0).all()
    assert scan(view, verify_checksums=True).problems == []
    slot, chain = slot_pages((store.index, sessions[0].engine.ns), b"k1")
    view.data[chain[-1] * PAGE + 50] ^= 1                          # inside the last shard's bytes
    assert scan(view, verify_checksums=True).problems == [(slot, "checksum mismatch")]
    assert scan(view).problems == []                               # without verification: unseen
    # A restarted daemon with checksums on discards exactly that entry.
    restarted = Store(view, job_timeout=TIMEOUT, clock=FakeClock(), checksums=True)
    assert restarted.recovered["corrupt_discarded"] == 1 and restarted.recovered["ready"] == 2
    restarted.verify()


def test_bytes_past_the_block_in_the_last_page_are_not_hashed():
    data = np.zeros(4 * PAGE, dtype=np.uint8)
    row = np.array([2, 0])
    before = shard_checksum(data, row, PAGE, PAGE + 10)
    data[0 * PAGE + 10] = 7                                       # tail of the last page: unused
    assert shard_checksum(data, row, PAGE, PAGE + 10) == before
    data[0 * PAGE + 9] = 7
    assert shard_checksum(data, row, PAGE, PAGE + 10) != before


def test_entry_checksum_is_never_zero_and_depends_on_shard_order():
    assert entry_checksum([0]) == 1
    assert entry_checksum([1, 2]) != entry_checksum([2, 1])


def test_commit_with_the_wrong_number_of_checksums_is_refused():
    view = make_view(16)
    store = Store(view, job_timeout=TIMEOUT, clock=FakeClock(), checksums=True)
    (s,) = [store.attach("e", 0, 1, lay())]
    store.store(s, 1, keys("k", 2))
    with pytest.raises(RequestError) as err:
        store.commit(s, 1, True, [1])
    assert err.value.code == ErrorCode.BAD_REQUEST
    store.commit(s, 1, True, [5, 6])
    store.verify()

"""The disk tier's backend on real files: restarts, the directory's rules, damage, capacity and
eviction, full, read-only and dying disks.

The backend runs in the test process with a region-like mapping attached (as in
test_backends.py, whose byte-exact, namespace and batch tests run for the disk too); blocks hold
content derived from their key and are sealed with the test key, so a torn, foreign or damaged
block cannot pass. "A reboot" here is the backend closed and a new one opened on the same
directory with the region scrubbed; tests/tier/test_disk_nodes.py does it with real daemons.
"""

from __future__ import annotations

import json
import os
import resource
import signal

import numpy as np
import pytest

from kvtierd.tier.backend import Owner, TierRejected, open_backend, page_extents
from kvtierd.tier.disk import CAUSES, RUN_BYTES, DiskBackend, io_runs
from kvtierd.tier.diskformat import FORMAT_FILE, RECORD, checksums, name_digest
from kvtierd.tier.keys import Keyspace
from kvtierd.tier.seal import SUM_ID, SealKey, Seals

from .conftest import KEY, OWNER, move, seals

pytestmark = pytest.mark.timeout(120)

PAGE = 16 << 10
LENGTH = 3 * PAGE - 123          # three pages, the last partly used: a tail through the bounce buffer
SLOT = 3 * PAGE                  # its slot: the extents rounded up to 4 KiB
NS = Keyspace(b"model-disk|bf16|16|49029|replicated")
OTHER = Keyspace(b"model-other|bf16|16|49029|replicated")


@pytest.fixture
def region(make_region):
    return make_region(pages=512, page_size=PAGE)


def opened(address: str, region, owner: Owner = OWNER, **settings) -> DiskBackend:
    b = open_backend("disk", address, **settings)
    b.attach(region.memory, owner)
    return b


def blocks(n: int, first: int = 0) -> np.ndarray:
    return np.arange(first, first + 3 * n).reshape(n, 3)


def store(b, region, ks: Keyspace, keys: list[bytes], pages: np.ndarray) -> list[bool]:
    for k, p in zip(keys, pages):
        region.write(k, p.tolist(), LENGTH)
    return move(b, "put", ks, keys, region, pages, LENGTH)


def fetch_exact(b, region, ks: Keyspace, keys: list[bytes], first: int = 300) -> list[bool]:
    """Get ``keys`` into fresh pages; True for each that landed and holds exactly its bytes."""
    region.scrub()
    pages = blocks(len(keys), first)
    got = move(b, "get", ks, keys, region, pages, LENGTH)
    return [g and region.holds(k, p.tolist(), LENGTH) for g, k, p in zip(got, keys, pages)]


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


# ------------------------------------------------------------------------------------------ restarts
def test_every_block_is_found_again_after_a_reopen_and_no_other_namespace_gets_it(disk, region):
    b = opened(disk.address, region)
    keys = keys_of("kept", 40)
    assert store(b, region, NS, keys, blocks(40)) == [True] * 40
    assert b.info()["blocks"] == 40 and b.info()["direct"] is True
    b.close()
    b = opened(disk.address, region)           # "after a reboot": nothing but the directory
    try:
        assert b.info()["loaded_blocks"] == 40 and b.info()["dropped_records"] == 0
        assert b.exists(NS.names(keys)) == [True] * 40
        assert b.exists(OTHER.names(keys)) == [False] * 40
        assert move(b, "get", OTHER, keys[:4], region, blocks(4, 300), LENGTH) == [False] * 4
        assert fetch_exact(b, region, NS, keys) == [True] * 40
    finally:
        b.close()


def test_a_block_already_held_is_not_written_again(disk, region):
    b = opened(disk.address, region)
    try:
        assert store(b, region, NS, [b"once"], blocks(1)) == [True]
        region.write(b"something-else", [0, 1, 2], LENGTH)      # the same key again, other bytes
        assert move(b, "put", NS, [b"once"], region, blocks(1), LENGTH) == [True]
        assert fetch_exact(b, region, NS, [b"once"]) == [True]  # still the first value: write once
        assert b.info()["blocks"] == 1
    finally:
        b.close()


def test_sharded_blocks_with_tails_leave_the_region_past_them_untouched(disk, region):
    """Two shards of LENGTH each, every shard on pages of its own (a sharded entry): the tails of
    both go through the bounce buffer; the bytes of the pages past each shard are not touched."""
    b = opened(disk.address, region)
    try:
        keys = keys_of("sharded", 4)
        src = np.arange(24).reshape(8, 3)                # 4 blocks × 2 shards × 3 pages
        for i, k in enumerate(keys):
            for s in range(2):
                region.write(k + bytes([s]), src[2 * i + s].tolist(), LENGTH)
        ext = page_extents(src, PAGE, LENGTH)
        ext = [ext[2 * i] + ext[2 * i + 1] for i in range(4)]
        assert b.put(NS.names(keys), ext, seals(NS, keys, region.memory, ext, shards=2)) == [True] * 4
        region.scrub()
        marker = region.data.reshape(-1, PAGE)
        marker[:, LENGTH - 2 * PAGE:] = 0xA5             # past each block's bytes in its last page
        dst = np.random.default_rng(3).permutation(np.arange(100, 124)).reshape(8, 3)
        ext = page_extents(dst, PAGE, LENGTH)
        ext = [ext[2 * i] + ext[2 * i + 1] for i in range(4)]
        assert b.get(NS.names(keys), ext, seals(NS, keys, region.memory, ext, shards=2)) == [True] * 4
        for i, k in enumerate(keys):
            for s in range(2):
                assert region.holds(k + bytes([s]), dst[2 * i + s].tolist(), LENGTH)
                assert (marker[dst[2 * i + s][-1], LENGTH - 2 * PAGE:] == 0xA5).all()
    finally:
        b.close()


def test_buffered_io_when_o_direct_is_off(disk, region):
    b = opened(disk.address, region, direct=False)
    try:
        keys = keys_of("buffered", 8)
        assert store(b, region, NS, keys, blocks(8)) == [True] * 8
        assert b.info()["direct"] is False
        assert fetch_exact(b, region, NS, keys) == [True] * 8
    finally:
        b.close()


# ------------------------------------------------------------------------------------------ the directory's rules
def test_another_daemon_another_format_another_key_or_foreign_files_are_refused(disk, region):
    b = opened(disk.address, region)
    store(b, region, NS, [b"x"], blocks(1))
    # In use: a second companion at the same time (two daemons cannot share a disk tier at once).
    with pytest.raises(TierRejected, match=r"in use by another tier companion \(pid \d+\)"):
        opened(disk.address, region)
    b.close()
    with pytest.raises(TierRejected, match="belongs to the daemon named 'kvtierd', not to 'other'"):
        opened(disk.address, region, Owner("other", OWNER.key_id))
    with pytest.raises(TierRejected, match="sealed with key id .* every block would fail its check"):
        opened(disk.address, region, Owner("kvtierd", SealKey(b"k" * 32).id_hex))
    header_path = os.path.join(disk.address, FORMAT_FILE)
    with open(header_path) as f:
        header = json.load(f)
    with open(header_path, "w") as f:
        json.dump({**header, "version": 0}, f)
    with pytest.raises(TierRejected, match="written by an older kvtierd .*disk format 0"):
        opened(disk.address, region)
    foreign = os.path.join(disk.root, "foreign")
    os.makedirs(foreign)
    open(os.path.join(foreign, "notes.txt"), "w").close()
    with pytest.raises(TierRejected, match=r"holds files that are not a kvtierd disk tier's \(notes.txt\)"):
        opened(foreign, region)


@pytest.mark.parametrize("what", ["group-writable", "other-writable", "a writable file", "another owner"])
def test_a_directory_others_can_change_is_refused(disk, region, what):
    """The checksums suffice only because none but the daemon's user can change the directory."""
    b = opened(disk.address, region)
    store(b, region, NS, [b"x"], blocks(1))
    b.close()
    path = disk.address
    if what == "group-writable":
        os.chmod(path, 0o770)
    elif what == "other-writable":
        os.chmod(path, 0o702)
    elif what == "a writable file":
        path = os.path.join(disk.address, f"slots-{SLOT}.data")
        os.chmod(path, 0o620)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(path, 65534, 65534)
    fix = f"chown -R {os.geteuid()}" if what == "another owner" else "chmod -R go-w"
    with pytest.raises(TierRejected, match=f"is not private to this daemon's user: .*{path}.*{fix} {disk.address}"):
        opened(disk.address, region)
    if what == "another owner":
        os.chown(path, 0, 0)
    else:
        os.chmod(path, 0o600 if path != disk.address else 0o700)
    b = opened(disk.address, region)                # the fix named: served again
    try:
        assert fetch_exact(b, region, NS, [b"x"]) == [True]
    finally:
        b.close()


# ------------------------------------------------------------------------------------------ damage
def damage(path: str, offset: int, n: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(bytes(x ^ 0xFF for x in old))


def slot_of(b: DiskBackend, ks: Keyspace, key: bytes) -> int:
    return b.index.find(ks.names([key]))[0][1]


def test_damaged_records_are_dropped_and_the_rest_served(disk, region):
    b = opened(disk.address, region)
    keys = keys_of("rec", 20)
    store(b, region, NS, keys, blocks(20))
    hurt = [keys[3], keys[11], keys[19]]
    slots = [slot_of(b, NS, k) for k in hurt]
    b.close()
    rec = os.path.join(disk.address, f"slots-{SLOT}.rec")
    for slot, field in zip(slots, ("digest", "seal", "length")):      # torn or flipped by hand
        damage(rec, slot * RECORD.itemsize + RECORD.fields[field][1])
    b = opened(disk.address, region)
    try:
        assert b.info()["dropped_records"] == 3 and b.info()["loaded_blocks"] == 17
        assert b.exists(NS.names(hurt)) == [False] * 3
        rest = [k for k in keys if k not in hurt]
        assert fetch_exact(b, region, NS, rest) == [True] * 17
    finally:
        b.close()


def test_damaged_data_fails_its_checksum_and_is_dropped(disk, region):
    b = opened(disk.address, region)
    try:
        keys = keys_of("data", 6)
        store(b, region, NS, keys, blocks(6))
        records = np.fromfile(os.path.join(disk.address, f"slots-{SLOT}.rec"), RECORD)
        held = records[records["length"] != 0]
        assert len(held) == 6 and all(bytes(seal)[:4] == SUM_ID for seal in held["seal"])   # checksums, not MACs
        damage(os.path.join(disk.address, f"slots-{SLOT}.data"), slot_of(b, NS, keys[2]) * SLOT + 5000)
        region.scrub()
        ext = page_extents(blocks(6, 300), PAGE, LENGTH)
        sealed = seals(NS, keys, region.memory, ext)
        assert b.get(NS.names(keys), ext, sealed) == [True, True, False, True, True, True]
        assert sealed.rejected() == {"mismatch": 1, "other_key": 0}
        assert b.exists(NS.names(keys[2:3])) == [False]           # dropped: never tried again
    finally:
        b.close()


def test_a_directory_sealed_with_macs_by_0_3_1_is_still_checked_with_them_and_served(disk, region, monkeypatch):
    """0.3.1 wrote each record's seal field with the keyed BLAKE3 MAC; such records are checked
    with it (no format change), beside the checksums of blocks written since; a damaged one fails."""
    b = opened(disk.address, region)
    old = keys_of("old", 8)
    with monkeypatch.context() as m:
        m.setattr(Seals, "sums", lambda self, indices: [self.make(i) for i in indices])    # 0.3.1's seals
        assert store(b, region, NS, old, blocks(8)) == [True] * 8
    hurt = slot_of(b, NS, old[5])
    b.close()
    records = np.fromfile(os.path.join(disk.address, f"slots-{SLOT}.rec"), RECORD)
    assert all(bytes(seal)[:4] == KEY.id for seal in records[records["length"] != 0]["seal"])
    damage(os.path.join(disk.address, f"slots-{SLOT}.data"), hurt * SLOT + 4321)
    b = opened(disk.address, region)
    try:
        new = keys_of("new", 8)
        assert store(b, region, NS, new, blocks(8, 100)) == [True] * 8
        region.scrub()
        ext = page_extents(blocks(16, 300), PAGE, LENGTH)
        sealed = seals(NS, old + new, region.memory, ext)
        assert b.get(NS.names(old + new), ext, sealed) == [i != 5 for i in range(16)]
        assert sealed.rejected() == {"mismatch": 1, "other_key": 0}
        assert fetch_exact(b, region, NS, old[:5] + old[6:] + new) == [True] * 15
        assert b.exists(NS.names(old[5:6])) == [False]
    finally:
        b.close()


def test_a_block_claimed_for_another_namespace_or_key_fails_its_seal(disk, region):
    """A record rewritten (with a valid checksum) to say that its slot holds another namespace's
    block, or another key's: the bytes are real blocks, but the seal binds them to their own
    namespace and key, so neither is ever served as the other."""
    b = opened(disk.address, region)
    store(b, region, NS, [b"a", b"b"], blocks(2))
    slots = {k: slot_of(b, NS, k) for k in (b"a", b"b")}
    b.close()
    rec = os.path.join(disk.address, f"slots-{SLOT}.rec")
    records = np.fromfile(rec, RECORD)
    records[slots[b"a"]]["digest"] = name_digest(OTHER.names([b"a"])[0])       # "a" now claims OTHER's "a"
    records[slots[b"b"]]["digest"] = name_digest(NS.names([b"c"])[0])          # "b" claims key "c"
    records["check"] = checksums(records)
    records.tofile(rec)
    b = opened(disk.address, region)
    try:
        assert b.exists(OTHER.names([b"a"]) + NS.names([b"c"])) == [True, True]  # the records say so
        for ks, key in ((OTHER, b"a"), (NS, b"c")):
            ext = page_extents(blocks(1, 300), PAGE, LENGTH)
            sealed = seals(ks, [key], region.memory, ext)
            assert b.get(ks.names([key]), ext, sealed) == [False]
            assert sealed.rejected()["mismatch"] == 1
    finally:
        b.close()


def test_a_block_that_cannot_be_read_fails_alone_in_its_run(disk, region):
    """Blocks in consecutive slots move as one I/O (RUN_BYTES); the data file cut short by hand
    in the middle of a run: that run's I/O fails, then each of its blocks is read alone, so the
    blocks before the cut land byte-exact and only those past it fail (io_error) and are dropped."""
    assert RUN_BYTES // SLOT > 1
    b = opened(disk.address, region)
    try:
        keys = keys_of("cut", 40)
        assert store(b, region, NS, keys, blocks(40)) == [True] * 40
        slots = [slot_of(b, NS, k) for k in keys]
        cut = sorted(slots)[RUN_BYTES // SLOT // 2]          # inside the first run
        os.truncate(os.path.join(disk.address, f"slots-{SLOT}.data"), cut * SLOT + 4096)
        assert fetch_exact(b, region, NS, keys) == [slot < cut for slot in slots]
        assert b.info()["errors"]["io_error"] == sum(slot >= cut for slot in slots)
        assert b.exists(NS.names(keys)) == [slot < cut for slot in slots]      # dropped: never served
    finally:
        b.close()


def test_runs_are_consecutive_slots_of_at_most_run_bytes():
    """(block, slot) pairs sorted by slot: a run ends at a gap in the slots or at RUN_BYTES (one
    block at least, however large); the blocks keep their own indices."""
    most = RUN_BYTES // SLOT
    work = [(i, slot) for i, slot in enumerate([*range(0, most + 3), most + 5, most + 6, 900])]
    runs = io_runs(work, SLOT)
    assert [[slot for _, slot in run] for run in runs] == [list(range(0, most)), [most, most + 1, most + 2],
                                                           [most + 5, most + 6], [900]]
    assert [item for run in runs for item in run] == work
    assert io_runs([(0, 3), (1, 4)], 2 * RUN_BYTES) == [[(0, 3)], [(1, 4)]]
    assert io_runs([], SLOT) == []


def test_a_block_that_cannot_be_written_fails_alone_in_its_run(disk, region):
    """A put's blocks in consecutive slots are written as one I/O; the process may not write its
    files past a slot in the middle of the first run (RLIMIT_FSIZE: the kernel writes up to the
    limit, then answers EFBIG). The run's I/O fails, each of its blocks is written again alone: the
    blocks before the limit are stored and come back byte-exact, those past it fail (counted,
    never recorded: never served). Slot 10, cut by the limit, is written in part (a short write:
    io_error), the later ones not at all (EFBIG: other)."""
    assert RUN_BYTES // SLOT > 12
    b = opened(disk.address, region)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # EFBIG instead of the signal
    try:
        assert store(b, region, NS, [b"first"], blocks(1, 200)) == [True]    # the data file grown
        assert slot_of(b, NS, b"first") == 0
        keys = keys_of("limit", 30)
        resource.setrlimit(resource.RLIMIT_FSIZE, (11 * SLOT - 4096, limit[1]))   # slot 10 is cut
        done = store(b, region, NS, keys, blocks(30))
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        assert done == [True] * 9 + [False] * 21                   # slots 1-9 whole, then nothing
        errors = b.info()["errors"]                                 # slot 10 written in part: short
        assert (errors["io_error"], errors["other"]) == (1, 20)     # the rest refused: EFBIG
        assert b.exists(NS.names(keys)) == done
        assert fetch_exact(b, region, NS, keys[:9] + [b"first"]) == [True] * 10
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
        b.close()


# ------------------------------------------------------------------------------------------ capacity
def test_capacity_evicts_the_least_recently_used(disk, region):
    b = opened(disk.address, region, capacity=8 * SLOT + 2 * 4096)   # 8 slots (and the records)
    try:
        first = keys_of("old", 8)
        assert store(b, region, NS, first, blocks(8)) == [True] * 8
        assert fetch_exact(b, region, NS, first[:1]) == [True]       # used again: the most recent now
        more = keys_of("new", 4)
        assert store(b, region, NS, more, blocks(4, 100)) == [True] * 4
        assert b.exists(NS.names(first)) == [True] + [False] * 4 + [True] * 3
        info = b.info()
        assert info["blocks"] == 8 and info["allocated_bytes"] <= info["capacity_bytes"]
        assert fetch_exact(b, region, NS, first[:1] + first[5:] + more) == [True] * 8
    finally:
        b.close()


def test_two_slot_sizes_share_the_capacity(disk, region):
    """The capacity is full of one slot size; blocks of another size take the least recently
    used slots' space (punched out), and after a reopen the survivors are still exact."""
    small = PAGE                                                     # one-page blocks: slots of 16 KiB
    b = opened(disk.address, region, capacity=8 * SLOT + 4 * 4096)
    olds = keys_of("big", 8)
    store(b, region, NS, olds, blocks(8))
    keys = keys_of("small", 6)
    for k, p in zip(keys, range(200, 206)):
        region.write(k, [p], small)
    assert move(b, "put", NS, keys, region, np.arange(200, 206).reshape(6, 1), small) == [True] * 6
    info = b.info()
    assert sorted(info["slot_sizes"]) == [small, SLOT] and info["allocated_bytes"] <= info["capacity_bytes"]
    held = b.exists(NS.names(olds))
    assert 0 < sum(held) < 8 and held[-sum(held):] == [True] * sum(held)     # the oldest went
    b.close()
    b = opened(disk.address, region, capacity=8 * SLOT + 4 * 4096)
    try:
        survivors = [k for k, h in zip(olds, held) if h]
        assert fetch_exact(b, region, NS, survivors) == [True] * len(survivors)
        region.scrub()
        assert move(b, "get", NS, keys, region, np.arange(400, 406).reshape(6, 1), small) == [True] * 6
        assert all(region.holds(k, [400 + i], small) for i, k in enumerate(keys))
    finally:
        b.close()


# ------------------------------------------------------------------------------------------ bad disks
def test_a_full_filesystem_is_counted_and_refused(mount, region, caplog):
    fs = mount("tmpfs", 8)
    with open(os.path.join(fs.path, "hog"), "wb") as f:          # someone else fills the disk
        f.write(b"\0" * (7 << 20))
    b = opened(os.path.join(fs.path, "tier"), region, capacity="100%", free_floor=0)
    try:
        keys = keys_of("full", 40)                               # 40 × 48 KiB: more than the 1 MiB left
        for k, p in zip(keys, blocks(40)):
            region.write(k, p.tolist(), LENGTH)
        done = move(b, "put", NS, keys, region, blocks(40), LENGTH)
        assert 0 < sum(done) < 40                                # what fitted, and no more
        errors = b.info()["errors"]
        assert set(errors) == set(CAUSES) and errors["full"] + errors["no_space"] >= 1
        # Later blocks take the place of the tier's own oldest: it never grows past the disk.
        more = keys_of("more", 8)
        for k, p in zip(more, blocks(8, 200)):
            region.write(k, p.tolist(), LENGTH)
        assert move(b, "put", NS, more, region, blocks(8, 200), LENGTH) == [True] * 8
        held = [k for k, d in zip(keys, done) if d][8:]
        assert fetch_exact(b, region, NS, held + more) == [True] * (len(held) + 8)
        assert os.path.getsize(os.path.join(fs.path, "hog")) == 7 << 20
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk tier")]
        assert len(logged) == len({m.rsplit("(", 1)[1] for m in logged})          # once per cause
    finally:
        b.close()
    with open(os.path.join(fs.path, "hog2"), "wb") as f:         # the disk is full now
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    with pytest.raises(TierRejected, match="cannot be formatted: No space left on device"):
        opened(os.path.join(fs.path, "another"), region)


def test_the_free_floor_is_never_crossed(mount, region):
    fs = mount("tmpfs", 16)
    b = opened(os.path.join(fs.path, "tier"), region, capacity="100%", free_floor="50%")
    try:
        keys = keys_of("floor", 300)                             # 300 × 48 KiB: more than the 8 MiB allowed
        for start in range(0, 300, 50):
            for k, p in zip(keys[start:start + 50], blocks(50)):
                region.write(k, p.tolist(), LENGTH)
            assert move(b, "put", NS, keys[start:start + 50], region, blocks(50), LENGTH) == [True] * 50
            st = os.statvfs(fs.path)
            assert st.f_bavail * st.f_frsize >= 8 << 20          # half the 16 MiB stays free, always
        # The tier made room by evicting its own oldest blocks: the newest are all there.
        assert b.info()["blocks"] * SLOT <= 8 << 20
        assert b.exists(NS.names(keys[:50])) == [False] * 50
        assert fetch_exact(b, region, NS, keys[-50:]) == [True] * 50
    finally:
        b.close()


def test_a_read_only_filesystem_serves_promotes_only(mount, region):
    fs = mount("tmpfs", 16)
    address = os.path.join(fs.path, "tier")
    b = opened(address, region)
    keys = keys_of("ro", 10)
    store(b, region, NS, keys, blocks(10))
    b.close()
    os.mkdir(os.path.join(fs.path, "fresh"))
    fs.remount("ro")
    b = opened(address, region)
    try:
        assert b.info()["writable"] is False and b.info()["errors"]["read_only"] == 1
        assert fetch_exact(b, region, NS, keys) == [True] * 10
        with pytest.raises(TierRejected, match="read-only"):
            move(b, "put", NS, keys_of("more", 2), region, blocks(2), LENGTH)
    finally:
        b.close()
    with pytest.raises(TierRejected, match="fresh cannot hold its lock .*: Read-only file system"):
        opened(os.path.join(fs.path, "fresh"), region)


def test_a_dying_disk_fails_its_blocks_with_io_errors_counted(mount, region):
    """An ext4 filesystem on a loop device that is cut short under it: the block layer answers
    EIO for every I/O past the device's new end. Those blocks fail and are dropped; the calls
    return (nothing hangs) and the error is counted as io_error."""
    fs = mount("ext4", 64)
    b = opened(os.path.join(fs.path, "tier"), region, capacity="40MiB", free_floor=0)
    try:
        keys = keys_of("dying", 60)
        assert store(b, region, NS, keys, blocks(60)) == [True] * 60
        fs.shrink_device(4)                                      # the data file's extents lie past 4 MiB
        region.scrub()
        got = move(b, "get", NS, keys, region, blocks(60, 300), LENGTH)
        assert not all(got)
        assert b.info()["errors"]["io_error"] >= 1
        lost = [k for k, g in zip(keys, got) if not g]
        assert b.exists(NS.names(lost)) == [False] * len(lost)   # dropped: never served
    finally:
        b.close()

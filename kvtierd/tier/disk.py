"""The node's own disk as the second tier: blocks in preallocated slab files, written and read
with O_DIRECT from and into the region's pages, indexed by checksummed records, kept across
restarts and reboots (docs/tier.md, "The disk tier").

``tier_address`` is a directory on a local filesystem (``diskformat`` has its layout and the
rules of who may use it); ``tier_settings`` may give ``capacity`` (bytes such as "500GiB", or a
share of the filesystem such as "50%"; default 50%), ``free_floor`` (the free space the tier
never takes: bytes or a share, default 5%), ``io_threads`` (I/Os in flight, default 4),
``direct`` (O_DIRECT where the filesystem allows it, default true) and ``timeout`` (an I/O slower
than this counts ``slow``; the daemon passes ``tier_timeout``).

Put (``put``): slots are taken (free ones; else the file grows by preallocated chunks while the
capacity and the free-space floor allow; else the least recently used blocks are evicted — of
any slot size: another size's slot is punched out to give its space back), then the blocks are
written straight from the region — blocks in consecutive slots as one I/O of up to
``RUN_BYTES``, the runs cut into ``io_threads`` sequential streams, each run checksummed by its
I/O thread first (``seal.Seals.sums``: compiled, the GIL released) — then the data file is synced
(``fdatasync``), and only then the blocks' records, holding the checksums, are written and
synced: a record never names data that is not durable. A SIGKILL or power loss mid-write leaves
either no record for the slot or an older one whose checksum no longer matches the slot's bytes:
that block fails its check when it is read, and is dropped (never served). A block already held
is not written again.

Get (``get``): the records are read back and checked, the blocks are read straight into their
pages in the same runs and streams, and each run is checked by the thread that read it (records
written by 0.3.1 carry a MAC seal instead: those go to the seal threads); a block that fails
(checksum, seal, record, I/O error) is dropped from the index and its record cleared. A run
whose I/O fails is moved again block by block, so a bad block fails alone.

Restart: ``attach`` claims the directory and loads every slab's records at once
(``diskindex.DiskIndex``: checksums and index vectorised, no Python object per record); a torn
or damaged record is dropped and counted (``dropped_records``).

Bad disks never hang the daemon (its loop only ever waits on the companion's socket) and never
stop it serving from RAM: a failed write or read fails its blocks and is counted by cause
(``CAUSES``: no_space = ENOSPC/EDQUOT, io_error = EIO, read_only = EROFS, full = capacity or free
floor reached with nothing to evict, slow = an I/O past ``timeout``, other), logged once per
cause; a call whose every block failed raises (``TierRejected`` for a full or read-only disk,
which pauses demotes without opening the breaker, ``TierFailed`` otherwise). A directory on a
read-only filesystem is served read-only: promotes work, demotes are refused.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from operator import itemgetter
from typing import Iterable, Sequence

import numpy as np

from ..config import parse_size
from .backend import Backend, Block, Owner, TierFailed, TierRejected, TierUnavailable
from .diskformat import (RECORD, block_records, claim, digest_index, hole_records, keyspace_digest, name_digest,
                         slot_bytes, supports_direct, whole)
from .diskindex import DiskIndex
from .seal import KEY_ID_BYTES, SEAL_BYTES, SUM_ID, Seals
from .slabs import Slab

log = logging.getLogger("kvtierd.tier")

CAUSES = ("no_space", "io_error", "read_only", "full", "slow", "other")
GROW_BYTES = 256 << 20         # a slab grows by this much at a time (less near the capacity)
# One I/O moves up to this many bytes of blocks in consecutive slots (one block at least): a batch of
# 64 KiB blocks is then 16 times fewer syscalls, pool tasks and disk commands.
RUN_BYTES = 1 << 20
SLAB_FILE = re.compile(r"slots-(\d+)\.data$")
_ERRNO_CAUSE = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EIO: "io_error", errno.EROFS: "read_only"}


def parse_amount(text: str | int, setting: str) -> tuple[int, float]:
    """``"64GiB"`` → (bytes, 0); ``"50%"`` → (0, 0.5): a size or a share of the filesystem."""
    if isinstance(text, str) and text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share <= 1:
            raise ValueError(f"tier_settings {setting}: {text!r} is not a share between 0% and 100%")
        return 0, share
    try:
        return parse_size(text), 0.0
    except ValueError as exc:
        raise ValueError(f"tier_settings {setting}: {exc}, or a share of the filesystem such as 50%") from None


def io_runs(work: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """(block, slot) pairs sorted by slot → runs of consecutive slots of at most ``RUN_BYTES``
    (one block at least): one I/O each."""
    most = max(1, RUN_BYTES // size)
    out: list[list[tuple[int, int]]] = []
    for item in work:
        run = out[-1] if out else None
        if run is None or item[1] != run[-1][1] + 1 or len(run) == most:
            out.append([item])
        else:
            run.append(item)
    return out


def cause_of(exc: OSError) -> str:
    return _ERRNO_CAUSE.get(exc.errno, "other")


class DiskBackend(Backend):
    name = "disk"
    concurrent = True        # one index serves both lanes, under its lock

    def __init__(self, address: str, capacity: str | int = "50%", free_floor: str | int = "5%",
                 io_threads: int = 4, direct: bool = True, timeout: float = 0.5):
        """``address``: the tier's directory on a local filesystem."""
        if not address:
            raise ValueError("the disk tier needs a directory (tier_address)")
        if not isinstance(io_threads, int) or not 1 <= io_threads <= 256:
            raise ValueError(f"tier_settings io_threads: {io_threads!r} is not an integer in 1..256")
        self.directory = os.path.abspath(address)
        self.capacity_setting = parse_amount(capacity, "capacity")
        self.floor_setting = parse_amount(free_floor, "free_floor")
        self.io_threads, self.want_direct, self.slow = io_threads, bool(direct), float(timeout)
        self.lock = threading.Lock()                 # around the index and the slabs' arrays
        self.index = DiskIndex()
        self.errors: Counter = Counter()
        self._logged: set[str] = set()
        self.load_seconds = 0.0
        self.memory: memoryview | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.lock_fd: int | None = None
        self.writable = False
        self.direct = False
        self.capacity = self.floor = 0

    # ------------------------------------------------------------------ opening
    def attach(self, memory: memoryview, owner: Owner) -> None:
        if memory.readonly or not memory.contiguous:
            raise ValueError("the tier's memory must be writable and contiguous")
        self.memory = memory.cast("B") if memory.format != "B" else memory
        started = time.perf_counter()
        self.lock_fd, self.writable = claim(self.directory, owner)
        st = os.statvfs(self.directory)
        total = st.f_blocks * st.f_frsize
        self.capacity = self.capacity_setting[0] or int(self.capacity_setting[1] * total)
        self.floor = self.floor_setting[0] or int(self.floor_setting[1] * total)
        base = np.frombuffer(self.memory, np.uint8).ctypes.data if self.memory.nbytes else 0
        self.direct = self.want_direct and base % 4096 == 0 and supports_direct(self.directory)
        for name in sorted(os.listdir(self.directory)):
            m = SLAB_FILE.match(name)
            if m:
                self.index.add(Slab(self.directory, int(m.group(1)), self.direct, self.writable))
        self.pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="disk-io")
        self.load_seconds = time.perf_counter() - started
        if not self.writable:
            self._count("read_only", f"{self.directory} is on a read-only filesystem: promotes only")
        log.info("disk tier %s: %d blocks in %d slot sizes loaded in %.2f s (%d damaged records dropped), "
                 "capacity %d bytes, free floor %d bytes, %s I/O", self.directory, self.index.loaded_blocks,
                 len(self.index.slabs), self.load_seconds, self.index.dropped_records, self.capacity, self.floor,
                 "O_DIRECT" if self.direct else "buffered")

    def _drop(self, slab: Slab, slots: np.ndarray) -> None:
        """Forget these slots' blocks and clear their records (a restart must not find them)."""
        slots = np.sort(np.asarray(slots, np.int64))
        if not len(slots):
            return
        slab.index[slots] = 0
        if self.writable:
            try:
                slab.write_records(slots, np.zeros(len(slots), RECORD))
            except OSError as exc:
                self._count(cause_of(exc), f"clearing records: {exc}")

    # ------------------------------------------------------------------ room
    def _room(self) -> int:
        """Bytes the tier may still allocate: under its capacity and above the free floor."""
        allocated = sum(s.allocated() for s in self.index.slabs)
        st = os.statvfs(self.directory)
        return min(self.capacity - allocated, st.f_bavail * st.f_frsize - self.floor)

    def _allocate(self, number: int, n: int) -> np.ndarray:
        """``n`` slots of slab ``number`` (fewer when the disk is full), marked busy."""
        slab = self.index.slabs[number]
        free = np.flatnonzero((slab.index == 0) & (slab.busy == 0) & ~slab.hole)[:n]
        taken = [free]
        need = n - len(free)
        if need:
            room = self._room()
            if room < need * slab.size:
                reused, room = self._evict(number, need, room)
                taken.append(reused)
                need -= len(reused)
            if need and room >= slab.size:
                taken.append(self._grow(slab, min(need, room // slab.size), room))
                need = n - sum(map(len, taken))
            if need:
                self._count("full", f"no room for {need} blocks of {slab.size} bytes within the capacity "
                            f"({self.capacity} bytes) and the free floor ({self.floor} bytes)")
        slots = np.concatenate(taken).astype(np.int64)
        slab.busy[slots] += 1
        return slots

    def _evict(self, number: int, need: int, room: int) -> tuple[np.ndarray, int]:
        """Evict least recently used blocks: slots of this slab are reused as they are; another
        slab's are punched out, their space added to ``room``. Returns (reused slots, room)."""
        size = self.index.slabs[number].size
        reused: list[int] = []
        for other, slot in self.index.victims(max(need * 4, 64)):
            if len(reused) == need or room >= (need - len(reused)) * size:
                break
            if other == number:
                reused.append(slot)
                continue
            victim = self.index.slabs[other]
            self._drop(victim, np.array([slot]))
            if self._punch(victim, slot):
                room += victim.size
        reused_slots = np.array(reused, np.int64)
        self._drop(self.index.slabs[number], reused_slots)
        return reused_slots, room

    def _punch(self, slab: Slab, slot: int) -> bool:
        """Give a slot's space back (its record marks the hole for a restart)."""
        try:
            if not slab.punch(np.array([slot])):
                return False
            slab.write_records(np.array([slot]), hole_records(1))
        except OSError as exc:
            self._count(cause_of(exc), f"punching a slot of {slab.size} bytes: {exc.strerror}")
            return False
        return True

    def _grow(self, slab: Slab, count: int, room: int) -> np.ndarray:
        """``count`` slots for ``slab``: its holes preallocated again, then new preallocated
        slots (a chunk ahead, room allowing)."""
        holes = np.flatnonzero((slab.index == 0) & (slab.busy == 0) & slab.hole)[:count]
        try:
            if len(holes):
                slab.back(holes)
            more = count - len(holes)
            if more:
                first = slab.slots
                slab.extend(max(more, min(room // slab.size, GROW_BYTES // slab.size)))
                holes = np.concatenate((holes, np.arange(first, first + more)))
        except OSError as exc:
            self._count(cause_of(exc), f"preallocating {count} slots of {slab.size} bytes: {exc.strerror}")
            return np.zeros(0, np.int64)
        return holes

    # ------------------------------------------------------------------ errors
    def _count(self, cause: str, detail: str) -> None:
        self.errors[cause] += 1
        if cause not in self._logged:
            self._logged.add(cause)
            log.warning("disk tier %s: %s (%s; further ones are counted, not logged)", self.directory, detail, cause)

    def _failed_call(self, what: str, causes: Counter) -> None:
        """Every block of a call failed: raise by the commonest cause."""
        cause = causes.most_common(1)[0][0] if causes else "other"
        message = f"disk tier {self.directory}: every block of the {what} failed ({cause})"
        if cause in ("no_space", "full", "read_only"):
            raise TierRejected(message)
        raise TierFailed(message)

    def _streams(self, fn, tasks: list) -> list:
        """``fn`` of each task, the tasks cut into ``io_threads`` contiguous shares, each done in
        order by one I/O thread: as many sequential streams as threads. Returns (or raises) only
        once every stream has ended: the call's answer is the proof that none of its I/O still
        touches the region's pages."""
        share = max(1, -(-len(tasks) // self.io_threads))
        parts = [self.pool.submit(lambda first=first: [fn(task) for task in tasks[first:first + share]])
                 for first in range(0, len(tasks), share)]
        wait(parts)
        return [result for part in parts for result in part.result()]

    def _move(self, slab: Slab, run: list[tuple[int, int]], blocks: Sequence[Block],
              write: bool) -> list[str | None]:
        """One I/O for a run of (block, slot) in consecutive slots; when it fails, each block again
        alone, so that a bad block fails alone. The cause of each block's failure (None: moved)."""
        io = slab.write_blocks if write else slab.read_blocks
        started = time.perf_counter()
        try:
            io(run[0][1], self.memory, [blocks[i] for i, _ in run])
        except OSError as exc:
            if len(run) > 1:
                return [self._move(slab, [item], blocks, write)[0] for item in run]
            self._count(cause_of(exc), f"{'writing' if write else 'reading'} a block: {exc.strerror}")
            return [cause_of(exc)]
        took = time.perf_counter() - started
        if took > self.slow:
            self._count("slow", f"one I/O of {len(run)} blocks took {took:.2f} s (slow above {self.slow} s: "
                        "tier_timeout)")
        return [None] * len(run)

    # ------------------------------------------------------------------ calls
    def exists(self, keys: list[str]) -> list[bool]:
        with self.lock:
            return [hit is not None for hit in self.index.find(keys)]

    def put(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        if not keys:
            return []
        if not self.writable:
            self._count("read_only", f"{self.directory} is on a read-only filesystem")
            raise TierRejected(f"disk tier {self.directory} is read-only: no demotes")
        done = [False] * len(keys)
        by_size: dict[int, list[int]] = {}
        for i, block in enumerate(blocks):
            by_size.setdefault(slot_bytes(block), []).append(i)
        causes: Counter = Counter()
        for size, items in by_size.items():
            self._put_size(size, items, keys, blocks, seals, done, causes)
        if not any(done):
            self._failed_call("put", causes)
        return done

    def _put_size(self, size: int, items: list[int], keys: list[str], blocks, seals: Seals, done: list,
                  causes: Counter) -> None:
        """Write the blocks ``items`` of one slot size: slots, then data, sync, records, sync."""
        with self.lock:
            held = self.index.find([keys[i] for i in items])
            fresh = [i for i, hit in zip(items, held) if hit is None or hit[0].size != size]
            for i, hit in zip(items, held):
                done[i] = hit is not None and hit[0].size == size    # held already: blocks are immutable
            if not fresh:
                return
            number = self.index.by_size.get(size)
            try:
                if number is None:
                    number = self.index.add(Slab(self.directory, size, self.direct, self.writable))
            except OSError as exc:
                self._count(cause_of(exc), f"creating the slab of {size} bytes: {exc.strerror}")
                causes[cause_of(exc)] += len(fresh)
                return
            slots = self._allocate(number, len(fresh))
        slab = self.index.slabs[number]
        causes["full"] += len(fresh) - len(slots)
        work = sorted(zip(fresh, slots.tolist()), key=itemgetter(1))
        moved = [item for run in self._streams(lambda run: self._write_run(slab, run, blocks, seals),
                                               io_runs(work, slab.size)) for item in run]
        ok = [(i, slot, seal) for (i, slot), (cause, seal) in zip(work, moved) if cause is None]
        causes.update(cause for cause, _ in moved if cause is not None)
        if ok:
            try:
                slab.sync_data()                # the data is durable before any record names it
                slab.write_records(np.array([slot for _, slot, _ in ok]), self._records(ok, keys, blocks))
            except OSError as exc:
                self._count(cause_of(exc), f"syncing {len(ok)} blocks: {exc.strerror}")
                causes[cause_of(exc)] += len(ok)
                ok = []
            else:
                self._sync_records(slab)
        with self.lock:
            slab.busy[slots] -= 1
            groups: dict[int, list[tuple[int, int]]] = {}
            for i, slot, _ in ok:
                groups.setdefault(self.index.ns_number(keyspace_digest(keys[i])), []).append((slot, i))
            for ns, pairs in groups.items():
                self.index.publish(number, [slot for slot, _ in pairs],
                                   [digest_index(name_digest(keys[i])) for _, i in pairs], ns)
                for _, i in pairs:
                    done[i] = True

    def _write_run(self, slab: Slab, run: list[tuple[int, int]], blocks: Sequence[Block],
                   seals: Seals) -> list[tuple[str | None, bytes]]:
        """Checksum a run of blocks (in this I/O thread, the GIL released) and write it: each
        block's (cause of failure or None, checksum seal)."""
        sums = seals.sums([i for i, _ in run])
        return list(zip(self._move(slab, run, blocks, True), sums))

    def _sync_records(self, slab: Slab) -> None:
        try:
            slab.sync_records()
        except OSError as exc:
            self._count(cause_of(exc), f"syncing records: {exc.strerror}")

    def _records(self, ok: list, keys: list[str], blocks) -> np.ndarray:
        with self.lock:
            first = self.index.clock + 1
            self.index.clock += len(ok)
        return block_records([keys[i] for i, _, _ in ok], [seal for _, _, seal in ok],
                             [sum(n for _, n in blocks[i]) for i, _, _ in ok], first)

    def get(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        if not keys:
            return []
        with self.lock:
            found = [hit if hit is not None and hit[0].size == slot_bytes(block) else None
                     for hit, block in zip(self.index.find(keys), blocks)]
            for hit in filter(None, found):
                hit[0].busy[hit[1]] += 1
        landed = [False] * len(keys)
        try:
            seal_of = self._records_of(found, keys, blocks)
            by_slab: dict[Slab, list[tuple[int, int]]] = {}
            for i, hit in enumerate(found):
                if seal_of[i] is not None:
                    by_slab.setdefault(hit[0], []).append((i, hit[1]))
            runs = [(slab, run) for slab, items in by_slab.items()
                    for run in io_runs(sorted(items, key=itemgetter(1)), slab.size)]
            for checks in self._streams(lambda job: self._read_run(*job, blocks, seals, seal_of), runs):
                for read, checked in checks:
                    for i, ok in zip(read, checked):
                        landed[i] = ok
        finally:
            with self.lock:
                for hit, ok in zip(found, landed):
                    if hit is None:
                        continue
                    slab, slot = hit
                    slab.busy[slot] -= 1
                    if ok:
                        self.index.touch(slab, slot)
                    elif int(slab.index[slot]) != 0:      # failed its check or its read: never again
                        self._drop(slab, np.array([slot]))
        return landed

    def _records_of(self, found: list, keys: list[str], blocks) -> list[bytes | None]:
        """The seal each found block's record gives, once the record is whole and names that
        block with that length (None otherwise: the block is not read)."""
        out: list[bytes | None] = [None] * len(found)
        by_slab: dict[int, list[int]] = {}
        for i, hit in enumerate(found):
            if hit is not None:
                by_slab.setdefault(id(hit[0]), []).append(i)
        for items in by_slab.values():
            slab = found[items[0]][0]
            try:
                records = slab.read_records([found[i][1] for i in items])
            except OSError as exc:
                self._count(cause_of(exc), f"reading records: {exc.strerror}")
                continue
            # Column-wise: per-block numpy scalars cost ~20 µs a block here (5 ms for 256 blocks).
            digests = np.frombuffer(b"".join(name_digest(keys[i]) for i in items), np.uint8).reshape(-1, 16)
            lengths = np.array([sum(n for _, n in blocks[i]) for i in items], np.uint32)
            raw = records.view(np.uint8).reshape(len(records), RECORD.itemsize)
            good = whole(records) & (records["length"] == lengths) & (raw[:, :16] == digests).all(axis=1)
            at = RECORD.fields["seal"][1]
            seals = raw[:, at:at + SEAL_BYTES].tobytes()
            for j in np.flatnonzero(good).tolist():
                out[items[j]] = seals[j * SEAL_BYTES:(j + 1) * SEAL_BYTES]
        return out

    def _read_run(self, slab: Slab, run: list[tuple[int, int]], blocks: Sequence[Block], seals: Seals,
                  seal_of: list) -> list[tuple[list[int], Iterable[bool]]]:
        """Read a run of blocks into their pages and check them: checksum seals here (compiled,
        the GIL released), MAC seals of records written before 0.3.2 on the seal threads (the
        next run is read meanwhile). Pairs of (blocks read, their checks' outcomes)."""
        read = [i for (i, _), cause in zip(run, self._move(slab, run, blocks, False)) if cause is None]
        summed = [i for i in read if seal_of[i][:KEY_ID_BYTES] == SUM_ID]
        out: list[tuple[list[int], Iterable[bool]]] = [(summed, seals.check_sums(summed, [seal_of[i] for i in summed]))]
        if len(summed) < len(read):
            sealed = [i for i in read if seal_of[i][:KEY_ID_BYTES] != SUM_ID]
            out.append((sealed, seals.checking([(i, seal_of[i]) for i in sealed])))
        return out

    def remove(self, keys: list[str]) -> int:
        with self.lock:
            hits = [hit for hit in self.index.find(keys) if hit is not None]
            for slab, slot in hits:
                self._drop(slab, np.array([slot]))
        return len(hits)

    def clear(self, prefix: str) -> int:
        removed = 0
        with self.lock:
            ns = self.index.namespaces.get(keyspace_digest(prefix))
            for slab in self.index.slabs if ns is not None else ():
                slots = np.flatnonzero((slab.index != 0) & (slab.ns == ns))
                self._drop(slab, slots)
                removed += len(slots)
        if removed and self.writable:
            for slab in self.index.slabs:
                slab.sync_records()
        return removed

    def health(self) -> None:
        try:
            os.statvfs(self.directory)
        except OSError as exc:
            raise TierUnavailable(f"disk tier {self.directory}: {exc.strerror}") from None

    def info(self) -> dict:
        with self.lock:
            blocks, used = self.index.held()
            allocated = sum(s.allocated() for s in self.index.slabs)
            sizes = sorted(self.index.by_size)
            errors = {cause: self.errors[cause] for cause in CAUSES}
        try:
            st = os.statvfs(self.directory)
            fs_free = st.f_bavail * st.f_frsize
        except OSError:
            fs_free = 0
        return {"engine": "disk", "directory": self.directory, "zero_copy": self.direct, "direct": self.direct,
                "writable": self.writable, "blocks": blocks, "used_bytes": used, "allocated_bytes": allocated,
                "capacity_bytes": self.capacity, "free_floor_bytes": self.floor, "fs_free_bytes": fs_free,
                "slot_sizes": sizes, "errors": errors, "loaded_blocks": self.index.loaded_blocks,
                "dropped_records": self.index.dropped_records, "load_seconds": round(self.load_seconds, 3)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        for slab in self.index.slabs:
            slab.close()
        self.index = DiskIndex()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

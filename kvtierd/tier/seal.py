"""Seals: the integrity record every value in the second tier carries (invariant 14).

Anyone who can write to a remote tier's engine (a Redis Cluster, a Mooncake Store) could
otherwise plant a value of the right length under a namespace's key, and every engine on every
node would load it. So the companion *seals* each block it demotes and checks the
seal of each block it promotes before it reports the block landed (before the daemon makes it
READY); a block whose check fails is a miss, dropped and counted.

A seal is ``SEAL_BYTES`` (32) bytes: the sealing key's *id* (4 bytes, not secret: SHA-256 of a
label and the key; it tells which key sealed a value) and the first 28 bytes of a keyed BLAKE3
hash (a MAC) of the block bound to its namespace identity and key::

    BLAKE3(key=K; "kvtierd-seal-1" | u32 len(identity) | identity | u16 len(key) | key | u64 bytes | u16 shards | block)

A check fails for one of two reasons (``REASONS``, the metric's label values): ``other_key`` —
the value was sealed under another key id: the nodes disagree on ``tier_key_file`` (each node's
key id is in ``kvtierctl status``); ``mismatch`` — same key, but the bytes, the namespace or the
block key are not the ones sealed (planted, foreign, damaged or torn).

Why keyed BLAKE3 (the ``blake3`` package): every block demoted or promoted is hashed once, so
the MAC's speed bounds the tier's. Measured here over 1 MiB blocks on one thread of a loaded
2-CPU machine: BLAKE3 keyed 1.5-2.6 GiB/s, HMAC-SHA-256 (SHA extensions) 0.47-0.6 GiB/s, keyed
BLAKE2b 0.27-0.31 GiB/s; with HMAC-SHA-256 the seal cost more than the disk tier's O_DIRECT read
of the same block. BLAKE3 releases the GIL (two threads: 2.7 GiB/s), so the seal threads hash
several blocks at once. 224 bits of tag leave forgery out of reach; the other 4
bytes name the key.

The disk tier's blocks carry a *checksum seal* instead (``Seals.sums``/``check_sums``): key id
0 (``SUM_ID``; no key has it — a key whose id digest starts with four zero bytes takes id 1),
the XXH64 (compiled: ``_native.block_sums``) of the block bound the same way, then zeros::

    XXH64("kvtierd-disk-sum-1" | u32 len(identity) | identity | u16 len(key) | key | u64 bytes | u16 shards | block)

Why not the MAC there: invariant 14 ("bytes from outside the node are proven") needs it for the
remote tiers (Mooncake, Redis: other hosts write them), but the disk tier's directory is trusted
exactly as the region is — private to the daemon's user (``diskformat.check_private`` refuses it
otherwise), and anyone who can write it as that user can read ``tier_key_file`` too and forge a
MAC, so a MAC adds nothing. What the disk needs is a checksum that catches a torn or damaged
block and binds it to its namespace, key, length and shards (so no other namespace or key ever
gets it), fast: XXH64 runs 9.3-9.5 GB/s on one core of this machine, against keyed BLAKE3's ~3.5
GiB/s plus its per-block Python (with the MAC, the disk tier's promote of 64 KiB blocks measured
0.72x its O_DIRECT floor; without any check, 0.92x). ``check`` never takes a checksum seal (its
key id is no key's: ``other_key``), so a value planted in a remote tier with one is refused;
the disk tier checks records written by 0.3.1 (MAC seals) with the MAC, as before.

The key: a file (setting ``tier_key_file``) holding at least 32 bytes as hex, readable by the
daemon's user alone (mode 0600 or 0400; anything more open is refused with the chmod that fixes
it). ``load_key(path, create=True)`` generates 32 random bytes there when the file does not
exist (O_EXCL, mode 0600). The same key must be on every node that shares a tier.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
import threading
from operator import itemgetter
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Sequence

import blake3

from .. import _native

SEAL_BYTES = 32
KEY_ID_BYTES = 4
MIN_KEY_BYTES = 32
LABEL = b"kvtierd-seal-1"
# The disk tier's checksum seals: key id 0 (no SealKey has it), then the XXH64 of the bound block
# (little-endian), then zeros; SUM_LABEL opens what is hashed.
SUM_ID = bytes(KEY_ID_BYTES)
SUM_LABEL = b"kvtierd-disk-sum-1"
_SUM_PAD = bytes(SEAL_BYTES - KEY_ID_BYTES - 8)
REASONS = ("mismatch", "other_key")
# Threads that hash a batch's blocks for a backend without threads of its own (Redis, Mooncake);
# BLAKE3 releases the GIL, so they run on as many cores as there are.
HASH_THREADS = min(8, os.cpu_count() or 2)
# Bytes of blocks one task of those threads hashes (~0.3 ms): a task per 64 KiB block cost more in
# handing blocks and the GIL between threads than it saved (256 of them: 7.7-10 ms on two threads,
# 6.5 ms on one).
TASK_BYTES = 1 << 20
# A batch moves through an engine (Mooncake, Redis) in up to PIPELINE_PARTS parts of at least
# PART_BYTES (``pipeline``), so that hashing one part hides behind the transfer of another: only
# the first part's seals (put) or the last part's checks (get) are not overlapped.
PIPELINE_PARTS = 4
PART_BYTES = 4 << 20
_hashers: ThreadPoolExecutor | None = None
_hashers_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _hashers
    with _hashers_lock:
        if _hashers is None:
            _hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="seal")
        return _hashers

Extent = tuple[int, int]


def pipeline(blocks: Sequence[Sequence[Extent]], most: int) -> list[range]:
    """The parts of a batch of ``blocks`` (one length): ranges of consecutive blocks, at most
    ``most`` each (an engine's largest call)."""
    n = len(blocks)
    if not n:
        return []
    length = max(1, sum(size for _, size in blocks[0]))
    part = min(most, max(-(-n // PIPELINE_PARTS), -(-PART_BYTES // length)))
    return [range(i, min(i + part, n)) for i in range(0, n, part)]


class SealKey:
    """The secret, the MAC key derived from it (BLAKE3's key derivation: any length of secret),
    and its public id."""

    __slots__ = ("secret", "mac_key", "id")

    def __init__(self, secret: bytes):
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"a tier key holds at least {MIN_KEY_BYTES} bytes, not {len(secret)}")
        self.secret = bytes(secret)
        self.mac_key = blake3.blake3(self.secret, derive_key_context="kvtierd tier seal key 1").digest()
        key_id = hashlib.sha256(b"kvtierd-seal-key-id" + self.secret).digest()[:KEY_ID_BYTES]
        # Id 0 marks the disk tier's checksums (SUM_ID): the one key in 2**32 whose digest starts
        # with four zero bytes takes id 1 instead, so a MAC's id is never taken for a checksum's.
        self.id = key_id if key_id != SUM_ID else (1).to_bytes(KEY_ID_BYTES, "big")

    @property
    def id_hex(self) -> str:
        return self.id.hex()


def load_key(path: str, create: bool = False) -> SealKey:
    """The key in ``path`` (hex); with ``create``, a new random one written there when absent.
    ValueError names the file and the fix."""
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ValueError(f"cannot create the tier key file {path}: {exc.strerror}; set tier_key_file to a "
                             "writable path, or create the file (64 hex digits, mode 0600)") from None
        else:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(MIN_KEY_BYTES).hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(4096)
    except OSError as exc:
        raise ValueError(f"cannot read the tier key file {path}: {exc.strerror} (setting tier_key_file)") from None
    if stat.S_IMODE(mode) & 0o077:
        raise ValueError(f"the tier key file {path} is open to others (mode {stat.S_IMODE(mode):04o}): "
                         f"chmod 600 {path}")
    try:
        secret = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"the tier key file {path} does not hold hex digits (generate one: "
                         f"head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > {path})") from None
    try:
        return SealKey(secret)
    except ValueError as exc:
        raise ValueError(f"the tier key file {path}: {exc}") from None


class Sealer:
    """Seals of one namespace (its identity) under one key; ``seals`` makes those of a batch."""

    __slots__ = ("key", "_base", "sum_head")

    def __init__(self, key: SealKey, identity: bytes):
        self.key = key
        bound = struct.pack("<I", len(identity)) + identity
        self._base = blake3.blake3(LABEL + bound, key=key.mac_key)
        self.sum_head = SUM_LABEL + bound

    def seals(self, keys: Sequence[bytes], memory: memoryview, blocks: Sequence[Sequence[Extent]],
              shards: int = 1) -> "Seals":
        return Seals(self, keys, memory, blocks, shards)


class Seals:
    """The seals of one put or get: ``make(i)`` the seal of block ``i`` as it is in ``memory``
    now; ``check(i, seal)`` whether the bytes that landed there are the ones sealed. Thread-safe
    per block: a backend may call them for different blocks from several threads."""

    __slots__ = ("sealer", "keys", "memory", "blocks", "shards", "failed")

    def __init__(self, sealer: Sealer, keys: Sequence[bytes], memory: memoryview,
                 blocks: Sequence[Sequence[Extent]], shards: int):
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys for {len(blocks)} blocks")
        if memory.format != "B":             # the region's mapping is a ctypes array ("<B"); BLAKE3 takes bytes
            memory = memory.cast("B")
        self.sealer, self.keys, self.memory, self.blocks, self.shards = sealer, keys, memory, blocks, shards
        self.failed: list[str | None] = [None] * len(keys)    # block → the reason its check failed

    def _tag(self, i: int) -> bytes:
        h = self.sealer._base.copy()
        key, block = self.keys[i], self.blocks[i]
        h.update(struct.pack("<H", len(key)) + key + struct.pack("<QH", sum(n for _, n in block), self.shards))
        mem = self.memory
        for off, n in block:
            h.update(mem[off:off + n])
        return h.digest()[:SEAL_BYTES - KEY_ID_BYTES]

    def make(self, i: int) -> bytes:
        return self.sealer.key.id + self._tag(i)

    def check(self, i: int, seal: bytes | memoryview) -> bool:
        seal = bytes(seal)
        if seal[:KEY_ID_BYTES] != self.sealer.key.id:
            self.failed[i] = "other_key"
            return False
        if not hmac.compare_digest(seal[KEY_ID_BYTES:], self._tag(i)):
            self.failed[i] = "mismatch"
            return False
        return True

    def sums(self, indices: Sequence[int]) -> list[bytes]:
        """The disk tier's checksum seals of blocks ``indices`` as they are in ``memory`` now
        (one compiled pass, the GIL released: call it from the thread that moves the blocks)."""
        raw = _native.block_sums(self.memory, self.sealer.sum_head, self.keys, self.blocks, indices, self.shards)
        return [SUM_ID + raw[k:k + 8] + _SUM_PAD for k in range(0, len(raw), 8)]

    def check_sums(self, indices: Sequence[int], seals: Sequence[bytes]) -> list[bool]:
        """Whether each block of ``indices`` holds the bytes its checksum seal (``seals``, key id
        ``SUM_ID``) was made of; a failure counts as ``mismatch``."""
        out = [bytes(seal) == made for seal, made in zip(seals, self.sums(indices))]
        for i, ok in zip(indices, out):
            if not ok:
                self.failed[i] = "mismatch"
        return out

    def _spread(self, fn, items: Iterable, block_of=lambda item: item) -> Iterator:
        """``fn`` of each item (of block ``block_of(item)``), on ``HASH_THREADS`` threads from now
        on, in tasks of about ``TASK_BYTES`` of blocks; iterating waits for each in turn."""
        tasks: list[list] = [[]]
        size = 0
        for item in items:
            if size >= TASK_BYTES:
                tasks.append([])
                size = 0
            tasks[-1].append(item)
            size += sum(n for _, n in self.blocks[block_of(item)])
        pool = _pool()
        futures = [pool.submit(lambda task=task: [fn(item) for item in task]) for task in tasks if task]
        return (result for future in futures for result in future.result())

    def making(self, indices: Iterable[int]) -> Iterator[bytes]:
        """The seals of blocks ``indices``, hashed on ``HASH_THREADS`` threads from now on, while
        the caller moves other blocks; iterating waits for each in turn."""
        return self._spread(self.make, indices)

    def make_all(self, indices: Iterable[int]) -> list[bytes]:
        """The seals of blocks ``indices``, hashed on ``HASH_THREADS`` threads at once."""
        return list(self.making(indices))

    def checking(self, seals: Iterable[tuple[int, bytes | memoryview]]) -> Iterator[bool]:
        """``check`` of each (block, seal), on ``HASH_THREADS`` threads from now on; iterating
        waits for each in turn."""
        return self._spread(lambda item: self.check(*item), seals, itemgetter(0))

    def check_all(self, seals: Iterable[tuple[int, bytes | memoryview]]) -> list[bool]:
        """``check`` of each (block, seal), on ``HASH_THREADS`` threads at once."""
        return list(self.checking(seals))

    def parts(self, ranges: Sequence[range]) -> Iterator[tuple[range, list[bytes]]]:
        """Each range of blocks (``pipeline``) with its seals: the next range's are hashed while
        the caller moves this one (a put's pipeline: only the first range's hashing is not hidden
        behind a transfer)."""
        ahead = self.making(ranges[0]) if ranges else iter(())
        for k, blocks in enumerate(ranges):
            sealed = list(ahead)
            if k + 1 < len(ranges):
                ahead = self.making(ranges[k + 1])
            yield blocks, sealed

    def rejected(self) -> dict[str, int]:
        """Blocks whose check failed, by reason."""
        out = dict.fromkeys(REASONS, 0)
        for reason in self.failed:
            if reason is not None:
                out[reason] += 1
        return out

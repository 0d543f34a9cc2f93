"""Mooncake Store as the second tier (``mooncake-transfer-engine-non-cuda``, tools/install-tier.sh).

Zero-copy: ``attach`` registers the region's data area with the store client
(``register_buffer``), and a small buffer of its own for the seals (``seal.SEAL_BYTES`` per
block of a batch). A value is the block's bytes then its seal: blocks move with
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``, one pointer and size per
extent and one for the seal, so a block whose pages are not contiguous is gathered and
scattered by the transfer engine itself, and the seal travels in the same value. No block passes through
the client's local staging buffer (``local_buffer_bytes`` only has to exist) or through Python
bytes. What remains is the transport's: over TCP the kernel's socket copies on both ends, and
the storing segment's own memory is the copy the tier keeps (over RDMA the NIC reads and writes
the registered pages).

Observed behaviour this module relies on (docs/tier.md; ../shared/recipes/mooncake-store-on-cpu.md):
- ``setup`` blocks ~4.4 s per retry when the master is not there: the master's port is probed
  first (``timeout``) and retries are capped (``MC_STORE_CLIENT_SETUP_RETRIES``).
- ``MC_TCP_BIND_ADDRESS`` decides which address the data plane advertises; it is set to
  ``local_hostname`` so a loopback deployment stays on loopback.
- A put of an existing key returns 0 and keeps the first value: blocks are immutable, so that
  is the write-once the tier wants.
- With the master gone, ``batch_is_exist`` fails in milliseconds (-900) but a put takes ~4.3 s
  to: the guard's deadline, not this module, bounds that wait.
- A batch of 4096 keys failed whole with TRANSFER_FAIL over TCP (2048 passed): ``MAX_BATCH``.
- A get into extents of another length than the stored value answers INVALID_PARAMS: a miss.
- Every object is leased for the master's ``--default_kv_lease_ttl`` after a put or get;
  removal uses ``force`` (a namespace clear must not wait for leases).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import socket
from typing import Sequence

from .backend import Backend, Block, Owner, TierFailed, TierRejected, TierUnavailable
from .seal import SEAL_BYTES, Seals, pipeline

# Mooncake's ErrorCode values (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200       # no segment has room
INVALID_PARAMS = -600            # e.g. a zero-length value
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707             # a get's lease ran out before its transfer ended: ask again
TRANSFER_FAIL = -800             # the segment holding the object did not answer (its owner died)
RPC_FAIL = -900                  # the master did not answer
UNAVAILABLE = frozenset({RPC_FAIL, -1010, -1011})   # + not serving in its current status/mode
# Keys per transfer call: 0.3.13.post1 over TCP failed every key of a 4096-key batch with
# TRANSFER_FAIL (2048 passed), so bigger batches go as several calls.
MAX_BATCH = 1024


def _probe(address: str, timeout: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise TierUnavailable(f"mooncake master {address} does not accept connections ({exc}); start it "
                              "(mooncake_master --rpc_address=... --rpc_port=...) or fix the tier address") from None


class MooncakeBackend(Backend):
    name = "mooncake"
    concurrent = True        # one store client serves several threads (the C++ client locks)

    def __init__(self, address: str, local_hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", device: str = "", segment_bytes: int = 0, local_buffer_bytes: int = 16 << 20,
                 replicas: int = 1, timeout: float = 2.0, setup_retries: int = 2):
        """``address``: the master's ``HOST:PORT``."""
        master = address
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise TierUnavailable(f"the Mooncake store client is not installed ({exc}); run "
                                  "tools/install-tier.sh VENV (make tier-install)") from None
        # Read by the client at setup: the data plane's advertised address, and how long a setup
        # against an absent master retries (~4.4 s each).
        os.environ["MC_TCP_BIND_ADDRESS"] = local_hostname
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(setup_retries))
        _probe(master, timeout)
        self.master = master
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_hostname, metadata_server, segment_bytes, local_buffer_bytes, protocol, device,
                              master)
        if rc != 0:
            raise TierUnavailable(f"mooncake setup against master {master} failed ({rc})")
        self.config = ReplicateConfig()
        self.config.replica_num = replicas
        self.segment_bytes = segment_bytes
        self._memory: memoryview | None = None   # registered memory: valid while this mapping lives
        self.base = 0               # its address
        self.size = 0
        self._closed = False

    # ------------------------------------------------------------------ memory
    def attach(self, memory: memoryview, owner: Owner) -> None:
        if memory.readonly or not memory.contiguous:
            raise ValueError("the tier's memory must be writable and contiguous")
        base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        rc = self.store.register_buffer(base, memory.nbytes)
        if rc != 0:
            raise TierRejected(f"mooncake register_buffer of {memory.nbytes} bytes failed ({rc})")
        self._memory = memory
        self.base, self.size = base, memory.nbytes
        # The seals of one call (at most MAX_BATCH blocks) travel from and into registered memory too.
        self._seals = mmap.mmap(-1, MAX_BATCH * SEAL_BYTES)
        self.seals_base = ctypes.addressof(ctypes.c_char.from_buffer(self._seals))
        rc = self.store.register_buffer(self.seals_base, len(self._seals))
        if rc != 0:
            raise TierRejected(f"mooncake register_buffer of the seals' {len(self._seals)} bytes failed ({rc})")

    def _buffers(self, blocks: Sequence[Block]) -> tuple[list[list[int]], list[list[int]]]:
        """Pointers and sizes of each block's extents, then of its seal's place (block ``i`` of
        the call: seal slot ``i % MAX_BATCH``, so each sub-batch of MAX_BATCH has its own)."""
        if not self.size:
            raise TierRejected("mooncake: attach() the region before moving blocks")
        base, size, seals = self.base, self.size, self.seals_base
        ptrs, sizes = [], []
        for i, block in enumerate(blocks):
            if any(off < 0 or n <= 0 or off + n > size for off, n in block):
                raise TierRejected(f"an extent of {block} lies outside the attached {size} bytes")
            ptrs.append([base + off for off, _ in block] + [seals + (i % MAX_BATCH) * SEAL_BYTES])
            sizes.append([n for _, n in block] + [SEAL_BYTES])
        return ptrs, sizes

    def _seal_view(self, i: int) -> memoryview:
        j = (i % MAX_BATCH) * SEAL_BYTES
        return memoryview(self._seals)[j:j + SEAL_BYTES]

    # ------------------------------------------------------------------ calls
    @staticmethod
    def _check(codes: list[int], what: str) -> None:
        """Raise when the engine as a whole failed the call (every key failed the same way)."""
        if codes and all(c in UNAVAILABLE for c in codes):
            raise TierUnavailable(f"mooncake {what}: the master does not answer ({codes[0]})")
        if codes and all(c == INVALID_PARAMS for c in codes):
            raise TierRejected(f"mooncake {what}: invalid parameters ({INVALID_PARAMS})")

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        codes = self.store.batch_is_exist(keys)
        if any(c < 0 for c in codes):
            raise TierUnavailable(f"mooncake batch_is_exist failed ({min(codes)})")
        return [c == 1 for c in codes]

    def put(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        if not keys:
            return []
        ptrs, sizes = self._buffers(blocks)
        codes = []
        for part, sealed in seals.parts(pipeline(blocks, MAX_BATCH)):    # the next part hashed meanwhile
            for b, seal in zip(part, sealed):
                self._seal_view(b)[:] = seal
            i, j = part.start, part.stop
            codes += self.store.batch_put_from_multi_buffers(keys[i:j], ptrs[i:j], sizes[i:j], self.config)
        self._check(codes, "put")
        return [c == 0 or c == OBJECT_ALREADY_EXISTS for c in codes]

    def get(self, keys: list[str], blocks: Sequence[Block], seals: Seals) -> list[bool]:
        if not keys:
            return []
        ptrs, sizes = self._buffers(blocks)
        want = list(map(sum, sizes))
        checks = []
        for part in pipeline(blocks, MAX_BATCH):
            i, j = part.start, part.stop
            got = self.store.batch_get_into_multi_buffers(keys[i:j], ptrs[i:j], sizes[i:j])
            again = [b for b, n in enumerate(got) if n == LEASE_EXPIRED]
            if again:    # the bytes landed but the lease check after them failed: ask once more
                more = self.store.batch_get_into_multi_buffers(
                    [keys[i + b] for b in again], [ptrs[i + b] for b in again], [sizes[i + b] for b in again])
                for b, n in zip(again, more):
                    got[b] = n
            # INVALID_PARAMS here is a stored value whose length is not the extents' (another
            # geometry): a miss for that key, not a refused call.
            if got and all(n in UNAVAILABLE for n in got):
                raise TierUnavailable(f"mooncake get: the master does not answer ({got[0]})")
            whole = [i + b for b, n in enumerate(got) if n == want[i + b]]
            # Checked while the next part transfers (the seal copied out of its slot first).
            checks.append((whole, seals.checking([(b, bytes(self._seal_view(b))) for b in whole])))
        landed = [False] * len(keys)
        for whole, held in checks:
            for b, ok in zip(whole, held):
                landed[b] = ok
        return landed

    def remove(self, keys: list[str]) -> int:
        if not keys:
            return 0
        codes = self.store.batch_remove(keys, True)
        self._check(codes, "remove")
        return sum(c == 0 for c in codes)

    def clear(self, prefix: str) -> int:
        n = self.store.remove_by_regex("^" + re.escape(prefix), True)
        if n < 0:
            if n in UNAVAILABLE:
                raise TierUnavailable(f"mooncake remove_by_regex: the master does not answer ({n})")
            raise TierFailed(f"mooncake remove_by_regex failed ({n})")
        return n

    def health(self) -> None:
        rc = self.store.health_check()
        if rc != 0:
            raise TierUnavailable(f"mooncake health_check: {'master unreachable' if rc == 2 else rc}")

    def info(self) -> dict:
        try:
            from importlib.metadata import version
            v = version("mooncake-transfer-engine-non-cuda")
        except Exception:
            v = "unknown"
        return {"engine": "mooncake", "version": v, "master": self.master, "zero_copy": True,
                "segment": self.store.get_hostname(), "segment_bytes": self.segment_bytes}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.size:
            self.store.unregister_buffer(self.base)
            self.store.unregister_buffer(self.seals_base)
        self._memory, self.size = None, 0
        self.store.close()

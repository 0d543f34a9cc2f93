"""``KvtierStorage``: SGLang's ``HiCacheStorage`` (its L3 tier) backed by kvtierd.

SGLang builds the backend through its ``dynamic`` storage backend (module
``kvtier.integrations.sglang``, class ``KvtierStorage``), registers its host KV pool, then calls
the methods below from its storage threads. Contract per method (SGLang 0.5.23):

- ``batch_exists(keys)`` (prefetch thread): how many leading keys kvtierd holds ready, in one
  ``lookup`` request (more only past kvtierd's 8192 keys per request), on a coordinator session
  of its own so that it never waits behind a copy. The lookup leases the hits
  (``kvtier_lease_ttl_s``) for the ``batch_get`` of the same pages that follows (see Leases).
  Keys kvtierd is promoting from its second tier (the lookup's ``pending``) are misses for now:
  SGLang's prefetch has no "ask again", and the next request with that prefix finds them ready.
- ``batch_set_v1(keys, host_indices)`` / ``batch_get_v1(keys, host_indices)`` (backup / io-aux
  thread, with ``interface_v1``): zero copy. The pages are copied between SGLang's host pool and
  the region by the kvtier client's CPU copier, with descriptors built from the host pool's
  layout (pages.py). A store returns once this rank's copy completed and its vote was accepted;
  per key True for written or already present, False for no space or any failure. A load
  returns True for the pages that arrived (a ready prefix), False from the first missing one.
- ``batch_set(keys, values)`` / ``batch_get(keys, target_locations)`` (without ``interface_v1``):
  the generic path, through a staging buffer registered with the client in place of the host
  pool (one more memcpy per page); ``set``/``get`` are its one-key forms; ``exists(key)`` is a
  one-key lookup. In v1 mode the generic methods raise NotImplementedError, and vice versa: the
  client has one registered memory, the host pool or the staging buffer.
- ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` (sidecar pools of hybrid models)
  raise NotImplementedError; hybrid models are refused when their pools are registered.
- ``clear()`` leaves kvtierd's cache alone (it is shared with other engines; ``kvtierctl clear``
  clears it); ``get_stats()`` is None (kvtierd exports its own metrics); ``close()`` detaches.

Job ids: each SGLang TP rank calls the backend on its own, with the same keys in the same order
(SGLang's schedulers run in lockstep and reduce hit counts across ranks). A kvtier job must be
named alike on every rank of a sharded engine, so its id is derived from what the ranks share:
a hash of (store|load, the keys, how many times this backend opened a job for these very keys).

Leases: SGLang asks ``batch_exists`` on its prefetch thread, batch by batch (``STORAGE_BATCH_SIZE``
pages), and once its scheduler decided to fetch (host memory allocated, the hit count reduced
across TP ranks), its io-aux thread reads the hit prefix in the same batches with ``batch_get``.
In between another engine may fill the region; so ``batch_exists`` leases its hits, and the read
of exactly those pages names the lease, which its load job consumes: it loads them all. The
lease id is derived from the keys (every TP rank of an engine leases and loads under the same
id: the first load consumes it), and the read finds it by the hash of its keys (``_leased``: a
bounded map). A read of other pages than were leased (ranks that disagreed on the hit count) is
a plain load; a prefetch SGLang drops (below its threshold, out of host memory) leaves its lease
to expire.

Failure: kvtierd unreachable, stopping or restarting never raises into SGLang's threads. A request
waits at most ``kvtier_timeout_s`` for its reply and the client re-attaches for at most as long
again (at once when a restarted daemon binds its socket); then the backend serves misses (0 hits,
False) at once and asks kvtierd nothing until a daemon serves its socket anew (a restart: the next
call after it attaches) or ``kvtier_retry_s`` passed (``kvtier.reach.Away``), so a storage thread
is held for a few ``kvtier_timeout_s`` once per outage, never more. Blocks stored before a daemon
restart stay (kvtierd recovers its ready entries); a load in flight at the restart is redone by
the client once it re-attached.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtierd.contract import protocol as P
from kvtierd.contract.codes import StoreOutcome
from kvtierd.contract.errors import KvtierError

from ...reach import AWAY_ERRORS, Away
from ...session import Client
from ..common import PART_KEYS
from .identity import Identity, identify, server_args
from .pages import HostPages
from .settings import KvtierSettings

logger = logging.getLogger("sglang.kvtier")

STAGING_BYTES = 64 << 20               # the generic path's staging buffer: at most this ...
STAGING_PAGES = 128                    # ... and at most SGLang's STORAGE_BATCH_SIZE pages
JOB_MEMORY = 65536                     # key lists whose job occurrences are remembered
LEASE_MEMORY = 4096                    # leased batches awaiting their read (older ones are forgotten)


def kvtier_key(key: str) -> bytes:
    """The kvtier key of an SGLang page key: its 32 bytes when it is SGLang's 64-digit hex
    SHA-256, else sha256(key) plus a marker byte (33 bytes, so the two forms never collide)."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest() + b"~"


def _distinct_prefix(keys: List[bytes]) -> int:
    """Length of the leading run of distinct keys (kvtierd refuses a request with duplicates; a
    page chain never repeats a key, so only a malformed batch is shortened)."""
    if len(set(keys)) == len(keys):
        return len(keys)
    seen: set = set()
    for i, key in enumerate(keys):
        if key in seen:
            return i
        seen.add(key)
    return len(keys)


class KvtierStorage(HiCacheStorage):
    """SGLang HiCache L3 storage in kvtierd (docs/sglang.md)."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None):
        self.config = storage_config
        self.settings = KvtierSettings.from_extra_config(storage_config.extra_config)
        self.pages: HostPages | None = None
        self.identity: Identity | None = None
        self._rank: Client | None = None            # rank session: copies and votes
        self._lookup: Client | None = None          # coordinator session: batch_exists
        self._state = threading.Lock()              # connecting, the away state
        self._rank_lock = threading.Lock()          # the rank session (backup and io-aux threads)
        self._lookup_lock = threading.Lock()
        self._away = Away(self.settings.socket, self.settings.retry_s, "SGLang HiCache storage",
                          "it serves misses (0 hits, nothing stored)", logger)
        self._closed = False
        self._staging: torch.Tensor | None = None
        self._occurrences: OrderedDict = OrderedDict()
        self._leased: OrderedDict = OrderedDict()   # _lease_id(leased keys) -> lease id, until read
        self._leased_lock = threading.Lock()        # batch_exists and batch_get run on two threads

    # ------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pages = HostPages.of(mem_pool_host)
        self.identity = identify(self.config, self.pages, self.settings, server_args())

    def on_host_pools_registered(self) -> None:
        others = sorted(str(name) for name in getattr(self, "registered_pools", {}) if str(name) != "kv")
        if others:
            raise ValueError(f"kvtier stores SGLang's KV pool only; this model also has host pools {others} "
                             "(hybrid SWA/Mamba/DSA/draft models): use another storage backend for it")
        if self.pages is None:
            raise ValueError("SGLang registered no host KV pool with the kvtier backend")
        ident = self.identity
        logger.info("kvtier: %s engine %s rank %d of %d, namespace %s (%s path, %d bytes per page)",
                    self.settings.socket, ident.engine_id, ident.rank, ident.world_size, ident.namespace.model,
                    "zero-copy v1" if self.settings.interface_v1 else "generic", self.pages.page_bytes)
        self._clients()

    def _kv_tensors(self) -> list:
        if self.settings.interface_v1:
            return self.pages.rows
        if self._staging is None:
            pages = max(1, min(STAGING_PAGES, STAGING_BYTES // self.pages.page_bytes))
            self._staging = torch.empty((pages, self.pages.page_bytes), dtype=torch.uint8)
        return [self._staging]

    def _clients(self) -> tuple[Client, Client] | None:
        """Both sessions, attaching first if needed; None while kvtierd is away (``Away``)."""
        with self._state:
            if self._closed or self.identity is None or not self._away.due():
                return None
            if self._rank is not None and self._lookup is not None:
                return self._rank, self._lookup
            ident, s = self.identity, self.settings
            tried = self._away.look()
            try:
                if self._rank is None:
                    rank = Client(s.socket, engine_id=ident.engine_id, rank=ident.rank, world_size=ident.world_size,
                                  namespace=ident.namespace, copier="cpu", timeout=s.timeout_s,
                                  reconnect_timeout=s.timeout_s)
                    try:
                        rank.register_kv_caches(self._kv_tensors())
                    except BaseException:
                        rank.close()
                        raise
                    self._rank = rank
                if self._lookup is None:
                    self._lookup = Client(s.socket, engine_id=ident.engine_id, rank=None,
                                          world_size=ident.world_size, namespace=ident.namespace, timeout=s.timeout_s,
                                          reconnect_timeout=s.timeout_s)
            except KvtierError as exc:
                self._away.lost(exc, tried)
                return None
            self._away.back()
            logger.info("kvtier: attached to kvtierd (%s, SGLang storage writer=%s)", self._rank.info.namespace,
                        self.config.is_storage_writer)
            return self._rank, self._lookup

    def _reached(self, failure: KvtierError | None, what: str) -> None:
        """After a request: kvtierd away (serve misses until it serves again), a refusal of this
        one request, or served (back, if it was away)."""
        with self._state:
            if isinstance(failure, AWAY_ERRORS):
                self._away.lost(failure)
            elif failure is not None:
                logger.warning("kvtier: %s: %s", what, failure)
            elif self._away.down:
                self._away.back()

    def _job_id(self, kind: str, keys: List[bytes]) -> int:
        """Same kind and keys, same occurrence: the same id on every rank (module docstring)."""
        h = hashlib.blake2b(kind.encode() + b"".join(len(k).to_bytes(1, "little") + k for k in keys),
                            digest_size=16).digest()
        n = self._occurrences.pop(h, 0)
        self._occurrences[h] = n + 1
        if len(self._occurrences) > JOB_MEMORY:
            self._occurrences.popitem(last=False)
        digest = hashlib.blake2b(h + n.to_bytes(8, "little"), digest_size=8).digest()
        return int.from_bytes(digest, "little") & P.MAX_JOB_ID

    # ------------------------------------------------------------------ the copies (rank lock held)
    def _store_locked(self, client: Client, keys: List[bytes], block_ids: np.ndarray) -> List[bool]:
        results = [False] * len(keys)
        for start in range(0, len(keys), PART_KEYS):
            chunk = keys[start:start + PART_KEYS]
            job = self._job_id("store", chunk)
            decision = client.store(job, chunk, block_ids[start:start + len(chunk)])
            (done,) = client.wait([job])
            if not done.ok:
                logger.warning("kvtier: store job %d not cached: %s", job, done.error)
            for i, outcome in enumerate(decision.outcomes):
                results[start + i] = outcome is StoreOutcome.PRESENT or (outcome is StoreOutcome.WRITE and done.ok)
            if not all(results[start:start + len(chunk)]):
                break                  # SGLang stops a backup at its first failed batch anyway
        return results

    def _load_locked(self, client: Client, keys: List[bytes], block_ids: np.ndarray) -> int:
        """Loads the ready prefix of ``keys`` (consuming the lease of exactly these keys, if
        batch_exists took one); returns how many arrived."""
        lease = self._lease_of(keys)
        loaded = 0
        for start in range(0, len(keys), PART_KEYS):
            chunk = keys[start:start + PART_KEYS]
            job = self._job_id("load", chunk)
            hits = client.load(job, chunk, block_ids[start:start + len(chunk)], lease=lease if start == 0 else None)
            (done,) = client.wait([job])
            if not done.ok:
                logger.warning("kvtier: load job %d failed: %s", job, done.error)
                break
            loaded += hits
            if hits < len(chunk):
                break
        return loaded

    def _with_rank(self, what: str, fn, failed):
        """Run ``fn(client)`` holding the rank session; ``failed`` when kvtierd is away or it fails."""
        clients = self._clients()
        if clients is None:
            return failed
        if not self._rank_lock.acquire(timeout=self.settings.timeout_s):
            logger.warning("kvtier: %s skipped: the kvtier session stayed busy for %gs", what, self.settings.timeout_s)
            return failed
        try:
            done = fn(clients[0])
        except KvtierError as exc:
            self._reached(exc, what)
            return failed
        finally:
            self._rank_lock.release()
        self._reached(None, what)
        return done

    def _need(self, v1: bool, method: str) -> None:
        if self.settings.interface_v1 != v1:
            raise NotImplementedError(
                f"kvtier: SGLang called {method} on a backend attached "
                f"{'with' if self.settings.interface_v1 else 'without'} interface_v1; the zero-copy and the generic "
                "path each need their own registration (set interface_v1 in the extra config to pick one)")

    # ------------------------------------------------------------------ HiCacheStorage: queries
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        tkeys = [kvtier_key(k) for k in keys]
        tkeys = tkeys[:_distinct_prefix(tkeys)]
        clients = self._clients()
        if clients is None or not tkeys:
            return 0
        if not self._lookup_lock.acquire(timeout=self.settings.timeout_s):
            return 0
        hits = 0
        lease = self._lease_id(tkeys) if self.settings.lease_ttl_s and len(tkeys) <= PART_KEYS else None
        try:
            for start in range(0, len(tkeys), P.MAX_KEYS_PER_REQUEST):
                chunk = tkeys[start:start + P.MAX_KEYS_PER_REQUEST]
                # pending (being promoted) keys: misses for now
                found = clients[1].lookup(chunk, lease=lease, ttl=self.settings.lease_ttl_s)
                hits += found
                if found < len(chunk):
                    break
            held = clients[1].lease_held(lease) if lease is not None else None
            if held is not None:
                self._remember_lease(self._lease_id(tkeys[:held.leased]), lease)
            failure = None
        except KvtierError as exc:
            failure = exc
        finally:
            self._lookup_lock.release()
        self._reached(failure, "lookup failed")
        return hits

    @staticmethod
    def _lease_id(keys: List[bytes]) -> int:
        """The lease of a batch: the same on every TP rank of the engine (they ask the same keys)."""
        digest = hashlib.blake2b(b"lease" + b"".join(len(k).to_bytes(1, "little") + k for k in keys),
                                 digest_size=8).digest()
        return int.from_bytes(digest, "little") & P.MAX_LEASE_ID

    def _remember_lease(self, leased: int, lease: int) -> None:
        """``lease`` holds the keys whose ``_lease_id`` is ``leased`` (all of its batch's, or a prefix)."""
        with self._leased_lock:
            self._leased.pop(leased, None)
            self._leased[leased] = lease
            if len(self._leased) > LEASE_MEMORY:
                self._leased.popitem(last=False)

    def _lease_of(self, keys: List[bytes]) -> int | None:
        """The lease batch_exists took on exactly these keys (forgotten once asked)."""
        leased = self._lease_id(keys)
        with self._leased_lock:
            return self._leased.pop(leased, None)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ zero-copy path
    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        self._need(True, "batch_set_v1")
        try:
            block_ids = self.pages.page_ids(host_indices, len(keys))
        except ValueError as exc:
            logger.error("kvtier: batch_set_v1: %s", exc)
            return [False] * len(keys)
        tkeys = [kvtier_key(k) for k in keys]
        unique = list(dict.fromkeys(tkeys))           # a repeated key has the same bytes: store it once
        first = {k: i for i, k in reversed(list(enumerate(tkeys)))}
        stored = self._with_rank("store failed", lambda c: self._store_locked(
            c, unique, block_ids[[first[k] for k in unique]]), [False] * len(unique))
        by_key = dict(zip(unique, stored))
        return [by_key[k] for k in tkeys]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        self._need(True, "batch_get_v1")
        try:
            block_ids = self.pages.page_ids(host_indices, len(keys))
        except ValueError as exc:
            logger.error("kvtier: batch_get_v1: %s", exc)
            return [False] * len(keys)
        tkeys = [kvtier_key(k) for k in keys]
        tkeys = tkeys[:_distinct_prefix(tkeys)]
        loaded = self._with_rank("load failed", lambda c: self._load_locked(c, tkeys, block_ids), 0)
        return [i < loaded for i in range(len(keys))]

    # ------------------------------------------------------------------ generic path (staging buffer)
    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        self._need(False, "batch_set")
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set needs one value per key ({len(keys)} keys)")
        tkeys = [kvtier_key(k) for k in keys]
        if _distinct_prefix(tkeys) < len(tkeys):
            keep = {k: i for i, k in reversed(list(enumerate(tkeys)))}
            order = sorted(keep.values())
            tkeys, values = [tkeys[i] for i in order], [values[i] for i in order]

        def store(client: Client) -> bool:
            staging = self._staging
            for start in range(0, len(tkeys), len(staging)):
                part = values[start:start + len(staging)]
                for row, value in zip(staging, part):
                    row.copy_(self._page_bytes(value))
                if not all(self._store_locked(client, tkeys[start:start + len(part)], np.arange(len(part)))):
                    return False
            return True

        return self._with_rank("store failed", store, False)

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        self._need(False, "batch_get")
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError(f"batch_get needs one target tensor per key ({len(keys)} keys)")
        tkeys = [kvtier_key(k) for k in keys]
        tkeys = tkeys[:_distinct_prefix(tkeys)]
        out: List[Optional[torch.Tensor]] = [None] * len(keys)

        def load(client: Client) -> None:
            staging = self._staging
            for start in range(0, len(tkeys), len(staging)):
                part = tkeys[start:start + len(staging)]
                loaded = self._load_locked(client, part, np.arange(len(part)))
                for i in range(loaded):
                    target = target_locations[start + i]
                    self._page_bytes(target).copy_(staging[i])
                    out[start + i] = target
                if loaded < len(part):
                    return

        self._with_rank("load failed", load, None)
        return out

    def _page_bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        """A flat page tensor as its bytes (a view: writing it writes the tensor)."""
        flat = tensor.reshape(-1).view(torch.uint8)
        if flat.numel() != self.pages.page_bytes:
            raise ValueError(f"a page of this host pool is {self.pages.page_bytes} bytes; got {flat.numel()}")
        return flat

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ------------------------------------------------------------------ hybrid models: not supported
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError("kvtier does not store SGLang sidecar pools (hybrid SWA/Mamba/DSA models)")

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError("kvtier does not store SGLang sidecar pools (hybrid SWA/Mamba/DSA models)")

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError("kvtier does not store SGLang sidecar pools (hybrid SWA/Mamba/DSA models)")

    # ------------------------------------------------------------------ operator calls
    def clear(self) -> bool:
        logger.info("kvtier: SGLang asked to clear its storage; kvtierd's cache is shared with other engines and "
                    "stays (kvtierctl clear empties it)")
        return False

    def get_stats(self):
        return None

    def close(self) -> None:
        with self._state:
            clients = [c for c in (self._rank, self._lookup) if c is not None]
            self._rank = self._lookup = None
            self._closed = True                     # no re-attach after close
        for client in clients:
            client.close()

"""Drive SGLang 0.5.23's own HiCache code on the CPU against a real kvtierd.

What is real: SGLang's device pools (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on device
"cpu"), its ``PagedTokenToKVPoolAllocator`` and ``ReqToTokenPool``, ``create_tree_cache`` →
``UnifiedRadixCache.init_hicache`` → the hybrid pool assembler → ``HybridCacheController`` with
its host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) and its four storage threads
→ ``StorageBackendFactory`` (``dynamic``) → ``kvtier.integrations.sglang.KvtierStorage`` → kvtierd.
Pages travel L1 (device pool) → L2 (host pool, write-through) → L3 (kvtierd, the backup thread)
and back: L3 → L2 (the prefetch and io-aux threads) → L1 (``load_back``).

The seams (what a GPU server has that this harness replaces, and why each is the narrowest):

- ``tests/sglang/cpu_stubs.py``: stand-ins for triton, torchvision and tvm_ffi, which SGLang
  imports at start but the storage path never calls.
- L1↔L2 copies: on CUDA SGLang moves device↔host with ``sgl_kernel`` ops. The CPU has none, so
  ``transfer_kv_direct`` (the op of ``layer_first`` + io backend ``direct``) is replaced by the
  same index copy in torch. Only that layout runs L1↔L2 here; the other host layouts are driven
  from L2 down (``Rank.store_pages`` / ``fetch_pages``) through the same controller threads.
  **Needs CUDA** for the real op: the GPU tests (tests/gpu/test_sglang_hicache.py).
- ``cudaHostRegister`` of the host pool is a no-op and the pools are unpinned (CPU torch cannot pin).
- The server's parallel state and arguments are published with SGLang's own test hooks
  (``get_parallel().override_permanently``, ``get_context().override_server_args``); no
  torch.distributed group is built (``tp_group=None``), so the TP ranks' hit counts are not
  MIN-reduced by SGLang: each rank process checks its own.
- "The model": device KV bytes are a function of the tokens up to the slot, the layer, K/V and a
  rank ``variant`` (MHA ranks hold different heads; an MLA rank given another variant proves it
  loaded rank 0's bytes, not its own).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from array import array
from dataclasses import dataclass, field

from tests.procs import ChildProcess, error_info, serve

from . import cpu_stubs

cpu_stubs.install()

LAYERS = 3


@dataclass
class RankSpec:
    """Everything that decides one SGLang scheduler process's cache (built alike in any process)."""

    kind: str                      # "mha" | "mla"
    socket: str
    engine_id: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    nnodes: int = 1                # --nnodes: the TP ranks are spread over this many nodes (node n: a block)
    interface_v1: bool = True
    layout: str = "layer_first"
    page_size: int = 4
    device_tokens: int = 256
    variant: int = 0               # which bytes this rank's "model" writes
    device: str = "cpu"            # "cuda": SGLang's own CUDA L1<->L2 ops, pinned host pool (GPU tests)
    extra: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)   # more server arguments (model_path, ...)

    def extra_config(self) -> dict:
        config = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                  "class_name": "KvtierStorage", "interface_v1": int(self.interface_v1),
                  "prefetch_threshold": self.page_size, "kvtier_socket": self.socket,
                  "kvtier_timeout_s": 5, "kvtier_retry_s": 0.5, **self.extra}
        if self.engine_id is not None:
            config["kvtier_engine_id"] = self.engine_id
        return config


def token_bytes(tokens: tuple, layer: int, part: int, variant: int, nbytes: int) -> bytes:
    """What the fake model writes for the last token of ``tokens`` (its prefix included)."""
    seed = hashlib.sha256(repr((tokens, layer, part, variant)).encode()).digest()
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.sha256(seed + counter.to_bytes(4, "little")).digest()
        counter += 1
    return bytes(out[:nbytes])


def _shim_cpu() -> None:
    """The CPU seams (module docstring)."""
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla
    from sglang.srt.mem_cache.pool_host import common

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers):
            dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)]

    common._cuda_host_register = lambda *a, **k: None
    common._cuda_host_unregister = lambda *a, **k: None
    mha.transfer_kv_direct = transfer_kv_direct
    mla.transfer_kv_direct = transfer_kv_direct


class Rank:
    """One SGLang scheduler process's radix tree with HiCache and the kvtier backend."""

    def __init__(self, spec: RankSpec):
        import torch
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
        from sglang.srt.runtime_context import get_context, get_parallel

        if spec.device == "cpu":
            _shim_cpu()
        self.spec = spec
        ps = spec.page_size
        r, n = spec.tp_rank, spec.tp_size
        get_parallel().override_permanently(tp_size=n, tp_rank=r, attn_tp_size=n, attn_tp_rank=r, pp_size=1,
                                            pp_rank=0, attn_dcp_size=1, attn_dcp_rank=0, attn_cp_size=1,
                                            attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, moe_tp_size=n,
                                            moe_ep_size=1, moe_dp_size=1, nnodes=spec.nnodes,
                                            node_rank=r // (n // spec.nnodes))
        server = dict(device=spec.device, page_size=ps, enable_hierarchical_cache=True, hicache_mem_layout=spec.layout,
                      hicache_io_backend="direct", hicache_write_policy="write_through", hicache_ratio=2.0,
                      hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=json.dumps(spec.extra_config()))
        self.server_args = get_context().override_server_args(**{**server, **spec.server}).install()
        if spec.kind == "mha":
            self.kv = MHATokenToKVPool(size=spec.device_tokens, page_size=ps, dtype=torch.bfloat16, head_num=2,
                                       head_dim=8, layer_num=LAYERS, device=spec.device, enable_memory_saver=False)
            self.buffers = list(self.kv.k_buffer) + list(self.kv.v_buffer)
        else:
            self.kv = MLATokenToKVPool(size=spec.device_tokens, page_size=ps, dtype=torch.bfloat16, kv_lora_rank=16,
                                       qk_rope_head_dim=8, layer_num=LAYERS, device=spec.device, enable_memory_saver=False)
            self.buffers = list(self.kv.kv_buffer)
        self.alloc = PagedTokenToKVPoolAllocator(size=spec.device_tokens, page_size=ps, dtype=torch.bfloat16,
                                                 device=spec.device, kvcache=self.kv, need_sort=False)
        requests = ReqToTokenPool(size=4, max_context_len=1024, device=spec.device, enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=requests, token_to_kv_pool_allocator=self.alloc,
                                 page_size=ps)

        class Worker:                   # the model runner's hook: nothing to register on the CPU
            def register_hicache_layer_transfer_counter(self, counter):
                pass

        self.cache = create_tree_cache(TreeCacheBuildContext(
            server_args=self.server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=Worker(), model_config=None,
            tp_size=n, tp_rank=r, tp_group=None))
        self.controller = self.cache.cache_controller
        self.host = self.controller.storage_host_pool
        if spec.device == "cpu":
            self.host.pin_memory = False     # CPU torch cannot allocate pinned pages
        self.backend = self.controller.storage_backend
        self._requests = 0
        self._held = None                    # prefetch_query's operation, until prefetch_read

    # --- the fake model
    def _fill(self, tokens: list[int], slots) -> None:
        import torch
        for i, slot in enumerate(slots.tolist()):
            prefix = tuple(tokens[: i + 1])
            for part, buffer in enumerate(self.buffers):
                row = buffer[slot].view(torch.uint8).reshape(-1)
                row.copy_(torch.frombuffer(bytearray(token_bytes(prefix, part, 0, self.spec.variant, row.numel())),
                                           dtype=torch.uint8).to(row.device))

    def _check(self, tokens: list[int], slots, variant: int) -> int:
        """How many leading tokens' device KV holds what the model wrote for them (``variant``)."""
        import torch
        for i, slot in enumerate(slots.tolist()):
            prefix = tuple(tokens[: i + 1])
            for part, buffer in enumerate(self.buffers):
                row = buffer[slot].view(torch.uint8).reshape(-1)
                if bytes(row.cpu().numpy()) != token_bytes(prefix, part, 0, variant, row.numel()):
                    return i
        return len(slots)

    # --- L1 -> L2 -> L3
    def write(self, tokens: list[int], timeout: float = 60.0) -> dict:
        """A request's prefill: KV into the device pool, inserted into the tree; then SGLang's
        write-through to the host pool and its backup to storage, until both are acknowledged."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.alloc.alloc(len(tokens))
        self._fill(tokens, slots)
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
        self.cache.flush_pending_backups()
        deadline = time.monotonic() + timeout
        backups = []
        while True:
            self.cache.writing_check()
            queued = self.controller.ack_backup_queue.qsize()
            self.cache.drain_storage_control_queues()
            backups.extend([queued] if queued else [])
            if not self.cache.ongoing_write_through and not self.cache.ongoing_backup:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("SGLang's write-through/backup did not finish")
            time.sleep(0.005)
        return {"slots": len(slots)}

    def evict_all(self) -> dict:
        """Drop everything from L1 and L2 (it stays in L3): the tree's own eviction."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        device = self.cache.evict(EvictParams(num_tokens=self.spec.device_tokens))
        host = self.cache.evict_host(self.host.size)
        return {"device": device.num_tokens_evicted, "host": host}

    # --- L3 -> L2 -> L1
    def fetch(self, tokens: list[int], timeout: float = 60.0) -> dict:
        """A new request with ``tokens``: match, prefetch what L1 and L2 lack from storage (SGLang's
        prefetch and io-aux threads), load back to the device. Returns the tokens that came from
        L3 (``host_hit``), the device prefix after loading, and how many of its tokens hold the
        bytes the model wrote (``correct``: variant 0, ``correct_own``: this rank's variant)."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", tokens))
        match = self.cache.match_prefix(MatchPrefixParams(key=key))
        self._requests += 1
        handle = CacheRequestHandle(f"req-{self._requests}", 0)
        matched = match.device_prefix_len + match.host_hit_length      # as SGLang's scheduler does
        anchor = match.last_host_node
        self.cache.prefetch_from_storage(handle, anchor, array("q", tokens[matched:]),
                                         self.cache.get_last_hash_value(anchor),
                                         matched_prefix_tokens=array("q", tokens[:matched]))
        deadline = time.monotonic() + timeout
        while True:
            self.cache.drain_storage_control_queues()
            if self.cache.check_prefetch_progress(handle):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("SGLang's prefetch did not finish")
            time.sleep(0.005)
        match = self.cache.match_prefix(MatchPrefixParams(key=key))
        from_storage = match.host_hit_length
        if from_storage:
            assert self.cache.load_back(match.best_match_node)
            self.cache.ready_to_load_host_cache()
            self.cache.loading_check()
            match = self.cache.match_prefix(MatchPrefixParams(key=key))
        slots = self.cache.path_device_indices(match.last_device_node)[: match.device_prefix_len]
        return {"host_hit": from_storage, "device": int(match.device_prefix_len),
                "correct": self._check(tokens, slots, 0), "correct_own": self._check(tokens, slots, self.spec.variant)}

    # --- L2 <-> L3 only (any host layout): the controller's own storage threads
    def page_keys(self, tokens: list[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        return get_storage_hash_str(array("q", tokens), None, page_size=self.spec.page_size)

    def store_pages(self, tokens: list[int], timeout: float = 60.0) -> int:
        """Host pages hold the tokens' KV; SGLang's backup thread writes them to storage
        (``write_storage``). Returns the tokens the controller reports stored."""
        import torch
        host = self.host.alloc(len(tokens))
        ps = self.spec.page_size
        for p in range(len(tokens) // ps):
            page = torch.frombuffer(bytearray(self.expected_page(tokens, p)), dtype=torch.uint8)
            self.host.set_from_flat_data_page(int(host[p * ps]), page.view(self.host.dtype))
        op = self.controller.write_storage(host, array("q", tokens), self.page_keys(tokens))
        deadline = time.monotonic() + timeout
        while True:
            try:
                done = self.controller.ack_backup_queue.get(timeout=0.1)
            except Exception:
                done = None
            if done is not None and done.id == op:
                self.host.free(host)
                return done.completed_tokens
            if time.monotonic() > deadline:
                raise TimeoutError("no backup ack")

    def fetch_pages(self, tokens: list[int], timeout: float = 60.0) -> dict:
        """SGLang's prefetch (hit query, then the io-aux thread's reads) into fresh host pages;
        returns the tokens fetched and how many pages hold the expected bytes."""
        hit = self.prefetch_query(tokens, timeout)
        return {"hit": hit, **self.prefetch_read(timeout)}

    def prefetch_query(self, tokens: list[int], timeout: float = 60.0) -> int:
        """The first half of ``fetch_pages``: SGLang's prefetch thread asks storage (batch_exists)
        and hands the operation to the scheduler, which holds it here (what SGLang's scheduler
        decides in between: host memory, the prefetch threshold). Returns the tokens hit."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        self._requests += 1
        self.controller.prefetch(CacheRequestHandle(f"req-{self._requests}", 0), array("q", tokens))
        op = self.controller.prefetch_hit_queue.get(timeout=timeout)
        self._held = (op, tokens)
        return op.storage_hit_count

    def prefetch_read(self, timeout: float = 60.0) -> dict:
        """The second half: host pages for the held operation, the io-aux thread's reads
        (batch_get); returns the tokens fetched and how many pages hold the expected bytes."""
        from queue import Empty

        op, tokens = self._held
        host = self.host.alloc(len(tokens))
        op.host_indices = host[:op.storage_hit_count]
        self.controller.prefetch_buffer.put(op)
        deadline = time.monotonic() + timeout
        done_tokens = 0
        while time.monotonic() < deadline:
            try:
                ack = self.controller.ack_prefetch_queue.get(timeout=0.1)
            except Empty:
                continue
            if ack.completed_tokens is not None:
                done_tokens = max(done_tokens, ack.completed_tokens)
            if getattr(ack, "completed_req", False):
                break
        ps = self.spec.page_size
        correct = 0
        for p in range(done_tokens // ps):
            if bytes(self.host.get_data_page(int(host[p * ps])).view(__import__("torch").uint8).numpy()) \
                    != self.expected_page(tokens, p):
                break
            correct += 1
        self.host.free(host)
        return {"fetched": done_tokens, "correct_pages": correct}

    def expected_page(self, tokens: list[int], page: int) -> bytes:
        """The flat bytes of page ``page`` of ``tokens`` in this host layout (distinct per page and rank)."""
        n = self.host.get_data_page(0).numel() * self.host.get_data_page(0).element_size()
        return token_bytes(tuple(tokens[: (page + 1) * self.spec.page_size]), -1, 0, self.spec.variant, n)

    # --- direct backend calls (what SGLang's threads call)
    def lookup(self, tokens: list[int]) -> int:
        return self.backend.batch_exists(self.page_keys(tokens))

    def backend_info(self) -> dict:
        ident = self.backend.identity
        return {"engine": ident.engine_id, "rank": ident.rank, "world_size": ident.world_size,
                "namespace": ident.namespace.model, "sharding": ident.namespace.sharding.value,
                "block_bytes": ident.namespace.block_bytes,
                "writer": self.controller.storage_config.is_storage_writer, "pid": os.getpid()}

    def timed(self, method: str, **kwargs) -> dict:
        """Run one of this object's methods; returns its result and the seconds it took."""
        started = time.monotonic()
        result = getattr(self, method)(**kwargs)
        return {"result": result, "seconds": time.monotonic() - started}

    def close(self) -> None:
        self.controller.detach_storage_backend()
        self.cache.release_host_resources()


def _serve(conn, spec: RankSpec) -> None:     # in the child
    try:
        rank = Rank(spec)
        conn.send(("ok", None))
    except Exception as exc:
        conn.send(("error", error_info(exc)))
        return
    commands = {name: getattr(rank, name) for name in dir(rank) if not name.startswith("_")
                and callable(getattr(rank, name))}
    serve(conn, commands, close=rank.close)


class RankProcess(ChildProcess):
    """A Rank in its own spawned process: one SGLang scheduler process of one TP rank."""

    def __init__(self, spec: RankSpec, timeout: float = 120):
        super().__init__(_serve, spec, timeout=timeout)

    def ready(self, timeout: float = 180) -> "RankProcess":
        self.result(timeout)
        return self

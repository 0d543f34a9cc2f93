"""Drive vLLM's own Scheduler and worker-role OffloadingConnector against a real kvtierd, on the CPU.

What is real: vLLM 0.33's ``VllmConfig``/``ModelConfig`` (from a tiny local config.json, with or
without weight files), its KV-cache planning (``get_kv_cache_configs``), its KV-cache allocation
(``allocate_kv_cache``, with ``device="cpu"``), its ``Scheduler`` (with the scheduler-role
connector that ``kv_transfer_config`` names: ``KvtierOffloadingConnector`` from
``kvtier.integrations.vllm``, or vLLM's plain ``OffloadingConnector`` loading the spec through
``spec_module_path``), one worker-role connector per rank process (which registers the KV cache
and calls the plugin's worker), the connector outputs collected as vLLM's model runner collects
them (transfer results, load errors, worker metadata), vLLM's ``KVOutputAggregator`` merging the
ranks' outputs, and the kvtierd daemon.

The seams (what a GPU engine has that this harness replaces, and why each is the narrowest):

- **KV-cache specs** are built from the config.json the way the attention layers report them
  (``FullAttentionSpec`` for GQA, ``MLAAttentionSpec(max_tp_shards=1)`` for MLA), because
  instantiating the model would need weights and a device.
- **The KV layout** is resolved with vLLM's own ``resolve_kv_cache_layout`` from the layouts a
  worker without declared backends supports (what the executor RPC would report).
- **The "model"**: a step writes, for every block its scheduled tokens touch, bytes derived from
  the block's token ids (the same on every rank, as MLA's latent KV is), into the CPU KV cache,
  and samples token 7. ``rank_variant`` makes ranks ≥ 1 write other bytes, to prove what they
  load came from rank 0's copy.
- **Transport**: the scheduler's ``kv_connector_metadata`` reaches the ranks pickled over a pipe
  (vLLM's executor pickles it into shared memory); no torch.distributed group is needed because
  the kvtier plugin coordinates the ranks through kvtierd.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.procs import ChildProcess, all_call, error_info, serve  # noqa: F401  (all_call: re-exported)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MODELS = Path(__file__).parent / "models"
BLOCK_TOKENS = 16


@dataclass
class EngineRecipe:
    """Everything that decides one engine's configuration; every process builds it the same way."""

    model: str                    # directory name under tests/vllm/models, or an absolute path
    tp: int
    socket: str
    engine_id: str
    extra: dict = field(default_factory=dict)
    num_blocks_memory: int = 1 << 20   # KV-cache bytes per rank handed to vLLM's planner
    connector: str = "KvtierOffloadingConnector"     # or "OffloadingConnector": the plain spec path
    failure_policy: str = "recompute"                 # kv_load_failure_policy
    # Several nodes (vLLM's mp executor with --nnodes): node n's kvtierd socket; rank r runs on
    # node r // (tp / nodes), the scheduler on node 0. Empty: one node, at ``socket``.
    node_sockets: tuple = ()
    kv_events: dict | None = None                     # vLLM's --kv-events-config (KVEventsConfig's fields)

    @property
    def nnodes(self) -> int:
        return max(1, len(self.node_sockets))

    def node_of(self, rank: int) -> int:
        return rank // (self.tp // self.nnodes)

    def extra_config(self, rank: int = 0) -> dict:
        socket = self.node_sockets[self.node_of(rank)] if self.node_sockets else self.socket
        return {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                "kvtier_socket": socket, "kvtier_timeout_s": 20, **self.extra}

    def transfer_config(self, rank: int = 0) -> dict:
        module = {} if self.connector == "OffloadingConnector" else {"kv_connector_module_path": "kvtier.integrations.vllm"}
        return {"kv_connector": self.connector, **module, "kv_role": "kv_both", "engine_id": self.engine_id,
                "kv_load_failure_policy": self.failure_policy, "kv_connector_extra_config": self.extra_config(rank)}


def build(recipe: EngineRecipe, rank: int = 0):
    """(vllm_config, kv_cache_config, per-layer specs) for ``rank`` of the recipe's engine (rank 0:
    also the scheduler's), on its node."""
    import torch
    from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model_config = ModelConfig(model=str(MODELS / recipe.model), skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=1024, seed=0)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=recipe.tp, distributed_executor_backend="mp",
                                       nnodes=recipe.nnodes, node_rank=recipe.node_of(rank)),
        kv_transfer_config=KVTransferConfig(**recipe.transfer_config(rank)),
        **({"kv_events_config": KVEventsConfig(**recipe.kv_events)} if recipe.kv_events else {}),
    )
    vllm_config.scheduler_config.async_scheduling = False
    vllm_config.parallel_config.rank = rank
    hf = model_config.hf_text_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    if model_config.use_mla:
        spec = MLAAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, max_tp_shards=1,
                                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=torch.bfloat16,
                                cache_dtype_str="auto")
    else:
        spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=max(1, hf.num_key_value_heads // recipe.tp),
                                 head_size=hf.head_dim, dtype=torch.bfloat16)
    specs = {name: spec for name in layers}
    supported = [layout.name for layout in get_supported_kv_cache_layouts([])]
    resolve_kv_cache_layout(vllm_config, [supported] * recipe.tp, specs.values())
    groups = get_global_kv_cache_groups(vllm_config, [specs] * recipe.tp)
    kv_cache_config = get_kv_cache_configs(vllm_config, [specs] * recipe.tp,
                                           [recipe.num_blocks_memory] * recipe.tp, groups)[rank]
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return vllm_config, kv_cache_config


def block_content(token_ids: tuple[int, ...], layer: int, nbytes: int, variant: int = 0) -> bytes:
    """What the fake model writes into a block of one layer: a function of the block's tokens."""
    out = bytearray()
    counter = 0
    seed = repr((token_ids, layer, variant)).encode()
    while len(out) < nbytes:
        out += hashlib.sha256(seed + counter.to_bytes(4, "little")).digest()
        counter += 1
    return bytes(out[:nbytes])


# ------------------------------------------------------------------------------ one rank
class RankWorker:
    """One TP rank: vLLM's worker-role OffloadingConnector over a CPU KV cache (in any process)."""

    def __init__(self, recipe: EngineRecipe, rank: int, rank_variant: bool = False):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.worker.utils import allocate_kv_cache

        self.rank = rank
        self.variant = rank if rank_variant else 0
        self.vllm_config, self.kv_cache_config = build(recipe, rank)
        with set_current_vllm_config(self.vllm_config):
            layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
            # vLLM's own allocation, on the CPU instead of a GPU.
            self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
            connector_cls = KVConnectorFactory.get_connector_class(self.vllm_config.kv_transfer_config)
            self.connector = connector_cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.connector.register_kv_caches(self.kv)
        self.layers = list(self.kv)
        self.spec = self.connector.connector_worker.spec
        self.worker = self.connector.connector_worker.worker

    def _rows(self, block_id: int):
        import torch
        for layer, name in enumerate(self.layers):
            yield layer, self.kv[name][block_id].view(torch.uint8).reshape(-1)

    def step(self, metadata: bytes, writes: list[tuple[int, tuple[int, ...]]], finished: set[str]) -> bytes:
        """One engine step as the model runner drives the connector; returns the pickled output."""
        import torch
        from vllm.v1.outputs import KVConnectorOutput

        meta = pickle.loads(metadata)
        connector = self.connector
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        for block_id, token_ids in writes:                     # the forward pass
            for layer, row in self._rows(block_id):
                content = block_content(token_ids, layer, row.numel(), self.variant)
                row.copy_(torch.frombuffer(bytearray(content), dtype=torch.uint8))
        connector.wait_for_save()
        results = connector.get_transfer_results(finished)          # as vLLM's model runner collects them
        output = KVConnectorOutput(finished_sending=results.finished_sending,
                                   finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=connector.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=connector.build_connector_worker_meta())
        connector.clear_connector_metadata()
        return pickle.dumps(output)

    def digests(self, block_ids: list[int]) -> list[str]:
        """sha256 over every layer's bytes of each block."""
        out = []
        for block_id in block_ids:
            h = hashlib.sha256()
            for _, row in self._rows(block_id):
                h.update(row.numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def expected(self, token_ids: tuple[int, ...], variant: int = 0) -> str:
        """The digest of a block holding what the fake model writes for ``token_ids``."""
        h = hashlib.sha256()
        for layer, row in self._rows(0):
            h.update(block_content(token_ids, layer, row.numel(), variant))
        return h.hexdigest()

    def zero(self) -> None:
        for tensor in {t.untyped_storage().data_ptr(): t for t in self.kv.values()}.values():
            tensor.untyped_storage().fill_(0)

    def info(self) -> dict:
        client = self.worker.client
        return {"writer": client.is_writer, "namespace": client.info.namespace,
                "connector": type(self.connector).__name__,
                "sharding": self.spec.namespace.sharding.value, "block_bytes": self.spec.namespace.block_bytes,
                "replicated_gate": self.spec.config.replicated_layout, "pid": os.getpid()}

    @staticmethod
    def optimize() -> int:
        """This process's -O level (``assert`` statements are compiled out from 1 on)."""
        import sys
        return sys.flags.optimize

    def close(self) -> None:
        self.connector.shutdown()


def _serve(conn, recipe: EngineRecipe, rank: int, rank_variant: bool) -> None:   # in the child
    try:
        worker = RankWorker(recipe, rank, rank_variant)
        conn.send(("ok", None))
    except Exception as exc:
        conn.send(("error", error_info(exc)))
        return
    commands = {name: getattr(worker, name) for name in dir(worker)
                if not name.startswith("_") and callable(getattr(worker, name))}
    serve(conn, commands, close=worker.close)


class RankProcess(ChildProcess):
    """A RankWorker in its own spawned process (its own ZMQ context, region mapping and pid)."""

    def __init__(self, recipe: EngineRecipe, rank: int, rank_variant: bool = False):
        super().__init__(_serve, recipe, rank, rank_variant)

    def ready(self, timeout: float = 120) -> None:
        """Wait until the worker is built (the child's first answer)."""
        self.result(timeout)


# ------------------------------------------------------------------------------ the engine
class Engine:
    """vLLM's Scheduler plus rank processes, stepped by hand like EngineCore.step()."""

    def __init__(self, recipe: EngineRecipe, ranks: list[RankProcess]):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.vllm_config, self.kv_cache_config = build(recipe, 0)
        self.ranks = ranks
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK_TOKENS, log_stats=True)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_TOKENS, hash_fn)
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler.connector, recipe.tp)
        self.connector_scheduler = self.scheduler.connector.connector_scheduler
        self.manager = self.connector_scheduler.manager
        self.first_computed: dict[str, int] = {}     # request -> tokens it had before its first forward
        # vLLM's KV connector counters (kv_offload_*) summed over the steps' scheduler stats: what
        # the engine's /metrics shows.
        self.connector_counters: dict[str, float] = {}

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int = 2):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def _writes(self, output) -> list[tuple[int, tuple[int, ...]]]:
        """(block id, the block's token ids) of every block the scheduled tokens write."""
        writes = []
        for req_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - count     # schedule() already advanced it
            self.first_computed.setdefault(req_id, start)
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            tokens = request.all_token_ids
            for index in range(start // BLOCK_TOKENS, (start + count - 1) // BLOCK_TOKENS + 1):
                writes.append((block_ids[index], tuple(tokens[index * BLOCK_TOKENS:(index + 1) * BLOCK_TOKENS])))
        return writes

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        writes = self._writes(output)
        metadata = pickle.dumps(output.kv_connector_metadata)
        kv_outputs = [pickle.loads(o) for o in all_call(self.ranks, "step", metadata=metadata, writes=writes,
                                                        finished=set(output.finished_req_ids))]
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_prompt_tokens
            sampled.append([7] if done else [])
        outputs = [ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                     sampled_token_ids=sampled, kv_connector_output=kv)
                   for kv in kv_outputs]
        core_outputs = self.scheduler.update_from_output(output, self.aggregator.aggregate(outputs))
        for core_output in core_outputs.values():
            stats = core_output.scheduler_stats.kv_connector_stats if core_output.scheduler_stats else None
            for name, series in (stats or {}).get("data", {}).items():
                if stats["types"].get(name) == "counter":
                    self.connector_counters[name] = self.connector_counters.get(name, 0) + sum(series.values())

    def serve(self, request_id: str, prompt: list[int], max_tokens: int = 2, timeout: float = 60.0):
        """Add a request and step until it finished and every transfer completed. Returns vLLM's
        Request (its status tells how it ended) and the GPU blocks that last held its full prompt
        blocks (their bytes stay until the blocks are reused)."""
        request = self.add_request(request_id, prompt, max_tokens)
        full = len(prompt) // BLOCK_TOKENS
        blocks: list[int] = []
        deadline = time.monotonic() + timeout
        while request_id in self.scheduler.requests:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} still {request.status} after {timeout}s")
            ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            if len(ids) >= full:
                blocks = list(ids[:full])
            self.step()
        self.run(timeout)
        return request, blocks

    def forget_prefix_cache(self) -> None:
        """vLLM's reset_prefix_cache(): a later request finds nothing on the "GPU". (Not an
        ``assert``: this also runs under ``python -O``.)"""
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def run(self, timeout: float = 60.0) -> None:
        """Step until no request is left and every transfer of the connector completed."""
        deadline = time.monotonic() + timeout
        while self.scheduler.requests or self.connector_scheduler._jobs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine still busy: requests {list(self.scheduler.requests)}, "
                                   f"transfers {list(self.connector_scheduler._jobs)}")
            self.step()
            if not self.scheduler.requests:
                time.sleep(0.005)      # only transfers left: let the copies finish

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def prompt_blocks(prompt: list[int]) -> list[tuple[int, ...]]:
    """The token ids of each full block of a prompt."""
    return [tuple(prompt[i:i + BLOCK_TOKENS]) for i in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS)]


def holds(ranks: list[RankProcess], blocks: list[int], prompt: list[int]) -> bool:
    """Whether every rank's GPU blocks ``blocks`` hold what rank 0's model computes for the prompt's
    full blocks (for MLA, every rank loads rank 0's copy)."""
    expected = [ranks[0].call("expected", token_ids=t) for t in prompt_blocks(prompt)]
    return all(digests == expected for digests in all_call(ranks, "digests", block_ids=blocks))


def before_next_load(engine: Engine, action) -> None:
    """Run ``action()`` once, inside the scheduler step that loads next: after its lookup said HIT,
    before its prepare_load (the window a lease will close)."""
    manager = engine.manager
    original = manager.prepare_load

    def prepare_load(keys, req_context):
        del manager.prepare_load                       # back to the class's method
        action()
        return original(keys, req_context)

    manager.prepare_load = prepare_load


def serve_twice(engine: Engine, ranks: list[RankProcess], prompt: list[int], action=None):
    """Serve ``prompt`` (its blocks go to kvtierd); forget vLLM's prefix cache and zero the KV
    caches; serve it again, running ``action`` in that second request's load window. Returns the
    second Request and whether its blocks hold the right bytes."""
    engine.serve("stored", prompt)
    engine.forget_prefix_cache()
    all_call(ranks, "zero")
    if action is not None:
        before_next_load(engine, action)
    request, blocks = engine.serve("again", prompt)
    return request, holds(ranks, blocks, prompt)


@contextmanager
def running(recipe: EngineRecipe, rank_variant: bool = False):
    """An Engine of the recipe with its rank processes; stopped and reaped on exit."""
    ranks = [RankProcess(recipe, r, rank_variant) for r in range(recipe.tp)]
    engine = None
    try:
        for r in ranks:
            r.ready()
        engine = Engine(recipe, ranks)
        yield engine, ranks
    finally:
        if engine is not None:
            engine.shutdown()
        for r in ranks:
            r.stop()

"""Scheduler time of vLLM 0.33 with the kvtier plugin against vLLM's native CPU offloading, measured
in the same run through vLLM's real ``Scheduler`` (CPU, no model, no GPU).

Runs in the vLLM venv (``make vllm-install``)::

    .venv-vllm/bin/python bench/vllm_scheduler.py [--trials 7] [--json out.json]     # or: make bench-vllm

One prompt of 32,769 tokens (2,048 full blocks of 16) is cached in full in each tier: in kvtierd
(one region, shared by every kvtier engine of the run) and in each native engine's own
``CPUOffloadingSpec``. Only ``scheduler.schedule()`` is timed (perf_counter, GC off around it);
engines are built fresh per trial, and the tiers alternate within a trial so that they share
the machine's load. Sections:

1. **admission**: the step that looks the prompt up and admits it (its 2,048 blocks to be
   loaded). Three designs of kvtier's manager: "kvtier" answers every lookup of the request from
   one batched kvtierd lookup that the step waits for (at most ``kvtier_lookup_wait_ms``, 10 ms);
   "kvtier (no wait)" sends the same batch without waiting (``kvtier_lookup_wait_ms`` 0: RETRY,
   admitted a step later); "kvtier (public path)" is the RETRY collection vLLM's API offers
   without the private key positions (one batch per request sent at the end of the step, admitted
   a step later). "kvtier (no lease)" is "kvtier" with ``kvtier_lease_ttl_s`` 0: what holding the
   hit until the load (a lease) costs the step. Reported: schedule() of the admitting step, the
   steps and the wall time from ``add_request`` to admission, the time the scheduler waited for
   kvtierd, the lookups, the kvtierd requests of the scheduler for the request.
2. **waiting**: the same request while it waits for GPU blocks (a decoding request holds them):
   vLLM looks all 2,048 blocks up again every step. Reported: schedule() per step, lookups per
   step.
3. **kvtierd dead**: kvtierd SIGKILLed while that request waits and new requests keep arriving,
   stepping on for a few seconds; then restarted. Reported: the longest time the scheduler
   thread waited for kvtierd in one step (the manager's own count), schedule() per step next to
   a native engine given the same arrivals with nothing cached (what vLLM itself costs once
   nothing can be loaded), how long until the link is back, and whether a prompt cached before
   the kill loads again.

Between steps the "model" sleeps ``--forward-ms`` (not timed), as a forward pass would take.

Goals (issue 13): admission <= 1.0x native, waiting <= 1.5x native, dead: no step over 1 ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from concurrent.futures import TimeoutError as FutureTimeout

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 16
PROMPT_TOKENS = 2048 * BLOCK + 1                 # 2,048 full blocks
FILLER_TOKENS = 200 * BLOCK                      # the decoding request that holds GPU blocks
PROBE_TOKENS = 64 * BLOCK + 1                    # a smaller prompt cached in kvtierd
GPU_BLOCKS = 2200                                # enough for the prompt alone, not with the filler
MAX_MODEL_LEN = 33024
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
NATIVE = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 64 << 20}


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 + salt) % 250 + 3 for i in range(n)]


class Engine:
    """vLLM's Scheduler over a config with the given KV connector; schedule() timed, no model."""

    def __init__(self, model: str, connector: str, extra: dict, engine_id: str, forward_s: float):
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        module = {"kv_connector_module_path": "kvtier.integrations.vllm"} if connector != "OffloadingConnector" else {}
        model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16",
                                   max_model_len=MAX_MODEL_LEN, seed=0)
        config = VllmConfig(model_config=model_config,
                            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                            parallel_config=ParallelConfig(tensor_parallel_size=1, distributed_executor_backend="mp"),
                            kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                                                engine_id=engine_id, kv_load_failure_policy="recompute",
                                                                kv_connector_extra_config=extra, **module))
        config.scheduler_config.async_scheduling = False
        hf = model_config.hf_text_config
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim,
                                 dtype=torch.bfloat16)
        specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}
        resolve_kv_cache_layout(config, [[layout.name for layout in get_supported_kv_cache_layouts([])]],
                                specs.values())
        kv_config = get_kv_cache_configs(config, [specs], [GPU_BLOCKS * spec.page_size_bytes * len(specs)],
                                         get_global_kv_cache_groups(config, [specs]))[0]
        config.cache_config.num_gpu_blocks = kv_config.num_blocks
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BLOCK,
                                   log_stats=True)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.manager = self.scheduler.connector.connector_scheduler.manager
        self.forward_s = forward_s
        self.lookups = 0

    def count_lookups(self) -> None:
        """Count manager.lookup calls (a wrapper: only in passes that are not timed)."""
        lookup = self.manager.lookup

        def counted(key, req_context):
            self.lookups += 1
            return lookup(key, req_context)

        self.manager.lookup = counted

    def request(self, request_id: str, tokens: list[int], max_tokens: int = 2):
        from vllm import SamplingParams
        from vllm.v1.request import Request
        return Request(request_id=request_id, prompt_token_ids=tokens, pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       block_hasher=self.hasher)

    def step(self) -> float:
        """One schedule() (timed), the model's time (a sleep: background threads run meanwhile, as
        they do during a real forward pass), and its output (one token for every request done
        prefilling)."""
        from vllm.v1.outputs import ModelRunnerOutput
        gc.disable()
        started = time.perf_counter()
        output = self.scheduler.schedule()
        elapsed = time.perf_counter() - started
        gc.enable()
        time.sleep(self.forward_s)
        ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[7] if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens else [] for r in ids]
        self.scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
        return elapsed

    def keys(self, request) -> list[bytes]:
        from vllm.v1.kv_offload.base import make_offload_key
        return [make_offload_key(h, 0) for h in request.block_hashes]

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def cache_natively(engine: Engine, request) -> None:
    """The native tier of this engine holds every block of the request."""
    from vllm.v1.kv_offload.base import ReqContext
    keys, ctx = engine.keys(request), ReqContext(req_id="warm")
    engine.manager.on_new_request(ctx)
    out = engine.manager.prepare_store(keys, ctx)
    assert out is not None and len(out.keys_to_store) == len(keys)
    engine.manager.complete_store(keys, ctx)


def cache_in_kvtierd(engine: Engine, requests: list) -> None:
    """kvtierd holds every block of the requests: stored through this engine's manager and a
    kvtier worker over a small CPU KV cache (the bytes do not matter to the scheduler)."""
    import torch
    from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                         GPULoadStoreSpec, ReqContext)

    from kvtier.integrations.vllm.worker import KvtierOffloadingWorker

    manager = engine.manager
    half = manager.namespace.block_bytes // 2
    pages = [torch.zeros((16, half), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(p, half) for p in pages],
                               group_data_refs=[[CanonicalKVCacheRef(0, half), CanonicalKVCacheRef(1, half)]])
    worker = KvtierOffloadingWorker(manager.settings, manager.engine_id, 0, 1, manager.namespace, caches,
                                    reports_failures=True)
    try:
        for job, request in enumerate(requests, start=1):
            keys, ctx = engine.keys(request), ReqContext(req_id=f"warm{job}")
            manager.on_new_request(ctx)
            out = manager.prepare_store(keys, ctx)
            n = len(out.keys_to_store)
            worker.submit_store(job, GPULoadStoreSpec([i % 16 for i in range(n)], group_sizes=[n],
                                                      block_indices=[0]), out.store_spec)
            worker.wait({job})
            if not all(r.success for r in worker.get_finished()):
                raise RuntimeError("kvtierd did not store the prompt")
            manager.complete_store(keys, ctx)
    finally:
        worker.shutdown()


def settle(engine: Engine) -> None:
    """Wait until the engine's link thread is idle (it serves in order), so that setup work does
    not run into the timed steps."""
    try:
        engine.manager.link.submit(lambda client: None).result(30)
    except FutureTimeout:
        raise RuntimeError("the link thread did not get through its queue") from None


class Run:
    def __init__(self, socket: str, model: str, forward_s: float):
        self.model = model
        self.forward_s = forward_s
        self.kvtier = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                       "kvtier_socket": socket, "kvtier_retry_s": 1.0, "kvtier_timeout_s": 2.0}
        self.engines = 0
        self.cached = False

    def engine(self, tier: str) -> Engine:
        self.engines += 1
        if tier == "native":
            return Engine(self.model, "OffloadingConnector", NATIVE, f"native-{self.engines}", self.forward_s)
        extra = {"kvtier (no wait)": {**self.kvtier, "kvtier_lookup_wait_ms": 0},
                 "kvtier (no lease)": {**self.kvtier, "kvtier_lease_ttl_s": 0}}.get(tier, self.kvtier)
        engine = Engine(self.model, "KvtierOffloadingConnector", extra, f"kvtier-{self.engines}", self.forward_s)
        if tier == "kvtier (public path)":
            engine.manager.use_key_positions = False
        return engine

    def warm(self, engine: Engine, tier: str, request) -> None:
        """The request's blocks are in the tier (kvtierd: once per run, with the probe prompt)."""
        if tier == "native":
            cache_natively(engine, request)
            return
        if not self.cached:
            cache_in_kvtierd(engine, [request, engine.request("probe", prompt(PROBE_TOKENS, salt=2))])
            self.cached = True
        settle(engine)

    def admission(self, tier: str, count: bool = False) -> dict:
        from vllm.v1.request import RequestStatus
        engine = self.engine(tier)
        try:
            big = engine.request("big", prompt(PROMPT_TOKENS))
            self.warm(engine, tier, big)
            if count:
                engine.count_lookups()
            requests = engine.manager.link.requests if tier != "native" else 0
            waited = engine.manager.stats.waited_s if tier != "native" else 0.0
            steps, schedule = 0, 0.0
            started = time.perf_counter()
            engine.scheduler.add_request(big)
            while big.status == RequestStatus.WAITING:
                if steps == 1000:
                    raise RuntimeError(f"{tier}: the request was not admitted in 1000 steps")
                elapsed = engine.step()
                steps += 1
                schedule += elapsed
            wall = time.perf_counter() - started
            if big.num_computed_tokens != 2048 * BLOCK:
                raise RuntimeError(f"{tier}: admitted with {big.num_computed_tokens} tokens to load, not all")
            if tier != "native":
                settle(engine)            # the load's background request counts too
            sent = engine.manager.link.requests - requests if tier != "native" else None
            waited = engine.manager.stats.waited_s - waited if tier != "native" else 0.0
            return {"admit_ms": elapsed * 1e3, "steps": steps, "schedule_ms": schedule * 1e3, "wall_ms": wall * 1e3,
                    "waited_ms": waited * 1e3, "lookups": engine.lookups, "kvtierd_requests": sent}
        finally:
            engine.shutdown()

    def waiting(self, tier: str, steps: int, count: bool = False) -> dict:
        engine = self.engine(tier)
        try:
            filler = engine.request("filler", prompt(FILLER_TOKENS, salt=1), max_tokens=10**6)
            engine.scheduler.add_request(filler)
            for _ in range(3):
                engine.step()
            big = engine.request("big", prompt(PROMPT_TOKENS))
            self.warm(engine, tier, big)
            engine.scheduler.add_request(big)
            engine.step()                                # the first lookup of the request
            if count:
                engine.count_lookups()
            requests = engine.manager.link.requests if tier != "native" else 0
            times = [engine.step() for _ in range(steps)]
            if big.num_computed_tokens:
                raise RuntimeError(f"{tier}: the request did not wait for GPU blocks")
            sent = (engine.manager.link.requests - requests) / steps if tier != "native" else None
            return {"step_ms": statistics.median(times) * 1e3, "lookups_per_step": engine.lookups / steps,
                    "kvtierd_requests_per_step": sent}
        finally:
            engine.shutdown()

    def arrivals(self, engine: Engine, seconds: float, on_step=None) -> list[tuple[float, float]]:
        """A decoding request, a long request waiting for GPU blocks, and a new short request every
        5 steps, for ``seconds``: (schedule() time, time waited for kvtierd) per step."""
        engine.scheduler.add_request(engine.request("filler", prompt(FILLER_TOKENS, salt=1), max_tokens=10**6))
        for _ in range(3):
            engine.step()
        engine.scheduler.add_request(engine.request("big", prompt(PROMPT_TOKENS)))
        engine.step()
        if on_step is not None:
            on_step()
        stats = getattr(engine.manager, "stats", None)
        rows, arrived = [], 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if len(rows) % 5 == 0:
                arrived += 1
                engine.scheduler.add_request(engine.request(f"new{arrived}", prompt(PROBE_TOKENS, salt=9 + arrived),
                                                            max_tokens=4))
            waited = stats.waited_s if stats else 0.0
            rows.append((engine.step(), (stats.waited_s - waited) if stats else 0.0))
        return rows

    def dead(self, daemon, seconds: float) -> dict:
        """kvtierd killed while requests keep arriving, then restarted; the same arrivals on a
        native engine with nothing cached (what vLLM itself costs once nothing can be loaded)."""
        from vllm.v1.request import RequestStatus
        native = self.engine("native")
        try:
            control = self.arrivals(native, seconds)
        finally:
            native.shutdown()
        engine = self.engine("kvtier")
        link = engine.manager.link
        try:
            rows = self.arrivals(engine, seconds, on_step=lambda: daemon.stop(signal.SIGKILL))
            restarted = time.perf_counter()
            daemon.start()
            comeback = []
            while not link.up:
                waited = engine.manager.stats.waited_s
                comeback.append((engine.step(), engine.manager.stats.waited_s - waited))
                if time.perf_counter() > restarted + 120:
                    raise RuntimeError("the link did not come back")
            back = time.perf_counter() - restarted
            engine.scheduler.finish_requests(list(engine.scheduler.requests), RequestStatus.FINISHED_ABORTED)
            probe = engine.request("probe", prompt(PROBE_TOKENS, salt=2))
            engine.scheduler.add_request(probe)
            for _ in range(50):
                engine.step()
                if probe.status != RequestStatus.WAITING:
                    break
            return {"steps": len(rows), "max_wait_ms": max(w for _, w in rows) * 1e3,
                    "max_schedule_ms": max(t for t, _ in rows) * 1e3,
                    "median_schedule_ms": statistics.median(t for t, _ in rows) * 1e3,
                    "native_max_schedule_ms": max(t for t, _ in control) * 1e3,
                    "native_median_schedule_ms": statistics.median(t for t, _ in control) * 1e3,
                    "steps_over_1ms": sum(t > 1e-3 for t, _ in rows),
                    "native_steps_over_1ms": sum(t > 1e-3 for t, _ in control), "native_steps": len(control),
                    "back_after_s": back, "max_wait_ms_comeback": max((w for _, w in comeback), default=0) * 1e3,
                    "probe_loaded_tokens": probe.num_computed_tokens, "probe_tokens": PROBE_TOKENS - 1}
        finally:
            engine.shutdown()


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=7, help="fresh engines per tier and section")
    parser.add_argument("--wait-steps", type=int, default=20, help="steps timed while the request waits")
    parser.add_argument("--dead-seconds", type=float, default=5.0, help="seconds stepped with kvtierd killed")
    parser.add_argument("--forward-ms", type=float, default=5.0,
                        help="the model's time per step (a sleep between steps, not timed)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from kvtierbench import launcher

    root = tempfile.mkdtemp(prefix="kvt-bench-vllm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model = os.path.join(root, "tiny-llama-32k")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    daemon = launcher.DaemonProcess(os.path.join(root, "d"), "--size", "256MiB", "--page-size", "4KiB", "--pin",
                                    "off", "--job-timeout", "30", "--metrics-address", "127.0.0.1:0")
    os.makedirs(daemon.dir)
    tiers = ["native", "kvtier", "kvtier (no lease)", "kvtier (no wait)", "kvtier (public path)"]
    out: dict = {"load_average_start": os.getloadavg()[0], "trials": args.trials}
    try:
        daemon.start(60)
        run = Run(daemon.socket, model, args.forward_ms / 1000)
        admission = {t: [] for t in tiers}
        waiting = {t: [] for t in tiers}
        for _ in range(args.trials):
            for tier in tiers:
                admission[tier].append(run.admission(tier))
                waiting[tier].append(run.waiting(tier, args.wait_steps))
        counted = {t: (run.admission(t, count=True), run.waiting(t, args.wait_steps, count=True)) for t in tiers}
        med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
        out["admission"] = {t: {"admit_ms": med(admission[t], "admit_ms"), "steps": med(admission[t], "steps"),
                                "wall_ms": med(admission[t], "wall_ms"), "schedule_ms": med(admission[t], "schedule_ms"),
                                "lookups": counted[t][0]["lookups"], "kvtierd_requests": counted[t][0]["kvtierd_requests"],
                                "waited_ms": med(admission[t], "waited_ms"),
                                "all_admit_ms": [round(r["admit_ms"], 2) for r in admission[t]],
                                "all_waited_ms": [round(r["waited_ms"], 2) for r in admission[t]]} for t in tiers}
        out["waiting"] = {t: {"step_ms": med(waiting[t], "step_ms"), "lookups_per_step": counted[t][1]["lookups_per_step"],
                              "kvtierd_requests_per_step": counted[t][1]["kvtierd_requests_per_step"],
                              "all_step_ms": [round(r["step_ms"], 3) for r in waiting[t]]} for t in tiers}
        out["dead"] = run.dead(daemon, args.dead_seconds)
    finally:
        out["load_average_end"] = os.getloadavg()[0]
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)

    native_a, native_w = out["admission"]["native"], out["waiting"]["native"]
    print(f"vLLM scheduler with a {PROMPT_TOKENS}-token prompt cached in full (2048 blocks), median of "
          f"{args.trials} fresh engines; load average {out['load_average_start']:.1f} -> {out['load_average_end']:.1f}")
    print(f"\n{'admission':22} {'admitting step':>15} {'vs native':>10} {'steps':>6} {'to admission':>13} "
          f"{'waited':>9} {'lookups':>8} {'kvtierd requests':>17}")
    for t in tiers:
        a = out["admission"][t]
        print(f"{t:22} {a['admit_ms']:>12.2f} ms {ratio(a['admit_ms'], native_a['admit_ms']):>10} {a['steps']:>6g} "
              f"{a['wall_ms']:>10.2f} ms {a['waited_ms']:>6.2f} ms {a['lookups']:>8} {str(a['kvtierd_requests']):>17}")
    print(f"\n{'waiting for GPU blocks':22} {'per step':>15} {'vs native':>10} {'lookups/step':>13} "
          f"{'kvtierd requests/step':>22}")
    for t in tiers:
        w = out["waiting"][t]
        print(f"{t:22} {w['step_ms']:>12.3f} ms {ratio(w['step_ms'], native_w['step_ms']):>10} "
              f"{w['lookups_per_step']:>13g} {str(w['kvtierd_requests_per_step']):>22}")
    d = out["dead"]
    print(f"\nkvtierd SIGKILLed under a waiting request while new ones arrive ({args.dead_seconds:g} s, {d['steps']} steps): "
          f"the scheduler waited for kvtierd at most {d['max_wait_ms']:.3f} ms in a step; schedule() median "
          f"{d['median_schedule_ms']:.3f} ms, max {d['max_schedule_ms']:.2f} ms, {d['steps_over_1ms']} steps over 1 ms "
          f"(native with nothing cached, same arrivals: median {d['native_median_schedule_ms']:.3f} ms, max "
          f"{d['native_max_schedule_ms']:.2f} ms, {d['native_steps_over_1ms']} of {d['native_steps']} over 1 ms). "
          f"Restarted: the link was back after {d['back_after_s']:.2f} s (waited at most {d['max_wait_ms_comeback']:.3f} ms "
          f"in a step meanwhile); a prompt cached before the kill then loaded {d['probe_loaded_tokens']} of "
          f"{d['probe_tokens']} tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

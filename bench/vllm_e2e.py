#!/usr/bin/env python3
"""End-to-end generation through vllm.LLM with kvtierd between two engines (GPU only).

A small MLA model (DeepSeek-V2-Lite's attention geometry: kv_lora_rank 512, rope 64, 16 heads;
two dense layers, a 1,024-token vocabulary) with vLLM's dummy weights (seeded: identical in every
process) is run twice, each engine in its own process with the kvtier offloading connector:

- engine A computes a prompt (greedy, ``--max-tokens`` tokens) and stores its KV in kvtierd;
- engine B, a fresh process with an empty GPU cache, runs the same prompt: its prefix comes from
  kvtierd (the daemon's ``load_hit_keys`` grows) and it must produce the same tokens as A.

Both name the same kvtier namespace (``kvtier_namespace``): dummy weights otherwise put the engine
id in the namespace (kvtier.integrations.vllm.identity), since random weights are usually not
shared. TP=2 (one copy written by rank 0, loaded by both ranks) where two GPUs exist, else TP=1.
The miniature of the DeepSeek-V2-Lite TP=2 evaluation. Writes a JSON result to ``--out``; exits 0
when the tokens match and B hit, 1 otherwise, 0 with ``skipped`` when CUDA or vLLM is missing.

Usage: python bench/vllm_e2e.py --out result.json [--tp N] [--max-tokens 16]
(tools/gpu_check.py runs it as its vllm-e2e step.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 1024,
         "intermediate_size": 2048, "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 16,
         "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "first_k_dense_replace": 2, "vocab_size": 1024,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
         "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000}
NAMESPACE = "gpu-check-tiny-mla@dummy-seeded"
PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(256)]     # 16 blocks of 16 tokens


def engine(model: str, socket: str, tp: int, max_tokens: int, out: str) -> None:
    """One engine's process: generate greedily, a few more steps so that its stores finish, exit."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    transfer = KVTransferConfig(
        kv_connector="KvtierOffloadingConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                                   "kvtier_socket": socket, "kvtier_namespace": NAMESPACE})
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=tp,
              enforce_eager=True, gpu_memory_utilization=0.4, max_model_len=1024, max_num_seqs=4, seed=0,
              kv_transfer_config=transfer)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    (result,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], greedy)
    for i in range(3):       # more engine steps: the connector reports and finishes its stores
        llm.generate([TokensPrompt(prompt_token_ids=[11 + i] * 8)], SamplingParams(max_tokens=2, detokenize=False))
    time.sleep(2)
    Path(out).write_text(json.dumps({"tokens": list(result.outputs[0].token_ids)}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=0, help="tensor parallel size (default: 2 with two GPUs, else 1)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--engine", nargs=3, metavar=("MODEL", "SOCKET", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        engine(args.engine[0], args.engine[1], args.tp, args.max_tokens, args.engine[2])
        return 0
    result: dict = {"namespace": NAMESPACE, "prompt_tokens": len(PROMPT)}
    try:
        import torch
        import vllm  # noqa: F401
        gpus = torch.cuda.device_count()
    except ImportError as exc:
        gpus, result["skipped"] = 0, f"{exc.name} not importable"
    if not result.get("skipped") and gpus == 0:
        result["skipped"] = "no CUDA device"
    if result.get("skipped"):
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(result["skipped"])
        return 0
    tp = args.tp or (2 if gpus >= 2 else 1)
    result["tp"] = tp
    from kvtierbench.launcher import DaemonProcess
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-e2e-", dir="/dev/shm"))
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(MODEL))
    daemon = DaemonProcess(str(work / "kvtierd"), "--size", "2GiB", "--pin", "auto", "--metrics-address", "off")
    try:
        daemon.start()
        for name in ("a", "b"):
            before = daemon.stats()
            began = time.monotonic()
            proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--tp", str(tp), "--max-tokens",
                                   str(args.max_tokens), "--engine", str(work / "model"), daemon.socket,
                                   str(work / f"{name}.json")], capture_output=True, text=True, timeout=600)
            after = daemon.stats()
            result[f"engine_{name}"] = {
                "exit": proc.returncode, "seconds": round(time.monotonic() - began, 1),
                "tokens": json.loads((work / f"{name}.json").read_text())["tokens"] if proc.returncode == 0 else None,
                "store_written_keys": after["store_written_keys"] - before["store_written_keys"],
                "load_hit_keys": after["load_hit_keys"] - before["load_hit_keys"],
                "log_tail": proc.stderr[-2000:] if proc.returncode else ""}
            if proc.returncode:
                break
        a, b = result["engine_a"], result.get("engine_b", {})
        result["same_tokens"] = a["tokens"] is not None and a["tokens"] == b.get("tokens")
        result["passed"] = bool(result["same_tokens"] and b.get("load_hit_keys", 0) > 0 and a["store_written_keys"] > 0)
    finally:
        daemon.stop()
        daemon.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("engine_")}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

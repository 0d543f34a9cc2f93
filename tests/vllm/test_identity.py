"""The model fingerprint in the namespace: what changes it and what does not (identity.py)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

import torch  # noqa: E402

from kvtier.integrations.vllm import identity  # noqa: E402

MODELS = Path(__file__).parent / "models"


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


@pytest.fixture
def model(tmp_path) -> Path:
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    shutil.copy(MODELS / "tiny-llama" / "config.json", directory)
    write_safetensors(directory / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\1" * 9000})
    return directory


def test_the_weights_digest_sees_the_values_not_where_or_when(model, tmp_path):
    digest = identity.weights_digest(str(model))
    copy = tmp_path / "elsewhere"
    shutil.copytree(model, copy)
    os.utime(copy / "model.safetensors", (1, 1))
    assert identity.weights_digest(str(copy)) == digest             # an identical copy agrees
    # A fine-tune saved over the file: same header; values differ at the start, or only at the end.
    write_safetensors(model / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\2" + b"\1" * 8999})
    assert identity.weights_digest(str(model)) != digest
    write_safetensors(model / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\1" * 8999 + b"\3"})
    assert identity.weights_digest(str(model)) != digest
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"vocab_size": 256',
                                                                                  '"vocab_size": 257'))
    assert identity.weights_digest(str(copy)) != digest             # the config is hashed whole


def test_no_weight_file_no_digest_and_other_formats_are_sampled(tmp_path):
    assert identity.weights_digest(str(MODELS / "tiny-llama")) is None
    assert identity.weights_digest(str(tmp_path / "missing")) is None
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * (3 << 20))
    first = identity.weights_digest(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * ((3 << 20) - 1) + b"\1")
    assert first is not None and identity.weights_digest(str(tmp_path)) != first


def test_canonical_values_are_the_same_in_every_process():
    class Opaque:
        pass

    assert identity.canonical({"d": torch.bfloat16, "s": {3, 1}, "t": (1, "x"), "f": len, "o": Opaque()}) == {
        "d": "torch.bfloat16", "s": [1, 3], "t": [1, "x"], "f": "builtins.len",
        "o": "test_canonical_values_are_the_same_in_every_process.<locals>.Opaque"}


def vllm_config(model: Path, engine_id: str = "e", **model_fields):
    from vllm.config import CacheConfig, KVTransferConfig, LoadConfig, ModelConfig, VllmConfig
    load_format = model_fields.pop("load_format", "auto")
    fields = {"skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 1024, "seed": 0, **model_fields}
    return VllmConfig(model_config=ModelConfig(model=str(model), **fields),
                      cache_config=CacheConfig(block_size=16), load_config=LoadConfig(load_format=load_format),
                      kv_transfer_config=KVTransferConfig(kv_connector="KvtierOffloadingConnector",
                                                          kv_connector_module_path="kvtier.integrations.vllm",
                                                          kv_role="kv_both", engine_id=engine_id))


def test_the_fingerprint_follows_what_changes_the_kv_and_nothing_else(model, tmp_path):
    base = identity.from_vllm_config(vllm_config(model))
    assert base.name == "tiny-llama" and base.weights_read and base.complete and len(base.fingerprint) == 16
    copy = tmp_path / "copy" / "tiny-llama"
    shutil.copytree(model, copy)
    assert identity.from_vllm_config(vllm_config(copy, engine_id="other", max_model_len=512, seed=7)) == base
    assert identity.from_vllm_config(vllm_config(model, dtype="float16")).fingerprint != base.fingerprint
    overrides = vllm_config(model, hf_overrides={"rms_norm_eps": 1e-5})
    assert identity.from_vllm_config(overrides).fingerprint != base.fingerprint
    # Random weights: never shared, not even between two engines of the same config.
    dummy = [identity.from_vllm_config(vllm_config(model, engine_id=e, load_format="dummy")) for e in "ab"]
    assert dummy[0].fingerprint != dummy[1].fingerprint and not dummy[0].weights_read


def test_every_process_computes_the_same_fingerprint(model):
    code = ("import os, sys; os.environ['VLLM_TARGET_DEVICE'] = 'cpu'; sys.path.insert(0, os.getcwd());"
            "from tests.vllm.test_identity import vllm_config; from kvtier.integrations.vllm import identity;"
            f"print(identity.from_vllm_config(vllm_config({str(model)!r})).fingerprint)")
    root = Path(__file__).resolve().parents[2]
    runs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
            for _ in range(2)]
    prints = {r.stdout.strip().splitlines()[-1] for r in runs}
    assert prints == {identity.from_vllm_config(vllm_config(model)).fingerprint}

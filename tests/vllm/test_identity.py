"""vLLM's config mapped onto the model fingerprint (identity.py): what changes it and what does not.

The weights digest itself is tested in tests/unit/test_fingerprint.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` builds .venv-vllm")

from kvtier.integrations import fingerprint  # noqa: E402
from kvtier.integrations.vllm import identity  # noqa: E402
from tests.unit.test_fingerprint import write_safetensors  # noqa: E402

MODELS = Path(__file__).parent / "models"


@pytest.fixture
def model(tmp_path) -> Path:
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    shutil.copy(MODELS / "tiny-llama" / "config.json", directory)
    write_safetensors(directory / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\1" * 9000})
    return directory


def test_a_hub_model_is_read_from_its_local_cache_snapshot(model, tmp_path):
    """vLLM reads a hub id's weights from the Hugging Face cache (LoadConfig.download_dir); the
    snapshot of the revision is fingerprinted, offline: a revision not cached has no digest."""
    pytest.importorskip("huggingface_hub", reason="vLLM's huggingface_hub is not installed")
    cache, revisions = tmp_path / "hub", ("a" * 40, "b" * 40)
    repo = cache / "models--org--tiny-llama"
    for revision in revisions:
        shutil.copytree(model, repo / "snapshots" / revision)
    write_safetensors(repo / "snapshots" / revisions[1] / "model.safetensors", {"a": b"\5" * 64})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revisions[0])
    assert fingerprint.weights_location("org/tiny-llama", None, str(cache)) == str(repo / "snapshots" / revisions[0])
    first = fingerprint.local_weights_digest("org/tiny-llama", None, str(cache))
    assert first == fingerprint.weights_digest(str(model))
    second = fingerprint.local_weights_digest("org/tiny-llama", revisions[1], str(cache))
    assert second is not None and second != first
    assert fingerprint.local_weights_digest("org/tiny-llama", "c" * 40, str(cache)) is None
    assert fingerprint.local_weights_digest("org/other", None, str(cache)) is None


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

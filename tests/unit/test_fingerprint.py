"""kvtier.integrations.fingerprint: what changes the weights digest and the fingerprint, and what does not.

How each engine maps its config onto the fingerprint is tested with the engine (tests/vllm/test_identity.py,
tests/sglang/test_backend.py).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from kvtier.integrations.fingerprint import FILE_SAMPLE_BYTES, canonical, fingerprint, weights_digest

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3, "vocab_size": 256}


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
    (directory / "config.json").write_text(json.dumps(CONFIG))
    write_safetensors(directory / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\1" * 9000})
    return directory


def test_the_weights_digest_sees_the_values_not_where_or_when(model, tmp_path):
    digest = weights_digest(str(model))
    copy = tmp_path / "elsewhere"
    shutil.copytree(model, copy)
    os.utime(copy / "model.safetensors", (1, 1))
    assert weights_digest(str(copy)) == digest                      # an identical copy agrees
    (copy / "tokenizer.json").write_text("{}")
    assert weights_digest(str(copy)) == digest                      # the tokenizer does not change the KV
    # A fine-tune saved over the file: same header; values differ at the start, or only at the end.
    write_safetensors(model / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\2" + b"\1" * 8999})
    assert weights_digest(str(model)) != digest
    write_safetensors(model / "model.safetensors", {"a": bytes(range(256)) * 40, "b": b"\1" * 8999 + b"\3"})
    assert weights_digest(str(model)) != digest
    (copy / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 257}))
    assert weights_digest(str(copy)) != digest                      # the config is hashed whole


def test_a_fine_tune_of_some_tensors_is_seen_wherever_they_lie(tmp_path):
    """Every tensor is sampled, not the file: a change to tensors in the middle of a large file shows."""
    tensors = {f"layers.{i:03d}.w": bytes([i]) * (64 << 10) for i in range(64)}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    digest = weights_digest(str(tmp_path))
    tensors.update({f"layers.{i:03d}.w": bytes([i + 100]) * (64 << 10) for i in (20, 21)})
    write_safetensors(tmp_path / "model.safetensors", tensors)
    assert weights_digest(str(tmp_path)) != digest


def test_no_weight_file_no_digest_and_other_formats_are_sampled(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert weights_digest(str(tmp_path)) is None                   # configs alone are no weights
    assert weights_digest(str(tmp_path / "missing")) is None
    # Not a safetensors file in fact (random bytes): its first and last MiB are read, here all of it.
    weights = bytearray(os.urandom(300_000))
    (tmp_path / "model.safetensors").write_bytes(weights)
    first = weights_digest(str(tmp_path))
    weights[150_000:150_010] = os.urandom(10)
    (tmp_path / "model.safetensors").write_bytes(weights)
    assert first is not None and weights_digest(str(tmp_path)) != first
    big = tmp_path / "big"
    big.mkdir()
    (big / "pytorch_model.bin").write_bytes(b"\0" * (3 * FILE_SAMPLE_BYTES))
    first = weights_digest(str(big))
    (big / "pytorch_model.bin").write_bytes(b"\0" * (3 * FILE_SAMPLE_BYTES - 1) + b"\1")
    assert first is not None and weights_digest(str(big)) != first
    assert weights_digest(str(big / "pytorch_model.bin")) is not None   # one weight file (e.g. a .gguf path)


def test_canonical_values_are_the_same_in_every_process():
    class Opaque:
        pass

    assert canonical({"d": torch.bfloat16, "s": {3, 1}, "t": (1, "x"), "f": len, "o": Opaque()}) == {
        "d": "torch.bfloat16", "s": [1, 3], "t": [1, "x"], "f": "builtins.len",
        "o": "test_canonical_values_are_the_same_in_every_process.<locals>.Opaque"}


def test_the_fingerprint_is_16_hex_digits_of_the_parts_in_any_order():
    parts = {"kv_dtype": torch.bfloat16, "page_size": 64, "weights": None}
    assert fingerprint(parts) == fingerprint(dict(reversed(parts.items())))
    assert len(fingerprint(parts)) == 16 and int(fingerprint(parts), 16) >= 0
    assert fingerprint({**parts, "page_size": 32}) != fingerprint(parts)

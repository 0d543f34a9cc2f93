"""A model's cache identity: a short fingerprint of what determines the bytes of its KV cache.

Two engines may share cached KV only when the same tokens produce the same KV bytes in both:
same weights (path, revision, checkpoint files, quantization), same KV dtype and the same page
layout. ``fingerprint(parts)`` hashes such a description (a JSON-able mapping the integration
builds from what its engine knows) into 16 hex digits that go into the kvtier namespace, so
engines whose weights differ land in different namespaces and never load each other's blocks.

``weights_digest(model_path, revision)`` is the weights part, without reading whole checkpoints:

- the directory is ``model_path`` when it is a local directory, else the Hugging Face cache's
  snapshot of (``model_path``, ``revision``) if one is on this machine (looked up offline, through
  ``huggingface_hub`` when it is installed); a snapshot directory is named by the commit it holds;
- every top-level ``*.json`` file (config, generation and quantization configs, the weights'
  index) is hashed whole;
- every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) contributes its
  name, size and three 64 KiB samples (start, middle, end): a fine-tune or re-quantization saved
  over the same directory changes the sampled tensor bytes, while sharing between engines that
  load the very same files costs a few reads at start.

It returns None when no local copy can be found (the caller then keys on path and revision only,
and says so in its log).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 64 * 1024


def fingerprint(parts: Mapping[str, Any]) -> str:
    """16 hex digits of sha256 over the canonical JSON of ``parts``."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_directory(model_path: str, revision: str | None = None) -> str | None:
    """The local directory holding ``model_path``'s files, or None (looked up offline only)."""
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model_path, "config.json", revision=revision)
    except Exception:           # not a repo id, or a malformed cache: no local copy
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def _sample(path: str, size: int) -> bytes:
    with open(path, "rb") as f:
        out = b""
        for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(offset)
            out += f.read(SAMPLE_BYTES)
        return out


def weights_digest(model_path: str, revision: str | None = None) -> str | None:
    """sha256 (hex) over the checkpoint's configs and sampled weight files; None without a local copy."""
    directory = model_directory(model_path, revision)
    if directory is None:
        return None
    h = hashlib.sha256()
    names = sorted(os.listdir(directory))
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".json"):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
        elif name.endswith(WEIGHT_SUFFIXES):
            size = os.path.getsize(path)
            h.update(f"{name}\0{size}\0".encode() + _sample(path, size))
    return h.hexdigest()

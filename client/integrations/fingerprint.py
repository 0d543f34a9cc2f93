"""A model's cache identity: a short fingerprint of what determines the bytes of its KV cache.

Two engines may share cached KV only when the same tokens produce the same KV bytes in both:
same weights, same config and quantization, same KV dtype and the same KV memory layout. Each
integration maps its engine's config onto a JSON-able description of these (``parts``);
``fingerprint(parts)`` hashes it into 16 hex digits that go into the kvtier namespace, so engines
whose KV differs land in different namespaces and never load each other's blocks.

``local_weights_digest(model, revision)`` is the weights part, without reading whole checkpoints:

- the files are those at ``model`` (a model directory or one weight file) when it exists, else in
  the local Hugging Face cache snapshot of (``model``, ``revision``) (looked up offline: this never
  downloads);
- each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, sorted by name)
  contributes its name and size; a safetensors file its header (every tensor's name, dtype, shape
  and offsets) and the first and last ``TENSOR_SAMPLE_BYTES`` of every tensor's data, so a
  fine-tune saved over the same files (same header and index, other values) changes it even when
  only some tensors changed; other formats their first and last ``FILE_SAMPLE_BYTES``;
- the directory's ``config.json``, ``params.json``, weights index, quantization configs and
  ``*.py`` files are hashed whole (not the tokenizer's files: they do not change the KV of given
  token ids);
- file times and the directory's path are left out, so identical copies agree.

It reads a few KiB per tensor, once per process start, and returns None when there is no local
weight file (the integration then keys on the model's path and revision, and says so in its log).
A change confined to the middle of every tensor it touches is not seen.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import hashlib
import json
import os
from typing import Any, Mapping

FINGERPRINT_HEX = 16
TENSOR_SAMPLE_BYTES = 4096      # read from the start and from the end of every safetensors tensor
FILE_SAMPLE_BYTES = 1 << 20     # read from the start and from the end of other weight files
SMALL_FILE_BYTES = 64 << 20     # config-like files up to this size are hashed whole
MAX_HEADER_BYTES = 100 << 20    # a safetensors header larger than this is not believed
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
CONFIG_PATTERNS = ("config.json", "params.json", "*index.json", "*quant*.json", "*.py")


def canonical(value: Any) -> Any:
    """``value`` as JSON-able data that is the same in every process (no object addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if hasattr(value, "to_dict"):
        return canonical(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return canonical({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    if type(value).__repr__ is not object.__repr__:      # e.g. torch.dtype: a repr of its own
        return repr(value)
    return type(value).__qualname__


def fingerprint(parts: Mapping[str, Any]) -> str:
    """``FINGERPRINT_HEX`` hex digits of a sha256 over the canonical JSON of ``parts``."""
    text = json.dumps(canonical(parts), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_HEX]


def local_weights_digest(model: str, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """``weights_digest`` of the weights ``model`` names on this node (``weights_location``); None
    when none is there."""
    location = weights_location(model, revision, download_dir)
    return weights_digest(location) if location else None


def weights_location(model: str, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """Where an engine reads ``model``'s weights on this node: the path itself, else the local
    Hugging Face cache (``download_dir``, else the default one) snapshot of ``revision`` (never
    downloads); None when neither exists."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:           # not a hub id, not cached, no huggingface_hub: nothing to read
        return None


def weights_digest(path: str) -> str | None:
    """A sha256 (hex) of the weights at ``path`` (a model directory, or one weight file), as the
    module docstring describes; None when there is no weight file."""
    if os.path.isfile(path):
        weights, configs = [path], []
    elif os.path.isdir(path):
        weights = sorted({f for p in WEIGHT_PATTERNS for f in glob.glob(os.path.join(path, p)) if os.path.isfile(f)})
        configs = sorted({f for p in CONFIG_PATTERNS for f in glob.glob(os.path.join(path, p))
                          if os.path.isfile(f)} - set(weights))
    else:
        return None
    if not weights:
        return None
    digest = hashlib.sha256()
    for name in configs + weights:
        digest.update(os.path.basename(name).encode() + b"\0")
        digest.update(_file_digest(name, whole=name in configs))
    return digest.hexdigest()


def _file_digest(name: str, whole: bool) -> bytes:
    fd = os.open(name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        digest = hashlib.sha256(size.to_bytes(8, "little"))
        if whole and size <= SMALL_FILE_BYTES:
            digest.update(os.pread(fd, size, 0))
        elif not (name.endswith(".safetensors") and _safetensors_samples(fd, size, digest)):
            digest.update(os.pread(fd, FILE_SAMPLE_BYTES, 0))
            digest.update(os.pread(fd, FILE_SAMPLE_BYTES, max(0, size - FILE_SAMPLE_BYTES)))
        return digest.digest()
    finally:
        os.close(fd)


def _safetensors_samples(fd: int, size: int, digest) -> bool:
    """Hash a safetensors file's header and samples of every tensor; False if it is not one."""
    if size < 8:
        return False
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        return False
    header = os.pread(fd, length, 8)
    try:
        tensors = json.loads(header)
        spans = sorted(tuple(map(int, t["data_offsets"])) for k, t in tensors.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    digest.update(header)
    base = 8 + length
    for begin, end in spans:
        n = min(TENSOR_SAMPLE_BYTES, max(0, end - begin))
        digest.update(os.pread(fd, n, base + begin))
        digest.update(os.pread(fd, n, base + end - n))
    return True

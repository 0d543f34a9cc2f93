"""What an engine's KV bytes depend on: the model fingerprint in its kvtier namespace.

Engines share cached blocks exactly when their namespaces are equal, and vLLM's block hashes come
from token ids alone. So the namespace must name whatever changes the KV computed for the same
tokens. Its model part is ``<name>@<fingerprint>``: ``name`` is the model's last path component
(for people: ``kvtierctl namespaces``), ``fingerprint`` the first 16 hex digits of a sha256 over
the canonical JSON of

- ModelConfig: ``dtype``, ``quantization``, ``quantization_config``, ``hf_overrides``,
  ``model_impl``, and ``hf_text_config`` as vLLM resolved it (after overrides; without its path
  and library-version fields);
- CacheConfig: ``cache_dtype``, ``kv_cache_dtype_skip_layers``;
- LoadConfig: ``load_format``, ``model_loader_extra_config``;
- the weights digest (``weights_digest``) of the files vLLM loads from: the model directory, or
  the local Hugging Face cache snapshot of the model's revision;
- where no weight file can be read (a streaming loader, a hub model not in the local cache):
  the model path or URI, ``model_weights``, ``revision`` and ``code_revision`` instead; with
  ``load_format="dummy"`` (random weights) the vLLM engine id, so that such an engine never
  shares.

Left out on purpose: the model's path when its weights were read (identical copies in two
directories of the same name share), ``max_model_len``, seeds, the tokenizer (it does not change
the KV of given token ids) and the TP size (a sharded namespace records the bytes per rank; a
replicated one is TP-independent). Block size, bytes per block, vLLM's KV-cache memory layout
and the namespace kind are namespace fields of their own.

The scheduler and every rank compute the fingerprint from the same config and files, so they
agree; if they ever did not, kvtierd refuses the attach (LAYOUT_MISMATCH), which is loud.

``KvtierOffloadingConnector`` computes it from the whole VllmConfig (``from_vllm_config``) and
hands it to the spec it builds (``announce``); the plain spec path sees only vLLM's
OffloadingConfig and fingerprints the weights its model name points to
(``from_offloading_config``), without revision, quantization or overrides.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

logger = logging.getLogger("vllm.kvtier")

FINGERPRINT_HEX = 16
TENSOR_SAMPLE_BYTES = 4096      # read from the start and from the end of every safetensors tensor
FILE_SAMPLE_BYTES = 1 << 20     # read from the start and from the end of other weight files
SMALL_FILE_BYTES = 64 << 20     # config-like files up to this size are hashed whole
MAX_HEADER_BYTES = 100 << 20    # a safetensors header larger than this is not believed
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
CONFIG_PATTERNS = ("config.json", "params.json", "*index.json", "*quant*.json", "*.py")
# Fields of a transformers config that name where or with what it was read, not what it is.
UNRELATED_CONFIG_KEYS = ("_name_or_path", "_commit_hash", "transformers_version")


@dataclass(frozen=True)
class ModelIdentity:
    """The model part of a namespace: ``name@fingerprint``."""

    name: str
    fingerprint: str
    weights_read: bool        # the weights digest is in the fingerprint
    complete: bool            # computed from the whole VllmConfig (the connector subclass)


def short_name(model: str) -> str:
    """The last component of a model path, URI or hub id (``meta-llama/Llama-3-8B`` -> ``Llama-3-8B``)."""
    return model.rstrip("/").rsplit("/", 1)[-1] or model


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


def _fingerprint(fields: Mapping[str, Any]) -> str:
    text = json.dumps(canonical(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_HEX]


# ------------------------------------------------------------------------------ the weights
def weights_location(model: str, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """Where vLLM reads ``model``'s weights on this node: the path itself, else the local Hugging
    Face cache snapshot of ``revision`` (never downloads); None when neither exists."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:           # not a hub id, not cached, no huggingface_hub: nothing to read
        return None


def weights_digest(path: str) -> str | None:
    """A sha256 (hex) of the weights at ``path`` (a model directory, or one weight file), reading
    a few KiB per tensor; None when there is no weight file.

    For each weight file (sorted by name): its name and size; for safetensors the header (every
    tensor's name, dtype, shape and offsets) and the first and last ``TENSOR_SAMPLE_BYTES`` of every
    tensor's data, which catches a fine-tune saved over the same files (same header, other
    values); for other formats the first and last ``FILE_SAMPLE_BYTES``. The directory's config,
    index, quantization and code files are hashed whole. File times are left out, so identical
    copies agree.
    """
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


# ------------------------------------------------------------------------------ identities
def _model_config_fields(model_config) -> dict[str, Any]:
    config = canonical(model_config.hf_text_config.to_dict())
    for key in UNRELATED_CONFIG_KEYS:
        config.pop(key, None)
    return {"dtype": model_config.dtype, "quantization": model_config.quantization,
            "quantization_config": model_config.quantization_config, "hf_overrides": model_config.hf_overrides,
            "model_impl": model_config.model_impl, "hf_text_config": config}


def from_vllm_config(vllm_config) -> ModelIdentity:
    """The identity of the model a VllmConfig serves (the connector subclass's path)."""
    model_config, load_config = vllm_config.model_config, vllm_config.load_config
    source = model_config.model_weights or model_config.model
    fields = _model_config_fields(model_config)
    fields.update(cache_dtype=vllm_config.cache_config.cache_dtype,
                  kv_cache_dtype_skip_layers=sorted(vllm_config.cache_config.kv_cache_dtype_skip_layers or ()),
                  load_format=load_config.load_format, loader_extra=load_config.model_loader_extra_config)
    digest = None
    if canonical(load_config.load_format) == "dummy":
        fields["random_weights_of_engine"] = vllm_config.kv_transfer_config.engine_id
    else:
        location = weights_location(model_config.model, model_config.revision, load_config.download_dir)
        digest = weights_digest(location) if location else None
    if digest is None:
        fields.update(model=source, model_weights=model_config.model_weights, revision=model_config.revision,
                      code_revision=model_config.code_revision if model_config.trust_remote_code else None)
    fields["weights"] = digest
    identity = ModelIdentity(short_name(source), _fingerprint(fields), digest is not None, True)
    _log(identity, source)
    return identity


def from_offloading_config(config) -> ModelIdentity:
    """The identity from what vLLM hands a plain spec: the model name and the KV dtype only (no
    revision, quantization or overrides: see ``KvtierOffloadingConnector``)."""
    name = config.model.name
    location = weights_location(name)
    digest = weights_digest(location) if location else None
    fields = {"kv_dtype": config.model.dtype, "weights": digest, "model": None if digest else name}
    identity = ModelIdentity(short_name(name), _fingerprint(fields), digest is not None, False)
    _log(identity, name)
    return identity


def _log(identity: ModelIdentity, source: str) -> None:
    if identity.weights_read:
        logger.info("kvtier: model %s fingerprint %s (weights read)", source, identity.fingerprint)
    else:
        logger.warning("kvtier: no weight file of %s is readable on this node; its fingerprint %s covers the "
                       "model's name, revision and config but not its weights. Set kvtier_namespace to a name "
                       "that changes whenever the weights do.", source, identity.fingerprint)


# ------------------------------------------------------------------------------ handing it to the spec
Resolver = Callable[[], ModelIdentity]
_ANNOUNCED: contextvars.ContextVar[Resolver | None] = contextvars.ContextVar("kvtier_model", default=None)


@contextlib.contextmanager
def announce(resolve: Resolver) -> Iterator[None]:
    """Make ``resolve`` (called only if the namespace needs it) the model identity of the spec
    built inside this block: vLLM's OffloadingConnector builds its spec synchronously in its
    ``__init__`` and hands it no VllmConfig."""
    token = _ANNOUNCED.set(resolve)
    try:
        yield
    finally:
        _ANNOUNCED.reset(token)


def announced() -> Resolver | None:
    """What ``announce`` set around the spec's construction; None on the plain spec path."""
    return _ANNOUNCED.get()

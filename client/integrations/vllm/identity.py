"""What an engine's KV bytes depend on: the model fingerprint in its kvtier namespace.

Engines share cached blocks exactly when their namespaces are equal, and vLLM's block hashes come
from token ids alone. So the namespace must name whatever changes the KV computed for the same
tokens. Its model part is ``<name>@<fingerprint>``: ``name`` is the model's last path component
(for people: ``kvtierctl namespaces``), ``fingerprint`` the first 16 hex digits of a sha256 over
the canonical JSON (``kvtier.integrations.fingerprint``) of

- ModelConfig: ``dtype``, ``quantization``, ``quantization_config``, ``hf_overrides``,
  ``model_impl``, and ``hf_text_config`` as vLLM resolved it (after overrides; without its path
  and library-version fields);
- CacheConfig: ``cache_dtype``, ``kv_cache_dtype_skip_layers``;
- LoadConfig: ``load_format``, ``model_loader_extra_config``;
- the weights digest (``fingerprint.local_weights_digest``) of the files vLLM loads from: the
  model directory, or the local Hugging Face cache snapshot of the model's revision (in vLLM's
  ``download_dir``);
- where no weight file can be read (a streaming loader, a hub model not in the local cache):
  the model path or URI, ``model_weights``, ``revision`` and ``code_revision`` instead; with
  ``load_format="dummy"`` (random weights) the vLLM engine id, so that such an engine never
  shares.

Left out on purpose: the model's path when its weights were read (identical copies in two
directories of the same name share), ``max_model_len``, seeds, the tokenizer (it does not change
the KV of given token ids) and the TP size (a sharded namespace records the bytes per rank; a
replicated one is TP-independent). Block size, bytes per block, vLLM's KV-cache memory layout
and the namespace's sharding are namespace fields of their own.

The scheduler and every rank compute the fingerprint from the same config and files, so they
agree; if they ever did not, kvtierd refuses the attach (LAYOUT_MISMATCH), which is loud.

``KvtierOffloadingConnector`` computes it from the whole VllmConfig (``from_vllm_config``) and
hands it to the spec it builds (``announce``); the plain spec path sees only vLLM's
OffloadingConfig and fingerprints the weights its model name points to
(``from_offloading_config``), without revision, quantization or overrides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..fingerprint import canonical, fingerprint, local_weights_digest
from .handoff import Handoff

logger = logging.getLogger("vllm.kvtier")

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
        digest = local_weights_digest(model_config.model, model_config.revision, load_config.download_dir)
    if digest is None:
        fields.update(model=source, model_weights=model_config.model_weights, revision=model_config.revision,
                      code_revision=model_config.code_revision if model_config.trust_remote_code else None)
    fields["weights"] = digest
    identity = ModelIdentity(short_name(source), fingerprint(fields), digest is not None, True)
    _log(identity, source)
    return identity


def from_offloading_config(config) -> ModelIdentity:
    """The identity from what vLLM hands a plain spec: the model name and the KV dtype only (no
    revision, quantization or overrides: see ``KvtierOffloadingConnector``)."""
    name = config.model.name
    digest = local_weights_digest(name)
    fields = {"kv_dtype": config.model.dtype, "weights": digest, "model": None if digest else name}
    identity = ModelIdentity(short_name(name), fingerprint(fields), digest is not None, False)
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
# ``resolve`` is called only if the namespace needs the model's identity.
_MODEL: Handoff[Resolver] = Handoff("kvtier_model")
announce = _MODEL.announce
announced = _MODEL.announced

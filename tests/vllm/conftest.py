"""Fixtures of the vLLM integration suite (run by `make test-vllm`, in the .venv-vllm venv).

The daemon fixtures are the integration suite's: a real kvtierd in its own /tmp directory,
stopped and removed after each test. Without vLLM installed every test here is skipped.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # before anything imports vllm

from tests.integration.conftest import daemon, start_daemon  # noqa: E402,F401  (fixtures)

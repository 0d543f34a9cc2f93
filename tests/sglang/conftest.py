"""Fixtures of the SGLang integration suite (run by `make test-sglang`, in the .venv-sglang venv).

The daemon fixtures are the integration suite's: a real kvtierd in its own /tmp directory,
stopped and removed after each test. SGLang itself runs in child processes (one per TP rank,
tests/sglang/harness.py) that the tests stop. Without SGLang installed every test here is skipped.
"""

from tests.integration.conftest import daemon, start_daemon  # noqa: F401  (fixtures)

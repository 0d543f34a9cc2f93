"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from .store_env import Env


@pytest.fixture
def env():
    """A store over a 64-page region in memory; checked with ``verify()`` after the test."""
    e = Env()
    yield e
    e.store.verify()

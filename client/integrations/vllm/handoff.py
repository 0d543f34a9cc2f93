"""What KvtierOffloadingConnector hands the spec it builds.

vLLM's OffloadingConnector builds its spec synchronously in its ``__init__`` and gives it no
VllmConfig; the connector sets what the spec needs from that config — the model's identity, the
topology, the block hash algorithm — in a ``Handoff`` around the construction (``announce``), and
the spec reads it there (``announced``). The plain spec path finds None and falls back to what
vLLM's OffloadingConfig says.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    """One value handed from the connector to the spec built inside ``announce``."""

    def __init__(self, name: str):
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def announce(self, value: T) -> Iterator[None]:
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)

    def announced(self) -> T | None:
        """What ``announce`` set around the spec's construction; None on the plain spec path."""
        return self._var.get()

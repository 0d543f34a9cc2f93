"""CPU stand-ins that let SGLang 0.5.23 import on a machine without CUDA (see docs/sglang.md).

SGLang imports a few CUDA-only packages unconditionally: ``triton`` (at the top of
``sglang/srt/utils/common.py``), ``torchvision`` (through its multimodal configs) and ``tvm_ffi``
(through a custom all-reduce). Nothing on the HiCache storage path launches a kernel or calls
these packages, so when one of them cannot be imported, ``install()`` registers a permissive
stand-in module for it (and every submodule): any attribute is a stand-in object, calling one
with a single function returns that function (so ``@triton.jit`` and ``@triton.autotune(...)``
leave the decorated function as it is). A package that *is* installed is never shadowed.

``install()`` must run before the first ``import sglang``; it also sets TORCHDYNAMO_DISABLE=1,
because with the stand-ins the ``torch.compile`` decorators SGLang applies at import time would
pull in ``torch._inductor``, which needs the real triton.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

STUBBED = ("triton", "torchvision", "tvm_ffi")


class _Anything:
    """Stands in for any object of a stubbed package."""

    __version__ = "3.4.0"

    def __init__(self, name: str = "stub"):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]                 # used as a decorator: keep the function
        return _Anything(self._name + "()")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __getitem__(self, item):
        return _Anything(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<cpu stand-in {self._name}>"

    def __mro_entries__(self, bases):
        return (object,)                   # `class X(triton.Something)` still works


class _StubModule(types.ModuleType):
    __version__ = "3.4.0"

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install() -> list[str]:
    """Register stand-ins for the packages of STUBBED that cannot be imported; returns their names."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    missing = tuple(name for name in STUBBED if name not in sys.modules and importlib.util.find_spec(name) is None)
    if missing and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder(missing))
    return list(missing)

"""The daemon's compiled core, kvtierd._native (native/README.md); everything else is in pyproject.toml.

Plain C against the Python C API: `pip install` builds it with the machine's C compiler and Python
headers, nothing else (no Cython, no NumPy headers). The client library never imports it.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvtierd._native",
    sources=[f"native/{name}.c" for name in ("module", "common", "keytable", "records", "related", "batch", "sketch",
                                             "policy", "policies", "kvevents", "checksum", "requests")],
    depends=["native/native.h", "native/policy.h"],
    extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
)])

"""SGLang's real HiCache path on a GPU: device KV pools in CUDA memory, pinned host pools, and
SGLang's own CUDA copy ops (``sgl_kernel``: ``transfer_kv_direct`` for io backend ``direct``, the
``transfer_kv_*_lf_pf`` / ``*_pf_lf`` kernels for ``kernel``) between L1 and L2; L2↔L3 goes through
kvtier as on the CPU. Needs CUDA and the ``sgl_kernel`` package (SGLang's CUDA kernels), which the
CPU venv does not install: skipped without them, with the reason.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed: `make test-sglang` builds .venv-sglang", allow_module_level=True)

import torch  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (SGLang's device pools and L1<->L2 kernels)", allow_module_level=True)
if importlib.util.find_spec("sgl_kernel") is None:
    pytest.skip("needs sgl_kernel (SGLang's CUDA kernels) in this venv", allow_module_level=True)

from tests.sglang.harness import RankProcess, RankSpec  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.cuda, pytest.mark.timeout(300)]

PROMPT = list(range(1000, 1032))


@pytest.mark.parametrize("kind, layout, io", [("mha", "layer_first", "direct"), ("mha", "layer_first", "kernel"),
                                              ("mha", "page_first", "kernel"), ("mla", "layer_first", "kernel"),
                                              ("mla", "page_first_direct", "direct")])
def test_gpu_round_trip_through_sglangs_cuda_copies(daemon, kind, layout, io):
    procs = [RankProcess(RankSpec(kind, daemon.socket, engine_id="gpu-a", layout=layout, device="cuda",
                                  server={"hicache_io_backend": io})),
             RankProcess(RankSpec(kind, daemon.socket, engine_id="gpu-b", layout=layout, device="cuda",
                                  server={"hicache_io_backend": io}))]
    try:
        a, b = (p.ready() for p in procs)
        a.call("write", tokens=PROMPT)
        a.call("evict_all")
        assert a.call("fetch", tokens=PROMPT) == {"host_hit": 32, "device": 32, "correct": 32, "correct_own": 32}
        got = b.call("fetch", tokens=PROMPT)
        assert (got["host_hit"], got["correct"]) == (32, 32)
    finally:
        for p in procs:
            p.stop()

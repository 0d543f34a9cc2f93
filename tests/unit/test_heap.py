"""kvtierd.heap: with the thresholds set, memory the loop frees is reused without faulting pages
in again (checked in a child process: mallopt is process-wide)."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

CHILD = """
import resource, sys
from kvtierd import heap

def faults():
    # Blocks a little larger each time (a flush's batch as the load grows), every page written,
    # then freed: glibc's default maps each anew (its threshold follows the last one freed) and
    # faults its pages in; kept, the heap holds them and only its growth is faulted in.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(50):
        block = bytearray((256 + 16 * i) << 10)
        block[::4096] = b"x" * len(range(0, len(block), 4096))
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


default = faults()
said = heap.keep_freed_heap()
print(default, faults(), said, sep="|")
"""


def child(**env) -> tuple[int, int, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**environ, **env}, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    default, kept, said = out.strip().split("|")
    return int(default), int(kept), said


def test_freed_blocks_are_reused_without_faulting_pages_in_again():
    default, kept, said = child()
    assert default >= 50 * 64, default                # each block's pages faulted in anew
    assert kept < 300, (kept, said)                   # the largest block's, once
    assert "keeps up to 64 MiB" in said


def test_an_operators_malloc_environment_is_left_as_it_is():
    *_, said = child(MALLOC_TRIM_THRESHOLD_="1048576")
    assert said == "malloc left to the environment (MALLOC_TRIM_THRESHOLD_)"
    *_, said = child(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")
    assert said == "malloc left to the environment (GLIBC_TUNABLES)"

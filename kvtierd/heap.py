"""glibc's malloc, set for the daemon's loop: freed heap kept for the next allocation instead of
handed back to the kernel and faulted in again.

Why: by default glibc gives the top of its heap back (``brk``) once 128 KiB of it are free, and
serves allocations of 128 KiB and more with a fresh ``mmap`` each, unmapped on free. The loop
allocates and frees the same sizes over and over — a KV events flush writes a ~60 KiB batch and
ZMQ copies it, a store job's keys become blobs of ~9 KiB — so the heap's top went back and forth
and every new page cost a fault and its zeroing: in some daemons 1.3 faults a 256-key store job,
~10 µs of the loop's thread (``clear_page`` in ``perf``; 2-vCPU VM), in others none, as the heap
happened to lie. With these settings a page is faulted in once and reused; the daemon keeps at most
``TRIM_THRESHOLD`` of free heap above what it uses (its region is shared memory, not heap).

An operator's own ``MALLOC_*_`` environment (glibc's tunables) is left as it is, and other C
libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt's parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Free heap above this is handed back to the kernel.
TRIM_THRESHOLD = 64 << 20
# Allocations of this size and more get mappings of their own (the index's tables at start, not
# the loop's batches and temporaries: a snapshot page's arrays are ~2 MiB).
MMAP_THRESHOLD = 4 << 20
ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_heap() -> str:
    """Set glibc's thresholds (see the module docstring). Returns what was done, for the log."""
    if platform.libc_ver()[0] != "glibc":
        return "not glibc: malloc left as it is"
    named = [name for name in ENVIRONMENT if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        named.append("GLIBC_TUNABLES")
    if named:
        return f"malloc left to the environment ({', '.join(named)})"
    libc = ctypes.CDLL(None)
    # mallopt returns 1 on success; setting either threshold also stops glibc from moving them.
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "mallopt refused the thresholds: malloc left as it is"
    return f"malloc keeps up to {TRIM_THRESHOLD >> 20} MiB of freed heap, maps {MMAP_THRESHOLD >> 20} MiB and more"

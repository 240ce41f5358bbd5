"""Freed memory kept for the next tensors instead of returned to the OS (glibc's malloc).

glibc serves a request of more than its mmap threshold (128 KiB, raised up to 32 MiB by what it has
seen) with a fresh mapping, and returns it on free; it also returns free space at the top of its heap
past a trim threshold. A prefill piece allocates the same large intermediates in every layer (SmolLM2
at 4,096 tokens: a 25 MB MLP product; Qwen2.5-Coder-0.5B: 80 MB), so each layer touched fresh pages
again: 370-420K page faults per 4K prefill for SmolLM2, 2.8-3.2M for Qwen 0.5B, whose kernel time
was 4.4-5.6 s of a 6.7-7.9 s prefill (session 31). With mmap off and no trimming, a freed block is
reused by the next request its size: the faults are paid once, at the peak.

The cost is that a process keeps its peak heap: what it frees goes back to its own malloc, not to the
OS. For a process that serves a model that is the working set anyway. TRIFORCE_REUSE_MEMORY=0 leaves
malloc as it is. Only glibc has these settings; elsewhere this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to 1 GiB; more goes back to the OS

_done: bool | None = None


def reuse_freed_memory() -> bool:
    """Once per process: malloc keeps freed blocks (no mmap for large requests, no trimming of the
    heap's top below TRIM_THRESHOLD). Whether it is in effect."""
    global _done
    if _done is None:
        _done = os.environ.get("TRIFORCE_REUSE_MEMORY", "1") != "0" and _mallopt()
    return _done


def _mallopt() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # no C library by that name, or no mallopt in it
        return False

"""Keeping freed memory in the process for the next step (glibc's malloc), as the tcmalloc that
vLLM's and IPEX's CPU guides preload does.

Why: every step allocates activations of megabytes to tens of megabytes (a 2048-token prefill
chunk's MLP output is 25 MB) and frees them at its end. glibc serves the largest with fresh
``mmap``s and gives the top of its heap back to the OS once more than its trim threshold is
free, so the next step faults the same memory in again and the kernel zeroes it page by page,
while the other torch threads wait at the op's barrier. Measured on the offline workload's
prefill (64 prompts, 9 200 tokens, 2 threads): 287 000-293 000 page faults and 0.5 s of system
time per 8-10 s round with glibc's defaults; none at all with the thresholds below.

The thresholds are glibc's ``mallopt`` settings: allocations up to ``MMAP_THRESHOLD`` come from
the heap, and the heap is trimmed only past ``TRIM_THRESHOLD``, so the process keeps its peak
working set (which a step needs anyway) instead of returning it after every step.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (half its 64 MB heap size)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the thresholds to this process's malloc, once; False where the C library is not
    glibc (musl, macOS) or refuses them (then its defaults stay, with a warning)."""
    global _applied
    if _applied is None:
        _applied = _set_thresholds()
    return _applied


def glibc_tunables() -> str:
    """The same thresholds as a ``GLIBC_TUNABLES`` value, for a process started from outside
    (the benchmarks give vLLM's CPU backend this in place of the tcmalloc its guide preloads)."""
    return f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on a value it rejects.
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
        return True
    logger.warning("glibc rejected the malloc thresholds: freed memory goes back to the OS after each step")
    return False

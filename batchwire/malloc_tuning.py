"""glibc's malloc: large blocks in mappings of their own, so that memory a burst of large requests
used goes back to the operating system when they end.

glibc serves a block of 128 KiB or more with ``mmap``, but the first time it frees such a block it
raises that threshold to the freed block's size (up to 32 MiB), and from then on large blocks come
from the heap, whose freed space it keeps: after a flood of large inputs and outputs the process
stays at its peak RSS. Setting the threshold once fixes it where it starts.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024


def keep_large_blocks_apart(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fixes glibc's mmap threshold at ``threshold_bytes``; False where the C library has no
    ``mallopt`` (not glibc) or the operator set ``MALLOC_MMAP_THRESHOLD_`` (theirs wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold_bytes)
    return done

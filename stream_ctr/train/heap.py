"""How a training process asks glibc's malloc to keep its heap between steps.

A step allocates and frees the same large tensors every time (activations and
their gradients: ~13 MB each for DeepFM at batch 8,192, ~105 MB at 65,536).
glibc serves a block above its mmap threshold (128 KiB, rising by itself to at
most 32 MiB) with fresh pages from the kernel, and gives free heap above its
trim threshold back: either way the next step faults its memory in again, page
by page.  Measured on the 2-vCPU EPYC, whole DeepFM steps in bf16: ~11,000
minor page faults a step at batch 8,192 (112-124 ms a step) against ~200 with
the heap kept (98 ms); at 65,536 ~88,000 faults and 1.33 s against ~30 and
0.77 s.  The price: up to `keep_bytes` of free heap stays with the process
(peak RSS +15% at 65,536 in that measurement).

Blocks larger than `MMAP_THRESHOLD_BYTES` (a big embedding table being grown)
still get their own mapping, so freeing one returns it to the system at once.
"""
from __future__ import annotations

import ctypes
import logging
import sys

from stream_ctr.config import HEAP_KEEP_MIN_BYTES

log = logging.getLogger("stream_ctr.train")

M_TRIM_THRESHOLD = -1           # mallopt parameters (glibc malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 << 20
# Older glibc refuses an mmap threshold above 32 MiB: then 32 MiB.
_GLIBC_MMAP_MAX_BYTES = 32 << 20
_C_INT_MAX = (1 << 31) - 1


def keep_heap(keep_bytes: int) -> bool:
    """Let up to `keep_bytes` of freed heap stay with the process and serve blocks up
    to `MMAP_THRESHOLD_BYTES` from the heap (glibc on Linux; elsewhere, or with
    `keep_bytes` 0, nothing changes).  Returns whether glibc took both settings."""
    if keep_bytes <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):       # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    keep = max(keep_bytes, HEAP_KEEP_MIN_BYTES)      # below it: more faults than the default
    mmap_ok = (mallopt(M_MMAP_THRESHOLD, min(MMAP_THRESHOLD_BYTES, keep)) == 1
               or mallopt(M_MMAP_THRESHOLD, _GLIBC_MMAP_MAX_BYTES) == 1)
    trim_ok = mallopt(M_TRIM_THRESHOLD, min(keep, _C_INT_MAX)) == 1
    if not (mmap_ok and trim_ok):
        log.debug("malloc refused %s (mallopt returned 0)",
                  " and ".join(n for n, ok in (("the mmap threshold", mmap_ok),
                                               ("the trim threshold", trim_ok)) if not ok))
    return mmap_ok and trim_ok

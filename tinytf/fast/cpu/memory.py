"""Keep freed memory in the process, so that each training step's fresh arrays do not
page-fault.

A training step allocates and frees the same large arrays every time (activations,
gradients, attention weights: megabytes each). glibc's ``malloc`` gives memory back to the
operating system eagerly: arrays above its ``mmap`` threshold get pages of their own, which
``free`` unmaps, and the heap's free top is trimmed once it exceeds the trim threshold. The
threshold adapts to the sizes freed, but only up to 32 MB, and each trim resets the cycle;
the next step then touches fresh pages, each a page fault in which the kernel zeroes 4 KB.
With 4,096-token batches on the ``tiny`` model that is about 100,000 faults per step.

:func:`keep_freed_memory` sets the two thresholds once (``mallopt``): arrays up to 32 MB
(the largest value glibc accepts) come from the heap, and the heap is never trimmed, so the
process keeps the pages of its largest step and reuses them. The cost is that memory freed
after that peak stays with the process until it exits (the peak itself is unchanged).
The commands call :func:`keep_by_default` when they start (``import tinytf`` changes
nothing): on Linux with glibc, unless ``TINYTF_KEEP_MEMORY=0`` or the user has tuned
``malloc`` already (``GLIBC_TUNABLES`` naming it, or a ``MALLOC_*`` variable). A library
user opts in by calling :func:`keep_freed_memory` (or :func:`keep_by_default`).
Figures: docs/architecture.md, "Freed memory".
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1          # mallopt's parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20      # glibc's largest: HEAP_MAX_SIZE / 2 on 64-bit systems
TRIM_THRESHOLD = (1 << 31) - 1  # the largest int: never trim

_kept = False


def user_tuned_malloc(environ=os.environ) -> bool:
    """True if the environment already tunes glibc's malloc (then it is left alone)."""
    return "glibc.malloc" in environ.get("GLIBC_TUNABLES", "") or any(
        name.startswith("MALLOC_") for name in environ)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold to 32 MB and switch heap trimming off; True if set
    (False off Linux/glibc or where ``mallopt`` refuses). Idempotent."""
    global _kept
    if _kept:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):       # a C library without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def kept() -> bool:
    """Whether :func:`keep_freed_memory` has set the thresholds in this process."""
    return _kept


def keep_by_default(environ=os.environ) -> bool:
    """What the commands do when they start: :func:`keep_freed_memory` unless
    ``TINYTF_KEEP_MEMORY=0`` or :func:`user_tuned_malloc`."""
    if environ.get("TINYTF_KEEP_MEMORY", "1") == "0" or user_tuned_malloc(environ):
        return False
    return keep_freed_memory()

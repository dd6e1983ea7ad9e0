"""Keeping a long-running peer's heap from growing: glibc malloc settings for big, short-lived tensors.

A peer allocates and frees tensors of a fragment's size all the time (deltas, merged gradients, new
replica tensors). glibc raises its mmap threshold each time such a block is freed (up to 32 MiB), after
which big blocks come from the heap and freed ones are kept there: the process's memory creeps up with
the number of updates applied, though nothing is referenced. `bound_heap` fixes the threshold (blocks of
1 MiB or more are mapped and unmapped, so freeing returns them to the system), trims the heap above
1 MiB and caps the malloc arenas at 2 (one per busy thread otherwise). A no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
THRESHOLD_BYTES = 1 << 20


def bound_heap() -> bool:
    """Apply the settings above to this process; False where they cannot be (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1
    ok &= mallopt(M_ARENA_MAX, 2) == 1
    return bool(ok)

"""Keep the memory a long-lived rank process frees, instead of handing it back to the kernel.

glibc's malloc serves every allocation above its mmap threshold (32 MB at most) with a fresh
``mmap`` and unmaps it on ``free``; a thread's allocations go to a per-thread arena that does the
same for anything that does not fit its 64 MB heap. torch's CPU tensors are plain ``malloc``
allocations, so a training step that allocates the same 64 MB gradients and temporaries on every
call faults every page of them in again, zero-filled by the kernel, on every call. On the
development machine (a virtual machine) that zero-filling was a third of the CPU time of the
seed tests' 84M-parameter steps (``perf``: ``clear_page_erms`` under ``asm_exc_page_fault``).

:func:`retain_freed_memory` sets, through ``mallopt``, one arena for all threads, no ``mmap``
for large blocks (they come from the heap, where freed blocks are reused), and a trim threshold
(free memory at the top of the heap above it is still returned). A process that calls it keeps
its peak heap for its life (minus what it trims): for processes that run many jobs, such as
:class:`~spmd_backend.testing.ranks.RankPool`'s workers, and not for users' training processes
(that is their allocator's business). Requires glibc; elsewhere it does nothing and says so.
Call it before the process allocates much: memory already mapped keeps its arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

#: the default trim threshold: free memory at the top of the heap beyond it goes back
DEFAULT_TRIM_BYTES = 1 << 30


def retain_freed_memory(trim_bytes: int = DEFAULT_TRIM_BYTES) -> bool:
    """Make this process's malloc reuse freed large blocks; True where glibc accepted it."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("retain_freed_memory: no mallopt in this C library (%s); nothing changed", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    limit = min(int(trim_bytes), 2**31 - 1)  # mallopt takes an int
    ok = all(
        mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, limit))
    )
    if not ok:
        log.info("retain_freed_memory: mallopt refused a setting; the allocator may be mixed")
    return ok

"""Give the heap that tracing and compiling freed back to the operating system.

Tracing a step (fake tensors, functionalization, fx nodes and their metadata), running the
passes and lowering make many short-lived allocations. glibc's allocator keeps what they free
in the process's heap, so after a compile the resident set stays several hundred MB above what
is live (measured on the seed MLP: 1014 MB resident after the first calls against 565 MB once
returned, DDP 639 MB; steady-step peak 755 against DDP's 725 MB). :func:`release_freed_heap`
asks glibc to return it (``malloc_trim(0)``): once per compile, which costs a few milliseconds.

Requires nothing; guarantees nothing is freed that is still in use (``malloc_trim`` only returns
free pages) and a no-op returning ``False`` where the C library has no ``malloc_trim`` (musl,
macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_heap() -> bool:
    """Return freed heap memory to the OS; ``True`` when the C library could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


__all__ = ["release_freed_heap"]

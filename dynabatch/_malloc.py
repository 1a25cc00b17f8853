"""Handing freed C-heap memory back to the operating system: :func:`trim`.

A burst of short-lived allocations (a tokenizer's per-chunk Python lists and
encodings, a shard's Parquet buffers) leaves glibc's heap, and Arrow's memory
pool, holding free memory they do not return by themselves, so the process's
resident memory stays at the burst's peak. glibc's ``malloc_trim(0)`` and the
pool's ``release_unused`` return it; elsewhere (macOS, musl, Windows) only the
latter runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

__all__ = ["trim"]


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim() -> None:
    """Returns the free memory of the C heap (glibc) and of Arrow's allocator, when pyarrow is loaded, to the
    operating system: a few milliseconds.

    Example:
        >>> from dynabatch._malloc import trim
        >>> trim()
    """
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:  # Arrow keeps freed buffers in its own pool (jemalloc or mimalloc) otherwise
        arrow.default_memory_pool().release_unused()
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)

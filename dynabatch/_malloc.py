"""Handing freed C-heap memory back to the operating system: :func:`trim`.

A burst of short-lived allocations (a tokenizer's per-chunk Python lists and
encodings, a shard's Parquet buffers) leaves glibc's heap holding free memory
that it does not return by itself, so the process's resident memory stays at
the burst's peak. glibc's ``malloc_trim(0)`` returns it; elsewhere (macOS, musl,
Windows) :func:`trim` does nothing.
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
    """Returns the free memory of the C heap to the operating system (glibc), a few milliseconds; else nothing.

    Example:
        >>> from dynabatch._malloc import trim
        >>> trim()
    """
    malloc_trim = _malloc_trim()
    if malloc_trim is not None:
        malloc_trim(0)

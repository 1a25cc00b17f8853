"""The one out-of-memory guard: call, measure, catch out-of-memory, free memory.

:func:`call_guarded` runs one call and returns an :class:`Attempt`: its output
and (when asked) its peak memory, or the out-of-memory error it raised. Any
other error propagates. After an out-of-memory error the error's traceback is
dropped (it holds the failed call's tensors) and memory is freed, so the
caller can retry smaller at once. :func:`dynabatch.run`, the profiling of
:func:`~dynabatch.memory.measure.collect_peak_alloc` and
``train_classifier/generate_training_data.py`` all go through it.

Example:
    >>> import torch
    >>> from dynabatch.memory.guard import call_guarded
    >>> ok = call_guarded(lambda n: torch.zeros(n, 128).sum(), 4, measure_on="cpu")
    >>> ok.error is None, ok.peak_bytes
    (True, 2560)
    >>> failed = call_guarded(lambda n: torch.zeros(n, 128).sum(), 4, measure_on="cpu", limit_bytes=1024)
    >>> type(failed.error).__name__, failed.output
    ('OutOfMemoryError', None)
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Attempt", "call_guarded", "free_memory", "is_out_of_memory_error"]

_CPU_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory_error(exc: BaseException) -> bool:
    """Tells whether ``exc`` is an out-of-memory error of CUDA or of the CPU allocator."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CPU_OOM_MESSAGES)


def free_memory() -> None:
    """Collects garbage and returns CUDA's cached blocks (when CUDA is available)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Attempt:
    """What :func:`call_guarded` got: the output and peak bytes, or the out-of-memory error."""

    output: Any = None
    peak_bytes: int | None = None
    error: BaseException | None = None


def call_guarded(
    fn: Callable[..., Any],
    *args: Any,
    measure_on: Any = None,
    limit_bytes: int | None = None,
    prepare: Callable[[Any], Any] | None = None,
    finish: Callable[[Any], Any] | None = None,
    cleanup: Callable[[], None] | None = None,
    free_after: bool = False,
) -> Attempt:
    """Calls ``fn(*args)``; an out-of-memory error is returned in the :class:`Attempt`, never raised.

    Args:
        fn: the work.
        *args: its arguments (``prepare`` maps the first one, e.g. moves a batch to a device).
        measure_on: ``None``, or the device to measure ``fn``'s peak memory on
            (:func:`~dynabatch.memory.measure.track_peak_memory`); only ``fn`` is measured.
        limit_bytes: CPU only: a simulated device of this many free bytes.
        prepare: applied to the first argument before the call, outside the measurement.
        finish: applied to the output after the call, outside the measurement (its
            out-of-memory errors are caught too).
        cleanup: called after the call, whatever happened (drops references the work holds).
        free_after: free memory after every call, not only after an out-of-memory error.

    Returns:
        ``Attempt(output, peak_bytes, None)``, or ``Attempt(None, None, error)``
        after an out-of-memory error (its traceback dropped, memory freed).
    """
    from dynabatch.memory.measure import track_peak_memory

    error = None
    try:
        if prepare is not None and args:
            args = (prepare(args[0]), *args[1:])
        if measure_on is not None:
            with track_peak_memory(measure_on, limit_bytes=limit_bytes) as mem:
                output = fn(*args)
            peak = mem.peak_bytes
        else:
            output, peak = fn(*args), None
        if finish is not None:
            output = finish(output)
    except Exception as exc:
        if not is_out_of_memory_error(exc):
            raise
        error = exc.with_traceback(None)  # the traceback's frames hold the failed call's tensors
    finally:
        args = ()
        if cleanup is not None:
            cleanup()
    if error is not None:
        free_memory()
        return Attempt(error=error)
    if free_after:
        free_memory()
    return Attempt(output, peak)

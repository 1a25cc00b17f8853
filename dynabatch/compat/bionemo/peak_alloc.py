"""bionemo's ``collect_cuda_peak_alloc``, and :func:`collect_peak_alloc`, its API on the CPU too.

Both run a piece of work on every item of a dataset and record its peak
memory, through :mod:`dynabatch.memory.device`'s backends and
:mod:`dynabatch.memory.oom`'s guard: bionemo's function records the CUDA
allocator's absolute peak and skips items that run out of memory; dynabatch's
records the peak beyond what was allocated before (on CUDA or the CPU) and
keeps such items with ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.memory.device import backend_of, free_memory, is_out_of_memory_error
from dynabatch.memory.measure import check_measurable_device
from dynabatch.memory.oom import call_guarded

__all__ = ["collect_cuda_peak_alloc", "collect_peak_alloc"]

logger = logging.getLogger(__name__)

Data = TypeVar("Data")
Feature = TypeVar("Feature")


def collect_peak_alloc(
    dataset: Iterable[Data],
    work: Callable[[Data], Feature],
    device: str | torch.device,
    cleanup: Callable[[], None] | None = None,
) -> tuple[list[Feature | None], list[int | None]]:
    """Runs ``work`` on every item and records its peak activation memory.

    The API of bionemo's ``collect_cuda_peak_alloc``, on CUDA and on the CPU.
    An item whose ``work`` runs out of memory is kept in place: its feature and
    its peak are ``None`` (a warning is logged), so both lists stay aligned with
    ``dataset``. Any other error propagates. ``cleanup`` runs after every item,
    in a ``finally`` block, before garbage collection.

    Args:
        dataset: the items to run.
        work: does the work for one item and returns its feature.
        device: where ``work`` runs (``cpu`` or ``cuda``).
        cleanup: called after each item to drop references ``work`` holds.

    Returns:
        ``(features, peaks)``, one entry per item; peaks are bytes.

    Example:
        >>> import torch
        >>> from dynabatch.compat.bionemo import collect_peak_alloc
        >>> feats, peaks = collect_peak_alloc([1, 4], lambda n: torch.zeros(n, 128).sum().item() + n, "cpu")
        >>> feats, peaks
        ([1.0, 4.0], [1024, 2560])
    """
    dev = check_measurable_device("device", device)
    if not callable(work):
        raise bad_type("work", "a callable", work)
    if cleanup is not None and not callable(cleanup):
        raise bad_type("cleanup", "a callable or None", cleanup)
    features: list[Feature | None] = []
    peaks: list[int | None] = []
    for position, data in enumerate(dataset):
        attempt = call_guarded(work, data, measure_on=dev, cleanup=cleanup, free_after=True)
        if attempt.error is not None:
            logger.warning("item %d ran out of memory; recorded with peak None: %s", position, attempt.error)
        features.append(attempt.output)
        peaks.append(attempt.peak_bytes)
    return features, peaks


def collect_cuda_peak_alloc(
    dataset: Iterable[Data],
    work: Callable[[Data], Feature],
    device: torch.device,
    cleanup: Callable[[], None] | None = None,
) -> tuple[list[Feature], list[int]]:
    """Collects CUDA peak memory allocation statistics for a given workflow (bionemo's API).

    For every item, the CUDA peak statistics are reset, ``work(item)`` runs and
    the allocator's ``allocated_bytes.all.peak`` (``max_memory_allocated``) is recorded:
    the *absolute* peak, weights and optimizer state included (as bionemo does;
    :func:`collect_peak_alloc` records the peak beyond what was allocated before,
    on CUDA or the CPU). An item whose ``work`` raises
    runs out of memory is skipped (logged as a warning), so both
    lists hold only the items that ran. After every item, in a ``finally``
    block: ``cleanup()``, garbage collection, emptying the allocator's cache and a
    reset of the peak statistics. The first items may show smaller peaks
    (uninitialised internal buffers); consider skipping them.

    Args:
        dataset: An iterable containing the input data.
        work: A function that takes a data point and returns its feature; the
            memory it allocates is tracked.
        device: The target Torch CUDA device.
        cleanup: A function called after each iteration to drop references held
            by ``work``.

    Returns:
        ``(features, alloc_peaks)``: the features and peak bytes of the items that ran.

    Raises:
        ValueError: If the provided device is not a CUDA device.

    Example:
        >>> from dynabatch.compat.bionemo import collect_cuda_peak_alloc
        >>> collect_cuda_peak_alloc([1], lambda n: n, torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: device should be a CUDA device, but got device=device(type='cpu')
    """
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise bad_value("device", "a CUDA device", device) from None
    if dev.type != "cuda":
        raise bad_value("device", "a CUDA device", device)
    if not callable(work):
        raise bad_type("work", "a callable", work)
    if cleanup is not None and not callable(cleanup):
        raise bad_type("cleanup", "a callable or None", cleanup)
    cuda = backend_of(dev)
    features: list[Feature] = []
    alloc_peaks: list[int] = []
    for position, data in enumerate(dataset):
        try:
            cuda.reset_peak(dev)
            feature = work(data)
            alloc_peaks.append(cuda.max_allocated(dev))
            features.append(feature)
        except Exception as error:
            if not is_out_of_memory_error(error):
                raise
            logger.warning("item %d ran out of CUDA memory; skipped: %s", position, error)
        finally:
            del data
            feature = None
            if cleanup is not None:
                cleanup()
            free_memory()
            cuda.reset_peak(dev)
    return features, alloc_peaks

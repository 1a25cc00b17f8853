"""Peak activation memory of a block of work, on an accelerator or on the CPU.

*Peak activation memory* is the most memory the block had allocated at any one
time beyond what was allocated before it started: weights, persistent buffers
and inputs already placed on the device are not counted.

* CUDA (and XPU): the caching allocator's statistics (peak reset, allocated
  before, maximum allocated after);
* CPU: a dispatch-mode tracker of tensor storages (see ``_storage_tracker``),
  rounded to CUDA's 512-byte blocks; deterministic for a given call.

Both are the trackers of :mod:`dynabatch.memory.device`'s backends.

Example:
    >>> import torch
    >>> from dynabatch.memory.measure import track_peak_memory
    >>> weight = torch.ones(256, 256)
    >>> with track_peak_memory("cpu") as mem:
    ...     out = (weight @ weight).relu()
    >>> mem.peak_bytes  # two 256x256 float32 results, weights not counted
    524288
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.memory.device import backend_of, backends, free_memory, is_out_of_memory_error, known_backend
from dynabatch.memory.oom import call_guarded

__all__ = [
    "PeakMemory",
    "check_device",
    "check_measurable_device",
    "collect_cuda_peak_alloc",
    "collect_peak_alloc",
    "is_out_of_memory_error",
    "track_peak_memory",
]

logger = logging.getLogger(__name__)

Data = TypeVar("Data")
Feature = TypeVar("Feature")


@dataclass
class PeakMemory:
    """What :func:`track_peak_memory` measured; ``peak_bytes`` is set when the block ends.

    :meth:`mark` splits the block into segments (e.g. one per decoding step of
    ``generate``): ``segment_peaks`` holds each segment's peak, in bytes beyond
    what was allocated when the block started, the last one appended when the
    block ends; ``peak_bytes`` is their maximum.
    """

    device: torch.device
    peak_bytes: int | None = None
    segment_peaks: list[int] = field(default_factory=list)
    _mark: Callable[[], int] | None = field(default=None, repr=False, compare=False)

    def mark(self) -> None:
        """Ends the current segment (its peak goes to ``segment_peaks``); a new one starts at the bytes held now."""
        if self._mark is None:
            raise RuntimeError("PeakMemory.mark() should be called inside its track_peak_memory block")
        self.segment_peaks.append(self._mark())


def _parse_device(name: str, value: Any, rule: str) -> torch.device:
    if not isinstance(value, (str, torch.device)):
        raise bad_type(name, rule, value)
    try:
        return torch.device(value)
    except RuntimeError:
        raise bad_value(name, "a valid torch device such as 'cpu' or 'cuda:0'", value) from None


def check_device(name: str, value: Any, rule: str = "a str or torch.device") -> torch.device:
    """``value`` as a :class:`torch.device` that this machine has; else an error naming ``name``.

    Refuses, before any work starts, what would fail later inside torch: a
    string torch cannot parse (``"gpu"``) and an accelerator this machine does
    not have (torch raises a bare ``AssertionError`` when a tensor is moved there).

    Raises:
        TypeError: ``value`` is not a str or torch.device (``rule`` says what is).
        ValueError: torch cannot parse it, or the device is not available here.
    """
    dev = _parse_device(name, value, rule)
    if dev.type in ("cpu", "meta"):
        return dev
    backend = known_backend(dev.type)
    if backend is None:  # a type without a backend: torch's own check, where its module has one
        available = getattr(getattr(torch, dev.type, None), "is_available", None)
        if callable(available) and not available():
            raise bad_value(name, f"an available device (torch.{dev.type}.is_available() is False)", value)
        return dev
    if not backend.available():
        raise bad_value(name, f"an available device (torch.{dev.type}.is_available() is False: no "
                        f"{dev.type.upper()} device here)", value)
    count = backend.count()
    if dev.index is not None and dev.index >= count:
        raise bad_value(name, f"an available device (this machine has {count} {dev.type.upper()} device(s), "
                        f"{dev.type}:0 to {dev.type}:{count - 1})", value)
    return dev


def check_measurable_device(name: str, value: Any, rule: str = "a str or torch.device") -> torch.device:
    """:func:`check_device` for a device whose memory can be measured (the CPU, CUDA, XPU).

    A bare ``"cuda"`` becomes the current device of its type (``cuda:0``).
    """
    dev = _parse_device(name, value, rule)
    backend = known_backend(dev.type)
    if backend is None or not backend.measurable:
        measurable = ", ".join(repr(b.type) for b in backends() if b.measurable)
        raise bad_value(name, f"a device whose memory can be measured ({measurable})", value)
    check_device(name, value, rule)
    return backend.current() if dev.index is None and dev.type != "cpu" else dev


@contextlib.contextmanager
def track_peak_memory(device: str | torch.device = "cpu", *, limit_bytes: int | None = None) -> Iterator[PeakMemory]:
    """Measures the peak activation memory of the block it wraps.

    Args:
        device: a device whose memory can be measured (``cpu``, ``cuda``,
            ``xpu``); the block's work must run there.
        limit_bytes: CPU only. Raise :class:`torch.OutOfMemoryError` as soon as
            the block holds more than this many bytes, as a device with that
            much free memory would.

    Yields:
        A :class:`PeakMemory` whose ``peak_bytes`` is filled in when the block
        ends (also when it raises).

    Raises:
        ValueError: for a device that cannot be measured, or ``limit_bytes`` off the CPU.
    """
    dev = check_measurable_device("device", device)
    result = PeakMemory(dev)
    if limit_bytes is not None:
        limit_bytes = check_positive_int("limit_bytes", limit_bytes)
    tracker = backend_of(dev).peak_tracker(dev, limit_bytes)
    result._mark = tracker.mark
    try:
        with tracker:
            yield result
    finally:
        result._mark = None
        result.segment_peaks.append(tracker.segment_peak_bytes)
        result.peak_bytes = tracker.peak_bytes


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
        >>> from dynabatch.memory.measure import collect_peak_alloc
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
        >>> from dynabatch.memory.measure import collect_cuda_peak_alloc
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

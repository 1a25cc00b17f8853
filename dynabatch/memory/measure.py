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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.memory.device import backend_of, backends, is_out_of_memory_error, known_backend

__all__ = [
    "PeakMemory",
    "check_device",
    "check_measurable_device",
    "is_out_of_memory_error",
    "track_peak_memory",
]


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

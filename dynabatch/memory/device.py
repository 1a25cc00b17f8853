"""The one device layer: every call dynabatch makes about a device's memory goes through here.

A backend per device type (``torch.device(...).type``) answers the same
questions: is the device here and which one is current, is memory held there,
synchronize, free and total bytes (and whether they are the device's own, what
a budget can be a share of), the peak-memory tracker of a block of work, a cap
on what this process may hold, empty the cache, and is an exception an
out-of-memory error of that device.

* ``cuda`` (:class:`CudaBackend`; ROCm builds of torch go through ``torch.cuda``
  too) and ``xpu`` (:class:`XpuBackend`): the caching allocator's statistics
  (:class:`AllocatorBackend`: peak reset, allocated bytes, ``mem_get_info``);
* ``mps`` (:class:`MpsBackend`): free and total bytes and the cache; torch
  keeps no peak statistics for it, so its peaks cannot be measured;
* ``cpu`` (:class:`CpuBackend`): the storage tracker
  (:mod:`~dynabatch.memory._storage_tracker`) measures peaks, with a
  simulated limit (``limit_bytes``) if asked; free bytes are the system's
  available memory, which is no device's own, except inside
  :func:`simulated_memory`: a device of a declared size, which runs out of
  memory beyond it (how the planner is checked to fill a device without one).

Each backend also moves a batch's tensors to its device (:meth:`DeviceBackend.copier`): a plain copy, or on CUDA
and XPU a :class:`StreamCopier` (a copy stream of its own, the compute stream waiting on its event), and tells
device failures (:meth:`DeviceBackend.is_device_failure`: the device or its context is lost) from other errors.

Adding a device type is one class here, registered with :func:`register_backend`
(a backend over torch's allocator statistics is a subclass of
:class:`AllocatorBackend` naming its type). Nothing else in dynabatch calls
``torch.cuda`` (or another device module) about memory.

Free memory is computed once, by :func:`free_bytes`: what the driver has free
plus what the caching allocator holds without using it, since a call can reuse
that. A device without index (``cuda``) means the current device of its type
(:meth:`DeviceBackend.indexed`), also for the functions of torch that refuse it.

Example:
    >>> import torch
    >>> backend_of("cpu").type, is_out_of_memory_error(torch.OutOfMemoryError("CUDA out of memory"))
    ('cpu', True)
    >>> is_out_of_memory_error(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"))
    True
    >>> with backend_of("cpu").peak_tracker(torch.device("cpu")) as tracker:
    ...     _ = torch.ones(256, 256) * 2
    >>> tracker.peak_bytes  # two 256 x 256 float32 tensors
    524288
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.memory._storage_tracker import StorageTracker

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "AllocatorBackend",
    "AllocatorPeakTracker",
    "Copier",
    "CpuBackend",
    "CudaBackend",
    "DeviceBackend",
    "MpsBackend",
    "StreamCopier",
    "XpuBackend",
    "backend_of",
    "backends",
    "causes",
    "copier",
    "default_accelerator",
    "default_device",
    "device_count",
    "device_in_use",
    "free_bytes",
    "free_memory",
    "is_device_failure",
    "is_out_of_memory_error",
    "known_backend",
    "knows_memory",
    "make_current",
    "measurable",
    "pins_memory",
    "register_backend",
    "simulated_memory",
    "total_bytes",
]

_BACKENDS: dict[str, DeviceBackend] = {}


def register_backend(cls: type[DeviceBackend]) -> type[DeviceBackend]:
    """Registers a backend class for its ``type`` (a class decorator); a later one replaces an earlier one."""
    if not (isinstance(cls, type) and issubclass(cls, DeviceBackend)) or not cls.type:
        raise bad_type("cls", "a DeviceBackend subclass with a type", cls)
    _BACKENDS[cls.type] = cls()
    return cls


def backends() -> list[DeviceBackend]:
    """Every registered backend, the CPU's last."""
    return sorted(_BACKENDS.values(), key=lambda b: b.type == "cpu")


class DeviceBackend:
    """What dynabatch asks of one device type. Subclasses set :attr:`type` and override what differs."""

    type: ClassVar[str] = ""
    """The ``torch.device`` type this backend answers for."""
    out_of_memory_messages: ClassVar[tuple[str, ...]] = ()
    """Texts of this device's out-of-memory errors raised as a plain ``RuntimeError``."""
    measurable: ClassVar[bool] = False
    """Whether :meth:`peak_tracker` can measure a block's peak here."""
    pinned_copies: ClassVar[bool] = False
    """Whether batches copy here asynchronously from pinned host memory (``non_blocking``)."""
    cappable: ClassVar[bool] = False
    """Whether :meth:`capped` can hold this process under a limit here."""
    failure_messages: ClassVar[tuple[str, ...]] = ()
    """Texts of this device's runtime errors (a lost device, a corrupted context) raised as a ``RuntimeError``."""

    def module(self) -> Any:
        """torch's module of this device type (``torch.cuda``), or ``None``."""
        return getattr(torch, self.type, None)

    def _call(self, name: str, *args: Any, default: Any = None) -> Any:
        fn = getattr(self.module(), name, None)
        return fn(*args) if callable(fn) else default

    def available(self) -> bool:
        """Whether a device of this type is here."""
        return bool(self._call("is_available", default=False))

    def count(self) -> int:
        """How many devices of this type are here."""
        return int(self._call("device_count", default=0)) if self.available() else 0

    def current(self) -> torch.device:
        """The current device of this type, with its index when it has one."""
        index = self._call("current_device")
        return torch.device(self.type) if index is None else torch.device(self.type, int(index))

    def in_use(self) -> bool:
        """Whether this process holds memory on the current device (a model was moved there)."""
        return False

    def make_current(self, device: torch.device) -> None:
        """Makes ``device`` the calling thread's current device of its type (a worker thread per device)."""
        if device.index is not None:
            self._call("set_device", device)

    def synchronize(self, device: torch.device) -> None:
        """Waits for the device's queued work."""

    def empty_cache(self) -> None:
        """Returns the allocator's cached, unused blocks to the device."""

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        """Bytes free for this process on ``device`` and its total bytes."""
        raise bad_value("device", f"a device whose free memory torch reports (not {self.type})", str(device))

    def knows_memory(self) -> bool:
        """Whether this device's free and total memory are its own (a budget can be a share of them): an
        accelerator's are; the CPU's are the whole system's, shared with everything else, unless simulated."""
        return self.type != "cpu"

    def indexed(self, device: torch.device) -> torch.device:
        """``device`` with its index: a bare ``cuda`` is the current device of its type (some of torch's
        functions refuse a device without index)."""
        if device.index is not None:
            return device
        index = self.current().index
        return device if index is None else torch.device(device.type, index)

    def peak_tracker(self, device: torch.device, limit_bytes: int | None = None) -> Any:
        """A context manager measuring the peak bytes a block allocates on ``device`` beyond what it held
        before: ``mark()`` ends a segment and returns its peak; ``segment_peak_bytes`` (the last segment's)
        and ``peak_bytes`` are read after the block."""
        raise bad_value("device", "a device whose memory can be measured "
                        f"({', '.join(repr(b.type) for b in backends() if b.measurable)})", str(device))

    def prime_peak_tracker(self, device: torch.device) -> None:
        """Pays ahead what this process's first :meth:`peak_tracker` costs once (nothing here), so that the first
        measured call of a run, timed as the device's, does not."""

    def capped(self, device: torch.device, limit_bytes: float) -> contextlib.AbstractContextManager[None]:
        """A context in which this process may hold at most ``limit_bytes`` on ``device``: beyond, an allocation
        raises the device's out-of-memory error, as on a device of that size."""
        raise bad_value("device", "a device whose memory can be capped "
                        f"({', '.join(repr(b.type) for b in backends() if b.cappable)})", str(device))

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this device's out-of-memory error."""
        return isinstance(exc, RuntimeError) and any(m in str(exc) for m in self.out_of_memory_messages)

    def is_device_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` says this device (or its context) failed, rather than the work on it: an error of
        the device's runtime (:data:`failure_messages`), never an out-of-memory error."""
        return isinstance(exc, RuntimeError) and any(m in str(exc) for m in self.failure_messages) \
            and not self.is_out_of_memory(exc)

    def copier(self, device: torch.device) -> Copier:
        """What moves a batch's tensors to ``device`` (:class:`Copier`: ``tensor.to(device)``)."""
        return Copier(device, non_blocking=False)


class AllocatorPeakTracker:
    """A block's peak bytes from a caching allocator's statistics (reset the peak, read allocated and the peak).

    The allocator keeps one peak per device, which every reset clears: a tracker opened inside another
    (a measured ``run`` inside a measured job) would wipe the outer block's peak so far. So every
    reset through :meth:`AllocatorBackend.reset_peak` first hands the peak so far to each tracker still
    open on that device (:attr:`seen`), and a tracker's peak is the larger of that and the allocator's.
    """

    def __init__(self, backend: AllocatorBackend, device: torch.device) -> None:
        self.backend, self.device = backend, device
        self.before = 0
        self.seen = 0  # the highest allocated bytes of this segment that a reset inside it cleared
        self.segment_peak_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> Self:
        b = self.backend
        b.synchronize(self.device)
        b.reset_peak(self.device)
        self.before = b.allocated(self.device)
        b.open_tracker(self)
        return self

    def _segment(self) -> int:
        peak = max(0, max(self.seen, self.backend.max_allocated(self.device)) - self.before)
        self.peak_bytes = max(self.peak_bytes, peak)
        return peak

    def mark(self) -> int:
        """Ends a segment and returns its peak; the next one starts at what is held now."""
        # The allocator counts allocations as the host asks for them: no synchronization needed here.
        peak = self._segment()
        self.backend.reset_peak(self.device)
        self.seen = 0
        return peak

    def __exit__(self, *exc: object) -> None:
        try:
            self.backend.synchronize(self.device)
            self.segment_peak_bytes = self._segment()
        finally:
            self.backend.close_tracker(self)


class Copier:
    """Moves a batch's tensors to ``device`` (``tensor.to(device)``; ``non_blocking`` from pinned host memory where
    the device copies asynchronously); other values are kept as they are."""

    def __init__(self, device: torch.device, *, non_blocking: bool) -> None:
        self.device, self.non_blocking = device, non_blocking

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {key: value.to(self.device, non_blocking=self.non_blocking) if isinstance(value, torch.Tensor)
                else value for key, value in tensors.items()}


class StreamCopier(Copier):
    """Copies on a stream of its own (``module``: ``torch.cuda`` or ``torch.xpu``), so a batch's copy never queues
    behind the compute before it.

    The device's current (compute) stream waits for the copy through an event, not the host; each copied tensor is
    recorded as used by the compute stream (``record_stream``), so the caching allocator does not hand its memory to
    another copy while the compute that reads it may still run. The pinned host buffers are kept until their copy
    is done by torch's pinned-memory allocator, which records the copy stream's use of them.
    """

    def __init__(self, module: Any, device: torch.device) -> None:
        super().__init__(device, non_blocking=True)
        self.module = module
        self.stream = module.Stream(device=device)

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        compute = self.module.current_stream(self.device)
        with self.module.stream(self.stream):
            moved = super().__call__(tensors)
            copied = self.stream.record_event()
        compute.wait_event(copied)
        for value in moved.values():
            if isinstance(value, torch.Tensor) and value.device.type == self.device.type:
                value.record_stream(compute)
        return moved


_OPEN_TRACKERS: dict[torch.device, list[AllocatorPeakTracker]] = {}  # by device: the trackers open on it
_TRACKERS_LOCK = threading.Lock()  # a worker thread per device opens and closes trackers


class AllocatorBackend(DeviceBackend):
    """A device whose torch module keeps caching-allocator statistics (``torch.cuda``'s functions)."""

    measurable = True
    pinned_copies = True
    cappable = True

    def allocated(self, device: torch.device) -> int:
        return int(self._call("memory_allocated", device, default=0))

    def max_allocated(self, device: torch.device) -> int:
        return int(self._call("max_memory_allocated", device, default=0))

    def open_tracker(self, tracker: AllocatorPeakTracker) -> None:
        """Counts ``tracker`` as open on its device until :meth:`close_tracker`: resets hand it their peak."""
        with _TRACKERS_LOCK:
            _OPEN_TRACKERS.setdefault(self.indexed(tracker.device), []).append(tracker)

    def close_tracker(self, tracker: AllocatorPeakTracker) -> None:
        """Ends what :meth:`open_tracker` began."""
        with _TRACKERS_LOCK:
            trackers = _OPEN_TRACKERS.get(self.indexed(tracker.device), [])
            if tracker in trackers:
                trackers.remove(tracker)

    def reset_peak(self, device: torch.device) -> None:
        """Resets the device's peak statistic, handing the peak so far to the trackers open on it first."""
        if not self._call("is_initialized", default=True):
            self.synchronize(device)  # torch refuses a peak reset before its allocator is set up ("did you call init?")
        with _TRACKERS_LOCK:
            trackers = list(_OPEN_TRACKERS.get(self.indexed(device), ()))
        if trackers:
            peak = self.max_allocated(device)
            for tracker in trackers:
                tracker.seen = max(tracker.seen, peak)
        self._call("reset_peak_memory_stats", device)

    def in_use(self) -> bool:
        if not self.available() or not self._call("is_initialized", default=True):
            return False
        return self.allocated(self.current()) > 0

    def synchronize(self, device: torch.device) -> None:
        self._call("synchronize", device)

    def empty_cache(self) -> None:
        if self.available():
            self._call("empty_cache")

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        info = self._call("mem_get_info", device)
        if info is None:  # a torch too old to report it
            return super().free_and_total(device)
        free, total = info
        unused_cache = int(self._call("memory_reserved", device, default=0)) - self.allocated(device)
        return int(free) + max(0, unused_cache), int(total)

    @contextlib.contextmanager
    def capped(self, device: torch.device, limit_bytes: float) -> Iterator[None]:
        """The caching allocator's per-process cap (``set_per_process_memory_fraction``) at ``limit_bytes``:
        what the allocator holds counts, cached blocks and fragmentation included. The cap goes back to the
        whole device (a fraction of 1, torch's default) when the block ends."""
        device = self.indexed(device)  # torch's set_per_process_memory_fraction refuses a bare "cuda"
        total = self.free_and_total(device)[1]
        self._call("set_per_process_memory_fraction", min(1.0, float(limit_bytes) / total), device)
        try:
            yield
        finally:
            self._call("set_per_process_memory_fraction", 1.0, device)

    def copier(self, device: torch.device) -> Copier:
        """A :class:`StreamCopier` (a copy stream of its own) where torch has streams for this device."""
        if self.available() and callable(getattr(self.module(), "Stream", None)):
            return StreamCopier(self.module(), device)
        return Copier(device, non_blocking=self.available())

    def peak_tracker(self, device: torch.device, limit_bytes: int | None = None) -> AllocatorPeakTracker:
        if limit_bytes is not None:
            raise bad_value("limit_bytes", f"None on a {self.type.upper()} device (the device's own memory is the "
                            "limit)", limit_bytes)
        return AllocatorPeakTracker(self, device)


@register_backend
class CudaBackend(AllocatorBackend):
    """NVIDIA GPUs, and AMD GPUs under ROCm (whose torch answers through ``torch.cuda``)."""

    type = "cuda"
    # The caching allocator's error, and what CUDA itself or cuBLAS raise when memory outside it runs out
    # (a cuBLAS handle or workspace, a kernel's own buffers): each is freed by smaller calls as well.
    out_of_memory_messages = ("CUDA out of memory", "HIP out of memory", "CUDA error: out of memory",
                              "HIP error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
    # The runtime's own errors: an illegal access, a device-side assert, a launch failure, an ECC error or a GPU
    # that fell off the bus leave the context unusable (torch >= 2.8 raises them as torch.AcceleratorError).
    failure_messages = ("CUDA error:", "HIP error:", "CUDA driver error", "CUBLAS_STATUS_EXECUTION_FAILED",
                        "NCCL error")


@register_backend
class XpuBackend(AllocatorBackend):
    """Intel GPUs (``torch.xpu``)."""

    type = "xpu"
    out_of_memory_messages = ("XPU out of memory",)


@register_backend
class MpsBackend(DeviceBackend):
    """Apple GPUs (``torch.mps``): free and total bytes and the cache; no peak statistics, so not measurable."""

    type = "mps"
    out_of_memory_messages = ("MPS backend out of memory",)

    def current(self) -> torch.device:
        return torch.device("mps")

    def count(self) -> int:
        return 1 if self.available() else 0

    def in_use(self) -> bool:
        return self.available() and int(self._call("current_allocated_memory", default=0)) > 0

    def synchronize(self, device: torch.device) -> None:
        self._call("synchronize")

    def empty_cache(self) -> None:
        if self.available():
            self._call("empty_cache")

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        total = int(self._call("recommended_max_memory", default=0))
        return max(0, total - int(self._call("driver_allocated_memory", default=0))), total


@register_backend
class CpuBackend(DeviceBackend):
    """The CPU: peaks from the storage tracker (with a simulated ``limit_bytes``), the system's available memory;
    or, inside :func:`simulated_memory`, a device of a declared size."""

    type = "cpu"
    out_of_memory_messages = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
    measurable = True
    cappable = True

    def __init__(self) -> None:
        self.simulated: StorageTracker | None = None  # the tracker holding a simulated device's memory
        self.simulated_total = 0

    def available(self) -> bool:
        return True

    def count(self) -> int:
        return 1

    def current(self) -> torch.device:
        return torch.device("cpu")

    def knows_memory(self) -> bool:
        return self.simulated is not None

    def free_and_total(self, device: torch.device) -> tuple[int, int]:
        sim = self.simulated
        if sim is not None:
            return max(0, int(sim.limit_bytes) - sim.current_bytes), self.simulated_total
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):  # a platform without these sysconf names
            raise bad_value("device", "a device whose free memory is known (this system does not report the "
                            "CPU's; give the budget in bytes)", str(device)) from None

    def peak_tracker(self, device: torch.device, limit_bytes: int | None = None) -> StorageTracker:
        return StorageTracker(limit_bytes=limit_bytes)

    def prime_peak_tracker(self, device: torch.device) -> None:
        StorageTracker.prime()

    @contextlib.contextmanager
    def capped(self, device: torch.device, limit_bytes: float) -> Iterator[None]:
        """The storage tracker over the block (in this thread) at ``limit_bytes``: an allocation beyond raises
        ``torch.OutOfMemoryError``, as on a device with that much free memory."""
        with StorageTracker(limit_bytes=int(limit_bytes)):
            yield


# -- what the rest of dynabatch calls --------------------------------------------------------------------


def _as_device(device: Any) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def known_backend(kind: str) -> DeviceBackend | None:
    """The backend registered for device type ``kind`` (``"cuda"``), or ``None``."""
    return _BACKENDS.get(kind)


def backend_of(device: Any) -> DeviceBackend:
    """The backend of ``device`` (a str, a ``torch.device`` or a device type)."""
    kind = _as_device(device).type
    if kind not in _BACKENDS:
        raise bad_value("device", f"a device of a type dynabatch knows ({', '.join(sorted(_BACKENDS))})", str(device))
    return _BACKENDS[kind]


def measurable(device: Any) -> bool:
    """Whether the memory of ``device`` (a ``torch.device``) can be measured: its type has a measuring backend."""
    backend = known_backend(_as_device(device).type)
    return backend is not None and backend.measurable


def pins_memory(device: Any) -> bool:
    """Whether batches for ``device`` are best built in pinned memory and copied with ``non_blocking`` (CUDA, XPU)."""
    try:
        backend = known_backend(_as_device(device).type) if device is not None else None
    except (RuntimeError, TypeError):
        return False  # a device torch cannot parse: batch.to() names the error
    return backend is not None and backend.pinned_copies and backend.available()


def copier(device: Any) -> Copier | None:
    """What moves batches to ``device`` (:meth:`DeviceBackend.copier`); ``None`` for ``device=None`` (batches stay
    where they are built). A device torch cannot parse, or of a type without a backend, gets a plain
    :class:`Copier`: its first copy names the error."""
    if device is None:
        return None
    try:
        dev = _as_device(device)
    except (RuntimeError, TypeError):
        return Copier(device, non_blocking=False)
    backend = known_backend(dev.type)
    return backend.copier(dev) if backend is not None else Copier(dev, non_blocking=False)


def make_current(device: Any) -> None:
    """Makes ``device`` current in the calling thread (its type's ``set_device``; nothing on the CPU)."""
    dev = _as_device(device)
    backend_of(dev).make_current(dev)


def is_out_of_memory_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: ``torch.OutOfMemoryError``, or any backend's message, or an error
    raised from one (``raise ... from error``: a model wrapper that names its own failure keeps the out-of-memory
    error as its ``__cause__``; smaller calls fit all the same).

    Example:
        >>> import torch
        >>> try:
        ...     try:
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ...     except torch.OutOfMemoryError as oom:
        ...         raise RuntimeError("the model's forward failed") from oom
        ... except RuntimeError as wrapped:
        ...     is_out_of_memory_error(wrapped)
        True
    """
    return any(map(_says_out_of_memory, causes(exc)))


def _says_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` itself (not what it was raised from) is an out-of-memory error."""
    return isinstance(error, torch.OutOfMemoryError) or any(b.is_out_of_memory(error) for b in _BACKENDS.values())


def _says_device_failed(error: BaseException) -> bool:
    """Whether ``error`` itself (not what it was raised from) names a device's failure (checked after out of memory)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return any(b.is_device_failure(error) for b in _BACKENDS.values())


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from (``__cause__``, ``raise ... from``), in that order; a chain that
    loops back is cut."""
    chain: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__
    return chain


def is_device_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a device failed (``torch.AcceleratorError``, or any backend's runtime error text, or an
    error raised from one), not the work on it. An out-of-memory error is never one: smaller calls fit.

    Example:
        >>> import torch
        >>> is_device_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
        True
        >>> is_device_failure(torch.OutOfMemoryError("CUDA out of memory")), is_device_failure(ValueError("bad row"))
        (False, False)
    """
    chain = causes(exc)  # a wrapper's error raised from the runtime's is the device's failure too
    return not any(map(_says_out_of_memory, chain)) and any(map(_says_device_failed, chain))


def free_memory() -> None:
    """Collects garbage and returns every available accelerator's cached blocks."""
    gc.collect()
    for b in backends():
        b.empty_cache()


def free_bytes(device: Any) -> int:
    """Bytes this process can still allocate on ``device``: the driver's free bytes plus the allocator's
    cached, unused blocks (the system's available memory on the CPU)."""
    dev = _as_device(device)
    return backend_of(dev).free_and_total(dev)[0]


def total_bytes(device: Any) -> int:
    """The device's total bytes."""
    dev = _as_device(device)
    return backend_of(dev).free_and_total(dev)[1]


def knows_memory(device: Any) -> bool:
    """Whether ``device`` has memory of its own that a budget can be a share of: an accelerator, or the CPU inside
    :func:`simulated_memory` (the CPU's memory is the whole system's, which the process shares)."""
    backend = known_backend(_as_device(device).type)
    return backend is not None and backend.knows_memory()


@contextlib.contextmanager
def simulated_memory(total: float, free: float | None = None) -> Iterator[None]:
    """Runs the block (in this thread) with the CPU as a device of ``total`` bytes, ``free`` of them free.

    Inside, the CPU's free and total memory are those (:func:`free_bytes` falls as the block allocates, and a
    budget such as ``"90%"`` is a share of them: :func:`knows_memory` is true), and an allocation beyond what is free
    raises ``torch.OutOfMemoryError``, as on an accelerator of that size; what is allocated before the block (the
    weights) is not counted. Peaks measured inside are those of the storage tracker, as ever on the CPU.

    Args:
        total: the device's bytes.
        free: its free bytes when the block starts (the model already loaded); default ``total``.

    Example:
        >>> import torch
        >>> with simulated_memory(total=2**20, free=2**19):
        ...     free_bytes("cpu"), knows_memory("cpu")
        (524288, True)
        >>> with simulated_memory(total=2**20, free=2**19):
        ...     torch.ones(2**18) * 2  # 1 MiB of float32
        Traceback (most recent call last):
        ...
        torch.OutOfMemoryError: dynabatch CPU tracker: 1048576 bytes allocated exceed limit_bytes=524288
    """
    total = _positive_bytes("total", total)
    free = total if free is None else _positive_bytes("free", free)
    if free > total:
        raise bad_value("free", f"at most total={total}", free)
    cpu = _BACKENDS["cpu"]
    if not isinstance(cpu, CpuBackend):
        raise bad_value("device", "the CPU backend dynabatch registers (another was registered for 'cpu')", "cpu")
    if cpu.simulated is not None:
        raise RuntimeError("simulated_memory should not be nested: the CPU is already a simulated device")
    tracker = StorageTracker(limit_bytes=free, exclusive=False)  # around a whole run: its workers' trackers run
    with tracker:
        cpu.simulated, cpu.simulated_total = tracker, total
        try:
            yield
        finally:
            cpu.simulated, cpu.simulated_total = None, 0


def _positive_bytes(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise bad_value(name, "a number of bytes >= 1", value)
    return int(value)


def device_count(kind: str) -> int:
    """How many devices of type ``kind`` (``"cuda"``) are here (0 for a type without a backend)."""
    return _BACKENDS[kind].count() if kind in _BACKENDS else 0


def default_accelerator() -> torch.device | None:
    """The first available accelerator's type as a device (``cuda``, then ``xpu``, then ``mps``), else ``None``."""
    for b in backends():
        if b.type != "cpu" and b.available():
            return torch.device(b.type)
    return None


def default_device() -> torch.device:
    """The first available accelerator whose memory can be measured (``cuda``, ``xpu``), else the CPU."""
    for b in backends():
        if b.measurable and b.available():
            return torch.device(b.type)
    return torch.device("cpu")


def device_in_use() -> torch.device | None:
    """The current device of the first accelerator on which this process holds memory, else ``None``."""
    for b in backends():
        if b.type != "cpu" and b.in_use():
            return b.current()
    return None

"""Counts the bytes of tensor storages allocated inside a block of CPU code.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op.
A storage first seen as an op *output* was allocated inside the block; a storage
first seen as an op *input* existed before (weights, inputs, caches) and is never
counted. A weak reference on each counted storage queues it when it is freed, and
its bytes are subtracted before the next op's storages are counted. Sizes are
rounded up to 512 bytes, as CUDA's caching allocator does, so CPU and CUDA peaks
are in the same units. The result depends only on the ops run and their shapes,
so the same call twice gives the same bytes.

**One tracked block at a time.** torch's Python dispatch is not safe in two
threads at once: two threads each running a model under its own mode crash the
process now and then (a segmentation fault in ``find_torch_dispatch_rule`` on an
op's first calls; torch 2.13: 1 process in 60 where two threads each ran 5 BERT
forwards). So a tracker holds a process-wide lock while it is active (``exclusive``,
the default): several CPU workers (``devices=["cpu", "cpu"]``) measure their
calls in turn. A thread may nest trackers.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["BLOCK_BYTES", "StorageTracker", "round_block"]

_ONE_BLOCK_AT_A_TIME = threading.RLock()  # torch's Python dispatch in two threads at once can crash (see above)
_PRIMED = False  # a tracker ran an op in this process (StorageTracker.prime)

BLOCK_BYTES = 512
"""CUDA's caching allocator hands out blocks in multiples of 512 bytes."""


def round_block(nbytes: int) -> int:
    """Rounds ``nbytes`` up to a whole number of 512-byte blocks (0 stays 0)."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


class _Watch(weakref.ref):
    """A weak reference to a watched storage that carries the storage's key."""

    __slots__ = ("key",)


def _tensors(values: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Appends the tensors among an aten op's arguments or results to ``found``: tensors, scalars and lists or
    tuples of them, walked directly (a pytree flattening on every op costs several times more; generate runs
    thousands of ops)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            _tensors(value, found)
        elif isinstance(value, dict):
            _tensors(tree_leaves(value), found)
    return found


class StorageTracker(TorchDispatchMode):
    """Tracks live and peak bytes of storages allocated while the mode is active.

    Args:
        limit_bytes: if given, raise :class:`torch.OutOfMemoryError` as soon as the
            live bytes allocated inside the block exceed it, as a device with that
            much free memory would.
        exclusive: hold the process-wide lock while active (no other thread's
            tracker runs meanwhile); ``False`` for a block that spans other
            threads' work (a simulated device around a whole run).
    """

    def __init__(self, limit_bytes: int | None = None, exclusive: bool = True) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.exclusive = exclusive
        self._current = 0
        self.peak_bytes = 0
        self.segment_peak_bytes = 0  # the peak since the last mark()
        self._counted: dict[int, int] = {}  # storage key -> counted bytes
        self._preexisting: set[int] = set()
        self._watched: dict[int, _Watch] = {}  # storage key -> the weak reference that queues it when freed
        # A freed storage's reference, queued by a C method: a Python callback would run Python's signal handlers,
        # and Python drops what a weakref callback raises, so a Ctrl-C landing there would be lost (about 1 in 40
        # during a tracked BERT forward). The frees are counted before the next op's storages, as they happened.
        self._freed: list[_Watch] = []
        self._lock = threading.RLock()  # a storage freed on another thread

    @classmethod
    def prime(cls) -> None:
        """Runs one op under a tracker, once a process: torch imports its dispatch machinery (``torch._dynamo``,
        2-4 s on a CPU) at the first op any dispatch mode sees, which a run would time as its first batch's."""
        global _PRIMED
        if not _PRIMED:
            with cls():
                torch.zeros(1).add_(1)
            _PRIMED = True

    # -- bookkeeping -------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        """Bytes allocated inside the block and still held."""
        with self._lock:
            self._uncount_freed()
            return self._current

    def _uncount_freed(self) -> None:
        freed = self._freed
        while freed:
            key = freed.pop().key
            self._watched.pop(key, None)
            self._preexisting.discard(key)
            self._current -= self._counted.pop(key, 0)

    def _watch(self, storage: torch.UntypedStorage, key: int) -> None:
        # Dropping the reference (at the block's end) is what detaches it.
        watch = self._watched[key] = _Watch(storage, self._freed.append)
        watch.key = key

    def _see(self, tensors: list[torch.Tensor], is_output: bool) -> None:
        """Counts the storages of one op's input or output tensors (one lock for all of them)."""
        with self._lock:
            self._uncount_freed()  # first: a freed storage's key may be a new storage's now
            for tensor in tensors:
                if tensor.layout != torch.strided or tensor.is_meta:
                    continue
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self._preexisting:
                    continue
                counted = self._counted.get(key)
                if counted is None and not is_output:
                    self._preexisting.add(key)
                    self._watch(storage, key)
                    continue
                size = round_block(storage.nbytes())
                if counted is None:
                    self._counted[key] = size
                    self._current += size
                    self._watch(storage, key)
                elif size != counted:  # resize_ and out= ops can grow a storage in place
                    self._current += size - counted
                    self._counted[key] = size
                else:
                    continue
                if self._current > self.segment_peak_bytes:
                    self.segment_peak_bytes = self._current
                    self.peak_bytes = max(self.peak_bytes, self._current)
            held = self._current
        if self.limit_bytes is not None and held > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"dynabatch CPU tracker: {held} bytes allocated exceed "
                f"limit_bytes={self.limit_bytes}"
            )

    def mark(self) -> int:
        """Ends a segment of the block: returns its peak; the next segment starts at the bytes held now."""
        with self._lock:
            self._uncount_freed()
            peak, self.segment_peak_bytes = self.segment_peak_bytes, self._current
        return peak

    # -- dispatch ----------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        inputs = _tensors(args, [])
        if kwargs:
            _tensors(kwargs.values(), inputs)
        if inputs:
            self._see(inputs, is_output=False)
        out = func(*args, **kwargs)
        outputs = [out] if type(out) is torch.Tensor else _tensors((out,), [])
        if outputs:
            self._see(outputs, is_output=True)
        return out

    def __enter__(self) -> StorageTracker:
        if self.exclusive:
            _ONE_BLOCK_AT_A_TIME.acquire()
        try:
            return super().__enter__()
        except BaseException:
            if self.exclusive:
                _ONE_BLOCK_AT_A_TIME.release()
            raise

    def __exit__(self, *exc: object) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self.exclusive:
                _ONE_BLOCK_AT_A_TIME.release()
            # Storages that outlive the block (the call's outputs) no longer
            # need watching: their references dropped, they queue nothing.
            with self._lock:
                self._uncount_freed()
                self._watched.clear()

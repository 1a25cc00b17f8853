"""Counts the bytes of tensor storages allocated inside a block of CPU code.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op.
A storage first seen as an op *output* was allocated inside the block; a storage
first seen as an op *input* existed before (weights, inputs, caches) and is never
counted. A ``weakref.finalize`` on each counted storage subtracts its bytes when
it is freed. Sizes are rounded up to 512 bytes, as CUDA's caching allocator does,
so CPU and CUDA peaks are in the same units. The result depends only on the ops
run and their shapes, so the same call twice gives the same bytes.

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

BLOCK_BYTES = 512
"""CUDA's caching allocator hands out blocks in multiples of 512 bytes."""


def round_block(nbytes: int) -> int:
    """Rounds ``nbytes`` up to a whole number of 512-byte blocks (0 stays 0)."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


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
        self.current_bytes = 0
        self.peak_bytes = 0
        self.segment_peak_bytes = 0  # the peak since the last mark()
        self._counted: dict[int, int] = {}  # storage key -> counted bytes
        self._preexisting: set[int] = set()
        self._finalizers: list[weakref.finalize] = []
        self._lock = threading.Lock()

    # -- bookkeeping -------------------------------------------------------
    def _watch(self, storage: torch.UntypedStorage, key: int) -> None:
        self._finalizers.append(weakref.finalize(storage, self._freed, key))

    def _freed(self, key: int) -> None:
        with self._lock:
            self._preexisting.discard(key)
            self.current_bytes -= self._counted.pop(key, 0)

    def _see(self, tensor: torch.Tensor, is_output: bool) -> None:
        if tensor.is_meta or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        with self._lock:
            if key in self._preexisting:
                return
            size = round_block(storage.nbytes())
            if key in self._counted:
                # resize_ and out= ops can grow a storage in place.
                self.current_bytes += size - self._counted[key]
                self._counted[key] = size
            elif is_output:
                self._counted[key] = size
                self.current_bytes += size
                self._watch(storage, key)
            else:
                self._preexisting.add(key)
                self._watch(storage, key)
            if self.current_bytes > self.segment_peak_bytes:
                self.segment_peak_bytes = self.current_bytes
                self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            over = self.limit_bytes is not None and self.current_bytes > self.limit_bytes
        if over:
            raise torch.OutOfMemoryError(
                f"dynabatch CPU tracker: {self.current_bytes} bytes allocated exceed "
                f"limit_bytes={self.limit_bytes}"
            )

    def mark(self) -> int:
        """Ends a segment of the block: returns its peak; the next segment starts at the bytes held now."""
        with self._lock:
            peak, self.segment_peak_bytes = self.segment_peak_bytes, self.current_bytes
        return peak

    # -- dispatch ----------------------------------------------------------
    def _see_all(self, values: Any, is_output: bool) -> None:
        # An aten op's arguments and results are tensors, scalars and lists or tuples of them: walked
        # directly, which costs a fraction of a pytree flattening on every op (generate runs thousands).
        for value in values:
            if isinstance(value, torch.Tensor):
                self._see(value, is_output)
            elif isinstance(value, (list, tuple)):
                self._see_all(value, is_output)
            elif isinstance(value, dict):
                self._see_all(tree_leaves(value), is_output)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        self._see_all(args, is_output=False)
        if kwargs:
            self._see_all(kwargs.values(), is_output=False)
        out = func(*args, **kwargs)
        self._see_all((out,), is_output=True)
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
            # need watching; drop the finalizers so nothing is kept alive.
            for fin in self._finalizers:
                fin.detach()
            self._finalizers.clear()

"""Out-of-memory safety for training steps: a micro-batch that runs out of memory is run in halves.

:func:`guarded_step` runs one micro-batch's forward and backward. If it runs
out of memory, the batch is split as :mod:`dynabatch.memory.oom`'s policy
splits every call that ran out of memory (in halves) and each half is run,
recursively, so the optimizer still receives the gradient of the whole batch
(the batch is cut by :func:`dynabatch.data.collate.split_rows`, the one
splitter, with every column kept: ``labels`` of another width, as an
encoder-decoder's, and positions counted from the first column, as with left
padding, stay exactly as collated):

* the step function must normalise its loss by the item count of the whole
  optimizer step (not of the micro-batch), so the halves' losses sum to the
  whole batch's;
* an out-of-memory error in the *backward* may strike after some parameters
  already accumulated this batch's gradient. Their post-accumulate hooks tell
  which; those parameters are frozen while the halves run, so no gradient is
  counted twice and none is lost.

A :class:`StepGuard` learns from the errors as :func:`dynabatch.run`'s
measured mode does, with the policy of :mod:`dynabatch.memory.oom`, per task
(one task, ``None``, for a trainer without tasks):

* the shapes that ran out of memory: a later batch at least as wide with at
  least as many rows is split before it runs (:func:`~dynabatch.memory.oom.failed_cap`);
* the limit the errors set on a batch's padded cells (rows x width, what a
  training step's activations and logits grow with), an
  :class:`~dynabatch.memory.oom.OutOfMemoryLimit`: half the cells of the batch
  that failed, rising by quarter steps as the parts that run succeed, never
  back to a size that failed. A later batch above it is split before it runs,
  into the fewest equal parts under it (:func:`~dynabatch.memory.oom.equal_parts`),
  so a device that holds fewer cells than the plan assumed costs a few
  errors, not one per batch.

Example:
    >>> import torch
    >>> weight = torch.nn.Parameter(torch.ones(4))
    >>> def step(batch):
    ...     (batch["x"] @ weight).sum().backward()
    ...     return batch["x"].shape[0]
    >>> guard = StepGuard()
    >>> result = guarded_step(step, {"x": torch.ones(6, 4)}, [weight], guardian=guard)
    >>> result.outputs, weight.grad.tolist(), guard.num_out_of_memory
    ([6], [6.0, 6.0, 6.0, 6.0], 0)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from dynabatch._validation import check_positive_int
from dynabatch.data.collate import batch_shape, split_rows
from dynabatch.memory.oom import MAX_ROWS, OutOfMemoryLimit, call_guarded, equal_parts, failed_cap, split_sizes

__all__ = ["BATCH_WIDE_FIELDS", "GuardedResult", "StepGuard", "guarded_step"]

logger = logging.getLogger(__name__)


class StepGuard:
    """What out-of-memory errors in training steps taught, per task: the sizes :func:`guarded_step` splits first.

    Args:
        limit_bytes: simulate a device of this many bytes on the CPU: guarded
            steps run under the CPU tracker's ``limit_bytes``, so going over it
            raises a real out-of-memory error (``None``: no limit).
    """

    def __init__(self, *, limit_bytes: int | None = None) -> None:
        self.limit_bytes = None if limit_bytes is None else check_positive_int("limit_bytes", limit_bytes)
        self.num_out_of_memory = 0
        self._failed: dict[Hashable, list[tuple[int, int]]] = {}  # task -> [(rows, length) that ran out of memory]
        self._cells: dict[Hashable, OutOfMemoryLimit] = {}  # task -> the limit errors set on padded cells

    def failed_shapes(self, task_type: Hashable | None = None) -> list[tuple[int, int]]:
        """The ``(rows, length)`` of the batches of ``task_type`` that ran out of memory, in order."""
        return list(self._failed.get(task_type, ()))

    def record_out_of_memory(self, task_types: Sequence[Hashable], length: int, rows: int) -> None:
        """Remembers that a batch of ``rows`` rows of these tasks (none: task ``None``), ``length`` wide, ran out
        of memory."""
        self.num_out_of_memory += 1
        for task in _tasks(task_types):
            self._failed.setdefault(task, []).append((int(rows), int(length)))
            self._cells.setdefault(task, OutOfMemoryLimit(row_floor=False)).observe_out_of_memory(
                int(rows), max(1, int(length)))

    def record_success(self, task_types: Sequence[Hashable], length: int, rows: int) -> None:
        """Remembers that a batch of ``rows`` rows of these tasks, ``length`` wide, ran: the cell limit may rise."""
        for task in _tasks(task_types):
            if task in self._cells:
                self._cells[task].observe_success(int(rows), max(1, int(length)))

    def remembered_batch_size(self, task_types: Sequence[Hashable], length: int) -> int | None:
        """The most rows of these tasks at ``length`` that no remembered failure forbids (the failed shapes and
        the cell limit), or ``None``."""
        caps = []
        for task in _tasks(task_types):
            if task in self._failed:
                caps.append(int(failed_cap(np.array(length), self._failed[task])))
                caps.append(self._cells[task].rows_under_limit(max(1, int(length))))
        caps = [c for c in caps if c is not None and c < MAX_ROWS]
        return min(caps) if caps else None


def _tasks(task_types: Sequence[Hashable]) -> set[Hashable]:
    """The tasks a batch's memory is remembered under: its own, or ``None`` for a batch without tasks."""
    return set(task_types) or {None}


@dataclass
class GuardedResult:
    """What :func:`guarded_step` ran: each part's step output, rows and measured peak (in order)."""

    outputs: list[Any] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    peaks: list[int | None] = field(default_factory=list)
    splits: int = 0
    early_gradients: int = 0
    """Parameters whose gradient had arrived when a backward ran out of memory (frozen for the halves)."""


@contextlib.contextmanager
def _frozen(params: list[nn.Parameter]) -> Iterator[None]:
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def guarded_step(
    step: Callable[[dict[str, Any]], Any],
    batch: dict[str, Any],
    parameters: Sequence[nn.Parameter],
    *,
    guardian: StepGuard | None = None,
    task_types: Sequence[Hashable] = (),
    measure_on: str | torch.device | None = None,
) -> GuardedResult:
    """Runs ``step(batch)`` (forward + backward); on out-of-memory, runs it in halves.

    Args:
        step: does forward, loss and ``backward`` for a batch; its loss must be
            normalised by the whole optimizer step's item count.
        batch: a collated batch (dict of tensors and per-row lists).
        parameters: the model's parameters (to see which got gradients before an error).
        guardian: remembers the sizes that ran, splits known-too-big batches
            first, and supplies the simulated CPU limit.
        task_types: the batch's tasks, for the guardian's memory.
        measure_on: measure each part's peak on this device (``None``: don't).

    Raises:
        torch.OutOfMemoryError: a single row does not fit, or the error came after every parameter's gradient had
            arrived (parts would add the gradient twice).
    """
    params = [p for p in parameters if p.requires_grad]
    result = GuardedResult()
    _run(step, batch, params, guardian, task_types, measure_on, result)
    return result


BATCH_WIDE_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Fields of a packed batch that describe all its rows at once (flash-attention's): it cannot be cut into rows."""


def _batch_wide(batch: dict[str, Any]) -> list[str]:
    return [key for key in BATCH_WIDE_FIELDS if key in batch]


def _shape(batch: dict[str, Any]) -> tuple[int, int]:
    """Rows and padded width (of ``input_ids`` when the batch has them: a packed batch's mask is 4-D)."""
    rows, width = batch_shape(batch)
    ids = batch.get("input_ids")
    return rows, int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.ndim == 2 else width


def _run(step, batch, params, guardian, task_types, measure_on, result: GuardedResult) -> None:
    """Runs ``batch`` (in the parts the guardian's memory asks for), or its halves after an out-of-memory error."""
    rows, length = _shape(batch)
    known = guardian.remembered_batch_size(task_types, length) if guardian is not None else None
    if known is not None and rows > known and not _batch_wide(batch):  # split before it runs
        parts = split_rows(batch, equal_parts(rows, known), trim=False)
        result.splits += len(parts) - 1
        for part in parts:
            _run(step, part, params, guardian, task_types, measure_on, result)
        return
    fired: set[int] = set()
    handles = [p.register_post_accumulate_grad_hook(lambda p: fired.add(id(p))) for p in params]
    limit = guardian.limit_bytes if guardian is not None else None
    measure = measure_on if measure_on is not None or limit is None else "cpu"
    try:
        attempt = call_guarded(step, batch, measure_on=measure, limit_bytes=limit)
    finally:
        for handle in handles:
            handle.remove()
    if attempt.error is None:
        result.outputs.append(attempt.output)
        result.rows.append(rows)
        result.peaks.append(attempt.peak_bytes)
        if guardian is not None:
            guardian.record_success(task_types, length, rows)
        return
    if rows == 1:
        raise attempt.error
    wide = _batch_wide(batch)
    if wide:
        logger.error("out of memory on %d rows x %d; the batch holds %s, which describe all its rows at once, so it "
                     "cannot be split (PackedCollator(return_flash_attn_kwargs=False) makes batches that can)",
                     rows, length, ", ".join(wide))
        raise attempt.error
    done = [p for p in params if id(p) in fired]
    todo = [p for p in params if id(p) not in fired]
    if done and not todo:  # its parts, every parameter frozen, could only fail in their backward
        attempt.error.add_note(f"dynabatch: out of memory on {rows} rows x {length} after every parameter's gradient "
                               "had arrived (after the backward): the gradient of these rows is complete, so running "
                               "them again in parts cannot help and would add it twice; free memory after the "
                               "backward in the step, or lower the batch size")
        raise attempt.error
    sizes = split_sizes(rows)
    logger.warning("out of memory on %d rows x %d; running it as %s rows", rows, length, " + ".join(map(str, sizes)))
    if guardian is not None:
        guardian.record_out_of_memory(task_types, length, rows)
    result.splits += 1
    result.early_gradients += len(done)
    with _frozen(done):
        for part in split_rows(batch, sizes, trim=False):
            _run(step, part, todo, guardian, task_types, measure_on, result)

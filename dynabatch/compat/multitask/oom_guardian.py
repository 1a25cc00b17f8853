"""Out-of-memory safety for training (the multi-task system's ``OOMGuardian`` and ``GradientCheckpointManager``).

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

The :class:`OOMGuardian` learns from the errors as :func:`dynabatch.run`'s
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

:class:`~dynabatch.memory.budget.MemoryBudget` gives the guardian's budget and
safe batch sizes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from dynabatch._validation import bad_type, bad_value, check_positive_number
from dynabatch.data.collate import batch_shape, split_rows
from dynabatch.memory.budget import MemoryBudget, check_memory_margin
from dynabatch.memory.device import backend_of, free_bytes, free_memory
from dynabatch.memory.oom import MAX_ROWS, OutOfMemoryLimit, call_guarded, equal_parts, failed_cap, split_sizes
from dynabatch.memory.units import GB, MB
from dynabatch.training.predictor import last_measured_predictor

__all__ = ["BATCH_WIDE_FIELDS", "GradientCheckpointManager", "GuardedResult", "OOMGuardian", "guarded_step"]

logger = logging.getLogger(__name__)

class OOMGuardian:
    """Keeps training steps inside the device's memory.

    Args:
        device: the training device.
        memory_margin_percent: fraction of the budget kept free, in [0, 1)
            (a fraction, despite the name: 0.10 keeps 10% free).
        max_memory_mb: the budget for a step's peak memory in MB (10**6
            bytes, as the multi-task system's docs count: 30000 is "30GB"); by
            default what the device has free (:func:`~dynabatch.memory.device.free_bytes`).
        predictor: a calibrated :class:`~dynabatch.MemoryPredictor` for
            :meth:`estimate_safe_batch_size`; by default the one that last
            recorded a measurement in the process (the multi-task system's call passes none).
        simulate_limit: CPU only: run guarded steps under the CPU tracker's
            ``limit_bytes`` = ``max_memory_mb``, so going over it raises a real
            out-of-memory error, as on a device of that size.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda:0",
        memory_margin_percent: float = 0.10,
        *,
        max_memory_mb: float | None = None,
        predictor: Any = None,
        simulate_limit: bool = False,
    ) -> None:
        if not isinstance(device, (str, torch.device)):
            raise bad_type("device", "a str or torch.device", device)
        self.device = torch.device(device)
        self.memory_margin_percent = check_memory_margin(memory_margin_percent, "memory_margin_percent")
        self.max_memory_mb = None if max_memory_mb is None else check_positive_number("max_memory_mb", max_memory_mb)
        self.predictor = predictor
        if simulate_limit and (self.device.type != "cpu" or self.max_memory_mb is None):
            raise bad_value("simulate_limit", "False unless device is the CPU and max_memory_mb is set", simulate_limit)
        self.simulate_limit = bool(simulate_limit)
        self.num_out_of_memory = 0
        self._failed: dict[Hashable, list[tuple[int, int]]] = {}  # task -> [(rows, length) that ran out of memory]
        self._cells: dict[Hashable, OutOfMemoryLimit] = {}  # task -> the limit errors set on padded cells

    # -- budget --------------------------------------------------------------
    def budget_bytes(self) -> float:
        """The memory a step may use: ``max_memory_mb``, else what the device has free now."""
        if self.max_memory_mb is not None:
            return self.max_memory_mb * MB
        if not backend_of(self.device).available():
            raise bad_value("device", "an available device, or max_memory_mb= to check against", self.device)
        return float(free_bytes(self.device))

    def budget(self, task_type: Hashable | None = None, model: Any = None) -> MemoryBudget:
        """The :class:`~dynabatch.memory.budget.MemoryBudget` of a step now: :meth:`budget_bytes`, the margin,
        and the shapes of ``task_type`` that ran out of memory; ``model`` predicts its bytes (optional)."""
        return MemoryBudget(model, self.budget_bytes(), memory_margin=self.memory_margin_percent,
                            failed_shapes=self._failed.get(task_type, ()))

    def usable_bytes(self) -> float:
        """The budget minus the safety margin."""
        return self.budget().budget_bytes

    @property
    def limit_bytes(self) -> int | None:
        """The CPU tracker's limit when simulating a device, else ``None``."""
        return int(self.max_memory_mb * MB) if self.simulate_limit else None

    def preflight_check(self, predicted_memory_gb: float) -> bool:
        """True if a step predicted to need ``predicted_memory_gb`` fits the budget minus the margin."""
        predicted = check_positive_number("predicted_memory_gb", predicted_memory_gb) if predicted_memory_gb else 0.0
        usable = self.usable_bytes()
        fits = predicted * GB <= usable
        if not fits:
            logger.warning("preflight: %.3f GB predicted, %.3f GB usable", predicted, usable / GB)
        return fits

    def emergency_cleanup(self) -> None:
        """Frees what can be freed: garbage collection and CUDA's cached blocks."""
        free_memory()

    # -- remembered sizes ----------------------------------------------------
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

    def estimate_safe_batch_size(self, task_type: Hashable, seq_length: float | None = None) -> int:
        """Most rows of ``task_type`` predicted to fit the budget minus the margin (0 if none fits).

        Uses the predictor (at the task's typical length unless ``seq_length``
        is given) through :meth:`budget`, so a shape that ran out of memory caps it.
        Without a predictor: the most rows :meth:`remembered_batch_size` allows
        at ``seq_length`` (default: the widest batch of the task that failed).
        """
        predictor = self.predictor if self.predictor is not None else last_measured_predictor()
        if predictor is None:
            widest = max((width for _, width in self._failed.get(task_type, ())), default=1)
            remembered = self.remembered_batch_size([task_type], math.ceil(seq_length or widest))
            if remembered is None:
                raise bad_value(
                    "predictor",
                    "a calibrated MemoryPredictor (OOMGuardian(predictor=...); none has recorded a measurement "
                    "in this process)",
                    None,
                )
            return remembered
        length = predictor.typical_length(task_type) if seq_length is None else float(seq_length)
        return int(self.budget(task_type, _TaskBytes(predictor, task_type)).rows_allowed(math.ceil(length)))


def _tasks(task_types: Sequence[Hashable]) -> set[Hashable]:
    """The tasks a batch's memory is remembered under: its own, or ``None`` for a batch without tasks."""
    return set(task_types) or {None}


class _TaskBytes:
    """One task of a predictor as the memory model of a budget: ``predict(rows, padded_length)`` in bytes."""

    def __init__(self, predictor: Any, task_type: Hashable) -> None:
        self.predictor, self.task_type = predictor, task_type

    def predict(self, rows: Any, padded_length: Any) -> Any:
        return self.predictor.predict_bytes(self.task_type, rows, padded_length)


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
    guardian: OOMGuardian | None = None,
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
        torch.OutOfMemoryError: a single row does not fit.
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
    sizes = split_sizes(rows)
    logger.warning("out of memory on %d rows x %d; running it as %s rows", rows, length, " + ".join(map(str, sizes)))
    if guardian is not None:
        guardian.record_out_of_memory(task_types, length, rows)
    result.splits += 1
    result.early_gradients += len(done)
    with _frozen(done):
        for part in split_rows(batch, sizes, trim=False):
            _run(step, part, todo, guardian, task_types, measure_on, result)


class GradientCheckpointManager:
    """Turns activation (gradient) checkpointing on and off for HF and plain torch models."""

    @staticmethod
    def enable_gradient_checkpointing(model: nn.Module) -> bool:
        """Recomputes activations in the backward instead of keeping them; True if enabled.

        HF models use their own switch (and stop caching keys and values). A
        plain torch model gets each block of its largest ``ModuleList`` or
        ``Sequential`` wrapped in ``torch.utils.checkpoint``.
        """
        if not isinstance(model, nn.Module):
            raise bad_type("model", "a torch.nn.Module", model)
        if getattr(model, "supports_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if getattr(getattr(model, "config", None), "use_cache", False):
                model.config.use_cache = False
            return True
        blocks = _largest_block_list(model)
        if blocks is None:
            logger.warning("%s has no ModuleList or Sequential of blocks to checkpoint", type(model).__name__)
            return False
        for block in blocks:
            if not hasattr(block, "_dynabatch_forward"):
                block._dynabatch_forward = block.forward
                block.forward = _checkpointed(block._dynabatch_forward)
        return True

    @staticmethod
    def disable_gradient_checkpointing(model: nn.Module) -> None:
        """Undoes :meth:`enable_gradient_checkpointing`."""
        if getattr(model, "supports_gradient_checkpointing", False):
            if hasattr(model, "activation_checkpointing_disable"):
                model.activation_checkpointing_disable()
            else:
                model.gradient_checkpointing_disable()
            return
        for module in model.modules():
            if hasattr(module, "_dynabatch_forward"):
                module.forward = module._dynabatch_forward
                del module._dynabatch_forward

    @staticmethod
    def is_enabled(model: nn.Module) -> bool:
        """Whether checkpointing is on (either kind)."""
        if any(hasattr(m, "_dynabatch_forward") for m in model.modules()):
            return True
        return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _largest_block_list(model: nn.Module) -> nn.Module | None:
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    return max(lists, key=len) if lists else None


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run

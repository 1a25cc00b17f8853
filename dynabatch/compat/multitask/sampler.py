"""Memory-aware multi-task batch sampler (the multi-task system's ``MemoryAwareBatchSampler``).

A thin ``torch.utils.data`` batch sampler over
:func:`dynabatch.compat.multitask.memory_aware.plan_memory_aware_batches`, built on
:class:`dynabatch.sampling.base.PlannedBatchSampler` (``set_epoch``,
``state_dict`` / ``load_state_dict`` resuming mid-epoch, the same number of
batches on every distributed rank). Memory comes from a
:class:`~dynabatch.compat.multitask.MemoryPredictor` fitted to measured peaks: the sampler
takes a frozen snapshot of it when built, so an epoch's plan does not move
while the predictor keeps learning.

Tasks and sizes come from ``dataset.get_sample_metadata(idx)`` (a dict with
``task_type`` and optionally a size field such as ``length``, ``seq_length``,
``num_tokens`` or one you name with ``size_field``, e.g. ``"num_images"``), or
from ``task_types=`` / ``lengths=`` arrays.

Example:
    >>> from dynabatch.compat.multitask.predictor import MemoryPredictor
    >>> from dynabatch.compat.multitask.sampler import MemoryAwareBatchSampler
    >>> predictor = MemoryPredictor("cpu")
    >>> for rows in (1, 2, 4):
    ...     predictor.record_actual_memory("short", 1 + rows * 1.0, batch_size=rows, seq_length=8)
    ...     predictor.record_actual_memory("long", 1 + rows * 4.0, batch_size=rows, seq_length=32)
    >>> tasks = ["short"] * 6 + ["long"] * 4
    >>> sampler = MemoryAwareBatchSampler(None, batch_size=8, max_memory_mb=10, shuffle=False,
    ...                                   task_diversity_weight=0.0, predictor=predictor,
    ...                                   task_types=tasks, lengths=[8] * 6 + [32] * 4)
    >>> [[tasks[i] for i in b] for b in sampler]
    [['long', 'long'], ['short', 'short', 'short', 'short', 'short', 'short'], ['long', 'long']]
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_bool,
    check_fraction,
    check_lengths,
    check_non_negative_int,
    check_positive_int,
    check_positive_number,
)
from dynabatch.compat.multitask.memory_aware import (
    BatchBytes,
    check_single_samples_fit,
    plan_memory_aware_batches,
)
from dynabatch.compat.multitask.predictor import MemoryPredictor
from dynabatch.memory.budget import MemoryBudget, check_memory_margin
from dynabatch.memory.units import MB
from dynabatch.sampling.base import PlannedBatchSampler

__all__ = ["MemoryAwareBatchSampler", "read_task_metadata"]

logger = logging.getLogger(__name__)

_SIZE_FIELDS = ("length", "seq_length", "num_tokens")


def _size(name: str, value: Any) -> int:
    """A sample's size from its metadata: a non-negative integer (numpy and 0-d tensor integers too)."""
    try:
        value = operator.index(value)
    except TypeError:
        raise bad_type(name, "a non-negative integer size", value) from None
    return check_non_negative_int(name, value)


def read_task_metadata(dataset: Any, size_field: str | None = None) -> tuple[list[Hashable], np.ndarray]:
    """Task type and size of every sample of ``dataset``.

    Reads ``dataset.get_sample_metadata(idx)`` when the dataset has it, else
    ``dataset[idx]`` (a dict). The size is ``size_field`` when named, else the
    first of ``length`` / ``seq_length`` / ``num_tokens``, else the length of
    the sample's ``input_ids``, else 1.

    Raises:
        ValueError: a sample's metadata has no ``task_type``, or a negative size (its index is named).
        TypeError: a size that is not an integer (a float such as 3.7 is not cut to 3).
    """
    if dataset is None or not hasattr(dataset, "__len__"):
        raise bad_type("dataset", "a sized dataset (or pass task_types= and lengths=)", dataset)
    has_meta = callable(getattr(dataset, "get_sample_metadata", None))
    source = "dataset.get_sample_metadata" if has_meta else "dataset.__getitem__"
    tasks: list[Hashable] = []
    sizes = np.ones(len(dataset), dtype=np.int64)  # no size known: every sample counts 1
    for idx in range(len(dataset)):
        meta = dataset.get_sample_metadata(idx) if has_meta else dataset[idx]
        if not isinstance(meta, dict) or meta.get("task_type") is None:
            raise bad_value(f"{source}({idx})", "a dict with a 'task_type' key", meta)
        tasks.append(meta["task_type"])
        if size_field is not None:
            if size_field not in meta:
                raise bad_value(f"{source}({idx})", f"a dict with the size_field {size_field!r}", meta)
            sizes[idx] = _size(f"{source}({idx})[{size_field!r}]", meta[size_field])
            continue
        key = next((k for k in _SIZE_FIELDS if k in meta), None)
        if key is not None:
            sizes[idx] = _size(f"{source}({idx})[{key!r}]", meta[key])
        elif not has_meta and "input_ids" in meta:
            sizes[idx] = len(meta["input_ids"])
        elif has_meta:
            sample = dataset[idx]
            if isinstance(sample, dict) and "input_ids" in sample:
                sizes[idx] = len(sample["input_ids"])
    return tasks, sizes


class MemoryAwareBatchSampler(PlannedBatchSampler):
    """Batches whose predicted memory stays <= ``max_memory_mb`` x (1 - ``memory_margin``).

    Args:
        dataset: a dataset with ``get_sample_metadata(idx)`` (or dict samples
            with ``task_type``); may be ``None`` when ``task_types`` and
            ``lengths`` are given.
        batch_size: at most this many rows per batch.
        max_memory_mb: the memory budget of one batch (training step) in MB
            (10**6 bytes, as ``"MB"`` in every memory size dynabatch parses);
            ``None``: no budget, batches of ``batch_size`` rows.
        shuffle: shuffle samples within tasks and the batch order each epoch.
        task_diversity_weight: 0 gives single-task batches, 1 batches that
            mirror the global task mix.
        seed: seeds all shuffling, with the epoch.
        predictor: a :class:`~dynabatch.compat.multitask.MemoryPredictor` with measurements for
            every task. Only the predictor passed here is used. Without one, or
            while it lacks a measurement of some task, every batch is
            ``batch_size`` rows (the task mix still applies) and one warning
            says memory is not calibrated yet.
        memory_margin: fraction of ``max_memory_mb`` kept free, in [0, 1).
        task_types, lengths: per-sample tasks and sizes, instead of reading the dataset.
        size_field: the metadata field holding a sample's size.
        is_training: plan with the predictor's training-step (or forward-only) fits.
        sort_window: sort each task's shuffled samples by length within windows of
            this many, so batches waste less on padding (``None``: no sorting).
        num_replicas, rank, shard: ranks (see :class:`~dynabatch.sampling.base.PlannedBatchSampler`).

    Attributes:
        budget: the :class:`~dynabatch.memory.budget.MemoryBudget` every batch is planned under
            (``None`` without ``max_memory_mb``).
        calibrated: whether batches are planned by predicted memory (else by ``batch_size``).

    Raises:
        ValueError: ``max_memory_mb`` <= 0, or below what one sample of a task
            needs (the task is named); a margin outside [0, 1); metadata without
            ``task_type``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        max_memory_mb: float | None,
        shuffle: bool = True,
        task_diversity_weight: float = 0.5,
        seed: int = 0,
        *,
        predictor: MemoryPredictor | None = None,
        memory_margin: float = 0.10,
        task_types: Sequence[Hashable] | None = None,
        lengths: Sequence[int] | None = None,
        size_field: str | None = None,
        is_training: bool = True,
        sort_window: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shard: bool = True,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank, shard=shard)
        self.sort_window = None if sort_window is None else check_positive_int("sort_window", sort_window)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.max_memory_mb = None if max_memory_mb is None else check_positive_number("max_memory_mb", max_memory_mb)
        self.memory_margin = check_memory_margin(memory_margin)
        self.budget = None if max_memory_mb is None else MemoryBudget(None, self.max_memory_mb * MB,
                                                                      memory_margin=self.memory_margin)
        self.task_diversity_weight = check_fraction("task_diversity_weight", task_diversity_weight)
        self.dataset = dataset
        if task_types is None:
            tasks, sizes = read_task_metadata(dataset, size_field)
        else:
            if isinstance(task_types, (str, bytes)) or not isinstance(task_types, Iterable):
                raise bad_type("task_types", "a sequence of task types, one per sample", task_types)
            tasks = list(task_types)
            sizes = np.ones(len(tasks), dtype=np.int64) if lengths is None else check_lengths("lengths", lengths)
            if len(sizes) != len(tasks):
                raise bad_value("lengths", f"one length per task type ({len(tasks)})", f"<{len(sizes)} lengths>")
            for idx, task in enumerate(tasks):
                if task is None or not isinstance(task, Hashable):
                    raise bad_value(f"task_types[{idx}]", "a hashable task type", task)
        self.task_names: list[Hashable] = list(dict.fromkeys(tasks))
        position = {t: k for k, t in enumerate(self.task_names)}
        self.task_ids = np.array([position[t] for t in tasks], dtype=np.int64)
        self.lengths = sizes
        if predictor is not None and not isinstance(predictor, MemoryPredictor):
            raise bad_type("predictor", "a MemoryPredictor or None", predictor)
        self.predictor = predictor
        self.is_training = check_bool("is_training", is_training)
        unmeasured = [t for t in self.task_names if predictor is None or not predictor.has_measurement(t, is_training)]
        self.calibrated = self.budget is not None and not unmeasured
        self.batch_bytes: BatchBytes | None = None
        if self.calibrated:
            self.batch_bytes = predictor.batch_memory_function(self.task_names, self.is_training)
            check_single_samples_fit(
                self.task_ids, self.lengths, self.batch_bytes, self.budget,
                name="max_memory_mb", value=max_memory_mb, task_names=self.task_names, unit=("MB", MB),
            )
        elif self.task_names and self.budget is not None:
            what = "no predictor was given" if predictor is None else (
                f"the predictor has no {'training-step' if is_training else 'forward'} measurement of task(s) "
                f"{unmeasured}")
            logger.warning("memory is not calibrated yet (%s): batches of batch_size=%d rows, not planned by "
                           "max_memory_mb; measure with MemoryPredictor.record_actual_memory or .calibrate and pass "
                           "predictor=", what, self.batch_size)

    def plan(self, epoch: int) -> list[np.ndarray]:
        return plan_memory_aware_batches(
            self.task_ids,
            self.lengths,
            self.batch_bytes,
            self.budget if self.calibrated else None,
            batch_size=self.batch_size,
            task_diversity_weight=self.task_diversity_weight,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            sort_window=self.sort_window,
        )

    def identity(self) -> list[Any]:
        return [self.task_ids, self.lengths, self.batch_size, self.task_diversity_weight, self.sort_window,
                self.budget if self.calibrated else None, self.batch_bytes]

    def predicted_mb(self, indices: Sequence[int]) -> float | None:
        """Predicted peak of a batch of these indices, in MB (``None`` while memory is not calibrated)."""
        if self.batch_bytes is None:
            return None
        idx = np.asarray(indices, dtype=np.int64)
        counts = np.bincount(self.task_ids[idx], minlength=len(self.task_names))
        return self.batch_bytes(counts, int(self.lengths[idx].max())) / MB

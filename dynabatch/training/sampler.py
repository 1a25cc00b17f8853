"""Memory-aware multi-task batch sampler (seed 001's ``MemoryAwareBatchSampler``).

A thin ``torch.utils.data`` batch sampler over
:func:`dynabatch.sampling.memory_aware.plan_memory_aware_batches`, built on
:class:`dynabatch.sampling.base.PlannedBatchSampler` (``set_epoch``,
``state_dict`` / ``load_state_dict`` resuming mid-epoch, the same number of
batches on every distributed rank). Memory comes from a
:class:`~dynabatch.MemoryPredictor` fitted to measured peaks: the sampler
takes a frozen snapshot of it when built, so an epoch's plan does not move
while the predictor keeps learning.

Tasks and sizes come from ``dataset.get_sample_metadata(idx)`` (a dict with
``task_type`` and optionally a size field such as ``length``, ``seq_length``,
``num_tokens`` or one you name with ``size_field``, e.g. ``"num_images"``), or
from ``task_types=`` / ``lengths=`` arrays.

Example:
    >>> from dynabatch.training.predictor import MemoryPredictor
    >>> from dynabatch.training.sampler import MemoryAwareBatchSampler
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

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_fraction,
    check_positive_int,
    check_positive_number,
)
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.memory_aware import (
    check_single_samples_fit,
    plan_memory_aware_batches,
)
from dynabatch.training.predictor import MB, MemoryPredictor, active_predictor

__all__ = ["STEP_SEPARATOR", "CountBatchSampler", "MemoryAwareBatchSampler", "StepBatchSampler", "read_task_metadata"]

_SIZE_FIELDS = ("length", "seq_length", "num_tokens")

STEP_SEPARATOR = -1
"""Marks the end of a micro-batch inside a :class:`StepBatchSampler` step."""


def read_task_metadata(dataset: Any, size_field: str | None = None) -> tuple[list[Hashable], np.ndarray]:
    """Task type and size of every sample of ``dataset``.

    Reads ``dataset.get_sample_metadata(idx)`` when the dataset has it, else
    ``dataset[idx]`` (a dict). The size is ``size_field`` when named, else the
    first of ``length`` / ``seq_length`` / ``num_tokens``, else the length of
    the sample's ``input_ids``, else 1.

    Raises:
        ValueError: a sample's metadata has no ``task_type`` (its index is named).
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
            sizes[idx] = int(meta[size_field])
            continue
        key = next((k for k in _SIZE_FIELDS if k in meta), None)
        if key is not None:
            sizes[idx] = int(meta[key])
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
        max_memory_mb: the memory budget of one batch (training step) in MB.
        shuffle: shuffle samples within tasks and the batch order each epoch.
        task_diversity_weight: 0 gives single-task batches, 1 batches that
            mirror the global task mix.
        seed: seeds all shuffling, with the epoch.
        predictor: a :class:`~dynabatch.MemoryPredictor` with measurements for
            every task; by default the one that last recorded a measurement.
        memory_margin: fraction of ``max_memory_mb`` kept free, in [0, 1).
        task_types, lengths: per-sample tasks and sizes, instead of reading the dataset.
        size_field: the metadata field holding a sample's size.
        is_training: plan with the predictor's training-step (or forward-only) fits.
        sort_window: sort each task's shuffled samples by length within windows of
            this many, so batches waste less on padding (``None``: no sorting).
        num_replicas, rank, shard: distributed sharding (see :class:`~dynabatch.sampling.base.PlannedBatchSampler`).

    Raises:
        ValueError: ``max_memory_mb`` <= 0, or below what one sample of a task
            needs (the task is named); a margin outside [0, 1); metadata without
            ``task_type``; a task the predictor has no measurement for.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        max_memory_mb: float,
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
        self.max_memory_mb = check_positive_number("max_memory_mb", max_memory_mb)
        if isinstance(memory_margin, bool) or not isinstance(memory_margin, (int, float)) or not 0 <= memory_margin < 1:
            raise bad_value("memory_margin", "a number in [0, 1)", memory_margin)
        self.memory_margin = float(memory_margin)
        self.task_diversity_weight = check_fraction("task_diversity_weight", task_diversity_weight)
        self.dataset = dataset
        if task_types is None:
            tasks, sizes = read_task_metadata(dataset, size_field)
        else:
            tasks = list(task_types)
            sizes = np.ones(len(tasks), dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
            if len(sizes) != len(tasks):
                raise bad_value("lengths", f"one length per task type ({len(tasks)})", f"<{len(sizes)} lengths>")
            for idx, task in enumerate(tasks):
                if task is None or not isinstance(task, Hashable):
                    raise bad_value(f"task_types[{idx}]", "a hashable task type", task)
        self.task_names: list[Hashable] = list(dict.fromkeys(tasks))
        position = {t: k for k, t in enumerate(self.task_names)}
        self.task_ids = np.array([position[t] for t in tasks], dtype=np.int64)
        self.lengths = sizes
        predictor = predictor if predictor is not None else active_predictor()
        if predictor is None:
            raise bad_value(
                "predictor",
                "a MemoryPredictor with measured peaks (none was given and none has recorded a "
                "measurement in this process: call record_actual_memory or calibrate first)",
                predictor,
            )
        if not isinstance(predictor, MemoryPredictor):
            raise bad_type("predictor", "a MemoryPredictor", predictor)
        self.predictor = predictor
        self.is_training = bool(is_training)
        self.batch_bytes = predictor.batch_memory_function(self.task_names, self.is_training)
        self.max_bytes = self.max_memory_mb * MB * (1.0 - self.memory_margin)
        check_single_samples_fit(
            self.task_ids, self.lengths, self.batch_bytes, self.max_bytes,
            name="max_memory_mb", value=max_memory_mb, task_names=self.task_names, unit=("MB", MB),
        )

    def plan(self, epoch: int) -> list[np.ndarray]:
        return plan_memory_aware_batches(
            self.task_ids,
            self.lengths,
            self.batch_bytes,
            self.max_bytes,
            batch_size=self.batch_size,
            task_diversity_weight=self.task_diversity_weight,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            sort_window=self.sort_window,
        )

    def identity(self) -> list[Any]:
        return [
            self.task_ids,
            self.lengths,
            self.batch_size,
            self.max_bytes,
            self.task_diversity_weight,
            self.sort_window,
            np.asarray(self.batch_bytes.coefficients),
        ]

    def predicted_mb(self, indices: Sequence[int]) -> float:
        """Predicted peak of a batch of these indices, in MB."""
        idx = np.asarray(indices, dtype=np.int64)
        counts = np.bincount(self.task_ids[idx], minlength=len(self.task_names))
        return self.batch_bytes(counts, int(self.lengths[idx].max())) / MB


class CountBatchSampler(PlannedBatchSampler):
    """Micro-batches of at most ``batch_size`` rows and no memory model (no predictor given)."""

    def __init__(self, task_ids: np.ndarray, lengths: np.ndarray, batch_size: int, weight: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.task_ids, self.lengths, self.batch_size, self.weight = task_ids, lengths, batch_size, weight

    def plan(self, epoch: int) -> list[np.ndarray]:
        return plan_memory_aware_batches(
            self.task_ids, self.lengths, lambda c, n: 0.0, 1.0, batch_size=self.batch_size,
            task_diversity_weight=self.weight, shuffle=self.shuffle, seed=self.seed, epoch=epoch,
        )

    def identity(self) -> list[Any]:
        return [self.task_ids, self.lengths, self.batch_size, self.weight]


class StepBatchSampler(PlannedBatchSampler):
    """Groups a sampler's micro-batches into optimizer steps of at least ``target_batch_size`` samples.

    Each yielded list is one step: the micro-batches' indices separated by
    :data:`STEP_SEPARATOR`. The last step of an epoch may hold fewer samples.
    Order, resumption and sharding act on whole steps.
    """

    def __init__(self, micro: PlannedBatchSampler, target_batch_size: int | None) -> None:
        if not isinstance(micro, PlannedBatchSampler):
            raise bad_type("micro", "a PlannedBatchSampler", micro)
        super().__init__(
            shuffle=micro.shuffle, seed=micro.seed, num_replicas=micro.num_replicas, rank=micro.rank, shard=micro.shard
        )
        self.micro = micro
        self.target_batch_size = None if target_batch_size is None else check_positive_int(
            "target_batch_size", target_batch_size
        )

    def plan(self, epoch: int) -> list[np.ndarray]:
        steps: list[np.ndarray] = []
        current: list[np.ndarray] = []
        rows = 0
        for batch in self.micro.plan(epoch):
            current.append(np.asarray(batch, dtype=np.int64))
            rows += len(batch)
            if self.target_batch_size is None or rows >= self.target_batch_size:
                steps.append(_join(current))
                current, rows = [], 0
        if current:
            steps.append(_join(current))
        return steps

    def identity(self) -> list[Any]:
        return [self.micro.fingerprint, self.target_batch_size]


def _join(batches: list[np.ndarray]) -> np.ndarray:
    sep = np.array([STEP_SEPARATOR], dtype=np.int64)
    parts = [p for b in batches for p in (b, sep)][:-1]
    return np.concatenate(parts)


def split_step(indices: Sequence[int]) -> list[list[int]]:
    """The micro-batches of a step from :class:`StepBatchSampler` (empty ones dropped)."""
    out: list[list[int]] = [[]]
    for i in indices:
        if i == STEP_SEPARATOR:
            out.append([])
        else:
            out[-1].append(int(i))
    return [b for b in out if b]

"""The plan of ``DynamicBatchingTrainer``: its optimizer steps, its task weights, and how a resume replays them.

The trainer's training data is a sequence of optimizer steps, each made of
micro-batches: :func:`step_sampler` builds the micro-batch sampler
(:class:`~dynabatch.compat.multitask.MemoryAwareBatchSampler` when a predictor and a budget
are given, else micro-batches of a fixed number of rows) and groups it into
steps with :class:`~dynabatch.training.step_sampler.StepBatchSampler`;
:class:`IndexedDataset` and :func:`collate_step` turn a step's indices into
the collated micro-batches. Under several processes the steps are dealt to
the ranks by accelerate (``shard=False``: every rank's steps, a multiple of
the world size, rank ``r`` taking the ``r``-th of each group), so every rank
runs the same number of steps and every sample is trained once per epoch.

Under several processes (DDP) a step's gradient is reduced once, whatever
number of backward passes each rank ran (an out-of-memory split adds some):
every backward runs without DDP's synchronisation and
:func:`~dynabatch.training.gradients.average_gradients` averages the accumulated gradients over the ranks
afterwards (:func:`reduce_step`); counts and losses are summed with
:func:`dynabatch.sampling.ranks.reduce_across_ranks`.

The task loss weights are checked by :func:`check_task_weights`. A
checkpoint holds :data:`STATE_FILE` (:func:`write_state` / :func:`read_state`):
the predictor state the plan was made from, the predictor and the task
weights, so a resumed run plans exactly as the saved one did.

Example:
    >>> import numpy as np
    >>> from dynabatch.compat.multitask._trainer_plan import collate_step, step_sampler
    >>> steps, planned_by_memory = step_sampler(
    ...     ["a"] * 5 + ["b"] * 5, np.arange(1, 11), rows=2, target_batch_size=4,
    ...     task_diversity_weight=0.0, seed=0, world_size=1)
    >>> planned_by_memory is None, len(steps)
    (True, 3)
    >>> sorted(i for step in steps for i in step if i >= 0)  # -1 separates micro-batches
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    >>> collate_step(list, [(4, "e"), (2, "c"), (-1, None), (7, "h")])
    {'micro_batches': [['e', 'c'], ['h']], 'sample_indices': [[4, 2], [7]]}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.compat.multitask.predictor import MemoryPredictor
from dynabatch.compat.multitask.sampler import MemoryAwareBatchSampler
from dynabatch.sampling.ranks import reduce_across_ranks
from dynabatch.training.gradients import average_gradients
from dynabatch.training.step_sampler import StepBatchSampler, split_step

__all__ = [
    "STATE_FILE",
    "IndexedDataset",
    "check_task_weights",
    "collate_step",
    "read_state",
    "reduce_step",
    "step_sampler",
    "write_state",
]

STATE_FILE = "dynabatch_state.json"
"""The file in each checkpoint folder holding the plan's predictor state and the task weights."""


class IndexedDataset(torch.utils.data.Dataset):
    """Hands the collator (index, sample) pairs, and the step separator (index -1) through."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> tuple[int, Any]:
        return (idx, None) if idx < 0 else (idx, self.dataset[idx])


def step_sampler(
    tasks: Sequence[Hashable],
    lengths: np.ndarray,
    *,
    rows: int,
    target_batch_size: int | None,
    task_diversity_weight: float,
    seed: int,
    world_size: int,
    rank: int = 0,
    max_steps: int = -1,
    num_train_epochs: float = 1.0,
    predictor: MemoryPredictor | None = None,
    max_memory_mb: float | None = None,
    memory_margin: float = 0.10,
    sort_window: int | None = None,
) -> tuple[StepBatchSampler, MemoryAwareBatchSampler | None]:
    """The step sampler of a training run, and its memory-planned micro-batch sampler (``None`` without one).

    Args:
        tasks, lengths: every sample's task and size.
        rows: at most this many rows per micro-batch.
        target_batch_size: samples per optimizer step (``None``: every micro-batch is a step).
        task_diversity_weight: the micro-batches' task mix (0 single-task ... 1 global mix).
        seed: seeds the shuffling, with the epoch.
        world_size, rank: the number of processes and this one's index; with
            several the sampler yields every rank's steps for accelerate to deal
            (``shard=False``).
        max_steps, num_train_epochs: the run's length, as in ``TrainingArguments``:
            every epoch it touches gets at least the most steps per rank any of
            them plans (HF fixes an epoch's steps from ``len()`` of the first;
            a longer epoch would lose its last steps).
        predictor, max_memory_mb, memory_margin, sort_window: plan the
            micro-batches under this memory budget (both predictor and budget given).
    """
    shard = {"shuffle": True, "seed": seed, "num_replicas": world_size, "rank": rank, "shard": world_size == 1}
    planned = predictor is not None and max_memory_mb is not None
    micro = MemoryAwareBatchSampler(
        None, rows, max_memory_mb if planned else None, task_diversity_weight=task_diversity_weight,
        predictor=predictor if planned else None, memory_margin=memory_margin, task_types=tasks, lengths=lengths,
        sort_window=sort_window if planned else None, **shard,
    )
    steps = StepBatchSampler(micro, target_batch_size)
    # Without sharding len() counts every rank's steps (max_len and set_min_batches are per rank).
    ranks = 1 if steps.shard else steps.num_replicas
    epochs = epochs_to_plan(max_steps, num_train_epochs, len(steps) // ranks)
    steps.set_min_batches(steps.max_len(epochs))
    return steps, micro if micro.calibrated else None


def epochs_to_plan(max_steps: int, num_train_epochs: float, steps_per_epoch: int) -> int:
    """How many epochs a run of ``max_steps`` (if > 0) or ``num_train_epochs`` touches (one more for ``max_steps``)."""
    if max_steps and max_steps > 0:
        return max(1, math.ceil(max_steps / max(1, steps_per_epoch))) + 1
    return max(1, math.ceil(num_train_epochs))


def collate_step(collator: Callable[[list[Any]], Any], items: list[tuple[int, Any]]) -> dict[str, Any]:
    """One step's ``micro_batches`` (each collated) and ``sample_indices`` from its (index, sample) pairs."""
    indices = split_step([i for i, _ in items])
    samples = {i: s for i, s in items if i >= 0}
    return {
        "micro_batches": [collator([samples[i] for i in group]) for group in indices],
        "sample_indices": indices,
    }


def write_state(
    folder: str,
    plan_predictor: dict[str, Any] | None,
    predictor: MemoryPredictor | None,
    task_weights: dict[Hashable, float],
) -> None:
    """Writes :data:`STATE_FILE` into a checkpoint ``folder``."""
    state = {
        "plan_predictor": plan_predictor,
        "predictor": predictor.state_dict() if predictor is not None else None,
        "task_weights": {str(k): v for k, v in task_weights.items()},
    }
    with open(os.path.join(folder, STATE_FILE), "w") as fh:
        json.dump(state, fh)


def read_state(
    folder: str | None, predictor: MemoryPredictor | None, task_weights: dict[Hashable, float]
) -> dict[str, Any] | None:
    """Restores a checkpoint ``folder``'s :data:`STATE_FILE` into ``predictor`` and ``task_weights`` (in place).

    Returns:
        The saved state (its ``plan_predictor``: the state of the predictor the
        saved run planned with), or ``None`` when the folder has no state file.
    """
    if not folder or not os.path.isfile(os.path.join(folder, STATE_FILE)):
        return None
    with open(os.path.join(folder, STATE_FILE)) as fh:
        saved = json.load(fh)
    if predictor is not None and saved.get("predictor") is not None:
        predictor.load_state_dict(saved["predictor"])
    for key, weight in saved["task_weights"].items():  # JSON keys are strings: back to the task they name
        task_weights[next((t for t in task_weights if str(t) == key), key)] = weight
    return saved


def check_task_weights(
    weights: dict[Hashable, float] | None, train_tasks: Sequence[Hashable] | None
) -> dict[Hashable, float]:
    """Every training task's loss weight: ``weights`` checked, the tasks it does not name weighing 1.

    Raises:
        TypeError: ``weights`` is not a dict.
        ValueError: it names a task absent from ``train_tasks`` (when known), or
            a weight is negative or not finite.
    """
    known = list(dict.fromkeys(train_tasks or []))
    if weights is None:
        return {t: 1.0 for t in known}
    if not isinstance(weights, dict):
        raise bad_type("task_loss_weights", "a dict of task type -> weight", weights)
    if train_tasks is not None:
        unknown = [t for t in weights if t not in known]
        if unknown:
            raise bad_value(
                "task_loss_weights", f"a dict over the training data's tasks {known} (unknown: {unknown})", weights
            )
    for task, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise bad_value(f"task_loss_weights[{task!r}]", "a finite number >= 0", w)
    return {**{t: 1.0 for t in known}, **{t: float(w) for t, w in weights.items()}}


def reduce_step(
    step_loss: float, task_sum: dict[Hashable, float], task_items: dict[Hashable, float], tasks: Sequence[Hashable],
    params: Sequence[torch.nn.Parameter] | None, world_size: int,
) -> tuple[float, dict[Hashable, float]]:
    """The end of a step under several processes: its loss and per-task losses over all ranks, its one gradient reduction.

    One ``all_reduce`` of [``step_loss``, each of ``tasks``' loss sum and item
    count, which of ``params`` have a gradient]; then, when ``params`` are
    given (DDP, all backward passes run without synchronisation), their
    gradients are averaged over the ranks (:func:`average_gradients`).
    ``tasks`` must be the same list on every rank. Returns the mean of the
    ranks' ``step_loss`` and each task's loss sum over its item count, both
    summed over the ranks (tasks with no items anywhere left out).
    """
    tasks = list(dict.fromkeys(tasks))
    k = len(tasks)
    values = [step_loss, *(task_sum.get(t, 0.0) for t in tasks), *(task_items.get(t, 0.0) for t in tasks)]
    values += [float(p.grad is not None) for p in params or ()]
    reduced = reduce_across_ranks(values)
    if params is not None:
        average_gradients(params, [n > 0 for n in reduced[1 + 2 * k:]], world_size)
    sums, counts = reduced[1:1 + k], reduced[1 + k:1 + 2 * k]
    return reduced[0] / world_size, {t: s / n for t, s, n in zip(tasks, sums, counts) if n > 0}

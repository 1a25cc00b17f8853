"""Memory-aware multi-task batch planning: pure numpy, no model needed.

:func:`plan_memory_aware_batches` cuts an epoch of samples (a task id and a
length each) into batches whose predicted memory stays under a budget, with a
tunable task mix:

* ``task_diversity_weight=0``: every batch holds one task;
* ``task_diversity_weight=1``: every batch mirrors the global task mix
  (tasks interleaved in proportion to their counts);
* in between: tasks arrive in overlapping runs, so batches hold a few tasks.

Memory comes from ``batch_bytes(counts, padded_length)``, ``counts[k]`` being
the rows of task ``k``; :meth:`dynabatch.compat.multitask.MemoryPredictor.batch_memory_function`
gives one fitted from measured peaks. Whether a batch fits is the
:class:`~dynabatch.memory.budget.MemoryBudget`'s answer (the margin, the shapes
that ran out of memory). Without a budget (memory not measured yet) batches are
``batch_size`` rows. Every index is planned exactly once; the batch predicted
costliest comes first, so an out-of-memory error shows at step one.

Example:
    >>> import numpy as np
    >>> from dynabatch.compat.multitask.memory_aware import plan_memory_aware_batches
    >>> tasks = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    >>> lengths = np.array([10, 10, 10, 10, 40, 40, 40, 40])
    >>> cost = lambda counts, length: 100 + counts.sum() * length  # bytes
    >>> plan = plan_memory_aware_batches(tasks, lengths, cost, 200, task_diversity_weight=0.0, shuffle=False)
    >>> [b.tolist() for b in plan]  # the costliest (200 bytes) first
    [[4, 5], [0, 1, 2, 3], [6, 7]]
    >>> mixed = plan_memory_aware_batches(tasks, lengths, cost, 10_000, task_diversity_weight=1.0, batch_size=4)
    >>> [sorted(tasks[b].tolist()) for b in mixed]
    [[0, 0, 1, 1], [0, 0, 1, 1]]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_bool,
    check_fraction,
    check_lengths,
    check_non_negative_int,
    check_positive_int,
)
from dynabatch.memory.budget import MemoryBudget, parse_memory

__all__ = ["BatchBytes", "check_single_samples_fit", "plan_memory_aware_batches", "task_order"]

BatchBytes = Callable[[np.ndarray, int], float]
"""``batch_bytes(counts, padded_length) -> bytes``: the predicted peak of a batch;
``counts[k]`` is its rows of task ``k``, for ``k`` up to the largest task id planned."""


def _no_bytes(counts: np.ndarray, padded_length: int) -> float:
    """No memory model: every batch costs nothing (``batch_size`` alone bounds it)."""
    return 0.0


def check_single_samples_fit(
    task_ids: np.ndarray,
    lengths: np.ndarray,
    batch_bytes: BatchBytes,
    budget: MemoryBudget,
    *,
    name: str = "budget",
    value: object = None,
    task_names: list | None = None,
    unit: tuple[str, float] = ("bytes", 1.0),
) -> None:
    """Raises ValueError naming the task whose longest sample alone ``budget`` does not allow: predicted above its
    bytes, or (``allows``) not narrower than a shape that ran out of memory on one row.

    ``name``/``value`` are the argument the user gave (``value`` defaults to
    the budget's bytes), ``task_names[k]`` names task ``k`` and ``unit`` is the
    (label, bytes) the message uses.
    """
    limit = budget.budget_bytes
    given = limit if value is None else value
    num_tasks = int(task_ids.max()) + 1 if task_ids.size else 0
    for task in range(num_tasks):
        mine = lengths[task_ids == task]
        if not mine.size:
            continue
        counts = np.zeros(num_tasks, dtype=np.int64)
        counts[task] = 1
        need = batch_bytes(counts, int(mine.max()))
        label = task_names[task] if task_names is not None else task
        if need > limit:
            raise ValueError(
                f"{name} should be at least what one sample needs (task {label!r} at length {int(mine.max())} "
                f"needs {need / unit[1]:.4g} {unit[0]} within the margin), "
                f"but got {name}={given!r}"
            )
        if not bool(budget.allows(1, int(mine.max()), need)):
            raise ValueError(
                f"{name} should allow one sample alone (task {label!r} at length {int(mine.max())} is at least "
                f"as large as a shape that ran out of memory, of {budget.failed_shapes} (rows, width)), "
                f"but got {name}={given!r}"
            )


def task_order(
    task_ids: np.ndarray,
    task_diversity_weight: float,
    rng: np.random.Generator | None,
    lengths: np.ndarray | None = None,
    sort_window: int | None = None,
) -> np.ndarray:
    """The order samples are taken in: task runs (weight 0) to proportional interleaving (weight 1).

    Each sample gets a key mixing its task's block position with its spread
    position inside the task; ``rng`` shuffles within tasks and the task
    order (``None``: input order, tasks by id). With ``sort_window``, each
    task's (shuffled) samples are sorted by length within consecutive windows
    of that many samples, so neighbours have similar lengths (less padding).
    """
    n = task_ids.size
    num_tasks = int(task_ids.max()) + 1 if n else 0
    rank = np.empty(n, dtype=np.float64)
    counts = np.bincount(task_ids, minlength=num_tasks)
    for task in range(num_tasks):
        where = np.flatnonzero(task_ids == task)
        if rng is not None:
            where = rng.permutation(where)
        if sort_window is not None and lengths is not None:
            where = np.concatenate([
                chunk[np.argsort(lengths[chunk], kind="stable")]
                for chunk in np.split(where, np.arange(sort_window, where.size, sort_window))
            ]) if where.size else where
        rank[where] = np.arange(where.size)
    jitter = rng.uniform(0.0, 1.0, size=n) if rng is not None else np.full(n, 0.5)
    spread = (rank + jitter) / np.maximum(counts[task_ids], 1)  # in [0, 1): position inside the task
    block_of = rng.permutation(num_tasks) if rng is not None else np.arange(num_tasks)
    block = (block_of[task_ids] + spread) / max(num_tasks, 1)
    key = (1.0 - task_diversity_weight) * block + task_diversity_weight * spread
    return np.lexsort((rank, task_ids, key))


def plan_memory_aware_batches(
    task_ids: np.ndarray,
    lengths: np.ndarray,
    batch_bytes: BatchBytes | None,
    budget: MemoryBudget | float | None,
    *,
    batch_size: int | None = None,
    task_diversity_weight: float = 0.5,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    sort_window: int | None = None,
) -> list[np.ndarray]:
    """Plans one epoch of batches (arrays of positions) under a memory budget.

    Args:
        task_ids: task of each sample, as integers ``0..K-1``.
        lengths: length (or other size) of each sample; a batch is padded to its longest.
        batch_bytes: predicted peak bytes of a batch (see :data:`BatchBytes`);
            it must not decrease when rows or length grow. ``None`` with ``budget=None``.
        budget: what a batch may cost: a :class:`~dynabatch.memory.budget.MemoryBudget`
            (its ``allows``: the margin, the shapes that ran out of memory), a
            number of bytes (no margin), or ``None``: memory is not measured and
            batches are ``batch_size`` rows.
        batch_size: at most this many rows per batch (``None``: memory alone decides).
        task_diversity_weight: 0 single-task batches ... 1 batches that mirror the global mix.
        shuffle: shuffle within tasks and the task order (seeded per epoch). The batch
            predicted costliest comes first, the others in plan order: a sampler
            (:class:`dynabatch.compat.multitask.MemoryAwareBatchSampler`) shuffles the batch order.
        seed: with ``epoch``, seeds a local generator (the global random state is untouched).
        epoch: the epoch being planned.
        sort_window: sort each task's samples by length within windows of this many
            (after shuffling): fewer padded tokens, batches still varied across the epoch.

    Returns:
        The batches; every position in ``range(len(task_ids))`` appears exactly once.

    Raises:
        ValueError: a sample alone is predicted above the budget, or is as large as a shape
            the budget saw run out of memory (its task is named), or the arguments are out of range.
    """
    task_ids = check_lengths("task_ids", task_ids, what="task ids")
    lengths = check_lengths("lengths", lengths)
    if lengths.size != task_ids.size:
        raise bad_value("lengths", f"one length per task id ({task_ids.size})", f"<{lengths.size} lengths>")
    if batch_size is not None:
        batch_size = check_positive_int("batch_size", batch_size)
    if budget is None:
        if batch_size is None:
            raise bad_value("batch_size", "a positive integer without a memory budget", batch_size)
        batch_bytes = _no_bytes
        budget = MemoryBudget(None, 1.0, memory_margin=0.0)  # every batch costs 0 bytes: batch_size decides
    elif not isinstance(budget, MemoryBudget):
        budget = MemoryBudget(None, parse_memory(budget, "budget"), memory_margin=0.0)
    if not callable(batch_bytes):
        raise bad_type("batch_bytes", "a callable (counts, padded_length) -> bytes", batch_bytes)
    weight = check_fraction("task_diversity_weight", task_diversity_weight)
    check_bool("shuffle", shuffle)
    rng = np.random.default_rng([check_non_negative_int("seed", seed), check_non_negative_int("epoch", epoch)])
    if task_ids.size == 0:
        return []
    check_single_samples_fit(task_ids, lengths, batch_bytes, budget,
                             name="budget", value=budget.max_memory)

    num_tasks = int(task_ids.max()) + 1
    if sort_window is not None:
        sort_window = check_positive_int("sort_window", sort_window)
    order = task_order(task_ids, weight, rng if shuffle else None, lengths, sort_window)
    batches: list[np.ndarray] = []
    costs: list[float] = []
    counts = np.zeros(num_tasks, dtype=np.int64)
    current: list[int] = []
    padded, cost = 0, 0.0
    for i in order.tolist():
        task, length = int(task_ids[i]), int(lengths[i])
        if current:
            counts[task] += 1
            new_padded = max(padded, length)
            new_cost = batch_bytes(counts, new_padded)
            counts[task] -= 1
            full = batch_size is not None and len(current) >= batch_size
            other_task = weight == 0.0 and task_ids[current[-1]] != task
            if not (full or other_task or not budget.allows(len(current) + 1, new_padded, new_cost)):
                current.append(i)
                counts[task] += 1
                padded, cost = new_padded, new_cost
                continue
            batches.append(np.array(current, dtype=np.int64))
            costs.append(cost)
            counts[:] = 0
        current = [i]
        counts[task] = 1
        padded = length
        cost = batch_bytes(counts, padded)
    batches.append(np.array(current, dtype=np.int64))
    costs.append(cost)

    first = int(np.argmax(costs))
    return [batches[first]] + batches[:first] + batches[first + 1 :]

"""Planning to a memory budget with a calibrated memory model. Pure numpy.

Lengths sorted longest first are cut into consecutive batches; a batch
starting at sorted position ``p`` has longest row ``L = sorted_lengths[p]``
and takes as many rows as the :class:`~dynabatch.memory.budget.MemoryBudget`
allows there (one vectorised :meth:`~dynabatch.memory.budget.MemoryBudget.max_rows`
call over the distinct lengths, at the width the collator pads to, then one
walk over the batches). The budget also keeps out every shape at least as
large as one that ran out of memory.

* **Relative** (``max_memory=None``, the spec's semantics): the first batch is
  exactly the ``batch_size`` longest texts and its *predicted* peak is the
  budget. Every later batch takes the most rows whose predicted peak is at or
  under ``(1 - memory_margin)`` x budget, and never fewer than ``batch_size``:
  ``batch_size`` rows of a text no longer than the first batch's are never
  predicted above the first batch's peak (the model grows with length), so when
  even they do not fit under the margin they are what the batch takes.
* **Absolute** (``max_memory`` in bytes, ``"12GB"``, ``"512MiB"``, or ``"80%"``
  of the CUDA device's free memory): every batch, the first included, takes the
  most rows predicted at or under ``(1 - memory_margin) x max_memory``;
  ``batch_size`` plays no part. A text whose single row is predicted above it
  is a batch of one row on its own, counted and logged as a warning.

With ``granularity``, a batch's rows are rounded down to a multiple of it when
at least one multiple fits (the last batch takes what remains).

Example:
    >>> import numpy as np
    >>> from dynabatch.memory.model import MemoryModel
    >>> from dynabatch.sampling.budget import plan_batch_sizes_to_budget
    >>> shapes = [(1, 8), (4, 64), (32, 16), (4, 128)]  # measured peaks: 1000 + 100 bytes a token
    >>> mm = MemoryModel().fit(*zip(*shapes), [1000 + r * 100 * L for r, L in shapes])
    >>> lengths = np.array([128] * 4 + [64] * 8 + [16] * 40)
    >>> plan_batch_sizes_to_budget(lengths, mm, batch_size=4).tolist()  # 0.9 x (1000 + 4 x 12800) = 46980
    [4, 7, 7, 28, 6]
    >>> plan_batch_sizes_to_budget(lengths, mm, max_memory=20_000, memory_margin=0).tolist()
    [1, 1, 1, 1, 2, 2, 2, 2, 11, 11, 11, 7]
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dynabatch._validation import bad_value, check_lengths, check_positive_int
from dynabatch.memory.budget import MemoryBudget

__all__ = ["plan_batch_sizes_to_budget", "plan_batches_to_budget", "plan_budget", "plan_sizes_under"]

logger = logging.getLogger(__name__)


def _check_sorted(sorted_lengths: Any) -> np.ndarray:
    arr = check_lengths("sorted_lengths", sorted_lengths)
    if arr.size > 1 and (arr[1:] > arr[:-1]).any():
        raise bad_value("sorted_lengths", "sorted longest first", "an unsorted array")
    return arr


def plan_sizes_under(lengths: np.ndarray, budget: MemoryBudget, *, first: int = 0,
                     granularity: int | None = None) -> np.ndarray:
    """Batch sizes over ``lengths`` (sorted longest first), each the most rows ``budget`` allows.

    Args:
        lengths: token lengths, longest first (checked by the callers).
        budget: the memory budget every batch (but a ``first`` one) keeps.
        first: ``> 0``: the first batch is exactly that many rows and no later
            batch has fewer (relative mode); ``0``: every batch is sized by the
            budget, one row at the least.
        granularity: round rows down to a multiple of it where one fits.
    """
    n = len(lengths)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    first = min(first, n)
    # One max_rows call per distinct length (lengths are sorted, so runs are contiguous).
    starts = np.flatnonzero(np.r_[True, lengths[1:] != lengths[:-1]])
    per_length = np.asarray(budget.max_rows(lengths[starts]), dtype=np.int64)
    if granularity is not None:
        rounded = per_length - per_length % granularity
        per_length = np.where(rounded > 0, rounded, per_length)
    per_length = np.maximum(per_length, first or 1).tolist()
    ends = np.r_[starts[1:], n].tolist()

    # One step per run of equal lengths: every batch starting inside a run has that run's rows
    # (the last one may reach into the next, shorter run).
    pieces = [np.array([first], dtype=np.int64)] if first else []
    pos, run = first, 0
    while pos < n:
        while ends[run] <= pos:
            run += 1
        rows = per_length[run]
        count = -(-(ends[run] - pos) // rows)
        pieces.append(np.full(count, rows, dtype=np.int64))
        pos += count * rows
    out = np.concatenate(pieces)
    out[-1] -= pos - n if pos > n else 0
    if not first:
        over = int(np.count_nonzero(np.asarray(budget.max_rows(lengths[np.cumsum(out) - out])) == 0))
        if over:
            logger.warning("%d texts are predicted above the memory budget of %.0f bytes on their own; each is a "
                           "batch of one row", over, budget.budget_bytes)
    return out


def plan_budget(sorted_lengths: np.ndarray, memory_model: Any, *, first: int, max_memory: Any,
                memory_margin: float, pad_to_multiple_of: int | None, device: Any = None) -> MemoryBudget:
    """A plan's budget: relative to its first batch (``first`` > 0 rows of the longest length), else ``max_memory``."""
    reference = (min(first, len(sorted_lengths)), max(1, int(sorted_lengths[0]))) if first else None
    return MemoryBudget(memory_model, None if reference else max_memory, memory_margin=memory_margin,
                        reference_batch=reference, pad_to_multiple_of=pad_to_multiple_of, device=device)


def plan_batch_sizes_to_budget(
    sorted_lengths: Any,
    memory_model: Any,
    *,
    batch_size: int | None = None,
    max_memory: Any = None,
    memory_margin: float = 0.10,
    granularity: int | None = None,
    pad_to_multiple_of: int | None = None,
    device: Any = None,
) -> np.ndarray:
    """Batch sizes over lengths sorted longest first, each the most rows the memory model allows.

    Args:
        sorted_lengths: token lengths, longest first.
        memory_model: has ``predict(rows, padded_length)`` (a
            :class:`~dynabatch.memory.model.MemoryModel`; its ``max_rows`` closed form is used).
        batch_size: relative mode: the first batch's rows (required there).
        max_memory: ``None`` (relative) or the budget (see :func:`~dynabatch.memory.budget.parse_memory`).
        memory_margin: predicted peaks stay at or under ``(1 - memory_margin)`` x budget; in [0, 1).
        granularity: round rows down to a multiple of it where one fits.
        pad_to_multiple_of: the collator's rounding of widths: batches are sized at their padded width.
        device: the CUDA device of a percentage ``max_memory``.

    Returns:
        ``int64`` sizes; batch ``i`` is ``sorted_lengths[sum(sizes[:i]):sum(sizes[:i + 1])]``.
    """
    lengths = _check_sorted(sorted_lengths)
    if granularity is not None:
        granularity = check_positive_int("granularity", granularity)
    first = 0
    if max_memory is None:
        if batch_size is None:
            raise bad_value("batch_size", "a positive integer in relative mode (max_memory=None)", batch_size)
        first = check_positive_int("batch_size", batch_size)
    if max_memory is None and len(lengths) == 0:
        return np.empty(0, dtype=np.int64)
    budget = plan_budget(lengths, memory_model, first=first, max_memory=max_memory, memory_margin=memory_margin,
                         pad_to_multiple_of=pad_to_multiple_of, device=device)
    return plan_sizes_under(lengths, budget, first=first, granularity=granularity)


def plan_batches_to_budget(lengths: Any, memory_model: Any, **kwargs: Any) -> list[np.ndarray]:
    """Batches of input positions (longest first) from token lengths in input order.

    The keyword arguments are those of :func:`plan_batch_sizes_to_budget`.
    Every position appears exactly once.

    Example:
        >>> from dynabatch.memory.model import MemoryModel
        >>> mm = MemoryModel().fit([1, 2, 4], [4, 8, 2], [10, 40, 20])  # 2.5 bytes a token
        >>> [b.tolist() for b in plan_batches_to_budget([2, 8, 4, 8], mm, max_memory=40, memory_margin=0)]
        [[1, 3], [2, 0]]
    """
    arr = check_lengths("lengths", lengths)
    order = np.argsort(-arr, kind="stable")
    sizes = plan_batch_sizes_to_budget(arr[order], memory_model, **kwargs)
    return np.split(order, np.cumsum(sizes)[:-1]) if len(sizes) else []

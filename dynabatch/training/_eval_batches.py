"""Evaluation and prediction batches for the HF ``Trainer`` hook: planned longest first, results put back in order.

The evaluation batches are the inference planner's (:func:`~dynabatch.sampling.planner.plan_batches`):
the ``batch_size`` longest rows first, later batches grown as rows get shorter
while the planned peak stays under the first batch's. The ``Trainer`` gathers
predictions in the order the batches come; :func:`in_order` takes them back to
dataset order.

Example:
    >>> import numpy as np
    >>> batches = plan_eval_batches(np.array([3, 9, 5, 1]), batch_size=2)
    >>> [b.tolist() for b in batches][0]  # the two longest first
    [1, 2]
    >>> order = np.concatenate(batches)
    >>> in_order(np.array([30, 90, 50, 10])[order], np.argsort(order)).tolist()
    [30, 90, 50, 10]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from dynabatch._validation import check_lengths
from dynabatch.memory.shape import ModelShape
from dynabatch.sampling.planner import plan_batches

__all__ = ["eval_lengths", "in_order", "plan_eval_batches"]

logger = logging.getLogger(__name__)


def eval_lengths(dataset: Any, field: str) -> np.ndarray | None:
    """Each row's length of ``field`` (Arrow offsets for a ``datasets.Dataset``); ``None`` when rows have no such field."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        if field not in columns:
            return None
        from dynabatch.data.sources import _list_lengths

        return _list_lengths(dataset, field)
    try:
        first = dataset[0] if len(dataset) else None
    except (TypeError, KeyError, IndexError):
        return None
    if not isinstance(first, Mapping) or field not in first:
        return None
    return check_lengths(f"len(eval_dataset[i][{field!r}])",
                         np.fromiter((len(dataset[i][field]) for i in range(len(dataset))), np.int64, len(dataset)))


def plan_eval_batches(lengths: np.ndarray, batch_size: int, model_shape: ModelShape | None = None) -> list[np.ndarray]:
    """Batches of row positions, longest first: the inference planner's plan (``batch_size`` rows first)."""
    if lengths.size == 0:
        return []
    longest = max(1, int(lengths.max()))
    return plan_batches(lengths, batch_size, longest, model_shape=model_shape)


def in_order(value: Any, inverse: np.ndarray) -> Any:
    """``value`` (an array or a tuple, list or dict of them, one row per yielded row) back in dataset order."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return value[inverse] if value.ndim and len(value) == len(inverse) else value
    if isinstance(value, (tuple, list)):
        return type(value)(in_order(v, inverse) for v in value)
    if isinstance(value, Mapping):
        return {key: in_order(v, inverse) for key, v in value.items()}
    return value

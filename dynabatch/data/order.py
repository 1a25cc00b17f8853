"""Putting per-batch outputs back in input order.

Batches are planned by length, not in input order, so each
:class:`~dynabatch.data.collate.Batch` carries ``indices``, the input positions of
its rows. Collect one output and ``batch.indices`` per batch, and
:func:`restore_order` returns one item per input position, in input order.
Positions, not texts, are the key, so duplicate texts are no problem; outputs
of different widths across batches (e.g. ``generate`` results) are fine since
rows come back separately.

The usual loop collects both, batch by batch::

    outputs, indices = [], []
    for batch in loader:
        outputs.append(model(**batch.to(device)).logits.cpu())
        indices.append(batch.indices)
    logits = restore_order(outputs, indices)  # logits[p] belongs to texts[p]

Example:
    >>> import torch
    >>> from dynabatch.data.order import restore_order
    >>> outputs = [torch.tensor([[20, 21], [30, 31]]), ["x", "y"]]  # one entry per batch
    >>> indices = [torch.tensor([2, 3]), [1, 0]]  # the batch.indices of each batch
    >>> restore_order(outputs, indices)
    ['y', 'x', tensor([20, 21]), tensor([30, 31])]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value

__all__ = ["POSITIONS_RULE", "as_positions", "restore_order"]

logger = logging.getLogger(__name__)

_OUTPUT_RULE = "a torch.Tensor, numpy array, list or tuple with one item per row"


POSITIONS_RULE = "a 1-D torch tensor, numpy array or list of int positions"


def as_positions(name: str, value: Any, rule: str = POSITIONS_RULE, *, shape_in_message: bool = False) -> np.ndarray:
    """``value`` (a tensor, numpy array, list, tuple or range of int) as a 1-D int64 array; errors name ``name``.

    An array of another shape is refused showing the value (or its shape, with ``shape_in_message``).

    Example:
        >>> import torch
        >>> as_positions("indices", torch.tensor([3, 1])).tolist()
        [3, 1]
    """
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().numpy()
    elif isinstance(value, (np.ndarray, list, tuple, range)):
        array = np.asarray(value)
    else:
        raise bad_type(name, rule, value)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise bad_value(name, rule, f"array of shape {array.shape}" if shape_in_message else value)
    if not np.issubdtype(array.dtype, np.integer):
        raise bad_type(name, rule, value)
    return array.astype(np.int64, copy=False)


def _rows(name: str, value: Any) -> list:
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise bad_value(name, f"{_OUTPUT_RULE} (a batch dimension first)", value)
        return list(value.unbind(0))
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise bad_value(name, f"{_OUTPUT_RULE} (a batch dimension first)", value)
        return list(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    raise bad_type(name, _OUTPUT_RULE, value)


def restore_order(outputs: Sequence[Any], indices: Sequence[Any]) -> list:
    """Returns the rows of all batches in input order.

    Args:
        outputs: one entry per batch: a ``torch.Tensor`` or numpy array with
            the batch dimension first, or a list or tuple with one item per row.
        indices: one entry per batch, in the same order: the input positions
            of its rows (``batch.indices``; a tensor, numpy array or list of int).

    Returns:
        A list with one item per input position: item ``p`` is the row whose
        position is ``p``. Tensor and array rows come back as ``t[i]``, list
        items as they are.

    Raises:
        TypeError: ``outputs``/``indices`` or one of their entries of the wrong type.
        ValueError: ``outputs`` and ``indices`` of different lengths, a batch
            whose row count differs from its number of positions, or positions
            that are not each of ``0..n-1`` exactly once.
    """
    for name, value in (("outputs", outputs), ("indices", indices)):
        if not isinstance(value, (list, tuple)):
            raise bad_type(name, "a list with one entry per batch", value)
    if len(outputs) != len(indices):
        raise bad_value("len(indices)", f"len(outputs)={len(outputs)}, one entry per batch", len(indices))

    rows: list = []
    positions: list[np.ndarray] = []
    for b, (output, index) in enumerate(zip(outputs, indices)):
        batch_rows = _rows(f"outputs[{b}]", output)
        batch_positions = as_positions(f"indices[{b}]", index)
        if len(batch_rows) != len(batch_positions):
            raise bad_value(
                f"len(outputs[{b}])",
                f"len(indices[{b}])={len(batch_positions)}, one row per position",
                len(batch_rows),
            )
        rows.extend(batch_rows)
        positions.append(batch_positions)

    n = len(rows)
    if n == 0:
        return []
    flat = np.concatenate(positions)
    negative = np.flatnonzero(flat < 0)
    if negative.size:
        b, j = _locate(positions, int(negative[0]))
        raise bad_value(f"indices[{b}][{j}]", f"a position in range({n})", int(flat[negative[0]]))

    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    rule = f"1 (every position in range({n}) exactly once, one per row)"
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if repeated.size:
        k = int(repeated[0])
        value = int(ordered[k])
        where = " and ".join("indices[{}][{}]".format(*_locate(positions, int(order[i]))) for i in (k, k + 1))
        count = int(np.count_nonzero(ordered == value))
        raise bad_value(f"indices.count({value})", f"{rule}; it is at {where}", count)
    misplaced = np.flatnonzero(ordered != np.arange(n))
    if misplaced.size:
        # n distinct non-negative positions but not 0..n-1: the first gap is missing.
        raise bad_value(f"indices.count({int(misplaced[0])})", rule, 0)
    return [rows[i] for i in order.tolist()]


def _locate(positions: list[np.ndarray], flat_index: int) -> tuple[int, int]:
    """Batch number and row within it of the ``flat_index``-th position."""
    ends = np.cumsum([len(p) for p in positions])
    b = int(np.searchsorted(ends, flat_index, side="right"))
    start = int(ends[b - 1]) if b else 0
    return b, flat_index - start

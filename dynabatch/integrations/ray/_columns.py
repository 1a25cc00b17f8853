"""Columns in and out of a Ray Data window: checked names and options, results as one column."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value

__all__ = ["as_numpy", "check_column", "check_options", "columns_of", "to_column"]


def check_column(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_type(name, "a column name (a non-empty str)", value)
    if not value:
        raise bad_value(name, "a column name (a non-empty str)", value)
    return value


def check_options(name: str, value: Any, own: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_type(name, "None or a dict of keyword arguments", value)
    taken = sorted(set(value) & set(own))
    if taken:
        raise bad_value(name, f"a dict without the keywords DynamicBatchPredictor sets itself {list(own)}",
                        dict(value))
    return dict(value)


def as_numpy(item: Any) -> Any:
    """A result row with its tensors as numpy arrays (inside plain tuples, lists and dicts too)."""
    import torch

    if isinstance(item, torch.Tensor):
        item = item.detach().cpu()
        if item.dtype == torch.bfloat16:  # numpy has no bfloat16
            item = item.float()
        return item.numpy()
    if type(item) in (list, tuple):
        return type(item)(as_numpy(x) for x in item)
    if type(item) is dict:
        return {key: as_numpy(value) for key, value in item.items()}
    return item


def to_column(results: list[Any]) -> np.ndarray:
    """One column from per-row results: stacked when every row is an array of one shape and dtype.

    Tensors become numpy arrays. Rows that are arrays of one shape and dtype
    (an embedding, logits, a scalar) are stacked into one array, which Ray
    stores as a tensor column; anything else (``generate`` token ids of their
    own lengths, strings, dicts, a ``None`` for a failed row) is an object
    array with one item per row.

    Example:
        >>> import torch
        >>> to_column([torch.ones(3), torch.zeros(3)]).shape
        (2, 3)
        >>> column = to_column([torch.tensor([5, 6]), torch.tensor([7]), None])
        >>> column.dtype, [None if r is None else r.tolist() for r in column]
        (dtype('O'), [[5, 6], [7], None])
    """
    rows = [as_numpy(r) for r in results]
    if rows and all(isinstance(r, np.ndarray) for r in rows):
        first = rows[0]
        if all(r.shape == first.shape and r.dtype == first.dtype for r in rows):
            return np.stack(rows)
    column = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        column[i] = row
    return column


def columns_of(batch: Any) -> tuple[list[str], Any]:
    """The batch's column names, and whether it is a pandas DataFrame (else a dict of arrays)."""
    if isinstance(batch, Mapping):
        return list(batch), False
    if hasattr(batch, "columns") and hasattr(batch, "assign"):  # a pandas DataFrame
        return [str(c) for c in batch.columns], True
    raise bad_type("batch", "a dict of numpy arrays (map_batches' default batch_format) or a pandas DataFrame",
                   batch)

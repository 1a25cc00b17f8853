"""Arrow columns back to rows (:func:`decode_rows`) and stacked (:func:`stack_columns`), by a results :class:`Layout`.

The reading side of :mod:`dynabatch.inference._columns`: a row comes back as
``run`` gave it (tensors with their dtype, ``bfloat16`` too, and shape; numpy
arrays and scalars; Python scalars; tuples, lists and dicts), each tensor in
its own compact storage; a null row (an input without a result) as ``None``.

Example:
    >>> import torch
    >>> from dynabatch.inference._columns import Layout
    >>> from dynabatch.inference._decode import decode_rows, stack_columns
    >>> rows = [(torch.tensor([1.0, 2.0]), "a"), (torch.tensor([3.0, 4.0]), "b")]
    >>> layout = Layout.infer(rows)
    >>> decode_rows(layout, layout.encode(rows))[1]
    (tensor([3., 4.]), 'b')
    >>> vectors, labels = stack_columns(layout, layout.encode(rows), as_tensor=False)
    >>> vectors.shape, labels.tolist()
    ((2, 2), ['a', 'b'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dynabatch.inference._columns import Layout, _build, _Spec

__all__ = ["decode_rows", "stack_columns"]


def _flat_values(array: pa.Array, spec: _Spec) -> tuple[np.ndarray, np.ndarray | None]:
    """A column without nulls as numpy: ``(values of shape (rows, *shape), None)``, or for a ragged column
    ``(values of shape (total, *shape[1:]), lengths)``."""
    lengths = None
    if spec.ragged:
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
        array = array.flatten()
    inner = spec.shape[1:] if spec.ragged else spec.shape
    for _ in inner:
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    rows = len(values) // max(1, int(np.prod(inner, dtype=np.int64))) if inner else len(values)
    return values.reshape(rows, *inner), lengths


def _as_tensor(values: np.ndarray, spec: _Spec) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(values, copy=True))
    return tensor.to(torch.bfloat16) if spec.dtype == "bfloat16" else tensor


def _column_rows(array: pa.Array, spec: _Spec) -> list:
    if spec.kind in ("scalar", "values"):
        return array.to_pylist()
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    values, lengths = _flat_values(array.filter(valid) if not valid.all() else array, spec)
    if spec.kind == "tensor":
        whole = _as_tensor(values, spec)
        parts = whole.split(lengths.tolist()) if lengths is not None else whole.unbind(0)
        rows = [part.clone() for part in parts]
    elif lengths is not None:
        rows = [np.array(part) for part in np.split(values, np.cumsum(lengths)[:-1])] if len(lengths) else []
    else:
        rows = list(values) if not spec.shape else [np.array(v) for v in values]
    if valid.all():
        return rows
    out: list = [None] * len(array)
    for i, row in zip(np.flatnonzero(valid).tolist(), rows):
        out[i] = row
    return out


def _as_array(column: Any) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def decode_rows(layout: Layout, columns: Mapping[str, Any]) -> list:
    """Rows back from columns (arrays or chunked arrays of one length), as ``run`` gives them; a null row -> ``None``."""
    decoded = {name: _column_rows(_as_array(columns[name]), spec) for name, spec in layout.specs.items()}
    if "column" in layout.tree:
        return decoded[layout.tree["column"]]
    n = len(next(iter(decoded.values()))) if decoded else 0
    return [_build(layout.tree, decoded, i) for i in range(n)]


def _stacked(array: pa.Array, spec: _Spec, name: str, as_tensor: bool) -> Any:
    if array.null_count:
        raise ValueError(f"{name} should have a value in every row to stack, but got None in {array.null_count} "
                         "rows; read rows one by one or use to_arrow()")
    if spec.kind == "values":
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError(f"{name} should have rows of one length to stack, but got lengths from "
                             f"{int(lengths.min())} to {int(lengths.max())}; read rows one by one or use to_arrow()")
        values = array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), -1)
    elif spec.kind == "scalar":
        values = array.to_numpy(zero_copy_only=False)
    else:
        values, lengths = _flat_values(array, spec)
        if lengths is not None:
            if len(lengths) and (lengths != lengths[0]).any():
                raise ValueError(f"{name} should have rows of one shape to stack, but got first dimensions from "
                                 f"{int(lengths.min())} to {int(lengths.max())} (rows of different lengths); read "
                                 "rows one by one or use to_arrow()")
            values = values.reshape(len(lengths), int(lengths[0]) if len(lengths) else 0, *spec.shape[1:])
    if not as_tensor:
        return values
    if values.dtype.kind not in "biuf":
        raise TypeError(f"{name} should hold numbers or bools to stack as a tensor, but got dtype {values.dtype}")
    return _as_tensor(values, spec) if spec.kind == "tensor" else torch.from_numpy(np.array(values, copy=True))


def stack_columns(layout: Layout, columns: Mapping[str, Any], *, as_tensor: bool) -> Any:
    """Every row stacked: one array (or tensor) per column, in the rows' structure (a dict, tuple or list of them)."""
    stacked = {name: _stacked(_as_array(columns[name]), spec, name, as_tensor) for name, spec in layout.specs.items()}
    return _build(layout.tree, {name: _Whole(value) for name, value in stacked.items()}, 0)


class _Whole:
    """Stands for a whole column in :func:`_build` (item 0 is the column itself)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getitem__(self, i: int) -> Any:
        return self.value

"""A Ray Data window's columns: names and options checked, the batch's format, the results as one column
(:func:`output_column`: numpy's, or Arrow's on :class:`~dynabatch.inference.columns.Columns`, the store's encoding)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.inference.columns import Columns, numpy_column

__all__ = ["check_column", "check_options", "columns_of", "frame_column", "output_column"]


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


def columns_of(batch: Any) -> tuple[list[str], Any]:
    """The batch's column names, and whether it is a pandas DataFrame (else a dict of arrays)."""
    if isinstance(batch, Mapping):
        return list(batch), False
    if hasattr(batch, "columns") and hasattr(batch, "assign"):  # a pandas DataFrame
        return [str(c) for c in batch.columns], True
    raise bad_type("batch", "a dict of numpy arrays (map_batches' default batch_format) or a pandas DataFrame",
                   batch)


def output_column(rows: list[Any], *, nullable: bool, varying: Collection[tuple] = ()) -> np.ndarray | pa.Array:
    """A window's results as one column.

    Where no row can fail (``nullable=False``) it is :func:`~dynabatch.inference.columns.numpy_column`: rows of one
    shape make Ray's tensor column. Where a row can fail and get ``None`` (``on_oom`` / ``on_error="skip"``), rows of
    arrays make one Arrow array on the store's types instead, a failed row null: Ray cannot join a window's tensor
    column with the column of objects a ``None`` makes in another (a job that sorts, repartitions or converts its
    output failed, and a Parquet file held pickled rows). A per-token output (at a row path in ``varying``, the run
    result's) and a row of two or more dimensions are a list in every window, whatever their lengths there, so that
    windows type them alike; a window whose every row failed is a column of nulls. Other
    rows (dicts, Python values, and arrays the store's encoding refuses: inner shapes or dtypes that differ between
    rows, complex numbers) stay numpy's, as where no row can fail.

    Example:
        >>> import torch
        >>> output_column([torch.ones(2), None], nullable=True).to_pylist()
        [[1.0, 1.0], None]
        >>> output_column([torch.ones(2), torch.zeros(2)], nullable=False).shape
        (2, 2)
    """
    first = next((row for row in rows if row is not None), None)
    if nullable and rows and first is None:  # every row failed: nulls, which Ray joins to any other column's type
        return pa.nulls(len(rows))
    if not nullable or not isinstance(first, (torch.Tensor, np.ndarray, np.generic)):
        return numpy_column(rows)
    try:
        columns = Columns.of(first)
        parts = [columns.parts(rows)]
        fields = columns.fit(parts, varying=columns.names if np.ndim(first) >= 2 else columns.at(varying))
    except (TypeError, ValueError):  # rows the store's encoding refuses (kinds, dtypes or inner shapes that differ)
        return numpy_column(rows)
    return columns.table(parts, list(fields.values())).column(0).combine_chunks()


def frame_column(values: np.ndarray | pa.Array, index: Any) -> Any:
    """:func:`output_column`'s column for a pandas window: an Arrow array on its own type (pandas' ``ArrowDtype``,
    which Ray keeps), numpy's as a list of rows."""
    if not isinstance(values, pa.Array):
        return list(values)
    import pandas as pd

    return pd.Series(values, dtype=pd.ArrowDtype(values.type), index=index)

"""A Ray Data window's columns: names and options checked, the batch's format (results into a column:
:func:`dynabatch.inference.columns.numpy_column`, the one encoding of rows)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynabatch._validation import bad_type, bad_value

__all__ = ["check_column", "check_options", "columns_of"]


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

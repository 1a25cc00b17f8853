"""Stable ids of texts: :func:`check_ids`, one unique str or int per text, held as one Arrow array.

A results store keyed by id (``build_dynamic_batch_dataloader(..., ids=...)``)
finds a text's stored row by its id, not its position, so a corpus that grows
or is reordered reruns only the texts not stored yet. The ids stay one Arrow
array (``string`` or ``int64``), never a Python object per text.

Example:
    >>> from dynabatch.data.ids import check_ids
    >>> check_ids(["doc-7", "doc-2"], 2).to_pylist()
    ['doc-7', 'doc-2']
    >>> check_ids([3, 3], 2)
    Traceback (most recent call last):
    ...
    ValueError: ids should be unique (one stable id per text), but got 1 id given to several texts (first: 3 at positions 0, 1)
"""

from __future__ import annotations

import collections.abc
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, brief, first_few
from dynabatch.data.text_source import is_text_type

__all__ = ["check_ids"]

_RULE = "a sequence of str or of int, one per text (a list, numpy array, pandas Series or Arrow array)"
_INT64 = "ints in int64's range [-2**63, 2**63) (a store keys rows by int64 ids)"


def _as_arrow(ids: Any) -> Any:
    import pyarrow as pa

    if isinstance(ids, pa.ChunkedArray):
        return ids.combine_chunks()
    if isinstance(ids, pa.Array):
        return ids
    if isinstance(ids, (str, bytes, collections.abc.Mapping)) or not isinstance(
            ids, (collections.abc.Sequence, np.ndarray)) and not hasattr(ids, "tolist"):
        raise bad_type("ids", _RULE, ids)
    values = ids if isinstance(ids, (list, np.ndarray)) else ids.tolist() if hasattr(ids, "tolist") else list(ids)
    try:
        return pa.array(values, from_pandas=True)  # a NaN (pandas' missing value) is a null: a missing id
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        kinds = sorted({type(v).__name__ for v in (values.tolist() if isinstance(values, np.ndarray) else values)})
        if isinstance(exc, OverflowError) and kinds == ["int"]:  # ints past 2**64: Arrow holds none of them
            raise _out_of_range(values) from None
        raise TypeError(f"ids should be {_RULE}, but got ids={brief(ids)} holding {', '.join(kinds)} values") from exc


def _out_of_range(values: Any) -> ValueError:
    """The refusal of int ids outside int64's range, naming the first such id and its position."""
    position, value = next((p, v) for p, v in enumerate(values) if v is not None and not -(2**63) <= int(v) < 2**63)
    return ValueError(f"ids should be {_INT64}, but got id {int(value)} at position {position}: give such ids as "
                      "str")


def _whole(array: Any) -> bool:
    """Whether the float ``array`` holds missing values and whole numbers alone: ints that pandas turned into
    floats to hold a NaN (a missing id)."""
    import pyarrow.compute as pc

    values = array.drop_null()
    return bool(array.null_count) and pc.all(pc.equal(pc.floor(values), values)).as_py() is not False


def _missing(array: Any) -> ValueError:
    """The refusal of the missing (null: None, NaN) ids of ``array``, naming their positions."""
    missing = np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))
    return ValueError(f"ids should give every text an id, but got {missing.size} missing (None, NaN) at positions "
                      f"{first_few(missing)}")


def check_ids(ids: Any, n: int, *, texts_name: str = "texts") -> Any:
    """``ids`` as a ``pyarrow`` ``string`` or ``int64`` array of ``n`` unique values (``None`` stays ``None``), one
    per item of the caller's argument ``texts_name`` (which a refused length names).

    Raises:
        TypeError: ``ids`` is not a sequence of str or of int (floats, bools, mixed types).
        ValueError: not one id per text, a missing (null) id, an int id outside int64's range, or an id given to
            several texts.
    """
    if ids is None:
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    array = _as_arrow(ids)
    if pa.types.is_dictionary(array.type):  # pandas' categorical: its values are the ids
        array = array.cast(array.type.value_type)
    if is_text_type(array.type):
        array = array.cast(pa.string())
    elif pa.types.is_integer(array.type):
        try:
            array = array.cast(pa.int64())
        except pa.ArrowInvalid:  # uint64 ids of 2**63 or more
            raise _out_of_range(array.to_pylist()) from None
    elif pa.types.is_floating(array.type) and _whole(array):  # pandas' int column holding a missing id (NaN)
        raise _missing(array)
    elif not pa.types.is_null(array.type):
        column = getattr(ids, "column_name", None)  # a datasets column: its name and feature
        named = f" (column {column!r}, a datasets {ids.features})" if column is not None else ""
        raise TypeError(f"ids should be {_RULE}, but got ids={brief(ids)} of Arrow type {array.type}{named}")
    if len(array) != n:
        raise bad_value("len(ids)", f"len({texts_name})={n}, one id per text", len(array))
    if array.null_count:
        raise _missing(array)
    unique = pc.unique(array)
    if len(unique) == n:
        return array
    group = pc.index_in(array, value_set=unique).to_numpy()
    counts = np.bincount(group, minlength=len(unique))
    repeated = np.flatnonzero(counts > 1)
    first = int(repeated[0])
    where = np.flatnonzero(group == first)
    noun = "id" if repeated.size == 1 else "ids"
    raise ValueError(f"ids should be unique (one stable id per text), but got {repeated.size} {noun} given to several "
                     f"texts (first: {unique[first].as_py()!r} at positions {first_few(where)})")

"""The arguments of bionemo's size-aware batching: ``sizeof`` as a function, the checks, and their errors.

:func:`~dynabatch.compat.bionemo.size_aware.size_aware_batching` and
:class:`~dynabatch.compat.bionemo.size_aware.SizeAwareBatchSampler` (and the bucket
samplers) read ``sizeof`` and check ``max_total_size``, the loggers and each
size through these helpers, so every sampler words its errors the same way
(see the edge cases in ``size_aware.py``'s docstring).

Example:
    >>> from dynabatch.compat.bionemo._size_aware_args import _size_function
    >>> _size_function({"a": 3})("a"), _size_function([5, 7])(1), _size_function(len)("four")
    (3, 7, 4)
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch


class ArgumentError(ValueError, TypeError):
    """A wrong argument where bionemo documents ValueError but a wrong *type* is a TypeError in Python.

    Raised for arguments of the wrong type whose documented error is ValueError,
    so that code written against either convention catches it.
    """


class _MissingSizeError(RuntimeError, LookupError):
    """``sizeof`` (a mapping or a sequence) has no entry for an index."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _MissingKeyError(_MissingSizeError, KeyError):
    pass


class _MissingIndexError(_MissingSizeError, IndexError):
    pass


def _short(value: Any) -> str:
    return reprlib.repr(value)


def described(value: Any) -> str:
    return f"{_short(value)} of type {type(value).__name__}"


def _call_sizeof(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def size(data: Any) -> Any:
        try:
            return function(data)
        except Exception as exc:
            raise RuntimeError(f"sizeof raises error at data={_short(data)}: {exc}") from exc

    return size


def _look_up_mapping(table: Mapping[Any, Any]) -> Callable[[Any], Any]:
    def size(index: Any) -> Any:
        try:
            return table[index]
        except KeyError as exc:
            raise _MissingKeyError(
                f"sizeof raises error at data={_short(index)}: sizeof (a mapping of {len(table)} entries) "
                f"has no entry for index {_short(index)}"
            ) from exc

    return size


def _look_up_sequence(table: Sequence[Any]) -> Callable[[Any], Any]:
    def size(index: Any) -> Any:
        if index.__class__ is int and 0 <= index < len(table):  # the common case, fast
            return table[index]
        missing = isinstance(index, numbers.Integral) and not 0 <= index < len(table)
        if not missing:
            try:
                return table[index]
            except (IndexError, TypeError) as exc:
                raise _MissingIndexError(
                    f"sizeof raises error at data={_short(index)}: sizeof (a sequence of {len(table)} sizes) "
                    f"cannot be indexed by {described(index)}: {exc}"
                ) from exc
        raise _MissingIndexError(
            f"sizeof raises error at data={_short(index)}: sizeof (a sequence of {len(table)} sizes) "
            f"has no entry for index {index!r}; valid indices are 0..{len(table) - 1}"
        )

    return size


def _size_function(sizeof: Any) -> Callable[[Any], Any]:
    """``sizeof`` as a function of one element: callables are called, mappings and sequences indexed."""
    if callable(sizeof):
        return _call_sizeof(sizeof)
    if isinstance(sizeof, Mapping):
        return _look_up_mapping(sizeof)
    if isinstance(sizeof, (torch.Tensor, np.ndarray)):
        if sizeof.ndim != 1:
            raise ArgumentError(
                f"sizeof must be a callable, a dictionary or a sequence container (a 1D tensor or array "
                f"counts as one), but got sizeof with shape {tuple(sizeof.shape)}"
            )
        return _look_up_sequence(sizeof.tolist())
    if isinstance(sizeof, Sequence) and not isinstance(sizeof, (str, bytes, bytearray)):
        return _look_up_sequence(sizeof)
    raise TypeError(
        f"sizeof must be a callable, a dictionary or a sequence container, but got sizeof={described(sizeof)}"
    )


def _is_nan(value: Any) -> bool:
    """Whether ``value`` is a real NaN; safe for ints too large for a float (``math.isnan`` overflows)."""
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value)


def _check_max_total_size(max_total_size: Any) -> None:
    """bionemo's check for ``SizeAwareBatchSampler``: a real number (int or float), else ValueError.

    bionemo documents "ValueError if max_total_size is not a positive number" but
    checks only that it is a real number, and its own tests construct samplers
    with ``max_total_size=0`` (iterating one skips, with a warning, every element
    of positive size). So 0 and negative values are accepted here. Refused, as
    dynabatch's own stricter choices: a bool and NaN (NaN would put every element
    in one batch, since no comparison with it is true).
    """
    rule = "a real number (int or float, not NaN)"
    if isinstance(max_total_size, bool) or not isinstance(max_total_size, numbers.Real):
        raise ArgumentError(f"max_total_size should be {rule}, but got max_total_size={described(max_total_size)}")
    if _is_nan(max_total_size):
        raise ValueError(f"max_total_size should be {rule}, but got max_total_size={max_total_size!r}")


def _check_logger(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} should be a callable taking a str or None, but got {name}={described(value)}")


def _exceeds(size: Any, limit: Any, data: Any) -> bool:
    """``size > limit`` with a clear error for a size that is not a comparable number."""
    if size.__class__ is int:  # the common case, fast
        try:
            return size > limit
        except TypeError:
            pass  # the limit is not comparable with an int: the general path says so
    if _is_nan(size):
        raise ValueError(f"sizeof should return a number, but got NaN for data={_short(data)}")
    try:
        return bool(size > limit)
    except TypeError as exc:
        raise TypeError(
            f"sizeof should return a number comparable with max_total_size={limit!r}, but got "
            f"{described(size)} for data={_short(data)} (not int or float: {exc})"
        ) from exc

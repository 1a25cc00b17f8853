"""bionemo's ``create_buckets``: bucket ranges of bounded width holding enough elements each.

Part of the API of ``bionemo.size_aware_batching`` (its ``utils`` module), with
the same argument names, order, defaults, error types and documented outputs;
:class:`~dynabatch.compat.bionemo.bucket.BucketBatchSampler` batches within the
buckets it makes.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from dynabatch.compat.bionemo._size_aware_args import ArgumentError, described

__all__ = ["Buckets", "create_buckets"]


class Buckets(NamedTuple):
    """Bucket boundaries and the number of elements in each bucket.

    Attributes:
        bucket_boundaries: 1D tensor of the ascending boundaries; bucket ``k``
            is ``bucket_boundaries[k] <= size < bucket_boundaries[k + 1]``.
        bucket_sizes: 1D tensor of the number of elements in each bucket.
    """

    bucket_boundaries: torch.Tensor
    bucket_sizes: torch.Tensor


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _is_real_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_complex


def _check_1d_tensor(name: str, value: Any, rule: str, dtype_ok: Any) -> None:
    if not torch.is_tensor(value):
        raise ArgumentError(f"{name} should be {rule}, but got {name}={described(value)}")
    if value.ndim != 1:
        raise ValueError(f"{name} should be {rule}, but got {name} with shape {tuple(value.shape)}")
    if not dtype_ok(value.dtype):
        raise ValueError(f"{name} should be {rule}, but got {name}.dtype={value.dtype}")


def _check_positive_int(name: str, value: Any) -> None:
    rule = "a positive integer"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{name} should be {rule}, but got {name}={described(value)}")
    if value <= 0:
        raise ValueError(f"{name} should be {rule}, but got {name}={value!r}")


def create_buckets(sizes: torch.Tensor, max_width: int, min_bucket_count: int) -> Buckets:
    """Create buckets for a list of integers with a maximal width of interval and a minimal bucket count.

    Returns a named tuple of the bucket boundaries and the bucket sizes: e.g.
    ``torch.tensor([0, 5, 7]), torch.tensor([3, 2])`` specifies 2 buckets, one
    with range 0 <= sizes < 5 (width 5, 3 elements) and one with 5 <= sizes < 7
    (width 2, 2 elements).

    Walking the distinct sizes in ascending order, a bucket takes sizes until
    it holds ``min_bucket_count`` elements or the next size would make it wider
    than ``max_width``. A gap wider than ``max_width`` before the next size is
    filled with empty buckets of width ``max_width``; the last bucket ends just
    after the largest size.

    Args:
        sizes: A 1D tensor of integers.
        max_width: The maximum width of a bucket, should be a positive integer.
        min_bucket_count: The minimum count of a bucket, should be a positive
            integer. A bucket may hold fewer elements if its width reaches
            ``max_width``.

    Raises:
        ValueError: If the provided sizes is empty, or not integers (a value
            that is not a tensor raises an error that is both ValueError and
            TypeError).
        ValueError: If max_width is not a positive integer or min_bucket_count
            is not a positive integer.

    Returns:
        A named tuple containing bucket boundaries in ascending order and the
        number of elements in each bucket.

    Example:
        >>> import torch
        >>> from dynabatch.compat.bionemo import create_buckets

        >>> sizes = torch.tensor([1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 22, 22, 22, 22])
        >>> buckets = create_buckets(sizes, max_width=5, min_bucket_count=10)
        >>> # 5 buckets: 1 <= sizes < 6, 6 <= sizes < 11, 11 <= sizes < 16, 16 <= sizes < 21, 21 <= sizes < 23
        >>> print(buckets.bucket_boundaries)
        tensor([ 1,  6, 11, 16, 21, 23])

        >>> # each with 12, 0, 0, 0, 4 elements respectively.
        >>> print(buckets.bucket_sizes)
        tensor([12,  0,  0,  0,  4])

        >>> sizes = torch.arange(20)
        >>> # min_bucket_count is used to control bucket size
        >>> buckets = create_buckets(sizes, max_width=10, min_bucket_count=5)
        >>> print(buckets.bucket_boundaries)
        tensor([ 0,  5, 10, 15, 20])

        >>> print(buckets.bucket_sizes)
        tensor([5, 5, 5, 5])
    """
    _check_1d_tensor("sizes", sizes, "a 1D tensor of integers", _is_integer_dtype)
    if sizes.numel() == 0:
        raise ValueError(f"sizes should be a non-empty 1D tensor of integers, but got sizes={sizes!r}")
    _check_positive_int("max_width", max_width)
    _check_positive_int("min_bucket_count", min_bucket_count)
    width, min_count = int(max_width), int(min_bucket_count)

    distinct, counts = torch.unique(sizes, sorted=True, return_counts=True)
    values, numbers_of = distinct.tolist(), counts.tolist()
    boundaries = [values[0]]
    bucket_sizes: list[int] = []
    start = 0
    while start < len(values):
        lower = boundaries[-1]
        stop, count = start, 0
        while stop < len(values) and count < min_count and values[stop] - lower < width:
            count += numbers_of[stop]
            stop += 1
        upper = values[stop] if stop < len(values) else values[-1] + 1
        n_full_width = (upper - lower) // width
        if n_full_width > 0:
            boundaries.extend(lower + width * k for k in range(1, n_full_width + 1))
            bucket_sizes.extend([count] + [0] * (n_full_width - 1))
        else:
            boundaries.append(upper)
            bucket_sizes.append(count)
        start = stop
    return Buckets(torch.tensor(boundaries), torch.tensor(bucket_sizes))

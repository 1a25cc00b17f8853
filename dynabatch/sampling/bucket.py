"""bionemo's bucket batching: batches of elements whose sizes fall in one bucket range.

The API of ``bionemo.size_aware_batching`` (``create_buckets``, ``Buckets`` and
``BucketBatchSampler``), with the same argument names, order, defaults, error
types and documented outputs, including the shuffled outputs for a seeded
``torch.Generator`` (the same sequence of ``torch.randperm`` /
``torch.multinomial`` draws).

Behaviour on the edge cases, as bionemo's:

* Elements whose size is outside every bucket range are skipped, with a
  ``UserWarning`` (``warnings.warn``) saying how many; if no element is inside
  the ranges, :class:`RuntimeError`.
* Buckets with no elements are kept: they still count in the number of buckets
  (the length of every ``base_batch_sampler_individual_kwargs`` value), get a
  base batch sampler over an empty list, and are never chosen.
* ``shuffle=True`` permutes each bucket's indices in place every epoch (the
  permutation of epoch 2 applies to epoch 1's order) and picks the bucket of
  each batch at random with probability proportional to the elements it has
  left. Without a ``generator``, one is seeded at construction from torch's
  global random number generator, as ``torch.utils.data.RandomSampler`` does.
* ``len()`` works only if the base batch sampler class has ``__len__``.
"""

from __future__ import annotations

import numbers
import struct
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Dict, List, NamedTuple, Optional, Type

import numpy as np
import torch
from torch.utils.data import Sampler

from dynabatch.sampling.size_aware import _ArgumentError, _described

__all__ = ["BucketBatchSampler", "Buckets", "create_buckets"]


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
        raise _ArgumentError(f"{name} should be {rule}, but got {name}={_described(value)}")
    if value.ndim != 1:
        raise ValueError(f"{name} should be {rule}, but got {name} with shape {tuple(value.shape)}")
    if not dtype_ok(value.dtype):
        raise ValueError(f"{name} should be {rule}, but got {name}.dtype={value.dtype}")


def _check_positive_int(name: str, value: Any) -> None:
    rule = "a positive integer"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _ArgumentError(f"{name} should be {rule}, but got {name}={_described(value)}")
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
        >>> from dynabatch import create_buckets

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
    bucket_sizes: List[int] = []
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


# Picking a bucket. bionemo draws it with torch.multinomial(probabilities, 1, generator), which is
# argmax(probabilities / q) for exponential variates q. The torch it documented its outputs with
# drew q on the CPU through MKL: one 32-bit word w of the generator's Mersenne Twister seeds an
# MCG31m1 stream (x_0 = w mod (2**31 - 1), or 1 if that is 0; x_k = a**k x_0 mod (2**31 - 1)) and
# q_k = -ln(x_k / (2**31 - 1)). Later torch builds draw q differently, so the same seed gives other
# batches; drawing q as that torch did keeps bionemo's documented outputs (and is the same
# exponential race, so every bucket is still picked with probability proportional to its weight).
_MCG31_MODULUS = 2**31 - 1
_MCG31_MULTIPLIER = 1132489760


def _mcg_powers(n: int) -> np.ndarray:
    """``a**k mod m`` for ``k < n``, the MCG31m1 multipliers of a stream's first ``n`` values."""
    powers = np.empty(max(n, 1), dtype=np.uint64)
    power = 1
    for k in range(len(powers)):
        powers[k] = power
        power = power * _MCG31_MULTIPLIER % _MCG31_MODULUS
    return powers


_TWISTER: List[np.random.RandomState] = []  # one reusable RandomState, for the twist every 624 words


def _temper(y: int) -> int:
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    return y ^ (y >> 18)


def _next_word(generator: torch.Generator) -> int:
    """Consumes and returns the generator's next 32-bit Mersenne Twister output.

    torch's CPU generator state is ``seed (u64), left (i32), seeded (i32), next (u64), state[624] (u64 each)``;
    the next output is ``state[next]`` tempered, unless ``left == 1``, when the state is regenerated first.
    """
    state = generator.get_state().numpy()
    left, next_index = struct.unpack_from("<i4xQ", state, 8)
    if left > 1:
        (raw,) = struct.unpack_from("<I", state, 24 + 8 * next_index)
        word = _temper(raw)
    else:
        if not _TWISTER:
            _TWISTER.append(np.random.RandomState(0))
        key = np.frombuffer(state, dtype=np.uint64, count=624, offset=24).astype(np.uint32)
        _TWISTER[0].set_state(("MT19937", key, 624))
        word = int(_TWISTER[0].randint(0, 2**32, dtype=np.uint64))
    consumed = int(torch.empty(1, dtype=torch.int32).random_(generator=generator))  # the same word, mod 2**31
    if consumed != word % 2**31:
        raise RuntimeError("unexpected torch.Generator state layout: cannot draw buckets as bionemo does")
    return word


def _draw_bucket(weights: torch.Tensor, generator: Optional[torch.Generator], powers: np.ndarray) -> int:
    """Index of a bucket drawn with probability ``weights[k] / weights.sum()``, as bionemo's torch drew it."""
    if generator is None or generator.device.type != "cpu":
        return int(torch.multinomial(weights, 1, generator=generator))
    start = _next_word(generator) % _MCG31_MODULUS or 1
    stream = (np.uint64(start) * powers[: len(weights)]) % np.uint64(_MCG31_MODULUS)
    exponential = torch.from_numpy(-np.log(stream / _MCG31_MODULUS)).to(weights.dtype)
    return int(torch.argmax(weights / exponential))


def _check_kwargs(name: str, value: Any) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _ArgumentError(f"{name} should be a keyword argument dictionary, but got {name}={_described(value)}")
    bad_keys = [key for key in value if not isinstance(key, str)]
    if bad_keys:
        raise _ArgumentError(
            f"{name} should be a keyword argument dictionary (str keys), but got {name} with keys {bad_keys!r}"
        )
    return value


class BucketBatchSampler(Sampler[List[int]]):
    """A batch sampler whose batches hold elements from one pre-defined bucket range each.

    Elements are grouped into buckets by their sizes and the bucket ranges;
    a base batch sampler is then used for each bucket to create mini-batches.

    The bucket ranges are given by ``bucket_boundaries``, which is sorted and
    used to create ``len(bucket_boundaries) - 1`` left-closed right-open
    intervals: ``[10, 5, 0, 16]`` is sorted as ``[0, 5, 10, 16]`` and gives the
    buckets ``[0, 5), [5, 10), [10, 16)``.

    Each base batch sampler is created as
    ``base_batch_sampler_class(bucket_element_indices[k], **base_batch_sampler_shared_kwargs,
    **{key: values[k] for key, values in base_batch_sampler_individual_kwargs.items()})``:
    ``{'drop_last': True}`` shared and ``{'batch_size': [8, 10, 12]}``
    individual kwargs give 3 batch samplers with ``drop_last=True`` and batch
    sizes 8, 10 and 12.

    In ``__iter__``, if ``shuffle`` is True, the element indices in each bucket
    are shuffled and a bucket is picked at random for each mini-batch; if
    False, nothing is shuffled and buckets are used in ascending order of their
    ranges. Batches are homogeneous, which reduces padding.

    Modified from https://github.com/rssrwn/semla-flow/blob/main/semlaflow/data/util.py
    (by way of bionemo).

    Example:
        >>> import torch
        >>> from dynabatch import BucketBatchSampler

        >>> # Define the sizes for a dataset
        >>> sizes = torch.arange(25)
        >>> # Define bucket ranges
        >>> bucket_boundaries = torch.tensor([0, 6, 15, 25])

        >>> # Create a bucket batch sampler with torch.utils.data.BatchSampler as base batch sampler
        >>> # As there are 3 buckets, there will be 3 base batch samplers with batch sizes 2, 3, and 5.
        >>> batch_sampler = BucketBatchSampler(
        ...     sizes=sizes,
        ...     bucket_boundaries=bucket_boundaries,
        ...     base_batch_sampler_class=torch.utils.data.BatchSampler,
        ...     base_batch_sampler_shared_kwargs={'drop_last': False},
        ...     base_batch_sampler_individual_kwargs={'batch_size': [2,3,5]},
        ...     shuffle=False,
        ... )

        >>> # Iterate over batches of indices that lies in the same bucket and with different batch sizes.
        >>> print(list(batch_sampler))
        [[0, 1], [2, 3], [4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21, 22, 23, 24]]

        >>> # randomize the dataset and buckets
        >>> batch_sampler = BucketBatchSampler(
        ...     sizes=sizes,
        ...     bucket_boundaries=bucket_boundaries,
        ...     base_batch_sampler_class=torch.utils.data.BatchSampler,
        ...     base_batch_sampler_shared_kwargs={'drop_last': False},
        ...     base_batch_sampler_individual_kwargs={'batch_size': [2,3,5]},
        ...     shuffle=True,
        ...     generator=torch.Generator().manual_seed(0),
        ... )
        >>> print(list(batch_sampler))
        [[24, 17, 16, 22, 19], [2, 5], [12, 10, 11], [3, 0], [15, 18, 20, 21, 23], [7, 13, 6], [14, 9, 8], [1, 4]]
        >>> print(list(batch_sampler))
        [[14, 9, 13], [23, 16, 20, 21, 15], [5, 0], [8, 10, 11], [17, 24, 22, 18, 19], [12, 6, 7], [4, 2], [3, 1]]

        >>> # Combine with SizeAwareBatchSampler to control the cost of each batch
        >>> from dynabatch import SizeAwareBatchSampler
        >>> item_costs = sizes.tolist()
        >>> def cost_of_element(index):
        ...     return item_costs[index]
        >>> batch_sampler = BucketBatchSampler(
        ...     sizes=sizes,
        ...     bucket_boundaries=bucket_boundaries,
        ...     base_batch_sampler_class=SizeAwareBatchSampler,
        ...     base_batch_sampler_shared_kwargs={"sizeof": cost_of_element, "max_total_size": 40},
        ...     base_batch_sampler_individual_kwargs={},
        ...     shuffle=True,
        ...     generator=torch.Generator().manual_seed(0),
        ... )
        >>> print(list(iter(batch_sampler)))
        [[24], [2, 5, 3, 0, 1, 4], [12, 10, 11, 7], [13, 6, 14], [17, 16], [22], [19, 15], [9, 8], [18, 20], [21], [23]]
    """

    def __init__(
        self,
        sizes: torch.Tensor,
        bucket_boundaries: torch.Tensor,
        base_batch_sampler_class: Type[Sampler],
        base_batch_sampler_shared_kwargs: Optional[Dict[str, Any]] = None,
        base_batch_sampler_individual_kwargs: Optional[Dict[str, Iterable]] = None,
        shuffle: Optional[bool] = True,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        """Initializes the BucketBatchSampler.

        Args:
            sizes: A 1D tensor of real numbers, the size of each element.
            bucket_boundaries: A 1D tensor of real numbers, the boundaries of
                the bucket ranges; sorted, then used to create
                ``len(bucket_boundaries) - 1`` left-closed right-open intervals.
                It should not contain any duplicate values.
            base_batch_sampler_class: Base batch sampler class (a subclass of
                ``torch.utils.data.Sampler``), created for each bucket with the
                bucket's element indices and the kwargs below.
            base_batch_sampler_shared_kwargs: Keyword arguments shared by all
                base batch samplers. Defaults to ``{}``.
            base_batch_sampler_individual_kwargs: Keyword arguments per bucket:
                each value has one entry per bucket
                (``len(bucket_boundaries) - 1``). Defaults to ``{}``.
            shuffle: Whether to shuffle the elements and buckets. Defaults to True.
            generator: Generator used in sampling. Defaults to None.

        Raises:
            ValueError: If ``sizes`` or ``bucket_boundaries`` is not a 1D tensor
                of real numbers, or ``bucket_boundaries`` has fewer than 2
                values, duplicates or NaN.
            ValueError: If ``base_batch_sampler_shared_kwargs`` or
                ``base_batch_sampler_individual_kwargs`` is not a keyword
                argument dictionary.
            ValueError: If a value of ``base_batch_sampler_individual_kwargs``
                does not have ``len(bucket_boundaries) - 1`` entries.
            RuntimeError: If no element has a size inside the bucket ranges.

        A value of the wrong type (not a tensor, not a dict, a non-Sampler
        class, a non-bool ``shuffle``, a non-Generator ``generator``) raises an
        error that is both ValueError and TypeError.
        """
        _check_1d_tensor("sizes", sizes, "a 1D tensor of real numbers", _is_real_dtype)
        _check_1d_tensor("bucket_boundaries", bucket_boundaries, "a 1D tensor of real numbers", _is_real_dtype)
        if len(bucket_boundaries) < 2:
            raise ValueError(
                f"bucket_boundaries should have at least 2 values, but got bucket_boundaries={bucket_boundaries!r}"
            )
        if bool(torch.isnan(bucket_boundaries).any()):
            raise ValueError(f"bucket_boundaries should not contain NaN, but got bucket_boundaries={bucket_boundaries!r}")
        bucket_boundaries = torch.sort(bucket_boundaries).values
        if bool((bucket_boundaries[1:] <= bucket_boundaries[:-1]).any()):
            raise ValueError(
                "bucket_boundaries should not contain duplicate values, but got sorted "
                f"bucket_boundaries={bucket_boundaries!r}"
            )
        if not (isinstance(base_batch_sampler_class, type) and issubclass(base_batch_sampler_class, Sampler)):
            raise _ArgumentError(
                "base_batch_sampler_class should be a batch sampler class inherited from "
                f"torch.utils.data.Sampler, but got base_batch_sampler_class={base_batch_sampler_class!r}"
            )
        shared = _check_kwargs("base_batch_sampler_shared_kwargs", base_batch_sampler_shared_kwargs)
        individual = _check_kwargs("base_batch_sampler_individual_kwargs", base_batch_sampler_individual_kwargs)
        if not isinstance(shuffle, bool):
            raise _ArgumentError(f"shuffle should be a bool, but got shuffle={_described(shuffle)}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise _ArgumentError(f"generator should be a torch.Generator or None, but got generator={_described(generator)}")

        self.num_buckets = len(bucket_boundaries) - 1
        per_bucket: Dict[str, List[Any]] = {}
        for key, values in individual.items():
            if not isinstance(values, Iterable) or isinstance(values, (str, bytes)):
                raise _ArgumentError(
                    f"base_batch_sampler_individual_kwargs[{key!r}] should be an iterable of {self.num_buckets} "
                    f"values (one per bucket), but got {_described(values)}"
                )
            per_bucket[key] = list(values)
            if len(per_bucket[key]) != self.num_buckets:
                raise ValueError(
                    f"base_batch_sampler_individual_kwargs[{key!r}] should have {self.num_buckets} values "
                    f"(len(bucket_boundaries) - 1), but got {len(per_bucket[key])}: {per_bucket[key]!r}"
                )

        self.sizes = sizes
        self.bucket_boundaries = bucket_boundaries
        self.shuffle = shuffle
        self.generator = generator
        if shuffle and generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self.generator = torch.Generator().manual_seed(seed)
        self.base_batch_sampler_class = base_batch_sampler_class
        self.base_batch_sampler_shared_kwargs = shared
        self.base_batch_sampler_individual_kwargs = [
            {key: values[k] for key, values in per_bucket.items()} for k in range(self.num_buckets)
        ]

        self.bucket_element_indices = self._group(sizes, bucket_boundaries)
        self.bucket_sizes = torch.tensor([len(indices) for indices in self.bucket_element_indices], dtype=torch.int64)
        self.num_samples = int(self.bucket_sizes.sum())
        if self.num_samples == 0:
            raise RuntimeError(
                f"no element of sizes is inside the bucket ranges: sizes span [{sizes.min().item() if len(sizes) else None}, "
                f"{sizes.max().item() if len(sizes) else None}] ({len(sizes)} elements), "
                f"bucket_boundaries={bucket_boundaries.tolist()}"
            )
        if self.num_samples < len(sizes):
            warnings.warn(
                f"{len(sizes) - self.num_samples} elements are outside the buckets provided and will be skipped",
                stacklevel=2,
            )
        self._mcg_powers = _mcg_powers(self.num_buckets)
        self.base_batch_samplers: List[Sampler] = [
            base_batch_sampler_class(self.bucket_element_indices[k], **shared, **self.base_batch_sampler_individual_kwargs[k])
            for k in range(self.num_buckets)
        ]

    def _group(self, sizes: torch.Tensor, boundaries: torch.Tensor) -> List[List[int]]:
        """The element indices in each bucket, ascending; elements outside every range are left out."""
        dtype = torch.promote_types(sizes.dtype, boundaries.dtype)
        # position p: boundaries[p - 1] <= size < boundaries[p]; bucket p - 1 for 1 <= p <= num_buckets
        position = torch.bucketize(sizes.to(dtype), boundaries.to(dtype), right=True)
        order = torch.argsort(position, stable=True).tolist()
        ends = torch.cumsum(torch.bincount(position, minlength=self.num_buckets + 2), dim=0).tolist()
        return [order[ends[k]:ends[k + 1]] for k in range(self.num_buckets)]

    def __len__(self) -> int:
        """The number of batches; only if the base batch sampler class has ``__len__``."""
        return sum(len(sampler) for sampler in self.base_batch_samplers)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[List[int]]:
        """Iterate over batches of indices, each batch from one bucket.

        Yields:
            A batch of indices of elements whose sizes are in one bucket range.
        """
        if self.shuffle:
            for indices in self.bucket_element_indices:  # in place: the base samplers hold these lists
                permutation = torch.randperm(len(indices), generator=self.generator).tolist()
                indices[:] = [indices[p] for p in permutation]
        batches = [iter(sampler) for sampler in self.base_batch_samplers]
        remaining = self.bucket_sizes.clone()
        total = self.num_samples
        while total > 0:
            if self.shuffle:
                bucket = _draw_bucket(remaining / total, self.generator, self._mcg_powers)
            else:
                bucket = int(torch.argmax((remaining > 0).to(torch.int64)))
            try:
                batch = next(batches[bucket])
            except StopIteration:  # the base sampler dropped or skipped the rest of its bucket
                remaining[bucket] = 0
                total = int(remaining.sum())
                continue
            remaining[bucket] -= len(batch)
            total -= len(batch)
            yield batch

"""bionemo's bucket batching: batches of elements whose sizes fall in one bucket range.

The API of ``bionemo.size_aware_batching`` (``create_buckets``, ``Buckets`` and
``BucketBatchSampler``), with the same argument names, order, defaults, error
types and documented outputs, including the shuffled outputs for a seeded
``torch.Generator`` (the same sequence of ``torch.randperm`` /
``torch.multinomial`` draws).

Behaviour on the edge cases, as bionemo's:

* Elements whose size is outside every bucket range are skipped, with a
  ``UserWarning`` (``warnings.warn``) saying how many at construction, as
  bionemo's, and a WARNING log line every epoch; if no element is inside
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

import logging
import numbers
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Dict, List, Optional, Type

import numpy as np
import torch
from torch.utils.data import Sampler

from dynabatch.compat.bionemo._bucket_draw import draw_bucket, mcg_powers
from dynabatch.compat.bionemo._size_aware_args import ArgumentError, described
from dynabatch.compat.bionemo.bucket_utils import (
    Buckets,
    _check_1d_tensor,
    _is_real_dtype,
    create_buckets,
)

__all__ = ["BucketBatchSampler", "Buckets", "create_buckets"]

logger = logging.getLogger(__name__)


def _check_kwargs(name: str, value: Any) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArgumentError(f"{name} should be a keyword argument dictionary, but got {name}={described(value)}")
    bad_keys = [key for key in value if not isinstance(key, str)]
    if bad_keys:
        raise ArgumentError(
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
        >>> from dynabatch.compat.bionemo import BucketBatchSampler

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
        >>> from dynabatch.compat.bionemo import SizeAwareBatchSampler
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
            raise ArgumentError(
                "base_batch_sampler_class should be a batch sampler class inherited from "
                f"torch.utils.data.Sampler, but got base_batch_sampler_class={base_batch_sampler_class!r}"
            )
        shared = _check_kwargs("base_batch_sampler_shared_kwargs", base_batch_sampler_shared_kwargs)
        individual = _check_kwargs("base_batch_sampler_individual_kwargs", base_batch_sampler_individual_kwargs)
        if not isinstance(shuffle, bool):
            raise ArgumentError(f"shuffle should be a bool, but got shuffle={described(shuffle)}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ArgumentError(f"generator should be a torch.Generator or None, but got generator={described(generator)}")

        self.num_buckets = len(bucket_boundaries) - 1
        per_bucket: Dict[str, List[Any]] = {}
        for key, values in individual.items():
            if not isinstance(values, Iterable) or isinstance(values, (str, bytes)):
                raise ArgumentError(
                    f"base_batch_sampler_individual_kwargs[{key!r}] should be an iterable of {self.num_buckets} "
                    f"values (one per bucket), but got {described(values)}"
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
        self.n_elements = len(sizes)
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
        self._mcg_powers = mcg_powers(self.num_buckets)
        self._skip, self._yielded, self._epoch_start = 0, 0, None  # state_dict / load_state_dict
        self._initial_orders = [list(indices) for indices in self.bucket_element_indices]  # set_epoch
        self._base_seed = None if self.generator is None else self.generator.initial_seed()
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
        skip, self._skip = self._skip, 0
        self._epoch_start, self._yielded = self._snapshot(), 0
        if self.num_samples < self.n_elements:  # said at construction (bionemo's UserWarning) and every epoch
            logger.warning("%d of %d elements are outside the bucket ranges and skipped this epoch",
                           self.n_elements - self.num_samples, self.n_elements)
        if self.shuffle:
            for indices in self.bucket_element_indices:  # in place: the base samplers hold these lists
                permutation = torch.randperm(len(indices), generator=self.generator).tolist()
                indices[:] = [indices[p] for p in permutation]
        batches = [iter(sampler) for sampler in self.base_batch_samplers]
        remaining = self.bucket_sizes.numpy().copy()
        total = self.num_samples
        while total > 0:
            if self.shuffle:
                bucket = draw_bucket(remaining, total, self.generator, self._mcg_powers)
            else:
                bucket = int(np.argmax(remaining > 0))
            try:
                batch = next(batches[bucket])
            except StopIteration:  # the base sampler dropped or skipped the rest of its bucket
                remaining[bucket] = 0
                total = int(remaining.sum())
                continue
            remaining[bucket] -= len(batch)
            total -= len(batch)
            self._yielded += 1
            if skip:  # resuming: these batches were yielded before the state was saved
                skip -= 1
                continue
            yield batch
        self._epoch_start = None

    def set_epoch(self, epoch: int) -> None:
        """Makes the coming epoch's order depend only on ``epoch`` and the generator's initial seed.

        An extra of dynabatch's, for distributed and resumed training: the bucket
        orders go back to ascending indices and the generator is re-seeded with
        ``initial_seed + epoch``, so ``set_epoch(0)`` gives the first epoch of a
        fresh sampler, and every rank calling ``set_epoch(e)`` gets the same epoch
        ``e`` whatever it iterated before. Without calls to ``set_epoch`` the
        sampler behaves as bionemo's (each epoch continues the generator).
        ``set_epoch`` is passed on to base batch samplers that have it.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative int, but got epoch={epoch!r}")
        for indices, initial in zip(self.bucket_element_indices, self._initial_orders):
            indices[:] = initial  # in place: the base samplers hold these lists
        if self.generator is not None and self._base_seed is not None:
            self.generator.manual_seed(self._base_seed + int(epoch))
        self._skip, self._epoch_start = 0, None
        for sampler in self.base_batch_samplers:
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)

    def _snapshot(self) -> Dict[str, Any]:
        return {
            "generator": None if self.generator is None else self.generator.get_state(),
            "bucket_element_indices": [list(indices) for indices in self.bucket_element_indices],
        }

    def state_dict(self) -> Dict[str, Any]:
        """Where iteration is, for :meth:`load_state_dict` to resume without losing or repeating a batch.

        Mid-epoch (an iterator of this sampler has started and not finished), the
        state is the epoch's start (generator state and bucket orders) and the
        number of batches yielded so far; otherwise it is the start of the next
        epoch, or, after :meth:`load_state_dict`, the loaded position (so a
        state saved again before iterating still resumes there). With a ``DataLoader`` that prefetches (``num_workers > 0``), set
        ``"batches_yielded"`` to the number of batches actually consumed. An
        extra of dynabatch's (bionemo has no state); base batch samplers are
        assumed to be deterministic given their index list (as
        ``BatchSampler`` and ``SizeAwareBatchSampler`` are).
        """
        if self._epoch_start is None:  # between epochs: the coming one, after the batches a loaded state skips
            return {"epoch_start": self._snapshot(), "batches_yielded": self._skip, "num_samples": self.num_samples}
        return {"epoch_start": self._epoch_start, "batches_yielded": self._yielded, "num_samples": self.num_samples}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`: the next iterator resumes after its ``batches_yielded`` batches.

        Raises:
            ValueError: the state is of a sampler over other elements or buckets, or (when the base
                batch sampler class has ``__len__``) has yielded more batches than an epoch has.
            TypeError: ``state_dict`` is not a dict (the error is a ValueError too).
        """
        if not isinstance(state_dict, dict):
            raise ArgumentError(f"state_dict should be a dict from BucketBatchSampler.state_dict(), but got "
                                f"state_dict={described(state_dict)}")
        start = state_dict.get("epoch_start")
        orders = start.get("bucket_element_indices") if isinstance(start, dict) else None
        mine = [sorted(indices) for indices in self.bucket_element_indices]
        if orders is None or [sorted(o) for o in orders] != mine or state_dict.get("num_samples") != self.num_samples:
            raise ValueError("state_dict should be a state_dict() of a BucketBatchSampler over the same elements and "
                             "buckets, but got one that differs")
        skip = state_dict.get("batches_yielded", 0)
        if isinstance(skip, bool) or not isinstance(skip, numbers.Integral) or skip < 0:
            raise ValueError(f"state_dict['batches_yielded'] should be a non-negative int, but got {skip!r}")
        try:
            available = len(self)
        except TypeError:  # a base batch sampler without __len__ (SizeAwareBatchSampler): unknown until built
            available = None
        if available is not None and skip > available:
            raise ValueError(f"state_dict['batches_yielded'] should be at most {available} (the batches of an "
                             f"epoch), but got {skip!r}")
        for indices, order in zip(self.bucket_element_indices, orders):
            indices[:] = order  # in place: the base samplers hold these lists
        if start["generator"] is not None:
            if self.generator is None:
                self.generator = torch.Generator()
            self.generator.set_state(start["generator"])
        self._skip, self._epoch_start = int(skip), None

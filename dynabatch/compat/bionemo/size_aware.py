"""bionemo's size-aware batching: batches whose summed element sizes stay under a maximum.

The API of ``bionemo.size_aware_batching.sampler`` (``size_aware_batching`` and
``SizeAwareBatchSampler``), with the same argument names, order, defaults,
error types, logger calls and documented outputs.

Behaviour on the edge cases, as bionemo's:

* An element whose own size exceeds ``max_total_size`` is **skipped**: it is in
  no batch. ``warn_logger`` is called once for each such element and once more,
  when the data are exhausted, with how many elements were batched out of how
  many; ``info_logger`` is called once at the end with the number of batches.
  Without the callables the same messages go to this module's
  :mod:`logging` logger (per element at DEBUG, the summaries at WARNING/INFO).
* Batches are built greedily in input order: a batch is yielded as soon as the
  next element would take its total over ``max_total_size``, so the total of a
  yielded batch never exceeds it (sizes are assumed additive and, in practice,
  non-negative).
* Empty input yields no batch. A generator works as well as indexable data; it
  is consumed once (a ``SizeAwareBatchSampler`` over a generator is empty in
  its second epoch).
* An exception raised by ``sizeof`` becomes a :class:`RuntimeError` saying
  ``sizeof raises error at data=...``; an index missing from a ``sizeof``
  mapping or sequence raises the same, and it is also a :class:`KeyError` /
  :class:`IndexError`. A size that cannot be compared with
  ``max_total_size`` (a string, None) raises :class:`TypeError`; a NaN size
  raises :class:`ValueError`.
* ``max_total_size`` only has to be a real number: ``SizeAwareBatchSampler``
  with 0 or a negative value constructs (bionemo documents a ValueError for a
  non-positive value but does not raise one, and its tests rely on that), and
  iterating it skips every element of positive size, with the warnings above.
  NaN is refused with :class:`ValueError` (by both entry points).
* ``SizeAwareBatchSampler`` has no ``__len__``: the number of batches is only
  known by building them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, List, Optional, TypeVar, Union

from torch.utils.data import Sampler

from dynabatch.compat.bionemo._size_aware_args import (
    _check_logger,
    _check_max_total_size,
    _exceeds,
    _is_nan,
    _short,
    _size_function,
    described,
)

__all__ = ["SizeAwareBatchSampler", "size_aware_batching"]

logger = logging.getLogger(__name__)

Data = TypeVar("Data")
BatchCollated = TypeVar("BatchCollated")
Real = Union[int, float]


def _log(callback: Optional[Callable[[str], None]], level: int, message: str) -> None:
    if callback is not None:
        callback(message)
    else:
        logger.log(level, message)


def _greedy_batches(
    elements: Iterator[Any],
    size_of: Callable[[Any], Any],
    max_total_size: Any,
    collate_fn: Optional[Callable[[List[Any]], Any]],
    info_logger: Optional[Callable[[str], None]],
    warn_logger: Optional[Callable[[str], None]],
) -> Iterator[Any]:
    """One pass over ``elements``: close a batch when the next element would overflow it."""

    def finished(batch: List[Any]) -> Any:
        return batch if collate_fn is None else collate_fn(batch)

    batch: List[Any] = []
    batch_total: Any = 0
    n_seen = n_batched = n_batches = 0
    for data in elements:
        n_seen += 1
        size = size_of(data)
        if _exceeds(size, max_total_size, data):
            message = f"Size of element {_short(data)} exceeds max_total_size ({size} > {max_total_size}), skipping"
            _log(warn_logger, logging.DEBUG, message)
            continue
        if batch and _exceeds(size + batch_total, max_total_size, data):
            n_batches += 1
            yield finished(batch)
            batch, batch_total = [], 0
        batch.append(data)
        batch_total += size
        n_batched += 1
    if batch:
        n_batches += 1
        yield finished(batch)
    if n_batched < n_seen:
        _log(
            warn_logger,
            logging.WARNING,
            f"{n_batched} samples were batched from {n_seen} of the input data; the {n_seen - n_batched} "
            f"missing samples each exceed max_total_size={max_total_size}",
        )
    _log(
        info_logger,
        logging.INFO,
        f"Batched {n_batched} samples into {n_batches} batches. If this does not match your expectation, "
        "adjust max_total_size or sizeof",
    )


def size_aware_batching(
    dataset: Iterable[Data],
    sizeof: Callable[[Data], Real],
    max_total_size: Real,
    collate_fn: Optional[Callable[[Iterable[Data]], BatchCollated]] = None,
    info_logger: Optional[Callable[[str], None]] = None,
    warn_logger: Optional[Callable[[str], None]] = None,
) -> Iterator[Union[List[Data], BatchCollated]]:
    """A generator of batches from an iterable whose total size does not exceed a maximum.

    Here the size can be a measurement of memory consumption of the elements in
    the batch. This can be useful for both indexable data and non-indexable but
    iterable data (a generator is consumed once, element by element).

    Assumptions (bionemo's): linear complexity (one pass; a batch is yielded as
    soon as adding the next element would exceed ``max_total_size``, or at the
    end); additive sizes (a batch's size is the sum of its elements' sizes);
    ``sizeof``'s return values are comparable with ``max_total_size``.

    Caveats: batch sizes may vary a lot, and so may the number of batches
    across epochs.

    An element whose own size exceeds ``max_total_size`` is skipped (it is in
    no batch) and reported through ``warn_logger`` (see the module docstring).
    ``max_total_size`` is not otherwise checked here (bionemo's function does
    not check it either): with ``max_total_size=0`` only size-0 elements are
    batched. ``SizeAwareBatchSampler`` behaves the same way with 0 or a
    negative value (as bionemo's); it refuses only a value that is not a real
    number.

    Args:
        dataset: The input iterable.
        sizeof: A function or mapping that returns the "size" of each element
            in ``dataset`` (a sequence container indexed by the element works
            too). Its return type must be comparable with ``max_total_size``
            and addable (operator ``+``).
        max_total_size: The maximum total "size" of each batch.
        collate_fn: An optional function to collate batches. Defaults to None,
            in which case each batch is a list of elements from ``dataset``.
        info_logger: A function to log info. Defaults to None.
        warn_logger: A function to log warnings. Defaults to None.

    Yields:
        Batches from ``dataset``.

    Raises:
        TypeError: if ``sizeof`` is not a callable, a mapping or a sequence
            container, ``dataset`` is not iterable, or ``collate_fn`` or a logger
            is neither None nor callable (all at the call); while iterating, if
            a size cannot be compared with ``max_total_size``.
        RuntimeError: while iterating, if ``sizeof`` raises (or has no entry
            for an element).

    Example:
        >>> import torch
        >>> from torch.utils.data import default_collate
        >>> from dynabatch.compat.bionemo import size_aware_batching

        >>> # Define a sample dataset with torch.tensor
        >>> dataset = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]),
        ...            torch.tensor([7, 8]), torch.tensor([9, 10])]

        >>> # Define a sizeof function that returns the size of each tensor
        >>> def sizeof(x):
        ...     return x.numel()

        >>> # Create a generator with max_total_size=4 and default_collate_fn
        >>> gen = size_aware_batching(dataset, sizeof, 4, collate_fn=default_collate)
        >>> batches = list(gen)
        >>> print(batches)  # doctest: +NORMALIZE_WHITESPACE
        [tensor([[1, 2], [3, 4]]), tensor([[5, 6], [7, 8]]), tensor([[ 9, 10]])]
    """
    size_of = _size_function(sizeof)
    if _is_nan(max_total_size):
        raise ValueError(f"max_total_size should be a number, but got max_total_size={max_total_size!r}")
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn should be a callable or None, but got collate_fn={described(collate_fn)}")
    _check_logger("info_logger", info_logger)
    _check_logger("warn_logger", warn_logger)
    try:
        elements = iter(dataset)
    except TypeError as exc:
        raise TypeError(f"dataset should be an iterable, but got dataset={described(dataset)}") from exc
    return _greedy_batches(elements, size_of, max_total_size, collate_fn, info_logger, warn_logger)


class SizeAwareBatchSampler(Sampler[List[int]]):
    """A batch sampler whose batches' total size does not exceed ``max_total_size``.

    This is useful when dealing with datasets where each element has a
    different size, such as graphs or sequences of varying lengths. The
    sampler uses ``sizeof`` to determine the size of each index the underlying
    ``sampler`` yields and groups consecutive indices greedily (see
    :func:`size_aware_batching`, which it runs once per epoch). An index whose
    own size exceeds ``max_total_size`` is skipped and reported through
    ``warn_logger``.

    It has no ``__len__`` (the number of batches is only known by building
    them). ``set_epoch(epoch)`` is passed on to the underlying sampler when it
    has one (a ``DistributedSampler``, for instance).

    With a memory model, ``sizeof`` is an element's marginal cost and
    ``max_total_size`` the budget minus the batch's fixed cost: see
    :class:`dynabatch.compat.bionemo.size_aware_memory.MemorySizeof`.

    Example:
        >>> import torch
        >>> from dynabatch.compat.bionemo import SizeAwareBatchSampler

        >>> # Define a sample dataset with torch.tensor
        >>> dataset = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]),
        ...            torch.tensor([7, 8]), torch.tensor([9, 10])]

        >>> # Define a function that returns the size of each element in the dataset.
        >>> def sizeof(index):
        ...     return dataset[index].numel()

        >>> # Create a SizeAwareBatchSampler with a maximum total batch size of 4.
        >>> batch_sampler = SizeAwareBatchSampler(
        ...     sampler=torch.utils.data.SequentialSampler(dataset),
        ...     sizeof=sizeof,
        ...     max_total_size=4
        ... )

        >>> # Iterate over batches of indices that do not exceed the maximum total size.
        >>> print(list(batch_sampler))
        [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self,
        sampler: Union[Sampler[List[int]], Iterable[int]],
        sizeof: Callable[[int], Real],
        max_total_size: Real,
        info_logger: Optional[Callable[[str], None]] = None,
        warn_logger: Optional[Callable[[str], None]] = None,
    ) -> None:
        """Initializes the SizeAwareBatchSampler.

        Args:
            sampler: The underlying sampler (or any iterable of indices).
            sizeof: A function that returns the size at each index, or a
                dictionary or sequence container indexed by it. Its return type
                must be comparable with ``max_total_size`` and addable.
            max_total_size: The maximum total size of a mini-batch.
            info_logger: A function to log info. Defaults to None.
            warn_logger: A function to log warnings. Defaults to None.

        Raises:
            TypeError: If sampler is not an instance of Sampler or Iterable, or
                if sizeof is not a callable, dictionary, or sequence container.
            ValueError: If max_total_size is not a real number (bionemo
                documents "not a positive number" but checks only that it is a
                real number, and so does this class: with 0 or a negative value
                it constructs, and iterating it skips every element of positive
                size, calling ``warn_logger`` for each). NaN is refused too.
        """
        if not (isinstance(sampler, Sampler) or (isinstance(sampler, Iterable) and not isinstance(sampler, str))):
            raise TypeError(
                "sampler should be an instance of torch.utils.data.Sampler or Iterable, "
                f"but got sampler={described(sampler)}"
            )
        _check_max_total_size(max_total_size)
        self._sizeof = _size_function(sizeof)
        _check_logger("info_logger", info_logger)
        _check_logger("warn_logger", warn_logger)
        self._sampler = sampler
        self._max_total_size = max_total_size
        self._info_logger = info_logger
        self._warn_logger = warn_logger

    def __iter__(self) -> Iterator[List[int]]:
        """Iterate over batches of indices.

        Yields:
            A batch of indices that do not exceed the maximum total size.
        """
        return _greedy_batches(
            iter(self._sampler), self._sizeof, self._max_total_size, None, self._info_logger, self._warn_logger
        )

    def set_epoch(self, epoch: int) -> None:
        """Passes ``epoch`` on to the underlying sampler if it has ``set_epoch`` (else does nothing)."""
        set_epoch = getattr(self._sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

"""A calibrated :class:`~dynabatch.memory.model.MemoryModel` as the sizes of bionemo's size-aware batching.

bionemo's recipe is: measure peaks with ``collect_cuda_peak_alloc``, fit a
memory model, batch with ``SizeAwareBatchSampler(sizeof=..., max_total_size=...)``.
:func:`fit_memory_model` is the middle step: it turns the ``(features, peaks)``
of :func:`~dynabatch.memory.measure.collect_peak_alloc` (or
``collect_cuda_peak_alloc``) into a :class:`~dynabatch.memory.model.MemoryModel`.

**What ``sizeof`` means here.** ``SizeAwareBatchSampler`` adds the sizes of a
batch's elements, but a batch's memory is not purely additive: the model
predicts a batch of ``r`` rows padded to length ``L`` to peak at

``peak(r, L) = F(L) + r * S(L)``

(``F`` the batch's fixed bytes, ``S`` the bytes of one more row; both grow with
``L``). So an element's size is its **marginal bytes per row**, ``S(L)`` at the
length ``L`` it is padded to, and the limit is the budget **minus the fixed
part**, ``max_total_size = budget_bytes - F(L_max)``, ``L_max`` being the
longest padded length a batch can have. Then ``sum of sizes <= max_total_size``
is ``peak(r, L) <= budget_bytes`` whenever every row of a batch is padded to the
length its size was computed at:

* every batch padded to one length (``padding="max_length"``): pass
  ``padded_length`` to :class:`MemorySizeof`;
* pad-to-longest batches of similar lengths: :func:`bucket_memory_kwargs` gives
  each bucket of a :class:`~dynabatch.compat.bionemo.bucket.BucketBatchSampler` a
  ``SizeAwareBatchSampler`` sized at the bucket's longest length (this is exact
  by the model, and the recommended way);
* ``MemorySizeof(model, lengths)`` alone, with pad-to-longest and mixed
  lengths in a batch, *undercounts* the padding of the shorter rows (they are
  padded to the batch's longest): use it only where a batch's lengths are close.

Example:
    >>> import torch
    >>> from dynabatch.compat.bionemo import BucketBatchSampler, SizeAwareBatchSampler, create_buckets
    >>> from dynabatch.compat.bionemo.size_aware_memory import bucket_memory_kwargs, fit_memory_model
    >>> shapes = [(r, n) for r in (1, 2, 4, 8) for n in (8, 16, 32, 64)]
    >>> peaks = [1000 + 50 * n + r * (200 + 10 * n) for r, n in shapes]  # measured bytes, e.g.
    >>> mm = fit_memory_model(shapes, peaks, device="cpu")
    >>> lengths = torch.tensor([9, 12, 30, 31, 60, 64, 10, 33])
    >>> buckets = create_buckets(lengths, max_width=16, min_bucket_count=2)
    >>> kwargs = bucket_memory_kwargs(mm, lengths, buckets.bucket_boundaries, budget_bytes=6000)
    >>> sampler = BucketBatchSampler(lengths, buckets.bucket_boundaries, SizeAwareBatchSampler,
    ...                              base_batch_sampler_individual_kwargs=kwargs, shuffle=False)
    >>> batches = list(sampler)  # buckets [9, 12) [12, 28) [28, 33) [33, 49) [49, 65)
    >>> batches
    [[0, 6], [1], [2, 3], [7], [4, 5]]
    >>> all(mm.predict(len(b), int(lengths[b].max())) <= 6000 for b in batches)
    True
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_lengths, check_positive_int, check_positive_number
from dynabatch.memory.budget import MemoryBudget
from dynabatch.memory.model import MemoryModel

__all__ = ["MemorySizeof", "bucket_memory_kwargs", "fit_memory_model"]

logger = logging.getLogger(__name__)


def _shape_of(feature: Any) -> tuple[Any, Any]:
    if isinstance(feature, Mapping):
        if "rows" in feature and "padded_length" in feature:
            return feature["rows"], feature["padded_length"]
    elif isinstance(feature, (tuple, list)) and len(feature) == 2:
        return feature[0], feature[1]
    raise bad_type(
        "features", "a list of (rows, padded_length) pairs or of dicts with those keys (what work returned)", feature
    )


def fit_memory_model(
    features: Iterable[Any], alloc_peaks: Iterable[Any], *, device: Any = None, model: Any = None
) -> MemoryModel:
    """Fits a :class:`~dynabatch.memory.model.MemoryModel` to what ``collect_peak_alloc`` returned.

    ``work`` in ``collect_peak_alloc(dataset, work, device)`` should return the
    shape of the batch it ran: ``(rows, padded_length)`` (``input_ids.shape``
    is one) or a dict with those keys. Items that ran out of memory (feature
    and peak ``None``) are left out, and logged. The fit is
    ``MemoryModel.fit`` (non-negative least squares, see its docs).

    Args:
        features: the shapes, one per item.
        alloc_peaks: the peak bytes, one per item.
        device: the device the peaks were measured on (recorded).
        model: the model they are of (recorded).

    Returns:
        The fitted model; ``predict(rows, padded_length)`` gives bytes.

    Raises:
        ValueError: lengths differ, or no item has both a shape and a peak.
        TypeError: a feature is not a shape.
    """
    features, alloc_peaks = list(features), list(alloc_peaks)
    if len(features) != len(alloc_peaks):
        raise bad_value("alloc_peaks", f"one peak per feature ({len(features)})", f"<{len(alloc_peaks)} peaks>")
    kept = [(_shape_of(f), p) for f, p in zip(features, alloc_peaks) if f is not None and p is not None]
    if len(kept) < len(features):
        logger.warning("fit_memory_model: %d of %d items left out (no shape or no peak: out of memory)",
                       len(features) - len(kept), len(features))
    if not kept:
        raise bad_value("features", "at least one item with a shape and a peak", f"<{len(features)} items>")
    rows = [int(shape[0]) for shape, _ in kept]
    lengths = [int(shape[1]) for shape, _ in kept]
    return MemoryModel(device=device, model=model).fit(rows, lengths, [p for _, p in kept], source="collect_peak_alloc")


def _check_budget(memory_model: Any, budget_bytes: Any = None, pad_to_multiple_of: int | None = None) -> MemoryBudget:
    """The :class:`~dynabatch.memory.budget.MemoryBudget` to size elements under: ``memory_model`` as it is when
    it is one, else a budget over that model (``budget_bytes``, no margin; 1 byte until a budget is known)."""
    if isinstance(memory_model, MemoryBudget):
        return memory_model
    if not callable(getattr(memory_model, "predict", None)):
        raise bad_type("memory_model", "a fitted MemoryModel or a MemoryBudget (an object with predict(rows, "
                       "padded_length))", memory_model)
    budget = 1.0 if budget_bytes is None else check_positive_number("budget_bytes", budget_bytes)
    return MemoryBudget(memory_model, budget, memory_margin=0.0, pad_to_multiple_of=pad_to_multiple_of)


def _split(budget: MemoryBudget, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``F(L)`` (fixed bytes) and ``S(L)`` (bytes per row) at every padded width, from the budget's predictions."""
    fixed = budget.predict_at(0, widths)
    per_row = budget.predict_at(1, widths) - fixed
    return fixed, np.maximum(per_row, 0.0)


def _size_for_rows(room: Any, rows: Any) -> Any:
    """The bytes per row at which exactly ``rows`` rows (at least 1) fit in ``room``: a shape's cap as a size."""
    return room / np.maximum(rows, 1) * (1 - 1e-12)


class MemorySizeof:
    """``sizeof`` for ``SizeAwareBatchSampler``: an element's bytes per row under a memory budget.

    ``MemorySizeof(mm, lengths)(i)`` is ``S(L_i)``, the predicted bytes one more
    row of length ``L_i`` adds to a batch (``L_i`` is ``lengths[i]``, or
    ``padded_length`` for every element, at the width the collator pads to).
    :meth:`max_total_size` is the matching limit, the budget minus the fixed
    bytes of the longest batch. See the module docstring for when the sum is
    exact. Given a :class:`~dynabatch.memory.budget.MemoryBudget`, its budget,
    margin, padding rule and failed shapes apply: an element at least as wide as
    a shape that ran out of memory costs enough that fewer rows than that shape
    fit. Likewise where the model predicts more than ``F(L) + r * S(L)`` (beyond
    the rows it measured it extrapolates conservatively), :meth:`max_total_size`
    raises the sizes so that no more rows fit than the budget allows at ``L``.

    Args:
        memory_model: a fitted :class:`~dynabatch.memory.model.MemoryModel`, or a
            :class:`~dynabatch.memory.budget.MemoryBudget` over one.
        lengths: every element's length in tokens (indexed by the sampler's indices).
        padded_length: the length every batch is padded to, if it is fixed.
        pad_to_multiple_of: the collator's ``pad_to_multiple_of``, if any (a
            budget's own rule when a budget is given).

    Example:
        >>> from dynabatch.compat.bionemo import SizeAwareBatchSampler
        >>> from dynabatch.compat.bionemo.size_aware_memory import MemorySizeof, fit_memory_model
        >>> shapes = [(r, n) for r in (1, 4, 16) for n in (16, 64, 128)]
        >>> mm = fit_memory_model(shapes, [3000 + r * 40 * n for r, n in shapes])
        >>> sizeof = MemorySizeof(mm, [128] * 10, padded_length=128)
        >>> round(sizeof(0)), round(sizeof.max_total_size(30000))
        (5120, 27000)
        >>> list(SizeAwareBatchSampler(range(10), sizeof, sizeof.max_total_size(30000)))
        [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    """

    def __init__(self, memory_model: Any, lengths: Any, *, padded_length: int | None = None,
                 pad_to_multiple_of: int | None = None) -> None:
        if pad_to_multiple_of is not None:
            pad_to_multiple_of = check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
        self.budget = _check_budget(memory_model, pad_to_multiple_of=pad_to_multiple_of)
        self._given_budget = isinstance(memory_model, MemoryBudget)
        own = check_lengths("lengths", lengths, positive=True)
        if padded_length is not None:
            padded_length = check_positive_int("padded_length", padded_length)
            if own.size and own.max() > padded_length:
                raise bad_value("padded_length", f">= the longest length ({int(own.max())})", padded_length)
            own = np.full_like(own, padded_length)
        self.memory_model = self.budget.memory_model
        self.lengths = np.asarray(self.budget.width(own), dtype=np.int64)
        self._distinct, inverse = np.unique(self.lengths, return_inverse=True)
        fixed, per_row = _split(self.budget, self._distinct) if self._distinct.size else (
            np.zeros(0), np.zeros(0))
        self._inverse, self._per_row_bytes = inverse, per_row
        self._longest_fixed = float(fixed.max()) if fixed.size else 0.0
        self._per_row = self._sizes(None).tolist()

    def _sizes(self, room: float | None, budget_bytes: float = 0.0) -> np.ndarray:
        """Each element's size; with ``room`` (the limit under ``budget_bytes``), raised where the budget allows
        fewer rows at its width than the bytes per row alone would (a shape that ran out of memory, or a model
        that predicts more than ``F + r * S`` beyond the rows it measured), so no more rows than that fit in
        ``room``."""
        sizes = self._per_row_bytes.copy()
        if room is not None and sizes.size:
            limit = budget_bytes / (1.0 - self.budget.memory_margin)  # rows_allowed takes the margin off again
            cap = self.budget.rows_allowed(self._distinct, max_memory=limit).astype(np.float64)
            sizes = np.maximum(sizes, np.where(cap > 0, _size_for_rows(room, cap), np.inf))
        return sizes[self._inverse] if sizes.size else sizes

    def __call__(self, index: int) -> float:
        """Bytes per row of element ``index`` at its padded length."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < len(self._per_row):
            raise bad_value("index", f"an element index in [0, {len(self._per_row)})", index)
        return self._per_row[index]

    def __len__(self) -> int:
        return len(self._per_row)

    def max_total_size(self, budget_bytes: float | None = None) -> float:
        """The budget minus the fixed bytes of a batch at the longest padded length.

        Args:
            budget_bytes: what a batch may use; default: the given budget's
                ``budget_bytes`` (its margin applied).

        Raises:
            ValueError: the fixed bytes alone are over the budget (no batch fits).
        """
        if budget_bytes is None:
            if not self._given_budget:
                raise bad_value("budget_bytes", "a number of bytes (no MemoryBudget was given)", budget_bytes)
            budget = self.budget.budget_bytes
        else:
            budget = check_positive_number("budget_bytes", budget_bytes)
        room = budget - self._longest_fixed
        if not room > 0:
            raise bad_value("budget_bytes", f"above the fixed bytes of the longest batch ({self._longest_fixed:.0f})",
                            budget_bytes)
        self._per_row = self._sizes(room, budget).tolist()
        return room


def bucket_memory_kwargs(memory_model: Any, lengths: Any, bucket_boundaries: Any, budget_bytes: float | None = None,
                         *, pad_to_multiple_of: int | None = None) -> dict[str, list[Any]]:
    """``base_batch_sampler_individual_kwargs`` giving each bucket a memory-sized ``SizeAwareBatchSampler``.

    For ``BucketBatchSampler(lengths, bucket_boundaries, SizeAwareBatchSampler,
    base_batch_sampler_individual_kwargs=...)``: in the bucket whose longest
    element is ``L`` (at its padded width), every element costs ``S(L)`` and the
    limit is ``budget_bytes - F(L)``, so a batch of the bucket, padded to its
    longest row (at most ``L``), is predicted at or under ``budget_bytes``; that
    is the budget's ``rows_allowed(L)`` rows (fewer where a shape ran out of memory).

    Args:
        memory_model: a fitted :class:`~dynabatch.memory.model.MemoryModel`, or a
            :class:`~dynabatch.memory.budget.MemoryBudget` over one.
        lengths: every element's length in tokens (the ``sizes`` of the bucket sampler).
        bucket_boundaries: the bucket sampler's boundaries.
        budget_bytes: the peak bytes a batch may reach (default: a given budget's ``budget_bytes``).
        pad_to_multiple_of: the collator's ``pad_to_multiple_of``, if any.

    Returns:
        ``{"sizeof": [...], "max_total_size": [...]}``, one entry per bucket.

    Raises:
        ValueError: one row of some non-empty bucket is already over the budget.
    """
    budget = _check_budget(memory_model, budget_bytes, pad_to_multiple_of)
    if budget_bytes is None and not isinstance(memory_model, MemoryBudget):
        raise bad_value("budget_bytes", "a number of bytes (no MemoryBudget was given)", budget_bytes)
    limit = budget.budget_bytes if budget_bytes is None else check_positive_number("budget_bytes", budget_bytes)
    own = check_lengths("lengths", lengths, positive=True)
    bounds = bucket_boundaries.detach().cpu().numpy() if isinstance(bucket_boundaries, torch.Tensor) else \
        np.asarray(bucket_boundaries)
    if bounds.ndim != 1 or not np.issubdtype(bounds.dtype, np.number):
        raise bad_type("bucket_boundaries", "a 1-D sequence of numbers", bucket_boundaries)
    bounds = np.sort(bounds.astype(np.float64))
    sizeofs: list[Any] = []
    limits: list[float] = []
    for lower, upper in pairwise(bounds):
        inside = own[(own >= lower) & (own < upper)]
        if not inside.size:  # an empty bucket still gets a sampler: any valid arguments
            sizeofs.append(_constant(0.0))
            limits.append(limit)
            continue
        width = int(budget.width(int(inside.max())))
        fixed, per_row = (float(v[0]) for v in _split(budget, np.array([width])))
        if fixed + per_row > limit:
            raise bad_value("budget_bytes", f"enough for one row of length {width} "
                            f"({math.ceil(fixed + per_row)} bytes predicted)", limit)
        rows = int(budget.rows_allowed(width, max_memory=limit / (1.0 - budget.memory_margin)))
        room = limit - fixed
        sizeofs.append(_constant(max(per_row, _size_for_rows(room, rows)) if rows else room))
        limits.append(room)
    return {"sizeof": sizeofs, "max_total_size": limits}


class _constant:
    """A sizeof giving every element of a bucket the same bytes per row (picklable, unlike a lambda)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, index: int) -> float:
        return self.value

    def __repr__(self) -> str:
        return f"<{self.value:.0f} bytes per row>"

"""The inference planner's settings, and the one rule that turns the rows memory allows into a batch's rows.

:class:`PlanSettings` holds what every inference plan is made under (the first
batch's rows, the truncation limit, the spike search's candidates, the
collator's padding, the growth per step and the token cap), validated once.
:func:`settle_rows` is the rule every inference plan applies on top of what an
estimator says fits, up front (:meth:`BudgetEstimator.plan_sizes
<dynabatch.sampling.estimators.BudgetEstimator.plan_sizes>`) and batch after
batch in measured mode (:meth:`BatchPlanner.next_batch
<dynabatch.sampling.planner.BatchPlanner.next_batch>`): rounded down to the
granularity, never below the floor, never above the caps.

Example:
    >>> settings = PlanSettings(batch_size=8, max_input_token_length=128, max_tokens=2048, pad_to_multiple_of=8)
    >>> int(settings.token_cap(100))  # 2048 tokens over rows padded to 104
    19
    >>> settle_rows(45, floor=8, granularity=8, cap=settings.token_cap(100)).tolist()
    19
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_fraction, check_positive_int, check_positive_number
from dynabatch.data.collate import padded_width
from dynabatch.memory.shape import ModelShape, check_model_shape

__all__ = ["PlanSettings", "candidate_sizes", "distinct", "settle_rows"]

_MAX_BATCH = 2**40  # candidate sizes stay exact in int64 and float64

def candidate_sizes(batch_size: int, batch_start_range: float, batch_end_range: float, steps: int) -> np.ndarray:
    """The candidate batch sizes, ascending and deduplicated (before capping at what remains).

    Example:
        >>> candidate_sizes(10, 1.0, 2.0, 5).tolist()
        [10, 13, 15, 18, 20]
    """
    sizes = np.ceil(batch_size * np.linspace(batch_start_range, batch_end_range, steps) - 1e-9)
    return distinct(sizes.astype(np.int64))


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D array, ascending: ``np.unique`` without its first call's import of ``numpy.ma``
    (0.1 s, a tenth of a small loader build).

    Example:
        >>> distinct(np.array([3, 1, 3, 2])).tolist()
        [1, 2, 3]
    """
    ordered = np.sort(values)
    keep = np.ones(len(ordered), dtype=bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep]


def settle_rows(fits: Any, *, floor: Any = 1, granularity: int | None = None, cap: Any = None) -> np.ndarray:
    """A batch's rows from the rows that fit: the one rule of every inference plan (ints or arrays, broadcast).

    1. Rounded down to a multiple of ``granularity`` where at least one multiple fits.
    2. Never fewer than ``floor``: the first batch's rows in a plan relative to
       the first batch (its rows at no longer texts cost no more than it did), 1 otherwise.
    3. Never more than ``cap``: the token cap, the growth over the last batch,
       the rows that remain (``None``: no cap).

    At least one row, whatever the caps.

    Example:
        >>> settle_rows([3, 13, 40], floor=4, granularity=8, cap=[100, 100, 20]).tolist()
        [4, 8, 20]
    """
    rows = np.asarray(fits, dtype=np.int64)
    if granularity is not None:
        rounded = rows - rows % granularity
        rows = np.where(rounded > 0, rounded, rows)
    rows = np.maximum(rows, floor)
    if cap is not None:
        rows = np.minimum(rows, cap)
    return np.maximum(rows, 1)


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """The planner's settings, validated once when made.

    Args:
        batch_size: rows of the first (longest, hardest) batch; the smallest batch size.
        max_input_token_length: the truncation limit the lengths were cut at.
        threshold: the highest spike probability a chosen candidate may have.
        batch_start_range: smallest candidate, as a multiple of ``batch_size`` (>= 1).
        batch_end_range: largest candidate, as a multiple of ``batch_size``.
        steps: number of candidate multiples between the two.
        model_shape: the model and call (:meth:`ModelShape.from_model
            <dynabatch.memory.shape.ModelShape.from_model>`), or ``None``.
        pad_to_multiple_of: the collator rounds each batch's width up to a
            multiple of it; every estimator judges a batch at that padded width.
        max_growth: measured mode (``run``): a batch has at most this many
            times the rows of the batch run before it (>= 1), so one optimistic
            measurement cannot make the next batch jump far past what was measured.
        max_tokens: padded tokens per batch (rows x padded width) at most, as
            text-embeddings-inference's ``--max-batch-tokens`` and fairseq's
            ``max_tokens``; ``None``: no token cap. Combined with the memory
            rule, the smaller wins, up front and in measured mode.

    Example:
        >>> PlanSettings(batch_size=10, max_input_token_length=64, batch_end_range=2.0, steps=5).candidates.tolist()
        [10, 13, 15, 18, 20]
    """

    batch_size: int
    max_input_token_length: int
    threshold: float = 0.025
    batch_start_range: float = 1.0
    batch_end_range: float = 6.0
    steps: int = 50
    model_shape: ModelShape | None = None
    pad_to_multiple_of: int | None = None
    max_growth: float = 2.0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        batch_size = check_positive_int("batch_size", self.batch_size)
        set_ = object.__setattr__
        set_(self, "batch_size", batch_size)
        set_(self, "max_input_token_length", check_positive_int("max_input_token_length", self.max_input_token_length))
        set_(self, "threshold", check_fraction("threshold", self.threshold))
        start, end = self.batch_start_range, self.batch_end_range
        for name, value in (("batch_start_range", start), ("batch_end_range", end)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise bad_type(name, "a number >= 1", value)
        if not (start >= 1 and math.isfinite(start)):
            raise bad_value("batch_start_range", "a finite number >= 1 (the first batch is the smallest)", start)
        if not (end >= start and math.isfinite(end)):
            raise bad_value("batch_end_range", f"a finite number >= batch_start_range={start!r}", end)
        if batch_size * end > _MAX_BATCH:
            raise bad_value("batch_end_range", f"at most {_MAX_BATCH} / batch_size={batch_size}", end)
        set_(self, "batch_start_range", float(start))
        set_(self, "batch_end_range", float(end))
        set_(self, "steps", check_positive_int("steps", self.steps))
        check_model_shape(self.model_shape)
        if self.pad_to_multiple_of is not None:
            set_(self, "pad_to_multiple_of", check_positive_int("pad_to_multiple_of", self.pad_to_multiple_of))
        growth = check_positive_number("max_growth", self.max_growth)
        if not (growth >= 1 and math.isfinite(growth)):
            raise bad_value("max_growth", "a finite number >= 1 (a batch may keep the rows of the one before)",
                            self.max_growth)
        set_(self, "max_growth", growth)
        if self.max_tokens is not None:
            set_(self, "max_tokens", check_positive_int("max_tokens", self.max_tokens))

    def width(self, longest: Any) -> Any:
        """The width the collator pads a batch whose longest row is ``longest`` to (int or array)."""
        return padded_width(longest, self.pad_to_multiple_of)

    def token_cap(self, longest: Any) -> Any:
        """The most rows whose longest is ``longest`` within ``max_tokens`` at the padded width (``None``: no cap)."""
        if self.max_tokens is None:
            return None
        return self.max_tokens // np.maximum(np.asarray(self.width(longest), dtype=np.int64), 1)

    @property
    def candidates(self) -> np.ndarray:
        """The candidate batch sizes, ascending (:func:`candidate_sizes`)."""
        return candidate_sizes(self.batch_size, self.batch_start_range, self.batch_end_range, self.steps)

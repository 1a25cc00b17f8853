"""Measured mode: batch sizes corrected by the peak memory of the batches already run.

The classifier's plan is the prior. Once batches have been measured, the
memory of a batch of ``r`` rows ``w`` tokens wide is modelled as
``r * (a + b * w)``: a part per row whatever its length (logits over the
vocabulary, the KV cache of generated tokens, beams) and a part per token.
``a`` and ``b`` are fitted by least squares (non-negative) to the measured
peaks per row, then scaled up so the model is never below any measurement.
While every measured batch has the same width, a row is taken to cost what
the costliest measured row did, whatever its length (a shorter row never
costs more): safe, and exact for memory that is all per row.
Texts run longest first, so the next batch's width is the length of the text
it starts with, and the largest ``r`` whose predicted peak stays at or under
``target`` (0.9) times the first batch's measured peak is the size: smaller
than planned after a spike, larger where the plan left memory unused. It
never goes below the first batch's rows (the planner's own floor) unless that
many would exceed the first batch's peak itself. Growth per step is bounded
(``max_growth`` times the last size) so the model never extrapolates far
beyond what it has seen.

Pure numpy over lengths and measured bytes: :func:`dynabatch.run` feeds it
(``adapt=True``) with CUDA memory statistics or the CPU tracker.

Example:
    >>> import numpy as np
    >>> from dynabatch.feedback import MemoryFeedback
    >>> lengths = np.array([100] * 4 + [50] * 40 + [10] * 200)  # sorted longest first
    >>> fb = MemoryFeedback(lengths, planned_sizes=[4] * 61)
    >>> fb.next_size(0)  # nothing measured yet: the plan
    4
    >>> fb.observe(rows=4, width=100, peak_bytes=4 * (1000 + 10 * 100))  # the first batch: the budget
    >>> fb.next_size(4)  # one width seen: 2000 bytes a row at any length; 3.6 rows fit, the floor is 4
    4
    >>> fb.observe(rows=4, width=50, peak_bytes=4 * (1000 + 10 * 50))
    >>> fb.next_size(8)  # 0.9 * 8000 bytes / (1000 + 10 * 50) per row = 4.8
    4
    >>> fb.next_size(44)  # 0.9 * 8000 / (1000 + 10 * 10) = 6.5 rows, plan says 4
    6
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from dynabatch._validation import (
    bad_value,
    check_fraction,
    check_non_negative_int,
    check_positive_number,
)

__all__ = ["MemoryFeedback"]

logger = logging.getLogger(__name__)


class MemoryFeedback:
    """Chooses the next batch size from the plan and the peaks measured so far.

    Args:
        sorted_lengths: token length of every text in run order (longest first).
        planned_sizes: the classifier's plan over ``sorted_lengths`` (sizes in order).
        target: largest predicted peak, as a fraction of the first batch's.
        max_growth: a batch has at most this many times the rows of the one before.

    Attributes:
        budget_: the first batch's measured peak bytes (``None`` until observed).
        per_row_, per_token_: the fitted model, bytes (``None`` until a batch is measured).
    """

    def __init__(self, sorted_lengths: Sequence[int], planned_sizes: Sequence[int], *, target: float = 0.9,
                 max_growth: float = 2.0) -> None:
        self.lengths = np.asarray(sorted_lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or (len(self.lengths) > 1 and (np.diff(self.lengths) > 0).any()):
            raise bad_value("sorted_lengths", "a 1-D array sorted longest first", "an unsorted array")
        sizes = np.asarray(planned_sizes, dtype=np.int64)
        if sizes.ndim != 1 or (sizes < 1).any() or sizes.sum() != len(self.lengths):
            raise bad_value("planned_sizes", f"positive sizes adding up to {len(self.lengths)} texts",
                            f"{len(sizes)} sizes adding up to {int(sizes.sum())}")
        self.target = check_fraction("target", target)
        self.max_growth = check_positive_number("max_growth", max_growth)
        if self.max_growth < 1:
            raise bad_value("max_growth", "at least 1", max_growth)
        self._plan_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._plan_sizes = sizes
        self._rows: list[int] = []
        self._widths: list[int] = []
        self._peaks: list[float] = []
        self.budget_: float | None = None
        self.floor_: int = int(sizes[0]) if len(sizes) else 1
        self.per_row_: float | None = None
        self.per_token_: float | None = None

    def planned_size(self, start: int) -> int:
        """The plan's size for the batch that holds sorted position ``start``."""
        i = int(np.searchsorted(self._plan_starts, start, side="right")) - 1
        return int(self._plan_sizes[max(i, 0)])

    def observe(self, rows: int, width: int, peak_bytes: float) -> None:
        """Records a measured batch; the first one observed is the budget."""
        rows = check_non_negative_int("rows", rows)
        width = check_non_negative_int("width", width)
        if not (peak_bytes >= 0 and np.isfinite(peak_bytes)):
            raise bad_value("peak_bytes", "a finite number >= 0", peak_bytes)
        if rows == 0:
            return
        if self.budget_ is None:
            self.budget_ = float(peak_bytes)
        self._rows.append(rows)
        self._widths.append(width)
        self._peaks.append(float(peak_bytes))
        self._fit()

    def _fit(self) -> None:
        widths = np.asarray(self._widths, dtype=np.float64)
        per_row = np.asarray(self._peaks) / np.asarray(self._rows, dtype=np.float64)
        if len(np.unique(widths)) < 2:
            self.per_row_, self.per_token_ = float(per_row.max()), 0.0
            return
        design = np.stack([np.ones_like(widths), widths], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, per_row, rcond=None)
        if b < 0:  # memory never shrinks with width: all per row
            a, b = per_row.max(), 0.0
        elif a < 0:  # nor is it negative per row: all per token
            a, b = 0.0, float((per_row / np.maximum(widths, 1.0)).max())
        predicted = a + b * widths
        scale = max(1.0, float((per_row / np.maximum(predicted, 1e-12)).max()))
        self.per_row_, self.per_token_ = float(a * scale), float(b * scale)

    def next_size(self, start: int, last_size: int | None = None) -> int:
        """Rows for the batch starting at sorted position ``start``.

        Args:
            start: sorted position of the batch's first (longest) text.
            last_size: rows of the batch run before it (bounds the growth).
        """
        remaining = len(self.lengths) - start
        if remaining <= 0:
            return 0
        plan = min(self.planned_size(start), remaining)
        if self.per_row_ is None or self.budget_ is None:
            return plan
        cost = max(self.per_row_ + self.per_token_ * float(self.lengths[start]), 1e-12)
        fits = int(self.target * self.budget_ // cost)
        floor = min(self.floor_, int(self.budget_ // cost))  # batch_size rows, unless over the budget itself
        cap = int(self.max_growth * (last_size or plan))
        size = max(1, min(max(fits, floor), cap, remaining))
        if size != plan:
            logger.debug("measured mode: %d rows at sorted position %d (plan %d, model fits %d)", size, start,
                         plan, fits)
        return size

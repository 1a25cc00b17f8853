"""Measured mode: batch sizes corrected by the peak memory of the batches already run.

The classifier's plan is the prior. Once a batch has been measured, its peak
per row bounds what a row costs in every later batch: texts run longest first
and a shorter row never needs more memory, so a later batch of ``r`` rows
peaks at most at ``r`` times the last measured peak per row. The next batch
takes the most rows whose bound stays at or under ``target`` (0.9) times the
first batch's measured peak: fewer than planned after a spike, more where the
plan left memory unused. As texts get shorter each measurement lowers the
bound and the batches grow, one batch behind the lengths. It never goes below
the first batch's rows (the planner's own floor) unless that many would exceed
the first batch's peak itself, and growth per step is bounded (``max_growth``
times the last size).

No curve is fitted: a line through the measured peaks extrapolated to shorter
texts under-predicts whenever memory falls less than linearly with length (a
``generate`` call's per-row logits and new tokens), and on a real
encoder-decoder it let batches reach 1.08x the first batch's peak; the bound
cannot be exceeded if memory grows with rows and with length.

Pure numpy over lengths and measured bytes: :func:`dynabatch.run` feeds it
(``adapt=True``) with CUDA memory statistics or the CPU tracker.

Example:
    >>> import numpy as np
    >>> from dynabatch.memory.feedback import MemoryFeedback
    >>> lengths = np.array([100] * 4 + [50] * 40 + [10] * 200)  # sorted longest first
    >>> fb = MemoryFeedback(lengths, planned_sizes=[4] * 61)
    >>> fb.next_size(0)  # nothing measured yet: the plan
    4
    >>> fb.observe(rows=4, peak_bytes=8000)  # the first batch: the budget, 2000 bytes a row
    >>> fb.next_size(4)  # 0.9 * 8000 / 2000 = 3.6 rows fit; the floor is the first batch's 4
    4
    >>> fb.observe(rows=4, peak_bytes=6000)  # shorter rows: 1500 bytes each
    >>> fb.next_size(8, last_size=4)  # 0.9 * 8000 / 1500 = 4.8
    4
    >>> fb.observe(rows=4, peak_bytes=4400)  # 1100 bytes a row
    >>> fb.next_size(12, last_size=4)  # 0.9 * 8000 / 1100 = 6.5
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
from dynabatch.memory.features import SPIKE_RATIO

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
        row_bytes_: the last measured peak per row, the bound on a row of any later
            batch (``None`` until a batch is measured).
    """

    def __init__(self, sorted_lengths: Sequence[int], planned_sizes: Sequence[int], *, target: float = SPIKE_RATIO,
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
        self.budget_: float | None = None
        self._floor = int(sizes[0]) if len(sizes) else 1  # the planner's smallest batch
        self.row_bytes_: float | None = None

    def planned_size(self, start: int) -> int:
        """The plan's size for the batch that holds sorted position ``start``."""
        i = int(np.searchsorted(self._plan_starts, start, side="right")) - 1
        return int(self._plan_sizes[max(i, 0)])

    def observe(self, rows: int, peak_bytes: float) -> None:
        """Records a measured batch (run in order, longest first); the first one observed is the budget."""
        self.observe_parts([(rows, peak_bytes)])

    def observe_parts(self, parts: Sequence[tuple[int, float]]) -> None:
        """Records a batch that ran as several calls, each ``(rows, peak_bytes)``.

        A batch split after running out of memory runs in parts: the largest
        part's peak is what fitted (the budget, if it is the first batch), and
        the costliest row of any part bounds the rows of later batches.
        """
        measured = []
        for rows, peak_bytes in parts:
            rows = check_non_negative_int("rows", rows)
            if not (peak_bytes >= 0 and np.isfinite(peak_bytes)):
                raise bad_value("peak_bytes", "a finite number >= 0", peak_bytes)
            if rows:
                measured.append((rows, float(peak_bytes)))
        if not measured:
            return
        if self.budget_ is None:
            self.budget_ = max(peak for _, peak in measured)
        self.row_bytes_ = max(peak / rows for rows, peak in measured)

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
        if self.row_bytes_ is None or self.budget_ is None:
            return plan
        cost = max(self.row_bytes_, 1e-12)
        fits = int(self.target * self.budget_ // cost)
        floor = min(self._floor, int(self.budget_ // cost))  # batch_size rows, unless over the budget itself
        cap = int(self.max_growth * (last_size or plan))
        size = max(1, min(max(fits, floor), cap, remaining))
        if size != plan:
            logger.debug("measured mode: %d rows at sorted position %d (plan %d, %d fit)", size, start, plan, fits)
        return size

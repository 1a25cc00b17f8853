"""Measured mode's bound: what the batches already run say about the peak of any later batch.

Once a batch has been measured, its peak per row bounds what a row costs in
every later batch at most as wide: a shorter row never needs more memory, so a
batch of ``r`` rows no wider than a measured batch of ``r_m`` rows and peak
``p_m`` peaks at most at ``p_m`` (if ``r <= r_m``) or ``r * p_m / r_m`` (if
``r > r_m``). :meth:`MemoryFeedback.bound` is that bound (the tightest over
every measured batch at least as wide), and :meth:`MemoryFeedback.max_rows`
the most rows it keeps under a budget (by
:func:`~dynabatch.memory.budget.rows_under`, the one closed form of it). The
first batch measured sets the budget (:attr:`MemoryFeedback.budget`), unless
an absolute budget was set before any ran (:meth:`MemoryFeedback.set_budget`:
``max_memory``, resolved on the device when the run starts, by
:func:`~dynabatch.memory.budget.resolve_max_memory`).

Texts run longest first, so every measured batch bounds every later one. In
measured mode the planner sizes the next batch with this bound
(:meth:`BatchPlanner.next_batch <dynabatch.sampling.planner.BatchPlanner.next_batch>`:
the most rows whose bound stays at or under 0.9 times the first batch's
measured peak, and the planner's rules on top). A run that cannot re-plan
(batches in another order, a plain iterable, ``torch.distributed``) uses the
same bound at ``1.0`` times the first peak to split a batch before it runs
(``dynabatch.run``'s guarded mode).

A call that runs out of memory lowers the limit later batches are planned
under, whatever the measured peaks say: :meth:`MemoryFeedback.observe_out_of_memory`
gives its rows and the measured peak per row at its width (:meth:`MemoryFeedback.row_bound`)
to the :class:`~dynabatch.memory.oom.OutOfMemoryLimit` (the rule lives there),
measured calls raise the limit again, and :meth:`MemoryFeedback.oom_cap` is
the most rows it allows at a width.

No curve is fitted: a line through the measured peaks extrapolated to shorter
texts under-predicts whenever memory falls less than linearly with length (a
``generate`` call's per-row logits and new tokens), and on a real
encoder-decoder it let batches reach 1.08x the first batch's peak; the bound
cannot be exceeded if memory grows with rows and with length.

Measuring need not be continuous (``sparse=True``, :meth:`MemoryFeedback.should_measure`):
a batch the bound already covers can run unmeasured, since the bound stays
valid for every narrower batch; measuring again only lets batches grow. A batch
is measured when nothing measured covers it, when it has at least
:data:`SPARSE_ROWS_GROWTH` times the rows of the batch whose measurement bounds
it, when its width is at most :data:`SPARSE_MAX_DROP` of that batch's, or when
the per-row peak at its width, extrapolated from the two measured widths
nearest above it, would be :data:`SPARSE_GAIN` lower (the bound would loosen by
that much). That extrapolation only decides *when* to measure, never what fits.

Pure numpy over measured bytes: :func:`dynabatch.run` feeds it with CUDA
memory statistics or the CPU tracker.

Example:
    >>> from dynabatch.memory.feedback import MemoryFeedback
    >>> fb = MemoryFeedback()
    >>> fb.observe(rows=4, padded_length=100, peak_bytes=8000)  # the first batch: the budget, 2000 bytes a row
    >>> fb.observe(rows=4, padded_length=50, peak_bytes=4400)  # shorter rows: 1100 bytes each
    >>> fb.budget, fb.bound(rows=8, padded_length=50), fb.bound(rows=2, padded_length=50)
    (8000.0, 8800.0, 4400.0)
    >>> fb.max_rows(padded_length=50, budget_bytes=0.9 * 8000), fb.max_rows(padded_length=100, budget_bytes=8000)
    (6, 4)
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence

import numpy as np

from dynabatch._validation import bad_value, check_bool, check_non_negative_int, check_positive_number
from dynabatch.memory.budget import rows_under
from dynabatch.memory.oom import OutOfMemoryLimit

__all__ = ["SPARSE_GAIN", "SPARSE_MAX_DROP", "SPARSE_ROWS_GROWTH", "MemoryFeedback"]

logger = logging.getLogger(__name__)

SPARSE_GAIN = 0.2
"""Sparse measuring: measure a batch when its extrapolated per-row peak is this share below the bound's."""
SPARSE_MAX_DROP = 0.5
"""Sparse measuring: always measure a batch at most this share of the width of the batch that bounds it."""
SPARSE_ROWS_GROWTH = 2.0
"""Sparse measuring: always measure a batch with at least this many times the rows of the batch that bounds it."""


class MemoryFeedback:
    """The peaks measured so far, the budget the first one sets, and the bound they put on any batch.

    Args:
        sparse: measure only the batches :meth:`should_measure` names (the
            CPU tracker's cost); ``False``: every batch.
        budget: an absolute budget in bytes (:meth:`set_budget`), or ``None``: the first measured batch's peak.

    Attributes:
        budget: the absolute budget, or the first batch's measured peak bytes (``None`` until observed).
        absolute: whether the budget was set up front (:meth:`set_budget`) rather than by the first peak.
        row_bytes_: the costliest row of the last measured batch (``None`` until a batch is measured).
        oom: what out-of-memory errors taught (:class:`~dynabatch.memory.oom.OutOfMemoryLimit`).
    """

    def __init__(self, *, sparse: bool = False, budget: float | None = None) -> None:
        check_bool("sparse", sparse)
        self.sparse = sparse
        self.budget: float | None = None
        self.absolute = False
        self.row_bytes_: float | None = None
        # (rows, width, peak) of every measured call, as columns grown in place (a run measures thousands)
        self._table = np.empty((3, 64), dtype=np.float64)
        self._n = 0
        self.oom = OutOfMemoryLimit()
        self._warned_zero = False
        self._warned_over = False
        self.set_budget(budget)

    def set_budget(self, budget: float | None) -> None:
        """An absolute budget in bytes for every batch, the first included (``None``: the first measured peak's,
        the relative rule); set before any batch is measured."""
        if budget is None:
            return
        check_positive_number("budget", budget, finite=True, rule="None or a finite number of bytes > 0")
        if self._n and not self.absolute:
            raise RuntimeError("MemoryFeedback.set_budget after a batch was measured: the first peak is the budget")
        self.budget, self.absolute = float(budget), True

    @property
    def measured(self) -> bool:
        """Whether any batch has been measured."""
        return self._n > 0

    # -- measurements ----------------------------------------------------------------------------
    def observe(self, rows: int, padded_length: float | None, peak_bytes: float) -> None:
        """Records a measured batch; the first one observed is the budget.

        Args:
            rows: its rows.
            padded_length: its padded width; ``None``: at least as wide as
                every batch asked about later (texts run longest first).
            peak_bytes: its measured peak.
        """
        self.observe_parts([(rows, padded_length, peak_bytes)])

    def observe_parts(self, parts: Sequence[tuple[int, float | None, float]]) -> None:
        """Records a batch that ran as several calls, each ``(rows, padded_length, peak_bytes)`` (as :meth:`observe`).

        A batch split after running out of memory runs in parts: the largest
        part's peak is what fitted (the budget, if it is the first batch), and
        each part bounds the batches at most as wide as it. A first batch that
        measured 0 bytes (nothing ran on the measured device) sets no budget.
        """
        measured = []
        for rows, width, peak_bytes in parts:
            rows = check_non_negative_int("rows", rows)
            if width is None:
                width = math.inf
            elif isinstance(width, bool) or not isinstance(width, numbers.Real) or not width >= 0:
                raise bad_value("padded_length", "None or a number >= 0 (a padded width)", width)
            if not (peak_bytes >= 0 and np.isfinite(peak_bytes)):
                raise bad_value("peak_bytes", "a finite number >= 0", peak_bytes)
            if rows:
                measured.append((rows, float(width), float(peak_bytes)))
        if not measured:
            return
        if self.budget is None:
            top = max(peak for _, _, peak in measured)
            if top <= 0:
                if not self._warned_zero:  # once: every later batch would say the same
                    self._warned_zero = True
                    logger.warning("the first measured batch peaked at 0 bytes: nothing it does allocates on the "
                                   "measured device, so no budget is set (batches follow the plan); run the "
                                   "batches on the device the model is on (run(..., device=...))")
                return
            self.budget = top
        elif self.absolute and not self._warned_over:
            self._warn_over_budget(measured)
        self.row_bytes_ = max(peak / rows for rows, _, peak in measured)
        end = self._n + len(measured)
        if end > self._table.shape[1]:
            grown = np.empty((3, max(end, 2 * self._table.shape[1])), dtype=np.float64)
            grown[:, : self._n] = self._table[:, : self._n]
            self._table = grown
        self._table[:, self._n : end] = np.asarray(measured, dtype=np.float64).T
        self._n = end
        if self.oom.failed_bytes is not None:  # measured successes raise what out-of-memory errors lowered
            for rows, width, _ in measured:
                self.oom.observe_success(rows, self.row_bound(width))

    def _warn_over_budget(self, measured: list[tuple[int, float, float]]) -> None:
        """Warns (once) of a measured call that peaked above the absolute budget: later calls are sized under it
        where the measured peaks bound rows under it, but rows alone run whatever they peak at, so a budget under one
        row would otherwise be exceeded silently (a memory model refuses such a budget when the run starts; without
        one only the peaks can tell)."""
        over = [(rows, width, peak) for rows, width, peak in measured if peak > self.budget]
        if not over:
            return
        self._warned_over = True
        rows, width, peak = max(over, key=lambda call: call[2])
        shape = f"{rows} row{'s' if rows != 1 else ''}" + (f" x {width:.0f} tokens" if math.isfinite(width) else "")
        logger.warning("a call of %s peaked at %s bytes, above the absolute budget of %s bytes (max_memory): later "
                       "calls are sized under it where the measured peaks allow, rows alone otherwise, whatever they "
                       "peak at; pass a larger max_memory, or max_memory=None (warned once)", shape, f"{peak:,.0f}",
                       f"{self.budget:,.0f}")

    def observe_out_of_memory(self, rows: int, width: float) -> None:
        """Records a call of ``rows`` x padded ``width`` that ran out of memory, predicted at :meth:`row_bound`
        a row; one that nothing measured bounds teaches nothing here (the shapes it dominates are still split
        before they run)."""
        self.oom.observe_out_of_memory(rows, self.row_bound(width))

    def row_bound(self, width: float) -> float | None:
        """The least measured peak per row of the calls at least as wide as ``width`` (``None`` if none is)."""
        if not self._n:
            return None
        r, w, p = self._columns()
        wide = w >= width
        return float((p[wide] / r[wide]).min()) if wide.any() else None

    def oom_cap(self, width: float) -> int | None:
        """The most rows at padded ``width`` that out-of-memory errors allow (``None`` before any)."""
        return self.oom.rows_under_limit(self.row_bound(width))

    def _columns(self) -> np.ndarray:
        """The measured calls' rows, widths and peaks (three views)."""
        return self._table[:, : self._n]

    def _bounds(self, rows: int, width: float) -> np.ndarray:
        """Each measurement's bound on ``rows`` x ``width`` (``inf`` where it is narrower)."""
        r, w, p = self._columns()
        bounds = np.where(rows <= r, p, rows * p / np.maximum(r, 1))
        return np.where(w >= width, bounds, np.inf)

    def bound(self, rows: int, padded_length: float) -> float | None:
        """The most a batch of ``rows`` rows and ``padded_length`` can peak at, by the measured batches at least as
        wide (memory grows with rows and with length); ``None`` when none is."""
        if not self._n:
            return None
        best = float(self._bounds(rows, padded_length).min())
        return best if math.isfinite(best) else None

    def max_rows(self, padded_length: float, budget_bytes: float) -> int:
        """The most rows at ``padded_length`` whose :meth:`bound` stays at or under ``budget_bytes`` (0 if none does)."""
        if not self._n:
            return 0
        r, w, p = self._columns()
        # Rows up to r_m are bounded by p_m; beyond, by rows x p_m / r_m: rows_under's closed form.
        rows = np.maximum(rows_under(0.0, p / r, budget_bytes), r.astype(np.int64))
        rows = np.where((w >= padded_length) & (p <= budget_bytes), rows, 0)
        return int(rows.max())

    def should_measure(self, rows: int, width: float) -> bool:
        """Whether a batch of ``rows`` x ``width`` is to be measured: always unless :attr:`sparse` (see the module)."""
        if not self.sparse or not self._n:  # nothing measured yet (an absolute budget is set before any is)
            return True
        if self.oom.above_fitted(rows, self.row_bound(width)):
            return True  # a call above what ran since an out-of-memory error: measuring it raises the limit
        bounds = self._bounds(rows, width)
        m = int(np.argmin(bounds))
        if not math.isfinite(bounds[m]):
            return True  # nothing measured is as wide
        r, w, p = self._columns()
        if rows >= SPARSE_ROWS_GROWTH * r[m]:
            return True
        if not math.isfinite(w[m]):
            return False
        if width <= (1.0 - SPARSE_MAX_DROP) * w[m]:
            return True
        per_row = p / r
        wider = np.flatnonzero((w > w[m]) & np.isfinite(w))
        if len(wider):  # the per-row slope over width between w[m] and the nearest measured width above it
            n = wider[np.argmin(w[wider])]
            n = wider[w[wider] == w[n]][np.argmin(per_row[wider][w[wider] == w[n]])]
            slope = max(0.0, (per_row[n] - per_row[m]) / (w[n] - w[m]))
        else:  # one width measured: a per-row peak proportional to width
            slope = per_row[m] / w[m] if w[m] > 0 else 0.0
        expected = per_row[m] - slope * (w[m] - width)
        return bool(expected <= (1.0 - SPARSE_GAIN) * per_row[m])

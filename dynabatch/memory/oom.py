"""Out of memory: the one guard around a call, and the one policy for what follows an error.

:func:`call_guarded` runs one call and returns an :class:`Attempt`: its output
and (when asked) its peak memory, or the out-of-memory error it raised. Any
other error propagates. After an out-of-memory error the error's traceback is
dropped (it holds the failed call's tensors) and memory is freed, so the
caller can retry smaller at once.

The policy, used by :func:`dynabatch.run`'s executor, training's
:class:`~dynabatch.training.step_guard.StepGuard` and
:class:`~dynabatch.memory.budget.MemoryBudget` alike:

* a call that ran out of memory is retried in halves (:func:`split_sizes`);
* a call with more rows than a cap allows is split before it runs into the
  fewest parts of at most that many rows, as equal as can be (:func:`equal_parts`);
* a failed shape dominates every shape at least as large in rows and in width
  (:func:`dominating`, :func:`failed_cap`): memory grows with both, so those
  are split before they are tried;
* an error at a shape is evidence that the device's real limit lies below what
  was predicted for that shape, whatever the measured peaks said (fragmentation,
  other processes, memory a tracker cannot see): :class:`OutOfMemoryLimit` holds
  that lower limit, which later calls are planned under and which rises again
  only on measured successes.

Example:
    >>> import torch
    >>> ok = call_guarded(lambda n: torch.zeros(n, 128).sum(), 4, measure_on="cpu")
    >>> ok.error is None, ok.peak_bytes
    (True, 2560)
    >>> failed = call_guarded(lambda n: torch.zeros(n, 128).sum(), 4, measure_on="cpu", limit_bytes=1024)
    >>> type(failed.error).__name__, failed.output
    ('OutOfMemoryError', None)
    >>> split_sizes(7), equal_parts(10, 4), dominating([(8, 64)], 9, 64), dominating([(8, 64)], 9, 32)
    ([3, 4], [4, 3, 3], (8, 64), None)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch.memory.device import backend_of, causes, free_memory, is_out_of_memory_error

__all__ = [
    "LIMIT_RISE",
    "MAX_ROWS",
    "Attempt",
    "OutOfMemoryLimit",
    "call_guarded",
    "dominating",
    "equal_parts",
    "failed_cap",
    "split_sizes",
]

logger = logging.getLogger(__name__)

MAX_ROWS = 2**40
"""The row count answered where nothing caps rows."""
LIMIT_RISE = 0.25
"""After an out-of-memory error, the share of the gap between what ran and what failed the limit rises by."""


# -- the guard ---------------------------------------------------------------------------------------


@dataclass
class Attempt:
    """What :func:`call_guarded` got: the output and peak bytes, or the out-of-memory error."""

    output: Any = None
    peak_bytes: int | None = None
    error: BaseException | None = None


def call_guarded(
    fn: Callable[..., Any],
    *args: Any,
    measure_on: Any = None,
    limit_bytes: int | None = None,
    prepare: Callable[[Any], Any] | None = None,
    finish: Callable[[Any], Any] | None = None,
    cleanup: Callable[[], None] | None = None,
    free_after: bool = False,
) -> Attempt:
    """Calls ``fn(*args)``; an out-of-memory error is returned in the :class:`Attempt`, never raised.

    Args:
        fn: the work.
        *args: its arguments (``prepare`` maps the first one, e.g. moves a batch to a device).
        measure_on: ``None``, or the device to measure ``fn``'s peak memory on (its
            backend's peak tracker, as :func:`~dynabatch.memory.measure.track_peak_memory`
            uses it); only ``fn`` is measured.
        limit_bytes: CPU only: a simulated device of this many free bytes.
        prepare: applied to the first argument before the call, outside the measurement.
        finish: applied to the output after the call, outside the measurement (its
            out-of-memory errors are caught too).
        cleanup: called after the call, whatever happened (drops references the work holds).
        free_after: free memory after every call, not only after an out-of-memory error.

    Returns:
        ``Attempt(output, peak_bytes, None)``, or ``Attempt(None, None, error)``
        after an out-of-memory error (its traceback dropped, memory freed).
    """
    error = None
    try:
        if prepare is not None and args:
            args = (prepare(args[0]), *args[1:])
        if measure_on is not None:
            device = torch.device(measure_on)
            with backend_of(device).peak_tracker(device, limit_bytes) as tracker:
                output = fn(*args)
            peak = tracker.peak_bytes
        else:
            output, peak = fn(*args), None
        if finish is not None:
            output = finish(output)
    except Exception as exc:
        if not is_out_of_memory_error(exc):
            raise
        for raised in causes(exc):  # each traceback's frames hold the failed call's tensors (a wrapper's too)
            raised.with_traceback(None)
        error = exc
    finally:
        args = ()
        if cleanup is not None:
            cleanup()
    if error is not None:
        free_memory()
        return Attempt(error=error)
    if free_after:
        free_memory()
    return Attempt(output, peak)


# -- splitting ---------------------------------------------------------------------------------------


def split_sizes(rows: int) -> list[int]:
    """The parts a call of ``rows`` rows that ran out of memory is retried as: halves, the second the larger."""
    return [rows // 2, rows - rows // 2]


def equal_parts(rows: int, cap: int) -> list[int]:
    """The fewest parts of at most ``cap`` rows (at least 1) that ``rows`` rows split into, as equal as can be."""
    parts = -(-rows // max(int(cap), 1))
    base, extra = divmod(rows, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def dominating(failed: Sequence[tuple[int, int]], rows: int, width: int) -> tuple[int, int] | None:
    """The first failed ``(rows, width)`` shape that ``rows`` x ``width`` is at least as large as, or ``None``."""
    for failed_rows, failed_width in failed:
        if rows >= failed_rows and width >= failed_width:
            return failed_rows, failed_width
    return None


def failed_cap(width: Any, failed: Sequence[tuple[int, int]]) -> np.ndarray:
    """The most rows at each width that no failed shape dominates: below ``r`` at widths >= ``w`` per failed ``(r, w)``."""
    width = np.asarray(width)
    cap = np.full(width.shape, MAX_ROWS, dtype=np.int64)
    for rows, failed_width in failed:
        cap = np.where(width >= failed_width, np.minimum(cap, rows - 1), cap)
    return cap


# -- learning from errors ----------------------------------------------------------------------------


class OutOfMemoryLimit:
    """The limit out-of-memory errors set on the *predicted* peak of later calls.

    A call is predicted at its rows times its bytes a row, as the caller
    predicts a row at the call's width (in :func:`dynabatch.run`, the measured
    peak per row of :class:`~dynabatch.memory.feedback.MemoryFeedback`). The rule:

    * before any error there is no limit;
    * an error on ``rows`` rows predicted at ``p`` bytes means the real limit
      lies below ``p``. From then on a row is predicted at no less than
      ``p / rows`` (the failed call's bytes a row): the drop of measured peaks
      with width is not trusted below it, since the memory that failed the call
      may not shrink with width (a ``generate``'s logits, memory the tracker
      cannot see). ``row_floor=False`` drops that floor where a row's cost is
      known at every width (a training step's padded cells, which its
      activations and logits grow with). The lowest failed prediction is never
      planned again;
    * right after an error the limit is half the failed prediction (the halves
      the call is retried as); then it lies between the highest prediction that
      ran since (``fitted_bytes``, a measured success) and the lowest that failed
      (``failed_bytes``): :data:`LIMIT_RISE` (a quarter) of the way up, and at
      least one row above what ran, while that stays below what failed. It
      rises only as measured successes come in, so batches grow back towards
      the failed size and stop one row short of the lowest size that failed; a
      quarter step overshoots rarely (at most 5 errors for any real limit up to
      300 rows, after a first failure at up to twice it).

    Args:
        row_floor: predict a row at no less than the failed call's cost a row
            (the default; see above).

    Example:
        >>> limit = OutOfMemoryLimit()
        >>> limit.rows_under_limit(100.0) is None  # nothing failed: no limit
        True
        >>> limit.observe_out_of_memory(rows=32, row_bytes=100.0)  # 100 bytes a row at least from now on
        >>> limit.limit_bytes, limit.rows_under_limit(50.0)  # the halves
        (1600.0, 16)
        >>> limit.observe_success(rows=16, row_bytes=60.0)  # a half ran: 16 rows at 100 bytes
        >>> limit.limit_bytes, limit.rows_under_limit(50.0)  # a quarter of the way from 1600 (ran) to 3200 (failed)
        (2000.0, 20)
        >>> limit.rows_under_limit(250.0)  # at a width where a row costs more than the failed call's, fewer rows
        8
        >>> cells = OutOfMemoryLimit(row_floor=False)  # a row costs its padded width, at any width
        >>> cells.observe_out_of_memory(rows=32, row_bytes=100.0)
        >>> cells.rows_under_limit(100.0), cells.rows_under_limit(25.0)
        (16, 64)
    """

    def __init__(self, *, row_floor: bool = True) -> None:
        self.row_floor = bool(row_floor)
        self.row_bytes = 0.0
        self.failed_bytes: float | None = None
        self.fitted_bytes = 0.0
        self.errors = 0

    def _bytes_a_row(self, row_bytes: float | None) -> float:
        given = float(row_bytes or 0.0)
        return max(given, self.row_bytes) if self.row_floor or given <= 0 else given

    def observe_out_of_memory(self, rows: int, row_bytes: float | None) -> None:
        """A call of ``rows`` rows, predicted at ``row_bytes`` a row, ran out of memory."""
        per_row = self._bytes_a_row(row_bytes)
        if rows < 1 or per_row <= 0:
            return
        predicted = rows * per_row
        self.errors += 1
        self.row_bytes = per_row
        if self.failed_bytes is None or predicted < self.failed_bytes:
            self.failed_bytes = predicted
        if self.fitted_bytes >= self.failed_bytes:
            self.fitted_bytes = 0.0
        logger.info("out of memory at %d rows predicted at %.0f bytes: later calls are planned under %.0f bytes",
                    rows, predicted, self.limit_bytes)

    def observe_success(self, rows: int, row_bytes: float | None) -> None:
        """A measured call of ``rows`` rows, predicted at ``row_bytes`` a row, ran: the limit may rise to it."""
        if self.failed_bytes is None or rows < 1:
            return
        predicted = rows * self._bytes_a_row(row_bytes)
        if self.fitted_bytes < predicted < self.failed_bytes:
            self.fitted_bytes = predicted

    @property
    def limit_bytes(self) -> float | None:
        """The most a later call may be predicted at (``None`` before any error)."""
        if self.failed_bytes is None:
            return None
        if not self.fitted_bytes:
            return self.failed_bytes / 2
        step = max(LIMIT_RISE * (self.failed_bytes - self.fitted_bytes), self.row_bytes)
        limit = self.fitted_bytes + step
        return limit if limit < self.failed_bytes else self.fitted_bytes

    def above_fitted(self, rows: int, row_bytes: float | None) -> bool:
        """Whether a call would be predicted above every success since the errors (measuring it may raise the limit)."""
        return self.failed_bytes is not None and rows * self._bytes_a_row(row_bytes) > self.fitted_bytes

    def rows_under_limit(self, row_bytes: float | None) -> int | None:
        """The most rows (at least 1), at ``row_bytes`` a row, whose prediction stays at or under the limit;
        ``None`` before any error."""
        limit = self.limit_bytes
        if limit is None:
            return None
        per_row = self._bytes_a_row(row_bytes)
        rows = int(limit // per_row)
        if (rows + 1) * per_row <= limit:  # floor() of a float quotient can be one off
            rows += 1
        return max(1, min(rows, MAX_ROWS))

"""The batch planner: token lengths in, batches of input positions out. Pure numpy.

:class:`BatchPlanner` is the one place that decides batches: given the lengths,
the :class:`PlanSettings` and an estimator (the spike classifier, with or
without model shape, or a calibrated memory model; see
:mod:`dynabatch.sampling.estimators`) it gives the whole plan up front
(:meth:`~BatchPlanner.batches`, what the loader serves) or batch after batch,
told each measured peak (:meth:`~BatchPlanner.next_batch` and
:meth:`~BatchPlanner.observe`, what ``run(memory="measured")`` uses).
:func:`plan_batches` and :func:`plan_batch_sizes` are the functional forms.

Texts are sorted longest first (stable). The first batch is exactly
``batch_size`` texts, the longest: the hardest batch, whose peak memory is the
budget. For every later batch starting at sorted position ``p`` the candidate
sizes are ``ceil(batch_size * linspace(batch_start_range, batch_end_range,
steps))``, deduplicated and capped at the texts that remain; the spike
classifier gives each candidate's probability of exceeding 90% of the first
batch's peak; the batch takes the largest candidate such that it *and every
smaller candidate* are at or below ``threshold`` (no safe island above an unsafe
candidate), or ``batch_size`` when none is safe; and at most ``max_tokens``
padded tokens when the settings give a token cap.

Features come from prefix sums of the sorted lengths, so no Python loop runs
over texts, and few classifier calls give exactly the batch-by-batch rule above
(see :mod:`dynabatch.sampling._spike_search`). The settings and the one rule
every plan applies on top of what memory allows are in
:mod:`dynabatch.sampling.plan_settings`.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.planner import plan_batches
    >>> lengths = np.random.default_rng(0).integers(1, 128, size=2000)
    >>> batches = plan_batches(lengths, batch_size=16, max_input_token_length=128)
    >>> len(batches[0]), int(lengths[batches[0]].min()) >= int(np.sort(lengths)[-16])
    (16, True)
    >>> sorted(np.concatenate(batches).tolist()) == list(range(2000))
    True
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_lengths
from dynabatch.memory.feedback import MemoryFeedback
from dynabatch.memory.shape import ModelShape
from dynabatch.sampling.estimators import SpikeEstimator, check_token_cap
from dynabatch.sampling.plan_settings import PlanSettings, candidate_sizes, settle_rows

__all__ = ["BatchPlanner", "PlanCursor", "PlanSettings", "candidate_sizes", "plan_batch_sizes", "plan_batches"]

logger = logging.getLogger(__name__)


def _truncated_lengths(lengths: Any, max_input_token_length: int) -> np.ndarray:
    arr = check_lengths("lengths", lengths)
    if arr.size and arr.max() > max_input_token_length:
        raise bad_value("lengths", f"at most max_input_token_length={max_input_token_length} (truncated lengths)",
                        int(arr.max()))
    return arr


def _longest_first(lengths: np.ndarray, max_input_token_length: int) -> np.ndarray:
    """Positions sorted longest first, ties in input order (a radix sort when lengths fit in 16 bits)."""
    if max_input_token_length < 2**15:
        return np.argsort((max_input_token_length - lengths).astype(np.int16), kind="stable")
    return np.argsort(-lengths, kind="stable")


@dataclass
class PlanCursor:
    """One consumer of a planner's pass: the peaks it measured and its last batch's rows."""

    feedback: MemoryFeedback
    last: int | None = None


class BatchPlanner:
    """Decides every batch over token lengths: the whole plan up front, or the next batch from measured peaks.

    Args:
        lengths: token count of every text (input order), truncated, special tokens included.
        settings: the :class:`PlanSettings`.
        estimator: how memory is judged (:mod:`dynabatch.sampling.estimators`):
            ``None`` for the bundled spike classifier (shape-aware when the
            settings carry a ``model_shape``).
        skip: input positions planned into no batch (bad inputs the loader skips), or ``None``.

    Up front, :meth:`batches` is the plan. Online, :meth:`next_batch` hands out
    the batches in plan order (longest first) and :meth:`observe` takes each
    batch's measured peak: the first measured batch's peak is the budget, and
    every later batch takes the rows that stay at or under the estimator's
    ``target`` times it, bounded by the measured peaks per row (a classifier;
    see :class:`~dynabatch.memory.feedback.MemoryFeedback`) or predicted by the
    memory model, which each measured peak refines; then the one rule of
    :func:`~dynabatch.sampling.plan_settings.settle_rows`: the estimator's
    granularity, never fewer rows than the first batch (unless the measured
    peaks say that many exceed the first batch's peak itself), never more than
    ``max_growth`` times the last batch, ``max_tokens`` padded tokens, or what remains.

    Example:
        >>> import numpy as np
        >>> planner = BatchPlanner(np.array([3, 9, 8, 2, 2, 7]), PlanSettings(batch_size=2, max_input_token_length=9))
        >>> [b.tolist() for b in planner.batches()]  # longest first: lengths 9 8 | 7 3 | 2 2
        [[1, 2], [5, 0], [3, 4]]
        >>> planner.next_batch().tolist()  # online: the plan's first batch
        [1, 2]
        >>> planner.observe(rows=2, padded_length=9, peak_bytes=1000)  # its peak: the budget, 500 a row
        >>> planner.next_batch().tolist()  # 0.9 * 1000 / 500 rows fit, and never fewer than batch_size
        [5, 0]
        >>> planner.observe(rows=2, padded_length=7, peak_bytes=300)  # 150 a row: 6 fit, 2 remain
        >>> planner.next_batch().tolist(), planner.next_batch()
        ([3, 4], None)
    """

    def __init__(self, lengths: Any, settings: PlanSettings, estimator: Any = None, *, skip: Any = None) -> None:
        if not isinstance(settings, PlanSettings):
            raise bad_type("settings", "a PlanSettings", settings)
        self.settings = settings
        self.lengths = _truncated_lengths(lengths, settings.max_input_token_length)
        self.order = _longest_first(self.lengths, settings.max_input_token_length)
        if skip is not None and len(skip):
            planned = np.ones(len(self.lengths), dtype=bool)
            planned[np.asarray(skip, dtype=np.int64)] = False
            self.order = self.order[planned[self.order]]
        self.sorted_lengths = self.lengths[self.order]
        self.estimator = SpikeEstimator() if estimator is None else estimator
        check_token_cap(self.sorted_lengths, settings, relative=self.estimator.relative)
        self._sizes: np.ndarray | None = None
        self._ends: np.ndarray | None = None  # where each planned batch ends in sorted positions
        self._start = 0
        self._cursor = self.cursor()

    def sizes(self) -> np.ndarray:
        """The plan's batch sizes over :attr:`sorted_lengths`, in order (computed once)."""
        if self._sizes is None:
            self._sizes = np.asarray(self.estimator.plan_sizes(self.sorted_lengths, self.settings), dtype=np.int64)
        return self._sizes

    def first_rows(self) -> int:
        """Rows of the plan's first batch (0 when nothing is planned)."""
        sizes = self.sizes()
        return int(sizes[0]) if len(sizes) else 0

    def batches(self) -> list[np.ndarray]:
        """The plan: one int64 array of input positions per batch, longest texts first."""
        sizes = self.sizes()
        if not len(sizes):
            return []
        # Runs of equal sizes become rows of one 2-D view each (far cheaper than a slice per batch).
        change = np.flatnonzero(np.diff(sizes)) + 1
        run_starts = np.concatenate([[0], change])
        run_ends = np.concatenate([change, [len(sizes)]])
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        out: list[np.ndarray] = []
        for a, b, size in zip(run_starts.tolist(), run_ends.tolist(), sizes[run_starts].tolist()):
            out.extend(self.order[offsets[a] : offsets[b]].reshape(b - a, size))
        return out

    def restart(self, *, sparse: bool = False) -> None:
        """Starts handing out batches from the first again, with the estimator as it was built (see
        :meth:`BudgetEstimator.restart <dynabatch.sampling.estimators.BudgetEstimator.restart>`): a planner run
        again hands out the batches it handed out before.

        Args:
            sparse: the :attr:`feedback` measures only the batches whose
                measurement could let later ones grow (see
                :meth:`~dynabatch.memory.feedback.MemoryFeedback.should_measure`).
        """
        self.estimator.restart()
        self._start = 0
        self._cursor = self.cursor(sparse=sparse)

    def cursor(self, *, sparse: bool = False) -> PlanCursor:
        """A new consumer of this pass's batches (one device of several): its own measured peaks and last size.

        Consumers share the pass: each :meth:`next_batch` takes the next
        longest texts, sized by the consumer's own peaks, so each device runs
        under its own first batch's peak.
        """
        return PlanCursor(MemoryFeedback(sparse=sparse))

    @property
    def feedback(self) -> MemoryFeedback:
        """The measured peaks of this pass (since :meth:`restart`) and the bound they set."""
        return self._cursor.feedback

    def planned_size(self, start: int) -> int:
        """The plan's size for the batch that holds sorted position ``start``."""
        sizes = self.sizes()
        if self._ends is None:
            self._ends = np.cumsum(sizes)
        return int(sizes[min(int(np.searchsorted(self._ends, start, side="right")), len(sizes) - 1)])

    def next_batch(self, cursor: PlanCursor | None = None) -> np.ndarray | None:
        """The input positions of the next batch, sized from the peaks observed so far; ``None`` when done.

        Args:
            cursor: whose peaks size it (:meth:`cursor`); ``None``: the planner's own.
        """
        cursor = self._cursor if cursor is None else cursor
        start = self._start
        if start >= len(self.sorted_lengths):
            return None
        size = self.next_size(start, cursor.last, cursor.feedback)
        self._start += size
        cursor.last = size
        return self.order[start : start + size]

    def peek(self, n: int, cursor: PlanCursor | None = None) -> list[np.ndarray]:
        """The next ``n`` batches :meth:`next_batch` would hand out if no peak were observed before them (a
        prefetcher builds them ahead; a batch re-sized by a later peak is built again)."""
        cursor = self._cursor if cursor is None else cursor
        start, last, out = self._start, cursor.last, []
        while len(out) < n and start < len(self.sorted_lengths):
            size = self.next_size(start, last, cursor.feedback)
            out.append(self.order[start : start + size])
            start, last = start + size, size
        return out

    def budget_on(self, device: Any) -> float | None:
        """The absolute budget a run on ``device`` plans under (the loader's ``max_memory``, resolved there when
        the run starts), or ``None``: the relative rule. Refused when it cannot hold one row of the longest text."""
        longest = int(self.settings.width(int(self.sorted_lengths[0]))) if len(self.sorted_lengths) else None
        return self.estimator.budget_on(device, longest)

    def next_size(self, start: int, last_size: int | None = None, feedback: MemoryFeedback | None = None) -> int:
        """Rows for the batch starting at sorted position ``start``, after a batch of ``last_size`` rows.

        Relative (no budget set up front): before any peak is measured, the
        plan's; then the rows the estimator (or the measured bound) keeps under
        ``target`` times the first batch's peak. Absolute (the feedback's budget
        set by :meth:`budget_on`): the rows the estimator's model of bytes keeps
        under it from the first batch on (or, without one, the plan's until a
        peak is measured, then the measured bound's); the bound's rows where
        they are more. Either way settled by
        :func:`~dynabatch.sampling.plan_settings.settle_rows`; sizes the
        measured bound extrapolates grow at most ``max_growth`` times a step.
        """
        settings, estimator = self.settings, self.estimator
        feedback = self._cursor.feedback if feedback is None else feedback
        remaining = len(self.sorted_lengths) - start
        longest = int(self.sorted_lengths[start])
        width = int(settings.width(longest))
        planned = self.planned_size(start)
        tokens = settings.token_cap(longest)
        cap = remaining if tokens is None else min(remaining, int(tokens))
        learned = feedback.oom_cap(width)  # what out-of-memory errors allow, whatever the rest says
        if learned is not None:
            cap = min(cap, learned)
        budget = feedback.budget
        if budget is None:  # nothing measured yet: the plan (which keeps the token cap)
            return int(settle_rows(planned, cap=cap))
        fits = estimator.rows_for_peak(longest, budget)
        if fits is None and not feedback.measured:  # an absolute budget, no model of bytes: the plan until a peak
            return int(settle_rows(planned, cap=cap))
        if fits is None or not feedback.absolute:
            cap = min(cap, int(settings.max_growth * (last_size or planned)))
        if fits is None:
            fits = feedback.max_rows(width, estimator.target * budget)
        elif feedback.absolute:  # the model errs high; what the measured peaks bound fits as well
            fits = max(fits, feedback.max_rows(width, estimator.target * budget))
        floor = 1
        if estimator.relative:  # the first batch's rows, unless the measured peaks put that many above its peak
            floor = min(int(self.sizes()[0]), max(1, feedback.max_rows(width, budget)))
        size = int(settle_rows(fits, floor=floor, granularity=estimator.granularity, cap=cap))
        if size != planned:
            logger.debug("measured mode: %d rows at sorted position %d (plan %d, %d fit)", size, start, planned, fits)
        return size

    def observe(self, rows: int, padded_length: int, peak_bytes: float) -> None:
        """Records the measured peak of the batch handed out last (rows of at most ``padded_length`` tokens)."""
        self.observe_parts([(rows, padded_length, peak_bytes)])

    def observe_parts(self, parts: Sequence[tuple[int, int, float]], cursor: PlanCursor | None = None) -> None:
        """Records a batch that ran as several calls (split after running out of memory), each
        ``(rows, padded_length, peak_bytes)``, by ``cursor`` (``None``: the planner's own)."""
        (self._cursor if cursor is None else cursor).feedback.observe_parts(parts)
        for rows, width, peak in parts:
            if rows:
                self.estimator.observe(rows, width, peak)

    def observe_out_of_memory(self, rows: int, padded_length: int, cursor: PlanCursor | None = None) -> None:
        """Records a call of ``rows`` x ``padded_length`` that ran out of memory: later batches are planned under
        the lower limit it shows (:meth:`~dynabatch.memory.feedback.MemoryFeedback.observe_out_of_memory`), and a
        memory model learns its cap."""
        (self._cursor if cursor is None else cursor).feedback.observe_out_of_memory(rows, padded_length)
        self.estimator.observe_out_of_memory(rows, padded_length)


def plan_batch_sizes(
    sorted_lengths: np.ndarray,
    batch_size: int,
    max_input_token_length: int,
    *,
    classifier: Any = None,
    threshold: float = 0.025,
    batch_start_range: float = 1.0,
    batch_end_range: float = 6.0,
    steps: int = 50,
    model_shape: ModelShape | None = None,
) -> np.ndarray:
    """Plans batch sizes over lengths already sorted longest first.

    The sizes cover the lengths in order: batch ``i`` is
    ``sorted_lengths[sum(sizes[:i]):sum(sizes[:i + 1])]``. See
    :func:`plan_batches` for the arguments.
    """
    settings = PlanSettings(batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps,
                            model_shape)
    lengths = _truncated_lengths(check_lengths("sorted_lengths", sorted_lengths, longest_first=True),
                                 settings.max_input_token_length)
    return SpikeEstimator(classifier).plan_sizes(lengths, settings)


def plan_batches(
    lengths: Any,
    batch_size: int,
    max_input_token_length: int,
    *,
    classifier: Any = None,
    threshold: float = 0.025,
    batch_start_range: float = 1.0,
    batch_end_range: float = 6.0,
    steps: int = 50,
    model_shape: ModelShape | None = None,
) -> list[np.ndarray]:
    """Plans batches of input positions from token lengths (in input order).

    Args:
        lengths: token count of every text, truncated, special tokens included.
        batch_size: rows of the first (longest, hardest) batch; the smallest batch size.
        max_input_token_length: the truncation limit the lengths were cut at.
        classifier: the spike classifier (see :func:`~dynabatch.memory.classifier.load_classifier`);
            ``None`` for the bundled one.
        threshold: the highest spike probability a chosen candidate may have.
        batch_start_range: smallest candidate, as a multiple of ``batch_size`` (>= 1).
        batch_end_range: largest candidate, as a multiple of ``batch_size``.
        steps: number of candidate multiples between the two.
        model_shape: the model and call (:meth:`ModelShape.from_model
            <dynabatch.memory.shape.ModelShape.from_model>`); plans with the
            shape-aware classifier, which holds on more model families (see
            ``train_classifier/REPORT.md``). ``None``: dynabatch 0.1.6's 13 features.

    Returns:
        One int64 array of input positions per batch, longest texts first;
        every position appears exactly once.
    """
    settings = PlanSettings(batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps,
                            model_shape)
    return BatchPlanner(lengths, settings, SpikeEstimator(classifier)).batches()

"""What a :class:`~dynabatch.sampling.planner.BatchPlanner` asks about memory: interchangeable estimators.

An estimator answers three questions over lengths sorted longest first:

* ``plan_sizes(sorted_lengths, settings)``: the batch sizes of the whole plan, up front;
* ``rows_within(padded_length, first_peak, floor)``: how many rows of that padded
  length fit under its budget, given the first batch's measured peak and rows,
  or ``None`` when it has no model of bytes (the planner then bounds rows by
  the last measured peak per row);
* ``observe(rows, padded_length, peak_bytes)`` and ``observe_out_of_memory(rows,
  padded_length)``: a measured peak, or a shape that ran out of memory, to refine itself.

:class:`SpikeEstimator` is the spike classifier (13 features, or 14 with a
:class:`~dynabatch.memory.shape.ModelShape`); :class:`BudgetEstimator` is a
calibrated memory model (``MemoryModel``: ``predict``, ``max_rows``, ``observe``)
and the :class:`~dynabatch.memory.budget.MemoryBudget` it plans under.

The spike search. For a batch starting at sorted position ``p`` the candidates
are :meth:`PlanSettings.candidates <dynabatch.sampling.planner.PlanSettings.candidates>`
capped at what remains; the batch takes the largest candidate such that it and
every smaller one have a spike probability at or below ``threshold``, or
``batch_size`` when none has. Features come from prefix sums, so no Python loop
runs over texts, and two shortcuts give exactly that batch-by-batch result with
few classifier calls:

* *runs of equal lengths*: when every candidate window from ``p`` lies inside
  one run of equal lengths ``L``, the features (and so the choice) depend on
  ``L`` alone; the choice for every such ``L`` comes from one classifier call,
  and the batches of a run are laid down at once;
* *speculation*: elsewhere one call checks the candidates at ``p`` together
  with, at the next positions the chosen size would reach, whether that size is
  still the choice there (two probabilities decide it for a classifier monotone
  in the candidate's rows, otherwise every candidate up to one past it).

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.estimators import SpikeEstimator
    >>> from dynabatch.sampling.planner import PlanSettings
    >>> lengths = np.sort(np.random.default_rng(0).integers(1, 128, size=500))[::-1]
    >>> sizes = SpikeEstimator().plan_sizes(lengths, PlanSettings(batch_size=8, max_input_token_length=128))
    >>> int(sizes[0]), int(sizes.sum()), bool((sizes[:-1] >= 8).all())
    (8, 500, True)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.memory.budget import MemoryBudget, check_memory_margin, parse_memory
from dynabatch.memory.classifier import SpikeClassifier, load_classifier
from dynabatch.memory.features import SPIKE_RATIO, compute_features

if TYPE_CHECKING:
    from dynabatch.sampling.planner import PlanSettings

__all__ = ["BudgetEstimator", "SpikeEstimator", "choose_estimator"]

logger = logging.getLogger(__name__)

_MAX_SPECULATION = 1024


class SpikeEstimator:
    """The spike classifier behind a planner.

    Args:
        classifier: ``None`` (the bundled classifier: the shape-aware one when the
            settings carry a ``model_shape``), a path to a trusted joblib file, or
            a fitted estimator (see :func:`~dynabatch.memory.classifier.load_classifier`).

    Attributes:
        target: the fraction of the first batch's peak a batch stays under.
    """

    target = SPIKE_RATIO

    def __init__(self, classifier: Any = None) -> None:
        self.classifier = classifier
        self._loaded: dict[bool, SpikeClassifier] = {}

    def classifier_for(self, settings: PlanSettings) -> SpikeClassifier:
        """The classifier to plan with, checked to take the shape exactly when the settings give one."""
        shape = settings.model_shape is not None
        if shape not in self._loaded:
            clf = load_classifier(self.classifier, shape=shape)
            if clf.uses_shape and not shape:
                raise bad_value("model_shape", "a ModelShape for a classifier fitted on memory_ratio_estimate", None)
            if shape and not clf.uses_shape:
                raise bad_value("classifier", "fitted on memory_ratio_estimate when model_shape is given",
                                f"a classifier of {len(clf.feature_names)} features")
            self._loaded[shape] = clf
        return self._loaded[shape]

    def plan_sizes(self, sorted_lengths: np.ndarray, settings: PlanSettings) -> np.ndarray:
        """Batch sizes over ``sorted_lengths`` (longest first), by the spike search."""
        search = _SpikeSearch(sorted_lengths, settings, self.classifier_for(settings))
        sizes = search.sizes()
        logger.debug("planned %d texts into %d batches with %d classifier calls", len(sorted_lengths), len(sizes),
                     search.calls)
        return sizes

    def rows_within(self, padded_length: int, first_peak: float, floor: int) -> int | None:
        """``None``: a classifier has no model of bytes."""
        return None

    def observe(self, rows: int, padded_length: int, peak_bytes: float) -> None:
        """A classifier does not learn from measured peaks (the planner's bound does)."""

    def observe_out_of_memory(self, rows: int, padded_length: int) -> None:
        """A classifier does not learn from out-of-memory errors (the runner's split does)."""


class BudgetEstimator:
    """A calibrated memory model and its :class:`~dynabatch.memory.budget.MemoryBudget` behind a planner.

    Args:
        memory_model: has ``predict(rows, padded_length)``, ``max_rows(padded_length,
            budget_bytes)`` and ``observe(rows, padded_length, peak_bytes)`` (a ``MemoryModel``).
        max_memory: ``None`` (relative: the first batch of ``batch_size`` longest
            texts sets the budget), or the budget (bytes or a size string).
        memory_margin: a batch's predicted peak stays at or under
            ``(1 - memory_margin)`` times the budget.
        granularity: batch sizes are multiples of it (when at least it).

    Attributes:
        budget: the plan's :class:`~dynabatch.memory.budget.MemoryBudget` (set by :meth:`plan_sizes`).
    """

    def __init__(self, memory_model: Any, *, max_memory: Any = None, memory_margin: float = 0.10,
                 granularity: int | None = None) -> None:
        for method in ("predict", "max_rows", "observe"):
            if not callable(getattr(memory_model, method, None)):
                raise bad_type("memory_model", "a MemoryModel (from dynabatch.calibrate or MemoryModel.load)",
                               memory_model)
        self.memory_model = memory_model
        self.max_memory = parse_memory(max_memory)
        self.memory_margin = check_memory_margin(memory_margin)
        self.granularity = None if granularity is None else check_positive_int("granularity", granularity)
        self.target = 1.0 - self.memory_margin
        self.budget: MemoryBudget | None = None

    def plan_sizes(self, sorted_lengths: np.ndarray, settings: PlanSettings) -> np.ndarray:
        """Batch sizes over ``sorted_lengths``: each the most rows the budget allows."""
        from dynabatch.sampling.budget import plan_budget, plan_sizes_under

        first = 0 if self.max_memory is not None else min(settings.batch_size, len(sorted_lengths))
        self.budget = plan_budget(sorted_lengths, self.memory_model, first=first, max_memory=self.max_memory,
                                  memory_margin=self.memory_margin, pad_to_multiple_of=settings.pad_to_multiple_of)
        return plan_sizes_under(sorted_lengths, self.budget, first=first, granularity=self.granularity)

    def rows_within(self, longest: int, first_peak: float, floor: int) -> int:
        """Rows whose longest is ``longest`` that the budget allows: ``max_memory``, or (relative) the first
        batch's measured peak, and then never fewer than ``floor`` (the first batch's rows)."""
        if self.budget is None:
            raise RuntimeError("BudgetEstimator.rows_within before plan_sizes")
        relative = self.max_memory is None
        rows = int(self.budget.max_rows(int(longest), max_memory=first_peak if relative else None))
        if self.granularity and rows >= self.granularity:
            rows -= rows % self.granularity
        return max(rows, floor) if relative else rows

    def observe(self, rows: int, padded_length: int, peak_bytes: float) -> None:
        """Refits the memory model with a measured peak."""
        self.memory_model.observe(rows, padded_length, peak_bytes)

    def observe_out_of_memory(self, rows: int, padded_length: int) -> None:
        """Records a shape that ran out of memory in the model (kept when it is saved); the budget, which
        reads the model's failed shapes, keeps rows below it from then on."""
        self.memory_model.observe(rows, padded_length, None, out_of_memory=True)


def choose_estimator(
    classifier: Any = None,
    memory_model: Any = None,
    *,
    max_memory: Any = None,
    memory_margin: Any = 0.10,
    granularity: Any = None,
) -> SpikeEstimator | BudgetEstimator:
    """The estimator for a loader's options: the spike classifier, or the memory model's budget when one is given.

    ``max_memory`` is ``None``, bytes (> 0), or a string (``"12GB"``, ``"800MiB"``,
    ``"80%"`` of the CUDA device's free memory; see
    :func:`~dynabatch.memory.budget.parse_memory`); ``memory_margin`` is in ``[0, 1)``;
    ``granularity`` a positive int or ``None``. The memory options need a ``memory_model``.

    Example:
        >>> type(choose_estimator()).__name__
        'SpikeEstimator'
        >>> choose_estimator(max_memory="12GB")
        Traceback (most recent call last):
        ...
        ValueError: max_memory should be None without a memory_model (the classifier plans relative to the first batch), but got max_memory='12GB'
    """
    memory_margin = check_memory_margin(memory_margin)
    if granularity is not None:
        granularity = check_positive_int("granularity", granularity)
    if memory_model is None:
        for name, value in (("max_memory", max_memory), ("granularity", granularity)):
            if value is not None:
                raise bad_value(name, "None without a memory_model (the classifier plans relative to the first "
                                "batch)", value)
        return SpikeEstimator(classifier)
    if classifier is not None:
        raise bad_value("classifier", "None when a memory_model is given (the memory model sizes the batches)",
                        classifier)
    return BudgetEstimator(memory_model, max_memory=max_memory, memory_margin=memory_margin, granularity=granularity)


class _SpikeSearch:
    """State of one spike-search pass over lengths sorted longest first."""

    def __init__(self, sorted_lengths: np.ndarray, settings: PlanSettings, clf: SpikeClassifier) -> None:
        self.lengths = sorted_lengths
        self.width = settings.width  # a batch's width: its longest row, padded as the collator pads it
        self.n = len(sorted_lengths)
        self.prefix = np.concatenate([[0], np.cumsum(sorted_lengths)])
        self.batch_size = settings.batch_size
        self.max_len = settings.max_input_token_length
        self.threshold = settings.threshold
        self.shape = settings.model_shape
        self.cands = settings.candidates
        self.clf = clf
        self.first = min(self.batch_size, self.n)
        self.calls = 0

    def _proba(self, starts: np.ndarray, sizes: np.ndarray, totals: np.ndarray | None = None) -> np.ndarray:
        stops = np.minimum(starts + sizes, self.n)
        if totals is None:
            totals = self.prefix[stops] - self.prefix[starts]
        f = compute_features(
            self.max_len, self.width(self.lengths[0]), self.first, self.prefix[self.first],
            self.width(self.lengths[starts]), stops - starts, totals, shape=self.shape,
        )
        self.calls += 1
        return self.clf.predict_spike_proba(f)

    def _safe_prefix(self, proba: np.ndarray) -> int:
        """How many leading candidates are safe before the first unsafe one."""
        unsafe = np.nonzero(proba > self.threshold)[0]
        return int(unsafe[0]) if len(unsafe) else len(proba)

    def _choice(self, found: int) -> int:
        return int(self.cands[found - 1]) if found else self.batch_size

    def _runs(self) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """Run starts, starts of runs long enough to hold every window, and the choice inside each of those."""
        run_starts = np.flatnonzero(np.diff(self.lengths)) + 1
        bounds = np.concatenate([[0], run_starts, [self.n]])
        cmax, k = int(self.cands[-1]), len(self.cands)
        long = bounds[:-1][np.diff(bounds) >= cmax]
        lengths = self.lengths[long]
        if not len(long):
            return run_starts, long, {}
        if self.clf.monotone_in_rows:  # bisection on the first unsafe candidate, every run at once
            lo, hi = np.full(len(long), -1), np.full(len(long), k)
            while (hi - lo > 1).any():
                mid = np.where(hi - lo > 1, (lo + hi) // 2, np.maximum(lo, 0))
                unsafe = self._proba(long, self.cands[mid], self.cands[mid] * lengths) > self.threshold
                move = hi - lo > 1
                hi = np.where(move & unsafe, mid, hi)
                lo = np.where(move & ~unsafe, mid, lo)
            found = hi
        else:
            proba = self._proba(np.repeat(long, k), np.tile(self.cands, len(long)),
                                np.tile(self.cands, len(long)) * np.repeat(lengths, k))
            found = [self._safe_prefix(row) for row in proba.reshape(len(long), k)]
        return run_starts, long, {int(n): int(f) for n, f in zip(lengths.tolist(), np.asarray(found).tolist())}

    def _window(self, pos: int, k: int, starts: np.ndarray, check: np.ndarray) -> tuple[int | None, np.ndarray]:
        """The safe prefix at ``pos`` from candidates around ``k`` (monotone classifier; ``None`` if undecided),
        and the probabilities of the ``check`` candidates at the speculative ``starts``, in one call."""
        last = len(self.cands) - 1
        lo, hi = max(k - 3, 0), min(k + 3, last)
        window = self.cands[lo : hi + 1]
        proba = self._proba(np.concatenate([np.full(len(window), pos), np.repeat(starts, len(check))]),
                            np.concatenate([window, np.tile(check, len(starts))]))
        unsafe = proba[: len(window)] > self.threshold
        if lo > 0 and unsafe[0]:
            found = None
        elif unsafe.any():
            found = lo + int(np.argmax(unsafe))
        else:
            found = last + 1 if hi == last else None
        return found, proba[len(window) :]

    def sizes(self) -> np.ndarray:
        if self.n == 0:
            return np.empty(0, dtype=np.int64)
        out, counts = [self.first], [1]  # batch sizes, run-length encoded
        pos = self.first
        n, cands, cmax = self.n, self.cands, int(self.cands[-1])
        run_starts, long_starts, choices = self._runs()
        monotone = self.clf.monotone_in_rows
        k = -1  # safe prefix of the last uncapped choice, to speculate on; -1: none
        width = 4  # speculative positions per call
        while pos < n:
            i = int(np.searchsorted(run_starts, pos, side="right"))
            end = int(run_starts[i]) if i < len(run_starts) else n
            if pos + cmax <= end:  # every candidate window inside a run of equal lengths
                k = choices[int(self.lengths[pos])]
                size = self._choice(k)
                count = (end - cmax - pos) // size + 1
                out.append(size)
                counts.append(count)
                pos += size * count
                continue
            caps = np.unique(np.minimum(cands, n - pos))
            # The next run long enough for the shortcut: speculating past its start is wasted.
            j = int(np.searchsorted(long_starts, pos, side="right"))
            limit = int(long_starts[j]) if j < len(long_starts) else n
            starts = np.empty(0, dtype=np.int64)
            check = np.empty(0, dtype=np.int64)
            lo = 0
            if k >= 0:
                # Is the safe prefix still k at the positions this size would reach?
                # Candidates below k must be safe and candidate k (if any) unsafe.
                step = int(cands[k - 1]) if k else self.batch_size
                lo = max(k - 1, 0) if monotone else 0
                check = cands[lo : k + 1]
                starts = pos + step * np.arange(1, width + 1, dtype=np.int64)
                starts = starts[(starts + cmax <= n) & (starts < limit)]
            found = None
            if monotone and k >= 0 and len(caps) == len(cands):
                found, spec_proba = self._window(pos, k, starts, check)
            if found is None:
                proba = self._proba(np.concatenate([np.full(len(caps), pos), np.repeat(starts, len(check))]),
                                    np.concatenate([caps, np.tile(check, len(starts))]))
                found, spec_proba = self._safe_prefix(proba[: len(caps)]), proba[len(caps) :]
            size = int(caps[found - 1]) if found else min(self.batch_size, n - pos)
            out.append(size)
            counts.append(1)
            pos += size
            if len(starts) and found == k:  # the size is step again: the speculation applies
                spec = spec_proba.reshape(len(starts), len(check)) <= self.threshold
                holds = (spec == (np.arange(lo, lo + len(check)) < k)).all(axis=1)
                hits = len(holds) if holds.all() else int(np.argmin(holds))
                out.append(size)
                counts.append(hits)
                pos += size * hits
                width = min(2 * width, _MAX_SPECULATION) if hits == len(holds) else max(4, 2 * hits)
            k = found if len(caps) == len(cands) else -1
        return np.repeat(np.asarray(out, dtype=np.int64), counts)

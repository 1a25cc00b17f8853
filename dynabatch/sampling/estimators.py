"""What a :class:`~dynabatch.sampling.planner.BatchPlanner` asks about memory, and planning to a memory budget.

An estimator answers, over lengths sorted longest first:

* ``plan_sizes(sorted_lengths, settings)``: the batch sizes of the whole plan, up front;
* ``rows_for_peak(longest, first_peak)``: in measured mode, how many rows whose
  longest is ``longest`` its model keeps under the budget once the first
  batch's peak is measured, or ``None`` when it has no model of bytes (the
  planner then bounds rows by the measured peaks per row,
  :class:`~dynabatch.memory.feedback.MemoryFeedback`);
* ``observe(rows, padded_length, peak_bytes)`` and ``observe_out_of_memory(rows,
  padded_length)``: a measured peak, or a shape that ran out of memory, to refine itself;
* ``prepare(settings)``: loads what ``plan_sizes`` will need (the spike classifier), so that a caller can do it
  beside the tokenizer rather than before the plan;
* ``restart()``: a run starts; what earlier runs taught it is dropped (a
  :class:`BudgetEstimator` built with ``refit=True`` keeps it: its memory model is
  the caller's, refitted in place);

* ``budget_on(device, longest)``: the absolute budget a run plans under on
  ``device`` (its ``max_memory``, resolved there when the run starts by
  :func:`~dynabatch.memory.budget.resolve_max_memory`), or ``None`` for the
  relative rule; a budget smaller than one row of the longest text is refused
  where the estimator predicts bytes;

and carries ``target`` (the share of the first batch's peak a later batch is
planned to), ``relative`` (whether the first batch, ``batch_size`` rows of the
longest texts, sets the budget and so is the smallest batch) and
``granularity`` (batch sizes rounded down to a multiple of it, or ``None``).
The planner applies the one rule of :func:`~dynabatch.sampling.plan_settings.settle_rows`
(granularity, floor, token and growth caps) on top of what the estimator says fits.

:class:`SpikeEstimator` is the spike classifier (13 features, or 14 with a
:class:`~dynabatch.memory.shape.ModelShape`; the search itself is
:mod:`dynabatch.sampling._spike_search`); :class:`BudgetEstimator` is a
calibrated memory model (``MemoryModel``: ``predict``, ``max_rows``, ``observe``)
and the :class:`~dynabatch.memory.budget.MemoryBudget` it plans under, in one
of two modes:

* **Relative** (``max_memory=None``): the first batch is exactly the
  ``batch_size`` longest texts and its *predicted* peak is the budget. Every
  later batch takes the most rows predicted at or under ``(1 - memory_margin)``
  x budget, and never fewer than ``batch_size``: ``batch_size`` rows of a text
  no longer than the first batch's are never predicted above the first batch's
  peak (the model grows with length).
* **Absolute** (``max_memory`` in bytes, ``"12GB"``, ``"512MiB"``, ``"80%"``
  of the device's free memory, or ``"auto"``: see
  :func:`~dynabatch.memory.budget.resolve_max_memory`): every batch, the first
  included, takes the most rows predicted at or under ``(1 - memory_margin) x
  max_memory``; ``batch_size`` plays no part. A budget smaller than one row of
  the longest text is refused.

The spike classifier plans relative to the first batch up front; with a
``max_memory`` it carries that budget to the run, whose measured peaks grow
later batches under it.

:func:`plan_batch_sizes_to_budget` and :func:`plan_batches_to_budget` are the
functional forms of :class:`BudgetEstimator`.

Example:
    >>> import numpy as np
    >>> from dynabatch.memory.model import MemoryModel
    >>> shapes = [(1, 8), (4, 64), (32, 16), (4, 128)]  # measured peaks: 1000 + 100 bytes a token
    >>> mm = MemoryModel().fit(*zip(*shapes), [1000 + r * 100 * L for r, L in shapes])
    >>> lengths = np.array([128] * 4 + [64] * 8 + [16] * 40)
    >>> plan_batch_sizes_to_budget(lengths, mm, batch_size=4).tolist()  # 0.9 x (1000 + 4 x 12800) = 46980
    [4, 7, 7, 28, 6]
    >>> plan_batch_sizes_to_budget(lengths, mm, max_memory=20_000, memory_margin=0).tolist()
    [1, 1, 1, 1, 2, 2, 2, 2, 11, 11, 11, 7]
    >>> plan_batch_sizes_to_budget(lengths, mm, max_memory=20_000, memory_margin=0, max_tokens=128).tolist()
    [1, 1, 1, 1, 2, 2, 2, 2, 8, 8, 8, 8, 8]
    >>> plan_batch_sizes_to_budget(lengths, mm, max_memory=10_000, memory_margin=0)
    Traceback (most recent call last):
    ...
    dynabatch.memory.budget.BudgetTooSmallError: max_memory should be at least one row of the longest text (13,800 bytes predicted for 1 x 128 tokens, planned to 1 of the budget); here 10,000 bytes: pass a larger max_memory, a smaller max_input_token_length, or max_memory=None (the relative rule), but got max_memory=10000
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_bool, check_lengths, check_positive_int
from dynabatch.memory.budget import MemoryBudget, check_memory_margin, resolve_max_memory
from dynabatch.memory.classifier import SpikeClassifier, load_classifier
from dynabatch.memory.features import SPIKE_RATIO
from dynabatch.memory.footprint import Footprint
from dynabatch.memory.units import check_max_memory
from dynabatch.sampling._spike_search import SpikeSearch
from dynabatch.sampling.plan_settings import PlanSettings, settle_rows

__all__ = [
    "BudgetEstimator",
    "SpikeEstimator",
    "choose_estimator",
    "plan_batch_sizes_to_budget",
    "plan_batches_to_budget",
]

logger = logging.getLogger(__name__)


class SpikeEstimator:
    """The spike classifier behind a planner.

    Args:
        classifier: ``None`` (the bundled classifier: the shape-aware one when the
            settings carry a ``model_shape``), a path to a trusted joblib file, or
            a fitted estimator (see :func:`~dynabatch.memory.classifier.load_classifier`).
        max_memory: the absolute budget a run plans under (see :meth:`budget_on`), or ``None``.

    Attributes:
        target: the fraction of the first batch's peak a batch stays under.
        relative: always ``True``: the first batch's peak is the budget.
        granularity: always ``None``.
    """

    target = SPIKE_RATIO
    relative = True
    granularity = None

    def __init__(self, classifier: Any = None, *, max_memory: Any = None) -> None:
        self.classifier = classifier
        self.max_memory = max_memory
        resolve_max_memory(max_memory)  # what the first accelerator (or the CPU) would refuse is refused here
        self._loaded: dict[bool, SpikeClassifier] = {}

    def budget_on(self, device: Any, longest: int | None = None) -> float | None:
        """The absolute budget on ``device`` (``max_memory`` resolved there), or ``None``: the relative rule
        (``longest``, the longest text's padded width, is for estimators that predict bytes)."""
        return resolve_max_memory(self.max_memory, device)

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

    def prepare(self, settings: PlanSettings) -> None:
        """Loads the classifier the settings plan with (a process's first load reads its compiled trees)."""
        self.classifier_for(settings)

    def plan_sizes(self, sorted_lengths: np.ndarray, settings: PlanSettings) -> np.ndarray:
        """Batch sizes over ``sorted_lengths`` (longest first), by the spike search."""
        search = SpikeSearch(sorted_lengths, settings, self.classifier_for(settings))
        sizes = search.sizes()
        logger.debug("planned %d texts into %d batches with %d classifier calls", len(sorted_lengths), len(sizes),
                     search.calls)
        return sizes

    def rows_for_peak(self, longest: int, first_peak: float) -> int | None:
        """``None``: a classifier has no model of bytes."""
        return None

    def restart(self) -> None:
        """A classifier learns nothing a run could leave behind."""

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
            texts sets the budget), or the budget (bytes, a size or a percentage
            string, ``"auto"``: :func:`~dynabatch.memory.budget.resolve_max_memory`).
        memory_margin: a batch's predicted peak stays at or under
            ``(1 - memory_margin)`` times the budget.
        granularity: batch sizes are multiples of it (when at least it).
        device: the device a percentage ``max_memory`` is of, for the plan made up front (a run resolves it
            again on its own device: :meth:`budget_on`).
        refit: ``False`` (the default): ``memory_model`` is never written; a run's measured peaks refine a
            copy of it, made at the first one and dropped when the next run starts (:meth:`restart`), so a
            loader run again plans as it did the first time. ``True``: they refit ``memory_model`` itself, in
            place, and every later run starts from what earlier ones measured (save it for the next job).

    Attributes:
        memory_model: the model this run plans with: the caller's, or the run's copy once it has learned.
        budget: the plan's :class:`~dynabatch.memory.budget.MemoryBudget` (set by :meth:`plan_sizes`).
        max_memory: the up-front plan's budget in bytes, or ``None`` (relative).
        relative: ``max_memory is None``.
    """

    def __init__(self, memory_model: Any, *, max_memory: Any = None, memory_margin: float = 0.10,
                 granularity: int | None = None, device: Any = None, refit: bool = False) -> None:
        for method in ("predict", "max_rows", "observe"):
            if not callable(getattr(memory_model, method, None)):
                raise bad_type("memory_model", "a MemoryModel (from dynabatch.calibrate or MemoryModel.load)",
                               memory_model)
        check_bool("refit", refit)
        self.memory_model = self.given = memory_model
        self.refit = refit
        self.max_memory_given = check_max_memory(max_memory)
        self.max_memory = resolve_max_memory(max_memory, device)
        self.memory_margin = check_memory_margin(memory_margin)
        self.granularity = None if granularity is None else check_positive_int("granularity", granularity)
        self.target = 1.0 - self.memory_margin
        self.relative = self.max_memory is None
        self.budget: MemoryBudget | None = None

    def prepare(self, settings: PlanSettings) -> None:
        """A memory model is loaded already: nothing to do ahead of the plan."""

    def plan_sizes(self, sorted_lengths: np.ndarray, settings: PlanSettings) -> np.ndarray:
        """Batch sizes over ``sorted_lengths``: each the most rows the budget allows, by the one rule."""
        n = len(sorted_lengths)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        first = min(settings.batch_size, n) if self.relative else 0
        self._check_budget(settings, max(1, int(sorted_lengths[0])))
        reference = (first, max(1, int(sorted_lengths[0]))) if first else None
        self.budget = MemoryBudget(self.memory_model, self.max_memory, memory_margin=self.memory_margin,
                                   reference_batch=reference, pad_to_multiple_of=settings.pad_to_multiple_of)
        # One rows_allowed call per distinct length (lengths are sorted, so runs are contiguous).
        starts = np.flatnonzero(np.r_[True, sorted_lengths[1:] != sorted_lengths[:-1]])
        run_lengths = sorted_lengths[starts]
        per_length = settle_rows(self.budget.rows_allowed(run_lengths), floor=max(first, 1),
                                 granularity=self.granularity, cap=settings.token_cap(run_lengths)).tolist()
        ends = np.r_[starts[1:], n].tolist()

        # One step per run of equal lengths: every batch starting inside a run has that run's rows
        # (the last one may reach into the next, shorter run).
        pieces = [np.array([first], dtype=np.int64)] if first else []
        pos, run = first, 0
        while pos < n:
            while ends[run] <= pos:
                run += 1
            rows = per_length[run]
            count = -(-(ends[run] - pos) // rows)
            pieces.append(np.full(count, rows, dtype=np.int64))
            pos += count * rows
        out = np.concatenate(pieces)
        out[-1] -= pos - n if pos > n else 0
        return out

    def _check_budget(self, settings: PlanSettings, longest: int) -> None:
        if not self.relative:
            MemoryBudget(self.memory_model, self.max_memory, memory_margin=self.memory_margin,
                         pad_to_multiple_of=settings.pad_to_multiple_of).check_one_row(longest,
                                                                                       given=self.max_memory_given)

    def budget_on(self, device: Any, longest: int | None = None) -> float | None:
        """The absolute budget on ``device`` (``max_memory`` resolved there), or ``None`` (relative); refused when
        one row of the longest text (``longest``: its padded width) is predicted above it."""
        budget = resolve_max_memory(self.max_memory_given, device)
        if budget is not None and longest is not None:
            MemoryBudget(self.memory_model, budget, memory_margin=self.memory_margin).check_one_row(
                longest, given=self.max_memory_given)
        return budget

    def rows_for_peak(self, longest: int, budget: float) -> int:
        """Rows whose longest is ``longest`` that ``budget`` allows (the run's: its absolute budget, or the first
        batch's measured peak), less the margin."""
        if self.budget is None:
            raise RuntimeError("BudgetEstimator.rows_for_peak before plan_sizes")
        return int(self.budget.rows_allowed(int(longest), max_memory=budget))

    def restart(self) -> None:
        """A run starts: without ``refit``, it plans with the caller's model as given (the copy an earlier run
        refined is dropped)."""
        self._use(self.given)

    def _use(self, memory_model: Any) -> None:
        self.memory_model = memory_model
        if self.budget is not None:
            self.budget.memory_model = memory_model

    def _learning(self) -> Any:
        """The model a measured point refits: the caller's with ``refit``, else this run's copy of it."""
        if self.memory_model is self.given and not self.refit:
            self._use(copy.deepcopy(self.given))
        return self.memory_model

    def observe(self, rows: int, padded_length: int, peak_bytes: float) -> None:
        """Refits the memory model (see ``refit``) with a measured peak."""
        self._learning().observe(rows, padded_length, peak_bytes)

    def observe_out_of_memory(self, rows: int, padded_length: int) -> None:
        """Records a shape that ran out of memory in the memory model (see ``refit``; kept when it is saved);
        the budget, which reads the model's failed shapes, keeps rows below it from then on."""
        self._learning().observe(rows, padded_length, None, out_of_memory=True)


def choose_estimator(
    classifier: Any = None,
    memory_model: Any = None,
    *,
    max_memory: Any = None,
    memory_margin: Any = 0.10,
    granularity: Any = None,
    model: Any = None,
    refit_memory_model: bool = False,
) -> SpikeEstimator | BudgetEstimator:
    """The estimator for a loader's options: the spike classifier, or the memory model's budget when one is given.

    With an absolute ``max_memory`` (resolved now, on the first accelerator) and a ``model`` but no
    ``memory_model``, the memory model is the model's :class:`~dynabatch.memory.footprint.Footprint` of a forward
    call (its activations), refined by the run's measured peaks.

    ``max_memory`` is ``None``, ``"auto"``, bytes (> 0), or a string (``"12GB"``, ``"800MiB"``,
    ``"80%"`` of the device's free memory; see
    :func:`~dynabatch.memory.budget.resolve_max_memory`); ``memory_margin`` is in ``[0, 1)``;
    ``granularity`` a positive int or ``None``, with a ``memory_model``; ``refit_memory_model``: a run's
    measured peaks refit ``memory_model`` in place (``BudgetEstimator``'s ``refit``). Without a memory model a
    ``max_memory`` is the run's budget: the classifier plans the first batch, the measured peaks the rest.

    Example:
        >>> type(choose_estimator()).__name__, choose_estimator(max_memory="12GB").max_memory
        ('SpikeEstimator', '12GB')
        >>> choose_estimator(granularity=8)
        Traceback (most recent call last):
        ...
        ValueError: granularity should be None without a memory_model (the classifier plans relative to the first batch), but got granularity=8
    """
    memory_margin = check_memory_margin(memory_margin)
    if granularity is not None:
        granularity = check_positive_int("granularity", granularity)
    check_bool("refit_memory_model", refit_memory_model)
    if memory_model is None:
        if refit_memory_model:
            raise bad_value("refit_memory_model", "False without a memory_model (there is no model of yours to "
                            "refit)", refit_memory_model)
        if granularity is not None:
            raise bad_value("granularity", "None without a memory_model (the classifier plans relative to the first "
                            "batch)", granularity)
        if model is not None and resolve_max_memory(max_memory) is not None:
            return BudgetEstimator(Footprint.from_model(model), max_memory=max_memory, memory_margin=memory_margin)
        return SpikeEstimator(classifier, max_memory=max_memory)
    if classifier is not None:
        raise bad_value("classifier", "None when a memory_model is given (the memory model sizes the batches)",
                        classifier)
    return BudgetEstimator(memory_model, max_memory=max_memory, memory_margin=memory_margin, granularity=granularity,
                           refit=refit_memory_model)


def plan_batch_sizes_to_budget(
    sorted_lengths: Any,
    memory_model: Any,
    *,
    batch_size: int | None = None,
    max_memory: Any = None,
    memory_margin: float = 0.10,
    granularity: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_tokens: int | None = None,
    device: Any = None,
) -> np.ndarray:
    """Batch sizes over lengths sorted longest first, each the most rows the memory model allows.

    Args:
        sorted_lengths: token lengths, longest first.
        memory_model: has ``predict(rows, padded_length)`` (a
            :class:`~dynabatch.memory.model.MemoryModel`; its ``max_rows`` closed form is used).
        batch_size: relative mode: the first batch's rows (required there).
        max_memory: ``None`` (relative) or the budget (see :func:`~dynabatch.memory.budget.resolve_max_memory`).
        memory_margin: predicted peaks stay at or under ``(1 - memory_margin)`` x budget; in [0, 1).
        granularity: round rows down to a multiple of it where one fits.
        pad_to_multiple_of: the collator's rounding of widths: batches are sized at their padded width.
        max_tokens: padded tokens per batch at most (``None``: no token cap); see
            :class:`~dynabatch.sampling.plan_settings.PlanSettings`.
        device: the device of a percentage ``max_memory``.

    Returns:
        ``int64`` sizes; batch ``i`` is ``sorted_lengths[sum(sizes[:i]):sum(sizes[:i + 1])]``.
    """
    lengths = check_lengths("sorted_lengths", sorted_lengths, longest_first=True)
    estimator = BudgetEstimator(memory_model, max_memory=max_memory, memory_margin=memory_margin,
                                granularity=granularity, device=device)
    if estimator.relative and batch_size is None:
        raise bad_value("batch_size", "a positive integer in relative mode (max_memory=None)", batch_size)
    settings = PlanSettings(1 if batch_size is None else batch_size, max(1, int(lengths.max(initial=1))),
                            pad_to_multiple_of=pad_to_multiple_of, max_tokens=max_tokens)
    check_token_cap(lengths, settings, relative=estimator.relative)
    return estimator.plan_sizes(lengths, settings)


def plan_batches_to_budget(lengths: Any, memory_model: Any, **kwargs: Any) -> list[np.ndarray]:
    """Batches of input positions (longest first) from token lengths in input order.

    The keyword arguments are those of :func:`plan_batch_sizes_to_budget`.
    Every position appears exactly once.

    Example:
        >>> from dynabatch.memory.model import MemoryModel
        >>> mm = MemoryModel().fit([1, 2, 4], [4, 8, 2], [10, 40, 20])  # 2.5 bytes a token
        >>> [b.tolist() for b in plan_batches_to_budget([2, 8, 4, 8], mm, max_memory=40, memory_margin=0)]
        [[1, 3], [2, 0]]
    """
    arr = check_lengths("lengths", lengths)
    order = np.argsort(-arr, kind="stable")
    sizes = plan_batch_sizes_to_budget(arr[order], memory_model, **kwargs)
    return np.split(order, np.cumsum(sizes)[:-1]) if len(sizes) else []


def check_token_cap(sorted_lengths: np.ndarray, settings: PlanSettings, *, relative: bool) -> None:
    """Refuses a ``max_tokens`` the first batch cannot keep: ``batch_size`` rows of the longest text
    (relative plans), or that text's one row (absolute plans)."""
    if settings.max_tokens is None or not len(sorted_lengths):
        return
    rows = min(settings.batch_size, len(sorted_lengths)) if relative else 1
    width = int(settings.width(int(sorted_lengths[0])))
    if rows * width > settings.max_tokens:
        if not relative:
            what = f"the longest text, {width} tokens wide"
        elif rows < settings.batch_size:  # every text: never named as a batch_size the caller did not pass
            what = (f"the first batch, all {rows} texts (fewer than batch_size={settings.batch_size}), the longest "
                    f"{width} tokens wide")
        else:
            what = f"the first batch, the batch_size={rows} longest texts {width} tokens wide"
        raise bad_value("max_tokens", f"at least {rows} x {width} = {rows * width} padded tokens ({what}); pass "
                        "a larger max_tokens, a smaller batch_size or a smaller max_input_token_length",
                        settings.max_tokens)

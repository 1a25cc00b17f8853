"""The batch planner: token lengths in, batches of input positions out. Pure numpy.

Texts are sorted longest first (stable). The first batch is exactly
``batch_size`` texts, the longest: the hardest batch, whose peak memory is the
budget. For every later batch starting at sorted position ``p`` the candidate
sizes are ``ceil(batch_size * linspace(batch_start_range, batch_end_range,
steps))``, deduplicated and capped at the texts that remain; the spike
classifier gives each candidate's probability of exceeding 90% of the first
batch's peak; the batch takes the largest candidate such that it *and every
smaller candidate* are at or below ``threshold`` (no safe island above an unsafe
candidate), or ``batch_size`` when none is safe.

Features come from prefix sums of the sorted lengths, so no Python loop runs
over texts. Consecutive batches usually take the same size, so the planner
speculates: one classifier call checks the exact candidates at the current
position together with, for the next positions the current size would reach,
whether that size is still the choice there. With a classifier that is monotone
in the candidate's rows (the bundled one) two probabilities decide that;
otherwise every candidate up to one past that size is checked. Each call yields
at least one batch, and the result is exactly the batch-by-batch rule above.

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
import math
import numbers
from typing import Any

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_fraction,
    check_positive_int,
)
from dynabatch.memory.classifier import SpikeClassifier, load_classifier
from dynabatch.memory.features import ModelShape, compute_features

__all__ = ["candidate_sizes", "check_model_shape", "check_plan_arguments", "plan_batch_sizes", "plan_batches"]

logger = logging.getLogger(__name__)

_MAX_SPECULATION = 1024
_MAX_BATCH = 2**40  # candidate sizes stay exact in int64 and float64


def candidate_sizes(batch_size: int, batch_start_range: float, batch_end_range: float, steps: int) -> np.ndarray:
    """The candidate batch sizes, ascending and deduplicated (before capping at what remains).

    Example:
        >>> candidate_sizes(10, 1.0, 2.0, 5).tolist()
        [10, 13, 15, 18, 20]
    """
    sizes = np.ceil(batch_size * np.linspace(batch_start_range, batch_end_range, steps) - 1e-9)
    return np.unique(sizes.astype(np.int64))


def check_plan_arguments(
    batch_size: Any,
    max_input_token_length: Any,
    threshold: Any,
    batch_start_range: Any,
    batch_end_range: Any,
    steps: Any,
) -> tuple[int, int, float, float, float, int]:
    """Validates the planning arguments (so a loader can refuse them before tokenizing)."""
    batch_size = check_positive_int("batch_size", batch_size)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    threshold = check_fraction("threshold", threshold)
    for name, value in (("batch_start_range", batch_start_range), ("batch_end_range", batch_end_range)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise bad_type(name, "a number >= 1", value)
    if not (batch_start_range >= 1 and math.isfinite(batch_start_range)):
        raise bad_value("batch_start_range", "a finite number >= 1 (the first batch is the smallest)",
                        batch_start_range)
    if not (batch_end_range >= batch_start_range and math.isfinite(batch_end_range)):
        raise bad_value("batch_end_range", f"a finite number >= batch_start_range={batch_start_range!r}",
                        batch_end_range)
    if batch_size * batch_end_range > _MAX_BATCH:
        raise bad_value("batch_end_range", f"at most {_MAX_BATCH} / batch_size={batch_size}", batch_end_range)
    steps = check_positive_int("steps", steps)
    return batch_size, max_input_token_length, threshold, float(batch_start_range), float(batch_end_range), steps


def _as_lengths(lengths: Any, max_input_token_length: int) -> np.ndarray:
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise bad_type("lengths", "a 1-D array of token counts", lengths)
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise bad_value("lengths", "a 1-D array of integer token counts", f"array of dtype {arr.dtype} and shape "
                        f"{arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise bad_value("lengths", "non-negative token counts", int(arr.min()))
    if arr.size and arr.max() > max_input_token_length:
        raise bad_value("lengths", f"at most max_input_token_length={max_input_token_length} (truncated lengths)",
                        int(arr.max()))
    return arr


def check_model_shape(model_shape: Any) -> ModelShape | None:
    """Validates ``model_shape`` (so a loader can refuse it before tokenizing)."""
    if model_shape is not None and not isinstance(model_shape, ModelShape):
        raise bad_type("model_shape", "a ModelShape (ModelShape.from_model(model, ...)) or None", model_shape)
    return model_shape


def _classifier_for(classifier: Any, model_shape: Any) -> SpikeClassifier:
    """The classifier to plan with, checked to take the shape exactly when one is given."""
    clf = load_classifier(classifier, shape=check_model_shape(model_shape) is not None)
    if clf.uses_shape and model_shape is None:
        raise bad_value("model_shape", "a ModelShape for a classifier fitted on memory_ratio_estimate", None)
    if model_shape is not None and not clf.uses_shape:
        raise bad_value("classifier", "fitted on memory_ratio_estimate when model_shape is given",
                        f"a classifier of {len(clf.feature_names)} features")
    return clf


class _Planner:
    """State of one planning pass over lengths sorted longest first."""

    def __init__(self, sorted_lengths: np.ndarray, batch_size: int, max_len: int, clf: SpikeClassifier,
                 threshold: float, cands: np.ndarray, shape: ModelShape | None = None) -> None:
        self.lengths = sorted_lengths
        self.n = len(sorted_lengths)
        self.prefix = np.concatenate([[0], np.cumsum(sorted_lengths)])
        self.batch_size = batch_size
        self.max_len = max_len
        self.clf = clf
        self.threshold = threshold
        self.cands = cands
        self.shape = shape
        self.first = min(batch_size, self.n)
        self.calls = 0

    def _proba(self, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        stops = np.minimum(starts + sizes, self.n)
        f = compute_features(
            self.max_len, self.lengths[0], self.first, self.prefix[self.first],
            self.lengths[starts], stops - starts, self.prefix[stops] - self.prefix[starts], shape=self.shape,
        )
        self.calls += 1
        return self.clf.predict_spike_proba(f)

    def _safe_prefix(self, proba: np.ndarray) -> int:
        """How many leading candidates are safe before the first unsafe one."""
        unsafe = np.nonzero(proba > self.threshold)[0]
        return int(unsafe[0]) if len(unsafe) else len(proba)

    def sizes(self) -> np.ndarray:
        if self.n == 0:
            return np.empty(0, dtype=np.int64)
        out = [self.first]
        pos = self.first
        n, cands = self.n, self.cands
        monotone = self.clf.monotone_in_rows
        k = -1  # safe prefix of the last uncapped choice, to speculate on; -1: none
        width = 4  # speculative positions per call
        while pos < n:
            caps = np.unique(np.minimum(cands, n - pos))
            starts = np.empty(0, dtype=np.int64)
            check = np.empty(0, dtype=np.int64)
            if k >= 0:
                # Is the safe prefix still k at the positions this size would reach?
                # Candidates below k must be safe and candidate k (if any) unsafe.
                step = int(cands[k - 1]) if k else self.batch_size
                lo = max(k - 1, 0) if monotone else 0
                check = cands[lo : k + 1]
                starts = pos + step * np.arange(1, width + 1, dtype=np.int64)
                starts = starts[starts + cands[-1] <= n]
            proba = self._proba(np.concatenate([np.full(len(caps), pos), np.repeat(starts, len(check))]),
                                np.concatenate([caps, np.tile(check, len(starts))]))
            found = self._safe_prefix(proba[: len(caps)])
            size = int(caps[found - 1]) if found else min(self.batch_size, n - pos)
            out.append(size)
            pos += size
            if len(starts) and found == k:  # the size is step again: the speculation applies
                spec = proba[len(caps) :].reshape(len(starts), len(check)) <= self.threshold
                holds = (spec == (np.arange(lo, lo + len(check)) < k)).all(axis=1)
                hits = len(holds) if holds.all() else int(np.argmin(holds))
                out.extend([size] * hits)
                pos += size * hits
                width = min(2 * width, _MAX_SPECULATION) if hits == len(holds) else max(4, 2 * hits)
            k = found if len(caps) == len(cands) else -1
        return np.asarray(out, dtype=np.int64)


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
    batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps = check_plan_arguments(
        batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps
    )
    lengths = _as_lengths(sorted_lengths, max_input_token_length)
    if len(lengths) > 1 and (np.diff(lengths) > 0).any():
        raise bad_value("sorted_lengths", "sorted longest first", "an unsorted array")
    clf = _classifier_for(classifier, model_shape)
    planner = _Planner(lengths, batch_size, max_input_token_length, clf, threshold,
                       candidate_sizes(batch_size, batch_start_range, batch_end_range, steps), model_shape)
    sizes = planner.sizes()
    logger.debug("planned %d texts into %d batches with %d classifier calls", len(lengths), len(sizes),
                 planner.calls)
    return sizes


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
            <dynabatch.memory.features.ModelShape.from_model>`); plans with the
            shape-aware classifier, which holds on more model families (see
            ``train_classifier/REPORT.md``). ``None``: the spec's 13 features.

    Returns:
        One int64 array of input positions per batch, longest texts first;
        every position appears exactly once.
    """
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    arr = _as_lengths(lengths, max_input_token_length)
    order = np.argsort(-arr, kind="stable")
    sizes = plan_batch_sizes(arr[order], batch_size, max_input_token_length, classifier=classifier,
                             threshold=threshold, batch_start_range=batch_start_range,
                             batch_end_range=batch_end_range, steps=steps, model_shape=model_shape)
    return np.split(order, np.cumsum(sizes)[:-1]) if len(sizes) else []

"""Per-task memory prediction for training, fitted from measured peaks (the multi-task system's ``MemoryPredictor``).

A multi-task dataset mixes samples whose training step costs very different
memory. :class:`MemoryPredictor` keeps, per task type (any hashable) and per
mode (training step or forward only), the peaks it was told or measured, and
fits the project's memory model to them
(:class:`dynabatch.memory.model.MemoryModel`: non-negative terms in rows and
padded length ``L``, refit at every observation), ``L`` being the padded
length or any size field such as a number of images (1 when unknown). A batch
mixing tasks is predicted as the row-weighted mix of each task's
prediction at the batch's row count and padded length. Nothing is assumed:
a task without a measurement cannot be predicted and says so.

Units follow the multi-task system's names in dynabatch's one convention
(:mod:`dynabatch.memory.units`): measurements are recorded in MB (10**6
bytes) and predictions are returned in GB (10**9 bytes), as ``"MB"`` and
``"GB"`` parse everywhere in dynabatch. One task's fit is in ``_task_fit.py``.

Example:
    >>> from dynabatch.compat.multitask.predictor import MemoryPredictor
    >>> predictor = MemoryPredictor(device="cpu")
    >>> for rows in (1, 2, 4, 8):
    ...     for length in (8, 16, 32):
    ...         predictor.record_actual_memory("T1", 10 + rows * 0.5 * length, batch_size=rows, seq_length=length)
    >>> round(predictor.predict_sample_memory("T1", seq_length=32) * 1000, 3)  # GB -> MB
    26.0
    >>> round(predictor.predict_batch_memory(["T1"] * 4, lengths=[8, 16, 32, 32]) * 1000, 3)
    74.0
    >>> predictor.get_calibration_accuracy()["T1"]["mean_abs_error_pct"] < 1e-6
    True
"""

from __future__ import annotations

import copy
import json
import logging
import math
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.compat.multitask._task_fit import TaskFit, check_task
from dynabatch.data.collate import batch_shape
from dynabatch.memory.oom import call_guarded
from dynabatch.memory.units import GB, MB

__all__ = ["MemoryPredictor", "estimate_training_memory", "last_measured_predictor", "task_shares"]

logger = logging.getLogger(__name__)

_last: list[weakref.ref] = []


def last_measured_predictor() -> MemoryPredictor | None:
    """The predictor that last recorded a measurement in this process (``None`` if none did).

    Only the two calls the multi-task system documents without a predictor argument read it:
    :func:`estimate_training_memory` and ``OOMGuardian.estimate_safe_batch_size``
    (each logs which predictor it used). Samplers never do: they plan with the
    predictor they are given.
    """
    return _last[0]() if _last else None


class MemoryPredictor:
    """Predicts the peak memory of a training step per task type, from measured peaks.

    Args:
        device: where the steps run (``"cpu"``, ``"cuda:0"``, ...); :meth:`calibrate`
            measures there (CUDA allocator statistics, or the CPU tensor tracker).
        max_observations: observations kept per task and mode (the oldest are dropped).

    Measurements come from :meth:`record_actual_memory` (your own numbers, in MB)
    or :meth:`calibrate` (runs your training step on real batches and measures).
    Every measured training step of a single task refits that task's model.
    """

    def __init__(self, device: str | torch.device = "cpu", *, max_observations: int = 256) -> None:
        if not isinstance(device, (str, torch.device)):
            raise bad_type("device", "a str or torch.device", device)
        self.device = torch.device(device)
        self.max_observations = check_positive_int("max_observations", max_observations)
        self._fits: dict[tuple[Hashable, bool], TaskFit] = {}
        self._task_lengths: dict[Hashable, list[float]] = {}

    # -- recording ---------------------------------------------------------
    def record_actual_memory(
        self,
        task_type: Hashable,
        actual_memory_mb: float,
        batch_size: int = 1,
        seq_length: float | None = None,
        is_training: bool = True,
    ) -> None:
        """Records one measured peak: ``batch_size`` rows of ``task_type`` padded to ``seq_length``.

        Args:
            task_type: the task (any hashable).
            actual_memory_mb: the measured peak in MB (10**6 bytes).
            batch_size: rows in the measured batch.
            seq_length: padded length (or other size field) >= 1; ``None`` when unknown (counted as 1).
            is_training: a training step (forward + backward) or a forward pass only.
        """
        check_task(task_type)
        if isinstance(actual_memory_mb, bool) or not isinstance(actual_memory_mb, (int, float, np.number)):
            raise bad_type("actual_memory_mb", "a number of MB", actual_memory_mb)
        if not math.isfinite(actual_memory_mb) or actual_memory_mb < 0:
            raise bad_value("actual_memory_mb", "a finite number >= 0", actual_memory_mb)
        rows = check_positive_int("batch_size", batch_size)
        length = 1.0 if seq_length is None else float(seq_length)  # no size dimension: every sample is 1
        if length < 1 or not math.isfinite(length) or length != int(length):
            raise bad_value("seq_length", "None or a whole number >= 1", seq_length)
        length = int(length)
        key = (task_type, bool(is_training))
        if key not in self._fits:
            self._fits[key] = TaskFit(self.device, self.max_observations)
        self._fits[key].add(rows, length, float(actual_memory_mb) * MB)
        _last[:] = [weakref.ref(self)]
        self._task_lengths.setdefault(task_type, []).append(length)

    def calibrate(
        self,
        step: Callable[[Any], Any],
        batches: Iterable[tuple[Hashable, Any]],
        *,
        is_training: bool = True,
    ) -> int:
        """Runs ``step(batch)`` on each ``(task_type, batch)`` and records its measured peak.

        ``step`` should do what training does with a batch (forward, loss,
        backward) and leave no references behind (zero the gradients with
        ``set_to_none=True`` after). A batch that runs out of memory is logged
        and skipped. Returns the number of batches measured.
        """
        if not callable(step):
            raise bad_type("step", "a callable taking a batch", step)
        measured = 0
        for task_type, batch in batches:
            rows, length = batch_shape(batch)
            attempt = call_guarded(step, batch, measure_on=self.device)
            if attempt.error is not None:  # an out-of-memory probe is data, not a crash
                logger.warning("calibration batch of task %r (%d x %d) ran out of memory", task_type, rows, length)
                continue
            self.record_actual_memory(task_type, attempt.peak_bytes / MB, rows, length, is_training)
            measured += 1
        return measured

    # -- prediction --------------------------------------------------------
    def has_measurement(self, task_type: Hashable, is_training: bool = True) -> bool:
        """Whether ``task_type`` has a measured peak in that mode (so it can be predicted)."""
        check_task(task_type)
        return (task_type, bool(is_training)) in self._fits

    @property
    def task_types(self) -> list[Hashable]:
        """Tasks with at least one measurement, in the order first seen."""
        return list(self._task_lengths)

    def typical_length(self, task_type: Hashable) -> float:
        """Median recorded length of ``task_type`` (1 when lengths were not given)."""
        self._fit_for(task_type, True, any_mode=True)
        return float(np.median(self._task_lengths[task_type]))

    def _fit_for(self, task_type: Hashable, is_training: bool, any_mode: bool = False) -> TaskFit:
        check_task(task_type)
        fit = self._fits.get((task_type, bool(is_training)))
        if fit is None and any_mode:
            fit = self._fits.get((task_type, not is_training))
        if fit is None:
            mode = "training step" if is_training else "forward pass"
            known = sorted(map(repr, {t for t, m in self._fits if m == bool(is_training)}))
            raise ValueError(
                f"task_type should be a task with a measured {mode} (known: {', '.join(known) or 'none'}; "
                f"call record_actual_memory or calibrate first), but got task_type={task_type!r}"
            )
        return fit

    def predict_bytes(self, task_type: Hashable, rows: Any, length: Any, is_training: bool = True) -> np.ndarray:
        """Predicted peak bytes of ``rows`` rows of one task padded to ``length`` (broadcasts)."""
        return self._fit_for(task_type, is_training).predict(rows, length)

    def predict_sample_memory(
        self, task_type: Hashable, is_training: bool = True, seq_length: float | None = None
    ) -> float:
        """Predicted peak of one sample of ``task_type`` in GB (its typical length when not given)."""
        length = self.typical_length(task_type) if seq_length is None else float(seq_length)
        return float(self.predict_bytes(task_type, 1, length, is_training)) / GB

    def predict_batch_memory(
        self,
        task_types: Sequence[Hashable],
        is_training: bool = True,
        lengths: Sequence[float] | None = None,
    ) -> float:
        """Predicted peak of a batch of these samples in GB.

        The batch is padded to its longest sample (``max(lengths)``, or the
        longest typical length of its tasks). A mixed batch is the row-weighted
        mix of each task's prediction at the batch's rows and padded length.
        """
        if isinstance(task_types, (str, bytes)) or not isinstance(task_types, Sequence):
            raise bad_type("task_types", "a sequence of task types", task_types)
        if not task_types:
            raise bad_value("task_types", "a non-empty sequence", task_types)
        if lengths is not None:
            if len(lengths) != len(task_types):
                raise bad_value("lengths", f"None or one length per task type ({len(task_types)})", lengths)
            padded = float(max(lengths))
        else:
            padded = max(self.typical_length(t) for t in task_types)
        counts: dict[Hashable, int] = {}
        for task in task_types:
            counts[task] = counts.get(task, 0) + 1
        return self._mix_bytes(counts, len(task_types), padded, is_training) / GB

    def _mix_bytes(self, counts: dict[Hashable, int], rows: int, padded: float, is_training: bool) -> float:
        return float(
            sum(n / rows * float(self.predict_bytes(t, rows, padded, is_training)) for t, n in counts.items())
        )

    def batch_memory_function(
        self, task_types: Sequence[Hashable], is_training: bool = True
    ) -> Callable[[np.ndarray, int], float]:
        """A frozen snapshot for planners: ``fn(counts, padded_length) -> bytes``.

        ``counts[k]`` is the number of rows of ``task_types[k]`` in the batch.
        Later measurements do not change a snapshot, so a plan stays reproducible.
        """
        models = [copy.deepcopy(self._fit_for(t, is_training).model) for t in task_types]

        def batch_bytes(counts: np.ndarray, padded_length: int) -> float:
            counts = np.asarray(counts, dtype=np.float64)
            rows = counts.sum()
            if rows == 0:
                return 0.0
            r, n = np.array([rows]), np.array([float(padded_length)])
            return float(sum(c / rows * m.predict_unchecked(r, n)[0] for c, m in zip(counts, models) if c))

        # what the snapshot predicts from (for fingerprints)
        batch_bytes.coefficients = np.concatenate([np.r_[m.coef_, m._knots_used] for m in models])
        return batch_bytes

    # -- accuracy and state ------------------------------------------------
    def get_calibration_accuracy(self, is_training: bool = True) -> dict[Hashable, dict[str, float]]:
        """Leave-one-out error of each task's model over its last 50 measurements.

        Returns per task ``{"mean_abs_error_pct", "max_abs_error_pct", "num_measurements"}``
        (errors are NaN with fewer than two measurements).
        """
        out: dict[Hashable, dict[str, float]] = {}
        for (task, mode), fit in self._fits.items():
            if mode != bool(is_training):
                continue
            errors = fit.loo_errors()
            out[task] = {
                "mean_abs_error_pct": float(errors.mean() * 100) if len(errors) else float("nan"),
                "max_abs_error_pct": float(errors.max() * 100) if len(errors) else float("nan"),
                "num_measurements": float(fit.num_observations),
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        """Every observation, JSON-serialisable when task types are str or int."""
        return {
            "device": str(self.device),
            "observations": [
                {"task_type": t, "is_training": m, **dict(zip(("rows", "lengths", "peaks"), f.columns()))}
                for (t, m), f in self._fits.items()
            ],
            "task_lengths": [[t, lengths] for t, lengths in self._task_lengths.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces all observations with those of ``state`` and refits."""
        if not isinstance(state, dict) or "observations" not in state:
            raise bad_type("state", "a dict from MemoryPredictor.state_dict()", state)
        self._fits.clear()
        self._task_lengths.clear()
        for obs in state["observations"]:
            fit = TaskFit(self.device, self.max_observations)
            fit.model.fit(obs["rows"], obs["lengths"], obs["peaks"], source="measured")
            self._fits[(obs["task_type"], bool(obs["is_training"]))] = fit
        for task, lengths in state.get("task_lengths", []):
            self._task_lengths[task] = list(lengths)
        if self._fits:
            _last[:] = [weakref.ref(self)]

    def save(self, path: str) -> None:
        """Writes :meth:`state_dict` as JSON."""
        with open(path, "w") as fh:
            json.dump(self.state_dict(), fh)

    @classmethod
    def load(cls, path: str) -> MemoryPredictor:
        """Reads a predictor written by :meth:`save`."""
        with open(path) as fh:
            state = json.load(fh)
        predictor = cls(state.get("device", "cpu"))
        predictor.load_state_dict(state)
        return predictor


def task_shares(name: str, task_distribution: Any) -> np.ndarray:
    """The fractions of ``task_distribution`` (task type -> fraction), in its order, scaled to sum to 1.

    Raises:
        TypeError: not a non-empty dict.
        ValueError: a fraction negative or not finite, or none positive.

    Example:
        >>> task_shares("task_distribution", {"T1": 2, "T2": 1, "T3": 1}).tolist()
        [0.5, 0.25, 0.25]
    """
    if not isinstance(task_distribution, dict) or not task_distribution:
        raise bad_type(name, "a non-empty dict of task type -> fraction", task_distribution)
    shares = np.array(list(task_distribution.values()), dtype=np.float64)
    if np.any(~np.isfinite(shares)) or np.any(shares < 0) or shares.sum() <= 0:
        raise bad_value(name, "non-negative fractions with a positive sum", task_distribution)
    return shares / shares.sum()


def estimate_training_memory(
    num_samples: int,
    task_distribution: dict[Hashable, float],
    batch_size: int,
    num_epochs: int,
    predictor: MemoryPredictor | None = None,
    is_training: bool = True,
) -> dict[str, Any]:
    """Plans memory and steps of a multi-task run (the multi-task system's ``estimate_training_memory``).

    The memory figures are the predictor's predictions for a batch of
    ``batch_size`` rows mixing the tasks as ``task_distribution`` says, padded
    to the longest typical length. Without ``predictor`` (the multi-task system's call), the
    predictor that last recorded a measurement in this process is used (and
    logged); with none, a ``ValueError`` says how to measure. A task without a
    measurement raises, naming it: nothing is predicted that was not measured.
    Memory figures are in MB (10**6 bytes).

    Returns:
        ``per_sample_mb`` (per task), ``per_batch_mb``, ``estimated_peak_memory_mb``
        (the costliest of the mixed batch and each single-task batch),
        ``samples_per_task``, ``batches_per_epoch``, ``total_steps``.
    """
    num_samples = check_positive_int("num_samples", num_samples)
    batch_size = check_positive_int("batch_size", batch_size)
    num_epochs = check_positive_int("num_epochs", num_epochs)
    shares = task_shares("task_distribution", task_distribution)
    tasks = list(task_distribution)
    samples_per_task = dict(zip(tasks, np.round(shares * num_samples).astype(int).tolist()))
    batches = math.ceil(num_samples / batch_size)
    out: dict[str, Any] = {
        "samples_per_task": samples_per_task,
        "batches_per_epoch": batches,
        "total_steps": batches * num_epochs,
        "per_sample_mb": None,
        "per_batch_mb": None,
        "estimated_peak_memory_mb": None,
    }
    if predictor is None:
        predictor = last_measured_predictor()
        if predictor is None:
            raise ValueError(
                "estimate_training_memory needs measured peaks, but got no predictor and no MemoryPredictor has "
                "recorded a measurement in this process: measure first (MemoryPredictor.record_actual_memory(task, "
                "mb, batch_size, seq_length), or MemoryPredictor.calibrate(step, batches)) and pass predictor="
            )
        logger.info("estimate_training_memory: using the MemoryPredictor on %s that last recorded a measurement",
                    predictor.device)
    if not isinstance(predictor, MemoryPredictor):
        raise bad_type("predictor", "a MemoryPredictor or None", predictor)
    padded = max(predictor.typical_length(t) for t in tasks)
    out["per_sample_mb"] = {
        t: predictor.predict_sample_memory(t, is_training) * GB / MB for t in tasks
    }
    counts = dict(zip(tasks, shares * batch_size))
    mixed = predictor._mix_bytes(counts, batch_size, padded, is_training)
    single = max(float(predictor.predict_bytes(t, batch_size, predictor.typical_length(t), is_training)) for t in tasks)
    out["per_batch_mb"] = mixed / MB
    out["estimated_peak_memory_mb"] = max(mixed, single) / MB
    return out

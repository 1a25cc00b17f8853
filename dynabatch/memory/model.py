"""A calibrated memory model: a batch's peak bytes from its rows and padded length.

A batch's peak activation memory is, at every instant of the work, a sum of
tensors whose sizes are products of the rows ``r``, the padded length ``L``
and constants of the model (hidden size, vocabulary, new tokens). The peak is
the largest of those sums over the work's phases (prefill, the decoding steps'
logits, the encoder's attention, ...). :class:`MemoryModel` fits

``peak(r, L) = c0 + c1 L + c2 L^2 + r (c3 + c4 L + c5 L^2 + sum_k d_k max(L - K_k, 0))``

with every coefficient >= 0 and no measured point predicted under its bytes,
at the least total relative over-prediction (a linear program,
``scipy.optimize.linprog``): a fit that errs, errs high. The hinge terms
``r max(L - K, 0)`` at knots ``K`` (the probed lengths) let a later phase take
over above a length: a sum of such terms with non-negative weights is how a
maximum of phases looks. Only as many knots are used as the points leave two
spare degrees of freedom for (none from 8 points), so few probes do not overfit.

Beyond the most rows ``R`` measured at a length or longer, a prediction is at
least ``r * predict(R, L) / R``: each phase is ``a + r s`` with ``a >= 0``, so
this bounds it, even where a row-free phase (a training step's optimizer update
and weights' gradients) hid the per-row cost at the rows probed. Every term
grows with ``r`` and ``L``, so the prediction does too, and for a fixed length
it is piecewise linear in ``r``: :meth:`MemoryModel.max_rows` is closed form.

The probes are kept (:attr:`MemoryModel.probes_`); a probe that ran out of
memory is a lower bound when the bytes it exceeded are known, and caps the rows
at its length and longer either way. :meth:`MemoryModel.observe` adds a measured
point and refits (how ``run(memory="measured")`` refines the model online).

Example:
    >>> from dynabatch.memory.model import MemoryModel
    >>> mm = MemoryModel(device="cpu")
    >>> for rows, length in [(4, 8), (4, 32), (16, 8), (16, 64), (32, 16), (2, 64)]:
    ...     _ = mm.observe(rows, length, 1000 + rows * (200 + 10 * length))
    >>> round(float(mm.predict(10, 40)))  # 1000 + 10 * (200 + 400)
    7000
    >>> int(mm.max_rows(40, 7001)), int(mm.max_rows(40, 6999))
    (10, 9)
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_bool, check_positive_int
from dynabatch.memory import _model_fit, _model_io
from dynabatch.memory._model_io import describe_model, library_versions
from dynabatch.memory.budget import rows_under
from dynabatch.memory.oom import failed_cap

__all__ = ["MemoryModel", "describe_model", "library_versions"]

logger = logging.getLogger(__name__)

_ROWS_EXTRAPOLATION = 2.0  # warn beyond this many times the most rows probed


def _as_counts(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise bad_type(name, "a number or an array of numbers", value)
    arr = arr.astype(np.float64)
    if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0):
        raise bad_value(name, "finite and >= 0", value)
    return arr


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, np.integer):
        value = int(value)
    return check_positive_int(name, value)


class MemoryModel:
    """Peak activation bytes of a batch as a function of its rows and padded length.

    Built by :func:`dynabatch.calibrate`, loaded by :meth:`load`, or grown point
    by point with :meth:`observe`. The fitted attributes end with ``_``.

    Args:
        device: the device the peaks were measured on (``"cpu"``, ``"cuda:0"``).
        model: the model the peaks are of (recorded by :func:`describe_model`).
        knots: the lengths where a phase may take over; ``None`` takes the
            lengths measured (at most 12 of them, spread geometrically).
        metadata: free-form settings to keep with the model (batch size, task, ...).

    Attributes:
        coef_: the non-negative coefficient of every term, in bytes.
        terms_: the terms' names (``"rows*length"``, ``"rows*(length-64)+"``, ...).
        probes_: one dict per probe: ``rows``, ``padded_length``, ``peak_bytes``
            (``None`` if it ran out of memory without a known bound),
            ``out_of_memory``, ``source``, and ``predicted_bytes``.
        measured_length_: the longest padded length a probe that fitted measured.
        loo_errors_: each measured probe's leave-one-probe-out relative error
            (prediction of the model fitted without it, over its peak, minus 1).
        loo_error_: the largest absolute value of ``loo_errors_``.
    """

    def __init__(self, *, device: Any = None, model: Any = None, knots: Any = None,
                 metadata: dict[str, Any] | None = None) -> None:
        self.device = None if device is None else str(device)
        self.model_info = describe_model(model) if not isinstance(model, dict) else dict(model)
        self.knots = None if knots is None else sorted({int(k) for k in knots})
        self.metadata = dict(metadata or {})
        self.versions = library_versions()
        self.probes_: list[dict[str, Any]] = []
        self._index: dict[tuple[int, int, bool], int] = {}
        self.coef_ = np.zeros(0)
        self.terms_: list[str] = []
        self._knots_used: list[int] = []
        self._reach = (np.zeros(0), np.zeros(0))  # measured lengths; the most rows measured at each or longer
        self._loo: np.ndarray | None = None
        self._warned = False

    # -- fitting (the machinery: dynabatch.memory._model_fit) ------------------
    def _points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows, lengths, bytes and whether each is a lower bound, for the probes with bytes."""
        usable = [p for p in self.probes_ if p["peak_bytes"] is not None]
        rows = np.array([p["rows"] for p in usable], dtype=np.float64)
        length = np.array([p["padded_length"] for p in usable], dtype=np.float64)
        peak = np.array([p["peak_bytes"] for p in usable], dtype=np.float64)
        bound = np.array([bool(p["out_of_memory"]) for p in usable], dtype=bool)
        return rows, length, peak, bound

    def _refit(self) -> None:
        rows, length, peak, bound = self._points()
        self._loo = None
        if not (~bound).any():
            self._reach = (np.zeros(0), np.zeros(0))
            self.coef_ = np.zeros(0)
            self.terms_ = []
            self._knots_used = []
            return
        knots = _model_fit.knots_for(length[~bound], self.knots)
        self._knots_used = knots
        self._reach = _model_fit.reach_table(rows[~bound], length[~bound])
        self.terms_ = _model_fit.term_names(knots)
        self.coef_ = _model_fit.solve(_model_fit.matrix(rows, length, knots), peak, bound)
        predicted = self.predict_unchecked(
            np.array([p["rows"] for p in self.probes_], dtype=np.float64),
            np.array([p["padded_length"] for p in self.probes_], dtype=np.float64),
        )
        for probe, value in zip(self.probes_, predicted.tolist()):
            probe["predicted_bytes"] = value

    def fit(self, rows: Any, padded_length: Any, peak_bytes: Any, out_of_memory: Any = None,
            *, source: str = "user") -> MemoryModel:
        """Replaces the probes with these measured points and fits.

        Args:
            rows, padded_length, peak_bytes: one value per point (``peak_bytes``
                ``None`` for an out-of-memory point whose bound is unknown).
            out_of_memory: per point, whether it ran out of memory (its bytes,
                if given, are then a lower bound).
            source: recorded with every point.

        Returns:
            ``self``.
        """
        rows_list, lengths, peaks = list(rows), list(padded_length), list(peak_bytes)
        ooms = [False] * len(rows_list) if out_of_memory is None else list(out_of_memory)
        if not len(rows_list) == len(lengths) == len(peaks) == len(ooms):
            raise bad_value("padded_length, peak_bytes, out_of_memory", f"of len(rows)={len(rows_list)} each",
                            (len(lengths), len(peaks), len(ooms)))
        self.probes_ = []
        self._index = {}
        for r, length, peak, oom in zip(rows_list, lengths, peaks, ooms):
            self._add(r, length, peak, bool(oom), source)
        self._refit()
        return self

    def _add(self, rows: Any, padded_length: Any, peak_bytes: Any, out_of_memory: bool, source: str,
             extra: dict[str, Any] | None = None) -> None:
        rows = _check_count("rows", rows)
        padded_length = _check_count("padded_length", padded_length)
        if peak_bytes is not None:
            if isinstance(peak_bytes, bool) or not isinstance(peak_bytes, numbers.Real) or not (
                    math.isfinite(peak_bytes) and peak_bytes >= 0):
                raise bad_value("peak_bytes", "a finite number of bytes >= 0 (or None when out of memory)",
                                peak_bytes)
            peak_bytes = int(peak_bytes)
        elif not out_of_memory:
            raise bad_value("peak_bytes", "a number of bytes for a point that did not run out of memory", None)
        key = (rows, padded_length, out_of_memory)
        index = {(p["rows"], p["padded_length"], p["out_of_memory"]): i for i, p in enumerate(self.probes_)} \
            if len(self._index) != len(self.probes_) else self._index
        self._index = index
        if key in index:  # the same shape twice: keep the larger peak (on CUDA peaks vary a little)
            probe = self.probes_[index[key]]
            if peak_bytes is not None and (probe["peak_bytes"] is None or peak_bytes > probe["peak_bytes"]):
                probe["peak_bytes"] = peak_bytes
            return
        index[key] = len(self.probes_)
        probe = {"rows": rows, "padded_length": padded_length, "peak_bytes": peak_bytes,
                 "out_of_memory": bool(out_of_memory), "source": source}
        probe.update(extra or {})
        self.probes_.append(probe)

    def observe(self, rows: Any, padded_length: Any, peak_bytes: Any = None, *, out_of_memory: bool = False,
                source: str = "observed", **extra: Any) -> MemoryModel:
        """Adds one measured point and refits.

        Args:
            rows: the batch's rows.
            padded_length: its padded length (width), in tokens.
            peak_bytes: its measured peak; with ``out_of_memory=True`` the bytes
                it was known to exceed (a lower bound), or ``None``.
            out_of_memory: the batch ran out of memory: over any budget at this
                shape, so :meth:`max_rows` stays below ``rows`` at this length and longer.
            source: recorded with the point (``"calibrate"``, ``"run"``, ...).
            **extra: more fields to keep with the point (e.g. ``seconds``).

        Returns:
            ``self``.
        """
        check_bool("out_of_memory", out_of_memory)
        self._add(rows, padded_length, peak_bytes, out_of_memory, source, extra)
        self._refit()
        return self

    # -- predicting --------------------------------------------------------
    def _check_fitted(self) -> None:
        if not len(self.coef_):
            raise RuntimeError("this MemoryModel has no measured point yet: build it with dynabatch.calibrate, "
                               "MemoryModel.load or observe()")

    def _ranges(self) -> tuple[float, float]:
        rows, length, _, bound = self._points()
        return float(rows[~bound].max()), float(length[~bound].max())

    def _warn_extrapolation(self, rows: np.ndarray | None, length: np.ndarray) -> None:
        if self._warned or not length.size:
            return
        max_rows, max_length = self._ranges()
        far_rows = rows is not None and rows.size and float(rows.max()) > _ROWS_EXTRAPOLATION * max_rows
        if float(length.max()) > max_length or far_rows:
            self._warned = True
            what = (f"padded_length={int(length.max())} beyond the longest probed ({int(max_length)})"
                    if float(length.max()) > max_length else
                    f"rows={int(rows.max())} beyond {_ROWS_EXTRAPOLATION:g}x the most probed ({int(max_rows)})")
            warnings.warn(f"MemoryModel extrapolates: {what}; calibrate with a larger max_input_token_length or "
                          "batch_size to cover it (warned once)", UserWarning, stacklevel=3)

    def predict_unchecked(self, rows: np.ndarray, padded_length: np.ndarray) -> np.ndarray:
        """:meth:`predict` without argument checks or warnings (float arrays in)."""
        length = np.asarray(padded_length, dtype=np.float64)
        fixed, slope = _model_fit.parts(self.coef_, self._knots_used, length)
        reach, per_row = _model_fit.reach_at(self._reach, length, fixed, slope)
        fit = fixed + rows * slope
        return np.where(rows > reach, np.maximum(fit, rows * per_row), fit)

    def predict(self, rows: Any, padded_length: Any) -> np.ndarray:
        """Predicted peak bytes, float64, broadcast over ``rows`` and ``padded_length``."""
        self._check_fitted()
        r, length = np.broadcast_arrays(_as_counts("rows", rows), _as_counts("padded_length", padded_length))
        self._warn_extrapolation(r, length)
        return self.predict_unchecked(r, length)

    def max_rows(self, padded_length: Any, budget_bytes: Any) -> np.ndarray:
        """The most rows at ``padded_length`` predicted at or under ``budget_bytes`` (0 if none), int64.

        Closed form (the prediction is linear in rows at a given length),
        broadcast over both arguments. A shape that ran out of memory caps the
        rows below its own at its length and longer (the rule of
        :class:`~dynabatch.memory.budget.MemoryBudget`, which plans with this model).
        """
        self._check_fitted()
        length, budget = np.broadcast_arrays(_as_counts("padded_length", padded_length),
                                             np.asarray(budget_bytes, dtype=np.float64))
        rows = np.minimum(self.max_rows_unchecked(length, budget), failed_cap(length, self.failed_shapes))
        self._warn_extrapolation(rows.astype(np.float64), length)
        return rows

    def max_rows_unchecked(self, padded_length: np.ndarray, budget_bytes: np.ndarray) -> np.ndarray:
        """:meth:`max_rows` without argument checks, warnings or the failed shapes' caps (float arrays in)."""
        fixed, slope = _model_fit.parts(self.coef_, self._knots_used, padded_length)
        rows = rows_under(fixed, slope, budget_bytes)
        reach, per_row = _model_fit.reach_at(self._reach, padded_length, fixed, slope)
        capped = rows_under(0.0, per_row, budget_bytes)  # beyond the rows measured: at least r * peak(R) / R
        return np.where((reach > 0) & (rows > reach), np.maximum(reach.astype(np.int64), np.minimum(rows, capped)),
                        rows)

    @property
    def measured_length_(self) -> int:
        """The longest padded length a probe that fitted measured (0 before any did)."""
        lengths = self._reach[0]  # ascending, refitted with every probe
        return int(lengths[-1]) if lengths.size else 0

    @property
    def failed_shapes(self) -> list[tuple[int, int]]:
        """``(rows, padded_length)`` of every probe that ran out of memory."""
        return [(p["rows"], p["padded_length"]) for p in self.probes_ if p["out_of_memory"]]

    def measured_peak(self, rows: int, padded_length: int) -> float | None:
        """The measured peak bytes of exactly this shape, if a probe that fitted measured it (else ``None``)."""
        for probe in self.probes_:
            if (probe["rows"], probe["padded_length"]) == (rows, padded_length) and not probe["out_of_memory"] \
                    and probe["peak_bytes"] is not None:
                return float(probe["peak_bytes"])
        return None

    def key(self) -> tuple[Any, ...]:
        """What identifies the model's predictions in a fingerprint: its terms, coefficients and failed shapes."""
        return ("MemoryModel", self.terms_, np.asarray(self.coef_, dtype=np.float64), list(self._knots_used),
                [np.asarray(a, dtype=np.float64) for a in self._reach], sorted(self.failed_shapes))

    # -- quality -----------------------------------------------------------
    @property
    def loo_errors_(self) -> np.ndarray:
        if self._loo is None:
            rows, length, peak, bound = self._points()
            self._loo = _model_fit.loo_errors(rows, length, peak, bound, self._knots_used)  # the fit's own knots
        return self._loo

    @property
    def loo_error_(self) -> float:
        errors = self.loo_errors_
        return float(np.nanmax(np.abs(errors))) if np.isfinite(errors).any() else float("nan")

    def report(self) -> str:
        """The probe table (measured against predicted, leave-one-out error) and the fitted terms."""
        self._check_fitted()
        return _model_io.report(self)

    summary = report

    def __repr__(self) -> str:
        name = (self.model_info or {}).get("name")
        return f"MemoryModel(model={name!r}, device={self.device!r}, probes={len(self.probes_)})"

    # -- saving ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON document :meth:`save` writes."""
        return _model_io.to_dict(self)

    def save(self, path: str | Path) -> None:
        """Writes the model as JSON: model, dtype, device, library versions, the probes and the fit."""
        _model_io.save(self, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryModel:
        """The model of a :meth:`to_dict` document, refitted from its probes."""
        return _model_io.from_dict(cls, data)

    @classmethod
    def load(cls, path: str | Path, *, model: Any = None, device: Any = None, task: str | None = None,
             max_new_tokens: int | None = None) -> MemoryModel:
        """Reads a model :meth:`save` wrote; warns as :meth:`check` does if it was made for another ``model``,
        ``device`` or ``task``, or fewer ``max_new_tokens``."""
        return _model_io.load(cls, path, model=model, device=device, task=task, max_new_tokens=max_new_tokens)

    def check(self, model: Any = None, device: Any = None, *, task: str | None = None,
              max_new_tokens: int | None = None) -> list[str]:
        """Warns (and returns the messages) where the run differs from what was calibrated.

        Args:
            model: the run's model: another name, class, parameter count, dtype or attention warns.
            device: the run's device: another device type warns.
            task: the run's work, one of ``"generate"``, ``"forward"``, ``"train"``: another than the file's warns.
            max_new_tokens: a generate run's new tokens per row: more than calibrated warns (a longer KV cache
                than measured); fewer over-predict and pass.

        Raises:
            TypeError: ``task`` not a str or ``max_new_tokens`` not an int.
            ValueError: ``task`` not one of them, or ``max_new_tokens`` below 0 or above 0 with another task.
        """
        return _model_io.check(self, model=model, device=device, task=task, max_new_tokens=max_new_tokens)

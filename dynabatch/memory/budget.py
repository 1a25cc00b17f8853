"""What a batch may cost: the one memory budget.

Every memory-aware path of dynabatch asks a :class:`MemoryBudget` whether a
shape fits and how many rows fit at a padded width: the loader's
``memory_model=`` / ``max_memory=``, the smart sampler's constraint, the
size-aware ``MemorySizeof``, the multi-task ``MemoryAwareBatchSampler`` and the
training ``OOMGuardian``. Nothing else computes a memory cap. A budget holds:

* a memory model (anything with ``predict(rows, padded_length)`` in bytes,
  such as :class:`~dynabatch.memory.model.MemoryModel`), or none when the
  caller predicts bytes itself and only asks :meth:`MemoryBudget.allows`;
* the budget in bytes: absolute (``max_memory``: bytes, ``"12GB"``,
  ``"512MiB"``, ``"80%"`` of a device's free memory), or relative to a
  reference batch known to fit (``reference_batch=(rows, padded_length)``:
  its *measured* peak when the model holds a measurement of that very shape,
  else its predicted peak);
* a margin: batches are planned to ``(1 - memory_margin)`` of the budget;
* the padding rule of the collator (``pad_to_multiple_of``): a batch is judged
  at the width it will really have, not at its longest row;
* the shapes that ran out of memory: a shape at least as large in rows and
  width as one that failed does not fit, whatever the model predicts (the
  rule of :mod:`dynabatch.memory.oom`).

Memory sizes are bytes inside; strings are parsed by :func:`~dynabatch.memory.units.parse_memory`
alone (re-exported here with the units), with ``"GB"`` = 10**9 bytes and
``"GiB"`` = 2**30 bytes (as accelerate).

**Which budget a run plans under** is one rule, :func:`resolve_max_memory`, applied where a run starts (after
the model is loaded) on the device its batches run on: ``max_memory=None`` is the relative rule (no batch above
the first batch's measured peak); ``"auto"`` is :data:`AUTO_SHARE` of the device's free memory where the device
has memory of its own (an accelerator; vLLM's ``gpu_memory_utilization`` and SGLang's ``mem_fraction_static``
plan to such a share), and the relative rule on the CPU, whose memory is the whole system's; a size or a
percentage is that absolute budget, a percentage refused where no device memory is known.
:func:`~dynabatch.memory.units.check_max_memory` refuses what no device could resolve before anything loads.

Example:
    >>> import numpy as np
    >>> from dynabatch.memory.model import MemoryModel
    >>> shapes = [(1, 8), (8, 64), (8, 16), (4, 128)]  # measured peaks: 1000 + 100 bytes a token slot
    >>> mm = MemoryModel().fit(*zip(*shapes), [1000 + r * 100 * L for r, L in shapes])
    >>> budget = MemoryBudget(mm, "60KB", memory_margin=0.0, pad_to_multiple_of=8)
    >>> budget.budget_bytes, int(budget.rows_allowed(64)), int(budget.rows_allowed(60))  # 60 is padded to 64
    (60000.0, 9, 9)
    >>> budget.observe_out_of_memory(8, 64)  # that shape ran out of memory: 7 rows at most from now on
    >>> int(budget.rows_allowed(64)), bool(budget.fits(np.array([8]), np.array([[64]]), np.array([[1]]))[0])
    (7, False)
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import padded_width
from dynabatch.memory.device import default_accelerator, knows_memory
from dynabatch.memory.oom import MAX_ROWS, failed_cap
from dynabatch.memory.units import GB, GIB, MB, MIB, check_max_memory, parse_memory

__all__ = [
    "AUTO_SHARE",
    "GB",
    "GIB",
    "MAX_ROWS",
    "MB",
    "MIB",
    "BudgetTooSmallError",
    "MemoryBudget",
    "check_memory_margin",
    "is_absolute",
    "parse_memory",
    "resolve_max_memory",
    "rows_under",
]

logger = logging.getLogger(__name__)

AUTO_SHARE = "90%"
"""``max_memory="auto"`` on a device with memory of its own: this share of its free memory (vLLM's default
``gpu_memory_utilization`` is 0.9); batches are planned to ``(1 - memory_margin)`` of it."""
class BudgetTooSmallError(ValueError):
    """A budget smaller than one row of the longest text (:meth:`MemoryBudget.check_one_row`)."""


def is_absolute(value: Any, device: Any = None) -> bool:
    """Whether ``max_memory`` sets an absolute budget on ``device`` (default: the first accelerator, else the CPU),
    as :func:`resolve_max_memory` decides it there, without reading the device's free memory: ``None`` and
    ``"auto"`` on a device without memory of its own are the relative rule.

    Example:
        >>> is_absolute("auto", "cpu"), is_absolute("2GiB", "cpu"), is_absolute(None)
        (False, True, False)
    """
    on = device if device is not None else (default_accelerator() or "cpu")
    return value is not None and not (isinstance(value, str) and value == "auto" and not knows_memory(on))


def resolve_max_memory(value: Any, device: Any = None, name: str = "max_memory") -> float | None:
    """The absolute budget ``max_memory`` sets on ``device``, in bytes, or ``None`` for the relative rule.

    Args:
        value: ``None`` (relative), ``"auto"`` (:data:`AUTO_SHARE` of the device's free memory where it has memory
            of its own, else relative), bytes, a size (``"20GB"``) or a percentage of the device's free memory.
        device: where the batches run (default: the first accelerator, else the CPU); read now, so call it once the
            model is on the device.
        name: the argument's name, for error messages.

    Raises:
        ValueError: a bad size, a percentage over 100%, or a percentage on a device whose memory is not known (the
            CPU: pass bytes or a size there).

    Example:
        >>> resolve_max_memory("auto", "cpu") is None, resolve_max_memory("2GiB", "cpu")
        (True, 2147483648.0)
        >>> resolve_max_memory("90%", "cpu")
        Traceback (most recent call last):
        ...
        ValueError: max_memory should be bytes or a size such as '20GB' on cpu (no device memory is known there: a percentage is a share of a device's free memory), but got max_memory='90%'
    """
    check_max_memory(value, name)
    on = device if device is not None else (default_accelerator() or "cpu")
    if not is_absolute(value, on):
        if value is not None:
            logger.info("%s='auto' on %s, which has no memory of its own: batches stay under the first batch's "
                        "measured peak (the relative rule)", name, on)
        return None
    if isinstance(value, str) and value == "auto":
        value = AUTO_SHARE
    return parse_memory(value, name, device=on)


def check_memory_margin(memory_margin: Any, name: str = "memory_margin") -> float:
    """``memory_margin`` as a float in [0, 1): the share of the budget kept free (0.10 is 10%)."""
    rule = "a number in [0, 1)"
    if isinstance(memory_margin, bool) or not isinstance(memory_margin, numbers.Real):
        raise bad_type(name, rule, memory_margin)
    if not 0 <= memory_margin < 1:  # also refuses NaN
        raise bad_value(name, rule, memory_margin)
    return float(memory_margin)


def rows_under(fixed: np.ndarray, slope: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """The most rows ``r`` with ``fixed + r * slope <= limit`` (0 if none), int64, exact against that sum.

    The closed form of a prediction linear in rows at a given width.
    """
    fixed, slope, limit = np.broadcast_arrays(np.asarray(fixed, np.float64), np.asarray(slope, np.float64),
                                              np.asarray(limit, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        rows = np.floor((limit - fixed) / slope)
    rows = np.where(slope > 0, rows, np.where(fixed <= limit, MAX_ROWS, 0))
    rows = np.clip(np.nan_to_num(rows, nan=0.0, posinf=MAX_ROWS), 0, MAX_ROWS).astype(np.int64)
    # floor() of a float quotient can be one off: settle it against the sum itself.
    rows = np.where((rows > 0) & (fixed + rows * slope > limit), rows - 1, rows)
    return np.where((rows < MAX_ROWS) & (fixed + (rows + 1) * slope <= limit), rows + 1, rows)


class MemoryBudget:
    """The one memory budget: does a batch of this shape fit, and how many rows fit at this width.

    It is also a constraint of :mod:`dynabatch.sampling.constraints` (``fits``,
    ``row_cap``, ``cost``, ``key``), so it plugs into the smart sampler and
    ``AllOf`` as it is.

    Args:
        memory_model: an object with ``predict(rows, padded_length)`` (bytes,
            broadcasting over arrays), such as :class:`~dynabatch.memory.model.MemoryModel`;
            ``None`` for a budget that only judges bytes the caller predicts (:meth:`allows`).
        max_memory: the budget: bytes, a size such as ``"12GB"`` or ``"512MiB"``,
            or ``"80%"`` of a device's free memory; ``None`` with ``reference_batch``.
        memory_margin: share of the budget kept free for what the model does
            not see (fragmentation, workspaces): batches are planned to
            ``max_memory * (1 - memory_margin)``.
        reference_batch: ``(rows, padded_length)`` of a batch known to fit
            (say the fixed batch size you trained with at your longest
            length): the budget is its peak, *measured* when the model holds a
            measurement of exactly that shape (``calibrate`` with that
            ``batch_size`` and length measures it), else predicted (the fit
            errs high, so at or a little above its peak). Exclusive with
            ``max_memory``. With ``memory_margin=0.0`` no planned batch is
            predicted above the reference; predictions err high at every
            probe, and on a held-out GPT-2-shaped training step (30k
            vocabulary, 19 steps planned instead of 100) the costliest step
            measured 0.999x the reference step. The default margin keeps 10%
            for what no probe saw (fragmentation, another allocator).
        batch_size: most rows per batch, or ``None``.
        field: with several key fields of lengths, the one the model's
            ``padded_length`` is (default: the first).
        pad_to_multiple_of: the collator's rounding of a batch's width; a
            batch is judged at its padded width.
        failed_shapes: ``(rows, width)`` shapes known to have run out of memory.
        device: the device of a percentage ``max_memory``.

    Attributes:
        max_memory: the budget in bytes.
        failed_shapes: the ``(rows, width)`` shapes that ran out of memory
            (those of the model's out-of-memory probes included): a batch at
            least as wide with at least as many rows does not fit.
    """

    def __init__(
        self,
        memory_model: Any,
        max_memory: float | str | None = None,
        *,
        memory_margin: float = 0.1,
        reference_batch: tuple[int, int] | None = None,
        batch_size: int | None = None,
        field: int = 0,
        pad_to_multiple_of: int | None = None,
        failed_shapes: Any = (),
        device: Any = None,
    ) -> None:
        if memory_model is not None and not callable(getattr(memory_model, "predict", None)):
            raise bad_type("memory_model", "a MemoryModel (or any object with predict(rows, padded_length) -> "
                           "bytes)", memory_model)
        self.memory_model = memory_model
        self.memory_margin = check_memory_margin(memory_margin)
        self.batch_size = None if batch_size is None else check_positive_int("batch_size", batch_size)
        if isinstance(field, bool) or not isinstance(field, (int, np.integer)) or field < 0:
            raise bad_value("field", "a non-negative integer (a column of lengths)", field)
        self.field = int(field)
        self.pad_to_multiple_of = None if pad_to_multiple_of is None else check_positive_int(
            "pad_to_multiple_of", pad_to_multiple_of)
        self._failed: list[tuple[int, int]] = []
        for rows, width in failed_shapes:
            self.observe_out_of_memory(rows, width)
        if (max_memory is None) == (reference_batch is None):
            raise bad_value("max_memory", "given, or None with reference_batch=(rows, padded_length), not both",
                            max_memory)
        if reference_batch is not None:
            if not (isinstance(reference_batch, tuple) and len(reference_batch) == 2):
                raise bad_type("reference_batch", "a tuple (rows, padded_length)", reference_batch)
            rows = check_positive_int("reference_batch[0]", _as_int(reference_batch[0]))
            length = check_positive_int("reference_batch[1]", _as_int(reference_batch[1]))
            reference_batch = (rows, length)
            self.max_memory = self._reference_bytes(rows, self.width(length))
        else:
            self.max_memory = parse_memory(max_memory, "max_memory", device=device)
        self.reference_batch = reference_batch

    def _reference_bytes(self, rows: int, width: int) -> float:
        if self.memory_model is None:
            raise bad_value("reference_batch", "None without a memory_model (its peak is predicted)", (rows, width))
        measured = getattr(self.memory_model, "measured_peak", None)
        peak = measured(rows, width) if callable(measured) else None
        if peak is None:
            logger.info("reference_batch %d x %d has no measurement: the budget is its predicted peak", rows, width)
            peak = float(np.asarray(self.memory_model.predict(rows, width), dtype=np.float64))
        return float(peak)

    # -- the budget --------------------------------------------------------
    @property
    def budget_bytes(self) -> float:
        """``max_memory * (1 - memory_margin)``: what a planned batch may be predicted to use."""
        return self.max_memory * (1.0 - self.memory_margin)

    @property
    def failed_shapes(self) -> list[tuple[int, int]]:
        model_failed = getattr(self.memory_model, "failed_shapes", None)
        return [*(model_failed or ()), *self._failed]

    def observe_out_of_memory(self, rows: int, padded_length: int) -> None:
        """Records a ``rows`` x ``padded_length`` call that ran out of memory: no shape at least as large fits from
        now on."""
        rows = check_positive_int("rows", _as_int(rows))
        padded_length = check_positive_int("padded_length", _as_int(padded_length))
        self._failed.append((rows, padded_length))

    def width(self, longest: Any) -> Any:
        """The padded width of a batch whose longest row is ``longest`` (int or array)."""
        return padded_width(longest, self.pad_to_multiple_of)

    def _model(self) -> Any:
        if self.memory_model is None:
            raise bad_value("memory_model", "a model with predict(rows, padded_length) to predict bytes", None)
        return self.memory_model

    def predict(self, rows: Any, longest: Any) -> np.ndarray:
        """Predicted peak bytes of ``rows`` rows whose longest is ``longest``, at the padded width (float64)."""
        return self.predict_at(rows, self.width(np.asarray(longest, dtype=np.int64)))

    def predict_at(self, rows: Any, width: Any) -> np.ndarray:
        """Predicted peak bytes of ``rows`` x ``width`` batches, ``width`` already padded (float64)."""
        model = self._model()
        rows, width = np.broadcast_arrays(np.asarray(rows, dtype=np.float64), np.asarray(width, dtype=np.float64))
        quiet = getattr(model, "predict_unchecked", None)  # asked about candidates it will not plan: no warnings
        predicted = quiet(rows, width) if callable(quiet) else model.predict(rows, width)
        return np.broadcast_to(np.asarray(predicted, dtype=np.float64), rows.shape)

    def allows(self, rows: Any, width: Any, predicted_bytes: Any) -> np.ndarray:
        """Whether batches of ``rows`` x ``width`` (padded) predicted at ``predicted_bytes`` fit: under the
        budget minus the margin, at most ``batch_size`` rows, and no larger than a shape that failed."""
        rows, width = np.asarray(rows), np.asarray(width)
        ok = np.asarray(predicted_bytes, dtype=np.float64) <= self.budget_bytes
        failed = self.failed_shapes
        if failed:  # planners ask per sample: no arrays built while nothing has failed
            ok = ok & (rows <= failed_cap(width, failed))
        return ok if self.batch_size is None else ok & (rows <= self.batch_size)

    def rows_allowed(self, longest: Any, *, max_memory: float | None = None) -> np.ndarray:
        """The most rows whose longest is ``longest`` that fit (0 if none), int64, broadcast over ``longest``.

        Args:
            longest: the batch's longest row (its width before padding).
            max_memory: another budget in bytes for this question (the margin
                still applies), e.g. a first batch's measured peak.
        """
        model = self._model()
        width = np.asarray(self.width(np.asarray(longest, dtype=np.int64)), dtype=np.float64)
        limit = self.budget_bytes if max_memory is None else float(max_memory) * (1.0 - self.memory_margin)
        closed = getattr(model, "max_rows_unchecked", None)
        if callable(closed):  # a MemoryModel: closed form
            rows = np.asarray(closed(width, np.full(width.shape, limit)), dtype=np.int64)
        else:
            rows = self._bisect_rows(width, limit)
        rows = np.minimum(rows, failed_cap(width, self.failed_shapes))
        return rows if self.batch_size is None else np.minimum(rows, self.batch_size)

    def _bisect_rows(self, width: np.ndarray, limit: float) -> np.ndarray:
        """The most rows predicted within ``limit`` at each width, by bisection (predictions grow with rows)."""
        flat = width.reshape(-1)
        lo = np.zeros(flat.shape, dtype=np.int64)
        hi = np.full(flat.shape, self.batch_size or MAX_ROWS, dtype=np.int64)
        while (lo < hi).any():
            mid = (lo + hi + 1) // 2
            fit = self.predict_at(mid, flat) <= limit
            lo = np.where(fit & (lo < hi), mid, lo)
            hi = np.where(~fit & (lo < hi), mid - 1, hi)
        return lo.reshape(width.shape)

    def check_one_row(self, longest: int, *, max_memory: float | None = None, given: Any = None) -> None:
        """Refuses a budget smaller than one row of the longest text (``max_memory``: another budget in bytes, as in
        :meth:`rows_allowed`; ``given``: how the user wrote it, for the message).

        Raises:
            BudgetTooSmallError: one row of ``longest`` tokens is predicted above the budget less its margin.
        """
        if int(self.rows_allowed(int(longest), max_memory=max_memory)) >= 1:
            return
        budget = self.max_memory if max_memory is None else float(max_memory)
        width = int(self.width(int(longest)))
        one = float(self.predict_at(1, width))
        raise bad_value("max_memory", f"at least one row of the longest text ({one:,.0f} bytes predicted for 1 x "
                        f"{width} tokens, planned to {1 - self.memory_margin:g} of the budget); here {budget:,.0f} "
                        "bytes: pass a larger max_memory, a smaller max_input_token_length, or max_memory=None (the "
                        "relative rule)", budget if given is None else given, BudgetTooSmallError)

    # -- the constraint protocol (dynabatch.sampling.constraints) ------------------
    def _widths(self, longest: np.ndarray) -> np.ndarray:
        longest = np.asarray(longest)
        if longest.ndim == 2:
            if self.field >= longest.shape[1]:
                raise bad_value("field", f"below the number of key fields ({longest.shape[1]})", self.field)
            longest = longest[:, self.field]
        return np.asarray(self.width(longest.astype(np.int64)))

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray | None = None) -> np.ndarray:
        """Whether each batch (``rows`` rows, longest row ``longest[i]``) fits the budget."""
        width = self._widths(longest)
        return self.allows(rows, width, self.predict_at(rows, width))

    def row_cap(self, lengths: np.ndarray) -> int:
        """The most rows any batch over ``lengths`` (``(n, k)``) can have: those of its shortest rows."""
        lengths = np.asarray(lengths)
        n = len(lengths)
        if lengths.ndim == 2 and self.field >= lengths.shape[1]:
            raise bad_value("field", f"below the number of key fields ({lengths.shape[1]})", self.field)
        column = lengths[:, self.field] if lengths.ndim == 2 else lengths
        shortest = max(1, int(column.min())) if n else 1
        return max(1, min(n, int(self.rows_allowed(shortest))))

    def cost(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        """Predicted bytes: the heaviest batch goes first."""
        return self.predict_at(rows, self._widths(longest))

    def key(self) -> tuple[Any, ...]:
        """What identifies the budget in a fingerprint: the model's key, the budget and its rules."""
        model = self.memory_model
        model_key = model.key() if callable(getattr(model, "key", None)) else model
        return ("MemoryBudget", model_key, self.max_memory, self.memory_margin, self.batch_size, self.field,
                self.pad_to_multiple_of, sorted(self._failed))

    def __repr__(self) -> str:
        return (f"MemoryBudget({self.memory_model!r}, max_memory={self.max_memory:g}, "
                f"memory_margin={self.memory_margin}, batch_size={self.batch_size}, field={self.field}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of})")


def _as_int(value: Any) -> Any:
    return int(value) if isinstance(value, np.integer) else value

"""What a training batch may hold, as small objects one planner reads (DynamiCat's four planners).

A constraint answers, vectorised, whether candidate batches fit:

* ``fits(rows, longest, shortest)`` takes ``rows`` (``(m,)`` ints), and the
  ``longest`` and ``shortest`` length of each key field in each candidate
  (``(m, k)`` ints, one column per field) and returns ``(m,)`` bools. It must be
  monotone: a batch that fits still fits with fewer rows, a shorter longest row
  or a longer shortest row (so every part of a fitting batch fits, which is
  what lets the samplers split batches to shard them evenly).
* ``row_cap(lengths)`` bounds the rows of any batch over these lengths
  (``(n, k)``), so the planner knows how far to search.
* ``cost(rows, longest)`` (optional) ranks batches by load, so the heaviest goes first.

Key fields: ``lengths`` may hold several fields (say source and target
lengths); every rule applies to each field, except :class:`TokenBudget` with
``combine="sum"``, which bounds the padded tokens summed over the fields.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.constraints import TokenBudget
    >>> budget = TokenBudget(max_tokens=100, batch_size=8)
    >>> budget.fits(np.array([4, 8, 2]), np.array([[25], [10], [60]]), np.array([[1], [1], [1]])).tolist()
    [True, True, False]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.sampling.budget import check_memory_margin, parse_max_memory

__all__ = [
    "AllOf",
    "Constraint",
    "FixedBatchSize",
    "LengthDifference",
    "MemoryBudget",
    "TokenBudget",
    "as_constraint",
    "batch_cost",
]


@runtime_checkable
class Constraint(Protocol):
    """The protocol the planner reads (see the module docs)."""

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray) -> np.ndarray: ...

    def row_cap(self, lengths: np.ndarray) -> int: ...


def _padded_tokens(rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
    return rows.astype(np.float64) * longest.sum(axis=1)


def _optional_batch_size(batch_size: Any) -> int | None:
    return None if batch_size is None else check_positive_int("batch_size", batch_size)


def _cap(batch_size: int | None, bound: int, n: int) -> int:
    cap = bound if batch_size is None else min(batch_size, bound)
    return max(1, min(cap, n))


class FixedBatchSize:
    """At most ``batch_size`` rows (exactly that many except at the end of a window).

    Example:
        >>> import numpy as np
        >>> FixedBatchSize(4).fits(np.array([4, 5]), np.ones((2, 1)), np.ones((2, 1))).tolist()
        [True, False]
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = check_positive_int("batch_size", batch_size)

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray) -> np.ndarray:
        return rows <= self.batch_size

    def row_cap(self, lengths: np.ndarray) -> int:
        return _cap(self.batch_size, self.batch_size, len(lengths))

    def cost(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        return _padded_tokens(rows, longest)

    def __repr__(self) -> str:
        return f"FixedBatchSize(batch_size={self.batch_size})"


class LengthDifference:
    """Longest minus shortest length in a batch at most ``max_diff`` (each field), rows at most ``batch_size``.

    Example:
        >>> import numpy as np
        >>> c = LengthDifference(max_diff=5, batch_size=16)
        >>> c.fits(np.array([3, 3]), np.array([[20], [20]]), np.array([[15], [14]])).tolist()
        [True, False]
    """

    def __init__(self, max_diff: int, batch_size: int) -> None:
        if isinstance(max_diff, bool) or not isinstance(max_diff, (int, np.integer)):
            raise bad_type("max_diff", "a non-negative integer", max_diff)
        if max_diff < 0:
            raise bad_value("max_diff", "a non-negative integer", max_diff)
        self.max_diff = int(max_diff)
        self.batch_size = check_positive_int("batch_size", batch_size)

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray) -> np.ndarray:
        spread = longest - shortest
        spread = spread[:, 0] if spread.shape[1] == 1 else spread.max(axis=1)
        return (rows <= self.batch_size) & (spread <= self.max_diff)

    def row_cap(self, lengths: np.ndarray) -> int:
        return _cap(self.batch_size, self.batch_size, len(lengths))

    def cost(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        return _padded_tokens(rows, longest)

    def __repr__(self) -> str:
        return f"LengthDifference(max_diff={self.max_diff}, batch_size={self.batch_size})"


class TokenBudget:
    """Rows x longest at most ``max_tokens`` (the padded tokens), rows at most ``batch_size`` (``None``: no cap).

    Args:
        max_tokens: the padded-token budget of a batch.
        batch_size: most rows per batch, or ``None``.
        combine: ``"each"``: every field's padded tokens within the budget;
            ``"sum"``: the padded tokens summed over the fields within it.

    A single row longer than ``max_tokens`` cannot be planned: the planner
    raises rather than break the budget.

    Example:
        >>> import numpy as np
        >>> c = TokenBudget(max_tokens=64, combine="sum")
        >>> c.fits(np.array([2, 2]), np.array([[16, 16], [20, 16]]), np.ones((2, 2), int)).tolist()
        [True, False]
    """

    def __init__(self, max_tokens: int, batch_size: int | None = None, *, combine: str = "each") -> None:
        self.max_tokens = check_positive_int("max_tokens", max_tokens)
        self.batch_size = _optional_batch_size(batch_size)
        if combine not in ("each", "sum"):
            raise bad_value("combine", "'each' or 'sum'", combine)
        self.combine = combine

    def _tokens(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        if longest.shape[1] == 1:
            return rows * longest[:, 0]
        per_field = rows[:, None] * longest
        return per_field.sum(axis=1) if self.combine == "sum" else per_field.max(axis=1)

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray) -> np.ndarray:
        ok = self._tokens(rows, longest) <= self.max_tokens
        return ok if self.batch_size is None else ok & (rows <= self.batch_size)

    def row_cap(self, lengths: np.ndarray) -> int:
        smallest = lengths.sum(axis=1).min() if self.combine == "sum" else lengths.max(axis=1).min()
        return _cap(self.batch_size, self.max_tokens // max(1, int(smallest)), len(lengths))

    def cost(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        return _padded_tokens(rows, longest)

    def __repr__(self) -> str:
        return f"TokenBudget(max_tokens={self.max_tokens}, batch_size={self.batch_size}, combine={self.combine!r})"


class MemoryBudget:
    """Predicted peak memory of a batch within a budget, from a fitted memory model.

    Args:
        memory_model: an object with ``predict(rows, padded_length)`` (bytes,
            broadcasting over arrays), such as
            :class:`dynabatch.memory.model.MemoryModel`.
        max_memory: the budget: bytes, a size such as ``"12GB"`` or
            ``"512MiB"``, or ``"80%"`` of the CUDA device's free memory (read
            by :func:`dynabatch.sampling.budget.parse_max_memory`); ``None``
            with ``reference_batch``.
        memory_margin: share of the budget kept free for what the model does
            not see (fragmentation, workspaces): batches are planned to
            ``budget * (1 - memory_margin)``.
        batch_size: most rows per batch, or ``None``.
        field: which key field is the model's ``padded_length`` (default: the
            first); with several fields, pass the one the model was fitted on.
        reference_batch: ``(rows, padded_length)`` of a batch known to fit
            (say the fixed batch size you trained with at your longest
            length): a relative budget, its predicted peak. Exclusive with
            ``max_memory``. The margin then applies to the whole predicted
            peak, weights' gradients included: a reference known to fit
            usually wants ``memory_margin=0``.

    A single row predicted above the budget cannot be planned: the planner
    raises (a training step must not be planned to run out of memory).

    Example:
        >>> import numpy as np
        >>> from dynabatch.memory.model import MemoryModel
        >>> mm = MemoryModel().fit([1, 8, 8, 4], [8, 64, 16, 128], [1000 + r * 100 * L for r, L in
        ...                                                        [(1, 8), (8, 64), (8, 16), (4, 128)]])
        >>> budget = MemoryBudget(mm, reference_batch=(4, 128), memory_margin=0.0)
        >>> round(budget.budget_bytes)  # 1000 + 4 * 100 * 128
        52200
        >>> budget.fits(np.array([8, 9]), np.array([[64], [64]]), np.array([[1], [1]])).tolist()
        [True, False]
    """

    def __init__(
        self,
        memory_model: Any,
        max_memory: float | str | None = None,
        *,
        memory_margin: float = 0.1,
        batch_size: int | None = None,
        field: int = 0,
        reference_batch: tuple[int, int] | None = None,
    ) -> None:
        if not callable(getattr(memory_model, "predict", None)):
            raise bad_type("memory_model", "an object with predict(rows, padded_length) -> bytes", memory_model)
        self.memory_model = memory_model
        self.memory_margin = check_memory_margin(memory_margin)
        self.batch_size = _optional_batch_size(batch_size)
        if isinstance(field, bool) or not isinstance(field, (int, np.integer)) or field < 0:
            raise bad_value("field", "a non-negative integer (a column of lengths)", field)
        self.field = int(field)
        if (max_memory is None) == (reference_batch is None):
            raise bad_value("max_memory", "given, or None with reference_batch=(rows, padded_length), not both",
                            max_memory)
        if reference_batch is not None:
            if not (isinstance(reference_batch, tuple) and len(reference_batch) == 2):
                raise bad_type("reference_batch", "a tuple (rows, padded_length)", reference_batch)
            rows = check_positive_int("reference_batch[0]", reference_batch[0])
            length = check_positive_int("reference_batch[1]", reference_batch[1])
            self.max_memory = float(np.asarray(memory_model.predict(rows, length), dtype=np.float64))
        else:
            self.max_memory = parse_max_memory(max_memory)
        self.reference_batch = reference_batch

    @property
    def budget_bytes(self) -> float:
        """``max_memory * (1 - memory_margin)``: what a planned batch may be predicted to use."""
        return self.max_memory * (1.0 - self.memory_margin)

    def _check_field(self, fields: int) -> None:
        if self.field >= fields:
            raise bad_value("field", f"below the number of key fields ({fields})", self.field)

    def _predict(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        self._check_field(longest.shape[1])
        # The planner's search asks about candidates it will not plan: no extrapolation warning for them
        # (MemoryModel.predict_unchecked); row_cap's max_rows warns for what can be planned.
        unchecked = getattr(self.memory_model, "predict_unchecked", None)
        if callable(unchecked):
            predicted = unchecked(rows.astype(np.float64), longest[:, self.field].astype(np.float64))
        else:
            predicted = self.memory_model.predict(rows, longest[:, self.field])
        return np.broadcast_to(np.asarray(predicted, dtype=np.float64), rows.shape)

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray) -> np.ndarray:
        ok = self._predict(rows, longest) <= self.budget_bytes
        return ok if self.batch_size is None else ok & (rows <= self.batch_size)

    def row_cap(self, lengths: np.ndarray) -> int:
        n = len(lengths)
        self._check_field(lengths.shape[1])
        shortest = max(1, int(lengths[:, self.field].min()))
        hi = n if self.batch_size is None else min(n, self.batch_size)
        max_rows = getattr(self.memory_model, "max_rows", None)
        if callable(max_rows):  # closed form (MemoryModel)
            return max(1, min(hi, int(np.asarray(max_rows(shortest, self.budget_bytes)))))
        lo, probe = 1, np.full((1, lengths.shape[1]), shortest)
        while lo < hi:  # the most rows of the shortest length the model allows (monotone in rows)
            mid = (lo + hi + 1) // 2
            if self.fits(np.array([mid]), probe, probe)[0]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def cost(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        return self._predict(rows, longest)

    def __repr__(self) -> str:
        # A fitted model's coefficients are part of what it plans: a refitted model is another constraint.
        coef = getattr(self.memory_model, "coef_", None)
        model = repr(self.memory_model) if coef is None else f"{self.memory_model!r} coef={np.asarray(coef).tolist()}"
        return (f"MemoryBudget({model}, max_memory={self.max_memory:g}, memory_margin={self.memory_margin}, "
                f"batch_size={self.batch_size}, field={self.field})")


class AllOf:
    """Several constraints at once: a batch fits if it fits every one.

    Example:
        >>> import numpy as np
        >>> c = AllOf(FixedBatchSize(8), LengthDifference(max_diff=2, batch_size=16))
        >>> c.fits(np.array([8, 9, 2]), np.full((3, 1), 9), np.array([[8], [8], [1]])).tolist()
        [True, False, False]
    """

    def __init__(self, *constraints: Constraint) -> None:
        if not constraints:
            raise bad_value("constraints", "at least one constraint", constraints)
        self.constraints = tuple(as_constraint(c) for c in constraints)

    def fits(self, rows: np.ndarray, longest: np.ndarray, shortest: np.ndarray) -> np.ndarray:
        ok = self.constraints[0].fits(rows, longest, shortest)
        for c in self.constraints[1:]:
            ok = ok & c.fits(rows, longest, shortest)
        return ok

    def row_cap(self, lengths: np.ndarray) -> int:
        return min(c.row_cap(lengths) for c in self.constraints)

    def cost(self, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
        return batch_cost(self.constraints[0], rows, longest)

    def __repr__(self) -> str:
        return f"AllOf({', '.join(map(repr, self.constraints))})"


def batch_cost(constraint: Constraint, rows: np.ndarray, longest: np.ndarray) -> np.ndarray:
    """The constraint's ``cost`` if it has one, else the padded tokens (rows x longest, summed over fields)."""
    cost = getattr(constraint, "cost", None)
    return cost(rows, longest) if callable(cost) else _padded_tokens(rows, longest)


def as_constraint(constraint: Constraint | Sequence[Constraint]) -> Constraint:
    """A constraint as given, or a list/tuple of constraints as their :class:`AllOf`."""
    if isinstance(constraint, (list, tuple)):
        return AllOf(*constraint)
    if not (callable(getattr(constraint, "fits", None)) and callable(getattr(constraint, "row_cap", None))):
        raise bad_type("constraint", "a constraint (fits and row_cap methods) or a list of them", constraint)
    return constraint

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
* ``key()`` (optional) says what identifies the constraint in a sampler's
  fingerprint (:func:`dynabatch._digest.fingerprint`); without it, its class and
  public attributes do (never its ``repr``), so a state saved by one process
  loads in the next.

The memory constraint is :class:`~dynabatch.memory.budget.MemoryBudget`, the
one memory budget of the library, a constraint as it is (re-exported here).

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
from dynabatch.memory.budget import MemoryBudget

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

    def key(self) -> tuple[Any, ...]:
        return ("FixedBatchSize", self.batch_size)

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

    def key(self) -> tuple[Any, ...]:
        return ("LengthDifference", self.max_diff, self.batch_size)

    def __repr__(self) -> str:
        return f"LengthDifference(max_diff={self.max_diff}, batch_size={self.batch_size})"


class TokenBudget:
    """Rows x longest at most ``max_tokens`` (the padded tokens), rows at most ``batch_size`` (``None``: no cap).

    Args:
        max_tokens: the padded-token budget of a batch.
        batch_size: most rows per batch, or ``None``.
        combine: ``"each"``: every field's padded tokens within the budget;
            ``"sum"``: the padded tokens summed over the fields within it.

    A single row longer than ``max_tokens`` cannot be planned: the smart
    sampler refuses it when it is built (and the planner when it plans) rather
    than break the budget.

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

    def key(self) -> tuple[Any, ...]:
        return ("TokenBudget", self.max_tokens, self.batch_size, self.combine)

    def __repr__(self) -> str:
        return f"TokenBudget(max_tokens={self.max_tokens}, batch_size={self.batch_size}, combine={self.combine!r})"


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

    def key(self) -> tuple[Any, ...]:
        return ("AllOf", list(self.constraints))  # each part by its own key (fingerprint reads it)

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

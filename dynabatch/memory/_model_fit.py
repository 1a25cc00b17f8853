"""The fitting machinery of a memory model: terms, knots, the upper fit, the reach and leave-one-out errors.

Private to :mod:`dynabatch.memory.model` (whose module docs give the model
``peak(r, L)`` these functions fit): pure functions over float arrays of rows,
padded lengths and peak bytes, with no state of their own.
:class:`~dynabatch.memory.model.MemoryModel` keeps the probes and the fitted
coefficients and calls these.

Example:
    >>> import numpy as np
    >>> rows, length = (a.ravel() for a in np.meshgrid([1.0, 2.0, 4.0], [8.0, 16.0, 32.0]))
    >>> x = matrix(rows, length, [])
    >>> coef = solve(x, 100 + rows * (10 + length), np.zeros(9, dtype=bool))
    >>> [round(float(c), 6) for c in coef]  # 1, length, length^2, rows, rows*length, rows*length^2
    [100.0, 0.0, 0.0, 10.0, 1.0, 0.0]
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

MAX_KNOTS = 12
BASE_TERMS = ("1", "length", "length^2", "rows", "rows*length", "rows*length^2")


def knots_for(lengths: np.ndarray, knots: list[int] | None) -> list[int]:
    """Knots inside the measured lengths; at most as many as the points leave free (2 spare degrees).

    ``knots`` are the ones asked for (``None``: the lengths measured, at most
    12 of them, spread geometrically).
    """
    distinct = np.unique(lengths)
    if knots is not None:
        inner = np.array([k for k in knots if distinct.size and distinct.min() < k < distinct.max()])
        most = len(inner)
    else:
        inner = distinct[1:-1]
        most = MAX_KNOTS
    most = min(most, max(0, len(lengths) - len(BASE_TERMS) - 2))
    if len(inner) > most:
        picks = np.unique(np.round(np.geomspace(1, len(inner), most)).astype(int) - 1) if most else []
        inner = inner[picks]
    return [int(k) for k in inner]


def term_names(knots: list[int]) -> list[str]:
    """The terms' names: the base terms, then one hinge ``rows*(length-K)+`` per knot."""
    return list(BASE_TERMS) + [f"rows*(length-{k})+" for k in knots]


def design(length: np.ndarray, knots: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Row-free part and per-row part of every term, shape ``(..., terms)`` each."""
    one = np.ones_like(length)
    zero = np.zeros_like(length)
    free = [one, length, length**2, zero, zero, zero]
    per_row = [zero, zero, zero, one, length, length**2]
    for k in knots:
        free.append(zero)
        per_row.append(np.maximum(length - k, 0.0))
    return np.stack(free, axis=-1), np.stack(per_row, axis=-1)


def matrix(rows: np.ndarray, length: np.ndarray, knots: list[int]) -> np.ndarray:
    """Every term's value at each point (rows, length): the design matrix of the fit."""
    free, per_row = design(length, knots)
    return free + rows[..., None] * per_row


def solve(x: np.ndarray, y: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """The least total relative over-prediction with no point predicted under its bytes (a linear program).

    A fit under a measured peak is how planned batches come out over the
    budget, so every point (an out-of-memory one's known bytes included) is
    a floor; least squares (below) only when the program finds no solution.
    """
    from scipy.optimize import linprog

    # Units where every number is near 1: columns over their largest value, bytes over the largest peak.
    # (Weights of 1 / bytes alone put 1e-9 in every row of a GB-sized problem, and HiGHS then calls a
    # feasible program infeasible: the least-squares fallback predicted 1.5-4% under measured peaks.)
    top = max(float(np.max(y, initial=0.0)), 1.0)
    weight = top / np.maximum(y, 1.0)
    scale = np.abs(x).max(axis=0)
    scale[scale <= 0] = 1.0
    a = x / scale
    result = linprog(c=(a * weight[:, None]).sum(axis=0), A_ub=-a * weight[:, None], b_ub=-(y / top) * weight,
                     bounds=(0, None), method="highs")
    if result.status == 0:
        return np.maximum(result.x, 0.0) * top / scale
    logger.warning("memory model: the upper fit found no solution (%s); least squares instead, which may predict "
                   "under measured peaks", result.message)
    return least_squares(x, y, bound)


def least_squares(x: np.ndarray, y: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative errors; violated lower bounds join with growing weight."""
    from scipy.optimize import nnls

    weight = np.where(bound, 0.0, 1.0) / np.maximum(y, 1.0)
    for _ in range(10):
        use = weight > 0
        a = x[use] * weight[use, None]
        scale = a.max(axis=0)
        scale[scale <= 0] = 1.0
        solution, _ = nnls(a / scale, y[use] * weight[use], maxiter=50 * x.shape[1])
        coef = solution / scale
        violated = bound & (x @ coef < y * (1 - 1e-4))
        if not violated.any():
            break
        weight[violated] = np.maximum(weight[violated] * 10, 1.0 / np.maximum(y[violated], 1.0))
    return coef


def reach_table(rows: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per measured length (ascending), the most rows measured at that length or longer."""
    order = np.argsort(-length, kind="stable")
    lengths, most = length[order], np.maximum.accumulate(rows[order])
    last = np.r_[lengths[1:] != lengths[:-1], True]  # each length's last (its maximum is over all >= it)
    return lengths[last][::-1], most[last][::-1]


def reach_at(reach: tuple[np.ndarray, np.ndarray], length: np.ndarray, fixed: np.ndarray,
             slope: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The most rows ``R`` measured at ``length`` or longer (0: none) and the fit's bytes a row there.

    ``reach`` is :func:`reach_table`'s. A peak is a maximum of phases, each
    ``a + r s`` with ``a >= 0``, so ``r * peak(R) / R`` bounds it for
    ``r >= R``: beyond the rows measured a prediction is at least that,
    whatever small per-row cost the fit found where a row-free phase (the
    optimizer step, weights' gradients) hid it.
    """
    lengths, most = reach
    if not lengths.size:
        return np.zeros(length.shape), np.zeros(length.shape)
    i = np.searchsorted(lengths, length, side="left")
    most_rows = np.where(i < lengths.size, most[np.minimum(i, lengths.size - 1)], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_row = np.where(most_rows > 0, (fixed + most_rows * slope) / most_rows, 0.0)
    return most_rows, per_row


def parts(coef: np.ndarray, knots: list[int], length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row-free bytes and the bytes per row at each length (terms with a zero coefficient skipped)."""
    c = coef.tolist()
    fixed = np.full(length.shape, c[0]) if c[0] else np.zeros(length.shape)
    slope = np.full(length.shape, c[3]) if c[3] else np.zeros(length.shape)
    for target, weight, power in ((fixed, c[1], 1), (fixed, c[2], 2), (slope, c[4], 1), (slope, c[5], 2)):
        if weight:
            target += weight * (length if power == 1 else length * length)
    for knot, weight in zip(knots, c[len(BASE_TERMS):]):
        if weight:
            slope += weight * np.maximum(length - knot, 0.0)
    return fixed, slope


def loo_errors(rows: np.ndarray, length: np.ndarray, peak: np.ndarray, bound: np.ndarray,
               knots: list[int]) -> np.ndarray:
    """Each measured (not ``bound``) point's relative error when fitted without it (NaN for fewer than 2)."""
    measured = np.flatnonzero(~bound)
    errors = np.full(len(measured), np.nan)
    if len(measured) > 1:
        x = matrix(rows, length, knots)
        for j, i in enumerate(measured):
            keep = np.ones(len(rows), dtype=bool)
            keep[i] = False
            coef = solve(x[keep], peak[keep], bound[keep])
            errors[j] = float(x[i] @ coef) / max(peak[i], 1.0) - 1.0
    return errors

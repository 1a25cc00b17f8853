"""Smart batching under a constraint: one pure-numpy planner and its batch sampler.

:func:`plan_constrained` shuffles the rows (seeded by ``(seed, epoch)``), cuts
them into windows of about ``window_batches`` batches, sorts each window
longest first (by the first key field, ties by the next) and cuts it greedily
into the largest batches the constraint allows. The batch with the highest
cost (predicted memory, else padded tokens) is put first. Every row is in
exactly one batch; batches never cross a window. ``window_batches=None`` sorts
the whole dataset as one window (the tightest padding, the same batches every
epoch, only their order changes).

How the greedy cut stays vectorised: for every start position the most rows
that fit is found by a binary search run on all positions at once, the
longest and shortest length of each candidate coming from sparse tables
(range max/min in O(1)); only the walk from batch to batch is a Python loop
(one step per batch). 1M lengths plan in well under a second.

:class:`SmartBatchSampler` is the torch batch sampler over it (set_epoch,
state_dict, even sharding: see :mod:`dynabatch.sampling.base`).

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.constraints import TokenBudget
    >>> from dynabatch.sampling.smart import SmartBatchSampler, plan_constrained
    >>> lengths = np.random.default_rng(0).integers(1, 200, size=1000)
    >>> batches = plan_constrained(lengths, TokenBudget(max_tokens=2048, batch_size=64), window_batches=16)
    >>> max(len(b) * int(lengths[b].max()) for b in batches) <= 2048
    True
    >>> sorted(np.concatenate(batches).tolist()) == list(range(1000))
    True
    >>> sampler = SmartBatchSampler(lengths, TokenBudget(max_tokens=2048), seed=0)
    >>> sampler.set_epoch(1)
    >>> sum(len(b) for b in sampler)
    1000
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dynabatch._validation import bad_value, check_bool, check_lengths, check_non_negative_int, check_positive_int
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.constraints import Constraint, as_constraint, batch_cost

__all__ = ["SmartBatchSampler", "as_lengths", "check_every_row_fits", "plan_constrained"]

logger = logging.getLogger(__name__)

_GRID = 16  # positions between two exact searches that bracket the rest


def as_lengths(lengths: Any) -> tuple[np.ndarray, tuple[str, ...]]:
    """Lengths as an ``(n, k)`` int64 array and the field names.

    ``lengths`` is a 1-D sequence (one key field), a 2-D array (one column per
    field) or a mapping of field name to 1-D lengths.

    Example:
        >>> array, names = as_lengths({"source": [3, 5], "target": [4, 1]})
        >>> array.tolist(), names
        ([[3, 4], [5, 1]], ('source', 'target'))
    """
    if isinstance(lengths, Mapping):
        if not lengths:
            raise bad_value("lengths", "a mapping with at least one field", lengths)
        names = tuple(str(k) for k in lengths)
        columns = [check_lengths(f"lengths[{k!r}]", v) for k, v in lengths.items()]
        sizes = {len(c) for c in columns}
        if len(sizes) > 1:
            raise bad_value("lengths", "fields of one length each", {k: len(c) for k, c in zip(names, columns)})
        return np.stack(columns, axis=1) if columns[0].size else np.zeros((0, len(columns)), np.int64), names
    array = check_lengths("lengths", lengths, fields=True)
    if array.ndim == 1:
        return array[:, None], ("lengths",)
    return array, tuple(f"lengths[:, {j}]" for j in range(array.shape[1]))


def _sparse_tables(values: np.ndarray, levels: int, op: Any) -> np.ndarray:
    """``table[j, i] = op`` over ``values[i : i + 2**j]`` (clipped at the end), for j < levels."""
    dtype = np.int32 if values.size == 0 or values.max() < 2**31 else np.int64
    table = np.empty((levels, *values.shape), dtype=dtype)
    table[0] = values
    for j in range(1, levels):
        step = 1 << (j - 1)
        table[j] = table[j - 1]
        op(table[j - 1][:-step], table[j - 1][step:], out=table[j][:-step])
    return table


def _range(table: np.ndarray, start: np.ndarray, rows: np.ndarray, op: Any) -> np.ndarray:
    j = np.frexp(rows.astype(np.float64))[1] - 1  # floor(log2(rows)), exact for integers
    return op(table[j, start], table[j, start + rows - (1 << j)])


def _most_rows(sorted_lengths: np.ndarray, ends: np.ndarray, constraint: Constraint, cap: int) -> np.ndarray:
    """For every start position, the most rows (up to its window's end) the constraint allows.

    Within a window rows are sorted by the first field, longest first, so that
    field's longest and shortest are the candidate's first and last row; the
    other fields come from sparse tables.
    """
    n, k = sorted_lengths.shape
    first = sorted_lengths[:, 0]
    if k > 1:
        levels = max(1, int(cap).bit_length())
        highs = _sparse_tables(sorted_lengths[:, 1:], levels, np.maximum)
        lows = _sparse_tables(sorted_lengths[:, 1:], levels, np.minimum)

    def bounds(s: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        longest, shortest = first[s][:, None], first[s + rows - 1][:, None]
        if k > 1:
            longest = np.concatenate([longest, _range(highs, s, rows, np.maximum)], axis=1)
            shortest = np.concatenate([shortest, _range(lows, s, rows, np.minimum)], axis=1)
        return longest, shortest

    def search(starts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The most rows in [lo, hi] that fit from each start (``lo`` rows are known to fit)."""
        lo, hi = lo.copy(), hi.copy()
        active = np.flatnonzero(lo < hi)
        while active.size:
            mid = (lo[active] + hi[active] + 1) // 2
            ok = np.asarray(constraint.fits(mid, *bounds(starts[active], mid)), dtype=bool)
            lo[active[ok]] = mid[ok]
            hi[active[~ok]] = mid[~ok] - 1
            active = active[lo[active] < hi[active]]
        return lo

    # A batch's end e(i) = i + rows(i) never decreases with i (a fitting batch
    # minus its first row still fits), so ends found on a coarse grid bracket
    # every position's end between its two grid neighbours' ends.
    positions = np.arange(n)
    limit = np.minimum(cap, ends - positions)
    grid = positions[::_GRID]
    grid_ends = np.append(grid + search(grid, np.ones(len(grid), np.int64), limit[grid]), n)
    cell = positions // _GRID
    lo = np.maximum(1, grid_ends[cell] - positions)
    hi = np.minimum(limit, grid_ends[cell + 1] - positions)
    return search(positions, lo, hi)


def _window_sort(lengths: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Stable order: by window, then longest first by the first field, then the next field."""
    span = int(window[-1]) + 1
    tops = lengths.max(axis=0)
    if span * float(np.prod(tops.astype(np.float64) + 1)) < 2**62:  # one int64 key: one stable argsort
        key = window.astype(np.int64)
        for j, top in enumerate(tops.tolist()):
            key = key * (top + 1) + (top - lengths[:, j])
        return np.argsort(key, kind="stable")
    keys = [-lengths[:, j] for j in range(lengths.shape[1] - 1, -1, -1)]
    return np.lexsort([*keys, window])


def _typical_rows(lengths: np.ndarray, constraint: Constraint, cap: int) -> int:
    """Rows the constraint allows in a batch of median-length rows (sizes the windows)."""
    median = np.median(lengths, axis=0).astype(np.int64)[None, :]
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.asarray(constraint.fits(np.array([mid]), median, median))[0]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_every_row_fits(lengths: np.ndarray, names: Sequence[str], constraint: Constraint) -> None:
    """Refuses a constraint that some row breaks on its own (no batch could hold it), naming the longest such row.

    ``lengths`` and ``names`` are :func:`as_lengths`' array and field names.

    Example:
        >>> from dynabatch.sampling.constraints import TokenBudget
        >>> check_every_row_fits(*as_lengths([50, 200, 120]), TokenBudget(max_tokens=100))
        Traceback (most recent call last):
        ...
        ValueError: constraint should be able to hold every row alone (row 1, lengths=200, is the longest of the 2 rows it cannot hold: raise its limit to hold that row, or truncate or drop such rows first), but got constraint=TokenBudget(max_tokens=100, batch_size=None, combine='each')
    """
    n = len(lengths)
    if not n:
        return
    alone = np.asarray(constraint.fits(np.ones(n, np.int64), lengths, lengths), dtype=bool)
    if alone.all():
        return
    bad = np.flatnonzero(~alone)
    worst = int(bad[np.argmax(lengths[bad].sum(axis=1))])
    described = ", ".join(f"{k}={int(v)}" for k, v in zip(names, lengths[worst]))
    rows = f"{len(bad)} row" + ("s" if len(bad) > 1 else "")
    raise bad_value("constraint", f"able to hold every row alone (row {worst}, {described}, is the longest of the {rows} it "
                    "cannot hold: raise its limit to hold that row, or truncate or drop such rows first)", constraint)


def plan_constrained(
    lengths: Any,
    constraint: Constraint | Sequence[Constraint],
    *,
    window_batches: int | None = 100,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> list[np.ndarray]:
    """Batches of row indices (every row exactly once), each within ``constraint``.

    Args:
        lengths: token lengths per row: 1-D, ``(n, k)`` or a mapping of key
            field to lengths (see :func:`as_lengths`).
        constraint: a constraint from :mod:`dynabatch.sampling.constraints` (or
            any object with its ``fits``/``row_cap`` protocol), or a list of
            them, all of which must hold.
        window_batches: rows are sorted within windows of about this many
            batches (smart batching); ``None`` sorts all rows as one window.
        shuffle: shuffle the rows before cutting windows (seeded by
            ``(seed, epoch)``); ``False`` cuts windows in input order.
        seed: seeds the shuffle together with ``epoch``.
        epoch: the epoch (a new shuffle for each).

    Returns:
        Arrays of row indices, the costliest batch first.

    Raises:
        ValueError: a single row breaks the constraint (too long for the
            budget; see :func:`check_every_row_fits`), or an argument is out of range.
    """
    array, names = as_lengths(lengths)
    constraint = as_constraint(constraint)
    if window_batches is not None:
        window_batches = check_positive_int("window_batches", window_batches)
    check_bool("shuffle", shuffle)
    seed = check_non_negative_int("seed", seed)
    epoch = check_non_negative_int("epoch", epoch)
    n = len(array)
    if n == 0:
        return []
    check_every_row_fits(array, names, constraint)
    cap = max(1, min(int(constraint.row_cap(array)), n))
    perm = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    if window_batches is None:
        window_rows = n
    else:
        window_rows = max(cap, window_batches * _typical_rows(array, constraint, cap))
    window = np.arange(n) // window_rows
    order = perm[_window_sort(array[perm], window)]
    ends = np.minimum((window + 1) * window_rows, n)  # window ids are already ascending by position
    sorted_lengths = array[order]

    most = _most_rows(sorted_lengths, ends, constraint, cap).tolist()
    starts: list[int] = []
    i = 0
    while i < n:
        starts.append(i)
        i += most[i]
    start_array = np.asarray(starts, dtype=np.int64)
    batches = np.split(order, start_array[1:])
    rows = np.diff(np.append(start_array, n))
    longest = np.stack([np.maximum.reduceat(sorted_lengths[:, j], start_array) for j in range(array.shape[1])], 1)
    heaviest = int(np.argmax(batch_cost(constraint, rows, longest)))
    batches[0], batches[heaviest] = batches[heaviest], batches[0]
    logger.debug("planned %d rows into %d batches (%s, window of %d rows)", n, len(batches), constraint, window_rows)
    return batches


class SmartBatchSampler(PlannedBatchSampler):
    """A torch batch sampler of :func:`plan_constrained` batches: re-planned every epoch, sharded evenly.

    Args:
        lengths: token lengths per row (1-D, ``(n, k)`` or a mapping of key field to lengths).
        constraint: the constraint (or list of constraints) every batch keeps.
        window_batches: smart-batching window in batches (``None``: one global sort).
        shuffle: new windows and a new batch order every epoch (seeded).
        seed: the seed of all randomness, combined with the epoch.
        num_replicas, rank, shard: sharding, see :class:`dynabatch.sampling.base.PlannedBatchSampler`.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``.
    With ``window_batches`` set and ``shuffle=True`` the number of batches can
    differ slightly between epochs (window ends); ``len()`` is the current epoch's.
    """

    def __init__(
        self,
        lengths: Any,
        constraint: Constraint | Sequence[Constraint],
        *,
        window_batches: int | None = 100,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shard: bool = True,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank, shard=shard)
        self.lengths, self.fields = as_lengths(lengths)
        self._named = dict(zip(self.fields, self.lengths.T))  # what plan_constrained reads, names kept
        self.constraint = as_constraint(constraint)
        check_every_row_fits(self.lengths, self.fields, self.constraint)  # now, not at the first iteration
        self.window_batches = None if window_batches is None else check_positive_int("window_batches", window_batches)

    def plan(self, epoch: int) -> list[np.ndarray]:
        return plan_constrained(
            self._named, self.constraint, window_batches=self.window_batches,
            shuffle=self.shuffle, seed=self.seed, epoch=epoch,
        )

    def identity(self) -> list[Any]:
        return [self.lengths, self.fields, self.constraint, self.window_batches]  # a constraint by its key()

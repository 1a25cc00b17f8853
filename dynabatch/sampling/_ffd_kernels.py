"""The compiled packing kernels behind :mod:`dynabatch.sampling.ffd` and the multipack sampler.

Packing: per group of ``group_size`` consecutive positions, each sequence
goes into the lowest-numbered bin with room (first fit), at most
``capacity`` tokens and ``bin_size`` sequences per bin. Two orders, and
``algorithm`` says which:

* ``"shuffled"``: a seeded shuffle of the group (axolotl's packer since 2025,
  first fit in the sampler's shuffled order). Every bin mixes short and long
  sequences, and the many very short ones arrive all along, while bins still
  have room in tokens and in count;
* ``"ffd"``: longest first (first-fit decreasing), the reference's order. It
  packs long-tailed lengths almost perfectly, but under the ``bin_size`` cap
  the shortest sequences come last, when the gaps are full, and open bins of
  ``bin_size`` sequences each, nearly empty (0.90 efficiency on real short
  text, against 0.999 shuffled);
* ``"auto"`` (the default): the shuffled order, or the decreasing one when it
  needs fewer bins for the group (it is not run when the shuffled order
  already meets the lower bound ``max(ceil(tokens / capacity), ceil(m /
  bin_size))``). So per group it never needs more bins than either: the
  efficiency is at least the better of FFD and shuffled first fit on every
  input (``benchmarks/packing.py`` measures it on six distributions).

Why numba: first fit asks, for every sequence, for the first bin with enough
room. Done with a max-segment tree over the bins that is a ``log2(bins)``
walk per sequence, an irregular data-dependent loop numpy cannot vectorise
and Python runs ~100x too slowly. ``numba.njit(cache=True)`` compiles it to
machine code once per machine (under a second: one kernel that allocates
nothing and uses only explicit loops, which numba compiles fastest) and later
processes load it from the cache; numba ships wheels for current numpy and
needs no compiler. One epoch of 1,000,000 sequences plans in a fraction of a
second, both orders included (``benchmarks/packing.py``).

Bins come out as two arrays, ``flat`` (positions) and ``offsets`` (bin ``j``
is ``flat[offsets[j]:offsets[j + 1]]``), not as lists: :func:`bins_to_lists`
makes lists when a caller wants them.

Example:
    >>> import numpy as np
    >>> lengths = np.array([2, 7, 3, 5])
    >>> flat, offsets, unplaced = pack(lengths, capacity=10, group_size=4, bin_size=200, algorithm="ffd")
    >>> bins_to_lists(flat, offsets), unplaced
    ([[1, 2], [3, 0]], 0)

    At most 3 sequences per bin: longest first leaves four 1s for last, and
    they need two more bins; the shuffled order mixes them in and "auto"
    keeps it (3 bins: the lower bound, 9 sequences / 3)::

    >>> lengths = np.array([6, 5, 4, 1, 1, 1, 1, 1, 1])
    >>> for algorithm in ("ffd", "auto"):
    ...     flat, offsets, _ = pack(lengths, 10, group_size=9, bin_size=3, algorithm=algorithm,
    ...                             noise=shuffle_noise(9, seed=0))
    ...     print(algorithm, [lengths[b].tolist() for b in bins_to_lists(flat, offsets)])
    ffd [[6, 4], [5, 1, 1], [1, 1, 1], [1]]
    auto [[5, 4, 1], [6, 1, 1], [1, 1, 1]]
    >>> sequential_offsets(np.array([4, 5, 3, 6, 2]), 10, 200).tolist()
    [0, 2, 4, 5]
"""

from __future__ import annotations

import gc
from itertools import pairwise
from typing import Any

import numba
import numpy as np

__all__ = [
    "ALGORITHMS", "bins_to_lists", "pack", "pack_groups", "sequential_offsets", "shuffle_noise", "sort_keys",
]

ALGORITHMS = ("auto", "ffd", "shuffled")


@numba.njit(cache=True)
def _pack_groups(lengths, keys, noise, capacity, group_size, max_bins, bin_size,
                 counts, order, bins, tree, filled, flat, offsets):  # pragma: no cover - compiled
    """First fit per group of ``group_size`` consecutive positions, in one or two orders, into preallocated arrays.

    Pass 0 (when ``noise`` is not empty) places the group in a shuffled order:
    Fisher-Yates with ``noise`` (uniform floats in [0, 1), one per position).
    Pass 1 (when ``keys`` is not empty) places it longest first: ``keys``
    order the sequences like ``lengths`` do, in ``[0, counts.size)``, for a
    counting sort (decreasing, stable). It is skipped when pass 0 already met
    the group's lower bound, and kept only if it needs fewer bins (or leaves
    fewer sequences unplaced). ``order[p]`` and ``bins[p]`` hold pass ``p``'s
    order and each placed sequence's bin (-1: no room).

    A max-segment tree over the group's bins (``tree``: room left, -1 for a
    bin not allowed or full; its ``filled.size`` leaves) finds the
    lowest-numbered bin with room in log time; at most ``max_bins`` bins per
    group, numbered in the order they were opened. Fills ``flat`` and
    ``offsets`` (zeros on entry) as :func:`pack_groups` returns them; returns
    ``(bins used, unplaced)``.

    Every array is allocated by the caller and every loop is explicit: numba
    compiles this in well under a second, where slices, ``min``/``max`` and
    allocations in here cost it another second on first use.
    """
    n = lengths.shape[0]
    n_keys = counts.shape[0]
    leaves = filled.shape[0]
    first = 0 if noise.shape[0] > 0 else 1
    last = 1 if keys.shape[0] > 0 else 0
    total_bins = 0
    unplaced = 0
    for g0 in range(0, n, group_size):
        g1 = g0 + group_size
        if g1 > n:
            g1 = n
        m = g1 - g0
        limit = m
        if max_bins < limit:
            limit = max_bins
        tokens = 0
        for i in range(g0, g1):
            tokens += lengths[i]
        lower = (m - 1) // bin_size + 1  # no packing of the group needs fewer bins (no overflow near int64 max)
        if capacity > 0 and tokens > 0 and (tokens - 1) // capacity + 1 > lower:
            lower = (tokens - 1) // capacity + 1
        best = -1
        best_bins = 0
        best_missed = 0
        for p in range(first, last + 1):
            if best >= 0 and best_missed == 0 and best_bins <= lower:
                break
            if p == 0:
                for k in range(m):
                    order[0, k] = g0 + k
                for k in range(m - 1, 0, -1):
                    j = int(noise[g0 + k] * (k + 1))
                    t = order[0, k]
                    order[0, k] = order[0, j]
                    order[0, j] = t
            else:
                for v in range(n_keys):
                    counts[v] = 0
                for i in range(g0, g1):
                    counts[keys[i]] += 1
                pos = 0
                for v in range(n_keys - 1, -1, -1):  # counts become each key's first slot, longest first
                    c = counts[v]
                    counts[v] = pos
                    pos += c
                for i in range(g0, g1):
                    v = keys[i]
                    order[1, counts[v]] = i
                    counts[v] += 1
            for b in range(leaves):
                tree[leaves + b] = capacity if b < limit else -1
                filled[b] = 0
            for node in range(leaves - 1, 0, -1):
                a = tree[2 * node]
                c = tree[2 * node + 1]
                tree[node] = a if a > c else c
            n_bins = 0
            missed = 0
            for k in range(m):
                size = lengths[order[p, k]]
                if tree[1] < size:
                    bins[p, k] = -1
                    missed += 1
                    continue
                node = 1
                while node < leaves:
                    node = 2 * node if tree[2 * node] >= size else 2 * node + 1
                b = node - leaves
                bins[p, k] = b
                if b >= n_bins:
                    n_bins = b + 1
                filled[b] += 1
                tree[node] = tree[node] - size if filled[b] < bin_size else -1
                node //= 2
                while node >= 1:
                    a = tree[2 * node]
                    c = tree[2 * node + 1]
                    tree[node] = a if a > c else c
                    node //= 2
            if best < 0 or missed < best_missed or (missed == best_missed and n_bins < best_bins):
                best = p
                best_bins = n_bins
                best_missed = missed
        unplaced += best_missed
        for k in range(m):
            if bins[best, k] >= 0:
                offsets[total_bins + bins[best, k] + 1] += 1
        for b in range(best_bins):  # offsets become cumulative; filled becomes each bin's next free slot
            offsets[total_bins + b + 1] += offsets[total_bins + b]
            filled[b] = offsets[total_bins + b]
        for k in range(m):
            b = bins[best, k]
            if b >= 0:
                flat[filled[b]] = order[best, k]
                filled[b] += 1
        total_bins += best_bins
    return total_bins, unplaced


def pack_groups(lengths: np.ndarray, keys: np.ndarray, key_max: int, noise: np.ndarray, capacity: int,
                group_size: int, max_bins: int, bin_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First fit per group of ``group_size`` consecutive positions, shuffled and/or longest first.

    ``lengths`` and ``keys`` are 1-D int64 arrays; ``keys`` order the
    sequences like ``lengths`` do, in ``[0, key_max]`` (the lengths, or their
    ranks when the capacity is huge), or are empty (no decreasing order).
    ``noise`` has one uniform float in [0, 1) per position to shuffle each
    group, or is empty (no shuffled order). With both, each group keeps the
    order that needs fewer bins, the shuffled one on a tie (see the module
    docs). Within a bin, sequences are in the order placed; at most
    ``max_bins`` bins per group, numbered in the order they were opened.
    Returns ``(flat, offsets, unplaced)``: bin ``j`` holds positions
    ``flat[offsets[j]:offsets[j + 1]]``, the groups' bins one after the other;
    ``unplaced`` counts sequences that found no room in ``max_bins`` bins
    (never, when ``max_bins >= group_size``).
    """
    lengths, keys = _int64(lengths), _int64(keys)  # one compiled signature: C-contiguous int64, float64
    noise = np.ascontiguousarray(noise, dtype=np.float64)
    n = lengths.shape[0]
    span = min(group_size, n)
    leaves = 1
    while leaves < max(min(max_bins, group_size), 1):
        leaves *= 2
    flat = np.empty(n, np.int64)
    offsets = np.zeros(n + 1, np.int64)
    used, unplaced = _pack_groups(
        lengths, keys, noise, int(capacity), int(group_size), int(max_bins), int(bin_size),
        np.empty(int(key_max) + 1, np.int64), np.empty((2, span), np.int64), np.empty((2, span), np.int64),
        np.empty(2 * leaves, np.int64), np.empty(leaves, np.int64), flat, offsets)
    return flat[: n - unplaced], offsets[: used + 1], int(unplaced)


@numba.njit(cache=True)
def _sequential_offsets(lengths, capacity, bin_size, offsets):  # pragma: no cover - compiled
    """Fills ``offsets`` with the bin boundaries of :func:`sequential_offsets`; returns the number of bins."""
    n = lengths.shape[0]
    offsets[0] = 0
    n_bins = 0
    room = capacity
    count = 0
    for i in range(n):
        size = lengths[i]
        if count > 0 and (size > room or count >= bin_size):
            n_bins += 1
            offsets[n_bins] = i
            room = capacity
            count = 0
        room -= size
        count += 1
    if n > 0:
        n_bins += 1
        offsets[n_bins] = n
    return n_bins


def sequential_offsets(lengths: np.ndarray, capacity: int, bin_size: int) -> np.ndarray:
    """Bin boundaries packing in order (1-D int64 ``lengths``): a new bin when the next sequence does not fit."""
    lengths = _int64(lengths)
    offsets = np.empty(lengths.shape[0] + 1, np.int64)
    n_bins = _sequential_offsets(lengths, int(capacity), int(bin_size), offsets)
    return offsets[: n_bins + 1]


def _int64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


def sort_keys(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Keys for the kernels' counting sort: the lengths, or their ranks if the capacity is huge."""
    if capacity <= 4 * lengths.size + 65536:
        return lengths, capacity
    ranks = np.unique(lengths, return_inverse=True)[1].astype(np.int64).ravel()
    return ranks, int(ranks.max()) if ranks.size else 0


def shuffle_noise(n: int, seed: Any = 0) -> np.ndarray:
    """The ``n`` uniform floats that shuffle each group, from a local ``np.random.default_rng(seed)``."""
    return np.random.default_rng(seed).random(n)


def pack(lengths: np.ndarray, capacity: int, group_size: int, bin_size: int, max_bins: int | None = None,
         algorithm: str = "auto", noise: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """First fit per group (see :func:`pack_groups`): ``(flat, offsets, unplaced)``.

    ``algorithm`` is one of :data:`ALGORITHMS` (see the module docs);
    ``noise`` shuffles the groups (default ``shuffle_noise(len(lengths), 0)``;
    unused with ``"ffd"``); ``max_bins`` defaults to ``group_size``.
    """
    empty = np.empty(0, np.int64)
    keys, key_max = (empty, 0) if algorithm == "shuffled" else sort_keys(lengths, capacity)
    if algorithm == "ffd":
        noise = np.empty(0)
    elif noise is None:
        noise = shuffle_noise(len(lengths))
    limit = group_size if max_bins is None else max_bins
    return pack_groups(lengths, keys, key_max, noise, capacity, group_size, limit, bin_size)


def bins_to_lists(flat: np.ndarray, offsets: np.ndarray, index: np.ndarray | None = None) -> list[list[int]]:
    """The bins as lists of positions (or of ``index[position]``)."""
    items = (flat if index is None else index[flat]).tolist()
    bounds = offsets.tolist()
    enabled = gc.isenabled()
    gc.disable()  # the collector's passes over 100,000s of new lists cost 5x the building (0.31 s vs 0.06 s)
    try:
        return [items[a:b] for a, b in pairwise(bounds)]
    finally:
        if enabled:
            gc.enable()

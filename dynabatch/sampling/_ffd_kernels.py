"""The compiled first-fit-decreasing kernels behind :mod:`dynabatch.sampling.ffd` and the multipack sampler.

Why numba: FFD asks, for every sequence, for the first bin with enough room.
Done with a max-segment tree over the bins that is a ``log2(bins)`` walk per
sequence, an irregular data-dependent loop numpy cannot vectorise and Python
runs ~100x too slowly. ``numba.njit(cache=True)`` compiles it to machine code
once per machine (under a second: the kernels allocate nothing and use only
explicit loops, which numba compiles fastest) and later processes load it
from the cache;
numba ships wheels for current numpy and needs no compiler. One epoch of
1,000,000 sequences plans in well under a second (``benchmarks/packing.py``).

Bins come out as two arrays, ``flat`` (positions) and ``offsets`` (bin ``j``
is ``flat[offsets[j]:offsets[j + 1]]``), not as lists: :func:`bins_to_lists`
makes lists when a caller wants them.

Example:
    >>> import numpy as np
    >>> flat, offsets, unplaced = pack(np.array([2, 7, 3, 5]), capacity=10, group_size=4, bin_size=200)
    >>> bins_to_lists(flat, offsets), unplaced
    ([[1, 2], [3, 0]], 0)
    >>> sequential_offsets(np.array([4, 5, 3, 6, 2]), 10, 200).tolist()
    [0, 2, 4, 5]
"""

from __future__ import annotations

from itertools import pairwise

import numba
import numpy as np

__all__ = ["bins_to_lists", "pack", "pack_groups", "sequential_offsets", "sort_keys"]


@numba.njit(cache=True)
def _pack_groups(lengths, keys, capacity, group_size, max_bins, bin_size,
                 counts, order, bins, tree, filled, flat, offsets):  # pragma: no cover - compiled
    """First-fit-decreasing per group of ``group_size`` consecutive positions, into preallocated arrays.

    ``keys`` order the sequences like ``lengths`` do, in ``[0, counts.size)``,
    for a counting sort (decreasing, stable). A max-segment tree over the
    group's bins (``tree``: room left, -1 for a bin not allowed or full; its
    ``filled.size`` leaves) finds the lowest-numbered bin with room in log
    time; at most ``max_bins`` bins per group, numbered in the order they were
    opened. Fills ``flat`` and ``offsets`` (zeros on entry) as
    :func:`pack_groups` returns them; returns ``(bins used, unplaced)``.

    Every array is allocated by the caller and every loop is explicit: numba
    compiles this in well under a second, where slices, ``min``/``max`` and
    allocations in here cost it another second on first use.
    """
    n = lengths.shape[0]
    n_keys = counts.shape[0]
    leaves = filled.shape[0]
    total_bins = 0
    unplaced = 0
    for g0 in range(0, n, group_size):
        g1 = g0 + group_size
        if g1 > n:
            g1 = n
        m = g1 - g0
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
            order[counts[v]] = i
            counts[v] += 1
        limit = m
        if max_bins < limit:
            limit = max_bins
        for b in range(leaves):
            tree[leaves + b] = capacity if b < limit else -1
            filled[b] = 0
        for node in range(leaves - 1, 0, -1):
            a = tree[2 * node]
            c = tree[2 * node + 1]
            tree[node] = a if a > c else c
        n_bins = 0
        for k in range(m):
            size = lengths[order[k]]
            if tree[1] < size:
                bins[k] = -1
                unplaced += 1
                continue
            node = 1
            while node < leaves:
                node = 2 * node if tree[2 * node] >= size else 2 * node + 1
            b = node - leaves
            bins[k] = b
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
        for k in range(m):
            if bins[k] >= 0:
                offsets[total_bins + bins[k] + 1] += 1
        for b in range(n_bins):  # offsets become cumulative; filled becomes each bin's next free slot
            offsets[total_bins + b + 1] += offsets[total_bins + b]
            filled[b] = offsets[total_bins + b]
        for k in range(m):
            b = bins[k]
            if b >= 0:
                flat[filled[b]] = order[k]
                filled[b] += 1
        total_bins += n_bins
    return total_bins, unplaced


def pack_groups(lengths: np.ndarray, keys: np.ndarray, key_max: int, capacity: int, group_size: int,
                max_bins: int, bin_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit-decreasing per group of ``group_size`` consecutive positions.

    ``lengths`` and ``keys`` are 1-D int64 arrays; ``keys`` order the
    sequences like ``lengths`` do, in ``[0, key_max]`` (the lengths, or their
    ranks when the capacity is huge). Within a group, sequences are placed
    longest first (ties in position order), each into the lowest-numbered bin
    with room; at most ``max_bins`` bins per group, numbered in the order they
    were opened. Returns ``(flat, offsets, unplaced)``: bin ``j`` holds
    positions ``flat[offsets[j]:offsets[j + 1]]``, longest first, the groups'
    bins one after the other; ``unplaced`` counts sequences that found no room
    in ``max_bins`` bins (never, when ``max_bins >= group_size``).
    """
    lengths, keys = _int64(lengths), _int64(keys)  # one compiled signature: C-contiguous int64
    n = lengths.shape[0]
    span = min(group_size, n)
    leaves = 1
    while leaves < max(min(max_bins, group_size), 1):
        leaves *= 2
    flat = np.empty(n, np.int64)
    offsets = np.zeros(n + 1, np.int64)
    used, unplaced = _pack_groups(
        lengths, keys, int(capacity), int(group_size), int(max_bins), int(bin_size),
        np.empty(int(key_max) + 1, np.int64), np.empty(span, np.int64), np.empty(span, np.int64),
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


def pack(lengths: np.ndarray, capacity: int, group_size: int, bin_size: int,
         max_bins: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """FFD per group (see :func:`pack_groups`): ``(flat, offsets, unplaced)``; ``max_bins`` defaults to ``group_size``."""
    keys, key_max = sort_keys(lengths, capacity)
    limit = group_size if max_bins is None else max_bins
    return pack_groups(lengths, keys, key_max, capacity, group_size, limit, bin_size)


def bins_to_lists(flat: np.ndarray, offsets: np.ndarray, index: np.ndarray | None = None) -> list[list[int]]:
    """The bins as lists of positions (or of ``index[position]``)."""
    items = (flat if index is None else index[flat]).tolist()
    bounds = offsets.tolist()
    return [items[a:b] for a, b in pairwise(bounds)]

"""How the multipack sampler shares an epoch's bins among ranks.

Private to :mod:`dynabatch.sampling.multipack`. An epoch's bins are the
dataset indices ``items`` and each bin's ``starts`` / ``ends`` into them.
:func:`share_bins` splits the bins with the most sequences in halves
(:func:`split_largest`) until every rank gets the same number of batches;
rank ``r`` gets bins ``r::num_replicas``, dealt into batches by :func:`deal`
(full batches first, none empty) and listed by :func:`rank_batches`.

This splitting is not :func:`dynabatch.sampling.base.split_for_replicas`: that
one cuts a batch into ``k`` equal parts at once (6 rows in three: 2, 2, 2),
this one halves the largest bin again and again (6 in three: 2, 1, 3), and
each sampler's batches (pinned by its tests) depend on its own.

Example:
    >>> import numpy as np
    >>> starts, ends = split_largest(np.array([0]), np.array([6]), 3)
    >>> (ends - starts).tolist()
    [2, 1, 3]
    >>> starts, ends, deals = share_bins(np.array([0, 6]), np.array([6, 8]), 3, 1, 0)
    >>> list(zip(starts.tolist(), ends.tolist())), deals
    ([(0, 3), (3, 6), (6, 8)], [[1], [1], [1]])
    >>> rank_batches(list(range(10, 18)), starts, ends, deals, [0, 1, 2], 3)
    [[[10, 11, 12]], [[13, 14, 15]], [[16, 17]]]
"""

from __future__ import annotations

import gc
from itertools import pairwise

import numpy as np


def split_largest(starts: np.ndarray, ends: np.ndarray, needed: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits the bins (``items[start:end]``) with the most sequences in halves until there are ``needed``."""
    starts, ends = starts.tolist(), ends.tolist()
    while len(starts) < needed:
        sizes = [e - s for s, e in zip(starts, ends)]
        at = int(np.argmax(sizes)) if sizes else 0
        if not sizes or sizes[at] < 2:
            raise ValueError(
                f"num_replicas should be at most the number of samples ({sum(sizes)}) so that every rank "
                f"gets a batch without repeating one, but got {needed} bins needed; pass drop_last=True "
                "or fewer ranks"
            )
        mid = starts[at] + -(-sizes[at] // 2)
        starts.insert(at + 1, mid)
        ends.insert(at, mid)
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def deal(n_bins_rank: int, batches: int, batch_size: int) -> list[int]:
    """Bins per batch: ``batches`` batches over ``n_bins_rank`` bins, full ones first, none empty."""
    if batches == 0:
        return []
    full = batches if batch_size == 1 else min(batches, (n_bins_rank - batches) // (batch_size - 1))
    rest, parts = n_bins_rank - full * batch_size, batches - full
    return [batch_size] * full + [rest // parts + (1 if i < rest % parts else 0) for i in range(parts)]


def share_bins(starts: np.ndarray, ends: np.ndarray, world: int, size: int,
               min_batches: int) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """Splits bins so every one of ``world`` ranks gets the same number of batches.

    Rank ``r`` gets bins ``r::world``; returns the bins and, per rank, the
    number of bins in each of its batches (of at most ``size`` bins, at least
    ``min_batches`` of them).
    """
    n = starts.size
    per_rank = -(-n // world)  # bins of the fullest rank
    count = max(-(-per_rank // size), min_batches) if n else 0  # batches per rank
    if n // world < count:  # a rank would have fewer bins than batches: split the fullest bins
        starts, ends = split_largest(starts, ends, count * world)
    shares = [len(range(r, starts.size, world)) for r in range(world)]
    return starts, ends, [deal(share, count, size) for share in shares]


def rank_batches(items: list[int], starts: np.ndarray, ends: np.ndarray, deals: list[list[int]],
                 ranks: list[int], world: int) -> list[list[list[int]]]:
    """The batches (lists of bins of dataset indices) of ``ranks``, step by step: rank order within a step."""
    first, last = starts.tolist(), ends.tolist()
    per_rank = []
    collecting = gc.isenabled()
    gc.disable()  # ~10^5 new lists: the cyclic collector would scan them again and again
    try:
        for r in ranks:
            bins = [items[a:b] for a, b in zip(first[r::world], last[r::world])]
            cuts = np.cumsum([0, *deals[r]]).tolist()
            per_rank.append([bins[a:b] for a, b in pairwise(cuts)])
        return [rank[k] for k in range(len(per_rank[0])) for rank in per_rank]
    finally:
        if collecting:
            gc.enable()

"""Sequence packing: axolotl's ``MultipackBatchSampler`` API, exact, resumable and fast.

Several sequences are packed into one fixed-capacity row ("bin") of at most
``batch_max_len`` tokens and at most ``bin_size`` sequences; ``batch_size``
bins make a batch. The planner is first-fit-decreasing (FFD) per group of
``group_size`` sequences, as in axolotl; the functions and the sampler keep
axolotl's names, argument order, defaults and return shapes (seed 004).

What this implementation adds to the reference:

* **Nothing is lost silently.** A sequence longer than ``batch_max_len`` raises
  a ``ValueError`` naming it (or is truncated to ``batch_max_len`` with
  ``oversized="truncate"``); the reference put it alone in an over-full bin.
  ``drop_last`` drops only whole bins that cannot fill a batch on every rank,
  and the number of samples dropped is kept in :attr:`MultipackBatchSampler.num_samples_dropped`
  and logged.
* **Deterministic.** The same ``seed`` and epoch give the same batches whatever
  ``num_processes`` (groups are packed independently and concatenated in
  order), on every rank. A ``RandomSampler`` is replaced by a permutation from
  ``np.random.default_rng([seed, epoch])``: torch's ``RandomSampler`` draws a
  fresh order on every iteration, which would make ``len()``, resumption and
  the ranks disagree.
* **Resumable and sharded**, with the conventions of
  :class:`dynabatch.sampling.base.PlannedBatchSampler` (which cannot be the base
  class here: a batch is a list of bins, not a flat index array, and the seed's
  constructor wins): ``state_dict`` / ``load_state_dict`` resume mid-epoch;
  ``num_replicas`` ranks get the same number of batches and disjoint indices,
  without dropping anything unless ``drop_last``; ``shard=False`` yields every
  rank's batches in turn for accelerate's round-robin dealer.

Why numba: FFD asks, for every sequence, for the first bin with enough room.
Done with a max-segment tree over the bins that is a ``log2(bins)`` walk per
sequence, an irregular data-dependent loop numpy cannot vectorise and Python
runs ~100x too slowly. ``numba.njit(cache=True)`` compiles it to machine code
once per machine (about a second) and later processes load it from the cache;
numba ships wheels for current numpy and needs no compiler. One epoch of
1,000,000 sequences plans in well under a second (``benchmarks/packing.py``).

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.multipack import MultipackBatchSampler
    >>> lengths = np.array([5, 3, 8, 2, 6, 4, 7, 1])
    >>> sampler = MultipackBatchSampler(list(range(8)), batch_size=2, batch_max_len=10,
    ...                                 lengths=lengths, drop_last=False)
    >>> batches = list(sampler)
    >>> batches
    [[[2, 3], [6, 1]], [[4, 5], [0, 7]]]
    >>> all(lengths[b].sum() <= 10 for batch in batches for b in batch)
    True
    >>> len(sampler), round(sampler.efficiency(), 3)
    (2, 0.9)
"""

from __future__ import annotations

import gc
import logging
import math
import numbers
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import pairwise
from multiprocessing import get_all_start_methods, get_context
from typing import Any

import numba
import numpy as np
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_non_negative_int,
    check_positive_int,
    check_positive_number,
)
from dynabatch.sampling.base import fingerprint

__all__ = ["MultipackBatchSampler", "allocate_sequentially", "ffd_check", "pack_group", "pack_parallel"]

LOG = logging.getLogger(__name__)

_NO_LIMIT = np.iinfo(np.int64).max
_EXTRA_KWARGS = ("seed", "oversized", "num_replicas", "rank", "shard")


# --------------------------------------------------------------------------- compiled kernels


@numba.njit(cache=True)
def _pack_groups(lengths, keys, key_max, capacity, group_size, max_bins, bin_size):  # pragma: no cover - compiled
    """First-fit-decreasing per group of ``group_size`` consecutive positions.

    ``keys`` order the sequences like ``lengths`` do, in ``[0, key_max]`` (the
    lengths, or their ranks when the capacity is huge), for a counting sort
    (decreasing, stable). A max-segment tree over the group's bins (room left;
    -1 for a bin not allowed or full) finds the lowest-numbered bin with room
    in log time; at most ``max_bins`` bins per group, numbered in the order they
    were opened. Returns ``(flat, offsets, unplaced)``: bin ``j`` holds
    positions ``flat[offsets[j]:offsets[j + 1]]``, longest first, the groups'
    bins one after the other; ``unplaced`` counts sequences that found no room
    in ``max_bins`` bins (never, when ``max_bins >= group_size``).
    """
    n = lengths.shape[0]
    flat = np.empty(n, np.int64)
    offsets = np.zeros(n + 1, np.int64)
    order = np.empty(min(group_size, n) if n else 0, np.int64)
    bins = np.empty(order.shape[0], np.int64)
    counts = np.zeros(key_max + 2, np.int64)
    start = np.empty(key_max + 2, np.int64)
    leaves = 1
    while leaves < max(min(max_bins, group_size), 1):
        leaves *= 2
    tree = np.empty(2 * leaves, np.int64)
    filled = np.empty(leaves, np.int64)
    total_bins = 0
    unplaced = 0
    for g0 in range(0, n, group_size):
        g1 = min(g0 + group_size, n)
        m = g1 - g0
        counts[:] = 0
        for i in range(g0, g1):
            counts[keys[i]] += 1
        pos = 0
        for v in range(key_max + 1, -1, -1):
            start[v] = pos
            pos += counts[v]
        for i in range(g0, g1):
            v = keys[i]
            order[start[v]] = i
            start[v] += 1
        limit = min(max_bins, m)
        tree[:] = -1
        for b in range(limit):
            tree[leaves + b] = capacity
        for node in range(leaves - 1, 0, -1):
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
        filled[:] = 0
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
            n_bins = max(n_bins, b + 1)
            filled[b] += 1
            tree[node] = tree[node] - size if filled[b] < bin_size else -1
            node //= 2
            while node >= 1:
                tree[node] = max(tree[2 * node], tree[2 * node + 1])
                node //= 2
        for k in range(m):
            if bins[k] >= 0:
                offsets[total_bins + bins[k] + 1] += 1
        for b in range(n_bins):
            offsets[total_bins + b + 1] += offsets[total_bins + b]
        fill = offsets[total_bins : total_bins + n_bins].copy()
        for k in range(m):
            b = bins[k]
            if b >= 0:
                flat[fill[b]] = order[k]
                fill[b] += 1
        total_bins += n_bins
    return flat, offsets[: total_bins + 1].copy(), unplaced


@numba.njit(cache=True)
def _sequential_offsets(lengths, capacity, bin_size):  # pragma: no cover - compiled
    """Bin boundaries packing in order: a new bin when the next sequence does not fit."""
    n = lengths.shape[0]
    offsets = np.empty(n + 1, np.int64)
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
    return offsets[: n_bins + 1].copy()


# --------------------------------------------------------------------------- checks


def _as_lengths(name: str, values: Any) -> np.ndarray:
    """A 1-D int64 array of non-negative lengths, or a clear error."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise bad_type(name, "a 1-D integer array of sequence lengths", values)
    array = np.asarray(values)
    if array.size == 0 and array.ndim == 1:
        return array.astype(np.int64)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise bad_type(name, f"a 1-D integer array of sequence lengths (dtype {array.dtype})", values)
    if array.ndim != 1:
        raise bad_value(name, f"a 1-D integer array of sequence lengths (shape {array.shape})", values)
    if array.min() < 0:
        at = int(np.argmin(array))
        raise bad_value(f"{name}[{at}]", "a non-negative sequence length", int(array[at]))
    return array.astype(np.int64, copy=False)


def _check_fits(name: str, lengths: np.ndarray, capacity: int, hint: str = "") -> None:
    if lengths.size and lengths.max() > capacity:
        at = int(np.argmax(lengths > capacity))
        raise bad_value(f"{name}[{at}]", f"at most the bin capacity {capacity} tokens{hint}", int(lengths[at]))


def _sort_keys(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Keys for the kernels' counting sort: the lengths, or their ranks if the capacity is huge."""
    if capacity <= 4 * lengths.size + 65536:
        return lengths, capacity
    ranks = np.unique(lengths, return_inverse=True)[1].astype(np.int64).ravel()
    return ranks, int(ranks.max()) if ranks.size else 0


def _pack(lengths: np.ndarray, capacity: int, group_size: int, bin_size: int,
          max_bins: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    keys, key_max = _sort_keys(lengths, capacity)
    limit = group_size if max_bins is None else max_bins
    return _pack_groups(lengths, keys, key_max, capacity, group_size, limit, bin_size)


def _bins_to_lists(flat: np.ndarray, offsets: np.ndarray, index: np.ndarray | None = None) -> list[list[int]]:
    items = (flat if index is None else index[flat]).tolist()
    bounds = offsets.tolist()
    return [items[a:b] for a, b in pairwise(bounds)]


# --------------------------------------------------------------------------- the seed's functions


def ffd_check(sequence_lengths: np.ndarray, bin_capacity: int, num_bins: int) -> bool:
    """First-fit-decreasing bin packing algorithm check.

    Checks if sequences with the given lengths could fit in the specified number of bins.

    Args:
        sequence_lengths: Array of sequence lengths.
        bin_capacity: Maximum capacity of each bin.
        num_bins: Number of bins available.

    Returns:
        bool: True if all sequences can be packed, False otherwise.

    Example:
        >>> import numpy as np
        >>> ffd_check(np.array([6, 5, 4, 3, 2]), 10, 2), ffd_check(np.array([6, 5, 4, 3, 3]), 10, 2)
        (True, False)
    """
    lengths = _as_lengths("sequence_lengths", sequence_lengths)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    num_bins = check_non_negative_int("num_bins", num_bins)
    if lengths.size == 0:
        return True
    if num_bins == 0 or lengths.max() > capacity:
        return False
    return _pack(lengths, capacity, lengths.size, _NO_LIMIT, max_bins=num_bins)[2] == 0


def pack_group(
    sequence_lengths: np.ndarray,
    group_offset: int,
    bin_capacity: int,
    max_bins: int,
    bin_size: int,
    safe_mode: bool = True,
) -> list[list[int]]:
    """Pack a group of sequences into bins using First-Fit Decreasing algorithm.

    Args:
        sequence_lengths: Array of sequence lengths.
        group_offset: Offset to apply to indices when returning results.
        bin_capacity: Maximum capacity of each bin.
        max_bins: Maximum number of bins to use.
        bin_size: Maximum number of sequences per bin.
        safe_mode: If True, use a more conservative packing approach: never
            open more than ``max_bins`` bins, and raise a ``ValueError`` if the
            group does not fit in them (the reference skipped those sequences
            silently). If False, open as many bins as needed.

    Returns:
        list[list[int]]: List of bins, where each bin contains indices of sequences
        assigned to it (``group_offset`` + position, longest first), bins in the
        order they were opened.

    Raises:
        ValueError: a sequence longer than ``bin_capacity``, or (safe mode) more
            than ``max_bins`` bins needed.

    Example:
        >>> import numpy as np
        >>> pack_group(np.array([2, 7, 3, 5]), 100, bin_capacity=10, max_bins=4, bin_size=200)
        [[101, 102], [103, 100]]
        >>> pack_group(np.array([2, 7, 3, 5]), 0, bin_capacity=10, max_bins=4, bin_size=1)
        [[1], [3], [2], [0]]
    """
    lengths = _as_lengths("sequence_lengths", sequence_lengths)
    offset = check_non_negative_int("group_offset", group_offset)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    max_bins = check_non_negative_int("max_bins", max_bins)
    bin_size = check_positive_int("bin_size", bin_size)
    if not isinstance(safe_mode, (bool, np.bool_)):
        raise bad_type("safe_mode", "a bool", safe_mode)
    _check_fits("sequence_lengths", lengths, capacity)
    limit = max_bins if safe_mode else max(max_bins, lengths.size)
    flat, offsets, unplaced = _pack(lengths, capacity, max(lengths.size, 1), bin_size, max_bins=limit)
    if unplaced:
        raise bad_value(
            "max_bins",
            f"enough bins for the group ({unplaced} of {lengths.size} sequences found no room; "
            "pass safe_mode=False to open more)",
            max_bins,
        )
    return [[i + offset for i in b] for b in _bins_to_lists(flat, offsets)]


def _pack_chunk(args: tuple[np.ndarray, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    lengths, capacity, group_size, bin_size = args
    return _pack(lengths, capacity, group_size, bin_size)[:2]


def _pack_arrays(
    lengths: np.ndarray,
    capacity: int,
    group_size: int,
    bin_size: int,
    num_processes: int,
    mp_start_method: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """FFD per group, in ``num_processes`` processes; the result does not depend on that number."""
    n_groups = -(-lengths.size // group_size)
    workers = min(num_processes, n_groups)
    if workers <= 1:
        return _pack(lengths, capacity, group_size, bin_size)[:2]
    per = -(-n_groups // workers) * group_size  # whole groups per process, in order
    tasks = [(lengths[i : i + per], capacity, group_size, bin_size) for i in range(0, lengths.size, per)]
    context = None
    if mp_start_method is not None:
        if mp_start_method in get_all_start_methods():
            context = get_context(mp_start_method)
        else:
            LOG.warning("mp_start_method=%r is not available here (%s); using the default",
                        mp_start_method, get_all_start_methods())
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        parts = list(pool.map(_pack_chunk, tasks))
    flats, offsets = [], [np.zeros(1, np.int64)]
    for flat, offs in parts:
        flats.append(flat)
        offsets.append(offs[1:] + offsets[-1][-1])
    starts = np.cumsum([0] + [t[0].size for t in tasks[:-1]])
    return np.concatenate([f + s for f, s in zip(flats, starts)]), np.concatenate(offsets)


def pack_parallel(
    sequence_lengths: np.ndarray,
    bin_capacity: int,
    group_size: int,
    bin_size: int,
    num_processes: int | None = None,
    safe_mode: bool = True,
    mp_start_method: str | None = "fork",
) -> list[list[int]]:
    """Pack sequences into bins using parallel processing.

    Each group of ``group_size`` consecutive sequences is packed on its own by
    FFD (:func:`pack_group`); the bins of the groups follow each other in group
    order, so the result is the same whatever ``num_processes``.

    Args:
        sequence_lengths: Array of sequence lengths.
        bin_capacity: Maximum capacity of each bin as total number of tokens.
        group_size: Number of sequences to process in each group.
        bin_size: Maximum number of sequences per bin (the reference's
            docstring says "bins"; its code, like this one, caps sequences per bin).
        num_processes: Number of parallel processes to use. ``None`` packs in
            this process: the compiled packer does a million sequences in a
            fraction of a second, less than starting processes costs.
        safe_mode: If True, use a more conservative packing approach (see
            :func:`pack_group`; a group can always open one bin per sequence, so
            it never binds here).
        mp_start_method: Multiprocessing start method ('fork', 'spawn',
            'forkserver'). 'spawn' is often safer with Numba/PyTorch. Set to
            None to use system default.

    Returns:
        list[list[int]]: List of bins, where each bin contains indices of sequences assigned to it.

    Example:
        >>> import numpy as np
        >>> pack_parallel(np.array([2, 7, 3, 5, 9, 1]), bin_capacity=10, group_size=3, bin_size=200)
        [[1, 2], [0], [4, 5], [3]]
    """
    lengths = _as_lengths("sequence_lengths", sequence_lengths)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    group_size = check_positive_int("group_size", group_size)
    bin_size = check_positive_int("bin_size", bin_size)
    processes = 1 if num_processes is None else check_positive_int("num_processes", num_processes)
    if not isinstance(safe_mode, (bool, np.bool_)):
        raise bad_type("safe_mode", "a bool", safe_mode)
    _check_fits("sequence_lengths", lengths, capacity)
    flat, offsets = _pack_arrays(lengths, capacity, group_size, bin_size, processes, mp_start_method)
    return _bins_to_lists(flat, offsets)


def allocate_sequentially(
    sequence_lengths: np.ndarray,
    rank: int,
    bin_capacity: int,
    num_ranks: int,
    *,
    bin_size: int | None = None,
) -> tuple[list[list[int]], int, int]:
    """Sequential allocator that preserves example order.

    A new bin starts when the next sequence does not fit in the current one
    (or, with ``bin_size``, when it already holds ``bin_size`` sequences).

    Args:
        sequence_lengths: The lengths of all examples.
        rank: The current rank (for distributed training).
        bin_capacity: The capacity of each bin (maximum sequence length).
        num_ranks: Number of ranks (processes / GPUs).
        bin_size: (dynabatch) at most this many sequences per bin; ``None``: no cap.

    Returns:
        rank_batches (list[list[int]]): List of batches for the current rank
        (every ``num_ranks``-th bin from ``rank``).
        total_tokens_used (int): Number of actual example tokens.
        total_token_slots (int): Maximum theoretical number of example tokens
        (number of bins * bin capacity).

    Example:
        >>> import numpy as np
        >>> allocate_sequentially(np.array([4, 5, 3, 6, 2]), rank=0, bin_capacity=10, num_ranks=1)
        ([[0, 1], [2, 3], [4]], 20, 30)
    """
    lengths = _as_lengths("sequence_lengths", sequence_lengths)
    num_ranks = check_positive_int("num_ranks", num_ranks)
    rank = check_non_negative_int("rank", rank)
    if rank >= num_ranks:
        raise bad_value("rank", f"in [0, num_ranks={num_ranks})", rank)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    cap = _NO_LIMIT if bin_size is None else check_positive_int("bin_size", bin_size)
    _check_fits("sequence_lengths", lengths, capacity)
    offsets = _sequential_offsets(lengths, capacity, cap)
    bins = _bins_to_lists(np.arange(lengths.size), offsets)
    return bins[rank::num_ranks], int(lengths.sum()), (offsets.size - 1) * capacity


# --------------------------------------------------------------------------- the sampler


def _process_group() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


def _reduce(value: float, op: str) -> float:
    """``value`` reduced (min / max) over the ranks of the process group; itself without one."""
    group = _process_group()
    if group is None or group[0] == 1:
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return float(tensor.item())


def _split_largest(starts: np.ndarray, ends: np.ndarray, needed: int) -> tuple[np.ndarray, np.ndarray]:
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


def _deal(n_bins_rank: int, batches: int, batch_size: int) -> list[int]:
    """Bins per batch: ``batches`` batches over ``n_bins_rank`` bins, full ones first, none empty."""
    if batches == 0:
        return []
    full = batches if batch_size == 1 else min(batches, (n_bins_rank - batches) // (batch_size - 1))
    rest, parts = n_bins_rank - full * batch_size, batches - full
    return [batch_size] * full + [rest // parts + (1 if i < rest % parts else 0) for i in range(parts)]


class MultipackBatchSampler(BatchSampler):
    """Batch sampler class for efficient packing of variable-length sequences.

    This sampler packs sequences into fixed-capacity bins (batches) to maximize
    GPU memory utilization and training throughput by reducing padding. It
    supports both parallel packing (using FFD algorithm) and sequential packing
    (preserving original sequence order). Each batch is a list of up to
    ``batch_size`` bins, each bin a list of dataset indices.

    Args:
        sampler: the order of the dataset indices (e.g. ``RandomSampler(ds)``,
            ``SequentialSampler(ds)`` or a list); it must cover as many items as
            ``lengths``. A ``RandomSampler`` becomes a seeded permutation per
            epoch (see the module docs); any other sampler is iterated each
            epoch (its ``set_epoch`` is called) and should be deterministic.
        batch_size: Number of bins per batch.
        batch_max_len: Bin capacity in tokens (maximum sequence length).
        lengths: Sequence lengths, a 1-D integer array indexed like the dataset.
        packing_efficiency_estimate: Initial efficiency estimate, in (0, 1]; kept
            for compatibility (the batch count here is exact, not estimated).
        drop_last: Drop the bins that cannot fill a last batch of ``batch_size``
            bins on every rank (counted in :attr:`num_samples_dropped`).
        num_count_samples: kept for compatibility: the reference estimated the
            batch count from this many random packings; here the epoch's plan is
            deterministic, so ``len()`` is exact.
        sequential: pack in sampler order (a bin never mixes non-neighbours)
            instead of FFD.
        group_size: Sequences per FFD group.
        bin_size: Maximum number of sequences in one bin.
        num_processes: processes for packing the groups (``None``: this process).
        safe_mode: passed to :func:`pack_parallel`.
        mp_start_method: start method of those processes.
        **kwargs: dynabatch's additions, all optional: ``seed`` (0; with the epoch
            seeds the order of a ``RandomSampler``), ``oversized`` (``"error"``,
            or ``"truncate"`` to count a too-long sequence as ``batch_max_len``
            tokens: truncate it when collating, e.g.
            ``PackedCollator(max_length=batch_max_len)``), ``num_replicas`` and
            ``rank`` (default: the process group's), ``shard`` (``True``; ``False``
            yields every rank's batches in turn, for accelerate's dealer). Other
            keywords are ignored with a warning, as the reference ignores them.

    ``len(sampler)`` is this rank's number of batches in the current epoch (the
    same on every rank). Call :meth:`set_epoch` before each epoch.
    """

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        batch_max_len: int,
        lengths: np.ndarray,
        packing_efficiency_estimate: float = 1.0,
        drop_last: bool = True,
        num_count_samples: int = 4,
        sequential: bool = False,
        group_size: int = 100000,
        bin_size: int = 200,
        num_processes: int | None = None,
        safe_mode: bool = True,
        mp_start_method: str = "fork",
        **kwargs: Any,
    ) -> None:
        batch_size = check_positive_int("batch_size", batch_size)
        self.batch_max_len = check_positive_int("batch_max_len", batch_max_len)
        for name, value in (("drop_last", drop_last), ("sequential", sequential), ("safe_mode", safe_mode)):
            if not isinstance(value, bool):
                raise bad_type(name, "a bool", value)
        super().__init__(sampler, batch_size, drop_last)
        self.packing_efficiency_estimate = check_positive_number(
            "packing_efficiency_estimate", packing_efficiency_estimate or 1.0)
        if self.packing_efficiency_estimate > 1:
            raise bad_value("packing_efficiency_estimate", "in (0, 1]", packing_efficiency_estimate)
        self.num_count_samples = check_positive_int("num_count_samples", num_count_samples)
        self.sequential = sequential
        self.group_size = check_positive_int("group_size", group_size)
        self.bin_size = check_positive_int("bin_size", bin_size)
        self.num_processes = None if num_processes is None else check_positive_int("num_processes", num_processes)
        self.safe_mode = safe_mode
        self.mp_start_method = mp_start_method

        unknown = sorted(set(kwargs) - set(_EXTRA_KWARGS))
        if unknown:
            LOG.warning("MultipackBatchSampler ignores the keyword arguments %s", unknown)
        self.seed = check_non_negative_int("seed", kwargs.get("seed", 0))
        self.oversized = kwargs.get("oversized", "error")
        if self.oversized not in ("error", "truncate"):
            raise bad_value("oversized", "'error' or 'truncate'", self.oversized)
        self.shard = kwargs.get("shard", True)
        if not isinstance(self.shard, bool):
            raise bad_type("shard", "a bool", self.shard)
        group = _process_group()
        num_replicas, rank = kwargs.get("num_replicas"), kwargs.get("rank")
        self.num_replicas = check_positive_int(
            "num_replicas", num_replicas if num_replicas is not None else (group[0] if group else 1))
        self.rank = check_non_negative_int("rank", rank if rank is not None else (group[1] if group else 0))
        if self.rank >= self.num_replicas:
            raise bad_value("rank", f"in [0, num_replicas={self.num_replicas})", self.rank)

        self.lengths = self._check_lengths(lengths)
        self._check_sampler(sampler)
        if self.sequential and not isinstance(sampler, SequentialSampler) and isinstance(sampler, RandomSampler):
            LOG.warning("sequential=True with a RandomSampler packs neighbours of a shuffled order")

        self.epoch = 0
        self.total_tokens_used = 0
        self.total_token_slots = 0
        self.num_samples_dropped = 0
        self.min_batches = 0
        self.len_across_ranks: int | None = None
        self._cache: tuple[int, list[list[list[int]]], str, int, int] | None = None
        self._stats_epoch: int | None = None
        self._done = 0
        self._resume_at = 0

    # ----------------------------------------------------------------- validation

    def _check_lengths(self, lengths: Any) -> np.ndarray:
        array = _as_lengths("lengths", lengths)
        if array.size and array.min() < 1:
            at = int(np.argmin(array))
            raise bad_value(f"lengths[{at}]", "a positive sequence length", int(array[at]))
        if self.oversized == "error":
            _check_fits("lengths", array, self.batch_max_len,
                        f" (batch_max_len={self.batch_max_len}; pass oversized='truncate' to cut it)")
        return np.minimum(array, self.batch_max_len)

    def _check_sampler(self, sampler: Any) -> None:
        if isinstance(sampler, DistributedSampler):
            size = len(sampler.dataset)  # type: ignore[arg-type]
            if self.num_replicas > 1 and self.shard:
                LOG.warning("a DistributedSampler already splits the data per rank: pass num_replicas=1 "
                            "so MultipackBatchSampler does not split it again")
        elif hasattr(sampler, "__len__"):
            size = len(sampler)
        else:
            raise bad_type("sampler", "a Sampler or an iterable of indices with a length", sampler)
        if size != self.lengths.size:
            raise ValueError(f"sampler should cover as many items as lengths ({self.lengths.size}), "
                             f"but got len(sampler)={size}")

    # ----------------------------------------------------------------- planning

    def _order(self, epoch: int) -> np.ndarray:
        sampler = self.sampler
        if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == self.lengths.size:
            return np.random.default_rng([self.seed, epoch]).permutation(self.lengths.size)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        order = np.fromiter((int(i) for i in sampler), dtype=np.int64)
        if order.size and (order.min() < 0 or order.max() >= self.lengths.size):
            bad = order[(order < 0) | (order >= self.lengths.size)][0]
            raise bad_value("sampler", f"yielding indices in [0, {self.lengths.size})", f"index {bad}")
        return order

    def _plan_bins(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's bins: dataset indices ``items`` and each bin's ``starts`` / ``ends`` into them."""
        lengths = self.lengths[order]
        if self.sequential:
            offsets = _sequential_offsets(lengths, self.batch_max_len, self.bin_size)
            items = order
        else:
            flat, offsets = _pack_arrays(lengths, self.batch_max_len, self.group_size, self.bin_size,
                                         self.num_processes or 1, self.mp_start_method)
            items = order[flat]
        return items, offsets[:-1], offsets[1:]

    def _distribute(self, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
        """Drops (``drop_last``) or splits bins so every rank gets the same number of batches.

        Rank ``r`` gets bins ``r::num_replicas``; returns the bins and, per rank,
        the number of bins in each of its batches.
        """
        world, size = self.num_replicas, self.batch_size
        if self.drop_last:
            keep = starts.size // (world * size) * world * size
            self.num_samples_dropped = int((ends[keep:] - starts[keep:]).sum())
            if self.num_samples_dropped:
                LOG.info("drop_last dropped %d samples (%d bins) of %d in epoch %d", self.num_samples_dropped,
                         starts.size - keep, self.lengths.size, self.epoch)
            starts, ends = starts[:keep], ends[:keep]
        else:
            self.num_samples_dropped = 0
        n = starts.size
        per_rank = -(-n // world)  # bins of the fullest rank
        count = max(-(-per_rank // size), self.min_batches) if n else 0  # batches per rank
        if n // world < count:  # a rank would have fewer bins than batches: split the fullest bins
            starts, ends = _split_largest(starts, ends, count * world)
        shares = [len(range(r, starts.size, world)) for r in range(world)]
        return starts, ends, [_deal(share, count, size) for share in shares]

    def generate_batches(self, set_stats: bool = False) -> list[list[list[int]]]:
        """Generate packed batches for training.

        Args:
            set_stats: Whether to update efficiency statistics (once per epoch).

        Returns:
            list[list[list[int]]]: List of batches, where each batch contains
            multiple bins, and each bin contains multiple sequence indices.
        """
        if self._cache is None or self._cache[0] != self.epoch:
            order = self._order(self.epoch)
            items, starts, ends = self._plan_bins(order)
            starts, ends, deals = self._distribute(starts, ends)
            world = self.num_replicas
            ranks = [self.rank] if self.shard else list(range(world))
            listed, first, last = items.tolist(), starts.tolist(), ends.tolist()
            per_rank = []
            collecting = gc.isenabled()
            gc.disable()  # ~10^5 new lists: the cyclic collector would scan them again and again
            try:
                for r in ranks:
                    bins = [listed[a:b] for a, b in zip(first[r::world], last[r::world])]
                    cuts = np.cumsum([0, *deals[r]]).tolist()
                    per_rank.append([bins[a:b] for a, b in pairwise(cuts)])
                batches = [rank[k] for k in range(len(per_rank[0])) for rank in per_rank]
            finally:
                if collecting:
                    gc.enable()
            tokens = np.concatenate([[0], np.cumsum(self.lengths[items])])
            chosen = np.concatenate([np.arange(r, starts.size, world) for r in ranks])
            used = int((tokens[ends[chosen]] - tokens[starts[chosen]]).sum())
            self._cache = (self.epoch, batches, fingerprint([order]), used, chosen.size * self.batch_max_len)
            self._stats_epoch = None
        batches = self._cache[1]
        if set_stats and self._stats_epoch != self.epoch:
            self._stats_epoch = self.epoch
            self.total_tokens_used += self._cache[3]
            self.total_token_slots += self._cache[4]
        return batches

    # ----------------------------------------------------------------- the seed's methods

    def __iter__(self) -> Iterator[list[list[int]]]:
        batches = self.generate_batches(set_stats=True)
        start, self._resume_at = self._resume_at, 0
        self._done = start  # now, not at the first next(): a state saved before that is this position
        return self._hand_out(batches[start:])

    def _hand_out(self, batches: list[list[list[int]]]) -> Iterator[list[list[int]]]:
        for batch in batches:
            self._done += 1
            yield batch

    def __len__(self) -> int:
        return len(self.generate_batches())

    def set_min_batches(self, min_batches: int) -> None:
        """Every epoch yields at least ``min_batches`` batches per rank (extra ones have fewer bins).

        For a loop that fixes the steps per epoch once, like the HF ``Trainer``
        (``len`` of the first epoch): pass the most batches any epoch has
        (:meth:`max_len`), so no epoch's last batches are left unused.
        """
        self.min_batches = check_non_negative_int("min_batches", min_batches)
        self._cache = None

    def max_len(self, epochs: int) -> int:
        """The most batches per rank any of epochs ``0 .. epochs - 1`` has (planning each)."""
        epochs = check_positive_int("epochs", epochs)
        current, most = self.epoch, 0
        for epoch in range(epochs):
            self.epoch = epoch
            most = max(most, len(self.generate_batches()))
        self.epoch = current
        self.generate_batches()  # the current epoch's plan (and num_samples_dropped) again
        return most

    def num_batches(self) -> int:
        """The number of batches of this rank in the current epoch."""
        return len(self)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch number, used for reproducible shuffling across epochs.

        A resume point loaded with :meth:`load_state_dict` holds only for its epoch.
        """
        epoch = check_non_negative_int("epoch", epoch)
        if epoch != self.epoch:
            self._resume_at = self._done = 0
        self.epoch = epoch

    def efficiency(self) -> float:
        """Calculate the packing efficiency (ratio of tokens used to total token slots).

        Higher is better - 1.0 would mean perfect packing with no wasted space.
        Counts the epochs iterated so far (the current one if none was).
        """
        if self.total_token_slots == 0:
            self.generate_batches(set_stats=True)
        if self.total_token_slots == 0:
            return 0.0
        return float(self.total_tokens_used / self.total_token_slots)

    def gather_efficiency(self) -> float:
        """Gather and synchronize packing efficiency estimates across all distributed ranks.

        Without a process group, this rank's efficiency is the measurement.

        Returns:
            float: A conservative efficiency estimate based on the measurements:
            99.7% of the best rank's efficiency, rounded down to 0.5% (the
            reference floored to a whole number first, which gave 0.0).
        """
        best = _reduce(self.efficiency(), "max")
        LOG.debug("sample packing efficiency across ranks: max %.4f", best)
        return math.floor(0.997 * best * 200.0) / 200.0

    def gather_len_batches(self, num: int) -> int:
        """Gather and synchronize batch counts across all distributed ranks.

        Returns the minimum number of batches available on any rank (``num``
        itself without a process group). This sampler already gives every rank
        the same count; the collective is for callers that check it.
        """
        if isinstance(num, bool) or not isinstance(num, numbers.Real):
            raise bad_type("num", "a number of batches", num)
        least = math.floor(_reduce(num, "min"))
        LOG.info("gather_len_batches: %d (this rank: %s)", least, num)
        self.len_across_ranks = least
        return least

    # ----------------------------------------------------------------- resumption

    def _identity(self) -> list[Any]:
        return [type(self).__name__, self.lengths, self.batch_size, self.batch_max_len, self.drop_last,
                self.sequential, self.group_size, self.bin_size, self.oversized, self.min_batches]

    @property
    def fingerprint(self) -> str:
        """Digest of the lengths and the packing settings; a saved state only loads into an equal one."""
        return fingerprint(self._identity())

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch, plus what identifies the data, the settings, the world and the order."""
        self.generate_batches()
        return {
            "fingerprint": self.fingerprint,
            "order_fingerprint": self._cache[2],  # type: ignore[index]
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "shard": self.shard,
            "epoch": self.epoch,
            "batches_done": self._done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state``: the next iteration continues that epoch where it stopped.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: the state belongs to other data, settings, world size or
                sampler order, or has a position past the epoch's end.
        """
        if not isinstance(state, dict):
            raise bad_type("state", "a dict from MultipackBatchSampler.state_dict()", state)
        keys = {"fingerprint", "order_fingerprint", "seed", "num_replicas", "shard", "epoch", "batches_done"}
        missing = keys - set(state)
        if missing:
            raise bad_value("state", f"a dict with the keys of state_dict() (missing {sorted(missing)})", state)
        for key in ("seed", "num_replicas", "shard"):
            if state[key] != getattr(self, key):
                raise bad_value(f"state[{key!r}]", f"{getattr(self, key)!r} as in this sampler", state[key])
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"state should come from a sampler over the same lengths and packing settings (fingerprint "
                f"{self.fingerprint!r}), but got state['fingerprint']={state['fingerprint']!r}"
            )
        epoch = check_non_negative_int("state['epoch']", state["epoch"])
        done = check_non_negative_int("state['batches_done']", state["batches_done"])
        self.epoch = epoch
        batches = self.generate_batches()
        if state["order_fingerprint"] != self._cache[2]:  # type: ignore[index]
            raise ValueError(
                "state should come from a sampler that gave the same order in that epoch, but got "
                f"state['order_fingerprint']={state['order_fingerprint']!r} (now {self._cache[2]!r}): "  # type: ignore[index]
                "pass a deterministic sampler (a RandomSampler is seeded by seed and epoch)"
            )
        if done > len(batches):
            raise bad_value("state['batches_done']", f"at most {len(batches)} (the batches of epoch {epoch})", done)
        self._resume_at = self._done = done

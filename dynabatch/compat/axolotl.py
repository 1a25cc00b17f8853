"""axolotl's multipack API: ``MultipackBatchSampler`` and its packing functions, on dynabatch.

The names, argument order, defaults and return shapes of axolotl's
``MultipackBatchSampler`` (dynabatch's own packing sampler,
:class:`dynabatch.sampling.multipack.MultipackBatchSampler`, also
``dynabatch.MultipackBatchSampler``) and of its module's functions
:func:`ffd_check`, :func:`pack_group`, :func:`pack_parallel` and
:func:`allocate_sequentially`, which pack with the core's packer
(:func:`dynabatch.sampling.ffd.pack_arrays` and its compiled kernel). They
refuse a sequence longer than the bin instead of packing it alone in an
over-full bin.

``pack_group`` and ``pack_parallel`` do not pack first-fit-decreasing by
default: each group is packed first fit in a seeded shuffled order, or
longest first when that needs fewer bins (``algorithm="auto"``), so it never
needs more bins than FFD or shuffled first fit; ``algorithm="ffd"`` gives the
reference's bins exactly, ``algorithm="shuffled"`` axolotl's current first fit
in shuffled order. ``ffd_check`` is FFD, as named. Packed batches are
collated by dynabatch's :class:`~dynabatch.data.packing.PackedCollator`.

Example:
    >>> import numpy as np
    >>> from dynabatch.compat.axolotl import MultipackBatchSampler, pack_parallel
    >>> pack_parallel(np.array([2, 7, 3, 5, 9, 1]), bin_capacity=10, group_size=3, bin_size=200, algorithm="ffd")
    [[1, 2], [0], [4, 5], [3]]
    >>> bins = pack_parallel(np.array([2, 7, 3, 5, 9, 1]), bin_capacity=10, group_size=3, bin_size=200)
    >>> len(bins), sorted(i for b in bins for i in b)
    (4, [0, 1, 2, 3, 4, 5])
    >>> sampler = MultipackBatchSampler(list(range(4)), batch_size=2, batch_max_len=8,
    ...                                 lengths=np.array([5, 3, 2, 6]))
    >>> [[int(np.array([5, 3, 2, 6])[b].sum()) for b in batch] for batch in sampler]  # tokens per bin
    [[8, 8]]
"""

from __future__ import annotations

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_lengths,
    check_non_negative_int,
    check_positive_int,
)
from dynabatch.sampling._ffd_kernels import bins_to_lists, pack, sequential_offsets, shuffle_noise
from dynabatch.sampling.ffd import NO_LIMIT, check_algorithm, check_fits, check_start_method, pack_arrays
from dynabatch.sampling.multipack import MultipackBatchSampler
from dynabatch.sampling.ranks import deal

__all__ = ["MultipackBatchSampler", "allocate_sequentially", "ffd_check", "pack_group", "pack_parallel"]


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
    lengths = check_lengths("sequence_lengths", sequence_lengths)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    num_bins = check_non_negative_int("num_bins", num_bins)
    if lengths.size == 0:
        return True
    if num_bins == 0 or lengths.max() > capacity:
        return False
    return pack(lengths, capacity, lengths.size, NO_LIMIT, max_bins=num_bins, algorithm="ffd")[2] == 0


def pack_group(
    sequence_lengths: np.ndarray,
    group_offset: int,
    bin_capacity: int,
    max_bins: int,
    bin_size: int,
    safe_mode: bool = True,
    *,
    algorithm: str = "auto",
    seed: int = 0,
) -> list[list[int]]:
    """Pack a group of sequences into bins by first fit, shuffled or longest first, whichever needs fewer bins.

    The reference packed first-fit-decreasing (``algorithm="ffd"`` here). By
    default the group is packed first fit in a shuffled order (seeded by
    ``seed``), and again longest first unless the shuffled order already needs
    the fewest bins possible; the packing with fewer bins is kept (the
    shuffled one on a tie). So it never needs more bins than FFD, nor than
    shuffled first fit: FFD packs long-tailed lengths best, the shuffled
    order many very short sequences under the ``bin_size`` cap (which FFD
    leaves for last, when only new, nearly empty bins have room for them).

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
        algorithm: (dynabatch) ``"auto"`` (above), ``"ffd"`` (the reference's
            first-fit decreasing, its exact bins) or ``"shuffled"`` (first fit
            in the shuffled order only, as axolotl packs since 2025).
        seed: (dynabatch) seeds the shuffled order (a local
            ``np.random.default_rng(seed)``); the same seed gives the same bins.

    Returns:
        list[list[int]]: List of bins, where each bin contains indices of sequences
        assigned to it (``group_offset`` + position, in the order placed: longest
        first with ``"ffd"``), bins in the order they were opened.

    Raises:
        ValueError: a sequence longer than ``bin_capacity``, or (safe mode) more
            than ``max_bins`` bins needed.

    Example:
        >>> import numpy as np
        >>> pack_group(np.array([2, 7, 3, 5]), 100, bin_capacity=10, max_bins=4, bin_size=200, algorithm="ffd")
        [[101, 102], [103, 100]]
        >>> pack_group(np.array([2, 7, 3, 5]), 0, bin_capacity=10, max_bins=4, bin_size=1, algorithm="ffd")
        [[1], [3], [2], [0]]
        >>> bins = pack_group(np.array([2, 7, 3, 5]), 100, bin_capacity=10, max_bins=4, bin_size=200)
        >>> len(bins), sorted(i for b in bins for i in b)
        (2, [100, 101, 102, 103])
    """
    lengths = check_lengths("sequence_lengths", sequence_lengths)
    offset = check_non_negative_int("group_offset", group_offset)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    max_bins = check_non_negative_int("max_bins", max_bins)
    bin_size = check_positive_int("bin_size", bin_size)
    if not isinstance(safe_mode, (bool, np.bool_)):
        raise bad_type("safe_mode", "a bool", safe_mode)
    algorithm = check_algorithm(algorithm)
    seed = check_non_negative_int("seed", seed)
    check_fits("sequence_lengths", lengths, capacity)
    limit = max_bins if safe_mode else max(max_bins, lengths.size)
    flat, offsets, unplaced = pack(lengths, capacity, max(lengths.size, 1), bin_size, max_bins=limit,
                                   algorithm=algorithm, noise=shuffle_noise(lengths.size, seed))
    if unplaced:
        raise bad_value(
            "max_bins",
            f"enough bins for the group ({unplaced} of {lengths.size} sequences found no room; "
            "pass safe_mode=False to open more)",
            max_bins,
        )
    return [[i + offset for i in b] for b in bins_to_lists(flat, offsets)]


def pack_parallel(
    sequence_lengths: np.ndarray,
    bin_capacity: int,
    group_size: int,
    bin_size: int,
    num_processes: int | None = None,
    safe_mode: bool = True,
    mp_start_method: str | None = "fork",
    *,
    algorithm: str = "auto",
    seed: int = 0,
) -> list[list[int]]:
    """Pack sequences into bins using parallel processing.

    Each group of ``group_size`` consecutive sequences is packed on its own
    like :func:`pack_group` does (by default first fit, shuffled or longest
    first, whichever needs fewer bins; the reference: FFD); the bins of the
    groups follow each other in group order, so the result is the same
    whatever ``num_processes``.

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
        algorithm: (dynabatch) ``"auto"``, ``"ffd"`` (the reference's bins)
            or ``"shuffled"``, as in :func:`pack_group`.
        seed: (dynabatch) seeds the shuffled order of every group.

    Returns:
        list[list[int]]: List of bins, where each bin contains indices of sequences assigned to it.

    Example:
        >>> import numpy as np
        >>> pack_parallel(np.array([2, 7, 3, 5, 9, 1]), bin_capacity=10, group_size=3, bin_size=200, algorithm="ffd")
        [[1, 2], [0], [4, 5], [3]]
    """
    lengths = check_lengths("sequence_lengths", sequence_lengths)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    group_size = check_positive_int("group_size", group_size)
    bin_size = check_positive_int("bin_size", bin_size)
    processes = 1 if num_processes is None else check_positive_int("num_processes", num_processes)
    if not isinstance(safe_mode, (bool, np.bool_)):
        raise bad_type("safe_mode", "a bool", safe_mode)
    algorithm = check_algorithm(algorithm)
    seed = check_non_negative_int("seed", seed)
    mp_start_method = check_start_method(mp_start_method)
    check_fits("sequence_lengths", lengths, capacity)
    flat, offsets = pack_arrays(lengths, capacity, group_size, bin_size, processes, mp_start_method,
                                algorithm=algorithm, seed=seed)
    return bins_to_lists(flat, offsets)


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
    lengths = check_lengths("sequence_lengths", sequence_lengths)
    num_ranks = check_positive_int("num_ranks", num_ranks)
    rank = check_non_negative_int("rank", rank)
    if rank >= num_ranks:
        raise bad_value("rank", f"in [0, num_ranks={num_ranks})", rank)
    capacity = check_non_negative_int("bin_capacity", bin_capacity)
    cap = NO_LIMIT if bin_size is None else check_positive_int("bin_size", bin_size)
    check_fits("sequence_lengths", lengths, capacity)
    offsets = sequential_offsets(lengths, capacity, cap)
    bins = bins_to_lists(np.arange(lengths.size), offsets)
    return deal(bins, num_ranks, rank), int(lengths.sum()), (offsets.size - 1) * capacity

"""Packing sequences into bins of a token capacity: the planner of dynabatch's packed batches.

:func:`pack_arrays` packs each group of ``group_size`` sequences into bins of
at most ``capacity`` tokens and ``bin_size`` sequences, as arrays (one flat
array of indices and the bins' offsets into it, no Python list per bin). It
does not pack first-fit-decreasing by default: under the ``bin_size`` cap,
FFD leaves the shortest sequences for last and opens nearly empty bins of
``bin_size`` of them (0.90 efficiency on real short text). Each group is
packed first fit in a seeded shuffled order, or longest first when that needs
fewer bins (``algorithm="auto"``), so it never needs more bins than FFD or
shuffled first fit; ``algorithm="ffd"`` gives first-fit decreasing's bins
exactly, ``algorithm="shuffled"`` first fit in the shuffled order only. The
compiled kernel, and why each order wins where, is in
:mod:`dynabatch.sampling._ffd_kernels`.
:class:`dynabatch.sampling.multipack.MultipackBatchSampler` and
:func:`dynabatch.integrations.trl.pack_dataset` plan with it; axolotl's
packing functions (:mod:`dynabatch.compat.axolotl`) are a layer over it.

Example:
    >>> import numpy as np
    >>> flat, offsets = pack_arrays(np.array([2, 7, 3, 5, 9, 1]), 10, 3, 200, 1, None, algorithm="ffd")
    >>> [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    [[1, 2], [0], [4, 5], [3]]
"""

from __future__ import annotations

import logging
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_all_start_methods, get_context
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_choice
from dynabatch.sampling._ffd_kernels import ALGORITHMS, pack, shuffle_noise

__all__ = ["NO_LIMIT", "START_METHODS", "check_algorithm", "check_fits", "check_start_method", "pack_arrays"]

LOG = logging.getLogger(__name__)

NO_LIMIT = np.iinfo(np.int64).max


def check_fits(name: str, lengths: np.ndarray, capacity: int, hint: str = "") -> None:
    """Raises a ``ValueError`` naming the first length above ``capacity``."""
    if lengths.size and lengths.max() > capacity:
        at = int(np.argmax(lengths > capacity))
        raise bad_value(f"{name}[{at}]", f"at most the bin capacity {capacity} tokens{hint}", int(lengths[at]))


def check_algorithm(algorithm: Any) -> str:
    """Returns ``algorithm`` if it names a packing order of :data:`~dynabatch.sampling._ffd_kernels.ALGORITHMS`."""
    rule = "'auto', 'ffd' or 'shuffled'"
    if not isinstance(algorithm, str):
        raise bad_type("algorithm", rule, algorithm)
    if algorithm not in ALGORITHMS:
        raise bad_value("algorithm", rule, algorithm)
    return algorithm


START_METHODS = ("fork", "spawn", "forkserver")


def check_start_method(mp_start_method: Any) -> str | None:
    """Returns ``mp_start_method`` if it is ``None`` or a multiprocessing start method's name.

    A name this platform lacks (``"fork"`` on Windows) is accepted here: :func:`pack_arrays` warns and
    uses the default there; a name no platform has is a typo, refused before any packing.
    """
    if mp_start_method is not None:
        check_choice("mp_start_method", mp_start_method, START_METHODS)
    return mp_start_method


def _pack_chunk(args: tuple[np.ndarray, int, int, int, str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths, capacity, group_size, bin_size, algorithm, noise = args
    return pack(lengths, capacity, group_size, bin_size, algorithm=algorithm, noise=noise)[:2]


def pack_arrays(
    lengths: np.ndarray,
    capacity: int,
    group_size: int,
    bin_size: int,
    num_processes: int,
    mp_start_method: str | None,
    algorithm: str = "auto",
    seed: Any = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The bins of every group, as arrays: ``(flat, offsets)`` as :func:`~dynabatch.sampling._ffd_kernels.pack`.

    A pure function of its arguments: ``algorithm`` as in :func:`pack_group`;
    the shuffled order comes from a local ``np.random.default_rng(seed)``
    (``seed``: anything it accepts, e.g. ``[seed, epoch]``), drawn here for
    every position, so the bins do not depend on ``num_processes``.

    Example:
        >>> import numpy as np
        >>> flat, offsets = pack_arrays(np.array([6, 6, 2, 2, 4, 4]), 8, 6, 200, 1, None, seed=[0, 1])
        >>> offsets.size - 1, sorted(flat.tolist())
        (3, [0, 1, 2, 3, 4, 5])
    """
    noise = shuffle_noise(lengths.size, seed) if algorithm != "ffd" else np.empty(0)
    n_groups = -(-lengths.size // group_size)
    workers = min(num_processes, n_groups)
    if workers <= 1:
        return pack(lengths, capacity, group_size, bin_size, algorithm=algorithm, noise=noise)[:2]
    per = -(-n_groups // workers) * group_size  # whole groups per process, in order
    tasks = [(lengths[i : i + per], capacity, group_size, bin_size, algorithm, noise[i : i + per])
             for i in range(0, lengths.size, per)]
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

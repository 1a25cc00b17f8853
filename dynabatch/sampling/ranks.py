"""Ranks: the world, one reduction over it, and the one routine that deals batches to ranks in equal steps.

Every batch sampler of dynabatch and :func:`dynabatch.run` under
``torch.distributed`` share an epoch's batches among ``num_replicas`` ranks the
same way (axolotl's ``allocate_sequentially`` in :mod:`dynabatch.compat.axolotl`
only deals its bins, as axolotl's does: ranks may get different counts):

1. :func:`split_for_replicas` splits the batches holding the most samples
   until their number is a multiple of ``num_replicas`` (and at least
   ``min_batches`` per rank). A part of a batch has fewer rows, no longer row
   and no wider length spread, so it keeps every constraint the planners use;
   nothing is dropped or repeated.
2. :func:`order_steps` groups the batches in *steps* of ``num_replicas``
   consecutive batches (neighbours in the plan, so of similar lengths: under
   DDP every rank waits for the slowest), shuffles the steps when asked (the
   first step, holding the plan's first and hardest batch, stays first), and
   :func:`deal` gives rank ``r`` the ``r``-th batch of every step.

So every rank gets the same number of batches, which code with collectives
(DDP, FSDP, a gather at the end) needs: a rank that left its loop early would
leave the others waiting forever.

A batch is a 1-D array of indices, or a list of such arrays (*groups*: the bins
of a packed row, the micro-batches of an optimizer step); a grouped batch is
split between its groups first, and inside a group only when it has fewer
groups than parts.

Example:
    >>> import numpy as np
    >>> batches = split_for_replicas([np.arange(4), np.array([4])], 3)
    >>> [b.tolist() for b in batches]
    [[0, 1], [2, 3], [4]]
    >>> order = order_steps(len(batches), 3, shuffle=False, seed=0, epoch=0)
    >>> [batches[i].tolist() for i in deal(order, 3, 1)]  # rank 1's share
    [[2, 3]]
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dynabatch._validation import bad_value, check_non_negative_int, check_positive_int

__all__ = [
    "batch_samples",
    "batches_needed",
    "deal",
    "most_replicas",
    "order_steps",
    "process_group",
    "reduce_across_ranks",
    "resolve_world",
    "split_batch",
    "split_for_replicas",
]


def process_group() -> tuple[int, int] | None:
    """``(rank, world_size)`` in the initialised ``torch.distributed`` process group, or ``None``.

    Every world getter of dynabatch answers in this order: rank first, then the number of ranks.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def resolve_world(rank: int | None, num_replicas: int | None) -> tuple[int, int]:
    """``(rank, num_replicas)`` checked; a ``None`` one is the process group's (else 0 and 1).

    Example:
        >>> resolve_world(None, None), resolve_world(3, 4)
        ((0, 1), (3, 4))
        >>> resolve_world(2, 2)
        Traceback (most recent call last):
        ...
        ValueError: rank should be in [0, num_replicas=2), but got rank=2
    """
    group = process_group()
    if rank is None:
        rank = group[0] if group else 0
    if num_replicas is None:
        num_replicas = group[1] if group else 1
    num_replicas = check_positive_int("num_replicas", num_replicas)
    rank = check_non_negative_int("rank", rank)
    if rank >= num_replicas:
        raise bad_value("rank", f"in [0, num_replicas={num_replicas})", rank)
    return rank, num_replicas


def reduce_across_ranks(values: Sequence[float], op: str = "sum") -> list[float]:
    """``values`` reduced element-wise (``"sum"``, ``"min"`` or ``"max"``) over the process group's ranks.

    One float64 ``all_reduce``, on the device the group's backend takes (the
    current CUDA device under NCCL, else the CPU); without a process group
    (or with one rank) the values themselves. Every rank must call it with as
    many values.

    Example:
        >>> reduce_across_ranks([2, 3.5], "max")  # no process group here
        [2.0, 3.5]
    """
    if op not in ("sum", "min", "max"):
        raise bad_value("op", "one of 'sum', 'min', 'max'", op)
    values = [float(v) for v in values]
    group = process_group()
    if group is None or group[1] == 1:
        return values
    import torch
    import torch.distributed as dist

    from dynabatch.memory.device import backend_of

    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    device = backend_of("cuda").current() if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=ops[op])
    return tensor.tolist()


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the indices of a flat batch, summed over the groups of a grouped one."""
    if isinstance(batch, list):
        return sum(len(group) for group in batch)
    return len(batch)


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` in ``parts`` contiguous parts, each non-empty (``parts`` at most its samples).

    A flat batch is cut into near-equal runs of indices. A grouped batch keeps
    its groups whole while it has at least ``parts`` of them (contiguous runs
    of groups); with fewer, its largest groups are halved first.

    Example:
        >>> import numpy as np
        >>> [p.tolist() for p in split_batch(np.arange(5), 2)]
        [[0, 1, 2], [3, 4]]
        >>> [[g.tolist() for g in p] for p in split_batch([np.arange(3), np.array([7])], 3)]
        [[[0, 1]], [[2]], [[7]]]
    """
    if not isinstance(batch, list):
        return list(np.array_split(batch, parts))
    groups = [np.asarray(g) for g in batch if len(g)]
    while len(groups) < parts:
        at = max(range(len(groups)), key=lambda i: (len(groups[i]), -i))
        groups[at : at + 1] = np.array_split(groups[at], 2)
    bounds = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(len(groups)), parts)])
    return [groups[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def split_for_replicas(
    batches: list[Any],
    num_replicas: int,
    min_batches: int = 0,
    *,
    samples: Callable[[Any], int] = batch_samples,
    split: Callable[[Any, int], list[Any]] = split_batch,
) -> list[Any]:
    """Splits the batches with the most samples until their number is a multiple of ``num_replicas``.

    Every index stays exactly once; a batch split in ``k`` is replaced in place
    by its ``k`` parts. At most ``num_replicas - 1`` splits when the plan has at
    least ``num_replicas`` batches; more when ``min_batches`` (per replica)
    asks for more batches than the plan has.

    Args:
        batches: the plan's batches (see the module docs), or any items that
            ``samples`` counts and ``split`` cuts.
        num_replicas: the number of ranks.
        min_batches: at least this many batches per rank.
        samples: a batch's number of samples.
        split: ``split(batch, k)``: the batch in ``k`` non-empty parts.

    Raises:
        ValueError: fewer samples than batches needed (a rank would get nothing): fewer samples than
            ranks, or batches too small to split into a multiple of ``num_replicas`` (7 batches of one
            sample for 2 ranks); the message names the largest ``num_replicas`` that works.

    Example:
        >>> import numpy as np
        >>> [b.tolist() for b in split_for_replicas([np.array([0, 1, 2, 3]), np.array([4])], 3)]
        [[0, 1], [2, 3], [4]]
    """
    num_replicas = check_positive_int("num_replicas", num_replicas)
    missing = batches_needed(len(batches), num_replicas, min_batches) - len(batches)
    if len(batches) == 0 or missing == 0:
        return list(batches)
    sizes = [samples(b) for b in batches]
    total = sum(sizes)
    needed = len(batches) + missing
    if total < needed:
        # Not only fewer samples than ranks: 7 batches of one sample each cannot make 8 for 2 ranks either,
        # since batches are split (a part keeps every constraint) but never merged (a merge may break one).
        largest = most_replicas(len(batches), total, num_replicas, min_batches)
        if not largest:  # even one rank cannot have min_batches batches: the floor is what is too high
            raise bad_value("min_batches", f"at most {total // num_replicas} for {total} samples on {num_replicas} "
                            "ranks (a batch holds at least one sample)", min_batches)
        floor = f", min_batches={min_batches}" if min_batches else ""
        raise bad_value(
            "num_replicas",
            f"at most {largest} for {total} samples in {len(batches)} "
            f"batch{'es' if len(batches) > 1 else ''}: {num_replicas} ranks need {needed} batches "
            f"({needed // num_replicas} each{floor}) of at least one sample, and batches are only split, never "
            "merged or padded",
            num_replicas,
        )
    pieces = [1] * len(batches)
    # Max-heap on the samples of a batch's largest piece; ties go to the earlier batch.
    heap = [(-size, i) for i, size in enumerate(sizes)]
    heapq.heapify(heap)
    for _ in range(missing):
        while True:
            _, i = heapq.heappop(heap)
            if sizes[i] > pieces[i]:
                break
        pieces[i] += 1
        heapq.heappush(heap, ((-sizes[i]) // pieces[i], i))  # -ceil(samples / pieces)
    out: list[Any] = []
    for batch, count in zip(batches, pieces):
        out.extend(split(batch, count) if count > 1 else [batch])
    return out


def batches_needed(planned: int, num_replicas: int, min_batches: int = 0) -> int:
    """The batches :func:`split_for_replicas` makes of ``planned``: a multiple of ``num_replicas``, ``min_batches``
    each at least.

    Example:
        >>> from dynabatch.sampling.ranks import batches_needed
        >>> batches_needed(7, 2), batches_needed(3, 4, min_batches=2)
        (8, 8)
    """
    target = max(planned, min_batches * num_replicas)
    return target + (-target) % num_replicas


def most_replicas(planned: int, samples: int, num_replicas: int, min_batches: int = 0) -> int:
    """The most ranks below ``num_replicas`` that ``planned`` batches of ``samples`` samples in all can be shared
    among (:func:`split_for_replicas` only splits batches, into parts of one sample at least); 0: none.

    Example:
        >>> from dynabatch.sampling.ranks import most_replicas
        >>> most_replicas(7, 7, 2), most_replicas(3, 5, 8)  # 7 one-sample batches for 2 ranks; 5 samples, 8 ranks
        (1, 5)
    """
    return next((k for k in range(num_replicas - 1, 0, -1) if batches_needed(planned, k, min_batches) <= samples), 0)


def order_steps(num_batches: int, num_replicas: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The global batch order for an epoch: steps of ``num_replicas`` consecutive batches, steps shuffled.

    ``num_batches`` must be a multiple of ``num_replicas``. The first step
    (holding the plan's first batch) stays first; the permutation is drawn
    from ``np.random.default_rng([seed, epoch])``, never the global state.

    Example:
        >>> order_steps(6, 2, shuffle=False, seed=0, epoch=0).tolist()
        [0, 1, 2, 3, 4, 5]
        >>> order = order_steps(8, 2, shuffle=True, seed=0, epoch=3)
        >>> order[:2].tolist(), sorted(order.tolist()) == list(range(8))
        ([0, 1], True)
    """
    steps = num_batches // num_replicas
    step_order = np.arange(steps)
    if shuffle and steps > 2:
        rng = np.random.default_rng([seed, epoch])
        step_order = np.concatenate([[0], 1 + rng.permutation(steps - 1)])
    return (step_order[:, None] * num_replicas + np.arange(num_replicas)[None, :]).ravel()


def deal(items: Sequence[Any] | np.ndarray, num_replicas: int, rank: int) -> Any:
    """Rank ``rank``'s share of ``items`` dealt in steps of ``num_replicas``: items ``rank``, ``rank + num_replicas``, ...

    Example:
        >>> deal([10, 11, 12, 13, 14], 2, 1)
        [11, 13]
    """
    return items[rank::num_replicas]

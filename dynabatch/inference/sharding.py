"""Sharding a batch plan over ranks: pure functions of predicted costs (no communication).

Every rank plans the same batches from the same lengths (the planner is
deterministic), so no batch or position ever travels between ranks: each rank
calls :func:`shard_batches` with the same predicted costs and gets its own share
of batch numbers, runs them, and :func:`gather_results` brings the results to
rank 0 in input order (:mod:`dynabatch.inference.distributed` holds the collectives).

Design:

* **Equal steps.** Every rank gets exactly ``ceil(n / world_size)`` steps; a
  rank with fewer batches gets ``-1`` steps (no batch) at the end. Code run per
  step or after the loop often holds a collective (an FSDP forward gathers
  parameters, a progress ``all_reduce``, the final gather); if one rank left the
  loop early, the others would wait in that collective forever. With equal
  steps every rank reaches each collective the same number of times. At most
  ``world_size - 1`` steps are padding in the whole job.
* **Balanced by cost.** The job takes as long as its slowest rank. A plan's
  batches differ in cost (the first holds the longest texts, later batches
  have more rows of shorter texts), so dealing them out round-robin can pile up
  expensive batches on one rank. :func:`balance` runs longest-processing-time
  greedy with a count cap: batches by predicted cost, most expensive first
  (ties by batch number), each to the rank with the least total cost among the
  ranks that still have fewer than ``ceil(n / world_size)`` batches (ties by
  rank). Costs are predictions such as rows x padded width
  (:func:`batch_costs`); any non-negative figure works.
* **Plan order on each rank.** Each rank runs its batches in ascending batch
  number, i.e. in plan order: the rank holding batch 0 starts with the hardest
  batch of the job (whose peak memory is the budget), so an out-of-memory error
  shows on the first step, and every rank starts with its longest texts.
* **No communication.** The assignment depends only on the costs and the world
  size, so every rank computes the same one on its own.

Balance guarantee: with ``W`` ranks, total cost ``T`` and largest cost
``c_max``, the most loaded rank carries at most ``T / W + (1 - 1/W) * c_max``;
so :func:`imbalance` (max over mean rank load) is at most
``1 + (W - 1) * c_max / T``, and the most loaded rank is within a factor
``2 - 1/W`` of the best possible assignment. The bound is tight (one batch,
two ranks). Proof sketch: call a rank's load without its first (largest)
batch its tail. While a rank ``q`` is not full, every rank's tail stays at
most ``q``'s load (a batch goes to the least loaded open rank and is no larger
than that rank's first batch). When ``q`` fills (``k = ceil(n / W)`` batches)
with smallest batch ``y``, a rank ``p`` with ``c`` batches has
``tail(p) + (k - c) * y <= load(q)`` (pair ``p``'s batches with ``q``'s
earlier, no smaller ones), which stays true as ``p`` takes batches no larger
than ``y``. So at the end every tail is at most every load, and
``T >= (W - 1) * tail(p) + load(p)``.

Example:
    >>> from dynabatch.inference.sharding import balance, shard_batches
    >>> costs = [9, 7, 6, 5, 4, 3, 2]  # one predicted cost per batch, plan order
    >>> shard_batches(costs, world_size=2, rank=0)
    [0, 3, 5, 6]
    >>> shard_batches(costs, world_size=2, rank=1)  # same step count, -1: no batch
    [1, 2, 4, -1]
    >>> [sum(costs[b] for b in share) for share in balance(costs, 2)]
    [19, 17]
"""

from __future__ import annotations

import heapq
import logging
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_non_negative_int,
    check_positive_int,
)
from dynabatch.data.collate import padded_width

__all__ = ["balance", "batch_costs", "imbalance", "shard_batches"]

logger = logging.getLogger(__name__)

_COST_RULE = "a finite non-negative number"


def _as_costs(costs: Any) -> np.ndarray:
    rule = "a 1-D sequence of finite non-negative numbers, one per batch"
    if isinstance(costs, torch.Tensor):
        costs = costs.detach().cpu().numpy()
    if isinstance(costs, (str, bytes)) or not isinstance(costs, (Sequence, np.ndarray)):
        raise bad_type("costs", rule, costs)
    try:
        arr = np.asarray(costs)
    except ValueError:  # ragged nesting
        raise bad_value("costs", rule, costs) from None
    if arr.ndim != 1:
        raise bad_value("costs", rule, f"array of shape {arr.shape}")
    if not isinstance(costs, np.ndarray) or arr.dtype.kind not in "iuf":  # a list may hide a bool among ints
        for i, value in enumerate(costs):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise bad_type(f"costs[{i}]", _COST_RULE, value)
    arr = arr.astype(np.float64)
    bad = np.flatnonzero(~(np.isfinite(arr) & (arr >= 0)))
    if bad.size:
        i = int(bad[0])
        raise bad_value(f"costs[{i}]", _COST_RULE, float(arr[i]))
    return arr


def _assign(costs: np.ndarray, world_size: int) -> list[list[int]]:
    """Count-capped LPT greedy; each rank's batch numbers ascending."""
    n = len(costs)
    cap = -(-n // world_size)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    heap = [(0.0, r) for r in range(world_size)]  # (load, rank) of the ranks not yet full
    for b in np.argsort(-costs, kind="stable").tolist():  # most expensive first, ties by batch number
        load, r = heapq.heappop(heap)
        shares[r].append(b)
        if len(shares[r]) < cap:
            heapq.heappush(heap, (load + float(costs[b]), r))
    for share in shares:
        share.sort()
    return shares


def balance(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Returns every rank's batch numbers: ``world_size`` lists, each ascending.

    Args:
        costs: predicted cost of every batch, in plan order (e.g. rows x padded
            width, see :func:`batch_costs`); finite and non-negative.
        world_size: number of ranks.

    Returns:
        ``shares[r]``: the batches rank ``r`` runs, in plan order, at most
        ``ceil(len(costs) / world_size)`` each; every batch is in exactly one
        list. See the module docstring for the algorithm and its guarantee.

    Raises:
        TypeError: ``costs`` not a sequence of numbers, ``world_size`` not an int.
        ValueError: a cost negative or not finite, ``world_size`` < 1.

    Example:
        >>> from dynabatch.inference.sharding import balance
        >>> balance([5, 1, 1, 1, 4], 2)  # loads 5 + 1 and 1 + 1 + 4
        [[0, 2], [1, 3, 4]]
    """
    arr = _as_costs(costs)
    world_size = check_positive_int("world_size", world_size)
    return _assign(arr, world_size)


def imbalance(costs: Sequence[float], world_size: int) -> float:
    """Returns max over mean rank load of :func:`balance`'s assignment.

    1.0 is perfect balance (also returned when all costs are 0 or there are
    none); the value is at most ``1 + (world_size - 1) * max(costs) / sum(costs)``.
    It is the time the job takes relative to a perfect split, if costs are exact.

    Example:
        >>> from dynabatch.inference.sharding import imbalance
        >>> round(imbalance([9, 7, 6, 5, 4, 3, 2], 2), 4)  # loads 19 and 17
        1.0556
    """
    arr = _as_costs(costs)
    world_size = check_positive_int("world_size", world_size)
    total = float(arr.sum())
    if total == 0:
        return 1.0
    loads = [float(arr[share].sum()) for share in _assign(arr, world_size)]
    return max(loads) * world_size / total  # not / (total / W): that underflows for tiny totals


def shard_batches(costs: Sequence[float], world_size: int, rank: int) -> list[int]:
    """Returns the batch numbers ``rank`` runs, one per step; ``-1`` for a step with no batch.

    Every rank gets ``ceil(len(costs) / world_size)`` steps, its batches first
    in plan order, then ``-1`` steps. Deterministic: every rank computes the
    same assignment from the same costs without communicating.

    Args:
        costs: predicted cost of every batch, in plan order (e.g. rows x padded
            width, see :func:`batch_costs`); finite and non-negative; the same
            on every rank.
        world_size: number of ranks.
        rank: this rank, ``0 <= rank < world_size``.

    Raises:
        TypeError: ``costs`` not a sequence of numbers, ``world_size`` or
            ``rank`` not an int.
        ValueError: a cost negative or not finite, ``world_size`` < 1, ``rank``
            negative or not below ``world_size``.

    Example:
        >>> from dynabatch.inference.sharding import shard_batches
        >>> shard_batches([3.0, 2.0, 2.0], world_size=2, rank=0)
        [0, -1]
    """
    arr = _as_costs(costs)
    world_size = check_positive_int("world_size", world_size)
    rank = check_non_negative_int("rank", rank)
    if rank >= world_size:
        raise bad_value("rank", f"a non-negative integer less than world_size={world_size}", rank)
    shares = _assign(arr, world_size)
    steps = -(-len(arr) // world_size)
    mine = shares[rank]
    if logger.isEnabledFor(logging.DEBUG):
        loads = [float(arr[share].sum()) for share in shares]
        mean = sum(loads) / world_size
        logger.debug("rank %d of %d: %d of %d batches in %d steps, load %.4g, max/mean load %.4f",
                     rank, world_size, len(mine), len(arr), steps, loads[rank],
                     max(loads) / mean if mean else 1.0)
    return mine + [-1] * (steps - len(mine))


def batch_costs(batches: Sequence[Any], lengths: Any) -> list[float]:
    """Returns rows x padded width (the longest length in the batch) of every batch.

    A simple predicted cost for :func:`shard_batches`: the number of token
    slots the model processes, padding included.

    Args:
        batches: one sequence of input positions per batch (as from
            :func:`~dynabatch.sampling.planner.plan_batches`).
        lengths: the token length of every input.

    Example:
        >>> from dynabatch.inference.sharding import batch_costs
        >>> batch_costs([[1, 2], [0, 3, 4]], [3, 9, 8, 2, 2])
        [18.0, 9.0]
    """
    if isinstance(batches, (str, bytes)) or not isinstance(batches, (Sequence, np.ndarray)):
        raise bad_type("batches", "a sequence of position arrays, one per batch", batches)
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise bad_value("lengths", "a 1-D array of integer token lengths", f"array of dtype {arr.dtype} and shape "
                        f"{arr.shape}")
    out = []
    for i, batch in enumerate(batches):
        pos = np.asarray(batch, dtype=np.int64) if len(batch) else np.zeros(0, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= len(arr)):
            raise bad_value(f"batches[{i}]", f"positions in range(len(lengths)={len(arr)})", batch)
        out.append(float(len(pos) * padded_width(int(arr[pos].max()) if pos.size else 0)))
    return out

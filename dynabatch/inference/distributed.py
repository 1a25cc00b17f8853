"""Sharding a batch plan over the ranks of a ``torch.distributed`` job.

Every rank plans the same batches from the same lengths (the planner is
deterministic), so no batch or position ever travels between ranks: each rank
calls :func:`shard_batches` with the same predicted costs and gets its own share
of batch numbers, runs them, and :func:`gather_results` brings the results to
rank 0 in input order.

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
    >>> from dynabatch.inference.distributed import balance, shard_batches
    >>> costs = [9, 7, 6, 5, 4, 3, 2]  # one predicted cost per batch, plan order
    >>> shard_batches(costs, world_size=2, rank=0)
    [0, 3, 5, 6]
    >>> shard_batches(costs, world_size=2, rank=1)  # same step count, -1: no batch
    [1, 2, 4, -1]
    >>> [sum(costs[b] for b in share) for share in balance(costs, 2)]
    [19, 17]
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import numbers
import pickle
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

__all__ = ["balance", "batch_costs", "gather_results", "imbalance", "shard_batches", "world"]

logger = logging.getLogger(__name__)

_COST_RULE = "a finite non-negative number"
_FEW = 5  # how many offending positions an error message names


def world() -> tuple[int, int]:
    """Returns ``(rank, world_size)`` of the default process group.

    ``(0, 1)`` when ``torch.distributed`` is unavailable or not initialized.

    Example:
        >>> from dynabatch.inference.distributed import world
        >>> world()  # no process group in a plain process
        (0, 1)
    """
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


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
        >>> from dynabatch.inference.distributed import balance
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
        >>> from dynabatch.inference.distributed import imbalance
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
        >>> from dynabatch.inference.distributed import shard_batches
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
        >>> from dynabatch.inference.distributed import batch_costs
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
        out.append(float(len(pos) * (int(arr[pos].max()) if pos.size else 0)))
    return out


# --------------------------------------------------------------------------- gathering


def _as_positions(positions: Any) -> np.ndarray:
    rule = "a 1-D list, numpy array or tensor of int input positions"
    if isinstance(positions, torch.Tensor):
        arr = positions.detach().cpu().numpy()
    elif isinstance(positions, (list, tuple, np.ndarray, range)):
        arr = np.asarray(positions)
    else:
        raise bad_type("positions", rule, positions)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise bad_value("positions", rule, f"array of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise bad_type("positions", rule, positions)
    return arr.astype(np.int64, copy=False)


def _few(values: Sequence[Any]) -> str:
    shown = ", ".join(str(v) for v in values[:_FEW])
    return shown + (", ..." if len(values) > _FEW else "")


def _check_cover(shares: list[np.ndarray], n: int) -> None:
    """Raises ValueError unless the ranks' positions are ``range(n)``, each once."""
    ranks = np.concatenate([np.full(len(p), r, dtype=np.int64) for r, p in enumerate(shares)])
    flat = np.concatenate(shares) if shares else np.zeros(0, dtype=np.int64)
    where = " across ranks" if len(shares) > 1 else ""
    outside = np.flatnonzero((flat < 0) | (flat >= n))
    if outside.size:
        names = [f"{int(flat[i])} (rank {int(ranks[i])})" for i in outside[:_FEW + 1]]
        raise ValueError(f"positions should be in range(n_inputs={n}), but got {outside.size} outside it "
                         f"(first few: {_few(names)})")
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    counts = np.bincount(flat, minlength=n)
    repeated = np.flatnonzero(counts > 1)
    if repeated.size:
        names = []
        for p in repeated[:_FEW + 1].tolist():
            lo, hi = np.searchsorted(ordered, [p, p + 1])
            names.append(f"{p} (ranks {sorted(ranks[order[lo:hi]].tolist())})")
        raise ValueError(f"positions should each be computed exactly once{where}, but got {repeated.size} "
                         f"computed more than once (first few: {_few(names)})")
    missing = np.flatnonzero(counts == 0)
    if missing.size:
        raise ValueError(f"positions should cover range(n_inputs={n}){where}, but got {missing.size} missing "
                         f"(first few: {_few(missing[:_FEW + 1].tolist())})")


def _check_local(positions: Any, results: Any, n_inputs: Any) -> tuple[np.ndarray, int]:
    n = check_non_negative_int("n_inputs", n_inputs)
    pos = _as_positions(positions)
    if not isinstance(results, (list, tuple)):
        raise bad_type("results", "a list with one result per position", results)
    if len(results) != len(pos):
        raise bad_value("len(results)", f"len(positions)={len(pos)}, one result per position", len(results))
    return pos, n


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _prepare(positions: Any, results: Any, n_inputs: Any) -> tuple[tuple, bytes | None, Exception | None]:
    """``(payload for every rank, pickled results, local error)``; never raises.

    The payload holds ``(positions, n_inputs, None)``, or ``(None, None, (error
    class, message))`` for a local problem, which every rank then raises.
    """
    try:
        pos, n = _check_local(positions, results, n_inputs)
    except Exception as exc:  # noqa: BLE001 (sent to every rank and raised there)
        kind = next((k for k in (TypeError, ValueError) if isinstance(exc, k)), RuntimeError)
        message = str(exc) if kind is not RuntimeError else f"{type(exc).__name__}: {exc}"
        return (None, None, (kind, message)), None, exc
    try:
        blob = pickle.dumps([_to_cpu(value) for value in results], protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 (sent to every rank and raised there)
        message = f"results should be picklable to send to rank 0, but got {type(exc).__name__}: {exc}"
        return (None, None, (TypeError, message)), None, exc
    return (pos, n, None), blob, None


def gather_results(positions: list[int], results: list, n_inputs: int) -> list | None:
    """Collective: brings every rank's results to rank 0, in input order.

    Every rank of the default process group must call it (it is a collective).
    Each passes the input positions it computed and their results, item ``i``
    of ``results`` belonging to ``positions[i]``. Positions are first shared
    with every rank (``all_gather_object``), so every rank checks them and all
    raise the same error together instead of some hanging; then results go to
    rank 0 only (``gather_object``). Results must be picklable; tensors among
    them are detached and moved to the CPU before sending (tensor results all
    come back on the CPU under a process group of more than one rank). With
    NCCL, set each rank's device (``torch.cuda.set_device``) first, as
    ``torch.distributed``'s object collectives require. Without a process group
    (or with one rank) it only checks and reorders, without communicating.

    Args:
        positions: the input positions this rank computed (list, numpy array
            or tensor of int).
        results: one result per position, same order.
        n_inputs: number of inputs of the whole job (the same on every rank).

    Returns:
        On rank 0, a list of ``n_inputs`` results: item ``p`` is the result
        for input position ``p``. ``None`` on the other ranks.

    Raises:
        TypeError: an argument of the wrong type, or results that cannot be
            pickled, on some rank (every rank raises; the message names the rank).
        ValueError: ``results`` and ``positions`` of different lengths, or
            ``n_inputs`` differs between ranks, or the positions over all
            ranks are not each of ``range(n_inputs)`` exactly once (the
            message says how many are out of range, repeated or missing, and
            names the first few).

    Example:
        >>> from dynabatch.inference.distributed import gather_results
        >>> gather_results([2, 0, 1], ["c", "a", "b"], 3)  # one process: just reorders
        ['a', 'b', 'c']
    """
    rank, size = world()
    if size == 1:
        pos, n = _check_local(positions, results, n_inputs)
        _check_cover([pos], n)
        out: list = [None] * n
        for p, value in zip(pos.tolist(), results):
            out[p] = value
        return out

    dist = torch.distributed
    # Every local problem travels in the first collective, so that all ranks raise together rather than
    # one raising and the others waiting for it forever; results are pickled up front for the same reason.
    payload, blob, local_error = _prepare(positions, results, n_inputs)
    everyone: list = [None] * size
    dist.all_gather_object(everyone, payload)
    for r, (_, _, error) in enumerate(everyone):
        if error is not None:
            kind, message = error
            raise kind(f"{message} (on rank {r} of {size})") from (local_error if r == rank else None)
    ns = [n for _, n, _ in everyone]
    if len(set(ns)) > 1:
        other = next(r for r, n in enumerate(ns) if n != ns[0])
        raise ValueError(f"n_inputs should be the same on every rank, but got n_inputs={ns[other]} on rank "
                         f"{other} and n_inputs={ns[0]} on rank 0")
    n = ns[0]
    shares = [pos for pos, _, _ in everyone]
    _check_cover(shares, n)

    gathered: list | None = [None] * size if rank == 0 else None
    dist.gather_object(blob, gathered, dst=0)
    if rank != 0:
        return None
    out = [None] * n
    for pos, data in zip(shares, gathered):
        for p, value in zip(pos.tolist(), pickle.loads(data)):
            out[p] = value
    logger.debug("gathered %d results from %d ranks", n, size)
    return out


def _check_same_batches(batches: Sequence[np.ndarray]) -> None:
    """Collective: raises the same ``ValueError`` on every rank unless all ranks hold the same batches.

    :func:`dynabatch.run` shards the batches across ranks itself, so each rank
    must be given all of them (the same loader); a per-rank share would be
    sharded twice. Compares a sha256 of every batch's input positions.
    """
    _, size = world()
    if size == 1:
        return
    digest = hashlib.sha256()
    for positions in batches:
        arr = np.ascontiguousarray(positions, dtype=np.int64)
        digest.update(len(arr).to_bytes(8, "little"))
        digest.update(arr.tobytes())
    everyone: list = [None] * size
    torch.distributed.all_gather_object(everyone, (len(batches), digest.hexdigest()))
    other = next((r for r, mine in enumerate(everyone) if mine != everyone[0]), None)
    if other is not None:
        raise ValueError(
            "loader should yield the same batches on every rank (run shards them across the ranks itself), but "
            f"got {everyone[other][0]} batches on rank {other} and {everyone[0][0]} on rank 0 that differ; pass "
            "every rank the whole loader, not its own share"
        )

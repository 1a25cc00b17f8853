"""The shared base of the training batch samplers: order, epochs, resumption and sharding.

A strategy supplies one pure function, :meth:`PlannedBatchSampler.plan`: the
batches (arrays of dataset indices) covering the whole dataset for an epoch,
deterministic for ``(seed, epoch)``. This base turns that plan into a
``torch.utils.data.Sampler`` of batches:

* **Order.** With ``shuffle=True`` the batch order is a seeded permutation per
  epoch (``np.random.default_rng([seed, epoch])``, never the global state).
  The plan's first batch stays first, so a planner that puts its heaviest batch
  there shows an out-of-memory error at step 1 rather than an hour in.
* **Sharding with equal counts** (like ``DistributedSampler``: ``num_replicas``
  and ``rank`` default to the process group when one is initialised). If the
  plan's ``B`` batches are not a multiple of ``num_replicas``, the batches with
  the most rows are split in halves (contiguous halves, so a length-sorted
  batch gives two length-sorted batches) until they are. Splitting keeps every
  index exactly once and keeps every constraint the planners use (a part of a
  batch has no more rows, no longer row and no wider length spread). Nothing is
  dropped or repeated; a dataset with fewer samples than ranks is refused. The
  batches are then dealt in *steps* of ``num_replicas`` consecutive planned
  batches (neighbours in the plan, so of similar lengths: under DDP every rank
  waits for the slowest); the steps are what gets shuffled, and rank ``r``
  takes the ``r``-th batch of every step.
* **Resumption** (:class:`dynabatch.sampling.passes.EpochPasses`, shared with
  the multipack sampler). :meth:`state_dict` records the epoch and the batches handed
  out so far plus a fingerprint of the data and settings;
  :meth:`load_state_dict` continues that epoch exactly where it stopped, and
  refuses a state saved for other data, settings or world size.

``set_min_batches(n)`` makes every epoch at least ``n`` batches per rank (more
splits): for a loop that fixes the steps per epoch from the first epoch's
``len()`` (the HF ``Trainer``) while a plan's batch count varies by epoch.

``shard=False`` yields every rank's batches, step by step (the batch for rank
0, then rank 1, ...), a multiple of ``num_replicas`` in all: what a wrapper
that deals batch ``i`` to rank ``i % num_replicas`` needs (accelerate's
``BatchSamplerShard``, which ``Accelerator.prepare`` and the HF ``Trainer``
put in front of a custom batch sampler). Each rank then gets exactly the
batches ``shard=True`` would give it.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.base import PlannedBatchSampler
    >>> class Pairs(PlannedBatchSampler):
    ...     def plan(self, epoch):
    ...         return [np.array([i, i + 1]) for i in range(0, 10, 2)]
    ...     def identity(self):
    ...         return ("pairs", 10)
    >>> rank0 = Pairs(num_replicas=2, rank=0, seed=1)
    >>> rank1 = Pairs(num_replicas=2, rank=1, seed=1)
    >>> len(rank0), len(rank1)  # 5 batches -> one split -> 6, three per rank
    (3, 3)
    >>> sorted(i for b in list(rank0) + list(rank1) for i in b)
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    >>> it = iter(rank0); first = next(it)
    >>> state = rank0.state_dict()
    >>> resumed = Pairs(num_replicas=2, rank=0, seed=1)
    >>> resumed.load_state_dict(state)
    >>> list(resumed) == list(it)
    True
"""

from __future__ import annotations

import heapq
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import Sampler

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_non_negative_int,
    check_positive_int,
)
from dynabatch.sampling.passes import EpochPasses, fingerprint, resolve_world

__all__ = ["PlannedBatchSampler", "fingerprint", "order_steps", "split_for_replicas"]

logger = logging.getLogger(__name__)


def split_for_replicas(batches: list[np.ndarray], num_replicas: int, min_batches: int = 0) -> list[np.ndarray]:
    """Splits the batches with the most rows until their number is a multiple of ``num_replicas``.

    Every index stays exactly once; a batch split in ``k`` is replaced in place
    by its ``k`` contiguous parts. At most ``num_replicas - 1`` splits when the
    plan has at least ``num_replicas`` batches; more when ``min_batches`` (per
    replica) asks for more batches than the plan has.

    Raises:
        ValueError: fewer indices than ``num_replicas`` (a rank would get nothing).

    Example:
        >>> import numpy as np
        >>> [b.tolist() for b in split_for_replicas([np.array([0, 1, 2, 3]), np.array([4])], 3)]
        [[0, 1], [2, 3], [4]]
    """
    num_replicas = check_positive_int("num_replicas", num_replicas)
    target = max(len(batches), min_batches * num_replicas)
    missing = target + (-target) % num_replicas - len(batches)
    if len(batches) == 0 or missing == 0:
        return list(batches)
    total = sum(len(b) for b in batches)
    if total < len(batches) + missing:
        raise bad_value(
            "num_replicas",
            f"at most the number of samples ({total}) so that every rank gets {missing + len(batches)} "
            f"batches in all",
            num_replicas,
        )
    pieces = [1] * len(batches)
    # Max-heap on the rows of a batch's largest piece; ties go to the earlier batch.
    heap = [(-len(b), i) for i, b in enumerate(batches)]
    heapq.heapify(heap)
    for _ in range(missing):
        while True:
            _, i = heapq.heappop(heap)
            if len(batches[i]) > pieces[i]:
                break
        pieces[i] += 1
        heapq.heappush(heap, ((-len(batches[i])) // pieces[i], i))  # -ceil(rows / pieces)
    out: list[np.ndarray] = []
    for batch, count in zip(batches, pieces):
        out.extend(np.array_split(batch, count) if count > 1 else [batch])
    return out


def order_steps(num_batches: int, num_replicas: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The global batch order for an epoch: steps of ``num_replicas`` consecutive batches, steps shuffled.

    ``num_batches`` must be a multiple of ``num_replicas``. The first step
    (holding the plan's first batch) stays first.

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


class PlannedBatchSampler(EpochPasses, Sampler[list[int]], ABC):
    """Base of the batch samplers over a pure plan: order, epochs, ``state_dict`` and sharding.

    Subclasses implement :meth:`plan` and :meth:`identity`.

    Args:
        shuffle: permute the batch order (by steps, see the module docs) every
            epoch, keeping the plan's first batch first.
        seed: seeds the permutation together with the epoch (and whatever
            randomness the plan uses); the global random state is never touched.
        num_replicas: number of ranks; defaults to the world size of the
            initialised process group, else 1.
        rank: this rank; defaults to the rank in the process group, else 0.
        shard: ``True`` yields this rank's batches; ``False`` yields every rank's
            batches step by step, for a wrapper that deals them out round-robin
            (accelerate / HF ``Trainer``).

    ``len(sampler)`` is the number of batches this rank gets in the current
    epoch (equal on every rank). Call :meth:`set_epoch` before each epoch.

    ``state_dict()`` counts the batches handed out by the sampler. A DataLoader
    with worker processes asks for batches ahead of the ones your loop has
    consumed; to resume exactly, save with ``num_workers=0`` or set
    ``state["batches_done"]`` to the number of batches your loop consumed.
    """

    _compared_state = ("shuffle", "seed", "num_replicas", "shard", "min_batches")
    _state_defaults: ClassVar[dict[str, Any]] = {"min_batches": 0}  # states saved before min_batches existed
    _differ_hint = ": the lengths, the constraint or the planning arguments differ"

    def __init__(
        self,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shard: bool = True,
    ) -> None:
        for name, value in (("shuffle", shuffle), ("shard", shard)):
            if not isinstance(value, bool):
                raise bad_type(name, "a bool", value)
        self.shuffle = shuffle
        self.shard = shard
        self.seed = check_non_negative_int("seed", seed)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self._start_epochs()
        self._cache: tuple[int, list[np.ndarray]] | None = None

    @abstractmethod
    def plan(self, epoch: int) -> list[np.ndarray]:
        """The batches (1-D integer arrays of dataset indices) of the whole dataset for ``epoch``.

        Must be deterministic for ``(self.seed, epoch)`` and identical on every
        rank; every index the epoch covers appears exactly once. Put the batch
        that needs the most memory first.
        """

    @abstractmethod
    def identity(self) -> Iterable[Any]:
        """What the plan depends on (lengths arrays, settings): hashed into :attr:`fingerprint`."""

    def epoch_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The batches this sampler yields in ``epoch`` (default: the current one), in order."""
        epoch = self.epoch if epoch is None else check_non_negative_int("epoch", epoch)
        if self._cache is None or self._cache[0] != epoch:
            planned = [np.asarray(b, dtype=np.int64) for b in self.plan(epoch)]
            planned = split_for_replicas(planned, self.num_replicas, self.min_batches)
            order = order_steps(len(planned), self.num_replicas, shuffle=self.shuffle, seed=self.seed, epoch=epoch)
            if self.shard:
                order = order[self.rank :: self.num_replicas]
            self._cache = (epoch, [planned[i] for i in order.tolist()])
        return self._cache[1]

    def _current_batches(self, for_pass: bool = False) -> list[np.ndarray]:
        return self.epoch_batches()

    def _output(self, batch: np.ndarray) -> list[int]:
        return batch.tolist()

    def _extra_state(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle, "min_batches": self.min_batches}

"""The inference loader's batch sampler: a prebuilt plan on the one sampler base.

The plan (batches of input positions, from :func:`dynabatch.sampling.planner.plan_batches`)
is fixed; the base (:class:`~dynabatch.sampling.base.PlannedBatchSampler`)
decides the order the batches are handed out in and which rank gets which.
With ``shuffle=True`` the order is a seeded permutation per epoch that keeps the
first, hardest batch first, so an out-of-memory error shows at once rather than
an hour in. ``state_dict``/``load_state_dict`` resume mid-epoch, and refuse a
state saved for another plan. It does not shard unless asked
(``num_replicas=None`` takes the process group's world).

Example:
    >>> from dynabatch.sampling.inference_sampler import DynamicBatchSampler
    >>> sampler = DynamicBatchSampler([[4, 2], [0], [1, 3]], shuffle=True, seed=0)
    >>> list(sampler)[0], len(sampler)
    ([4, 2], 3)
    >>> it = iter(sampler); _ = next(it)
    >>> state = sampler.state_dict()
    >>> resumed = DynamicBatchSampler([[4, 2], [0], [1, 3]], shuffle=True, seed=0)
    >>> resumed.load_state_dict(state)
    >>> list(resumed) == list(it)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dynabatch._validation import bad_type
from dynabatch.sampling.base import PlannedBatchSampler

__all__ = ["DynamicBatchSampler", "StreamingBatchSampler"]


class DynamicBatchSampler(PlannedBatchSampler):
    """Yields the planned batches (lists of input positions), in plan order or shuffled.

    Args:
        batches: the plan: one sequence of input positions per batch, hardest first.
        shuffle: permute the batch order every epoch, keeping batch 0 first.
        seed: seeds the permutation (with the epoch); the global random state
            is never touched.
        num_replicas, rank: share the plan among ranks (every rank the same
            number of batches, see :mod:`dynabatch.sampling.ranks`); the default
            ``1`` and ``0`` hand out every batch; ``None`` takes the process group's.
        shard: see :class:`~dynabatch.sampling.base.PlannedBatchSampler`.

    ``len(sampler)`` is the number of batches. With ``shuffle=True`` call
    :meth:`set_epoch` before each epoch for a new order.

    ``state_dict()`` records the batches handed out so far in the current
    epoch. A DataLoader with worker processes asks for batches ahead of the
    ones your loop has consumed; to resume exactly, save the state with
    ``num_workers=0`` or correct ``state["batches_done"]`` to the number you
    consumed.

    A sampler made by :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader`
    also carries the loader's plan as ``sampler.loader_plan`` (found under
    wrappers such as ``accelerate``'s), else ``None``.
    """

    _same_what = "plan"
    _differ_hint = ": the texts, tokenizer or planning arguments differ"

    def __init__(self, batches: Sequence[Sequence[int]], *, shuffle: bool = False, seed: int = 0,
                 num_replicas: int | None = 1, rank: int | None = 0, shard: bool = True) -> None:
        if isinstance(batches, (str, bytes)) or not hasattr(batches, "__len__"):
            raise bad_type("batches", "a sequence of sequences of input positions", batches)
        super().__init__(shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank, shard=shard)
        self.batches = [np.asarray(b, dtype=np.int64).reshape(-1) for b in batches]
        self.loader_plan: Any = None

    def plan(self, epoch: int) -> list[np.ndarray]:
        return self.batches

    def identity(self) -> list[Any]:
        batches = self.plan(0)
        return [np.asarray([len(b) for b in batches], dtype=np.int64),
                np.concatenate(batches) if batches else np.zeros(0, np.int64)]


class StreamingBatchSampler(DynamicBatchSampler):
    """The streaming loader's batch sampler: the plan of a :class:`~dynabatch.sampling.chunked_planner.ChunkedPlanner`,
    handed out chunk by chunk as each is tokenized.

    A pass from the start yields each batch as soon as its chunk is planned;
    ``len``, ``state_dict`` and a resumed pass plan the whole corpus first (as
    :class:`DynamicBatchSampler` over the complete plan).
    """

    def __init__(self, planner: Any) -> None:
        super().__init__([])
        self.planner = planner

    def plan(self, epoch: int) -> list[np.ndarray]:
        return self.planner.batches()

    def __iter__(self) -> Any:
        if self._resume_at or self.min_batches or self.num_replicas != 1:
            return super().__iter__()
        self._done = 0
        return self._hand_out(self.planner.iter_batches())

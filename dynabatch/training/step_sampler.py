"""Optimizer steps of micro-batches: a planned sampler's batches grouped into steps of a target size.

:class:`StepBatchSampler` groups the micro-batches of any
:class:`~dynabatch.sampling.base.PlannedBatchSampler` into optimizer steps of
at least ``target_batch_size`` samples, each yielded as one list with the
micro-batches separated by :data:`STEP_SEPARATOR`; :func:`split_step` cuts it
back into micro-batches.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.smart import SmartBatchSampler
    >>> from dynabatch.sampling.constraints import FixedBatchSize
    >>> micro = SmartBatchSampler(np.arange(1, 11), FixedBatchSize(2), shuffle=False)
    >>> steps = StepBatchSampler(micro, target_batch_size=4)
    >>> list(steps)  # STEP_SEPARATOR (-1) between micro-batches; the last step may hold fewer samples
    [[9, 8, -1, 7, 6], [5, 4, -1, 3, 2], [1, 0]]
    >>> split_step(next(iter(steps)))
    [[9, 8], [7, 6]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, check_positive_int
from dynabatch.sampling.base import PlannedBatchSampler

__all__ = ["STEP_SEPARATOR", "StepBatchSampler", "split_step"]

STEP_SEPARATOR = -1
"""Marks the end of a micro-batch inside a :class:`StepBatchSampler` step."""


class StepBatchSampler(PlannedBatchSampler):
    """Groups a sampler's micro-batches into optimizer steps of at least ``target_batch_size`` samples.

    Each yielded list is one step: the micro-batches' indices separated by
    :data:`STEP_SEPARATOR`. The last step of an epoch may hold fewer samples.
    A step is a grouped batch of the base (its micro-batches are the groups):
    order, resumption and ranks act on whole steps, and a step split to give
    every rank the same number is split between micro-batches first.
    """

    def __init__(self, micro: PlannedBatchSampler, target_batch_size: int | None) -> None:
        if not isinstance(micro, PlannedBatchSampler):
            raise bad_type("micro", "a PlannedBatchSampler", micro)
        super().__init__(
            shuffle=micro.shuffle, seed=micro.seed, num_replicas=micro.num_replicas, rank=micro.rank, shard=micro.shard
        )
        self.micro = micro
        self.target_batch_size = None if target_batch_size is None else check_positive_int(
            "target_batch_size", target_batch_size
        )

    def plan(self, epoch: int) -> list[list[np.ndarray]]:
        steps: list[list[np.ndarray]] = []
        current: list[np.ndarray] = []
        rows = 0
        for batch in self.micro.plan(epoch):
            current.append(np.asarray(batch, dtype=np.int64))
            rows += len(batch)
            if self.target_batch_size is None or rows >= self.target_batch_size:
                steps.append(current)
                current, rows = [], 0
        if current:
            steps.append(current)
        return steps

    def identity(self) -> list[Any]:
        return [self.micro.fingerprint, self.target_batch_size]

    def _output(self, batch: list[np.ndarray]) -> list[int]:
        sep = np.array([STEP_SEPARATOR], dtype=np.int64)
        return np.concatenate([p for group in batch for p in (group, sep)][:-1]).tolist()


def split_step(indices: Sequence[int]) -> list[list[int]]:
    """The micro-batches of a step from :class:`StepBatchSampler` (empty ones dropped)."""
    out: list[list[int]] = [[]]
    for i in indices:
        if i == STEP_SEPARATOR:
            out.append([])
        else:
            out[-1].append(int(i))
    return [b for b in out if b]

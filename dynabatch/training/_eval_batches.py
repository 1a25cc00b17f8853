"""Evaluation and prediction batches for the HF ``Trainer`` hook: planned longest first, sized from measured peaks.

:class:`EvalBatchSampler` hands out the inference planner's batches one at a
time (:class:`~dynabatch.sampling.planner.BatchPlanner` in measured mode, as
``dynabatch.run`` does): the ``batch_size`` longest rows first, and every later
batch as many rows as the peaks measured so far keep under the first batch's.
The hook runs each prediction step inside :meth:`EvalBatchSampler.measuring`,
which measures it on the device (:func:`~dynabatch.memory.measure.track_peak_memory`;
on the CPU only the steps whose measurement could let later batches grow,
:meth:`~dynabatch.memory.feedback.MemoryFeedback.should_measure`) and tells
the planner. The ``Trainer`` gathers predictions in the order the batches
come; :func:`in_order` takes them back to dataset order.

It is not a :class:`~dynabatch.sampling.base.PlannedBatchSampler`: its batches
depend on what was measured, so there is no plan to replay per ``(seed, epoch)``,
and evaluation needs none.

Example:
    >>> import numpy as np, torch
    >>> sampler = EvalBatchSampler(np.array([3, 9, 5, 1]), batch_size=2, device="cpu")
    >>> batches = iter(sampler)
    >>> first = next(batches); first.tolist()  # the two longest first
    [1, 2]
    >>> with sampler.measuring(rows=2, width=9):  # a prediction step, measured: its peak is the budget
    ...     logits = torch.ones(2, 9, 64) * 2
    >>> [b.tolist() for b in batches], sampler.measured_calls
    ([[0, 3]], 1)
    >>> order = sampler.order()
    >>> in_order(np.array([30, 90, 50, 10])[order], np.argsort(order)).tolist()
    [30, 90, 50, 10]
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from dynabatch._validation import check_lengths
from dynabatch.memory.device import measurable
from dynabatch.memory.measure import track_peak_memory
from dynabatch.memory.shape import ModelShape
from dynabatch.sampling.planner import BatchPlanner, PlanSettings

__all__ = ["EvalBatchSampler", "eval_lengths", "in_order"]

logger = logging.getLogger(__name__)


def eval_lengths(dataset: Any, field: str) -> np.ndarray | None:
    """Each row's length of ``field`` (Arrow offsets for a ``datasets.Dataset``); ``None`` when rows have no such field."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        if field not in columns:
            return None
        from dynabatch.data.sources import _list_lengths

        return _list_lengths(dataset, field)
    try:
        first = dataset[0] if len(dataset) else None
    except (TypeError, KeyError, IndexError):
        return None
    if not isinstance(first, Mapping) or field not in first:
        return None
    return check_lengths(f"len(eval_dataset[i][{field!r}])",
                         np.fromiter((len(dataset[i][field]) for i in range(len(dataset))), np.int64, len(dataset)))


class EvalBatchSampler(Sampler):
    """Evaluation batches of row positions, longest first, each sized from the peaks measured before it.

    Args:
        lengths: each row's length (dataset order).
        batch_size: rows of the first (longest, hardest) batch.
        model_shape: what the planner may know of the model and the call (its plan before any peak is measured).
        device: where the prediction steps run. A device whose memory cannot
            be measured (or ``None``): the planner's plan as it is.

    Attributes:
        planner: the :class:`~dynabatch.sampling.planner.BatchPlanner`; its
            :meth:`~dynabatch.sampling.planner.BatchPlanner.batches` is the plan before any measurement.
        measured_calls: how many prediction steps of the last pass were measured.

    A loader may ask for batches ahead of the steps that run them (accelerate
    looks one batch ahead; worker processes prefetch): a batch asked for
    before the first batch's peak is measured has at most the first batch's
    rows. Rows no longer than the first batch's, no more of them: no more
    memory than the first batch, whatever the plan said.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, model_shape: ModelShape | None = None,
                 device: Any = None) -> None:
        longest = max(1, int(lengths.max())) if lengths.size else 1
        self.planner = BatchPlanner(lengths, PlanSettings(batch_size, longest, model_shape=model_shape))
        self.device = torch.device(device) if device is not None and measurable(device) else None
        self.measured_calls = 0
        self._handed_out: list[np.ndarray] = []

    def __iter__(self) -> Iterator[np.ndarray]:
        planner, measured = self.planner, self.device is not None
        planner.restart(sparse=measured and self.device.type == "cpu")  # the CPU tracker's cost: sparse
        self._handed_out, self.measured_calls = [], 0
        start, last, total = 0, None, len(planner.sorted_lengths)
        while start < total:
            size = planner.next_size(start, last)
            if measured and self._handed_out and planner.feedback.budget is None:
                size = min(size, len(self._handed_out[0]))  # asked for ahead of the first batch's peak
            batch = planner.order[start : start + size]
            self._handed_out.append(batch)
            start, last = start + size, size
            yield batch

    @contextlib.contextmanager
    def measuring(self, rows: int, width: int) -> Iterator[None]:
        """Runs a prediction step of ``rows`` rows padded to ``width``; measured when it could let later batches grow."""
        if self.device is None or not self.planner.feedback.should_measure(rows, width):
            yield
            return
        with track_peak_memory(self.device) as memory:
            yield
        self.measured_calls += 1
        self.planner.observe(rows, width, memory.peak_bytes)

    def order(self) -> np.ndarray:
        """The row positions in the order the last pass handed them out."""
        return np.concatenate(self._handed_out) if self._handed_out else np.zeros(0, dtype=np.int64)


def in_order(value: Any, inverse: np.ndarray) -> Any:
    """``value`` (an array or a tuple, list or dict of them, one row per yielded row) back in dataset order."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return value[inverse] if value.ndim and len(value) == len(inverse) else value
    if isinstance(value, (tuple, list)):
        return type(value)(in_order(v, inverse) for v in value)
    if isinstance(value, Mapping):
        return {key: in_order(v, inverse) for key, v in value.items()}
    return value

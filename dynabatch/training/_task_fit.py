"""What :class:`~dynabatch.training.predictor.MemoryPredictor` fits and reads: one task's measured peaks.

``_TaskFit`` keeps the measured peaks of one (task, mode) and fits a
:class:`~dynabatch.memory.model.MemoryModel` to them; :func:`batch_shape`
reads a collated batch's rows and padded length; ``_check_task`` refuses a
task type that cannot key a dict. ``batch_shape`` is importable from
``dynabatch.training.predictor``.

Example:
    >>> import torch
    >>> from dynabatch.training.predictor import batch_shape
    >>> batch_shape({"input_ids": torch.zeros(4, 16, dtype=torch.long)})
    (4, 16)
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type
from dynabatch.memory.model import MemoryModel

__all__ = ["batch_shape"]


def batch_shape(batch: Any) -> tuple[int, int]:
    """Rows and padded length of a collated batch (``input_ids`` or the first 2-D tensor)."""
    tensor = batch.get("input_ids") if isinstance(batch, dict) else None
    if tensor is None and isinstance(batch, dict):
        tensor = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if not isinstance(tensor, torch.Tensor):
        raise bad_type("batch", "a dict holding an input_ids tensor (rows x padded length)", batch)
    return int(tensor.shape[0]), int(tensor.shape[1]) if tensor.dim() > 1 else 1


class _TaskFit:
    """The measured peaks of one (task, mode), fitted by a :class:`~dynabatch.memory.model.MemoryModel`."""

    def __init__(self, device: torch.device, max_observations: int) -> None:
        self.model = MemoryModel(device=device)
        self.max_observations = max_observations

    def add(self, rows: int, length: int, peak_bytes: float) -> None:
        self.model.observe(rows, length, peak_bytes, source="measured")
        if len(self.model.probes_) > self.max_observations:
            del self.model.probes_[0]
            self.model.fit(*self.columns(), source="measured")

    def columns(self) -> tuple[list, list, list]:
        """Rows, padded lengths and peak bytes of the kept observations, oldest first."""
        probes = self.model.probes_
        return [p["rows"] for p in probes], [p["padded_length"] for p in probes], [p["peak_bytes"] for p in probes]

    @property
    def num_observations(self) -> int:
        return len(self.model.probes_)

    def predict(self, rows: Any, length: Any) -> np.ndarray:
        r, n = np.broadcast_arrays(np.asarray(rows, dtype=np.float64), np.asarray(length, dtype=np.float64))
        return self.model.predict_unchecked(r, n)

    def loo_errors(self) -> np.ndarray:
        """Leave-one-out relative errors (absolute values) of the measured points."""
        errors = np.asarray(self.model.loo_errors_, dtype=np.float64)
        return np.abs(errors[np.isfinite(errors)])


def _check_task(task_type: Any) -> None:
    if task_type is None or not isinstance(task_type, Hashable):
        raise bad_type("task_type", "a hashable task type (not None)", task_type)

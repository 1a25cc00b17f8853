"""What :class:`~dynabatch.compat.multitask.predictor.MemoryPredictor` fits: one task's measured peaks.

``TaskFit`` keeps the measured peaks of one (task, mode) and fits a
:class:`~dynabatch.memory.model.MemoryModel` to them; ``check_task`` refuses
a task type that cannot key a dict.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type
from dynabatch.memory.model import MemoryModel

__all__ = ["TaskFit", "check_task"]


class TaskFit:
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


def check_task(task_type: Any) -> None:
    if task_type is None or not isinstance(task_type, Hashable):
        raise bad_type("task_type", "a hashable task type (not None)", task_type)

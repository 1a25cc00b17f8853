"""The memory-aware multi-task training system's API, on dynabatch.

The names its quick reference documents (``memory_utils``,
``dynamic_batching``, ``memory_safety``, ``dynamic_trainer``,
``dynamic_monitoring``, ``training_example``), importable from one module:
the per-task :class:`MemoryPredictor` and :func:`estimate_training_memory`,
the :class:`MemoryAwareBatchSampler`, the :class:`HeterogeneousCollator`,
:class:`OOMGuardian` and :class:`GradientCheckpointManager`, the
:class:`DynamicBatchingTrainer`, the :class:`DynamicBatchingMonitor` and its
:class:`BatchMetrics`, and :class:`DynamicBatchingTrainingPipeline` with its
:class:`HeterogeneousTrainingConfig` (plus :class:`MultiTaskDataset`).

Memory sizes follow dynabatch's one convention: ``*_mb`` arguments are MB of
10**6 bytes and GB figures are 10**9 bytes; ``memory_margin_percent`` is a
fraction (0.10 keeps 10% free). The trainer and the pipeline load
``transformers.Trainer`` on first use.

Example:
    >>> from dynabatch.compat.multitask import MemoryPredictor
    >>> predictor = MemoryPredictor(device="cpu")
    >>> predictor.record_actual_memory("T1", 130.0, batch_size=1)  # measured peaks, in MB
    >>> predictor.record_actual_memory("T1", 250.0, batch_size=2)
    >>> round(predictor.predict_batch_memory(["T1"] * 2), 3)  # GB (10**9 bytes): 10 MB + 120 MB a row
    0.25
"""

from typing import TYPE_CHECKING

from dynabatch._lazy import lazy_attributes
from dynabatch.compat.multitask.collate import HeterogeneousCollator
from dynabatch.compat.multitask.dataset import MultiTaskDataset
from dynabatch.compat.multitask.monitor import BatchMetrics, DynamicBatchingMonitor
from dynabatch.compat.multitask.oom_guardian import GradientCheckpointManager, OOMGuardian
from dynabatch.compat.multitask.predictor import MemoryPredictor, estimate_training_memory
from dynabatch.compat.multitask.sampler import MemoryAwareBatchSampler

if TYPE_CHECKING:  # imported on first use below
    from dynabatch.compat.multitask.pipeline import DynamicBatchingTrainingPipeline, HeterogeneousTrainingConfig
    from dynabatch.compat.multitask.trainer import DynamicBatchingTrainer

__getattr__ = lazy_attributes(__name__, {  # these import transformers.Trainer (seconds): loaded on first use
    "DynamicBatchingTrainer": "dynabatch.compat.multitask.trainer",
    "DynamicBatchingTrainingPipeline": "dynabatch.compat.multitask.pipeline",
    "HeterogeneousTrainingConfig": "dynabatch.compat.multitask.pipeline",
})


__all__ = [
    "BatchMetrics",
    "DynamicBatchingMonitor",
    "DynamicBatchingTrainer",
    "DynamicBatchingTrainingPipeline",
    "GradientCheckpointManager",
    "HeterogeneousCollator",
    "HeterogeneousTrainingConfig",
    "MemoryAwareBatchSampler",
    "MemoryPredictor",
    "MultiTaskDataset",
    "OOMGuardian",
    "estimate_training_memory",
]

"""dynabatch: memory-safe dynamic batch sizes for variable-length text inference.

The public surface is listed in ``__all__``; everything else is internal.
"""

from dynabatch.data.collate import Batch, TokenCollator
from dynabatch.data.order import restore_order
from dynabatch.data.sources import TokenizedSource, read_source, tokenize_source
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts
from dynabatch.data.training_collate import TrainingCollator
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.runner import BatchOutOfMemoryError, RunResult, run
from dynabatch.memory.calibrate import calibrate
from dynabatch.memory.classifier import SpikeClassifier, load_classifier
from dynabatch.memory.features import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    ModelShape,
    compute_features,
)
from dynabatch.memory.measure import (
    PeakMemory,
    collect_cuda_peak_alloc,
    collect_peak_alloc,
    is_out_of_memory_error,
    track_peak_memory,
)
from dynabatch.memory.model import MemoryModel
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.bucket import BucketBatchSampler, Buckets, create_buckets
from dynabatch.sampling.constraints import AllOf, FixedBatchSize, LengthDifference, MemoryBudget, TokenBudget
from dynabatch.sampling.planner import BatchPlanner, PlanSettings, plan_batch_sizes, plan_batches
from dynabatch.sampling.sampler import DynamicBatchSampler
from dynabatch.sampling.size_aware import SizeAwareBatchSampler, size_aware_batching
from dynabatch.sampling.smart import SmartBatchSampler, plan_constrained
from dynabatch.training.collate import HeterogeneousCollator
from dynabatch.training.dataset import MultiTaskDataset
from dynabatch.training.guard import GradientCheckpointManager, OOMGuardian
from dynabatch.training.monitor import BatchMetrics, DynamicBatchingMonitor
from dynabatch.training.predictor import MemoryPredictor, estimate_training_memory
from dynabatch.training.sampler import MemoryAwareBatchSampler

_LAZY = {  # these import transformers.Trainer (seconds): loaded on first use
    "DynamicBatchingTrainer": "dynabatch.training.trainer",
    "DynamicBatchingTrainingPipeline": "dynabatch.training.pipeline",
    "HeterogeneousTrainingConfig": "dynabatch.training.pipeline",
    "MultipackBatchSampler": "dynabatch.sampling.multipack",  # imports numba (~0.5 s)
    "BatchSamplerTrainer": "dynabatch.training.hf",
    "BatchSamplerTrainerMixin": "dynabatch.training.hf",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dynabatch' has no attribute {name!r}")


__version__ = "0.2.0.dev0"

__all__ = [
    "FEATURE_NAMES",
    "SHAPE_FEATURE_NAMES",
    "AllOf",
    "Batch",
    "BatchMetrics",
    "BatchOutOfMemoryError",
    "BatchPlanner",
    "BatchRecord",
    "BatchSamplerTrainer",
    "BatchSamplerTrainerMixin",
    "BucketBatchSampler",
    "Buckets",
    "DynamicBatchSampler",
    "DynamicBatchingMonitor",
    "DynamicBatchingTrainer",
    "DynamicBatchingTrainingPipeline",
    "FixedBatchSize",
    "GradientCheckpointManager",
    "HeterogeneousCollator",
    "HeterogeneousTrainingConfig",
    "LengthDifference",
    "MemoryAwareBatchSampler",
    "MemoryBudget",
    "MemoryModel",
    "MemoryPredictor",
    "ModelShape",
    "MultiTaskDataset",
    "MultipackBatchSampler",
    "OOMGuardian",
    "PeakMemory",
    "PlanSettings",
    "PlannedBatchSampler",
    "RunReport",
    "RunResult",
    "SizeAwareBatchSampler",
    "SmartBatchSampler",
    "SpikeClassifier",
    "TokenBudget",
    "TokenCollator",
    "TokenizedSource",
    "TokenizedTexts",
    "TrainingCollator",
    "build_dynamic_batch_dataloader",
    "calibrate",
    "collect_cuda_peak_alloc",
    "collect_peak_alloc",
    "compute_features",
    "create_buckets",
    "estimate_training_memory",
    "is_out_of_memory_error",
    "load_classifier",
    "plan_batch_sizes",
    "plan_batches",
    "plan_constrained",
    "read_source",
    "restore_order",
    "run",
    "size_aware_batching",
    "tokenize_source",
    "tokenize_texts",
    "track_peak_memory",
]

"""dynabatch: memory-safe dynamic batch sizes for variable-length text inference.

The public surface is listed in ``__all__``; everything else is internal.
"""

from dynabatch.memory.classifier import SpikeClassifier, load_classifier
from dynabatch.data.collate import Batch, TokenCollator
from dynabatch.memory.features import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    ModelShape,
    compute_features,
)
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.data.order import restore_order
from dynabatch.sampling.planner import plan_batch_sizes, plan_batches
from dynabatch.memory.measure import (
    PeakMemory,
    collect_cuda_peak_alloc,
    collect_peak_alloc,
    is_out_of_memory_error,
    track_peak_memory,
)
from dynabatch.memory.calibrate import calibrate
from dynabatch.memory.model import MemoryModel
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.runner import BatchOutOfMemoryError, RunResult, run
from dynabatch.sampling.sampler import DynamicBatchSampler
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts

__version__ = "0.2.0.dev0"

__all__ = [
    "FEATURE_NAMES",
    "SHAPE_FEATURE_NAMES",
    "Batch",
    "BatchOutOfMemoryError",
    "BatchRecord",
    "DynamicBatchSampler",
    "MemoryModel",
    "ModelShape",
    "PeakMemory",
    "RunReport",
    "RunResult",
    "SpikeClassifier",
    "TokenCollator",
    "TokenizedTexts",
    "build_dynamic_batch_dataloader",
    "calibrate",
    "collect_cuda_peak_alloc",
    "collect_peak_alloc",
    "compute_features",
    "is_out_of_memory_error",
    "load_classifier",
    "plan_batch_sizes",
    "plan_batches",
    "restore_order",
    "run",
    "tokenize_texts",
    "track_peak_memory",
]

"""dynabatch: memory-safe dynamic batch sizes for variable-length text inference.

The public surface is listed in ``__all__``; everything else is internal.
"""

from dynabatch.classifier import SpikeClassifier, load_classifier
from dynabatch.features import FEATURE_NAMES, compute_features
from dynabatch.profiling import (
    PeakMemory,
    collect_cuda_peak_alloc,
    collect_peak_alloc,
    is_out_of_memory_error,
    track_peak_memory,
)

__version__ = "0.2.0.dev0"

__all__ = [
    "FEATURE_NAMES",
    "PeakMemory",
    "SpikeClassifier",
    "collect_cuda_peak_alloc",
    "collect_peak_alloc",
    "compute_features",
    "is_out_of_memory_error",
    "load_classifier",
    "track_peak_memory",
]

"""dynabatch: memory-safe dynamic batches for variable-length text, for inference and training.

The public surface is ``__all__``: what a user picks and touches, all of it
dynabatch's own core (``data``, ``memory``, ``sampling``, ``inference``,
``training``). The APIs of the systems dynabatch is compatible with live in
:mod:`dynabatch.compat`, one module each with its own ``__all__``:
:mod:`dynabatch.compat.axolotl` (axolotl's multipack sampler),
:mod:`dynabatch.compat.bionemo` (bionemo's size-aware and bucket batching) and
:mod:`dynabatch.compat.multitask` (the memory-aware multi-task training
system); dynabatch inside other libraries in :mod:`dynabatch.integrations`
(sentence-transformers, TRL, Ray). Everything else is reachable through its module.

The distribution is ``torch-dynabatch`` (the package index's ``dynabatch`` is
another project); importing warns once if that project is installed here too
(:mod:`dynabatch._distribution`).
"""

from dynabatch._distribution import check_installation
from dynabatch._lazy import lazy_attributes
from dynabatch.data.collate import Batch, TokenCollator
from dynabatch.data.order import restore_order
from dynabatch.data.sources import TokenizedSource, tokenize_source
from dynabatch.data.text_source import TextSource, read_texts
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts
from dynabatch.data.training_collate import TrainingCollator
from dynabatch.inference.generation import generate
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.outputs import PerRow
from dynabatch.inference.runner import BatchOutOfMemoryError, IncompleteRunError, RunResult, StoredRunResult, run
from dynabatch.inference.store_lock import StoreBusyError
from dynabatch.memory.budget import MemoryBudget
from dynabatch.memory.calibrate import calibrate
from dynabatch.memory.measure import track_peak_memory
from dynabatch.memory.model import MemoryModel
from dynabatch.memory.shape import ModelShape
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.constraints import AllOf, FixedBatchSize, LengthDifference, TokenBudget
from dynabatch.sampling.inference_sampler import DynamicBatchSampler
from dynabatch.sampling.smart import SmartBatchSampler
from dynabatch.training.memory_limit import training_budget

__getattr__ = lazy_attributes(__name__, {  # loaded on first use: numba (~0.5 s), transformers.Trainer (seconds)
    "MultipackBatchSampler": "dynabatch.sampling.multipack",
    "PackedCollator": "dynabatch.data.packing",
    "BatchSamplerTrainer": "dynabatch.training.hf",
})

check_installation()  # the package index's other "dynabatch" beside this one: said once, with what to do

__version__ = "0.2.0.dev0"

__all__ = [
    "AllOf",
    "Batch",
    "BatchOutOfMemoryError",
    "BatchSamplerTrainer",
    "DynamicBatchSampler",
    "FixedBatchSize",
    "IncompleteRunError",
    "LengthDifference",
    "MemoryBudget",
    "MemoryModel",
    "ModelShape",
    "MultipackBatchSampler",
    "PackedCollator",
    "PerRow",
    "PlannedBatchSampler",
    "RunResult",
    "SmartBatchSampler",
    "StoreBusyError",
    "StoredRunResult",
    "TextSource",
    "TokenBudget",
    "TokenCollator",
    "TokenizedSource",
    "TokenizedTexts",
    "TrainingCollator",
    "build_dynamic_batch_dataloader",
    "calibrate",
    "generate",
    "read_texts",
    "restore_order",
    "run",
    "tokenize_source",
    "tokenize_texts",
    "track_peak_memory",
    "training_budget",
]

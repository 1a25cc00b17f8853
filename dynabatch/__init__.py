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

# Every public name is imported on first use: `import dynabatch` (and so `dynabatch --help`, a bad option of the
# command line) does not pay for torch, transformers and numba (seconds) before it needs them.
_WHERE = {
    "AllOf": "dynabatch.sampling.constraints",
    "Batch": "dynabatch.data.collate",
    "BatchOutOfMemoryError": "dynabatch.inference.runner",
    "BatchSamplerTrainer": "dynabatch.training.hf",
    "build_dynamic_batch_dataloader": "dynabatch.inference.loader",
    "calibrate": "dynabatch.memory.calibrate",
    "DynamicBatchSampler": "dynabatch.sampling.inference_sampler",
    "FixedBatchSize": "dynabatch.sampling.constraints",
    "generate": "dynabatch.inference.generation",
    "IncompleteRunError": "dynabatch.inference.runner",
    "LengthDifference": "dynabatch.sampling.constraints",
    "MemoryBudget": "dynabatch.memory.budget",
    "MemoryModel": "dynabatch.memory.model",
    "ModelShape": "dynabatch.memory.shape",
    "MultipackBatchSampler": "dynabatch.sampling.multipack",
    "PackedCollator": "dynabatch.data.packing",
    "PerRow": "dynabatch.inference.outputs",
    "PlannedBatchSampler": "dynabatch.sampling.base",
    "RankFailedError": "dynabatch.inference.distributed",
    "read_texts": "dynabatch.data.corpus",
    "restore_order": "dynabatch.data.order",
    "run": "dynabatch.inference.runner",
    "RunResult": "dynabatch.inference.runner",
    "SmartBatchSampler": "dynabatch.sampling.smart",
    "StoreBusyError": "dynabatch.inference.store_lock",
    "StoredRunResult": "dynabatch.inference.runner",
    "TextSource": "dynabatch.data.text_source",
    "TokenBudget": "dynabatch.sampling.constraints",
    "TokenCollator": "dynabatch.data.collate",
    "tokenize_source": "dynabatch.data.sources",
    "tokenize_texts": "dynabatch.data.tokenization",
    "TokenizedSource": "dynabatch.data.sources",
    "TokenizedTexts": "dynabatch.data.tokenization",
    "track_peak_memory": "dynabatch.memory.measure",
    "training_budget": "dynabatch.training.memory_limit",
    "TrainingCollator": "dynabatch.data.training_collate",
}
__getattr__ = lazy_attributes(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


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
    "RankFailedError",
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

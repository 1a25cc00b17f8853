"""bionemo's size-aware batching API (``bionemo.size_aware_batching``), on dynabatch.

The names, arguments, defaults, errors and documented outputs of bionemo's
``collect_cuda_peak_alloc``, ``create_buckets``, ``Buckets``,
``size_aware_batching``, ``SizeAwareBatchSampler`` and ``BucketBatchSampler``
(its ``utils`` and ``sampler`` modules), plus dynabatch's bridge from a
calibrated memory model to them: :func:`fit_memory_model`,
:class:`MemorySizeof` and :func:`bucket_memory_kwargs` (each consults a
:class:`~dynabatch.memory.budget.MemoryBudget`), and
:func:`collect_peak_alloc`, which measures on the CPU too.

Example:
    >>> import torch
    >>> from dynabatch.compat.bionemo import SizeAwareBatchSampler
    >>> dataset = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6])]
    >>> list(SizeAwareBatchSampler(torch.utils.data.SequentialSampler(dataset), lambda i: dataset[i].numel(), 4))
    [[0, 1], [2]]
"""

from dynabatch.compat.bionemo.bucket import BucketBatchSampler, Buckets, create_buckets
from dynabatch.compat.bionemo.peak_alloc import collect_cuda_peak_alloc, collect_peak_alloc
from dynabatch.compat.bionemo.size_aware import SizeAwareBatchSampler, size_aware_batching
from dynabatch.compat.bionemo.size_aware_memory import MemorySizeof, bucket_memory_kwargs, fit_memory_model

__all__ = [
    "BucketBatchSampler",
    "Buckets",
    "MemorySizeof",
    "SizeAwareBatchSampler",
    "bucket_memory_kwargs",
    "collect_cuda_peak_alloc",
    "collect_peak_alloc",
    "create_buckets",
    "fit_memory_model",
    "size_aware_batching",
]

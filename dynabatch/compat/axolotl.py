"""Sequence packing for training: axolotl's multipack API, packed collation and loss helpers.

A thin facade over:

* :mod:`dynabatch.sampling.multipack`: :class:`MultipackBatchSampler` and the
  functions :func:`ffd_check`, :func:`pack_group`, :func:`pack_parallel`,
  :func:`allocate_sequentially`, with axolotl's names, argument order and defaults;
* :mod:`dynabatch.data.packing`: :class:`PackedCollator` (one row per bin,
  ``position_ids`` restarting per sequence, ``cu_seq_lens`` / ``max_length``
  for flash-attention, an optional 4D block-diagonal mask for eager and sdpa),
  :class:`PackedDataset` and :func:`packed_dataloader`;
* :mod:`dynabatch.training.packed_loss`: the token-mean loss and
  ``num_items_in_batch`` for gradient accumulation.

Example:
    >>> import numpy as np
    >>> from dynabatch.packing import MultipackBatchSampler, PackedCollator, packed_dataloader
    >>> data = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 2, 6)]
    >>> sampler = MultipackBatchSampler(list(range(4)), batch_size=2, batch_max_len=8,
    ...                                 lengths=np.array([5, 3, 2, 6]))
    >>> batch = next(iter(packed_dataloader(data, sampler, PackedCollator())))
    >>> batch["input_ids"].tolist()
    [[1, 2, 3, 4, 5, 1, 2, 3], [1, 2, 3, 4, 5, 6, 1, 2]]
    >>> batch["position_ids"].tolist()
    [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]
"""

from __future__ import annotations

from dynabatch.data.packing import PackedCollator, PackedDataset, packed_dataloader
from dynabatch.sampling.multipack import (
    MultipackBatchSampler,
    allocate_sequentially,
    ffd_check,
    pack_group,
    pack_parallel,
)
from dynabatch.training.packed_loss import (
    count_target_tokens,
    num_items_in_batch,
    packed_causal_lm_loss,
)

__all__ = [
    "MultipackBatchSampler",
    "PackedCollator",
    "PackedDataset",
    "allocate_sequentially",
    "count_target_tokens",
    "ffd_check",
    "num_items_in_batch",
    "pack_group",
    "pack_parallel",
    "packed_causal_lm_loss",
    "packed_dataloader",
]

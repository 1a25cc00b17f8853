"""Each row's input hash (:func:`dynabatch._digest.row_hashes`), from a padded batch or a token store.

A results store records it with every row, so that a rerun tells a row of
these inputs from a row of other inputs at the same position or id. The two
forms give the same value for the same row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dynabatch._digest import row_hashes

__all__ = ["batch_input_hashes", "token_store_hashes"]


def batch_input_hashes(batch: Any) -> np.ndarray:
    """Each row's input hash (:func:`~dynabatch._digest.row_hashes`) from a padded batch: the real cells (by its
    attention mask) of every per-token tensor but the mask; equal to :func:`token_store_hashes` for the same row."""
    import torch

    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    real = mask.detach().cpu().bool() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else \
        torch.ones(ids.shape, dtype=torch.bool)
    offsets = np.zeros(len(real) + 1, dtype=np.int64)
    np.cumsum(real.sum(1).numpy(), out=offsets[1:])
    streams = {key: value.detach().cpu()[real].numpy() for key, value in batch.items()
               if key != "attention_mask" and isinstance(value, torch.Tensor) and value.shape == ids.shape}
    return row_hashes(streams, offsets)


def token_store_hashes(tokenized: Any) -> np.ndarray:
    """Every row's input hash from a :class:`~dynabatch.data.tokenization.TokenizedTexts` (vectorised)."""
    return row_hashes({"input_ids": tokenized.input_ids, **tokenized.extras}, tokenized.offsets)

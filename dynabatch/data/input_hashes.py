"""Each input row's 64-bit hash: from a padded batch (:func:`batch_input_hashes`) or a token store (:func:`token_store_hashes`).

A results store keeps every row's input hash
(:func:`dynabatch._digest.row_hashes` over the row's real tokens and the
tokenizer's extras), so a rerun tells a row computed from these very inputs
from a row of other inputs at the same position or id. Both functions give the
same hash for the same row: a batch hashes the cells its attention mask marks
real, a token store its rows as stored.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from dynabatch.data.input_hashes import batch_input_hashes, token_store_hashes
    >>> from dynabatch.data.tokenization import TokenizedTexts
    >>> batch = {"input_ids": torch.tensor([[5, 6, 0], [7, 8, 9]]),
    ...          "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}
    >>> store = TokenizedTexts(np.array([5, 6, 7, 8, 9], dtype=np.int32), np.array([0, 2, 5]), {})
    >>> bool((batch_input_hashes(batch) == token_store_hashes(store)).all())
    True
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

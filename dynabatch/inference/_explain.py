"""Errors of ``fn`` that name their likely cause: an embedding lookup out of range.

A model given rows longer than its position embeddings, or token ids of another
tokenizer, fails deep inside its forward with torch's bare ``IndexError: index
out of range in self``. :func:`explain_index_errors` wraps ``fn`` so that such an
error is raised again with the batch's shape, its largest token id and the two
likely causes, chained from the original.

Example:
    >>> import torch
    >>> from dynabatch.inference._explain import explain_index_errors
    >>> embed = torch.nn.Embedding(8, 2)
    >>> fn = explain_index_errors(lambda batch: embed(batch["input_ids"]))
    >>> fn({"input_ids": torch.tensor([[1, 9]])})
    Traceback (most recent call last):
    ...
    IndexError: fn(batch) failed in an embedding lookup (index out of range in self) on a batch of 1 rows x 2 \
tokens whose largest token id is 9: ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["explain_index_errors"]

_EMBEDDING_MESSAGE = "index out of range in self"  # torch's message for an embedding index out of range


def _shape_of(batch: Any) -> str:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not hasattr(ids, "shape") or len(ids.shape) != 2:
        return "a batch"
    largest = f" whose largest token id is {int(ids.max())}" if ids.numel() else ""
    return f"a batch of {ids.shape[0]} rows x {ids.shape[1]} tokens{largest}"


def explain_index_errors(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn``, with an embedding lookup's ``IndexError`` raised again naming its likely cause (chained).

    Any other error, and an ``IndexError`` with another message, propagates unchanged.
    """

    @functools.wraps(fn)
    def call(batch: Any) -> Any:
        try:
            return fn(batch)
        except IndexError as error:
            if _EMBEDDING_MESSAGE not in str(error):
                raise
            raise IndexError(
                f"fn(batch) failed in an embedding lookup ({_EMBEDDING_MESSAGE}) on {_shape_of(batch)}: most "
                "likely max_input_token_length is above the model's position embeddings (its "
                "config.max_position_embeddings or n_positions), or a token id is >= the model's vocabulary size "
                "(a tokenizer of another model); pass a max_input_token_length the model can embed "
                "(build_dynamic_batch_dataloader(..., model=model) checks it when the loader is built)"
            ) from error

    return call

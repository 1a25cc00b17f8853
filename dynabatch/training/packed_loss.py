"""Loss normalisation for packed batches: the mean over real target tokens, across accumulation.

A packed step's loss must be the mean cross-entropy over the tokens that are
really predicted: not over rows (a row holds several sequences), not over
padding, and with gradient accumulation not the mean of per-micro-batch means
(micro-batches hold different numbers of targets). The right divisor is the
number of targets of the whole optimizer step, which HF ``Trainer`` (transformers
5.x) calls ``num_items_in_batch``: it counts ``labels[..., 1:] != -100`` over
all micro-batches of the step (the causal shift leaves position 0 of a row
without a prediction), passes it to a model whose ``forward`` accepts loss
keyword arguments (every ``*ForCausalLM``), whose loss is then
``sum(token losses) / num_items_in_batch``, and stops dividing by the
accumulation steps. :class:`dynabatch.data.packing.PackedCollator` sets the label
of each sequence's first token to -100, so those counts are right for packed
rows too. The helpers here do the same for a hand-written loop.

Example:
    >>> import torch
    >>> from dynabatch.training.packed_loss import count_target_tokens, packed_causal_lm_loss
    >>> labels = torch.tensor([[-100, 2, 3, -100, 5]])
    >>> count_target_tokens(labels)
    3
    >>> logits = torch.zeros(1, 5, 8)  # uniform predictions: log(8) per target
    >>> round(packed_causal_lm_loss(logits, labels).item(), 4), round(torch.log(torch.tensor(8.0)).item(), 4)
    (2.0794, 2.0794)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from dynabatch._validation import bad_type, bad_value

__all__ = ["count_target_tokens", "num_items_in_batch", "packed_causal_lm_loss"]


def _labels(labels: Any, name: str = "labels") -> torch.Tensor:
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise bad_type(name, "an integer torch.Tensor of labels", labels)
    if labels.ndim != 2:
        raise bad_value(name, "of shape (rows, tokens)", f"shape {tuple(labels.shape)}")
    return labels


def count_target_tokens(labels: torch.Tensor, *, shift: bool = True, ignore_index: int = -100) -> int:
    """The tokens a causal LM is trained to predict in ``labels`` (rows x tokens).

    With ``shift`` (causal LMs) position 0 of a row is never a target, as in
    HF ``Trainer``'s count.
    """
    labels = _labels(labels)
    if shift:
        labels = labels[:, 1:]
    return int(labels.ne(ignore_index).sum())


def num_items_in_batch(micro_batches: Iterable[Mapping[str, Any]], *, ignore_index: int = -100) -> int:
    """``num_items_in_batch`` for one optimizer step: the targets of all its micro-batches together."""
    total = 0
    for i, batch in enumerate(micro_batches):
        if not isinstance(batch, Mapping) or "labels" not in batch:
            raise bad_type(f"micro_batches[{i}]", "a batch dict with 'labels'", batch)
        total += count_target_tokens(batch["labels"], ignore_index=ignore_index)
    return total


def packed_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Summed next-token cross-entropy divided by ``num_items_in_batch``.

    Args:
        logits: ``(rows, tokens, vocab)``.
        labels: ``(rows, tokens)``, -100 where there is nothing to predict
            (each sequence's first token in a packed row, padding).
        num_items_in_batch: the targets of the whole optimizer step (see
            :func:`num_items_in_batch`); ``None``: this batch's own targets, i.e.
            the mean over its real target tokens.

    With gradient accumulation, calling ``backward`` on each micro-batch's loss
    with the step's ``num_items_in_batch`` accumulates exactly the gradient of
    the token-mean loss over all micro-batches together.
    """
    labels = _labels(labels)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[:2] != labels.shape:
        raise bad_value("logits", f"a tensor of shape (rows, tokens, vocab) matching labels {tuple(labels.shape)}",
                        f"shape {tuple(getattr(logits, 'shape', ()))}")
    targets = labels[:, 1:].reshape(-1)
    summed = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.to(logits.device),
                             ignore_index=ignore_index, reduction="sum")
    divisor = count_target_tokens(labels, ignore_index=ignore_index) if num_items_in_batch is None \
        else num_items_in_batch
    if isinstance(divisor, torch.Tensor):
        return summed / divisor.to(summed.device)
    if divisor <= 0:
        raise bad_value("num_items_in_batch", "a positive number of target tokens", divisor)
    return summed / divisor

"""``build_dynamic_batch_dataloader``: texts in, a standard DataLoader of memory-safe batches out.

The stages, each its own module: :func:`~dynabatch.data.tokenization.tokenize_texts`
(every text tokenized once) -> :func:`~dynabatch.sampling.planner.plan_batches` (sorted
longest first, sizes chosen by the spike classifier) ->
:class:`~dynabatch.sampling.sampler.DynamicBatchSampler` (order, epochs, resumption) ->
:class:`~dynabatch.data.collate.TokenCollator` (padded tensors from the token store).

Example:
    >>> from transformers import AutoTokenizer
    >>> from dynabatch import build_dynamic_batch_dataloader
    >>> from dynabatch.demo import kjv_passages, minilm_path
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> texts = kjv_passages()[:500]
    >>> loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=8, max_input_token_length=128,
    ...                                         num_workers=0)
    >>> batch = next(iter(loader))
    >>> sorted(batch), batch["input_ids"].shape[0]
    (['attention_mask', 'input_ids', 'token_type_ids'], 8)
    >>> sum(len(b.indices) for b in loader)
    500
"""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import DataLoader, Dataset

from dynabatch._validation import bad_type, check_non_negative_int
from dynabatch.data.collate import TokenCollator, pad_token_id_of
from dynabatch.sampling.planner import check_model_shape, check_plan_arguments, plan_batches
from dynabatch.sampling.sampler import DynamicBatchSampler
from dynabatch.data.tokenization import tokenize_texts, validate_texts

__all__ = ["build_dynamic_batch_dataloader"]

logger = logging.getLogger(__name__)


class _Positions(Dataset):
    """Item ``i`` is ``i``: the collator builds the batch from the token store."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def build_dynamic_batch_dataloader(
    texts: Any,
    tokenizer: Any,
    batch_size: int,
    max_input_token_length: int,
    threshold: float = 0.025,
    shuffle: bool = False,
    num_workers: int = 4,
    batch_start_range: float = 1.0,
    batch_end_range: float = 6.0,
    steps: int = 50,
    *,
    classifier: Any = None,
    model_shape: Any = None,
    seed: int = 0,
    progress: bool = False,
    **tokenizer_kwargs: Any,
) -> DataLoader:
    """Builds a DataLoader whose batches grow as texts get shorter, under the first batch's peak memory.

    Args:
        texts: the input strings (list, tuple, pandas Series, ``datasets`` column).
        tokenizer: a Hugging Face tokenizer with a pad token.
        batch_size: rows of the first batch, the ``batch_size`` longest texts;
            every batch has at least this many rows (but the last).
        max_input_token_length: truncation limit per text, in tokens.
        threshold: highest spike probability a chosen batch size may have.
        shuffle: shuffle the batch order (the first, hardest batch stays first).
        num_workers: DataLoader worker processes (0: batches built in the main process).
        batch_start_range: smallest candidate size, as a multiple of ``batch_size`` (>= 1).
        batch_end_range: largest candidate size, as a multiple of ``batch_size``.
        steps: number of candidate sizes between the two.
        classifier: the spike classifier: ``None`` for the bundled one, a path
            to a trusted joblib file, or a fitted estimator.
        model_shape: what the planner may know of the model and the call,
            ``ModelShape.from_model(model, max_new_tokens=..., num_beams=...)``:
            plans with the shape-aware classifier, safer and larger batches on
            models unlike the profiled ones. ``None``: the spec's 13 features.
        seed: seeds the shuffled order.
        progress: show a progress bar while tokenizing.
        **tokenizer_kwargs: passed to the tokenizer (e.g. ``add_special_tokens=False``);
            ``pad_to_multiple_of`` rounds each batch's width up.

    Returns:
        A plain :class:`torch.utils.data.DataLoader`. Each batch is a
        :class:`~dynabatch.data.collate.Batch`: a dict of tensors (``input_ids``,
        ``attention_mask`` and the tokenizer's other outputs) that
        ``model(**batch)`` and ``model.generate(**batch)`` take, with
        ``batch.indices`` (input positions of its rows) and ``batch.texts``.
        Put per-batch outputs back in input order with
        :func:`~dynabatch.data.order.restore_order`.
    """
    items = validate_texts(texts)
    check_plan_arguments(batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps)
    check_non_negative_int("num_workers", num_workers)
    if not isinstance(shuffle, bool):
        raise bad_type("shuffle", "a bool", shuffle)
    check_model_shape(model_shape)
    pad_to_multiple_of = tokenizer_kwargs.pop("pad_to_multiple_of", None)
    pad_token_id_of(tokenizer)  # refuse a tokenizer without pad token before tokenizing
    tokenized = tokenize_texts(items, tokenizer, max_input_token_length, progress=progress, **tokenizer_kwargs)
    batches = plan_batches(
        tokenized.lengths,
        batch_size,
        max_input_token_length,
        classifier=classifier,
        threshold=threshold,
        batch_start_range=batch_start_range,
        batch_end_range=batch_end_range,
        steps=steps,
        model_shape=model_shape,
    )
    sampler = DynamicBatchSampler(batches, shuffle=shuffle, seed=seed)
    collator = TokenCollator.from_tokenizer(tokenized, tokenizer, texts=items, pad_to_multiple_of=pad_to_multiple_of)
    sizes = [len(b) for b in batches]
    logger.info("planned %d texts into %d batches (first %d rows, largest %d)", len(items), len(batches),
                sizes[0], max(sizes))
    return DataLoader(_Positions(len(items)), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers)

"""``build_dynamic_batch_dataloader``: texts in, a standard DataLoader of memory-safe batches out, with its plan as
``loader.plan`` (a :class:`LoaderPlan`); the texts are tokenized whole and planned at once, or streamed: tokenized
chunk by chunk in a background thread (:class:`~dynabatch.data.streaming.TokenStream`), each chunk planned as it comes.

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
    >>> len(loader.plan.planner.batches()) == len(loader)
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from dynabatch._background import Worker
from dynabatch._validation import bad_type, bad_value, check_bool, check_non_negative_int, check_positive_int
from dynabatch.data import streaming as token_streaming
from dynabatch.data.collate import TokenCollator, pad_token_id_of
from dynabatch.data.ids import check_ids
from dynabatch.data.streaming import TokenStream
from dynabatch.data.text_source import TextSource, check_on_bad_input, is_text_source, open_texts
from dynabatch.data.token_ids import are_token_ids, split_bad_rows, store_token_ids
from dynabatch.data.tokenization import (check_length_fits, check_tokenizer, check_tokenizer_kwargs, split_no_token,
                                         tokenize_texts)
from dynabatch.data.workers import available_cores
from dynabatch.memory.shape import check_position_limit, resolve_model_shape
from dynabatch.sampling.chunked_planner import ChunkedPlanner
from dynabatch.sampling.estimators import choose_estimator
from dynabatch.sampling.inference_sampler import DynamicBatchSampler, StreamingBatchSampler
from dynabatch.sampling.planner import BatchPlanner, PlanSettings

__all__ = ["STREAM_ABOVE", "LoaderPlan", "build_dynamic_batch_dataloader", "plan_of"]

logger = logging.getLogger(__name__)

BAD_TEXT = "bad input: not a str (the loader skipped it, on_bad_input='skip')"
"""The cause of a skipped text (``run``'s ``BAD_INPUT``)."""
BAD_ROW = "bad input: not a row of token ids (the loader skipped it, on_bad_input='skip')"
"""The cause of a skipped item of pre-tokenized texts."""
NO_TOKEN = "bad input: no token once tokenized (the loader skipped it, on_bad_input='skip')"
"""The cause of a skipped text (or pre-tokenized row) of no token."""

STREAM_ABOVE = 16_384
"""``stream=None`` streams a list of more texts than this (tokenizing it whole first would keep the device waiting)."""


@dataclass
class LoaderPlan:
    """What a dynabatch DataLoader is made of, attached to it as ``loader.plan``.

    Attributes:
        planner: the ``BatchPlanner`` that made it (streamed: a ``ChunkedPlanner``).
        sampler: the loader's ``batch_sampler``.
        collator: builds a batch from positions: the loader's ``collate_fn`` (streamed: the stream).
        n_inputs: how many inputs the loader was given (bad ones included).
        ids: the texts' ids (a ``pyarrow`` array), or ``None``.
        skipped: positions of the bad inputs planned into no batch (``on_bad_input="skip"``).
        stream: a streaming loader's :class:`~dynabatch.data.streaming.TokenStream`, else ``None``.
        bad_input: the cause ``run`` records for each skipped input, but those of ``no_token``.
        no_token: the skipped inputs of no token once tokenized (:data:`NO_TOKEN`); a stream finds its own as it
            tokenizes each chunk (``stream.no_token``).
    """

    planner: Any
    sampler: DynamicBatchSampler
    collator: Any
    n_inputs: int
    ids: Any
    skipped: np.ndarray
    stream: Any = None
    bad_input: str = BAD_TEXT
    no_token: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def causes(self, positions: np.ndarray) -> list[str]:
        """The cause ``run`` records for each skipped input at ``positions``."""
        return [NO_TOKEN if empty else self.bad_input for empty in np.isin(positions, self.no_token).tolist()]


def plan_of(loader: Any) -> LoaderPlan | None:
    """The :class:`LoaderPlan` of a dynabatch loader, also under ``accelerate``'s ``prepare`` (whose
    ``BatchSamplerShard`` wraps the plan's sampler: ``run`` shares the whole plan among the ranks itself); else
    ``None``."""
    if isinstance(getattr(loader, "plan", None), LoaderPlan):
        return loader.plan
    sampler = getattr(loader, "batch_sampler", None)  # accelerate's loader hands on its base loader's
    for candidate in (sampler, getattr(sampler, "batch_sampler", None)):  # BatchSamplerShard keeps it here
        if isinstance(getattr(candidate, "loader_plan", None), LoaderPlan):
            logger.info("loader was prepared by accelerate: running the whole dynabatch plan under it")
            return candidate.loader_plan
    return None


def _streams(texts: Any, stream: Any, shuffle: bool, token_ids: bool) -> bool:
    """Whether the loader streams: ``stream`` if given, else for a text source or a list above :data:`STREAM_ABOVE`."""
    if stream is not None and not isinstance(stream, bool):
        raise bad_type("stream", "None (auto), True or False", stream)
    if stream and token_ids:
        raise bad_value("stream", "False or None for pre-tokenized texts (there is nothing to tokenize)", stream)
    if stream and shuffle:
        raise bad_value("stream", "False or None with shuffle=True (a shuffled order needs the whole plan)", stream)
    if stream is not None or token_ids or shuffle:
        return bool(stream)
    if is_text_source(texts):
        return True
    try:
        return len(texts) > STREAM_ABOVE
    except TypeError:  # not texts: open_texts says why
        return False


def _streaming_loader(source: TextSource, skipped: np.ndarray, ids: Any, tokenizer: Any, settings: PlanSettings,
                      estimator: Any, num_workers: int, tokenize_cores: int | None, tokenizer_kwargs: dict,
                      on_bad_input: str, texts_name: str) -> DataLoader:
    """The streamed shape, built in this process (the stream's thread cannot be pickled): a plain loop consumes each
    batch's rows, so a chunk's tokens are freed once its batches are built (``run`` frees them itself)."""
    stream = TokenStream(source, tokenizer, settings.max_input_token_length, skip=skipped, on_bad_input=on_bad_input,
                         first_chunk=max(token_streaming.FIRST_CHUNK, 4 * settings.batch_size),
                         chunk_size=token_streaming.CHUNK_SIZE, pad_to_multiple_of=settings.pad_to_multiple_of,
                         tokenize_cores=tokenize_cores, texts_name=texts_name, **tokenizer_kwargs)
    planner = ChunkedPlanner(stream.feed(iter(range(stream.n_chunks))).next, settings, estimator)
    sampler = StreamingBatchSampler(planner)
    if num_workers:
        logger.info("stream: batches are built in this process (num_workers=%d not used)", num_workers)
    loader = DataLoader(range(stream.n), batch_sampler=sampler, collate_fn=stream.collate_and_consume,
                        num_workers=0)
    loader.plan = sampler.loader_plan = LoaderPlan(planner, sampler, stream, stream.n,
                                                   check_ids(ids, stream.n, texts_name=texts_name), skipped, stream)
    logger.info("streaming %d texts in %d chunks, longest first", stream.n, stream.n_chunks)
    return loader


def _eager_loader(tokenized: Any, texts: list | None, skipped: np.ndarray, ids: Any, tokenizer: Any,
                  settings: PlanSettings, estimator: Any, shuffle: bool, seed: int, num_workers: int,
                  on_bad_input: str, texts_name: str, bad_input: str = BAD_TEXT,
                  rows: list | None = None) -> DataLoader:
    """The eager shape: the whole token store planned at once (any order, workers); the dataset's item i is i. The
    rows of no token (``texts`` or pre-tokenized ``rows``) are bad inputs, by ``on_bad_input``; errors call the
    texts ``texts_name``."""
    no_token = split_no_token(tokenized.lengths, on_bad_input, (texts if rows is None else rows).__getitem__,
                              skipped=skipped, texts_name=texts_name)
    skipped = np.union1d(skipped, no_token) if no_token.size else skipped
    n = len(tokenized)
    id_array = check_ids(ids, n, texts_name=texts_name)
    planner = BatchPlanner(tokenized.lengths, settings, estimator, skip=skipped)
    batches = planner.batches()
    sampler = DynamicBatchSampler(batches, shuffle=shuffle, seed=seed)
    collator = TokenCollator.from_tokenizer(tokenized, tokenizer, texts=texts,
                                            pad_to_multiple_of=settings.pad_to_multiple_of)
    sizes = [len(b) for b in batches] or [0]  # none when every text is a bad input, skipped
    logger.info("planned %d texts into %d batches (first %d rows, largest %d)", n, len(batches), sizes[0], max(sizes))
    cores = available_cores()
    if num_workers > cores:
        logger.info("num_workers=%d capped at the %d available cores (torch warns above it)", num_workers, cores)
    loader = DataLoader(range(n), batch_sampler=sampler, collate_fn=collator, num_workers=min(num_workers, cores))
    loader.plan = sampler.loader_plan = LoaderPlan(planner, sampler, collator, n, id_array, skipped,
                                                   bad_input=bad_input, no_token=no_token)
    return loader


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
    progress: bool = True,
    memory_model: Any = None,
    refit_memory_model: bool = False,
    max_memory: Any = None,
    memory_margin: float = 0.10,
    granularity: int | None = None,
    model: Any = None,
    max_tokens: int | None = None,
    max_growth: float = 2.0,
    ids: Any = None,
    on_bad_input: str = "raise",
    stream: bool | None = None,
    tokenize_cores: int | None = None,
    texts_name: str = "texts",
    **tokenizer_kwargs: Any,
) -> DataLoader:
    """Builds a DataLoader whose batches grow as texts get shorter, under the first batch's peak memory.

    A plain loop runs the plan, an estimate, as it is; ``dynabatch.run(fn, loader)`` measures each batch's peak and
    re-sizes later batches so that none exceeds the first's. Every argument in full: ``docs/inference.md``.

    Args:
        texts: the input strings (list, tuple, pandas Series, ``datasets`` column, :class:`TextSource`, iterator), or
            pre-tokenized rows (token ids per text, taken as they are and truncated; ``batch.texts`` is then ``None``).
        tokenizer: a Hugging Face tokenizer object with a pad token (not a model name).
        batch_size: rows of the first batch, the longest texts; every batch but the last has at least this many.
        max_input_token_length: truncation limit per text, in tokens, special tokens included.
        threshold: highest spike probability a chosen batch size may have.
        shuffle, seed: shuffle the batch order, seeded (the first, hardest batch stays first).
        num_workers: DataLoader worker processes, capped (with a log line) at the cores this process may use.
        batch_start_range, batch_end_range, steps: ``steps`` candidate sizes from start to end times ``batch_size``.
        classifier: ``None`` (the bundled spike classifier), a path to a trusted joblib file, or a fitted estimator.
        model_shape: a ``ModelShape``: plans with the shape-aware classifier; ``None``: dynabatch 0.1.6's features.
        progress: show a progress bar while tokenizing.
        memory_model: a calibrated ``MemoryModel``: batches sized by its predicted peaks instead of the classifier.
        refit_memory_model: each run's measured peaks refit ``memory_model`` in place (else a run refines a copy).
        max_memory: ``None`` (the first batch's peak bounds every batch), or a budget (bytes, ``"90%"``, ``"auto"``).
        memory_margin, granularity: with ``memory_model``, the share of the budget kept free, and the size multiple.
        model: the model (or config) whose shape is read; a ``max_input_token_length`` above its positions is refused.
        max_tokens: padded tokens per batch at most (with the memory rule, the smaller wins); ``None``: no cap.
        max_growth: in ``run``'s measured mode, a batch has at most this many times the rows of the one before (>= 1).
        ids: one stable id per text (str or int, unique), or ``None``: a results store then keys rows by id.
        on_bad_input: ``"raise"`` a ``TypeError`` naming the items that are not str (a ``ValueError`` for texts or
            rows of no token once tokenized: streamed, as their chunk is), or ``"skip"`` them (no batch).
        stream: tokenize and plan chunk by chunk as batches run; ``None``: above :data:`STREAM_ABOVE` texts, and for
            texts from files, a dataset or an iterator. Not with ``shuffle`` nor pre-tokenized texts.
        tokenize_cores: cores to tokenize on, at most (the tokens are the same); ``None``: every core it may use.
        texts_name: what errors about the texts call them (a function that builds the loader from its own argument
            names that argument: ``dynabatch.generate``'s ``"prompts"``).
        **tokenizer_kwargs: passed to the tokenizer (``pad_to_multiple_of`` rounds each batch's width up).

    Returns:
        A plain :class:`torch.utils.data.DataLoader` with ``loader.plan`` (a :class:`LoaderPlan`); each batch a
        :class:`~dynabatch.data.collate.Batch` for ``model(**batch)``, with its input positions as ``.indices``.
    """
    check_on_bad_input(on_bad_input)
    if not isinstance(texts_name, str):
        raise bad_type("texts_name", "a str, the name of an argument (such as 'prompts')", texts_name)
    if not texts_name.isidentifier():
        raise bad_value("texts_name", "the name of an argument (such as 'prompts')", texts_name)
    token_ids = not is_text_source(texts) and are_token_ids(texts)
    streaming = _streams(texts, stream, shuffle, token_ids)
    check_tokenizer(tokenizer)
    check_tokenizer_kwargs(tokenizer, tokenizer_kwargs, build_dynamic_batch_dataloader)
    pad_to_multiple_of = tokenizer_kwargs.pop("pad_to_multiple_of", None)
    if token_ids and tokenizer_kwargs:
        raise bad_value("tokenizer_kwargs", "empty for pre-tokenized texts (the ids are taken as they are, no "
                        "tokenizer call)", tokenizer_kwargs)
    settings = PlanSettings(batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps,
                            resolve_model_shape(model_shape, model), pad_to_multiple_of, max_growth, max_tokens)
    check_non_negative_int("num_workers", num_workers)
    if tokenize_cores is not None:
        check_positive_int("tokenize_cores", tokenize_cores)
    check_bool("shuffle", shuffle)
    check_bool("progress", progress)  # as run checks it: a truthy "no" would show the bar
    estimator = choose_estimator(classifier, memory_model, max_memory=max_memory, memory_margin=memory_margin,
                                 granularity=granularity, model=model, refit_memory_model=refit_memory_model)
    pad_token_id_of(tokenizer)  # refuse a tokenizer without pad token before tokenizing
    if model is not None:
        check_position_limit(model, settings.max_input_token_length)
    if token_ids:
        rows, skipped = split_bad_rows(texts, on_bad_input, texts_name=texts_name)
        tokenized = store_token_ids(rows, max_input_token_length, texts_name=texts_name,
                                    truncation_side=getattr(tokenizer, "truncation_side", "right"))
        return _eager_loader(tokenized, None, skipped, ids, tokenizer, settings, estimator, shuffle, seed,
                             num_workers, on_bad_input, texts_name, bad_input=BAD_ROW, rows=rows)
    check_length_fits(tokenizer, settings.max_input_token_length, tokenizer_kwargs)
    source, skipped = open_texts(texts, on_bad_input, name=texts_name)
    if streaming:
        return _streaming_loader(source, skipped, ids, tokenizer, settings, estimator, num_workers, tokenize_cores,
                                 tokenizer_kwargs, on_bad_input, texts_name)
    items = source.texts()
    # What the plan needs loads beside the tokenizer (a process's first plan reads the classifier's trees): the
    # tokenizer's own call releases the GIL, and on one thread it leaves the other cores idle
    preparing = Worker(name="dynabatch-plan-prepare")
    preparing.submit(estimator.prepare, settings)
    try:
        tokenized = tokenize_texts(items, tokenizer, max_input_token_length, progress=progress,
                                   tokenize_cores=tokenize_cores, texts_name=texts_name, **tokenizer_kwargs)
    except BaseException:
        preparing.close(cancel=True)
        raise
    preparing.close()  # raises what loading it raised
    return _eager_loader(tokenized, items, skipped, ids, tokenizer, settings, estimator, shuffle, seed, num_workers,
                         on_bad_input, texts_name)

"""``build_dynamic_batch_dataloader``: texts in, a standard DataLoader of memory-safe batches out.

Texts are read (:func:`~dynabatch.data.text_source.open_texts`) and tokenized by one function
(:func:`~dynabatch.data.tokenization.tokenize_texts`) in either shape. **Eager**: one token store planned whole
(:class:`~dynabatch.sampling.planner.BatchPlanner`). **Streamed** (``stream=True``, above :data:`STREAM_ABOVE` texts,
or texts from files, a dataset or an iterator): a :class:`~dynabatch.data.streaming.TokenStream` tokenizes chunks
longest first in a background thread, each planned as it comes
(:class:`~dynabatch.sampling.chunked_planner.ChunkedPlanner`). ``loader.plan`` (a :class:`LoaderPlan`) is what
:func:`dynabatch.run` builds, re-plans or shares batches from.

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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from dynabatch._background import Worker
from dynabatch._validation import bad_type, bad_value, check_non_negative_int, check_positive_int
from dynabatch.data import streaming as token_streaming
from dynabatch.data.collate import TokenCollator, pad_token_id_of
from dynabatch.data.ids import check_ids
from dynabatch.data.streaming import TokenStream
from dynabatch.data.text_source import TextSource, check_on_bad_input, is_text_source, open_texts
from dynabatch.data.token_ids import are_token_ids, store_token_ids
from dynabatch.data.tokenization import check_length_fits, check_tokenizer, check_tokenizer_kwargs, tokenize_texts
from dynabatch.data.workers import available_cores
from dynabatch.memory.shape import check_position_limit, resolve_model_shape
from dynabatch.sampling.chunked_planner import ChunkedPlanner
from dynabatch.sampling.estimators import choose_estimator
from dynabatch.sampling.inference_sampler import DynamicBatchSampler, StreamingBatchSampler
from dynabatch.sampling.planner import BatchPlanner, PlanSettings

__all__ = ["STREAM_ABOVE", "LoaderPlan", "build_dynamic_batch_dataloader", "plan_of"]

logger = logging.getLogger(__name__)

STREAM_ABOVE = 16_384
"""``stream=None`` streams a list of more texts than this (tokenizing it whole first would keep the device waiting)."""


def _worker_count(num_workers: int) -> int:
    """``num_workers`` capped at the cores this process may use (what torch's DataLoader warns above)."""
    cores = available_cores()
    if num_workers > cores:
        logger.info("num_workers=%d capped at the %d available cores (torch warns above it)", num_workers, cores)
        return cores
    return num_workers


@dataclass
class LoaderPlan:
    """What a dynabatch DataLoader is made of, attached to it as ``loader.plan``.

    Attributes:
        planner: the :class:`~dynabatch.sampling.planner.BatchPlanner` that made the plan.
        sampler: the :class:`~dynabatch.sampling.inference_sampler.DynamicBatchSampler` (the loader's ``batch_sampler``).
        collator: the :class:`~dynabatch.data.collate.TokenCollator` (the loader's ``collate_fn``).
        ids: the texts' ids (a ``pyarrow`` array), or ``None``.
        skipped: positions of the bad inputs planned into no batch (``on_bad_input="skip"``).
        stream: a streaming loader's :class:`~dynabatch.data.streaming.TokenStream` (then also the collator, and the
            planner a :class:`~dynabatch.sampling.chunked_planner.ChunkedPlanner`), else ``None``.
    """

    planner: Any
    sampler: DynamicBatchSampler
    collator: Any
    ids: Any = None
    skipped: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    stream: Any = None

    @property
    def n_inputs(self) -> int:
        """How many inputs the loader was given (bad ones included)."""
        return self.stream.n if self.stream is not None else len(self.collator.tokenized)


def plan_of(loader: Any) -> LoaderPlan | None:
    """The :class:`LoaderPlan` of a dynabatch loader, also under ``accelerate``'s ``prepare`` (whose
    ``BatchSamplerShard`` wraps the plan's sampler: ``run`` shares the whole plan among the ranks itself); else
    ``None``."""
    plan = getattr(loader, "plan", None)
    if isinstance(plan, LoaderPlan):
        return plan
    for holder in (loader, getattr(loader, "base_dataloader", None)):
        sampler = getattr(holder, "batch_sampler", None)
        for candidate in (sampler, getattr(sampler, "batch_sampler", None)):  # BatchSamplerShard keeps it here
            plan = getattr(candidate, "loader_plan", None) if isinstance(candidate, DynamicBatchSampler) else None
            if isinstance(plan, LoaderPlan):
                logger.info("loader was prepared by accelerate: running the whole dynabatch plan under it")
                return plan
    return None


def _streams(texts: Any, stream: Any, shuffle: bool, token_ids: bool) -> bool:
    """Whether the loader streams: ``stream`` if given, else for a text source or a list above :data:`STREAM_ABOVE`."""
    if stream is not None and not isinstance(stream, bool):
        raise bad_type("stream", "None (auto), True or False", stream)
    if stream and token_ids:
        raise bad_value("stream", "False or None for pre-tokenized texts (there is nothing to tokenize)", stream)
    if stream and shuffle:
        raise bad_value("stream", "False or None with shuffle=True (a shuffled order needs the whole plan)", stream)
    if stream is not None:
        return stream
    if token_ids or shuffle:
        return False
    if is_text_source(texts):
        return True
    try:
        return len(texts) > STREAM_ABOVE
    except TypeError:
        return False


def _streaming_loader(source: TextSource, skipped: np.ndarray, ids: Any, tokenizer: Any, settings: PlanSettings,
                      estimator: Any, num_workers: int, tokenize_cores: int | None, tokenizer_kwargs: dict) -> DataLoader:
    """The streamed shape: a :class:`TokenStream` over ``source``, its chunks planned as they are tokenized."""
    stream = TokenStream(source, tokenizer, settings.max_input_token_length, skip=skipped,
                         first_chunk=max(token_streaming.FIRST_CHUNK, 4 * settings.batch_size),
                         chunk_size=token_streaming.CHUNK_SIZE, pad_to_multiple_of=settings.pad_to_multiple_of,
                         tokenize_cores=tokenize_cores, **tokenizer_kwargs)
    planner = ChunkedPlanner(stream.feed(iter(range(stream.n_chunks))).next, settings, estimator)
    sampler = StreamingBatchSampler(planner)
    if num_workers:
        logger.info("stream: batches are built in this process (num_workers=%d not used)", num_workers)
    # Batches are built in this process (the stream's thread cannot be pickled); a plain loop consumes a batch's
    # rows as it builds it, so each chunk's tokens are freed once its batches are built. run builds from the plan's
    # collator (the stream) and says itself when rows are finished.
    loader = DataLoader(range(stream.n), batch_sampler=sampler, collate_fn=stream.collate_and_consume,
                        num_workers=0)
    loader.plan = sampler.loader_plan = LoaderPlan(planner, sampler, stream, check_ids(ids, stream.n), skipped, stream)
    logger.info("streaming %d texts in %d chunks, longest first", stream.n, stream.n_chunks)
    return loader


def _eager_loader(tokenized: Any, texts: list[str] | None, skipped: np.ndarray, ids: Any, tokenizer: Any,
                  settings: PlanSettings, estimator: Any, shuffle: bool, seed: int, num_workers: int) -> DataLoader:
    """The eager shape: the whole token store planned at once (any order, workers)."""
    id_array = check_ids(ids, len(tokenized))
    planner = BatchPlanner(tokenized.lengths, settings, estimator, skip=skipped if skipped.size else None)
    batches = planner.batches()
    sampler = DynamicBatchSampler(batches, shuffle=shuffle, seed=seed)
    collator = TokenCollator.from_tokenizer(tokenized, tokenizer, texts=texts,
                                            pad_to_multiple_of=settings.pad_to_multiple_of)
    sizes = [len(b) for b in batches]
    logger.info("planned %d texts into %d batches (first %d rows, largest %d)", len(tokenized), len(batches),
                sizes[0], max(sizes))
    # The dataset's item i is i: the collator builds each batch from the token store.
    loader = DataLoader(range(len(tokenized)), batch_sampler=sampler, collate_fn=collator,
                        num_workers=_worker_count(num_workers))
    loader.plan = sampler.loader_plan = LoaderPlan(planner, sampler, collator, id_array, skipped)
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
    **tokenizer_kwargs: Any,
) -> DataLoader:
    """Builds a DataLoader whose batches grow as texts get shorter, under the first batch's peak memory.

    Every argument is a row of the table in ``docs/inference.md`` ("The loader"), with the rules in full.

    Args:
        texts: the input strings (list, tuple, pandas Series, ``datasets`` column, a :class:`TextSource`), or
            pre-tokenized rows (one list, 1-D array or tensor of token ids per text, taken as they are, truncated to
            ``max_input_token_length`` on the tokenizer's ``truncation_side``; ``batch.texts`` is then ``None``).
        tokenizer: a Hugging Face tokenizer object with a pad token (not a model name).
        batch_size: rows of the first batch, the ``batch_size`` longest texts; every batch but the last has at least
            this many rows.
        max_input_token_length: truncation limit per text, in tokens, special tokens included.
        threshold: highest spike probability a chosen batch size may have.
        shuffle: shuffle the batch order (the first, hardest batch stays first).
        num_workers: DataLoader worker processes, capped (with a log line) at the cores this process may use.
        batch_start_range: smallest candidate size, as a multiple of ``batch_size`` (>= 1).
        batch_end_range: largest candidate size, as a multiple of ``batch_size``.
        steps: number of candidate sizes between the two.
        classifier: the spike classifier: ``None`` for the bundled one, a path to a trusted joblib file, or a fitted
            estimator.
        model_shape: ``ModelShape.from_model(model, max_new_tokens=..., num_beams=...)``: plans with the shape-aware
            classifier. ``None``: dynabatch 0.1.6's 13 features.
        seed: seeds the shuffled order.
        progress: show a progress bar while tokenizing.
        memory_model: a calibrated ``MemoryModel``: batches sized by its predicted peaks instead of the classifier.
        refit_memory_model: ``True``: each run's measured peaks refit ``memory_model`` in place; ``False``: it is
            left as you built it (``run(memory="measured")`` refines a copy).
        max_memory: ``None`` (the relative rule: no batch above the first batch's peak), or an absolute budget every
            batch is planned under: bytes, ``"20GB"``/``"20GiB"``, ``"90%"`` of the device's free memory (read by
            ``dynabatch.run`` on its device as it starts; refused on the CPU), or ``"auto"`` (``"90%"`` on an
            accelerator, the relative rule on the CPU). See ``docs/memory.md``.
        memory_margin: with ``memory_model``, every batch's predicted peak stays at or under ``(1 - memory_margin)``
            times the budget; in ``[0, 1)``.
        granularity: with ``memory_model``, batch sizes are multiples of it (when at least it).
        model: the model (or config) the batches are for: its shape is read from it, and a
            ``max_input_token_length`` above its position embeddings is refused here, naming the config field.
        max_tokens: padded tokens per batch at most (text-embeddings-inference's ``--max-batch-tokens``); with the
            memory rule the smaller wins. It must hold the first batch, else ``ValueError``. ``None``: no cap.
        max_growth: in ``run``'s measured mode, a batch has at most this many times the rows of the one before (>= 1).
        ids: one stable id per text (str or int, unique), or ``None``: a results store then keys rows by id.
        on_bad_input: items of ``texts`` that are not str: ``"raise"`` a ``TypeError`` naming them, or ``"skip"``
            them (planned into no batch; ``run`` lists them in ``result.failed``).
        stream: tokenize and plan chunk by chunk while the batches run (:mod:`dynabatch.data.streaming`), longest
            first, in a background thread; ``None`` (auto): above :data:`STREAM_ABOVE` texts, and for texts read from
            files, a dataset or an iterator. Not with ``shuffle`` nor pre-tokenized texts.
        tokenize_cores: cores to tokenize on, at most; ``None``: every core this process may use. The tokens are the
            same whatever the count.
        **tokenizer_kwargs: passed to the tokenizer (e.g. ``add_special_tokens=False``); ``pad_to_multiple_of``
            rounds each batch's width up. A keyword the tokenizer does not take raises ``TypeError`` naming it.

    The plan is an estimate (the spike classifier can be wrong on models unlike the profiled ones), and a plain loop
    runs it as it is. ``dynabatch.run(fn, loader)`` measures each batch's peak and re-sizes later batches so that
    none exceeds the first's; ``memory_model=calibrate(...)`` sizes batches by measured probes of your model.

    Returns:
        A plain :class:`torch.utils.data.DataLoader`, with its plan as ``loader.plan`` (a :class:`LoaderPlan`). Each
        batch is a :class:`~dynabatch.data.collate.Batch`: a dict of tensors that ``model(**batch)`` takes, with
        ``batch.indices`` (input positions of its rows) and ``batch.texts``.
    """
    check_on_bad_input(on_bad_input)
    token_ids = not is_text_source(texts) and are_token_ids(texts)
    streaming = _streams(texts, stream, shuffle, token_ids)
    check_tokenizer(tokenizer)
    check_tokenizer_kwargs(tokenizer, tokenizer_kwargs, build_dynamic_batch_dataloader)
    pad_to_multiple_of = tokenizer_kwargs.pop("pad_to_multiple_of", None)
    if token_ids and tokenizer_kwargs:
        raise ValueError("tokenizer_kwargs should be empty for pre-tokenized texts (the ids are taken as they "
                         f"are, no tokenizer call), but got tokenizer_kwargs={tokenizer_kwargs!r}")
    settings = PlanSettings(batch_size, max_input_token_length, threshold, batch_start_range, batch_end_range, steps,
                            resolve_model_shape(model_shape, model), pad_to_multiple_of, max_growth, max_tokens)
    check_non_negative_int("num_workers", num_workers)
    if tokenize_cores is not None:
        check_positive_int("tokenize_cores", tokenize_cores)
    if not isinstance(shuffle, bool):
        raise bad_type("shuffle", "a bool", shuffle)
    estimator = choose_estimator(classifier, memory_model, max_memory=max_memory, memory_margin=memory_margin,
                                 granularity=granularity, model=model, refit_memory_model=refit_memory_model)
    pad_token_id_of(tokenizer)  # refuse a tokenizer without pad token before tokenizing
    if model is not None:
        check_position_limit(model, settings.max_input_token_length)
    if token_ids:
        tokenized = store_token_ids(texts, max_input_token_length,
                                    truncation_side=getattr(tokenizer, "truncation_side", "right"))
        return _eager_loader(tokenized, None, np.zeros(0, dtype=np.int64), ids, tokenizer, settings, estimator,
                             shuffle, seed, num_workers)
    check_length_fits(tokenizer, settings.max_input_token_length, tokenizer_kwargs)
    source, skipped = open_texts(texts, on_bad_input)
    if streaming:
        return _streaming_loader(source, skipped, ids, tokenizer, settings, estimator, num_workers, tokenize_cores,
                                 tokenizer_kwargs)
    items = source.texts()
    # What the plan needs loads beside the tokenizer (a process's first plan reads the classifier's trees): the
    # tokenizer's own call releases the GIL, and on one thread it leaves the other cores idle
    preparing = Worker(name="dynabatch-plan-prepare")
    preparing.submit(estimator.prepare, settings)
    try:
        tokenized = tokenize_texts(items, tokenizer, max_input_token_length, progress=progress,
                                   tokenize_cores=tokenize_cores, **tokenizer_kwargs)
    except BaseException:
        preparing.close(cancel=True)
        raise
    preparing.close()  # raises what loading it raised
    return _eager_loader(tokenized, items, skipped, ids, tokenizer, settings, estimator, shuffle, seed, num_workers)

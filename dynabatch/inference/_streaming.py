"""The streaming loader: a corpus planned chunk by chunk while it is tokenized, for
:func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader` (``stream=True``, or a corpus above
:data:`STREAM_ABOVE` texts, or texts from a file, a dataset or an iterator).

The loader's plan then holds a :class:`~dynabatch.data.streaming.TokenStream`
(``plan.stream``, also the collator) and a
:class:`~dynabatch.sampling.chunked_planner.ChunkedPlanner` fed by it: the
first chunk (the longest texts by characters) is tokenized when the first batch
is asked for, and the rest behind it, in a background thread.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from dynabatch._validation import bad_type, bad_value
from dynabatch.data import streaming as token_streaming
from dynabatch.data.streaming import TokenStream
from dynabatch.data.text_source import TextSource, is_text_source, read_texts
from dynabatch.data.tokenization import report_skipped, validate_texts
from dynabatch.sampling.chunked_planner import ChunkedPlanner
from dynabatch.sampling.inference_sampler import StreamingBatchSampler

__all__ = ["STREAM_ABOVE", "streaming_dataloader", "streaming_parts", "streams"]

logger = logging.getLogger(__name__)

STREAM_ABOVE = 16_384
"""``stream=None`` streams a list of more texts than this (tokenizing it whole first would keep the device waiting)."""


def streams(texts: Any, stream: Any, shuffle: bool, token_ids: bool) -> bool:
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


def _source(texts: Any, on_bad_input: str) -> tuple[TextSource, np.ndarray]:
    """The texts as a :class:`TextSource` and the positions of the bad ones (skipped), or a ``TypeError``."""
    source = read_texts(texts) if is_text_source(texts) else TextSource(texts)
    bad = source.bad()
    if bad.size and on_bad_input == "raise":
        if source.items is not None:
            validate_texts(source.items)  # the one message for texts that are not str
        raise TypeError(f"texts should hold only str, but got {bad.size} of {len(source)} missing (null) texts "
                        f"(positions {', '.join(map(str, bad[:10].tolist()))}{', ...' if bad.size > 10 else ''}): "
                        "clean them, or build the loader with on_bad_input='skip' (their results are None)")
    report_skipped(bad, len(source))
    return source, bad


def streaming_parts(texts: Any, tokenizer: Any, settings: Any, estimator: Any, *, on_bad_input: str,
                    tokenizer_kwargs: dict) -> tuple[TokenStream, ChunkedPlanner, StreamingBatchSampler, np.ndarray]:
    """The stream, its planner and its sampler over ``texts``, and the skipped positions."""
    source, skipped = _source(texts, on_bad_input)
    first = max(token_streaming.FIRST_CHUNK, 4 * settings.batch_size)
    stream = TokenStream(source, tokenizer, settings.max_input_token_length, skip=skipped, first_chunk=first,
                         chunk_size=token_streaming.CHUNK_SIZE, pad_to_multiple_of=settings.pad_to_multiple_of, **tokenizer_kwargs)
    feed = stream.feed(iter(range(stream.n_chunks)))
    planner = ChunkedPlanner(feed.next, settings, estimator)
    planner.feed = feed
    return stream, planner, StreamingBatchSampler(planner), skipped


def streaming_dataloader(dataset: Any, sampler: StreamingBatchSampler, stream: TokenStream,
                         num_workers: int) -> DataLoader:
    """The DataLoader over a stream: batches built in this process (the stream's thread cannot be pickled)."""
    if num_workers:
        logger.info("stream: batches are built in this process (num_workers=%d not used)", num_workers)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=stream, num_workers=0)

"""Training data in: a ``datasets.Dataset``, pandas, lists or files, tokenized once, lengths per key field.

:func:`read_source` turns what you have into a ``datasets.Dataset``: a
``datasets.Dataset`` as it is; a pandas DataFrame; a list of str (one column,
``"text"``), a list of dicts or a dict of lists; or files by path (one path or
a list; ``.jsonl``/``.json``, ``.csv``, ``.parquet``, read by ``datasets``
through pyarrow). The fields you name must be there.

:func:`tokenize_source` tokenizes the text fields with ``datasets.map`` in
batches, in ``num_proc`` processes (by default one for a fast tokenizer, which
is parallel inside, and several for a slow one), and returns a
:class:`TokenizedSource`: the tokenized ``datasets.Dataset`` (one column of
token ids per key field, plus the columns you keep), which a ``DataLoader`` or
the HF ``Trainer`` reads with
:class:`~dynabatch.data.training_collate.TrainingCollator`, and
:attr:`TokenizedSource.lengths`, the token length of every row per key field,
which the samplers plan with. Lengths come from the Arrow list offsets (no
Python loop over rows) and are exactly the collated widths, since truncation
happens here.

Example:
    >>> from transformers import AutoTokenizer
    >>> from dynabatch.demo import minilm_path
    >>> from dynabatch.data.sources import tokenize_source
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> rows = [{"question": "Who made light?", "answer": "God"}, {"question": "Why?", "answer": "It was good"}]
    >>> tokens = tokenize_source(rows, tokenizer, fields={"input_ids": "question", "labels": "answer"})
    >>> {k: v.tolist() for k, v in tokens.lengths.items()}
    {'input_ids': [6, 4], 'labels': [3, 5]}
    >>> tokens.dataset[1]["labels"]
    [101, 2009, 2001, 2204, 102]
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._distribution import import_extra
from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.workers import available_cores

__all__ = ["TokenizedSource", "read_source", "tokenize_source"]

logger = logging.getLogger(__name__)

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_SOURCE_RULE = ("a datasets.Dataset, a pandas DataFrame, a list of str or of dicts, a dict of lists, "
                "or a path (or list of paths) to .jsonl/.json/.csv/.parquet files")
_ROWS_PER_PROCESS = 2000  # the automatic num_proc starts a process only for this many rows


def _file_format(paths: list[Path]) -> str:
    formats = {_FORMATS.get("".join(p.suffixes[-1:]).lower()) for p in paths}
    if None in formats or len(formats) != 1:
        raise bad_value("source", "files of one format: .jsonl/.json, .csv or .parquet",
                        [str(p) for p in paths])
    return formats.pop()


def read_source(source: Any, *, fields: Sequence[str] = ()) -> Any:
    """``source`` as a ``datasets.Dataset``, checking that it has every column in ``fields``.

    Raises:
        TypeError: ``source`` is none of the accepted kinds.
        ValueError: a file missing or of an unknown format, or a field missing.
    """
    datasets = import_extra("datasets", "train", "dynabatch.tokenize_source")

    if isinstance(source, datasets.Dataset):
        dataset = source
    elif isinstance(source, (str, os.PathLike)) or (
            isinstance(source, (list, tuple)) and source and all(isinstance(s, os.PathLike) for s in source)):
        paths = [Path(p) for p in ([source] if isinstance(source, (str, os.PathLike)) else source)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise bad_value("source", "existing files (a str is read as a path; pass texts as a list)", missing[0])
        dataset = datasets.load_dataset(_file_format(paths), data_files=[str(p) for p in paths], split="train")
    elif type(source).__name__ == "DataFrame" and hasattr(source, "columns"):
        dataset = datasets.Dataset.from_pandas(source, preserve_index=False)
    elif isinstance(source, Mapping):
        dataset = datasets.Dataset.from_dict(dict(source))
    elif isinstance(source, (list, tuple)):
        if all(isinstance(s, str) for s in source):
            dataset = datasets.Dataset.from_dict({"text": list(source)})
        elif all(isinstance(s, Mapping) for s in source):
            dataset = datasets.Dataset.from_list([dict(s) for s in source])
        else:
            raise bad_type("source", _SOURCE_RULE, source)
    else:
        raise bad_type("source", _SOURCE_RULE, source)
    for field in fields:
        if field not in dataset.column_names:
            raise bad_value("fields", f"columns of the source {dataset.column_names}", field)
    return dataset


@dataclass(frozen=True)
class TokenizedSource:
    """Tokenized training rows and their lengths.

    Attributes:
        dataset: a ``datasets.Dataset`` with one column of token ids per key
            field (named as in ``fields``) plus the kept columns; its items are
            dicts of lists, what :class:`~dynabatch.data.training_collate.TrainingCollator` pads.
        lengths: key field name -> int64 array of every row's token count (pass
            it to a sampler: several fields plan on all of them).
    """

    dataset: Any
    lengths: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.dataset)


def _tokenize_batch(batch: dict[str, list[Any]], *, tokenizer: Any, fields: dict[str, str],
                    tokenizer_kwargs: dict[str, Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for column, field in fields.items():
        texts = batch[field]
        if not all(isinstance(t, str) for t in texts):
            bad = next(t for t in texts if not isinstance(t, str))
            raise bad_type(f"source[{field!r}]", "str in every row (a text field)", bad)
        out[column] = list(tokenizer(texts, **tokenizer_kwargs)["input_ids"])
    return out


def _auto_num_proc(tokenizer: Any, rows: int) -> int:
    if getattr(tokenizer, "is_fast", False):
        return 1
    # the cores this process may use (taskset, a cgroup quota, a torchrun rank's share), not the machine's: a
    # process per machine core on fewer cores ran 1.5-2.2x slower than one
    return max(1, min(available_cores(), rows // _ROWS_PER_PROCESS))


def tokenize_source(
    source: Any,
    tokenizer: Any,
    *,
    fields: str | Mapping[str, str] = "text",
    max_length: int | None = None,
    keep: Sequence[str] = (),
    num_proc: int | None = None,
    batch_size: int = 1000,
    add_special_tokens: bool = True,
    progress: bool = True,
) -> TokenizedSource:
    """Reads ``source`` (see :func:`read_source`) and tokenizes its text fields.

    Args:
        source: the rows.
        tokenizer: a Hugging Face tokenizer, or a callable taking a list of str
            and returning a mapping with ``"input_ids"`` (one list per text).
        fields: the text field (its tokens go to ``input_ids``), or a mapping
            of output column to text field, e.g. ``{"input_ids": "source",
            "labels": "target"}`` for sequence-to-sequence.
        max_length: truncate every field to this many tokens (special tokens
            included); ``None`` keeps whole texts.
        keep: other columns to carry over unchanged (e.g. a class ``label``).
        num_proc: tokenizing processes (``datasets.map``); ``None`` picks 1 for
            a fast tokenizer and, for a slow one, up to the cores this process
            may use (``tokenize_cores``'s count in ``docs/inference.md``: the
            affinity, a cgroup quota, a torchrun rank's share) with at least
            2,000 rows per process.
        batch_size: rows per tokenizer call.
        add_special_tokens: passed to the tokenizer.
        progress: show ``datasets``' progress bar.

    Raises:
        TypeError: a bad source, tokenizer or field value.
        ValueError: a missing field or column, a non-positive count, or an
            output column named twice.
    """
    if isinstance(fields, str):
        fields = {"input_ids": fields}
    if not isinstance(fields, Mapping) or not fields or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in fields.items()):
        raise bad_type("fields", "a text field name or a non-empty mapping of output column to text field", fields)
    fields = dict(fields)
    if isinstance(keep, str):
        keep = (keep,)
    keep = tuple(keep)
    clash = sorted(set(fields) & set(keep))
    if clash:
        raise bad_value("keep", f"columns other than the output columns {sorted(fields)}", clash)
    if not callable(tokenizer):
        raise bad_type("tokenizer", "a callable tokenizer returning a mapping with 'input_ids'", tokenizer)
    kwargs: dict[str, Any] = {"add_special_tokens": bool(add_special_tokens)}
    if max_length is not None:
        kwargs.update(truncation=True, max_length=check_positive_int("max_length", max_length))
    batch_size = check_positive_int("batch_size", batch_size)
    dataset = read_source(source, fields=[*fields.values(), *keep])
    if num_proc is None:
        num_proc = _auto_num_proc(tokenizer, len(dataset))
    num_proc = check_positive_int("num_proc", num_proc)
    from datasets.utils import logging as datasets_logging

    bars_were_on = datasets_logging.is_progress_bar_enabled()
    if not progress:
        datasets_logging.disable_progress_bar()
    try:
        # In memory with a fresh fingerprint: datasets neither hashes the tokenizer (slow)
        # nor reads a cache written by another tokenizer under the same name.
        tokenized = dataset.map(
            _tokenize_batch,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc if num_proc > 1 and len(dataset) > 1 else None,
            fn_kwargs={"tokenizer": tokenizer, "fields": fields, "tokenizer_kwargs": kwargs},
            remove_columns=[c for c in dataset.column_names if c not in keep],
            keep_in_memory=True,
            new_fingerprint=uuid.uuid4().hex,
            desc="tokenizing",
        )
    finally:
        if bars_were_on and not progress:
            datasets_logging.enable_progress_bar()
    lengths = {column: _list_lengths(tokenized, column) for column in fields}
    logger.debug("tokenized %d rows (%s) in %d process(es)", len(tokenized), fields, num_proc)
    return TokenizedSource(dataset=tokenized, lengths=lengths)


def _list_lengths(dataset: Any, column: str) -> np.ndarray:
    """Token counts of a list column, from the Arrow offsets."""
    import pyarrow.compute as pc

    if len(dataset) == 0:
        return np.zeros(0, np.int64)
    data = dataset.data.column(column)
    if dataset._indices is not None:  # a selected or shuffled view: lengths in the view's order
        data = data.take(dataset._indices.column(0))
    return pc.list_value_length(data).to_numpy(zero_copy_only=False).astype(np.int64)

"""Pre-tokenized texts into the token store: :func:`store_token_ids`.

Rows of token ids (lists of int, 1-D arrays or tensors) go into the same flat
:class:`~dynabatch.data.tokenization.TokenizedTexts` that
:func:`~dynabatch.data.tokenization.tokenize_texts` fills, truncated as a
tokenizer truncates, so the loader plans and pads them like tokenized texts.
:func:`are_token_ids` tells such rows from texts.
"""

from __future__ import annotations

import collections.abc
import itertools
import logging
import sys
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.tokenization import TokenizedTexts, bad_input_error, log_skipped

__all__ = ["are_token_ids", "split_bad_rows", "store_token_ids"]

logger = logging.getLogger(__name__)

_ID_ROW_TYPES = (list, tuple, np.ndarray)
_IDS_RULE = "a non-empty sequence of token id rows (lists of int, 1-D integer arrays or tensors), one per text"


def _is_id_row(item: Any) -> bool:
    return isinstance(item, _ID_ROW_TYPES) or (hasattr(item, "ndim") and hasattr(item, "tolist"))  # a tensor


def _missing(item: Any) -> bool:
    """``None``, a float NaN (pandas' missing value in a column of objects) or pandas' ``NA``."""
    return item is None or (isinstance(item, float) and item != item) or type(item).__name__ == "NAType"


def _by_position(texts: Any) -> Any:
    """``texts`` as a sequence read by position: a pandas Series' values (``series[0]`` reads the label 0) and a 1-D
    numpy array of objects as lists; any other value as it is."""
    if "pandas" in sys.modules and isinstance(texts, sys.modules["pandas"].Series):
        return texts.tolist()
    if isinstance(texts, np.ndarray) and texts.ndim == 1 and texts.dtype == object:
        return texts.tolist()
    return texts


def are_token_ids(texts: Any) -> bool:
    """Whether ``texts`` holds pre-tokenized rows (its first item that is not missing a list, tuple, array or tensor
    of ids), not str: a list or other sequence, a pandas Series or a 1-D numpy array of objects.

    Example:
        >>> import pandas as pd
        >>> are_token_ids([[101, 7592, 102]]), are_token_ids(["hello"]), are_token_ids(pd.Series([None, [101]]))
        (True, False, True)
    """
    if "pandas" in sys.modules and isinstance(texts, sys.modules["pandas"].Series):
        if texts.dtype != object:  # a column of numbers or of pandas' string dtype
            return False
    elif isinstance(texts, np.ndarray):
        if texts.ndim != 1 or texts.dtype != object:
            return False
    elif isinstance(texts, (str, bytes)) or not isinstance(texts, collections.abc.Sequence):
        return False
    for item in texts:  # by position; the first present item tells (a missing one is a bad input of either kind)
        if not _missing(item):
            return _is_id_row(item)
    return False


def split_bad_rows(texts: Any, on_bad_input: str = "raise", *,
                   texts_name: str = "texts") -> tuple[list, np.ndarray]:
    """``(rows, bad)``: pre-tokenized ``texts`` as a list with ``[]`` in place of every item that is not a row of ids
    (``None``, a pandas NaN, a str), and the ``int64`` positions of those items, which ``on_bad_input="raise"``
    refuses with a ``TypeError`` naming the first (as ``texts_name[i]``: the caller's argument), how many there are
    and the first ten positions (as for texts).

    Example:
        >>> rows, bad = split_bad_rows([[1, 2], None, [3]], on_bad_input="skip")
        >>> rows, bad.tolist()
        ([[1, 2], [], [3]], [1])
    """
    rows = list(_by_position(texts))
    bad = np.flatnonzero(np.fromiter((not _is_id_row(row) for row in rows), dtype=bool, count=len(rows)))
    if bad.size and on_bad_input == "raise":
        first = int(bad[0])
        refusal = bad_type(f"{texts_name}[{first}]", "a row of int token ids, like the other rows", rows[first])
        raise bad_input_error(refusal, bad, len(rows), "rows are not rows of token ids")
    log_skipped(bad, len(rows), "rows that are not rows of token ids")
    for position in bad.tolist():
        rows[position] = []
    return rows, bad


def _flat_ids(rows: list[Any], texts_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every row's ids in one integer array, and the rows' lengths; a TypeError names the first bad row (of the
    caller's argument ``texts_name``)."""
    for i, row in enumerate(rows):
        if not _is_id_row(row):
            raise bad_type(f"{texts_name}[{i}]", f"a row of int token ids, like {texts_name}[0]", row)
    rows = [row.tolist() if not isinstance(row, (list, tuple)) else row for row in rows]  # arrays, tensors
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    ids = list(itertools.chain.from_iterable(rows))
    try:
        flat = np.array(ids)
    except ValueError:  # ids that are themselves sequences, of several lengths
        flat = None
    if flat is None or flat.ndim != 1:  # ids that are sequences (rows of rows): the loop below names the first
        flat = np.empty(len(ids), dtype=object)
        for k, value in enumerate(ids):
            flat[k] = value
    if flat.size and (flat.dtype == bool or not np.issubdtype(flat.dtype, np.integer)):
        for i, row in enumerate(rows):
            for j, value in enumerate(row):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise bad_type(f"{texts_name}[{i}][{j}]", "an int token id", value)
    return flat, lengths  # its ints as they are (uint64, Python ints): checked for range before any cast


def store_token_ids(
    texts: Any, max_input_token_length: int, *, truncation_side: str = "right", texts_name: str = "texts"
) -> TokenizedTexts:
    """Pre-tokenized rows into the token store, truncated to ``max_input_token_length`` as a tokenizer truncates.

    Each row is taken as it is (no special tokens are added); a row longer
    than the limit keeps its first ``max_input_token_length`` ids, or its last
    with ``truncation_side="left"`` (pass the tokenizer's ``truncation_side``).

    Args:
        texts: one row of token ids per text: lists or tuples of int, 1-D
            integer numpy arrays or tensors (a sequence of them, not mixed with str).
        max_input_token_length: the truncation limit, in tokens.
        truncation_side: ``"right"`` or ``"left"``.
        texts_name: what an error calls ``texts`` (the caller's own argument holding them: ``dynabatch.generate``'s
            ``"prompts"``).

    Returns:
        The token store, without extras.

    Raises:
        TypeError: ``texts`` is not such a sequence, a row is not a row of ids,
            or an id is not an int (the message names its position).
        ValueError: empty ``texts``, a negative id or one above the store's
            ``int32``, or a bad limit or ``truncation_side``.

    Example:
        >>> tokens = store_token_ids([[1, 5, 6, 2], [1, 2], []], 3)
        >>> tokens.lengths.tolist(), tokens.row(0).tolist()
        ([3, 2, 0], [1, 5, 6])
        >>> store_token_ids([[1, 5, 6, 2]], 3, truncation_side="left").row(0).tolist()
        [5, 6, 2]
    """
    texts = _by_position(texts)
    if isinstance(texts, (str, bytes)) or not isinstance(texts, collections.abc.Sequence):
        raise bad_type(texts_name, _IDS_RULE, texts)
    if not len(texts):
        raise bad_value(texts_name, _IDS_RULE, texts)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    if truncation_side not in ("right", "left"):
        raise bad_value("truncation_side", "'right' or 'left'", truncation_side)
    flat, lengths = _flat_ids(list(texts), texts_name)
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(np.int32).max):
        at = int(np.flatnonzero((flat < 0) | (flat > np.iinfo(np.int32).max))[0])
        row = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        column = at - int(lengths[:row].sum())
        raise bad_value(f"{texts_name}[{row}][{column}]", "a token id in [0, 2**31)", int(flat[at]))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    kept = np.minimum(lengths, max_input_token_length)
    if truncation_side == "left":
        starts = starts + lengths - kept
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(kept, out=offsets[1:])
    # positions of the kept ids in ``flat``: each row's start, then consecutive ids
    take = np.repeat(starts - offsets[:-1], kept) + np.arange(offsets[-1])
    logger.debug("stored %d pre-tokenized rows (%d ids, %d truncated)", len(lengths), offsets[-1],
                 int((lengths > kept).sum()))
    return TokenizedTexts(input_ids=flat[take].astype(np.int32), offsets=offsets)

"""Padding batches straight from the token store.

A :class:`TokenCollator` turns the input positions of one batch into a
:class:`Batch`: ``input_ids``, ``attention_mask`` and every extra of the store
(e.g. ``token_type_ids``) as ``torch.long`` tensors padded to the batch's
longest row, on the right or on the left. It is built with a handful of numpy
operations per batch (no Python loop per row or token), pickles for DataLoader
workers, and gives what ``tokenizer(batch_texts, padding=True, truncation=True,
max_length=..., return_tensors="pt")`` would give, without tokenizing again.

Example:
    >>> from transformers import AutoTokenizer
    >>> from dynabatch.data.collate import TokenCollator
    >>> from dynabatch.demo import minilm_path
    >>> from dynabatch.data.tokenization import tokenize_texts
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> texts = ["In the beginning", "", "And God said"]
    >>> collate = TokenCollator.from_tokenizer(tokenize_texts(texts, tokenizer, 8), tokenizer, texts=texts)
    >>> batch = collate([2, 1])
    >>> batch["input_ids"].tolist()
    [[101, 1998, 2643, 2056, 102], [101, 102, 0, 0, 0]]
    >>> batch["attention_mask"].sum(dim=1).tolist(), batch.indices.tolist(), batch.texts
    ([5, 2], [2, 1], ['And God said', ''])
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.tokenization import TokenizedTexts, validate_texts

__all__ = [
    "Batch",
    "TokenCollator",
    "batch_shape",
    "pad_token_id_of",
    "padded_width",
    "real_tokens",
    "split_rows",
    "take_rows",
]

logger = logging.getLogger(__name__)

_PADDING_SIDES = ("right", "left")


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad token id; a clear error, with the usual fix, when it has none."""
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if pad_token_id is None:
        raise ValueError(
            "tokenizer should have a pad token (set one, e.g. tokenizer.pad_token = tokenizer.eos_token), "
            "but got tokenizer.pad_token_id=None"
        )
    return pad_token_id


class Batch(dict):
    """A mapping of tensors padded to the batch's longest row, plus where its rows came from.

    The mapping holds ``input_ids``, ``attention_mask`` and the extras (e.g.
    ``token_type_ids``), tensors only, so ``model(**batch)`` and
    ``model.generate(**batch)`` work.

    Attributes:
        indices: ``torch.long`` tensor of the rows' input positions (what
            :func:`dynabatch.data.order.restore_order` takes back).
        texts: the rows' input texts, or ``None`` when the collator had none.
    """

    def __init__(
        self,
        data: Mapping[str, torch.Tensor] | None = None,
        *,
        indices: torch.Tensor | None = None,
        texts: list[str] | None = None,
    ) -> None:
        super().__init__(data or {})
        self.indices = indices
        self.texts = texts

    def __missing__(self, key: Any) -> Any:
        # dynabatch 0.1.6 documented a "texts" key; here the rows' texts and positions are attributes, so that
        # model(**batch) takes the mapping as it is: a lookup of either key says where it is
        if key in ("texts", "indices"):
            raise KeyError(f"{key!r} is not a key of a dynabatch Batch (the mapping holds only tensors, so "
                           f"model(**batch) takes it): read batch.{key}")
        raise KeyError(key)

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        """Returns a new batch with every tensor of the mapping moved to ``device``.

        ``indices`` and ``texts`` are kept as they are (``indices`` stays on the CPU).
        """
        moved = {key: value.to(device, non_blocking=non_blocking) for key, value in self.items()}
        return Batch(moved, indices=self.indices, texts=self.texts)

    def pin_memory(self) -> Batch:
        """Returns a new batch with every tensor of the mapping in pinned memory (DataLoader's ``pin_memory``)."""
        pinned = {key: value.pin_memory() for key, value in self.items()}
        return Batch(pinned, indices=self.indices, texts=self.texts)


class TokenCollator:
    """Builds padded :class:`Batch` es from a :class:`~dynabatch.data.tokenization.TokenizedTexts`.

    Args:
        tokenized: the token store of all texts.
        pad_token_id: the id written into the padding of ``input_ids``.
        padding_side: ``"right"`` or ``"left"`` (decoder-only generation wants left).
        pad_to_multiple_of: round each batch's width up to a multiple of this.
        texts: the input texts, one per row of ``tokenized``; when given,
            ``batch.texts`` lists the rows' texts.
        pad_values: pad value of each extra (default 0), e.g.
            ``{"token_type_ids": 0}``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a bad ``padding_side``, ``texts`` of another length than
            ``tokenized``, or ``pad_values`` naming a key the store lacks.
    """

    def __init__(
        self,
        tokenized: TokenizedTexts,
        *,
        pad_token_id: int,
        padding_side: str = "right",
        pad_to_multiple_of: int | None = None,
        texts: list[str] | None = None,
        pad_values: dict[str, int] | None = None,
    ) -> None:
        if not isinstance(tokenized, TokenizedTexts):
            raise bad_type("tokenized", "a TokenizedTexts (from tokenize_texts)", tokenized)
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral):
            raise bad_type("pad_token_id", "an int", pad_token_id)
        if padding_side not in _PADDING_SIDES:
            raise bad_value("padding_side", "'right' or 'left'", padding_side)
        if pad_to_multiple_of is not None:
            pad_to_multiple_of = check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
        if texts is not None:
            texts = validate_texts(texts)
            if len(texts) != len(tokenized):
                raise bad_value("len(texts)", f"len(tokenized)={len(tokenized)}", len(texts))
        pad_values = dict(pad_values or {})
        for key, value in pad_values.items():
            if key not in tokenized.extras:
                raise bad_value(
                    "pad_values", f"a dict over the extras of tokenized {sorted(tokenized.extras)}", pad_values
                )
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise bad_type(f"pad_values[{key!r}]", "an int", value)

        self.tokenized = tokenized
        self.pad_token_id = int(pad_token_id)
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.texts = texts
        self.pad_values = {key: int(pad_values.get(key, 0)) for key in tokenized.extras}

    @classmethod
    def from_tokenizer(
        cls,
        tokenized: TokenizedTexts,
        tokenizer: Any,
        *,
        texts: list[str] | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> TokenCollator:
        """A collator padding as ``tokenizer`` would: its ``pad_token_id`` and ``padding_side``.

        ``token_type_ids`` are padded with ``tokenizer.pad_token_type_id`` when
        the tokenizer has one.

        Raises:
            ValueError: the tokenizer has no pad token.
        """
        pad_token_id = pad_token_id_of(tokenizer)
        pad_values = {}
        pad_token_type_id = getattr(tokenizer, "pad_token_type_id", None)
        if "token_type_ids" in tokenized.extras and isinstance(pad_token_type_id, numbers.Integral):
            pad_values["token_type_ids"] = int(pad_token_type_id)
        return cls(
            tokenized,
            pad_token_id=pad_token_id,
            padding_side=getattr(tokenizer, "padding_side", "right"),
            pad_to_multiple_of=pad_to_multiple_of,
            texts=texts,
            pad_values=pad_values,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(texts={len(self.tokenized)}, pad_token_id={self.pad_token_id}, "
            f"padding_side={self.padding_side!r}, pad_to_multiple_of={self.pad_to_multiple_of})"
        )

    def _positions(self, positions: Sequence[int]) -> np.ndarray:
        if isinstance(positions, torch.Tensor):
            positions = positions.detach().cpu().numpy()
        pos = np.asarray(positions)
        if pos.ndim != 1 or (pos.size and not np.issubdtype(pos.dtype, np.integer)):
            raise bad_type("positions", "a sequence of int", positions)
        if pos.size == 0:
            raise bad_value("positions", "a non-empty sequence of input positions", positions)
        n = len(self.tokenized)
        outside = np.flatnonzero((pos < 0) | (pos >= n))
        if outside.size:
            j = int(outside[0])
            raise bad_value(f"positions[{j}]", f"an input position in range({n})", int(pos[j]))
        return pos.astype(np.int64, copy=False)

    def __call__(self, positions: Sequence[int]) -> Batch:
        """Pads the rows at ``positions`` (one batch, in the order given) into a :class:`Batch`."""
        pos = self._positions(positions)
        offsets = self.tokenized.offsets
        starts = offsets[pos]
        lengths = offsets[pos + 1] - starts
        rows = len(pos)
        width = padded_width(int(lengths.max()), self.pad_to_multiple_of)

        # The real cells of the padded rectangle, row by row, are exactly the
        # rows' tokens in order (on either side), so one gather from the store
        # and one boolean-mask assignment fill it; the mask is the attention mask.
        columns = np.arange(width, dtype=np.int64)
        if self.padding_side == "left":
            mask = columns >= (width - lengths)[:, None]
        else:
            mask = columns < lengths[:, None]
        before = np.zeros(rows, dtype=np.int64)
        np.cumsum(lengths[:-1], out=before[1:])
        source = np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)

        def padded(values: np.ndarray, pad: int) -> torch.Tensor:
            out = np.full((rows, width), pad, dtype=np.int64)
            out[mask] = values[source]
            return torch.from_numpy(out)

        data = {
            "input_ids": padded(self.tokenized.input_ids, self.pad_token_id),
            "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        }
        for key, values in self.tokenized.extras.items():
            data[key] = padded(values, self.pad_values[key])
        texts = None if self.texts is None else [self.texts[i] for i in pos.tolist()]
        return Batch(data, indices=torch.from_numpy(pos.copy()), texts=texts)


def padded_width(longest: Any, pad_to_multiple_of: int | None = None) -> Any:
    """The width a batch is padded to: its longest row, rounded up to ``pad_to_multiple_of`` when given.

    ``longest`` may be an int or a numpy array of them (one per batch).

    Example:
        >>> padded_width(13), padded_width(13, 8), padded_width(0, 8)
        (13, 16, 0)
    """
    if isinstance(longest, np.ndarray):
        return longest if not pad_to_multiple_of else -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    if not pad_to_multiple_of:
        return int(longest)
    return -(-int(longest) // pad_to_multiple_of) * pad_to_multiple_of


def batch_shape(batch: Any) -> tuple[int, int]:
    """``(rows, width)`` of a collated batch: its rows and its padded length.

    A :class:`Batch` counts its ``indices``; any other mapping of tensors the
    first dimension of its ``input_ids`` (else ``attention_mask``, else its
    first tensor). The width is the second dimension of ``attention_mask`` or
    ``input_ids`` (else the widest 2-D tensor; 1 for a batch without one).

    Example:
        >>> import torch
        >>> batch_shape({"input_ids": torch.zeros(4, 16, dtype=torch.long)})
        (4, 16)
    """
    if not isinstance(batch, Mapping):
        raise bad_type("batch", "a dict holding an input_ids tensor (rows x padded length)", batch)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim >= 1}
    indices = getattr(batch, "indices", None)
    if indices is not None:
        rows = len(indices)
    else:
        first = next((tensors[k] for k in ("input_ids", "attention_mask") if k in tensors), None)
        if first is None and tensors:
            first = next(iter(tensors.values()))
        if first is None:
            raise bad_type("batch", "a dict holding an input_ids tensor (rows x padded length)", batch)
        rows = int(first.shape[0])
    for key in ("attention_mask", "input_ids"):
        value = tensors.get(key)
        if value is not None and value.ndim >= 2:
            return rows, int(value.shape[1])
    widths = [int(v.shape[1]) for v in tensors.values() if v.ndim >= 2]
    return rows, max(widths, default=0 if indices is not None else 1)


def real_tokens(batch: Batch) -> int:
    """Tokens that are not padding: the attention mask's sum (rows x width without a mask)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    rows, width = batch_shape(batch)
    return rows * width


def take_rows(
    batch: Mapping[str, Any],
    rows: Sequence[int] | torch.Tensor,
    *,
    padding_side: str | None = None,
    pad_to_multiple_of: int | None = None,
    trim: bool = True,
) -> Any:
    """The batch of the given rows (row numbers within ``batch``), trimmed to its longest row.

    The one way dynabatch cuts a collated batch (an out-of-memory split at
    inference or in training, a rank's share). Every tensor of the mapping
    whose first dimension is the batch's rows is indexed on it, and so is every
    list of one item per row (per-row metadata such as ``task_type``) and a
    :class:`Batch`'s ``indices`` and ``texts``. The width is then cut to the
    columns the attention mask uses (the columns of the padding side go),
    rounded up to ``pad_to_multiple_of`` when given: what collating those rows
    would give, with left or right padding.

    Args:
        batch: a :class:`Batch`, or any mapping of tensors (and per-row lists).
        rows: row numbers within ``batch``, in the order wanted.
        padding_side: ``"left"`` or ``"right"``; ``None`` infers it from the mask.
        pad_to_multiple_of: the collator's rounding of widths, if any.
        trim: ``False`` keeps every column (a training split: labels of
            another width, positions counted from the first column, stay as
            collated).

    Returns:
        A :class:`Batch` for a :class:`Batch`, else a ``dict``.
    """
    n, width = batch_shape(batch)
    index = torch.as_tensor(rows, dtype=torch.long)
    picked = index.tolist()
    data: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n:
            value = value[index.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            value = [value[i] for i in picked]
        data[key] = value
    mask = data.get("attention_mask")
    if trim and isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[1] == width and len(index):
        used = torch.nonzero(mask.bool().any(dim=0)).flatten().tolist()
        first, stop = (used[0], used[-1] + 1) if used else (0, 0)
        keep = min(width, max(1, padded_width(stop - first, pad_to_multiple_of)))
        left = padding_side == "left" if padding_side is not None else first > 0
        start = max(0, stop - keep) if left else min(first, width - keep)
        if keep < width:
            for key, value in data.items():
                if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == width:
                    data[key] = value[:, start : start + keep]
    if not isinstance(batch, Batch):
        return data
    texts = None if batch.texts is None else [batch.texts[i] for i in picked]
    return Batch(data, indices=torch.as_tensor(batch.indices, dtype=torch.long)[index], texts=texts)


def split_rows(batch: Mapping[str, Any], sizes: Sequence[int], *, padding_side: str | None = None,
               pad_to_multiple_of: int | None = None, trim: bool = True) -> list[Any]:
    """``batch`` cut into consecutive row groups of ``sizes`` (each trimmed unless ``trim=False``, see
    :func:`take_rows`).

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0], [9, 9, 0]]),
        ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]), "task": ["a", "b", "c"]}
        >>> [(p["input_ids"].tolist(), p["task"]) for p in split_rows(batch, [1, 2])]
        [([[5, 6, 7]], ['a']), ([[8, 0], [9, 9]], ['b', 'c'])]
    """
    rows, _ = batch_shape(batch)
    if sum(sizes) != rows or any(size < 1 for size in sizes):
        raise bad_value("sizes", f"positive row counts summing to the batch's {rows} rows", list(sizes))
    bounds = np.cumsum([0, *sizes]).tolist()
    options = {"padding_side": padding_side, "pad_to_multiple_of": pad_to_multiple_of, "trim": trim}
    return [take_rows(batch, range(a, b), **options) for a, b in pairwise(bounds)]

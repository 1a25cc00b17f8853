"""The row rule, stated in full as a table in ``docs/inference.md`` ("What ``fn`` may return"): :class:`RowSplitter`
turns what ``fn(batch)`` returned into one item per row, on the CPU, never depending on the batch's size or texts.

Example:
    >>> import torch
    >>> from dynabatch.data.collate import Batch
    >>> from dynabatch.inference.outputs import split_rows
    >>> batch = Batch({"input_ids": torch.tensor([[0, 7, 8], [0, 0, 9]]),
    ...                "attention_mask": torch.tensor([[0, 1, 1], [0, 0, 1]])}, indices=torch.tensor([4, 2]))
    >>> generated = torch.tensor([[0, 7, 8, 5, 0], [0, 0, 9, 6, 3]])  # the prompt echoed, then new tokens
    >>> [row.tolist() for row in split_rows(generated, batch, pad_token_id=0)]
    [[7, 8, 5], [9, 6, 3]]
    >>> tags = torch.tensor([[0, 3, 0], [0, 0, 0]])  # per-token labels; label 0 equals the pad id
    >>> [row.tolist() for row in split_rows(tags, batch, pad_token_id=0, token_outputs="per_token")]
    [[3, 0], [0]]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_choice

__all__ = ["TOKEN_OUTPUTS", "PerRow", "RowSplitter", "split_rows", "to_cpu"]

logger = logging.getLogger(__name__)

TOKEN_OUTPUTS = ("auto", "per_token", "generated", "whole")
"""The values of ``run(token_outputs=...)``: how token-shaped tensors are read (the module's rule)."""

_PER_TOKEN, _GENERATED, _ROW = "per-token", "generated", "per-row"


class PerRow(list):
    """What ``fn(batch)`` returns to say "one item per row, as given" where a list would be ambiguous (a list of
    tensors whose first dimension happens to equal the number of rows): no tensor in it is sliced or cut.

    Example:
        >>> from dynabatch import PerRow
        >>> PerRow(["first row", "second row"])
        ['first row', 'second row']
    """


def to_cpu(item: Any) -> Any:
    """Tensors (also inside plain lists, tuples and dicts) detached, on the CPU and compact (not a view keeping a much
    larger storage alive); other values as they are."""
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu()
        view = item.layout == torch.strided and item.untyped_storage().nbytes() > item.numel() * item.element_size()
        return item.clone() if view else item
    if type(item) in (list, tuple, PerRow):
        return type(item)(to_cpu(x) for x in item)
    if type(item) is dict:
        return {key: to_cpu(value) for key, value in item.items()}
    return item


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _batch_first(value: Any, n: int) -> bool:
    return _is_array(value) and value.ndim >= 1 and value.shape[0] == n


def _holds_batched(value: Any, n: int) -> bool:
    """Whether a container is made of batch-first tensors (``hidden_states``), so it splits per element."""
    if isinstance(value, PerRow):
        return False
    items = list(value.values()) if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else []
    return any(_batch_first(v, n) for v in items) and all(_batch_first(v, n) or v is None for v in items)


def _batch_first_hint(value: torch.Tensor | np.ndarray, n: int, name: str) -> str:
    """What to do with a tensor whose dimension 0 is not the batch's rows: move the dimension that is (a
    sequence-first model's ``(W, n, H)``), or return rows (a value of the whole batch goes beside them)."""
    dims = [d for d in range(1, value.ndim) if value.shape[d] == n]
    if dims:
        return f": its dimension {dims[0]} has {n}; move it first (e.g. {name}.transpose(0, {dims[0]}))"
    return (": return one row per batch row (a value of the whole batch, such as a loss, is left out when it "
            "stands beside the rows in a dict or tuple), or dynabatch.PerRow(items) with one item per row")


def _is_integer(value: torch.Tensor | np.ndarray) -> bool:
    if isinstance(value, np.ndarray):
        return np.issubdtype(value.dtype, np.integer)
    return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


class _BatchView:
    """What the rule reads of one batch (a ``dict`` of tensors with ``.indices``): its rows, width, input ids and
    real-token mask."""

    def __init__(self, batch: Any) -> None:
        self.n = len(batch.indices)
        inputs, mask = batch.get("input_ids"), batch.get("attention_mask")
        self.inputs = inputs if isinstance(inputs, torch.Tensor) and inputs.ndim == 2 else None
        mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
        self.real = None if mask is None else mask.detach().cpu().numpy().astype(bool)
        shaped = self.inputs if mask is None else mask
        self.width = None if shaped is None else shaped.shape[1]

    @cached_property
    def spans(self) -> list[slice | np.ndarray]:
        """Each row's real columns: a slice where they are contiguous, else their indices."""
        spans: list[slice | np.ndarray] = []
        for row in self.real:
            columns = np.flatnonzero(row)
            contiguous = columns.size > 0 and columns[-1] - columns[0] + 1 == columns.size
            spans.append(slice(int(columns[0]), int(columns[-1]) + 1) if contiguous else columns)
        return spans

    def echoes(self, value: torch.Tensor | np.ndarray) -> bool:
        """Whether ``value`` starts with the batch's ``input_ids`` (a decoder-only model echoes its prompt)."""
        if self.inputs is None or value.ndim != 2 or value.shape[1] < self.inputs.shape[1]:
            return False
        head = torch.as_tensor(value[:, : self.inputs.shape[1]])
        return torch.equal(head, self.inputs.detach().cpu().to(head.dtype))


class RowSplitter:
    """The row rule of one run, each field's reading fixed at its first batch.

    Args:
        pad_token_id: the pad id a generated sequence's padding is made of; ``None`` keeps generated rows whole.
        token_outputs: one of :data:`TOKEN_OUTPUTS`.
        padding_side: the batches' padding side (``None``: unknown); generated ids that continue right-padded
            prompts warn once.
    """

    def __init__(self, pad_token_id: int | None = None, token_outputs: str = "auto",
                 padding_side: str | None = None) -> None:
        check_choice("token_outputs", token_outputs, TOKEN_OUTPUTS)
        self.pad_token_id = pad_token_id
        self.token_outputs = token_outputs
        self.padding_side = padding_side
        self.kinds: dict[str, tuple[str, int | None]] = {}  # field -> (reading, the width it was read at)
        self._warned_right_padding = False

    def split(self, output: Any, batch: Any, name: str = "fn(batch)") -> list:
        """One item per row of ``batch`` (``len(batch.indices)`` items); tensors detached and on the CPU.

        Raises:
            TypeError: an output of a kind the rule does not know.
            ValueError: rows that do not match the batch's, an ambiguous output, or one contradicting its first reading.
        """
        view = _BatchView(batch)
        if output is None:
            return [None] * view.n
        if not (_is_array(output) or isinstance(output, (Mapping, list, tuple))):
            raise bad_type(name, "a tensor with a batch dimension, a tuple, list or dict of such tensors, a list "
                           "with one item per row, a dynabatch.PerRow, a ModelOutput or None", output)
        return self._split(output, view, name, field=False)

    def varying(self, row: Any, name: str = "fn(batch)", path: tuple = ()) -> list[tuple]:
        """The paths (keys and indices; ``()``: the row itself) of the tensors of ``row`` (as :meth:`split` gave it)
        whose first dimension varies from row to row (per-token or generated, or given one per row): a results store
        types its columns by them, whatever lengths its first rows have (the longest texts, often cut to one)."""
        if isinstance(row, Mapping):
            items = row.items()
        elif isinstance(row, (list, tuple)) and any(_is_array(v) or isinstance(v, (Mapping, list, tuple)) for v in row):
            items = enumerate(row)
        else:
            kind = self.kinds.get(name)  # None: an item given one per row (PerRow, a list)
            return [path] if _is_array(row) and (kind is None or kind[0] in (_PER_TOKEN, _GENERATED)) else []
        return [found for key, value in items for found in self.varying(value, f"{name}[{key!r}]", (*path, key))]

    def _split(self, value: Any, view: _BatchView, name: str, *, field: bool) -> list | None:
        """One item per row, or ``None`` for a ``field`` (an element of a container) with nothing per row: a loss
        over the batch, a cache object, ``None`` or an empty list."""
        n = view.n
        if isinstance(value, PerRow):
            if len(value) != n:
                raise bad_value(f"len({name})", f"{n} (a PerRow holds one item per batch row)", len(value))
            return [to_cpu(item) for item in value]
        if _is_array(value):
            if _batch_first(value, n):
                return self._tensor_rows(value, view, name)
            if field and value.ndim == 0:
                return None
            raise ValueError(str(bad_value(f"{name}.shape", f"a batch dimension first ({n} rows, one per batch row)",
                                           tuple(value.shape))) + _batch_first_hint(value, n, name))
        if isinstance(value, Mapping):
            columns = {key: self._split(item, view, f"{name}[{key!r}]", field=True) for key, item in value.items()}
            columns = {key: column for key, column in columns.items() if column is not None}
            return [{key: column[r] for key, column in columns.items()} for r in range(n)]
        if isinstance(value, (list, tuple)):
            return self._sequence_rows(value, view, name, field=field)
        return None  # a field without rows (split lets no other value through)

    def _sequence_rows(self, value: list | tuple, view: _BatchView, name: str, *, field: bool) -> list | None:
        n = view.n
        batched = [_batch_first(item, n) or _holds_batched(item, n) for item in value]
        if any(batched) and all(b or item is None for b, item in zip(batched, value)):
            if isinstance(value, tuple) or len(value) != n:  # one field per element
                parts = [self._split(item, view, f"{name}[{i}]", field=True) for i, item in enumerate(value)]
                kind = tuple if isinstance(value, tuple) else list
                return [kind(None if part is None else part[r] for part in parts) for r in range(n)]
            raise ValueError(
                f"{name} should say how it splits into rows, but got a list of {n} tensors for a batch of {n} "
                f"rows, each with {n} rows itself: one item per row, or one field per element? return a tuple of "
                "batch-first tensors (one field per element), or dynabatch.PerRow(items) for one item per row"
            )
        if len(value) == n:
            return [to_cpu(item) for item in value]
        if field and not value:
            return None
        if any(batched):
            i = batched.index(False)
            raise bad_value(f"{name}[{i}]", f"a tensor with a batch dimension first ({n} rows) like the other "
                            f"elements of {name}, or None", value[i])
        raise bad_value(f"len({name})", f"{n} (one item per batch row), or a tuple of tensors with {n} rows each",
                        len(value))

    def _tensor_rows(self, value: torch.Tensor | np.ndarray, view: _BatchView, name: str) -> list:
        value = to_cpu(value)  # a numpy array as it is
        kind = self._reading(value, view, name)
        if kind == _PER_TOKEN:
            return [value[r, span] for r, span in enumerate(view.spans)]
        if kind == _GENERATED:
            self._warn_right_padding(value, view)
            if self.pad_token_id is not None:
                return _generated_rows(value, view, self.pad_token_id)
        return list(value)  # a tensor's rows: its unbind(0)

    def _reading(self, value: torch.Tensor | np.ndarray, view: _BatchView, name: str) -> str:
        """How ``value``'s rows are read: at the field's first batch declared, or certain, or refused as ambiguous;
        checked against that at every later batch."""
        width, mode = view.width, self.token_outputs
        token_shaped = value.ndim >= 2 and width is not None and value.shape[1] == width
        if name in self.kinds:
            kind, first_width = self.kinds[name]
            if kind == _PER_TOKEN and not token_shaped:
                raise ValueError(
                    f"{name}.shape[1] should be the batch's width {width}, as at its first batch (width "
                    f"{first_width}, where it was read as per-token and cut by the attention mask), but got "
                    f"{name}.shape[1]={value.shape[1] if value.ndim >= 2 else None}: if it is not a per-token output "
                    "(a pooled vector, generated ids), pass token_outputs='generated' or 'whole' to run, or return "
                    "dynabatch.PerRow(rows)"
                )
            return kind
        integer_2d = value.ndim == 2 and _is_integer(value)
        if mode == "whole":
            kind = _ROW
        elif mode != "per_token" and integer_2d and (mode == "generated" or view.echoes(value)):
            kind = _GENERATED  # declared, or echoing the prompt: a decoder-only model's generate
        elif mode != "per_token" and token_shaped and value.ndim == 2:
            raise ValueError(
                f"{name} should say how its rows are read, but got a 2-D tensor of shape {tuple(value.shape)} "
                f"whose dimension 1 equals the batch's width {width}: one value per token, or one vector per "
                "row that happens to be as wide? Pass token_outputs='per_token' to cut each row to its real "
                "tokens by the attention mask, token_outputs='whole' to keep each row whole (a pooled vector)"
                + (", or token_outputs='generated' for generated ids (padding stripped)" if integer_2d else "")
            )
        else:
            kind = _PER_TOKEN if token_shaped else _ROW
        self.kinds[name] = (kind, width)
        if kind == _PER_TOKEN and view.real is None:
            raise ValueError(
                f"{name} should be cut to each row's real tokens (its dimension 1 is the batch's width "
                f"{width}), but got a batch without an attention_mask to cut it by: add one to the batches, "
                "or pass token_outputs='whole' to keep rows as they are"
            )
        return kind

    def _warn_right_padding(self, value: torch.Tensor | np.ndarray, view: _BatchView) -> None:
        if (self._warned_right_padding or self.padding_side != "right" or view.real is None
                or view.real[:, -1].all() or not view.echoes(value)):
            return
        self._warned_right_padding = True
        logger.warning(
            "fn(batch) returned generated ids that continue right-padded prompts: a decoder-only model then "
            "generates after pad tokens, and its replies are wrong; pad on the left (tokenizer.padding_side = "
            "'left' before building the loader, or dynabatch.generate, which does it for you)"
        )


def _generated_rows(value: torch.Tensor | np.ndarray, view: _BatchView, pad: int) -> list:
    """Rows of generated ids less the batch's padding: trailing pad ids, and leading ones only where the tensor echoes
    the batch's ``input_ids`` (a decoder-only ``generate``), and then only the row's own left padding (an
    encoder-decoder's start token equal to the pad id stays, and pad ids between real tokens always stay)."""
    start = np.zeros(view.n, dtype=np.int64)
    if view.real is not None and view.echoes(value):  # each row's own left padding, in the echoed prompt
        start = np.where(view.real.any(axis=1), view.real.argmax(axis=1), view.real.shape[1])
    real = np.asarray(value != pad)
    end = np.where(real.any(axis=1), real.shape[1] - real[:, ::-1].argmax(axis=1), 0)  # after the last real id
    return [row[a:b] for row, a, b in zip(value, start.tolist(), np.maximum(start, end).tolist())]


def split_rows(output: Any, batch: Any, *, pad_token_id: int | None = None, token_outputs: str = "auto",
               name: str = "fn(batch)") -> list:
    """:meth:`RowSplitter.split` for one batch (``name``: how error messages call ``output``); a run keeps one
    :class:`RowSplitter`, so that each field's reading is fixed by its first batch."""
    return RowSplitter(pad_token_id, token_outputs).split(output, batch, name)

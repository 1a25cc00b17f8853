"""Per-row pieces of batches and of batch outputs, for :func:`dynabatch.inference.runner.run`.

* :func:`split_rows` turns what a callable returned for a batch (a tensor, a
  list or tuple, a dict or ``ModelOutput``) into one item per row, on the CPU,
  with the batch's padding taken off token-id rows (``generate`` outputs).
* :func:`take_rows` and :func:`halves` cut rows out of a :class:`~dynabatch.data.collate.Batch`
  and trim its width to the longest row left, as collating those rows would.
* :func:`to_json_value` turns a row into what ``json`` stores.

Example:
    >>> import torch
    >>> from dynabatch.data.collate import Batch
    >>> from dynabatch.inference._rows import halves, split_rows
    >>> batch = Batch({"input_ids": torch.tensor([[0, 7, 8], [0, 0, 9]]),
    ...                "attention_mask": torch.tensor([[0, 1, 1], [0, 0, 1]])}, indices=torch.tensor([4, 2]))
    >>> generated = torch.tensor([[0, 7, 8, 5, 0], [0, 0, 9, 6, 3]])  # the prompt echoed, then new tokens
    >>> [row.tolist() for row in split_rows(generated, batch, pad_token_id=0)]
    [[7, 8, 5], [9, 6, 3]]
    >>> first, second = halves(batch)
    >>> second["input_ids"].tolist(), second.indices.tolist()
    ([[9]], [2])
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.data.collate import Batch

__all__ = ["batch_shape", "halves", "json_line", "real_tokens", "split_rows", "take_rows", "to_json_value"]


# --- batches ----------------------------------------------------------------------------------------


def batch_shape(batch: Batch) -> tuple[int, int]:
    """``(rows, width)`` of a batch: its number of positions and its padded length."""
    rows = len(batch.indices)
    for key in ("attention_mask", "input_ids"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            return rows, int(value.shape[1])
    widths = [int(v.shape[1]) for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim >= 2]
    return rows, max(widths, default=0)


def real_tokens(batch: Batch) -> int:
    """Tokens that are not padding: the attention mask's sum (rows x width without a mask)."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    rows, width = batch_shape(batch)
    return rows * width


def take_rows(
    batch: Batch,
    rows: Sequence[int] | torch.Tensor,
    *,
    padding_side: str | None = None,
    pad_to_multiple_of: int | None = None,
) -> Batch:
    """The batch of the given rows (row numbers within ``batch``), trimmed to its longest row.

    Every tensor of the mapping whose first dimension is the batch's rows is
    indexed on it, and so are ``indices`` and ``texts``. The width is then cut
    to the columns the attention mask uses (the columns of the padding side go),
    rounded up to ``pad_to_multiple_of`` when given: what collating those rows
    would give.

    Args:
        batch: the batch to take rows from.
        rows: row numbers within ``batch``, in the order wanted.
        padding_side: ``"left"`` or ``"right"``; ``None`` infers it from the mask.
        pad_to_multiple_of: the collator's rounding of widths, if any.
    """
    n, width = batch_shape(batch)
    index = torch.as_tensor(rows, dtype=torch.long)
    data: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n:
            value = value[index.to(value.device)]
        data[key] = value
    mask = data.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[1] == width and len(index):
        used = torch.nonzero(mask.bool().any(dim=0)).flatten().tolist()
        first, stop = (used[0], used[-1] + 1) if used else (0, 0)
        keep = stop - first
        if pad_to_multiple_of:
            keep = min(width, -(-keep // pad_to_multiple_of) * pad_to_multiple_of)
        left = padding_side == "left" if padding_side is not None else first > 0
        start = max(0, stop - keep) if left else min(first, width - keep)
        if keep < width:
            for key, value in data.items():
                if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == width:
                    data[key] = value[:, start : start + keep]
    texts = None if batch.texts is None else [batch.texts[i] for i in index.tolist()]
    return Batch(data, indices=torch.as_tensor(batch.indices, dtype=torch.long)[index], texts=texts)


def halves(
    batch: Batch, *, padding_side: str | None = None, pad_to_multiple_of: int | None = None
) -> tuple[Batch, Batch]:
    """Rows ``[:h]`` and ``[h:]`` (``h = rows // 2``), each trimmed to its longest row (see :func:`take_rows`)."""
    rows, _ = batch_shape(batch)
    if rows < 2:
        raise bad_value("len(batch.indices)", "at least 2 to split a batch in halves", rows)
    h = rows // 2
    options = {"padding_side": padding_side, "pad_to_multiple_of": pad_to_multiple_of}
    return take_rows(batch, range(h), **options), take_rows(batch, range(h, rows), **options)


# --- outputs ----------------------------------------------------------------------------------------


def _compact_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, on the CPU, and not a view keeping a much larger storage alive."""
    tensor = tensor.detach().cpu()
    if tensor.layout == torch.strided and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _is_token_ids(tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _leading_padding(batch: Batch, pad_token_id: int) -> list[int] | None:
    """Padding columns before each row's first token, for a batch's echoed prompt; ``None`` without input_ids."""
    inputs = batch.get("input_ids")
    if not isinstance(inputs, torch.Tensor) or inputs.ndim != 2:
        return None
    mask = batch.get("attention_mask")
    real = mask if isinstance(mask, torch.Tensor) and mask.shape == inputs.shape else inputs != pad_token_id
    real = real.detach().cpu().bool()
    width = real.shape[1]
    any_real = real.any(dim=1)
    first = real.to(torch.int8).argmax(dim=1)  # first real column (0 when the row has none)
    return torch.where(any_real, first, torch.full_like(first, width)).tolist()


def _token_rows(tensor: torch.Tensor, batch: Batch, pad_token_id: int | None) -> list[torch.Tensor]:
    """Rows of a 2-D token-id tensor without the batch's padding.

    Trailing pad ids go. Leading pad ids go only where the tensor starts with
    the batch's ``input_ids`` (a decoder-only ``generate`` echoes the prompt),
    and only the row's own left padding: an encoder-decoder output starting
    with a decoder start token equal to the pad id keeps it, and pad ids
    between real tokens always stay.
    """
    if pad_token_id is None:
        return list(tensor.unbind(0))
    leading = [0] * len(tensor)
    inputs = batch.get("input_ids")
    echoed = (
        isinstance(inputs, torch.Tensor)
        and inputs.ndim == 2
        and tensor.shape[1] >= inputs.shape[1]
        and torch.equal(tensor[:, : inputs.shape[1]], inputs.detach().cpu().to(tensor.dtype))
    )
    if echoed:
        leading = _leading_padding(batch, pad_token_id) or leading
    real = (tensor != pad_token_id).numpy()
    rows = []
    for r, start in enumerate(leading):
        nonpad = np.flatnonzero(real[r, start:])
        stop = start + int(nonpad[-1]) + 1 if nonpad.size else start
        rows.append(tensor[r, start:stop])
    return rows


def _batched(value: Any, n: int) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim >= 1 and value.shape[0] == n


def _split(value: Any, n: int, batch: Batch, pad_token_id: int | None, name: str, *, in_mapping: bool) -> list | None:
    """One item per row of ``value``, or ``None`` for a mapping value without a batch dimension."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 and in_mapping:
            return None  # e.g. a loss over the batch: no per-row value
        if value.ndim == 0 or value.shape[0] != n:
            shape = tuple(value.shape)
            raise bad_value(f"{name}.shape", f"a batch dimension first ({n} rows, one per batch row)", shape)
        value = _compact_cpu(value)
        return _token_rows(value, batch, pad_token_id) if _is_token_ids(value) else list(value.unbind(0))
    if isinstance(value, np.ndarray):
        if value.ndim == 0 and in_mapping:
            return None
        if value.ndim == 0 or value.shape[0] != n:
            raise bad_value(f"{name}.shape", f"a batch dimension first ({n} rows, one per batch row)", value.shape)
        return list(value)
    if isinstance(value, Mapping):
        columns = {}
        for key, item in value.items():
            split = None if item is None else _split(item, n, batch, pad_token_id, f"{name}[{key!r}]", in_mapping=True)
            if split is not None:
                columns[key] = split
        return [{key: column[r] for key, column in columns.items()} for r in range(n)]
    if isinstance(value, (list, tuple)):
        items = list(value)
        per_layer = items and all(_batched(item, n) for item in items)
        if len(items) == n and not (in_mapping and per_layer):
            return [_to_cpu(item) for item in items]
        if per_layer:  # e.g. hidden_states: one batched tensor per layer -> one tuple per row
            parts = [
                _split(item, n, batch, pad_token_id, f"{name}[{i}]", in_mapping=False) for i, item in enumerate(items)
            ]
            return [tuple(part[r] for part in parts) for r in range(n)]
        raise bad_value(
            f"len({name})", f"{n} (one item per batch row), or a tuple of tensors with {n} rows each", len(items)
        )
    if in_mapping:
        return None  # e.g. a KV cache object: nothing per row
    raise bad_type(
        name,
        "a tensor with a batch dimension, a list or tuple with one item per row, a dict of batched tensors, "
        "a ModelOutput or None",
        value,
    )


def _to_cpu(item: Any) -> Any:
    if isinstance(item, torch.Tensor):
        return _compact_cpu(item)
    if isinstance(item, (list, tuple)):
        return type(item)(_to_cpu(x) for x in item) if type(item) in (list, tuple) else item
    if isinstance(item, dict) and type(item) is dict:
        return {key: _to_cpu(value) for key, value in item.items()}
    return item


def split_rows(output: Any, batch: Batch, *, pad_token_id: int | None = None, name: str = "fn(batch)") -> list:
    """One item per row of ``batch`` from what a callable returned for it.

    Args:
        output: what the callable returned:

            * a tensor (or numpy array) with the batch dimension first: its rows.
              A 2-D integer tensor is taken as token ids (``generate``): each
              row loses its trailing pad ids, and, when the tensor starts with
              the batch's ``input_ids`` (the prompt a decoder-only model echoes),
              the row's own left padding; pad ids between real tokens stay.
              Return ``list(tensor)`` to keep rows exactly as they are;
            * a list or tuple with one item per row, kept as they are (tensors
              moved to the CPU); a tuple of batched tensors of another length
              (``return_dict=False`` outputs) gives one tuple per row;
            * a dict or ``transformers`` ``ModelOutput`` of batched values: one
              dict per row. Values without a batch dimension (``None``, a
              scalar loss, a cache object) are left out; a tuple of batched
              tensors (``hidden_states``) gives a tuple per row;
            * ``None``: ``None`` for every row.
        batch: the batch the output is for (its rows and ``input_ids``).
        pad_token_id: the pad id of the batch's padding; ``None`` keeps token rows whole.
        name: how error messages call ``output``.

    Returns:
        A list of ``len(batch.indices)`` items; tensors detached and on the CPU.

    Raises:
        TypeError: an output of another kind.
        ValueError: an output whose rows do not match the batch's.
    """
    n = len(batch.indices)
    if output is None:
        return [None] * n
    return _split(output, n, batch, pad_token_id, name, in_mapping=False)


def to_json_value(value: Any, name: str = "result") -> Any:
    """``value`` as ``json`` stores it: tensors and arrays as nested lists, tuples as lists.

    Raises:
        TypeError: a value ``json`` cannot store (the type is named).
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)  # NaN and Infinity too: json writes and reads them
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_json_value(item, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise bad_type(f"{name} keys", "str (JSON object keys)", key)
            out[key] = to_json_value(item, f"{name}[{key!r}]")
        return out
    raise TypeError(
        f"{name} should be JSON-storable with output_path set (a tensor, numpy array, number, str, None, "
        f"or a list or dict of those), but got a {name} of type {type(value).__name__}"
    )


def json_line(record: dict[str, Any]) -> str:
    """One compact JSON line (NaN and Infinity allowed, as ``json`` reads them back)."""
    return json.dumps(record, separators=(",", ":"))

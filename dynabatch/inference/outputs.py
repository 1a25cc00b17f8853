"""Per-row results from what a callable returned for a batch: :func:`split_rows`.

:func:`split_rows` turns a tensor, a list or tuple, a dict or ``ModelOutput``
into one item per row, on the CPU, with the batch's padding taken off token-id
rows (``generate`` outputs).

Example:
    >>> import torch
    >>> from dynabatch.data.collate import Batch
    >>> from dynabatch.inference.outputs import split_rows
    >>> batch = Batch({"input_ids": torch.tensor([[0, 7, 8], [0, 0, 9]]),
    ...                "attention_mask": torch.tensor([[0, 1, 1], [0, 0, 1]])}, indices=torch.tensor([4, 2]))
    >>> generated = torch.tensor([[0, 7, 8, 5, 0], [0, 0, 9, 6, 3]])  # the prompt echoed, then new tokens
    >>> [row.tolist() for row in split_rows(generated, batch, pad_token_id=0)]
    [[7, 8, 5], [9, 6, 3]]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.data.collate import Batch

__all__ = ["split_rows", "to_cpu"]


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
            return [to_cpu(item) for item in items]
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


def to_cpu(item: Any) -> Any:
    """Tensors (also inside plain lists, tuples and dicts) detached, on the CPU and compact; other values as they are."""
    if isinstance(item, torch.Tensor):
        return _compact_cpu(item)
    if isinstance(item, (list, tuple)):
        return type(item)(to_cpu(x) for x in item) if type(item) in (list, tuple) else item
    if isinstance(item, dict) and type(item) is dict:
        return {key: to_cpu(value) for key, value in item.items()}
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

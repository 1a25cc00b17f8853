"""Dynamic padding for training: a batch of feature dicts padded to its own longest row.

:class:`TrainingCollator` is a ``collate_fn`` for a ``DataLoader`` and a
``data_collator`` for the HF ``Trainer``. Each batch is padded only to its
longest row (rounded up to ``pad_to_multiple_of``), so batches of short rows
stay short:

* ``input_ids`` with the pad token, on the tokenizer's padding side;
* ``attention_mask`` built from the rows' lengths (or padded with 0 if given);
* ``labels`` / ``label_ids`` / ``label`` sequences with ``-100`` (ignored by
  the loss), on the same side (a token-classification ``label`` is renamed
  ``labels`` below, so its padding must be -100 too, as transformers'
  ``DataCollatorForTokenClassification`` pads it); with ``labels_from="input_ids"`` (causal LM) the labels are
  a copy of the input ids with the padding, and only the padding, at -100;
* every other sequence field (``token_type_ids``, ...) with 0 (or ``pad_values``);
* numbers and equal-shape tensors (a class label, a float vector) stacked,
  their dtype kept: only integer (or bool) 1-D sequences are token ids to pad; a ``label`` or
  ``label_ids`` field is renamed ``labels`` (what models take), as
  ``transformers.DataCollatorWithPadding`` does.

Example:
    >>> from dynabatch.data.training_collate import TrainingCollator
    >>> collate = TrainingCollator(pad_token_id=0, labels_from="input_ids", pad_to_multiple_of=4)
    >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    >>> batch["input_ids"].tolist()
    [[5, 6, 7, 0], [8, 0, 0, 0]]
    >>> batch["labels"].tolist(), batch["attention_mask"].tolist()
    ([[5, 6, 7, -100], [8, -100, -100, -100]], [[1, 1, 1, 0], [1, 0, 0, 0]])
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import pad_token_id_of, padded_width

__all__ = ["LABEL_KEYS", "LABEL_PAD_ID", "TrainingCollator", "name_labels"]

LABEL_PAD_ID = -100
"""The label the cross-entropy losses of torch and transformers ignore."""

LABEL_KEYS = ("labels", "label_ids", "label")
"""The label fields: their sequences are padded with the label pad id (-100), not 0."""


def name_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """Renames a ``label`` or ``label_ids`` field ``labels`` (what models take), in place.

    The names datasets use, renamed as ``transformers.DataCollatorWithPadding``
    does; a batch that has ``labels`` already keeps its fields as they are.
    """
    for key in ("label", "label_ids"):
        if key in batch and "labels" not in batch:
            batch["labels"] = batch.pop(key)
    return batch


def _as_ids(key: str, value: Any) -> np.ndarray | None:
    """A 1-D int array for a sequence field, ``None`` for a scalar or other value.

    A 1-D tensor or array of floats is not token ids: casting it would cut
    every value to an integer, so it is stacked as it is (``None``).
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex():
            return None
        return value.detach().cpu().numpy().astype(np.int64)
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_):
            return None
        return value.astype(np.int64)
    if isinstance(value, (list, tuple)):
        array = np.asarray(value)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise bad_type(f"features[...][{key!r}]", "a sequence of int token ids", value)
        return array.astype(np.int64)
    return None


class TrainingCollator:
    """Pads a list of feature dicts into a dict of ``torch.long`` tensors (see the module docs).

    Args:
        tokenizer: where ``pad_token_id`` and ``padding_side`` come from when
            not given (a Hugging Face tokenizer).
        pad_token_id: the id padding ``input_ids`` (and ``decoder_input_ids``).
        padding_side: ``"right"`` or ``"left"``; default the tokenizer's, else right.
        pad_to_multiple_of: round every padded width up to a multiple of this
            (tensor cores like multiples of 8).
        label_pad_token_id: what pads labels (default -100).
        labels_from: a field to copy into ``labels`` when the features have
            none (``"input_ids"`` for causal language modelling).
        pad_values: pad value per other field (default 0).

    Raises:
        TypeError: arguments of the wrong type, or features that are not a
            list of mappings of token id sequences.
        ValueError: no pad token, a bad padding side or pad multiple, features
            with different keys, or an empty batch.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        pad_token_id: int | None = None,
        padding_side: str | None = None,
        pad_to_multiple_of: int | None = None,
        label_pad_token_id: int = LABEL_PAD_ID,
        labels_from: str | None = None,
        pad_values: Mapping[str, int] | None = None,
    ) -> None:
        if pad_token_id is None:
            if tokenizer is None:
                raise bad_value("pad_token_id", "given, or a tokenizer with a pad token", None)
            pad_token_id = pad_token_id_of(tokenizer)
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral):
            raise bad_type("pad_token_id", "an int", pad_token_id)
        if padding_side is None:
            padding_side = getattr(tokenizer, "padding_side", None) or "right"
        if padding_side not in ("right", "left"):
            raise bad_value("padding_side", "'right' or 'left'", padding_side)
        if pad_to_multiple_of is not None:
            pad_to_multiple_of = check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
        if isinstance(label_pad_token_id, bool) or not isinstance(label_pad_token_id, numbers.Integral):
            raise bad_type("label_pad_token_id", "an int", label_pad_token_id)
        if labels_from is not None and not isinstance(labels_from, str):
            raise bad_type("labels_from", "a field name or None", labels_from)
        pad_values = dict(pad_values or {})
        for key, value in pad_values.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise bad_type(f"pad_values[{key!r}]", "an int", value)
        type_id = getattr(tokenizer, "pad_token_type_id", None)
        if isinstance(type_id, numbers.Integral) and not isinstance(type_id, bool):
            pad_values.setdefault("token_type_ids", int(type_id))
        self.pad_token_id = int(pad_token_id)
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.label_pad_token_id = int(label_pad_token_id)
        self.labels_from = labels_from
        self.pad_values = pad_values

    def __repr__(self) -> str:
        return (f"TrainingCollator(pad_token_id={self.pad_token_id}, padding_side={self.padding_side!r}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of}, labels_from={self.labels_from!r})")

    def _pad_value(self, key: str) -> int:
        if key in LABEL_KEYS:
            return self.label_pad_token_id
        if key in ("input_ids", "decoder_input_ids"):
            return self.pad_token_id
        return self.pad_values.get(key, 0)

    def _pad(self, rows: list[np.ndarray], pad: int) -> tuple[torch.Tensor, np.ndarray]:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        width = padded_width(int(lengths.max()), self.pad_to_multiple_of)
        columns = np.arange(width)
        mask = columns >= (width - lengths)[:, None] if self.padding_side == "left" else columns < lengths[:, None]
        out = np.full((len(rows), width), pad, dtype=np.int64)
        if lengths.sum():
            out[mask] = np.concatenate(rows)
        return torch.from_numpy(out), mask

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Pads ``features`` (one dict per row) into one batch."""
        if isinstance(features, Mapping) or not isinstance(features, Sequence):
            raise bad_type("features", "a list of dicts (one per row)", features)
        if not features:
            raise bad_value("features", "a non-empty list of dicts", features)
        if not all(isinstance(f, Mapping) for f in features):
            raise bad_type("features", "a list of dicts (one per row)", features)
        keys = list(features[0])
        for i, f in enumerate(features):
            if set(f) != set(keys):
                raise bad_value(f"features[{i}].keys()", f"the keys of features[0] {sorted(keys)}", sorted(f))
        batch: dict[str, Any] = {}
        masks: dict[str, np.ndarray] = {}
        for key in keys:
            values = [f[key] for f in features]
            ids = [_as_ids(key, v) for v in values]
            if all(r is not None for r in ids):
                batch[key], masks[key] = self._pad(ids, self._pad_value(key))  # type: ignore[arg-type]
            elif any(r is not None for r in ids):
                raise bad_value(f"features[...][{key!r}]", "a sequence in every row or in none", values)
            elif all(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
                shapes = sorted({tuple(v.shape) for v in values})
                if len(shapes) > 1:  # only int token-id sequences are padded
                    raise bad_value(f"features[...][{key!r}]", "tensors of one shape to stack (only integer 1-D "
                                    "sequences are padded, as token ids)", shapes)
                batch[key] = torch.stack([torch.as_tensor(v) for v in values])
            else:
                batch[key] = torch.tensor(values)
        name_labels(batch)
        if "attention_mask" not in batch and "input_ids" in masks:
            batch["attention_mask"] = torch.from_numpy(masks["input_ids"].astype(np.int64))
        if self.labels_from is not None and "labels" not in batch:
            if self.labels_from not in masks:
                raise bad_value("labels_from", f"a sequence field of the features {sorted(masks)}", self.labels_from)
            labels = batch[self.labels_from].clone()
            labels[torch.from_numpy(~masks[self.labels_from])] = self.label_pad_token_id
            batch["labels"] = labels
        return batch

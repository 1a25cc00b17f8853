"""Collation of samples from different tasks (the multi-task system's ``HeterogeneousCollator``).

Samples of a multi-task dataset carry different fields and lengths. The
collator pads every variable-length field (lists of numbers or 1-D tensors) to
the batch's longest, stacks equal-shape tensors and numbers, and keeps
strings and other metadata (``task_type`` first of all) as lists. Labels
follow :class:`~dynabatch.data.training_collate.TrainingCollator`'s rule: a
``labels``, ``label_ids`` or ``label`` sequence is padded with -100 (ignored by
the loss), and ``label`` or ``label_ids`` is renamed ``labels`` (what the model
and ``DynamicBatchingTrainer`` take); scalar labels are stacked as they are.
It is not that collator, which takes only int token-id fields and the same
keys in every row: here fields may be missing (metadata), float and kept as
strings.

Example:
    >>> from dynabatch.compat.multitask.collate import HeterogeneousCollator
    >>> collate = HeterogeneousCollator(pad_token_id=0)
    >>> batch = collate([
    ...     {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "task_type": "T1"},
    ...     {"input_ids": [8], "labels": [8], "task_type": "T2"},
    ... ])
    >>> batch["input_ids"].tolist(), batch["labels"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[5, 6, 7], [8, -100, -100]])
    >>> batch["attention_mask"].tolist(), batch["task_type"]
    ([[1, 1, 1], [1, 0, 0]], ['T1', 'T2'])
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import padded_width
from dynabatch.data.training_collate import LABEL_KEYS, LABEL_PAD_ID, name_labels

__all__ = ["METADATA_KEYS", "HeterogeneousCollator"]

METADATA_KEYS = ("task_type",)
"""Fields always kept as lists, whatever their values."""


def _is_sequence_field(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 1
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in value)
    )


class HeterogeneousCollator:
    """Collates samples whose fields and lengths differ by task.

    Args:
        tokenizer: gives ``pad_token_id`` and ``padding_side`` (optional if
            ``pad_token_id`` is given).
        pad_token_id: pads ``input_ids``; overrides the tokenizer's.
        label_pad_id: pads ``labels``, ``label_ids`` and ``label`` (``-100``:
            ignored by the loss).
        pad_to_multiple_of: round padded lengths up to a multiple of this.
        padding_side: ``"right"`` or ``"left"``; the tokenizer's by default.
        metadata_keys: fields kept as lists whatever their values.

    Padding values: ``input_ids`` the pad token, labels ``label_pad_id``,
    every other sequence field 0; ``label`` or ``label_ids`` is renamed
    ``labels`` unless the samples have ``labels``. An ``attention_mask`` is added when the
    samples have ``input_ids`` but no mask. A field missing from some samples
    is an error naming the field, except metadata, which becomes ``None``.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        pad_token_id: int | None = None,
        label_pad_id: int = LABEL_PAD_ID,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        metadata_keys: Sequence[str] = METADATA_KEYS,
    ) -> None:
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            raise bad_value("tokenizer", "a tokenizer with a pad_token_id, or pad_token_id=", tokenizer)
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral):
            raise bad_type("pad_token_id", "an int", pad_token_id)
        self.pad_token_id = int(pad_token_id)
        self.label_pad_id = int(label_pad_id)
        self.pad_to_multiple_of = (
            None if pad_to_multiple_of is None else check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
        )
        side = padding_side if padding_side is not None else getattr(tokenizer, "padding_side", "right")
        if side not in ("right", "left"):
            raise bad_value("padding_side", "'right' or 'left'", side)
        self.padding_side = side
        self.metadata_keys = tuple(metadata_keys)

    def _pad_value(self, key: str) -> int:
        if key == "input_ids":
            return self.pad_token_id
        if key in LABEL_KEYS:
            return self.label_pad_id
        return 0

    def _pad(self, key: str, values: list[Any]) -> torch.Tensor:
        tensors = [torch.as_tensor(v) for v in values]
        longest = padded_width(max((t.numel() for t in tensors), default=0), self.pad_to_multiple_of)
        dtype = torch.float32 if any(t.is_floating_point() for t in tensors) else torch.long
        out = torch.full((len(tensors), longest), self._pad_value(key), dtype=dtype)
        for row, t in enumerate(tensors):
            if self.padding_side == "right":
                out[row, : t.numel()] = t
            elif t.numel():
                out[row, -t.numel() :] = t
        return out

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
            raise bad_type("features", "a non-empty sequence of dicts (one per sample)", features)
        for position, feature in enumerate(features):
            if not isinstance(feature, Mapping):
                raise bad_type(f"features[{position}]", "a dict of fields", feature)
        keys = list(dict.fromkeys(k for f in features for k in f))
        batch: dict[str, Any] = {}
        for key in keys:
            present = [key in f for f in features]
            if key in self.metadata_keys:
                batch[key] = [f.get(key) for f in features]
                continue
            if not all(present):
                missing = present.index(False)
                raise bad_value(f"features[{missing}]", f"a sample with the field {key!r} like the others", features[missing])
            values = [f[key] for f in features]
            batch[key] = self._collate_field(key, values)
        if "input_ids" in batch and isinstance(batch["input_ids"], torch.Tensor) and "attention_mask" not in batch:
            lengths = [len(f["input_ids"]) for f in features]
            batch["attention_mask"] = self._pad("attention_mask", [[1] * n for n in lengths])
        return name_labels(batch)

    def _collate_field(self, key: str, values: list[Any]) -> Any:
        if all(_is_sequence_field(v) for v in values):
            return self._pad(key, values)
        if all(isinstance(v, torch.Tensor) for v in values):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) == 1:
                return torch.stack(values)
            raise bad_value(key, "tensors of one shape (or 1-D tensors, which are padded)", sorted(shapes))
        if all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in values):
            return torch.tensor(values)
        return list(values)

"""A small map-style multi-task dataset with the multi-task system's ``get_sample_metadata``.

Example:
    >>> from dynabatch.compat.multitask.dataset import MultiTaskDataset
    >>> data = MultiTaskDataset([
    ...     {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "task_type": "short"},
    ...     {"input_ids": [4, 5, 6, 7, 8], "labels": [4, 5, 6, 7, 8], "task_type": "long"},
    ... ])
    >>> len(data), data.get_sample_metadata(1)
    (2, {'task_type': 'long', 'length': 5})
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int

__all__ = ["MultiTaskDataset"]


class MultiTaskDataset(torch.utils.data.Dataset):
    """Samples (dicts with ``task_type`` and ``input_ids``) and their metadata.

    ``get_sample_metadata(idx)`` returns ``{"task_type", "length"}``, the
    length being the number of input ids: what
    :class:`~dynabatch.compat.multitask.MemoryAwareBatchSampler` plans with.
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]]) -> None:
        if isinstance(samples, (str, bytes, Mapping)) or not isinstance(samples, Sequence):
            raise bad_type("samples", "a sequence of dicts", samples)
        for idx, sample in enumerate(samples):
            if not isinstance(sample, Mapping) or sample.get("task_type") is None:
                raise bad_value(f"samples[{idx}]", "a dict with a 'task_type' key", sample)
            if "input_ids" not in sample:
                raise bad_value(f"samples[{idx}]", "a dict with 'input_ids'", sample)
        self.samples = [dict(s) for s in samples]

    @classmethod
    def from_texts(
        cls, tokenizer: Any, texts_by_task: Mapping[Hashable, Sequence[str]], *, max_length: int = 128
    ) -> MultiTaskDataset:
        """Tokenizes each task's texts for causal language modelling (labels = input ids).

        Samples are in task order, then text order; ``max_length`` truncates.
        """
        max_length = check_positive_int("max_length", max_length)
        samples = []
        for task, texts in texts_by_task.items():
            encoded = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
            samples.extend({"input_ids": ids, "labels": list(ids), "task_type": task} for ids in encoded)
        return cls(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return self.samples[idx]

    def get_sample_metadata(self, idx: int) -> dict[str, Any]:
        sample = self.samples[idx]
        return {"task_type": sample["task_type"], "length": len(sample["input_ids"])}

    @property
    def task_types(self) -> list[Hashable]:
        """The task of every sample."""
        return [s["task_type"] for s in self.samples]

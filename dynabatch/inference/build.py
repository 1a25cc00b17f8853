"""The build stage of :func:`dynabatch.run`: an item's tensors, collated in pinned host memory, ahead of the device.

:class:`Builder` collates a plan's positions from its token store (padding only), or takes a plain iterable's batch as
it came (the rows to run kept), with each row's input hash when a results store keeps them.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from dynabatch.data.collate import Batch
    >>> from dynabatch.inference.build import Builder
    >>> from dynabatch.inference.source import Item
    >>> batch = Batch({"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]]),
    ...                "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}, indices=torch.tensor([3, 9]))
    >>> builder = Builder(None, [batch], pad_token_id=0, pinned=False, hashes=True)
    >>> built = builder.build(Item(0, np.array([9]), batch, rows=np.array([1])))  # row 1 alone, trimmed
    >>> built.batch["input_ids"].tolist(), built.hashes_at(np.array([9])).dtype
    ([[8]], dtype('uint64'))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch.data.collate import Batch, split_rows, take_rows
from dynabatch.data.input_hashes import batch_input_hashes
from dynabatch.inference.source import Item

__all__ = ["Builder", "Built", "Padding"]


@dataclass(frozen=True)
class Padding:
    """The loader's padding rules: which side pads, and the multiple widths are padded to."""

    side: str | None = None
    multiple: int | None = None

    def take(self, batch: Batch, rows: Any) -> Batch:
        """The rows ``rows`` (row numbers) of ``batch``, re-padded to their longest."""
        return take_rows(batch, torch.as_tensor(rows), padding_side=self.side, pad_to_multiple_of=self.multiple)

    def split(self, batch: Batch, sizes: list[int]) -> list[Batch]:
        """``batch`` cut into consecutive parts of ``sizes`` rows, each trimmed as collating it would."""
        return split_rows(batch, sizes, padding_side=self.side, pad_to_multiple_of=self.multiple)


@dataclass
class Built:
    """An item's tensors, each row's input hash (``None`` when no store keeps them), the padding rules its parts are
    cut by, and (a plain iterable's batch) the ``(positions, input hashes)`` of its rows a store holds already, checked
    before any row of it is written."""

    batch: Batch
    hashes: np.ndarray | None = None
    padding: Padding = Padding()
    stored: tuple[np.ndarray, np.ndarray] | None = None

    def hashes_at(self, positions: np.ndarray) -> np.ndarray | None:
        """The input hashes of the rows at ``positions`` (rows of this batch)."""
        if self.hashes is None:
            return None
        indices = self.batch.indices.numpy()
        order = np.argsort(indices, kind="stable")
        return self.hashes[order[np.searchsorted(indices, positions, sorter=order)]]


class Builder:
    """Builds the batches of one run from ``plan`` (``None``: ``loader`` is an iterable of batches, whose
    ``collate_fn`` may say its padding); ``pad_token_id``: ``None`` takes the collator's; ``pinned``: in pinned host
    memory; ``hashes``: each row's input hash computed."""

    def __init__(self, plan: Any, loader: Any, *, pad_token_id: int | None, pinned: bool, hashes: bool) -> None:
        self.collator = None if plan is None else plan.collator
        collate = self.collator if plan is not None else getattr(loader, "collate_fn", None)
        pad = getattr(collate, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, (int, np.integer)) and not isinstance(pad, bool) else None
        side, multiple = getattr(collate, "padding_side", None), getattr(collate, "pad_to_multiple_of", None)
        self.padding = Padding(side if side in ("left", "right") else None,
                               multiple if isinstance(multiple, int) else None)
        self.pinned, self.hashes = pinned, hashes

    def build(self, item: Item) -> Built:
        """The item's tensors: collated from the plan, or its batch as it came with only the rows it runs; in pinned
        memory when the device copies from it (a batch that came already on a device stays there)."""
        stored = None
        if item.batch is None:
            batch = self.collator(item.positions)
        else:
            if self.hashes and item.stored.size:  # the rows the store holds, with their hashes to check
                positions = item.batch.indices.numpy()
                held = np.isin(positions, item.stored)
                stored = positions[held], batch_input_hashes(item.batch)[held]
            batch = item.batch if item.rows is None else self.padding.take(item.batch, item.rows)
        if self.pinned and all(t.device.type == "cpu" for t in batch.values() if isinstance(t, torch.Tensor)):
            batch = batch.pin_memory()
        return Built(batch, batch_input_hashes(batch) if self.hashes else None, self.padding, stored)

    def stand_in(self, item: Item) -> Batch:
        """One row of ``item`` that a rank has stored already: what it repeats to keep ranks in step."""
        if item.batch is None:
            return self.collator(item.stored[:1])
        row = int(np.flatnonzero(item.batch.indices.numpy() == item.stored[0])[0])
        return self.padding.take(item.batch, [row])

"""The build stage of :func:`dynabatch.run`: an item's tensors, collated in pinned host memory, ahead of the device.

:class:`Builder` turns an :class:`~dynabatch.inference.source.Item` into a :class:`Built` batch: a plan's positions
collated from its token store (padding only, no tokenizer call), a plain iterable's batch as it came (the rows to run
taken), in pinned memory where the device copies from it asynchronously, with each row's input hash when a results
store keeps them. It owns the loader's padding rules (how a batch is cut into parts that are trimmed as collating
them would) and frees a streamed plan's tokens once their rows are in a built batch or stored already.

:class:`Prefetcher` hands a worker its next item and batch, building the next ones in a background thread
(:class:`~dynabatch._background.Worker`) while the device runs the current one.

A plain iterable of batches has no plan to check before the run: where a results store holds some of its rows, the
rows are checked as their batch is built, before any row of that batch is written (``check_inputs``).

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

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch._background import Worker
from dynabatch.data.collate import Batch, split_rows, take_rows
from dynabatch.data.input_hashes import batch_input_hashes
from dynabatch.inference.scheduler import Lane, Scheduler
from dynabatch.inference.source import Item

__all__ = ["Builder", "Built", "Prefetcher"]

logger = logging.getLogger(__name__)


@dataclass
class Built:
    """An item's tensors, and each row's input hash (``None`` when no store keeps them)."""

    batch: Batch
    hashes: np.ndarray | None = None

    def hashes_at(self, positions: np.ndarray) -> np.ndarray | None:
        """The input hashes of the rows at ``positions`` (rows of this batch)."""
        if self.hashes is None:
            return None
        indices = self.batch.indices.numpy()
        order = np.argsort(indices, kind="stable")
        return self.hashes[order[np.searchsorted(indices, positions, sorter=order)]]


class Builder:
    """Builds the batches of one run.

    Args:
        plan: the loader's :class:`~dynabatch.inference.loader.LoaderPlan`, or ``None`` for an iterable of batches.
        loader: the loader (an iterable's ``collate_fn`` may say its padding).
        pad_token_id: the pad id of token-id outputs; ``None`` takes the collator's.
        pinned: batches in pinned host memory (the device copies from it asynchronously).
        hashes: each row's input hash is computed (a results store keeps them).
        check_inputs: ``check_inputs(positions, hashes)`` refuses stored rows whose inputs differ; called for a
            plain iterable's stored rows as their batch is built.
    """

    def __init__(self, plan: Any, loader: Any, *, pad_token_id: int | None, pinned: bool, hashes: bool,
                 check_inputs: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        collate = plan.collator if plan is not None else getattr(loader, "collate_fn", None)
        self.collator = None if plan is None else plan.collator
        self.stream = None if plan is None else plan.stream
        pad = getattr(collate, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, (int, np.integer)) and not isinstance(pad, bool) else None
        side = getattr(collate, "padding_side", None)
        self.padding_side = side if side in ("left", "right") else None
        multiple = getattr(collate, "pad_to_multiple_of", None)
        self.pad_to_multiple_of = multiple if isinstance(multiple, int) else None
        self.pinned, self.hashes, self.check_inputs = pinned, hashes, check_inputs

    def build(self, item: Item) -> Built:
        """The item's tensors: collated from the plan, or its batch as it came with only the rows it runs; in pinned
        memory when the device copies from it (a batch that came already on a device stays there)."""
        if item.batch is None:
            batch = self.collator(item.positions)
        else:
            if self.check_inputs is not None and item.stored.size:
                self._check_stored(item)
            batch = item.batch if item.rows is None else self.take(item.batch, item.rows)
        if self.pinned and all(t.device.type == "cpu" for t in batch.values() if isinstance(t, torch.Tensor)):
            batch = batch.pin_memory()
        return Built(batch, batch_input_hashes(batch) if self.hashes else None)

    def _check_stored(self, item: Item) -> None:
        """A plain iterable's batch holds rows a store holds: refused (by ``check_inputs``) unless computed from
        these very inputs."""
        hashes = batch_input_hashes(item.batch)
        positions = item.batch.indices.numpy()
        at = np.isin(positions, item.stored)
        self.check_inputs(positions[at], hashes[at])

    def release(self, positions: np.ndarray) -> None:
        """These rows are in a built batch, or stored already: a streamed plan frees each chunk's tokens once every
        row of it is."""
        if self.stream is not None and len(positions):
            self.stream.consumed(positions)

    def take(self, batch: Batch, rows: Any) -> Batch:
        """The rows ``rows`` (row numbers) of ``batch``, re-padded to their longest (the loader's padding rule)."""
        return take_rows(batch, torch.as_tensor(rows), padding_side=self.padding_side,
                         pad_to_multiple_of=self.pad_to_multiple_of)

    def split(self, batch: Batch, sizes: list[int]) -> list[Batch]:
        """``batch`` cut into consecutive parts of ``sizes`` rows, each trimmed as collating it would."""
        return split_rows(batch, sizes, padding_side=self.padding_side, pad_to_multiple_of=self.pad_to_multiple_of)

    def stand_in(self, item: Item) -> Batch:
        """One row of ``item`` that a rank has stored already: what it repeats to keep ranks in step."""
        if item.batch is None:
            return self.collator(item.stored[:1])
        row = int(np.flatnonzero(item.batch.indices.numpy() == item.stored[0])[0])
        return self.take(item.batch, [row])


class Prefetcher:
    """Hands one worker its items with their batches, building its next ``depth`` batches in a background thread.

    In measured mode the planner sizes a batch only once the peaks before it are measured, so the batches built ahead
    are the scheduler's answer *as it stands* (:meth:`~dynabatch.inference.scheduler.Scheduler.peek`); one that a
    later peak re-sized is built again, never run stale (:attr:`rebuilt` counts them).
    """

    def __init__(self, scheduler: Scheduler, builder: Builder, lane: Lane, depth: int) -> None:
        self.scheduler, self.builder, self.lane, self.depth = scheduler, builder, lane, depth
        self.ahead: deque[tuple[np.ndarray, Built]] = deque()  # positions -> their batch, built ahead
        self._worker = Worker(depth=1, name="dynabatch-prefetch") if depth else None
        self.rebuilt = 0

    def next_item(self) -> Item | None:
        """The next item of this worker's lane (``None`` when none is left), once the batches being built ahead
        are (they were peeked before it was taken)."""
        if self._worker is not None:
            self._worker.wait()  # an error building a batch raises here
        return self.scheduler.next(self.lane)

    def build(self, item: Item) -> Built | None:
        """``item``'s batch (built ahead, or now; ``None`` when every row of it is stored), its rows' tokens freed;
        then the next batches are built ahead."""
        built = None
        if item.positions.size:
            built = self._take(item.positions) if item.batch is None else None
            built = built or self.builder.build(item)
        self.builder.release(np.concatenate([item.positions, item.stored]))
        if self._worker is not None:
            self._worker.submit(self._fill)
        return built

    def _take(self, positions: np.ndarray) -> Built | None:
        while self.ahead:
            built_positions, built = self.ahead.popleft()
            if np.array_equal(built_positions, positions):
                return built
            self.rebuilt += 1
        return None

    def _fill(self) -> None:
        """The background thread's turn: the next batches as they stand, built (asking the planner costs time too,
        off the device's thread)."""
        for positions in self.scheduler.peek(self.lane, self.depth)[len(self.ahead):]:
            self.ahead.append((positions, self.builder.build(Item(-1, positions))))

    def close(self) -> None:
        """Stops the background thread (after the batch it is building) and drops what it built."""
        if self._worker is not None:
            self._worker.close(cancel=True)
        self.ahead.clear()

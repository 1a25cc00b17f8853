"""The source of :func:`dynabatch.run`: the batches to run, as a queue of :class:`Item` s.

A dynabatch DataLoader carries its plan (``loader.plan``), so its batches are known as input positions before their
tensors exist: the collator builds them only when a batch runs, so ranks can share them, rows already stored can be
taken out, and in measured mode the loader's planner sizes every next batch from the peaks measured so far. Any other
iterable of :class:`~dynabatch.data.collate.Batch` is read as it comes, ahead of the device.

The queue also holds what the memory mode needs per worker (a :class:`Lane`:
its measured peaks and, in measured mode, its cursor in the planner's pass), the input hashes the sink stores with
each row, and, for a streaming loader, tells the token stream which rows are finished so that their tokens are freed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch._background import Ahead
from dynabatch._validation import brief
from dynabatch.data.collate import Batch, take_rows
from dynabatch.data.input_hashes import batch_input_hashes, token_store_hashes
from dynabatch.memory.feedback import MemoryFeedback
from dynabatch.sampling.planner import PlanCursor
from dynabatch.sampling.ranks import deal, split_for_replicas

__all__ = ["BatchQueue", "Item", "Lane", "positions_of"]

logger = logging.getLogger(__name__)


@dataclass
class Item:
    """One planned batch: its number in the plan and its input positions (or the batch itself)."""

    number: int
    positions: np.ndarray
    batch: Batch | None = None  # plain iterables: the batch as it came; dynabatch loaders: built when run
    whole: bool = True  # False once rows already done (stored, or finished before a crash) are taken out
    crashes: int = 0  # times a device's worker crashed running it (several devices re-queue it once)


@dataclass
class Lane:
    """One worker's view of the queue: the peaks it measured (its own budget) and, in measured mode, its cursor
    in the planner's pass (see :meth:`~dynabatch.sampling.planner.BatchPlanner.cursor`)."""

    feedback: MemoryFeedback | None = None
    cursor: PlanCursor | None = None


def positions_of(batch: Any, loader: Any) -> np.ndarray:
    """The input positions of ``batch``'s rows (its ``.indices``), or a ``TypeError`` naming ``loader``."""
    indices = getattr(batch, "indices", None)
    if indices is None or not isinstance(batch, dict):
        raise TypeError(
            "loader should be a dynabatch DataLoader or an iterable of dynabatch Batches (dicts of tensors with "
            f".indices, the input positions of their rows), but got loader={brief(loader)} yielding a batch "
            f"of type {type(batch).__name__}" + ("" if indices is None else " (not a dict of tensors)")
        )
    return torch.as_tensor(indices).detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)


class BatchQueue:
    """The batches to run, handed out one :class:`Item` at a time to any number of workers.

    Args:
        loader: a dynabatch DataLoader, or any iterable of batches.
        plan: the loader's :class:`~dynabatch.inference.loader.LoaderPlan`; ``None`` for an iterable of batches.
        memory: the run's resolved memory mode (``"measured"``: the loader's planner sizes every next batch).
        sparse: measure only the calls the feedback names (the CPU tracker's cost).
        pad_token_id: the pad id of token-id outputs; ``None`` takes the collator's.
    """

    def __init__(self, loader: Any, plan: Any, *, memory: str, sparse: bool, pad_token_id: int | None) -> None:
        self.loader, self.plan, self.sparse = loader, plan, sparse
        self.guard = memory == "guarded"
        self.pending: deque[Item] = deque()
        self.stream: Iterator[Item] | None = None
        self.planner = None
        self.number = 0
        self.seen = -1  # the largest input position handed out (a plain iterable's count)
        self.lock = threading.Lock()  # several devices' workers share the queue
        self.retry: deque[Item] = deque()  # items a crashed worker left, served first
        self.done: np.ndarray | None = None  # rows the sink already holds (a resumed run)
        self._hashes: np.ndarray | None = None  # every input's hash, when known up front
        self._reader: Ahead | None = None
        collate = plan.collator if plan is not None else getattr(loader, "collate_fn", None)
        self.collator = plan.collator if plan is not None else None
        pad = getattr(collate, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, (int, np.integer)) and not isinstance(pad, bool) else None
        side = getattr(collate, "padding_side", None)
        self.padding_side = side if side in ("left", "right") else None
        multiple = getattr(collate, "pad_to_multiple_of", None)
        self.pad_to_multiple_of = multiple if isinstance(multiple, int) else None
        self.first_rows: int | None = None  # guarded: the most rows of a call before any peak is measured
        if plan is None:
            self.n_inputs: int | None = None
            self.total_rows: int | None = None
            self.stream = (Item(n, positions_of(b, loader), b) for n, b in enumerate(loader))
        else:
            self.n_inputs = plan.n_inputs
            self.total_rows = self.n_inputs - len(plan.skipped)
            if memory == "measured":
                self._use_planner(plan.planner)
            else:
                planned = (Item(n, np.asarray(p, dtype=np.int64)) for n, p in enumerate(plan.sampler))
                if plan.stream is None:
                    self.pending.extend(planned)  # the whole plan is known: the next batches can be built ahead
                else:
                    self.stream = planned  # planned as its chunks are tokenized
                if self.guard and self.total_rows:
                    # The plan's first batch: its rows, at the longest width, bound any batch of no more rows.
                    self.first_rows = plan.planner.first_rows()
        self.lane = self.new_lane()

    # --- what runs ----------------------------------------------------------------------------------

    def _use_planner(self, planner: Any) -> None:
        self.planner = planner
        planner.restart(sparse=self.sparse)

    def claim(self, planner: Any) -> None:
        """Takes the batches of ``planner`` (this rank's claimed chunks) instead of the loader's."""
        self.total_rows = None  # a share no one knows up front
        if self.planner is not None:
            self._use_planner(planner)
            self.lane = self.new_lane()
        else:
            self.stream = (Item(n, b) for n, b in enumerate(planner.iter_batches()))

    def read_ahead(self, depth: int) -> None:
        """Reads a plain iterable's batches up to ``depth`` ahead in a background thread (stopped by :meth:`close`)."""
        if depth and self.plan is None and self.stream is not None:
            self._reader = Ahead(self.stream, depth=depth, name="dynabatch-read-ahead")
            self.stream = iter(self._reader.next, None)

    def new_lane(self) -> Lane:
        """A worker's own view of the queue: in measured mode its own planner cursor, in guarded mode its own peaks."""
        if self.planner is not None:
            cursor = self.planner.cursor(sparse=self.sparse)
            return Lane(cursor.feedback, cursor)
        return Lane(MemoryFeedback(sparse=self.sparse) if self.guard else None)

    def set_budget(self, lane: Lane, device: Any) -> None:
        """The lane's absolute budget: the loader's ``max_memory`` resolved on the lane's device as the run starts
        (``None``, the relative rule: the lane's first measured peak)."""
        if self.plan is not None and lane.feedback is not None and device is not None:
            lane.feedback.set_budget(self.plan.planner.budget_on(device))

    @property
    def count(self) -> int:
        """How many inputs the run has: known up front, else (a plain iterable) the largest position seen + 1."""
        return self.n_inputs if self.n_inputs is not None else self.seen + 1

    def next_item(self, lane: Lane | None = None) -> Item | None:
        """The next batch to run (for ``lane``: its cursor sizes it in measured mode); ``None`` when none is left."""
        item = self._next(lane)
        if item is not None and item.positions.size:
            self.seen = max(self.seen, int(item.positions.max()))
        return item

    def _next(self, lane: Lane | None) -> Item | None:
        with self.lock:
            if self.retry:
                return self.retry.popleft()
            if self.planner is not None:
                positions = self.planner.next_batch((lane or self.lane).cursor)
                if positions is None:
                    return None
                self.number += 1
                return Item(self.number - 1, positions)
            if self.pending:
                return self.pending.popleft()
            item = next(self.stream, None) if self.stream is not None else None
            if item is None:
                self.stream = None
            return item

    def peek(self, n: int, lane: Lane | None = None) -> list[np.ndarray]:
        """The positions of the next ``n`` batches as they stand now (built ahead; in measured mode a later peak may
        re-size them). A plain iterable's batches come built: nothing to peek."""
        with self.lock:
            if self.planner is not None:
                return self.planner.peek(n, (lane or self.lane).cursor)
            return [item.positions for item, _ in zip(self.pending, range(n)) if item.batch is None]

    def requeue(self, item: Item) -> None:
        """Puts back the rows of an item a crashed worker did not finish; the next worker to ask runs them first."""
        with self.lock:
            self.retry.append(item)

    def without_stored(self, item: Item) -> Item | None:
        """``item`` without the rows the sink already holds (:attr:`done`); ``None`` if none is left."""
        if self.done is None or not item.positions.size:
            return item
        inside = item.positions < len(self.done)
        stored = np.zeros(len(item.positions), dtype=bool)
        stored[inside] = self.done[item.positions[inside]]
        if not stored.any():
            return item
        self.finish(item.positions[stored])
        return None if stored.all() else self.restrict(item, np.flatnonzero(~stored))

    def finish(self, positions: np.ndarray) -> None:
        """These rows are finished (or stored already): a streaming loader frees each chunk's tokens once every row
        of it is."""
        if self.plan is not None and self.plan.stream is not None and len(positions):
            self.plan.stream.consumed(positions)

    def shard(self, rank: int, world_size: int) -> None:
        """Lockstep: keeps only this rank's share of the whole plan: every rank the same number of batches (the one
        routine of :mod:`dynabatch.sampling.ranks`: the largest batches split, then dealt in steps)."""
        from dynabatch.inference.distributed import check_same_batches

        items = [*self.pending, *(self.stream or ())]
        self.stream = None
        check_same_batches([i.positions for i in items])
        if self.plan is None:
            self.n_inputs = max((int(i.positions.max()) + 1 for i in items if i.positions.size), default=0)

        def split(item: Item, parts: int) -> list[Item]:
            return [self.restrict(item, keep, whole=True)
                    for keep in np.array_split(np.arange(len(item.positions)), parts)]

        shares = split_for_replicas(items, world_size, samples=lambda item: len(item.positions), split=split)
        mine = deal(shares, world_size, rank)
        for number, item in enumerate(mine):
            item.number = number
        self.pending = deque(mine)
        logger.info("rank %d of %d: %d batches (%d rows) of %d batches (%d rows)", rank, world_size, len(mine),
                    sum(len(i.positions) for i in mine), len(items), sum(len(i.positions) for i in items))

    def close(self) -> None:
        """Stops the read-ahead thread, if any (after the batch it is reading)."""
        if self._reader is not None:
            self._reader.close()

    # --- batches and their rows ------------------------------------------------------------------------

    def build(self, item: Item) -> Batch:
        return item.batch if item.batch is not None else self.collator(item.positions)

    def restrict(self, item: Item, keep: np.ndarray, *, whole: bool = False) -> Item:
        """The item with only the rows at ``keep`` (row numbers within it); ``whole``: a batch of its own."""
        batch = None if item.batch is None else self.take(item.batch, keep)
        return Item(item.number, item.positions[keep], batch, whole=whole, crashes=item.crashes)

    def take(self, batch: Batch, rows: Any) -> Batch:
        """The rows ``rows`` of ``batch``, re-padded to their longest (the loader's padding rule)."""
        return take_rows(batch, torch.as_tensor(rows), padding_side=self.padding_side,
                         pad_to_multiple_of=self.pad_to_multiple_of)

    def input_hashes(self, batch: Batch) -> np.ndarray:
        """The input hash of each row of a built batch: looked up where known up front, else from its tensors
        (the same value, :mod:`dynabatch.data.input_hashes`)."""
        if self._hashes is not None:
            return self._hashes[batch.indices.numpy()]
        return batch_input_hashes(batch)

    def inputs_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, input hashes)`` of this run's inputs among ``positions``, before anything runs (to check
        the rows a store holds there).

        A loader planned up front hashes its whole token store once; a streaming loader tokenizes those rows; a plain
        iterable is read through once (a one-shot iterator is kept whole for the run).
        """
        if self.plan is not None:
            positions = positions[positions < self.n_inputs]
        if self.plan is not None and self.plan.stream is not None:
            return positions, self.plan.stream.input_hashes(positions)
        if self.plan is not None:
            if self._hashes is None:
                self._hashes = token_store_hashes(self.collator.tokenized)
            return positions, self._hashes[positions]
        if isinstance(self.loader, Iterator):
            self.pending.extend(self.stream)  # a one-shot iterator can be read only once
            self.stream = None
            batches = [item.batch for item in self.pending]
        else:
            batches = iter(self.loader)
        found, hashes = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.uint64)]
        for batch in batches:
            found.append(positions_of(batch, self.loader))
            hashes.append(batch_input_hashes(batch))
        found_at, found_hash = np.concatenate(found), np.concatenate(hashes)
        keep = np.isin(positions, found_at)  # stored rows of positions this run has no input at are not its rows
        order = np.argsort(found_at, kind="stable")
        where = order[np.searchsorted(found_at[order], positions[keep])]
        return positions[keep], found_hash[where]

    # --- what the memory mode learns --------------------------------------------------------------------

    def should_measure(self, rows: int, width: int, lane: Lane) -> bool:
        """Whether a call of ``rows`` x ``width`` is to be measured (always, unless measuring is sparse)."""
        return lane.feedback is None or lane.feedback.should_measure(rows, width)

    def max_call_rows(self, width: int, lane: Lane) -> int | None:
        """Guarded mode: the most rows a call of padded ``width`` may have, or ``None`` for no cap.

        Before any peak is measured: the plan's first batch's rows (a dynabatch loader; its first batch is the
        longest, so fewer rows never cost more). Then: the most rows the measured peaks bound at or under the first
        call's peak (:meth:`~dynabatch.memory.feedback.MemoryFeedback.max_rows`); ``None`` when no measured call at
        least as wide stays under it (a plain iterable's batch wider than every batch measured so far runs as it
        comes). Either way no more than out-of-memory errors allow.
        """
        if not self.guard:
            return None
        feedback = lane.feedback
        budget = feedback.budget
        caps = [self.first_rows if budget is None else feedback.max_rows(width, budget) or None,
                feedback.oom_cap(width)]
        caps = [c for c in caps if c is not None]
        return min(caps) if caps else None

    def observe_out_of_memory(self, rows: int, width: int, lane: Lane) -> None:
        """A call of ``rows`` x ``width`` ran out of memory: later calls on that lane's device are sized (measured
        mode) or capped (guarded mode) under the lower limit it shows."""
        with self.lock:
            if self.planner is not None:
                self.planner.observe_out_of_memory(rows, width, lane.cursor)
            elif lane.feedback is not None:
                lane.feedback.observe_out_of_memory(rows, width)

    def observe_item(self, item: Item, parts: list[tuple[int, int, int]], lane: Lane) -> None:
        """Tells the lane the peaks of an item's calls, ``(rows, width, peak)`` each. Measured mode takes an item
        only when it ran whole (its planner re-sizes from it); guarded mode takes every measured call."""
        with self.lock:
            if self.planner is None:
                if lane.feedback is not None:
                    lane.feedback.observe_parts(parts)
            elif item.whole:
                self.planner.observe_parts(parts, lane.cursor)

"""The batches :func:`dynabatch.run` runs, as a queue: :class:`BatchQueue`.

A dynabatch DataLoader carries its plan (``loader.plan``), so its batches are
known up front as input positions, and their tensors are built by its collator
only when a batch runs: the distributed split can reorder them, and in measured
mode (``adapt=True``) the loader's :class:`~dynabatch.sampling.planner.BatchPlanner`
hands out every next batch, told each measured peak. Any other iterable of
:class:`~dynabatch.data.collate.Batch` is streamed as it comes.

The queue holds the run's :class:`~dynabatch.memory.feedback.MemoryFeedback`
(the planner's in measured mode, its own in guarded mode): it says which calls
to measure (:meth:`BatchQueue.should_measure`) and, in guarded mode, how many
rows a call may have (:meth:`BatchQueue.max_call_rows`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, brief
from dynabatch.data.collate import Batch, take_rows
from dynabatch.inference.loader import LoaderPlan
from dynabatch.memory.feedback import MemoryFeedback
from dynabatch.sampling.planner import PlanCursor
from dynabatch.sampling.ranks import deal, split_for_replicas

logger = logging.getLogger(__name__)


@dataclass
class Item:
    """One planned batch: its number in the plan and its input positions (or the batch itself)."""

    number: int
    positions: np.ndarray
    batch: Batch | None = None  # plain iterables: the batch as it came; dynabatch loaders: built when run
    whole: bool = True  # False once rows already done (resumed) are taken out
    crashes: int = 0  # times a device's worker crashed running it (several devices re-queue it once)


@dataclass
class Lane:
    """One device's view of the queue: the peaks it measured (its own budget) and, in measured mode, its cursor
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
    """The batches to run, as a queue of :class:`Item` s.

    Args:
        loader: a dynabatch DataLoader, or any iterable of batches.
        plan: the loader's :class:`~dynabatch.inference.loader.LoaderPlan`
            (:func:`~dynabatch.inference.loader.plan_of`); ``None`` for an iterable of batches.
        pad_token_id: the pad id of token-id outputs; ``None`` takes the collator's.
        adapt: measured mode: the loader's planner sizes every next batch from
            the peaks given to :meth:`observe`.
        guard: guarded mode (exclusive with ``adapt``): the batches run as
            they come, and a call whose measured bound exceeds the first
            call's peak is split before it runs (:meth:`max_call_rows`).
        sparse: measure only the calls the feedback names (the CPU tracker's cost).
    """

    def __init__(self, loader: Any, plan: LoaderPlan | None, pad_token_id: int | None = None, *, adapt: bool = False,
                 guard: bool = False, sparse: bool = False) -> None:
        self.loader = loader
        self.plan = plan
        self.pending: deque[Item] = deque()
        self.stream: Iterator[Item] | None = None
        self.planner = None
        self.number = 0
        if self.plan is not None:
            self.collator: Any = self.plan.collator
            self.n_inputs: int | None = self.plan.n_inputs
            planned = (Item(number, np.asarray(p, dtype=np.int64)) for number, p in enumerate(self.plan.sampler))
            if self.plan.stream is not None and not adapt:
                self.stream = planned  # a streaming loader's plan, read as its chunks are tokenized
            elif not adapt:
                self.pending.extend(planned)
        else:
            if isinstance(loader, (str, bytes, dict)) or not isinstance(loader, Iterable):
                raise bad_type("loader", "a dynabatch DataLoader or an iterable of dynabatch Batches", loader)
            if adapt:
                raise bad_value("adapt", "False for a loader that is not a dynabatch DataLoader (measured mode "
                                "re-plans its batches)", adapt)
            self.collator = None
            self.n_inputs = None
            self.stream = (Item(n, positions_of(b, loader), b) for n, b in enumerate(loader))
        collate = self.collator if self.collator is not None else getattr(loader, "collate_fn", None)
        pad = getattr(collate, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, (int, np.integer)) and not isinstance(pad, bool) else None
        side = getattr(collate, "padding_side", None)
        self.padding_side = side if side in ("left", "right") else None
        multiple = getattr(collate, "pad_to_multiple_of", None)
        self.pad_to_multiple_of = multiple if isinstance(multiple, int) else None
        self.total_rows = self.n_inputs - len(self.plan.skipped) if self.plan is not None else None
        self.guard = guard and not adapt
        self.sparse = sparse
        self.lock = threading.Lock()  # several devices' workers share the queue
        self.retry: deque[Item] = deque()  # items a crashed worker left, served first
        self.first_rows: int | None = None  # guarded: the most rows of a call before any peak is measured
        if adapt:
            self.planner = self.plan.planner
            self.planner.restart(sparse=sparse)
            self.pending.clear()  # batches run longest first, sized as the run goes
        elif self.guard and self.plan is not None and self.total_rows:
            # The plan's first batch: its rows, at the longest width, bound any batch of no more rows.
            self.first_rows = self.plan.planner.first_rows()
        self.lane = self.new_lane()

    def use_planner(self, planner: Any, *, adapt: bool) -> None:
        """Takes the batches of ``planner`` (a rank's claimed chunks) instead of the loader's: sized from measured
        peaks (``adapt``), else as planned."""
        self.pending.clear()
        self.total_rows = None  # a share no one knows up front
        if adapt:
            self.planner = planner
            planner.restart(sparse=self.sparse)
            self.lane = self.new_lane()
        else:
            self.stream = (Item(n, b) for n, b in enumerate(planner.iter_batches()))

    def new_lane(self) -> Lane:
        """A device's own view of the queue: in measured mode its own planner cursor, in guarded mode its own peaks."""
        if self.planner is not None:
            cursor = self.planner.cursor(sparse=self.sparse)
            return Lane(cursor.feedback, cursor)
        return Lane(MemoryFeedback(sparse=self.sparse) if self.guard else None)

    def next_item(self, lane: Lane | None = None) -> Item | None:
        """The next batch to run (for ``lane``: its cursor sizes it in measured mode); ``None`` when none is left."""
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
            if self.stream is not None:
                item = next(self.stream, None)
                if item is not None:
                    return item
                self.stream = None
            return None

    def peek(self, n: int, lane: Lane | None = None) -> list[np.ndarray]:
        """The positions of the next ``n`` batches as they stand now (a prefetcher builds them ahead; in measured
        mode a later peak may re-size them). A streamed iterable is not peeked: its batches come built."""
        with self.lock:
            if self.planner is not None:
                return self.planner.peek(n, (lane or self.lane).cursor)
            return [item.positions for item, _ in zip(self.pending, range(n)) if item.batch is None]

    def requeue(self, item: Item) -> None:
        """Puts back an item a crashed worker did not finish; the next worker to ask runs it first."""
        with self.lock:
            self.retry.append(item)

    def should_measure(self, rows: int, width: int, lane: Lane | None = None) -> bool:
        """Whether a call of ``rows`` x ``width`` is to be measured (always, unless measuring is sparse)."""
        feedback = (lane or self.lane).feedback
        return feedback is None or feedback.should_measure(rows, width)

    def max_call_rows(self, width: int, lane: Lane | None = None) -> int | None:
        """Guarded mode: the most rows a call of padded ``width`` may have, or ``None`` for no cap.

        Before any peak is measured: the plan's first batch's rows (a dynabatch
        loader; its first batch is the longest, so fewer rows never cost more).
        Then: the most rows the measured peaks bound at or under the first
        call's peak (:meth:`~dynabatch.memory.feedback.MemoryFeedback.max_rows`);
        ``None`` when no measured call at least as wide stays under it (a plain
        iterable's batch wider than every batch measured so far runs as it comes).
        Either way no more than out-of-memory errors allow
        (:meth:`~dynabatch.memory.feedback.MemoryFeedback.oom_cap`).
        """
        if not self.guard:
            return None
        feedback = (lane or self.lane).feedback
        learned = feedback.oom_cap(width)  # what out-of-memory errors allow
        if feedback.budget_ is None:
            caps = [self.first_rows, learned]
        else:
            caps = [feedback.max_rows(width, feedback.budget_) or None, learned]
        caps = [c for c in caps if c is not None]
        return min(caps) if caps else None

    def observe_out_of_memory(self, rows: int, width: int, lane: Lane | None = None) -> None:
        """A call of ``rows`` x ``width`` ran out of memory: the calls after it, this item's remaining pieces
        included, are sized (measured mode) or capped (guarded mode) under the lower limit it shows (on that
        lane's device only)."""
        lane = lane or self.lane
        with self.lock:
            if self.planner is not None:
                self.planner.observe_out_of_memory(rows, width, lane.cursor)
            elif lane.feedback is not None:
                lane.feedback.observe_out_of_memory(rows, width)

    def observe_item(self, item: Item, parts: list[tuple[int, int, int]], lane: Lane | None = None) -> None:
        """Tells the lane's feedback the peaks of an item's calls, ``(rows, width, peak)`` each. Measured mode takes
        an item only when it ran whole (its planner re-sizes from it); guarded mode takes every measured call."""
        lane = lane or self.lane
        with self.lock:
            if self.planner is None:
                if lane.feedback is not None:
                    lane.feedback.observe_parts(parts)
            elif item.whole:
                self.planner.observe_parts(parts, lane.cursor)

    def shard(self, rank: int, world_size: int) -> None:
        """Keeps only this rank's share of the batches: every rank the same number (the one routine of
        :mod:`dynabatch.sampling.ranks`: the largest batches split, then dealt in steps of consecutive batches)."""
        self.materialize()
        items = list(self.pending)
        sizes = [len(i.positions) for i in items]

        def split(item: Item, parts: int) -> list[Item]:
            return [self.restrict(item, keep, whole=True) for keep in np.array_split(np.arange(len(item.positions)),
                                                                                  parts)]

        items = split_for_replicas(items, world_size, samples=lambda item: len(item.positions), split=split)
        mine = deal(items, world_size, rank)
        for number, item in enumerate(mine):
            item.number = number
        self.pending = deque(mine)
        logger.info("rank %d of %d: %d batches (%d rows) of %d batches (%d rows)", rank, world_size, len(mine),
                    sum(len(i.positions) for i in mine), len(sizes), sum(sizes))

    def materialize(self) -> None:
        """Reads a streamed iterable whole into the queue."""
        if self.stream is not None:
            self.pending.extend(self.stream)
            self.stream = None
            if self.plan is None:
                self.n_inputs = max((int(i.positions.max()) + 1 for i in self.pending if i.positions.size),
                                    default=0)

    def build(self, item: Item) -> Batch:
        if item.batch is not None:
            return item.batch
        return self.collator(item.positions)

    def restrict(self, item: Item, keep: np.ndarray, *, whole: bool = False) -> Item:
        """The item with only the rows at ``keep`` (row numbers within it); ``whole``: a batch of its own."""
        if item.batch is None:
            return Item(item.number, item.positions[keep], whole=whole)
        batch = take_rows(
            item.batch,
            torch.from_numpy(keep),
            padding_side=self.padding_side,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        return Item(item.number, item.positions[keep], batch, whole=whole)

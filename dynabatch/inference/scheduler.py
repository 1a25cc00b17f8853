"""The scheduler of :func:`dynabatch.run`: what runs next, on which worker, and at what size.

It sits between the source (:mod:`~dynabatch.inference.source`) and the workers, and owns every rule that decides a
batch's rows:

* **the memory mode**: ``measured`` (the loader's planner sizes each next batch from the lane's measured peaks),
  ``guarded`` (batches in their own order, split before they run where the measured peaks bound them above the
  budget), ``record`` and ``off`` (batches as they come);
* **the budget** (:meth:`Scheduler._feedback`, the one place a lane's budget is decided): the loader's absolute
  ``max_memory`` read on the lane's device, else the first measured call's peak;
* **lanes**: one per worker (device), each with its own peaks, budget, failed shapes and, in measured mode, its
  cursor in the planner's pass;
* **pre-splits**: the parts a batch is split into before it runs (a failed shape it is as large as, or the rows the
  measured peaks and out-of-memory errors allow: :mod:`dynabatch.memory.oom`'s policy);
* **rank shares**: lockstep (every rank the same number of batches, dealt by :mod:`dynabatch.sampling.ranks`) or
  claimed chunks (:func:`~dynabatch.inference.distributed.claimed_planner`);
* **rows already stored**, taken out of every batch before it is built.

A worker talks to it through :meth:`Scheduler.next` (the next item for its lane), :meth:`Scheduler.pre_split`,
:meth:`Scheduler.measure`, :meth:`Scheduler.report` (what a call measured, or that it ran out of memory) and
:meth:`Scheduler.requeue` (rows of a device that failed); the build stage reads :meth:`Scheduler.peek` to build
batches ahead. It holds positions only, never tensors.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from dynabatch.data.collate import Batch
    >>> from dynabatch.inference.scheduler import Scheduler
    >>> from dynabatch.inference.source import Source
    >>> batches = [Batch({"input_ids": torch.ones(n, 8, dtype=torch.long)}, indices=torch.arange(start, start + n))
    ...            for start, n in ((0, 4), (4, 2))]
    >>> stored = np.array([False, True, False, False, False, False])  # a store holds input 1
    >>> scheduler = Scheduler(Source(batches, None), memory="off", sparse=False, stored=stored)
    >>> lane = scheduler.lane()
    >>> item = scheduler.next(lane)
    >>> item.positions.tolist(), item.stored.tolist()
    ([0, 2, 3], [1])
    >>> scheduler.report(lane, item, out_of_memory=(3, 8))  # 3 rows x 8 tokens ran out of memory
    >>> scheduler.pre_split(lane, 3, 8).sizes, scheduler.pre_split(lane, 2, 8)
    ([1, 2], None)
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch.inference.source import Item, Source
from dynabatch.memory.feedback import MemoryFeedback
from dynabatch.memory.oom import dominating, equal_parts, split_sizes
from dynabatch.sampling.planner import PlanCursor
from dynabatch.sampling.ranks import deal, split_for_replicas

__all__ = ["Lane", "Scheduler", "Split"]

logger = logging.getLogger(__name__)


@dataclass
class Lane:
    """One worker's view of the scheduler: its measured peaks and budget (``feedback``), the shapes that ran out of
    memory on its device, and in measured mode its cursor in the planner's pass."""

    feedback: MemoryFeedback | None = None
    cursor: PlanCursor | None = None
    failed_shapes: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Split:
    """The parts a batch is split into before it runs, and why (for the log)."""

    sizes: list[int]
    reason: str


class Scheduler:
    """Hands out the items of ``source`` to any number of workers, each through its :class:`Lane`.

    Args:
        source: the run's :class:`~dynabatch.inference.source.Source`.
        memory: the resolved memory mode (``"measured"``, ``"guarded"``, ``"record"`` or ``"off"``).
        sparse: lanes measure only the calls that can let batches grow (the CPU tracker's cost).
        stored: which input positions a results store holds already (taken out of every batch), or ``None``.
        read_ahead: a plain iterable's batches read this many ahead (a background thread).
    """

    def __init__(self, source: Source, *, memory: str, sparse: bool, stored: np.ndarray | None = None,
                 read_ahead: int = 0) -> None:
        self.source = source
        self.guarded = memory == "guarded"
        self.sparse = sparse
        self.stored = stored if stored is not None and stored.any() else None
        self._lock = threading.Lock()  # several devices' workers share the scheduler
        self._retry: deque[Item] = deque()  # rows a failed device left, served first
        self._pending: deque[Item] = deque()  # items known up front, built ahead
        self._items: Iterator[Item] | None = None  # items that come as they are read or planned
        self._planner = None  # measured mode: the planner sizes every next batch
        self._number = 0
        self._first_rows: int | None = None  # guarded: a call's rows before any peak is measured
        self._seen = -1  # the largest input position handed out (a plain iterable's inputs are those it names)
        self._feed = None  # the claimed chunks' tokenizing feed (ranks="claim", a streamed plan)
        if memory == "measured":
            self._use_planner(source.planner)
        elif source.plan is not None and not source.streamed:
            self._pending.extend(source.items())  # the whole plan is known: its next batches can be built ahead
        else:
            self._items = source.items(read_ahead=read_ahead)
        if self.guarded and source.plan is not None:
            self._first_rows = source.first_rows()

    # --- rank shares ------------------------------------------------------------------------------------------

    def share(self, ranks: str, rank: int, world_size: int) -> None:
        """Keeps only this rank's share of the batches under ``ranks`` (``"single"``: every batch): ``"lockstep"``,
        every rank the same number of batches of the whole plan (the one routine of :mod:`dynabatch.sampling.ranks`:
        the largest batches split, then dealt in steps); ``"claim"``, the chunks of the plan this rank claims
        (:func:`~dynabatch.inference.distributed.claimed_planner`; a streamed plan tokenizes only those, stopped by
        :meth:`close`)."""
        if ranks == "lockstep":
            self._deal(rank, world_size)
        elif ranks == "claim":
            from dynabatch.inference.distributed import claimed_planner

            planner, self._feed = claimed_planner(self.source.plan)
            if self._planner is not None:
                self._use_planner(planner)
            else:
                self._pending.clear()
                self._items = (Item(n, b) for n, b in enumerate(planner.iter_batches()))

    def _deal(self, rank: int, world_size: int) -> None:
        from dynabatch.inference.distributed import check_same_batches

        items = [*self._pending, *(self._items or ())]
        self._items = None
        check_same_batches([i.positions for i in items])
        self._seen = max((int(i.positions.max()) for i in items if i.positions.size), default=-1)

        def split(item: Item, parts: int) -> list[Item]:
            return [item.keep(keep, whole=True) for keep in np.array_split(np.arange(len(item.positions)), parts)]

        shares = split_for_replicas(items, world_size, samples=lambda item: len(item.positions), split=split)
        mine = deal(shares, world_size, rank)
        for number, item in enumerate(mine):
            item.number = number
        self._pending = deque(mine)
        logger.info("rank %d of %d: %d batches (%d rows) of %d batches (%d rows)", rank, world_size, len(mine),
                    sum(len(i.positions) for i in mine), len(items), sum(len(i.positions) for i in items))

    def close(self) -> None:
        """Stops tokenizing the chunks this rank claims (after the chunk in progress)."""
        if self._feed is not None:
            self._feed.close()

    def _use_planner(self, planner: object) -> None:
        self._planner = planner
        planner.restart(sparse=self.sparse)

    # --- lanes and the budget -----------------------------------------------------------------------------------

    def _feedback(self, device: Any) -> MemoryFeedback:
        """A lane's peaks and budget: the one place the budget is decided. It is the loader's absolute budget
        (``max_memory``) resolved on the lane's ``device`` as the run starts, after the model is loaded; without one,
        the lane's first measured call's peak (:attr:`~dynabatch.memory.feedback.MemoryFeedback.budget`). Later calls
        stay under it."""
        feedback = MemoryFeedback(sparse=self.sparse)
        planner = self._planner if self._planner is not None else self.source.planner
        if planner is not None and device is not None:
            feedback.set_budget(planner.budget_on(device))
        return feedback

    def lane(self, device: Any = None) -> Lane:
        """A new worker's lane (``device``: where its peaks are measured, ``None`` for none): in measured mode its own
        planner cursor, in guarded mode its own peaks."""
        if self._planner is not None:
            feedback = self._feedback(device)
            return Lane(feedback, PlanCursor(feedback))
        return Lane(self._feedback(device) if self.guarded else None)

    # --- what runs next ---------------------------------------------------------------------------------------

    def next(self, lane: Lane) -> Item | None:
        """The next item for ``lane`` (sized by its cursor in measured mode), without the rows already stored
        (:attr:`Item.stored`; it may have no rows left to run); ``None`` when none is left."""
        with self._lock:
            item = self._next(lane)
            if item is not None and item.positions.size:
                self._seen = max(self._seen, int(item.positions.max()))
        return None if item is None else self._without_stored(item)

    @property
    def n_inputs(self) -> int:
        """How many inputs the run has: the loader's, or (a plain iterable) the largest position its batches named
        so far + 1."""
        return self.source.n_inputs if self.source.n_inputs is not None else self._seen + 1

    def _next(self, lane: Lane) -> Item | None:
        if self._retry:
            return self._retry.popleft()
        if self._planner is not None:
            positions = self._planner.next_batch(lane.cursor)
            if positions is None:
                return None
            self._number += 1
            return Item(self._number - 1, positions)
        if self._pending:
            return self._pending.popleft()
        item = next(self._items, None) if self._items is not None else None
        if item is None:
            self._items = None
        return item

    def _is_stored(self, positions: np.ndarray) -> np.ndarray:
        """Whether the store holds each of ``positions``."""
        stored = np.zeros(len(positions), dtype=bool)
        if self.stored is not None:
            inside = positions < len(self.stored)
            stored[inside] = self.stored[positions[inside]]
        return stored

    def _without_stored(self, item: Item) -> Item:
        stored = self._is_stored(item.positions) if not item.crashes else np.zeros(0, dtype=bool)
        if not stored.any():
            return item
        rest = item.keep(np.flatnonzero(~stored))
        rest.stored = item.positions[stored]
        return rest

    def peek(self, lane: Lane, n: int) -> list[np.ndarray]:
        """The positions of the next ``n`` batches to build as they stand now (stored rows taken out): built ahead;
        in measured mode a later peak may re-size them. A plain iterable's batches come built: nothing to peek."""
        with self._lock:
            if self._planner is not None:
                ahead = self._planner.peek(n, lane.cursor)
            else:
                ahead = [item.positions for item, _ in zip(self._pending, range(n)) if item.batch is None]
        ahead = [p[~self._is_stored(p)] for p in ahead]
        return [p for p in ahead if p.size]

    def requeue(self, item: Item) -> None:
        """Puts back the rows of an item whose device failed; the next worker to ask runs them first."""
        with self._lock:
            self._retry.append(item)

    # --- what the memory mode learns --------------------------------------------------------------------------

    def measure(self, lane: Lane, rows: int, width: int) -> bool:
        """Whether a call of ``rows`` x ``width`` on ``lane`` is measured (always, unless measuring is sparse)."""
        return lane.feedback is None or lane.feedback.should_measure(rows, width)

    def pre_split(self, lane: Lane, rows: int, width: int) -> Split | None:
        """The parts a call of ``rows`` x ``width`` is split into before it runs on ``lane``, or ``None`` to run it:
        halves when it is as large as a shape that ran out of memory there, else (guarded mode, or after an
        out-of-memory error) the fewest equal parts under the rows the measured peaks and errors allow."""
        if rows < 2:
            return None
        failed = dominating(lane.failed_shapes, rows, width)
        if failed is not None:
            return Split(split_sizes(rows), "as large as {} x {} which ran out of memory".format(*failed))
        cap = self._cap(lane, width)
        if cap is None or rows <= cap:
            return None
        return Split(equal_parts(rows, cap), f"the measured peaks and out-of-memory errors keep at most {cap} rows "
                     "of that width")

    def _cap(self, lane: Lane, width: int) -> int | None:
        """Guarded mode: the most rows a call of padded ``width`` may have, or ``None`` for no cap.

        Before any peak is measured: the plan's first batch's rows (a dynabatch loader; its first batch is the
        longest, so fewer rows never cost more). Then: the most rows the measured peaks bound at or under the budget
        (:meth:`~dynabatch.memory.feedback.MemoryFeedback.max_rows`); ``None`` when no measured call at least as wide
        stays under it (a plain iterable's batch wider than every batch measured so far runs as it comes). Either
        way no more than out-of-memory errors allow.
        """
        if not self.guarded:
            return None
        feedback = lane.feedback
        budget = feedback.budget
        caps = [self._first_rows or None if budget is None else feedback.max_rows(width, budget) or None,
                feedback.oom_cap(width)]
        caps = [c for c in caps if c is not None]
        return min(caps) if caps else None

    def report(self, lane: Lane, item: Item, *, ran: list[tuple[int, int, int]] = (),
               out_of_memory: tuple[int, int] | None = None) -> None:
        """What ``lane``'s worker saw running ``item``: a call of ``out_of_memory=(rows, width)`` ran out of memory
        (later calls there are sized or capped under the lower limit it shows, and shapes as large are split first),
        or the item finished with the measured ``ran=[(rows, width, peak), ...]``. Measured mode learns from an item
        only when it ran whole (the planner re-sizes from it); guarded mode from every measured call."""
        with self._lock:
            if out_of_memory is not None:
                lane.failed_shapes.append(out_of_memory)
                if self._planner is not None:
                    self._planner.observe_out_of_memory(*out_of_memory, lane.cursor)
                elif lane.feedback is not None:
                    lane.feedback.observe_out_of_memory(*out_of_memory)
            if not ran:
                return
            if self._planner is None:
                if lane.feedback is not None:
                    lane.feedback.observe_parts(ran)
            elif item.whole:
                self._planner.observe_parts(ran, lane.cursor)

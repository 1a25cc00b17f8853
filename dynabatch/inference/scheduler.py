"""The scheduler of :func:`dynabatch.run`: what runs next, on which worker, and at what size; every rule that decides
a batch's rows is here (``docs/architecture.md``, Scheduler). It holds positions, never tensors.

Example:
    >>> import numpy as np
    >>> import torch
    >>> from dynabatch.data.collate import Batch
    >>> from dynabatch.inference.execute import Outcome
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
    >>> scheduler.update(lane, Outcome(item, out_of_memory=[(3, 8)]))  # 3 rows x 8 tokens ran out of memory
    >>> sizing = scheduler.next(lane).sizing
    >>> sizing.split(3, 8).sizes, sizing.split(2, 8)
    ([1, 2], None)
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dynabatch.inference.source import Item, Source
from dynabatch.memory.feedback import MemoryFeedback
from dynabatch.memory.oom import dominating, equal_parts, split_sizes
from dynabatch.sampling.planner import PlanCursor

__all__ = ["Scheduler", "Sizing", "Split"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """The parts a batch is split into before it runs, and why (for the log)."""

    sizes: list[int]
    reason: str


@dataclass
class Sizing:
    """One worker's lane of the scheduler, which sizes the pieces of the items it hands that worker: the shapes that
    ran out of memory on its device (``failed``), its measured peaks and budget (``feedback``), in measured mode its
    ``cursor`` in the planner's pass, whether calls are capped by the peaks (``guarded``) and the rows a call may have
    before any peak is measured (``first_rows``)."""

    feedback: MemoryFeedback | None = None
    cursor: PlanCursor | None = None
    failed: list[tuple[int, int]] = field(default_factory=list)
    guarded: bool = False
    first_rows: int | None = None

    def measure(self, rows: int, width: int) -> bool:
        """Whether a call of ``rows`` x ``width`` is measured (always, unless measuring is sparse)."""
        return self.feedback is None or self.feedback.should_measure(rows, width)

    def split(self, rows: int, width: int, failed: Sequence[tuple[int, int]] = ()) -> Split | None:
        """The parts a call of ``rows`` x ``width`` is split into before it runs, or ``None`` to run it: halves when it
        is as large as a shape that ran out of memory (on the lane, or ``failed`` while the item ran); else, guarded,
        the fewest equal parts under the rows a call of that width may have: ``first_rows`` before any peak is
        measured, then the most the peaks bound under the budget (one, where every call measured as wide peaked above
        an absolute budget), never more than out-of-memory errors allow."""
        if rows < 2:
            return None
        shape = dominating([*self.failed, *failed], rows, width)
        if shape is not None:
            return Split(split_sizes(rows), "as large as {} x {} which ran out of memory".format(*shape))
        if not self.guarded:
            return None
        budget = self.feedback.budget
        bounded = self.first_rows if budget is None else self.feedback.max_rows(width, budget)  # 0: none bound
        over = not bounded and budget is not None and self.feedback.row_bound(width) is not None
        if over:
            # max_rows is 0 both where nothing as wide was measured (no bound: the call runs) and where every call
            # as wide peaked above the budget (an absolute max_memory under the plan's first batch): the latter
            # bounds no rows under it, so rows run alone, as measured mode plans them, never whole above it
            bounded = 1
        cap = min((c for c in (bounded, self.feedback.oom_cap(width)) if c), default=None)
        if cap is None or rows <= cap:
            return None
        if over and cap == 1:
            return Split(equal_parts(rows, cap), f"every call measured at least as wide peaked above the budget of "
                         f"{budget:,.0f} bytes: rows alone")
        return Split(equal_parts(rows, cap), f"the measured peaks and out-of-memory errors keep at most {cap} rows "
                     "of that width")


class Scheduler:
    """Hands out the items of ``source`` to any number of workers, each through its lane (``memory``: the
    resolved mode; ``sparse``: measure only the calls that can let batches grow; ``stored``: which positions a store
    holds; ``read_ahead``: a plain iterable's batches read this many ahead)."""

    def __init__(self, source: Source, *, memory: str, sparse: bool, stored: np.ndarray | None = None,
                 read_ahead: int = 0) -> None:
        self.guarded, self.sparse = memory == "guarded", sparse
        self.stored = stored
        self._lock = threading.Lock()  # several devices' workers share the scheduler
        self._retry: deque[Item] = deque()  # rows a failed device left, served first
        self._pending: deque[Item] = deque()  # items known up front, built ahead
        self._items: Iterator[Item] = iter(())  # items that come as they are read or planned
        self._planner = None  # measured mode: the planner sizes every next batch
        self._budgets = None if source.plan is None else source.plan.planner  # an absolute budget, read on a device
        self._numbers = itertools.count()  # measured mode: the planner's batches numbered as they are handed out
        self._first_rows = self._budgets.first_rows() if self.guarded and self._budgets is not None else None
        if memory == "measured":
            self._planner = self._budgets = source.planner
            self._planner.restart(sparse=sparse)
        elif source.known:
            self._pending.extend(source.items())  # the whole plan is known: its next batches can be built ahead
        else:
            self._items = source.items(read_ahead=read_ahead)

    def _feedback(self, device: Any) -> MemoryFeedback:
        """A lane's peaks and budget, the one place the budget is decided: the loader's absolute ``max_memory`` read
        on the lane's ``device`` as the run starts, else the lane's first measured call's peak."""
        feedback = MemoryFeedback(sparse=self.sparse)
        if self._budgets is not None and device is not None:
            feedback.set_budget(self._budgets.budget_on(device))
        return feedback

    def lane(self, device: Any = None) -> Sizing:
        """A new worker's lane (``device``: where its peaks are measured, ``None`` for none): in measured mode its own
        planner cursor, in guarded mode its own peaks."""
        feedback = self._feedback(device) if self.guarded or self._planner is not None else None
        cursor = None if self._planner is None else PlanCursor(feedback)
        return Sizing(feedback, cursor, [], self.guarded, self._first_rows)

    def next(self, lane: Sizing) -> Item | None:
        """The next item for ``lane`` (sized by its cursor in measured mode), without the rows already stored
        (:attr:`Item.stored`; it may have no rows left to run), sized by ``lane``; ``None`` when none is left."""
        with self._lock:
            if self._retry:
                item = self._retry.popleft()
            elif self._planner is not None:
                positions = self._planner.next_batch(lane.cursor)
                item = None if positions is None else Item(next(self._numbers), positions)
            else:
                item = self._pending.popleft() if self._pending else next(self._items, None)
        if item is None:
            return None
        stored = self._is_stored(item.positions)  # rows put back after a device failed were never stored
        if stored.any():
            item = replace(item.keep(np.flatnonzero(~stored)), stored=item.positions[stored])
        return replace(item, sizing=lane)

    def _is_stored(self, positions: np.ndarray) -> np.ndarray:
        """Whether the store holds each of ``positions``."""
        stored = np.zeros(len(positions), dtype=bool)
        if self.stored is not None:
            inside = positions < len(self.stored)
            stored[inside] = self.stored[positions[inside]]
        return stored

    def peek(self, lane: Sizing, n: int) -> list[np.ndarray]:
        """The positions of the next ``n`` batches to build as they stand now (stored rows taken out): built ahead;
        in measured mode a later peak may re-size them. A plain iterable's batches come built: nothing to peek."""
        with self._lock:
            if self._planner is not None:
                ahead = self._planner.peek(n, lane.cursor)
            else:
                ahead = [item.positions for item in itertools.islice(self._pending, n) if item.batch is None]
        ahead = [p[~self._is_stored(p)] for p in ahead]
        return [p for p in ahead if p.size]

    def update(self, lane: Sizing, outcome: Any) -> None:
        """What ``lane``'s worker saw running an item (an :class:`~dynabatch.inference.execute.Outcome`): its shapes
        that ran out of memory, its measured calls (measured mode learns only from an item that ran whole, guarded
        mode sets its budget only from one), and its unfinished rows (put back, run first)."""
        with self._lock:
            for shape in outcome.out_of_memory:
                lane.failed.append(shape)
                if self._planner is not None:
                    self._planner.observe_out_of_memory(*shape, lane.cursor)
                elif lane.feedback is not None:
                    lane.feedback.observe_out_of_memory(*shape)
            if outcome.unfinished is not None:
                self._retry.append(outcome.unfinished)
            if outcome.measured and self._planner is None and lane.feedback is not None and (
                    outcome.item.whole or lane.feedback.budget is not None):
                # the budget is the first batch's peak as planned: the rows a store left of a batch, or a failed
                # device left, peak lower (guarded, a rerun whose first batch was one row left ran every row alone)
                lane.feedback.observe_parts(outcome.measured)
            elif outcome.measured and self._planner is not None and outcome.item.whole:
                self._planner.observe_parts(outcome.measured, lane.cursor)

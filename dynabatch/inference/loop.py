"""The worker loop of :func:`dynabatch.run`, per device or rank: the one place that talks to more than one stage
(``docs/architecture.md``, Loop): an item from the scheduler, its batch built, its outcome handed to every stage."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dynabatch._background import Worker, run_in_threads
from dynabatch._validation import brief_error
from dynabatch.inference.build import Builder, Built
from dynabatch.inference.execute import Executor, Outcome
from dynabatch.inference.meter import Laps, Meter
from dynabatch.inference.report import RunReport
from dynabatch.inference.scheduler import Scheduler, Sizing
from dynabatch.inference.source import Item, Source
from dynabatch.memory.device import is_device_failure, make_current

__all__ = ["Prefetcher", "Stages", "WorkerParts", "run_workers"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """Hands one worker its items with their batches, building its next ``depth`` batches in a background thread, as
    the scheduler sees them now (:meth:`~dynabatch.inference.scheduler.Scheduler.peek`); one a later peak re-sized is
    built again, never run stale (:attr:`rebuilt` counts them)."""

    def __init__(self, scheduler: Scheduler, builder: Builder, lane: Sizing, depth: int) -> None:
        self.scheduler, self.builder, self.lane, self.depth = scheduler, builder, lane, depth
        self.ahead: deque[tuple[np.ndarray, Built]] = deque()  # positions -> their batch, built ahead
        self._worker = Worker(depth=1, name="dynabatch-prefetch") if depth else None
        self.rebuilt = 0

    def next_item(self) -> Item | None:
        """The lane's next item (``None``: none left), once the batches built ahead, peeked before it, are."""
        if self._worker is not None:
            self._worker.wait()  # an error building a batch raises here
        return self.scheduler.next(self.lane)

    def build(self, item: Item) -> Built | None:
        """``item``'s batch, built ahead or now (``None``: every row is stored); then the next ones are built ahead."""
        built = None
        if item.positions.size:
            built = (self._take(item.positions) if item.batch is None else None) or self.builder.build(item)
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
        """The background thread's turn: the next batches as they stand, built (the planner asked) off the device's."""
        for positions in self.scheduler.peek(self.lane, self.depth)[len(self.ahead):]:
            self.ahead.append((positions, self.builder.build(Item(-1, positions))))

    def close(self) -> None:
        """Stops the background thread (after the batch it is building) and drops what it built."""
        if self._worker is not None:
            self._worker.close(cancel=True)
        self.ahead.clear()


@dataclass
class Stages:
    """What every worker's loop shares: the stages it hands values to, ``stop`` (set when the run stops), batches
    built ahead, what makes a worker's :class:`~dynabatch.inference.distributed.Lockstep` (``None``: none), and the
    run's report (each item's record as it ends)."""

    source: Source
    scheduler: Scheduler
    builder: Builder
    sink: Any
    meter: Meter | None
    stop: threading.Event
    prefetch: int
    lockstep: Callable[[], Any] | None = None
    report: RunReport = field(default_factory=RunReport)


@dataclass
class WorkerParts:
    """One worker's own: its executor, its lane, its writer (closed, its rows committed, as it ends), its name."""

    executor: Executor
    lane: Sizing
    writer: Any
    name: str


def run_workers(targets: Sequence[Any], start_worker: Callable[[Any, int], WorkerParts], stages: Stages) -> None:
    """Runs the scheduler's items to their end on every target, one worker in the calling thread or a thread per
    device (:func:`~dynabatch._background.run_in_threads`), into ``stages.report``; ``start_worker(target, i)``, called
    in the worker's thread once its device is current there, returns the worker's parts.

    On any exit every thread has stopped and every worker's writer is closed. A device failure on one of several
    devices ends that worker, its unfinished rows put back once; any other error stops every worker and is raised
    (the rows finished before it are in the sink).
    """
    crashes: list[BaseException] = []  # what stopped one device's worker, its rows put back
    prefetchers: list[Prefetcher] = []
    busy, lock = [0], threading.Lock()  # workers holding an item (a failed device puts its rows back: others wait)
    several = len(targets) > 1

    def next_item(prefetcher: Prefetcher) -> Item | None:
        while not stages.stop.is_set():
            with lock:
                item = prefetcher.next_item()
                if item is not None or not busy[0]:
                    busy[0] += item is not None
                    return item
            stages.stop.wait(0.01)  # nothing to run while another worker runs: its device may fail and put rows back
        return None

    def work(i: int, target: Any) -> None:
        if several:
            make_current(target)
        laps = Laps(stages.meter.started if stages.meter is not None else None)  # making fn counts as the start
        worker = _WorkerLoop(stages, start_worker(target, i), laps, several)
        prefetchers.append(worker.prefetcher)
        try:
            while (item := next_item(worker.prefetcher)) is not None:
                try:
                    if (crash := worker.run(item)) is not None:
                        crashes.append(crash)
                        return
                finally:
                    with lock:
                        busy[0] -= 1
        except BaseException as exc:
            if several:
                logger.error("device %s: its worker stopped the run: %s", target, brief_error(exc))
            raise
        finally:
            worker.end()

    try:
        if not several:
            return work(0, targets[0])
        run_in_threads([lambda i=i, t=t: work(i, t) for i, t in enumerate(targets)], stages.stop,
                       names=[f"dynabatch-{t}" for t in targets])
    finally:
        stages.report.rebuilt_batches = sum(p.rebuilt for p in prefetchers)
    left = prefetchers[0].next_item() if prefetchers else None
    if left is not None:  # every device failed, each on other rows: the first failure stops the run
        crashes[0].add_note(f"every device failed with batches left to run (batch {left.number} first)")
        raise crashes[0]


class _WorkerLoop:
    """One worker's loop: ``item = next``, its batch built, the outcome of its run handed to every stage."""

    def __init__(self, stages: Stages, parts: WorkerParts, laps: Laps, several: bool) -> None:
        self.stages, self.parts, self.laps, self.several = stages, parts, laps, several
        self.prefetcher = Prefetcher(stages.scheduler, stages.builder, parts.lane, stages.prefetch)
        self.lockstep = stages.lockstep() if stages.lockstep is not None else None
        self.seconds = self.laps.lap("start")  # the seconds not yet given to a record

    def run(self, item: Item) -> BaseException | None:
        """Runs ``item``, its outcome handed on; returns the device failure that ended this worker (rows put back)."""
        stages, executor, outcome = self.stages, self.parts.executor, None
        try:
            _merge(self.seconds, self.laps.lap("plan"))
            built = self.prefetcher.build(item)
            stages.source.done(np.concatenate([item.positions, item.stored]))
            if built is not None and built.stored is not None:
                stages.sink.check_inputs(*built.stored)  # a plain iterable's stored rows: before any row is written
            _merge(self.seconds, self.laps.lap("build"))
            executor.start(item, built)
            try:
                if self.lockstep is not None:
                    self.lockstep.run(executor, item, built)
                else:
                    while executor.pending and not stages.stop.is_set():
                        executor.step()
            finally:  # the rows that finished before an error count too
                outcome = executor.outcome()
                self._hand_on(outcome, built)
        except Exception as exc:
            if not (self.several and is_device_failure(exc)):
                raise
            self._put_back(outcome or Outcome(item, unfinished=item), exc)
            return exc
        stages.scheduler.update(self.parts.lane, outcome)
        return None

    def _hand_on(self, outcome: Outcome, built: Built | None) -> None:
        """The outcome's rows and failed inputs to the writer, its record to the report, what it ran to the meter."""
        stages, writer, start = self.stages, self.parts.writer, time.perf_counter()
        failed = np.fromiter(outcome.failed, dtype=np.int64, count=len(outcome.failed))
        if len(outcome.positions):
            writer.write(outcome.positions, outcome.rows, built.hashes_at(outcome.positions), varying=outcome.varying)
        if len(failed):
            writer.fail(failed, built.hashes_at(failed), list(outcome.failed.values()))
        handing = time.perf_counter() - start
        _merge(self.seconds, self.laps.lap("plan", {**outcome.seconds, "store": handing}))
        if outcome.record is None:  # no row finished or was set aside
            return
        record = replace(outcome.record, seconds=outcome.record.seconds + handing, stages=self.seconds,
                         finished=self.laps.at(), device=self.parts.name if self.several else None)
        self.seconds = {}
        stages.report.records.append(record)
        if record.peak_bytes is not None:  # the budget a device's peaks are read against: its first one
            if self.several:
                stages.report.device_budgets.setdefault(self.parts.name, record.peak_bytes)
            if stages.report.budget_bytes is None:
                stages.report.budget_bytes = record.peak_bytes
        if stages.meter is not None:
            done = np.concatenate([outcome.positions, failed])
            stages.meter.add(done, rows=len(done), real_tokens=outcome.tokens, padded_tokens=record.padded_tokens,
                             width=record.width, worker=self.parts.name,
                             whole=not (record.oom_events or record.error_rows))

    def _put_back(self, outcome: Outcome, exc: BaseException) -> None:
        """Puts the unfinished rows of an item whose device failed back once (``exc`` raised on their second)."""
        rest = outcome.unfinished
        if rest is not None and len(rest.positions):
            if rest.crashes:
                logger.error("device %s: batch %d failed again (%s); it made another device fail before",
                             self.parts.name, rest.number, brief_error(exc))
                raise exc
            logger.error("device %s failed on batch %d (%s); its %d unfinished rows go back to the other devices",
                         self.parts.name, rest.number, brief_error(exc), len(rest.positions))
            rest = replace(rest, crashes=rest.crashes + 1, whole=False)
        else:
            rest = None
        self.stages.scheduler.update(self.parts.lane, replace(outcome, unfinished=rest))

    def end(self) -> None:
        """The worker ends: its builds ahead stopped, its writer closed (its rows committed, the store's time), its
        laps summed."""
        try:
            self.prefetcher.close()
        finally:
            self.laps.lap("plan")
            self.parts.writer.close()  # a store commits the rows it holds here: on a slow disk, much of the run
            self.laps.lap("store")
            self.stages.report.workers[self.parts.name] = self.laps.summary()


def _merge(into: dict[str, float], seconds: dict[str, float]) -> None:
    for stage, value in seconds.items():
        into[stage] = into.get(stage, 0.0) + value

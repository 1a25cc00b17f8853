"""The worker loop of :func:`dynabatch.run`: per device or rank, the one place that talks to more than one stage.

Each worker asks the scheduler for its next item, already sized (:meth:`~dynabatch.inference.scheduler.Scheduler.
next`), takes its batch from the build stage (built ahead by :class:`Prefetcher`), has the executor run it
(:mod:`~dynabatch.inference.execute`) and hands the outcome, a value, to each stage in turn: its rows and failed inputs
to the sink's writer, what it measured to the scheduler (:meth:`~dynabatch.inference.scheduler.Scheduler.update`),
the inputs it is done with to the source (:meth:`~dynabatch.inference.source.Source.done`) and its rows to the meter.
No stage calls another.

:func:`run_workers` runs one worker in the calling thread, or a thread per device
(:func:`dynabatch._background.run_in_threads`: torch releases the GIL while a device works, and it runs in a notebook).
A device failure (:func:`~dynabatch.memory.device.is_device_failure`) ends that device's worker and puts its
unfinished rows back once; any other error stops every worker and is raised. Every thread it starts has stopped when
it returns or raises, Ctrl-C included.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynabatch._background import Worker, run_in_threads
from dynabatch._validation import brief_error
from dynabatch.inference.build import Builder, Built
from dynabatch.inference.execute import Executor, Outcome
from dynabatch.inference.meter import Laps, Meter
from dynabatch.inference.report import RunReport
from dynabatch.inference.scheduler import Lane, Scheduler
from dynabatch.inference.source import Item, Source
from dynabatch.memory.device import is_device_failure, make_current

__all__ = ["Prefetcher", "Stages", "WorkerParts", "run_workers"]

logger = logging.getLogger(__name__)


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
        """``item``'s batch (built ahead, or now; ``None`` when every row of it is stored); then the next batches are
        built ahead."""
        built = None
        if item.positions.size:
            built = self._take(item.positions) if item.batch is None else None
            built = built or self.builder.build(item)
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


@dataclass
class Stages:
    """What every worker's loop shares: the stages it hands values to, ``stop`` (set when the run stops: each worker
    ends its call in progress), ``prefetch`` (batches built ahead) and ``lockstep`` (a new worker's
    :class:`~dynabatch.inference.distributed.Lockstep`, or ``None``: each worker runs its items to their end alone)."""

    source: Source
    scheduler: Scheduler
    builder: Builder
    sink: Any
    meter: Meter | None
    stop: threading.Event
    prefetch: int
    lockstep: Callable[[], Any] | None = None


@dataclass
class WorkerParts:
    """One worker's own parts: its executor, its lane of the scheduler, its writer of the sink, and its name."""

    executor: Executor
    lane: Lane
    writer: Any
    name: str


def run_workers(targets: Sequence[Any], start_worker: Callable[[Any, int], WorkerParts], stages: Stages,
                reports: list[tuple[str, RunReport]]) -> None:
    """Runs the scheduler's items to their end on every target: one worker in the calling thread, or a thread per
    device; each worker's name and report go into ``reports`` as it starts (each item's record, with its seconds by
    stage: planning, building, the device, the store, the waits on the stages ahead; rows that finished before an error
    included).

    ``start_worker(target, i)`` returns the worker's parts; it is called in the worker's thread, once the device is
    current there (so is the ``make_fn`` inside it). On any exit every thread has stopped: on an error or
    ``KeyboardInterrupt``, ``stages.stop`` is set and each worker ends its call in progress.

    A device failure (:func:`~dynabatch.memory.device.is_device_failure`) on one of several devices ends that worker;
    its unfinished rows go back to the scheduler once (rows that make a second device fail raise). Any other error
    (``fn`` raising, the sink refusing or failing to write rows, a batch failing to build) stops every worker and is
    raised: the rows finished before it are in the sink, the others are not.
    """
    crashes: list[BaseException] = []  # what stopped one device's worker, its rows put back
    prefetchers: list[Prefetcher] = []
    several = len(targets) > 1
    busy = _Busy(stages.stop)

    def work(i: int, target: Any) -> None:
        if several:
            make_current(target)
        laps = Laps(stages.meter.started if stages.meter is not None else None)
        try:
            _WorkerLoop(stages, start_worker(target, i), busy, several, laps).run(reports, prefetchers)
        except _DeviceFailed as failed:
            crashes.append(failed.error)
        except BaseException as exc:
            if several:
                logger.error("device %s: its worker stopped the run: %s", target, brief_error(exc))
            raise

    if not several:
        work(0, targets[0])
        return
    run_in_threads([lambda i=i, t=t: work(i, t) for i, t in enumerate(targets)], stages.stop,
                   names=[f"dynabatch-{t}" for t in targets])
    left = prefetchers[0].next_item() if prefetchers else None
    if left is not None:  # every device failed, each on other rows: the first failure stops the run
        crashes[0].add_note(f"every device failed with batches left to run (batch {left.number} first)")
        raise crashes[0]


class _DeviceFailed(Exception):
    """A worker's device failed and its rows went back to the other devices."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Busy:
    """How many workers hold an item: a worker finding nothing to run waits while another runs (its device may fail
    and put rows back)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop, self.count, self.lock = stop, 0, threading.Lock()

    def next_item(self, prefetcher: Prefetcher) -> Item | None:
        while not self.stop.is_set():
            with self.lock:
                item = prefetcher.next_item()
                if item is not None or not self.count:
                    self.count += item is not None
                    return item
            self.stop.wait(0.01)
        return None

    def done(self) -> None:
        with self.lock:
            self.count -= 1


class _WorkerLoop:
    """One worker's loop: ``item = next``, its batch built, the outcome of its run handed to every stage."""

    def __init__(self, stages: Stages, parts: WorkerParts, busy: _Busy, several: bool, laps: Laps) -> None:
        self.stages, self.parts, self.busy, self.several, self.laps = stages, parts, busy, several, laps
        self.report = RunReport()
        self.lockstep = stages.lockstep() if stages.lockstep is not None else None

    def run(self, reports: list[tuple[str, RunReport]], prefetchers: list[Prefetcher]) -> None:
        stages, parts = self.stages, self.parts
        prefetcher = Prefetcher(stages.scheduler, stages.builder, parts.lane, stages.prefetch)
        prefetchers.append(prefetcher)
        reports.append((parts.name, self.report))
        seconds = self.laps.lap("start")
        try:
            while (item := self.busy.next_item(prefetcher)) is not None:
                try:
                    seconds = self._item(item, prefetcher, seconds)
                finally:
                    self.busy.done()
        finally:
            self.report.rebuilt_batches = prefetcher.rebuilt
            prefetcher.close()
            self.laps.lap("plan")
            self.report.workers[parts.name] = self.laps.summary()

    def _item(self, item: Item, prefetcher: Prefetcher, seconds: dict[str, float]) -> dict[str, float]:
        """Runs ``item`` and hands its outcome on; returns the seconds not yet given to a record."""
        stages, executor = self.stages, self.parts.executor
        outcome = None
        try:
            _merge(seconds, self.laps.lap("plan"))
            built = prefetcher.build(item)
            stages.source.done(np.concatenate([item.positions, item.stored]))
            if built is not None and built.stored is not None:
                stages.sink.check_inputs(*built.stored)  # a plain iterable's stored rows: before any row is written
            _merge(seconds, self.laps.lap("build"))
            executor.start(item, built)
            try:
                if self.lockstep is not None:
                    self.lockstep.run(executor, item, built)
                else:
                    while executor.pending and not stages.stop.is_set():
                        executor.step()
            finally:  # the rows that finished before an error count too
                outcome = executor.outcome()
                seconds = self._hand_on(outcome, built, seconds)
        except Exception as exc:
            if not (self.several and is_device_failure(exc)):
                raise
            self._put_back(item if outcome is None else outcome.unfinished, outcome or Outcome(item), exc)
            raise _DeviceFailed(exc) from exc
        stages.scheduler.update(self.parts.lane, outcome)
        return seconds

    def _hand_on(self, outcome: Outcome, built: Built | None, seconds: dict[str, float]) -> dict[str, float]:
        """The outcome's rows and failed inputs to the sink's writer, its record to the report, what it ran to the
        meter; returns the seconds not yet given to a record."""
        writer, start = self.parts.writer, time.perf_counter()
        if len(outcome.positions):
            writer.write(outcome.positions, outcome.rows, built.hashes_at(outcome.positions), varying=outcome.varying)
        if outcome.failed:
            failed = np.fromiter(outcome.failed, dtype=np.int64, count=len(outcome.failed))
            writer.fail(failed, built.hashes_at(failed), list(outcome.failed.values()))
        handing = time.perf_counter() - start
        _merge(seconds, self.laps.lap("plan", {**outcome.seconds, "store": handing}))
        record, done = outcome.record, outcome.done
        if record is not None:
            record.seconds += handing
            record.stages, seconds = seconds, {}
            record.finished = self.laps.at()
            self.report.records.append(record)
            if self.report.budget_bytes is None and record.peak_bytes is not None:
                self.report.budget_bytes = record.peak_bytes
        if self.stages.meter is not None and len(done):
            self.stages.meter.add(done, rows=len(done), real_tokens=outcome.tokens,
                                  padded_tokens=record.padded_tokens if record is not None else 0,
                                  width=record.width if record is not None else None)
        return seconds

    def _put_back(self, rest: Item | None, outcome: Outcome, exc: BaseException) -> None:
        """Puts the unfinished rows of an item whose device failed back once; raises ``exc`` on their second
        failure."""
        device = self.parts.name
        if rest is not None and len(rest.positions):
            if rest.crashes:
                logger.error("device %s: batch %d failed again (%s); it made another device fail before", device,
                             rest.number, brief_error(exc))
                raise exc
            logger.error("device %s failed on batch %d (%s); its %d unfinished rows go back to the other devices",
                         device, rest.number, brief_error(exc), len(rest.positions))
            rest.crashes += 1
            rest.whole = False
        outcome.unfinished = rest
        self.stages.scheduler.update(self.parts.lane, outcome)


def _merge(into: dict[str, float], seconds: dict[str, float]) -> None:
    for stage, value in seconds.items():
        into[stage] = into.get(stage, 0.0) + value

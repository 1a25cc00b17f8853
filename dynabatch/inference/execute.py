"""The executor of :func:`dynabatch.run`: a worker per device, each batch through the one out-of-memory policy.

:class:`Executor` runs one item at a time on its device: its batch (built ahead by the build stage,
:mod:`~dynabatch.inference.build`) is copied to the device (:func:`dynabatch.memory.device.copier`: on CUDA a copy
stream of its own), passed to ``fn``, split into rows by the run's row rule and handed to the sink with their input
hashes. A piece that runs out of memory is split in halves and retried, down to one row; one the scheduler says to
split (:meth:`~dynabatch.inference.scheduler.Scheduler.pre_split`) is split before it is tried. What each call
measured, or that it ran out of memory, goes back to the scheduler (:meth:`~dynabatch.inference.scheduler.Scheduler.
report`), which sizes what runs next.

An error ``fn`` raises splits its batch in halves until the rows that fail are alone (bounded: see
:meth:`Executor._fn_failed`); ``on_error="raise"`` raises the first such row's error with a note naming its position
and id, ``on_error="skip"`` sets each aside with the error's text as its cause; the others run as usual.

:func:`run_workers` runs the scheduler's items: one worker in the calling thread, or a thread per device (threads:
torch releases the GIL while a device works, and it runs in a notebook). A device failure
(:func:`~dynabatch.memory.device.is_device_failure`) ends that device's worker and puts its unfinished rows back once;
any other error stops every worker and is raised. Every thread it starts has stopped when it returns or raises,
Ctrl-C included.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch.data.collate import Batch, batch_shape, real_tokens
from dynabatch.inference.build import Builder, Built, Prefetcher
from dynabatch.inference.meter import Laps, Meter
from dynabatch.inference.outputs import RowSplitter
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.scheduler import Lane, Scheduler
from dynabatch.inference.source import Item
from dynabatch.memory.device import is_device_failure, is_out_of_memory_error, make_current
from dynabatch.memory.oom import call_guarded, split_sizes
from dynabatch.sampling.ranks import reduce_across_ranks

__all__ = ["BatchOutOfMemoryError", "Executor", "Ran", "explain_index_errors", "run_workers"]

logger = logging.getLogger(__name__)

_FEW = 5  # positions (and ids) a note names

_SET_ASIDE = "on_error='skip' (--on-error skip on the command line) sets the rows it raises on alone aside"

_EMBEDDING_MESSAGE = "index out of range in self"  # torch's message for an embedding index out of range


class BatchOutOfMemoryError(RuntimeError):
    """A single row (input ``position``) ran out of memory on its own (``on_oom="raise"``); chained from the
    original error. ``partial``: the result so far, the rows not finished ``None``."""

    def __init__(self, message: str, *, position: int | None = None, partial: Any = None) -> None:
        super().__init__(message)
        self.position = position
        self.partial = partial

    def __reduce__(self) -> tuple:
        return type(self), (str(self),), {"position": self.position, "partial": self.partial}


def _brief(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text[:200]}"


def explain_index_errors(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn``, with an embedding lookup's ``IndexError`` raised again naming its likely cause (chained).

    A model given rows longer than its position embeddings, or token ids of another tokenizer, fails deep in its
    forward with torch's bare ``IndexError: index out of range in self``. Any other error propagates unchanged.

    Example:
        >>> import torch
        >>> from dynabatch.inference.execute import explain_index_errors
        >>> embed = torch.nn.Embedding(8, 2)
        >>> fn = explain_index_errors(lambda batch: embed(batch["input_ids"]))
        >>> fn({"input_ids": torch.tensor([[1, 9]])})
        Traceback (most recent call last):
        ...
        IndexError: fn(batch) failed in an embedding lookup (index out of range in self) on a batch of 1 row x 2 \
tokens whose largest token id is 9: ...
    """

    @functools.wraps(fn)
    def call(batch: Any) -> Any:
        try:
            return fn(batch)
        except IndexError as error:
            if _EMBEDDING_MESSAGE not in str(error):
                raise
            ids = batch.get("input_ids") if isinstance(batch, dict) else None
            shape = (f"a batch of {ids.shape[0]} row{'s' if ids.shape[0] != 1 else ''} x {ids.shape[1]} tokens"
                     + (f" whose largest token id is {int(ids.max())}" if ids.numel() else "")
                     if hasattr(ids, "shape") and len(ids.shape) == 2 else "a batch")
            raise IndexError(
                f"fn(batch) failed in an embedding lookup ({_EMBEDDING_MESSAGE}) on {shape}: most likely "
                "max_input_token_length is above the model's position embeddings (its "
                "config.max_position_embeddings or n_positions), or a token id is >= the model's vocabulary size "
                "(a tokenizer of another model); pass a max_input_token_length the model can embed "
                "(build_dynamic_batch_dataloader(..., model=model) checks it when the loader is built)"
            ) from error

    return call




@dataclass
class _Done:
    """What an item's finished calls gave: positions, rows, measured ``(rows, width, peak)`` and the inputs set aside
    (position -> cause)."""

    positions: list[np.ndarray] = field(default_factory=list)
    rows: list[Any] = field(default_factory=list)
    measured: list[tuple[int, int, int]] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    count: int = 0  # rows finished or failed, and their real tokens: the progress moves when the item does
    tokens: int = 0
    raised: tuple[int, Exception, np.ndarray] | None = None  # on_error="raise": the stack depth a failed piece's
    # halves lie above, its error and its positions, while the halves are tried to find the row it raises on


@dataclass
class Ran:
    """What an item's run gives the loop: the input positions finished or set aside, their real tokens, its record
    (``None`` when no row finished) and the seconds it spent on the device and handing rows to the store."""

    positions: np.ndarray
    tokens: int
    record: BatchRecord | None
    seconds: dict[str, float]


class _FnFailed(Exception):
    """Carries an error ``fn`` itself raised (not out of memory, not a device failure) past the guard's handling."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _few(values: list) -> str:
    return ", ".join(map(str, values[:_FEW])) + (", ..." if len(values) > _FEW else "")


class Executor:
    """One worker: runs items on its device, splitting on out-of-memory errors, and hands their rows to the sink.

    Args:
        fn: what runs a batch on this worker's device.
        scheduler: the run's :class:`~dynabatch.inference.scheduler.Scheduler`; ``lane``: this worker's lane of it.
        builder: the run's :class:`~dynabatch.inference.build.Builder` (how a batch is cut into parts).
        writer: the sink's writer for this worker (``write(positions, rows, hashes)``, ``fail(positions, hashes,
            causes)``).
        copier: moves a batch to the device (:func:`dynabatch.memory.device.copier`); ``None`` leaves it.
        memory_device: where peaks are measured; ``None``: not measured.
        splitter: the run's row rule (shared by every worker: each field's reading is fixed once).
        on_oom: ``"raise"`` or ``"skip"`` a single row that runs out of memory.
        on_error: ``"raise"`` the error ``fn`` raises, or ``"skip"`` the rows it raises on alone.
        ids: the loader's ids (a ``pyarrow`` array), named in an error's note; ``None``: positions only.
        lockstep: several ranks making the same number of calls per item (see :meth:`run_item`).
        stop: set when the run stops: the worker finishes its call in progress and stops.
        name: how the report names the worker's device.
    """

    def __init__(self, fn: Callable[[Batch], Any], scheduler: Scheduler, builder: Builder, *, lane: Lane,
                 writer: Any, copier: Callable | None, memory_device: Any, splitter: RowSplitter, on_oom: str,
                 on_error: str, ids: Any = None, lockstep: bool = False,
                 stop: threading.Event | None = None, name: str = "") -> None:
        self.fn = explain_index_errors(fn)
        self.scheduler, self.builder, self.lane, self.writer = scheduler, builder, lane, writer
        self.memory_device, self.splitter, self.ids = memory_device, splitter, ids
        self.on_oom, self.on_error, self.lockstep, self.name = on_oom, on_error, lockstep, name
        self._prepare = None if copier is None else (
            lambda b: Batch(copier(b), indices=b.indices, texts=getattr(b, "texts", None)))
        self.report = RunReport()
        self.unfinished: Item | None = None  # the rows of the item that raised which did not finish
        self.stop = stop or threading.Event()
        self._stand_in: Batch | None = None  # one row: the call a rank without work makes in a round
        self._stand_in_ran = False  # whether that row ran already (else it is the first row planned)
        self._seconds = {"device": 0.0, "store": 0.0}  # of the item in progress
        self.ran: Ran | None = None  # what the last item ran, however it ended (rows before an error included)

    def _call(self, batch: Batch) -> Any:
        try:
            return self.fn(batch)
        except Exception as exc:
            if is_out_of_memory_error(exc) or is_device_failure(exc):
                raise
            raise _FnFailed(exc) from None

    def run_item(self, item: Item, built: Built | None) -> Ran:
        """Runs ``item`` (``built``: its tensors; ``None`` when the store holds every row of it) split as needed.

        Its finished rows reach the sink however it ends; if it raises, the rows that did not finish are
        :attr:`unfinished`. In lockstep (several ranks) the item runs in rounds: each round every rank makes exactly
        one call that completes, its next piece or, when it has none left while another rank has, a stand-in call on
        one row it already ran (its result dropped), so collectives inside ``fn`` stay matched. Returns what ran
        (:class:`Ran`).
        """
        self.unfinished = item
        self._seconds = {"device": 0.0, "store": 0.0}
        self.ran = Ran(np.zeros(0, dtype=np.int64), 0, None, self._seconds)
        if built is None:
            self._join_step(item)
            self.unfinished = None
            return self.ran
        start = time.perf_counter()
        rows, width = batch_shape(built.batch)
        record = BatchRecord(batch=item.number, rows=rows, width=width, real_tokens=real_tokens(built.batch),
                             padded_tokens=0, seconds=0.0)
        if self.lockstep and self._stand_in is None:
            self._stand_in = self.builder.take(built.batch, [0])
        done, stack = _Done(), [built.batch]
        try:
            while self._round(bool(stack)):
                if stack:
                    self._call_one(item, record, stack, done)
                else:
                    self._call_stand_in()
        finally:
            self.unfinished = None
            if stack:
                left = np.concatenate([piece.indices.numpy() for piece in stack])
                rows_left = np.flatnonzero(np.isin(built.batch.indices.numpy(), left))
                self.unfinished = Item(item.number, built.batch.indices.numpy()[rows_left], built.batch, rows_left,
                                       whole=False, crashes=item.crashes)
            stack.clear()
            self._finish(item, record, done, built, start)
        self.scheduler.report(self.lane, item, ran=done.measured)
        return self.ran

    def _join_step(self, item: Item) -> None:
        """In lockstep: takes part in the rounds of a step whose rows this rank already has (a resumed run)."""
        if not self.lockstep:
            return
        if self._stand_in is None:  # nothing run yet: the step's first row is what a stand-in call repeats
            self._stand_in = self.builder.stand_in(item)
        while self._round(False):
            self._call_stand_in()

    def _round(self, have_work: bool) -> bool:
        """Whether a round is to run: this rank has work, or (lockstep) any rank has."""
        if not self.lockstep:
            return have_work and not self.stop.is_set()
        (anyone,) = reduce_across_ranks([float(have_work)], "max")
        return anyone > 0

    def _call_stand_in(self) -> None:
        attempt, error = self._attempt(self._stand_in, measure=False, finish=False)
        if error is not None:
            raise error
        if attempt.error is not None:
            logger.warning("a stand-in call (one row, to keep the ranks in step) ran out of memory: %s",
                           _brief(attempt.error))

    def _attempt(self, piece: Batch, *, measure: bool, finish: bool = True) -> tuple[Any, Exception | None]:
        """One guarded call of ``fn`` on ``piece``: ``(attempt, None)``, or ``(None, error)`` for an error ``fn``
        raised (handled here, outside the ``except`` block: it is raised again with no context of ours)."""
        start = time.perf_counter()  # the copy in, the call and the rows back on the CPU (which waits for the device)
        try:
            return call_guarded(self._call, piece, measure_on=self.memory_device if measure else None,
                                prepare=self._prepare,
                                finish=(lambda out: self.splitter.split(out, piece)) if finish else None), None
        except _FnFailed as failed:
            error = failed.error
        finally:
            self._seconds["device"] += time.perf_counter() - start
        return None, error

    def _call_one(self, item: Item, record: BatchRecord, stack: list, done: _Done) -> None:
        """Runs pieces off ``stack`` until one call completes (lockstep), the stack is empty or the run stops."""
        while stack and (self.lockstep or not self.stop.is_set()):
            piece = stack[-1]  # on the stack until it finishes: an error in fn leaves it unfinished
            rows, width = batch_shape(piece)
            split = self.scheduler.pre_split(self.lane, rows, width)
            if split is not None:
                logger.info("batch %d: splitting %d rows x %d tokens into %d parts before trying it: %s",
                            item.number, rows, width, len(split.sizes), split.reason)
                record.pre_split = True
                stack[-1:] = reversed(self.builder.split(piece, split.sizes))
                continue
            measure = self.memory_device is not None and self.scheduler.measure(self.lane, rows, width)
            attempt, error = self._attempt(piece, measure=measure)
            if error is not None or attempt.error is not None:
                alone = self._fn_failed(item, record, error, stack, done) if error is not None else \
                    self._out_of_memory(item, record, attempt.error, stack, done)
                if alone and self.lockstep and not stack:
                    self._call_stand_in()  # the round still owes the other ranks a call
                    return
                continue
            stack.pop()
            if attempt.peak_bytes is not None:
                record.peak_bytes = max(record.peak_bytes or 0, attempt.peak_bytes)
                done.measured.append((rows, width, attempt.peak_bytes))
            record.padded_tokens += rows * width
            done.positions.append(piece.indices.numpy())
            done.rows.extend(attempt.output)
            done.count += rows
            done.tokens += real_tokens(piece)
            if done.raised is not None and len(stack) <= done.raised[0]:  # every part of the failed piece ran
                raise self._not_alone(item, *done.raised[1:])
            if self.lockstep:
                if not self._stand_in_ran:  # a row that ran: what a stand-in call repeats
                    self._stand_in_ran, self._stand_in = True, self.builder.take(piece, [0])
                return

    def _describe(self, item: Item, positions: np.ndarray) -> str:
        """The rows at ``positions`` of batch ``item``, by position and id, for a note or a log line."""
        shown = positions[:_FEW].tolist()
        ids = f" (id{'s' if len(positions) > 1 else ''} {_few(self.ids.take(shown).to_pylist())})" \
            if self.ids is not None else ""
        if len(positions) == 1:
            return f"input position {shown[0]}{ids}, alone (a row of batch {item.number})"
        return f"batch {item.number}: {len(positions)} rows at input positions {_few(positions.tolist())}{ids}"

    def _fn_failed(self, item: Item, record: BatchRecord, error: Exception, stack: list, done: _Done) -> bool:
        """``fn`` raised on the piece on top of ``stack``: splits the piece in halves to find the row it raises on
        (``False``); on one row, raises the error noting that row (``on_error="raise"``) or sets the row aside with
        the error's text (``True``).

        The bound: each halving tries the first half, and the second only if the first ran, so naming a row costs at
        most ``2 * ceil(log2(rows))`` calls after the one that failed, and their rows that ran are finished rows; an
        ``fn`` that raises on every call (a broken model) fails on each first half and is named after
        ``ceil(log2(rows))`` calls (4 for 24 rows) holding fewer rows in all than the batch did.
        """
        piece = stack[-1]
        positions = piece.indices.numpy()
        if len(positions) > 1:
            if self.on_error == "raise" and done.raised is None:
                done.raised = (len(stack) - 1, error, positions)
            sizes = split_sizes(len(positions))
            logger.warning("%s: fn(batch) raised (%s); retrying as %s rows to find the rows it fails on",
                           self._describe(item, positions), _brief(error), " + ".join(map(str, sizes)))
            stack[-1:] = reversed(self.builder.split(piece, sizes))
            return False
        if self.on_error == "raise":
            error.add_note(f"dynabatch.run: fn(batch) raised on {self._describe(item, positions)}; {_SET_ASIDE}")
            raise error
        logger.warning("%s: fn(batch) raised on it (%s); set aside (result None, in failed)",
                       self._describe(item, positions), _brief(error))
        stack.pop()
        record.error_rows += 1
        done.failed[int(positions[0])] = _brief(error)
        done.count += 1
        return True

    def _not_alone(self, item: Item, error: Exception, positions: np.ndarray) -> Exception:
        """``error``, which ``fn`` raised on the rows at ``positions`` whose halves then all ran: noted so."""
        error.add_note(f"dynabatch.run: fn(batch) raised on {self._describe(item, positions)}, but on none of its "
                       "parts when retried in halves to find the row: the error depends on the batch as a whole "
                       "(its size or width) or comes and goes, not on one input; its rows ran in the halves (a store "
                       "keeps them); on_error='skip' (--on-error skip on the command line) goes on past such an error")
        return error

    def _out_of_memory(self, item: Item, record: BatchRecord, error: BaseException, stack: list,
                       done: _Done) -> bool:
        """Splits the piece on top of ``stack``, which ran out of memory (``False``), or skips it if it is one row
        (``True``; ``on_oom="raise"`` raises)."""
        piece = stack[-1]
        rows, width = batch_shape(piece)
        record.oom_events += 1
        self.scheduler.report(self.lane, item, out_of_memory=(rows, width))
        if rows > 1:
            sizes = split_sizes(rows)
            logger.warning("batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %s rows",
                           item.number, rows, width, _brief(error), " + ".join(map(str, sizes)))
            record.oom_splits += 1
            stack[-1:] = reversed(self.builder.split(piece, sizes))
            return False
        position = int(piece.indices[0])
        if self.on_oom == "raise":
            raise BatchOutOfMemoryError(
                f"input position {position} ran out of memory on its own (1 row x {width} tokens, batch "
                f"{item.number}), so it cannot be split further: {_brief(error)}; the error's .partial holds the "
                "finished rows; on_oom='skip' skips such rows", position=position) from error
        logger.warning("batch %d: input position %d ran out of memory on its own (1 row x %d tokens); skipping it "
                       "(result None)", item.number, position, width)
        stack.pop()
        record.failed_rows += 1
        done.failed[position] = f"out of memory alone: {_brief(error)}"
        done.count += 1
        return True

    def _finish(self, item: Item, record: BatchRecord, done: _Done, built: Built, start: float) -> None:
        """Hands the item's finished rows and the inputs set aside to the sink, and records it (rows: those
        finished or set aside here)."""
        handing = time.perf_counter()
        if done.positions:
            positions = np.concatenate(done.positions)
            self.writer.write(positions, done.rows, built.hashes_at(positions),
                              varying=self.splitter.varying(done.rows[0]))
        if done.failed:
            positions = np.fromiter(done.failed, dtype=np.int64, count=len(done.failed))
            self.writer.fail(positions, built.hashes_at(positions), list(done.failed.values()))
        self._seconds["store"] += time.perf_counter() - handing
        positions = np.concatenate([*done.positions, np.fromiter(done.failed, dtype=np.int64, count=len(done.failed))])
        self.ran = Ran(positions, done.tokens, record if done.count else None, self._seconds)
        if not done.count:
            return
        record.rows = done.count
        record.seconds = time.perf_counter() - start
        self.report.records.append(record)
        if self.report.budget_bytes is None and record.peak_bytes is not None:
            self.report.budget_bytes = record.peak_bytes


def run_workers(targets: Sequence[Any], start_worker: Callable[[Any, int], tuple[Executor, Prefetcher]],
                stop: threading.Event, meter: Meter | None = None) -> None:
    """Runs the scheduler's items to their end on every target: one worker in the calling thread, or a thread per
    device.

    ``start_worker(target, i)`` returns the worker's executor and the prefetcher it takes its items from; it is
    called in the worker's thread, once the device is current there (so is the ``make_fn`` inside it). On any exit
    every thread has stopped: on an error or ``KeyboardInterrupt``, ``stop`` is set and each worker ends its call in
    progress.

    A device failure (:func:`~dynabatch.memory.device.is_device_failure`) on one of several devices ends that worker;
    its unfinished rows go back to the scheduler once (rows that make a second device fail raise). Any other error
    (``fn`` raising, the sink refusing or failing to write rows, a batch failing to build) stops every worker and is
    raised: the rows finished before it are in the sink, the others are not.

    Each worker's loop is timed end to end (:class:`~dynabatch.inference.meter.Laps`: planning, building, the
    device, the store, the waits on the stages ahead); each item's seconds go into its record, and what ran,
    with the worker's totals at its end, to ``meter``.
    """
    errors: list[BaseException] = []  # what stops the run
    crashes: list[BaseException] = []  # what stopped one device's worker, its rows put back
    prefetchers: list[Prefetcher] = []
    busy = [0]  # workers holding an item (a failed device puts its rows back: the others wait for that)
    lock = threading.Lock()
    several = len(targets) > 1

    def next_item(prefetcher: Prefetcher) -> Item | None:
        while not stop.is_set():
            with lock:
                item = prefetcher.next_item()
                if item is not None or not busy[0]:
                    busy[0] += item is not None
                    return item
            stop.wait(0.01)  # nothing to run while another worker runs: its device may fail and put rows back
        return None

    def work(i: int, target: Any) -> None:
        if several:
            make_current(target)
        laps = Laps(meter.started if meter is not None else None)
        executor, prefetcher = start_worker(target, i)
        prefetchers.append(prefetcher)
        stages = laps.lap("start")
        try:
            while (item := next_item(prefetcher)) is not None:
                try:
                    executor.unfinished = item  # until it is built: a device failing to build it puts it back
                    executor.ran = None
                    _merge(stages, laps.lap("plan"))
                    built = prefetcher.build(item)
                    _merge(stages, laps.lap("build"))
                    try:
                        executor.run_item(item, built)
                    finally:  # the rows that finished before an error count too
                        stages = _account(executor.ran, laps, stages, meter)
                except Exception as exc:
                    if not (several and is_device_failure(exc) and _requeue(executor, target, exc)):
                        raise
                    crashes.append(exc)
                    return
                finally:
                    with lock:
                        busy[0] -= 1
        finally:
            executor.report.rebuilt_batches = prefetcher.rebuilt
            prefetcher.close()
            laps.lap("plan")
            executor.report.workers[executor.name] = laps.summary()

    def guarded_work(i: int, target: Any) -> None:
        try:
            work(i, target)
        except BaseException as exc:  # noqa: BLE001 (raised by run_workers, in the calling thread)
            logger.error("device %s: its worker stopped the run: %s", target, _brief(exc))
            errors.append(exc)
            stop.set()

    if not several:
        work(0, targets[0])
        return
    threads = [threading.Thread(target=guarded_work, args=(i, t), name=f"dynabatch-{t}", daemon=True)
               for i, t in enumerate(targets)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # timed waits: Ctrl-C reaches this thread even when a worker got the signal
                t.join(0.1)
    finally:
        stop.set()  # Ctrl-C or an error in this thread: every worker stops after its call in progress
        for t in threads:
            if t.ident is not None:
                t.join()
    if errors:
        raise errors[0]
    left = prefetchers[0].next_item() if prefetchers else None
    if left is not None:  # every device failed, each on other rows: the first failure stops the run
        crashes[0].add_note(f"every device failed with batches left to run (batch {left.number} first)")
        raise crashes[0]


def _account(ran: Ran | None, laps: Laps, stages: dict[str, float], meter: Meter | None) -> dict[str, float]:
    """Ends an item's lap: its seconds by stage into its record, what it ran to the meter (rows that finished
    before an error too); returns the seconds not yet given to a record."""
    if ran is None:  # the item did not run (its batch failed to build)
        return stages
    _merge(stages, laps.lap("plan", ran.seconds))
    if ran.record is not None:
        ran.record.stages, stages = stages, {}
        ran.record.finished = laps.at()
    if meter is not None and len(ran.positions):
        meter.add(ran.positions, rows=len(ran.positions), real_tokens=ran.tokens,
                  padded_tokens=ran.record.padded_tokens if ran.record is not None else 0,
                  width=ran.record.width if ran.record is not None else None)
    return stages


def _merge(into: dict[str, float], seconds: dict[str, float]) -> None:
    for stage, value in seconds.items():
        into[stage] = into.get(stage, 0.0) + value


def _requeue(executor: Executor, device: Any, exc: BaseException) -> bool:
    """Puts the unfinished rows of a batch whose device failed back once (``True``); ``False`` on their second
    failure."""
    rest = executor.unfinished
    if rest is None or not len(rest.positions):
        return True
    if rest.crashes:
        logger.error("device %s: batch %d failed again (%s); it made another device fail before", device,
                     rest.number, _brief(exc))
        return False
    logger.error("device %s failed on batch %d (%s); its %d unfinished rows go back to the other devices", device,
                 rest.number, _brief(exc), len(rest.positions))
    rest.crashes += 1
    rest.whole = False
    executor.scheduler.requeue(rest)
    return True

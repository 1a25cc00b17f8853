"""The executor of :func:`dynabatch.run`: a worker per device, each batch through the one out-of-memory policy.

:class:`Executor` runs one item at a time on its device: built (ahead, by :class:`Prefetcher`), moved, passed to
``fn``, split into rows by the run's row rule, handed to the sink with their input hashes. A piece that runs out of
memory is split in halves and retried, down to one row; one at least as large as a shape that failed, or with more
rows than the memory mode allows, is split before it is tried (:mod:`dynabatch.memory.oom`'s policy).

:func:`run_workers` runs the queue: one worker in the calling thread, or a thread per device over one shared queue
(threads: torch releases the GIL while a device works, and it runs in a notebook). Every thread it starts has stopped
when it returns or raises, Ctrl-C included.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynabatch.data.collate import Batch, batch_shape, real_tokens
from dynabatch.data.collate import split_rows as split_batch
from dynabatch.inference.outputs import RowSplitter
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.source import BatchQueue, Item, Lane
from dynabatch.memory.device import make_current, pins_memory
from dynabatch.memory.oom import call_guarded, dominating, equal_parts, split_sizes
from dynabatch.sampling.ranks import reduce_across_ranks

__all__ = ["BatchOutOfMemoryError", "Executor", "Prefetcher", "WorkerCrash", "explain_index_errors", "run_workers"]

logger = logging.getLogger(__name__)

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


class WorkerCrash(RuntimeError):
    """A device's worker failed on rows that had already made another worker fail."""


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
        IndexError: fn(batch) failed in an embedding lookup (index out of range in self) on a batch of 1 rows x 2 \
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
            shape = (f"a batch of {ids.shape[0]} rows x {ids.shape[1]} tokens"
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
    """What an item's finished calls gave: positions, rows, input hashes and measured ``(rows, width, peak)``."""

    positions: list[np.ndarray] = field(default_factory=list)
    rows: list[Any] = field(default_factory=list)
    hashes: list[np.ndarray] = field(default_factory=list)
    measured: list[tuple[int, int, int]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # rows that ran out of memory alone, skipped
    count: int = 0  # rows finished or failed, and their real tokens: the progress bar moves when the item does
    tokens: int = 0


class Executor:
    """One worker: runs items on its device, splitting on out-of-memory errors, and hands their rows to the sink.

    Args:
        fn: what runs a batch on this worker's device.
        queue: the shared :class:`~dynabatch.inference.source.BatchQueue`.
        writer: the sink's writer for this worker (``write(positions, rows, hashes)``).
        hashes: whether the sink stores each row's input hash (a results store).
        device: where each batch is moved (``batch.to(device)``); ``None`` leaves it.
        memory_device: where peaks are measured; ``None``: not measured.
        splitter: the run's row rule (shared by every worker: each field's reading is fixed once).
        on_oom: ``"raise"`` or ``"skip"`` a single row that runs out of memory.
        lockstep: several ranks making the same number of calls per item (see :meth:`run_item`).
        stop: set when the run stops: the worker finishes its call in progress and stops.
        lane: this worker's lane of the queue (its peaks, its planner cursor).
        name: how the report names the worker's device.
    """

    def __init__(self, fn: Callable[[Batch], Any], queue: BatchQueue, *, writer: Any, hashes: bool, device: Any,
                 memory_device: Any, splitter: RowSplitter, on_oom: str, bar: Any = None, lockstep: bool = False,
                 stop: threading.Event | None = None, lane: Lane | None = None, name: str = "") -> None:
        self.fn = explain_index_errors(fn)
        self.name, self.hashes = name, hashes
        self.queue, self.writer, self.splitter, self.on_oom, self.bar = queue, writer, splitter, on_oom, bar
        self.lane = queue.lane if lane is None else lane
        self.memory_device = memory_device
        self.pinned = pins_memory(device)  # batches built in pinned memory: the copy to the device is asynchronous
        self._prepare = (lambda b: b.to(device, non_blocking=self.pinned)) if device is not None else None
        self.report = RunReport()
        self.failed: list[int] = []
        self.failed_shapes: list[tuple[int, int]] = []
        self.unfinished: Item | None = None  # the rows of the item that raised which did not finish
        self.lockstep = lockstep
        self.stop = stop or threading.Event()
        self._stand_in: Batch | None = None  # one row: the call a rank without work makes in a round
        self._stand_in_ran = False  # whether that row ran already (else it is the first row planned)
        self._started = time.perf_counter()
        self._tokens = 0

    def build(self, item: Item) -> Batch:
        """The item's tensors (built here, or as they came), in pinned memory when the device copies from it (a
        batch that came already on a device stays there)."""
        batch = self.queue.build(item)
        on_cpu = all(t.device.type == "cpu" for t in batch.values() if isinstance(t, torch.Tensor))
        return batch.pin_memory() if self.pinned and on_cpu else batch

    def run_item(self, item: Item, batch: Batch | None = None) -> list[tuple[int, int, int]]:
        """Runs ``item`` (``batch``: its tensors, built ahead) split as needed; returns ``(rows, width, peak)`` of
        every measured call.

        Its finished rows reach the sink however it ends; if it raises, the rows that did not finish are
        :attr:`unfinished`. In lockstep (several ranks) the item runs in rounds: each round every rank makes exactly
        one call that completes, its next piece or, when it has none left while another rank has, a stand-in call on
        one row it already ran (its result dropped), so collectives inside ``fn`` stay matched.
        """
        start = time.perf_counter()
        self.unfinished = None
        batch = batch if batch is not None else self.build(item)
        rows, width = batch_shape(batch)
        record = BatchRecord(batch=item.number, rows=rows, width=width, real_tokens=real_tokens(batch),
                             padded_tokens=0, seconds=0.0)
        if self.lockstep and self._stand_in is None:
            self._stand_in = self.queue.take(batch, [0])
        done, stack = _Done(), [batch]
        del batch
        try:
            while self._round(bool(stack)):
                if stack:
                    self._call_one(item, record, stack, done)
                else:
                    self._call_stand_in()
        finally:
            if stack:
                left = np.concatenate([piece.indices.numpy() for piece in stack])
                self.unfinished = self.queue.restrict(item, np.flatnonzero(np.isin(item.positions, left)))
            stack.clear()
            self._finish(item, record, done, start)
        return done.measured

    def join_step(self, item: Item) -> None:
        """In lockstep: takes part in the rounds of a step whose rows this rank already has (a resumed run)."""
        if not self.lockstep:
            return
        if self._stand_in is None:  # nothing run yet: the step's first row is what a stand-in call repeats
            self._stand_in = self.build(self.queue.restrict(item, np.array([0])))
        while self._round(False):
            self._call_stand_in()

    def _round(self, have_work: bool) -> bool:
        """Whether a round is to run: this rank has work, or (lockstep) any rank has."""
        if not self.lockstep:
            return have_work and not self.stop.is_set()
        (anyone,) = reduce_across_ranks([float(have_work)], "max")
        return anyone > 0

    def _call_stand_in(self) -> None:
        attempt = call_guarded(self.fn, self._stand_in, prepare=self._prepare)
        if attempt.error is not None:
            logger.warning("a stand-in call (one row, to keep the ranks in step) ran out of memory: %s",
                           _brief(attempt.error))

    def _split(self, piece: Batch, sizes: list[int]) -> list[Batch]:
        return split_batch(piece, sizes, padding_side=self.queue.padding_side,
                           pad_to_multiple_of=self.queue.pad_to_multiple_of)

    def _pre_split(self, item: Item, record: BatchRecord, piece: Batch) -> list[int] | None:
        """The parts to split ``piece`` into before trying it, by the out-of-memory policy; ``None`` to run it."""
        rows, width = batch_shape(piece)
        if rows < 2:
            return None
        failed_shape = dominating(self.failed_shapes, rows, width)
        if failed_shape is not None:
            logger.info("batch %d: splitting %d rows x %d tokens before trying it, as large as %d x %d which ran "
                        "out of memory", item.number, rows, width, *failed_shape)
            sizes = split_sizes(rows)
        else:
            cap = self.queue.max_call_rows(width, self.lane)
            if cap is None or rows <= cap:
                return None
            sizes = equal_parts(rows, cap)
            logger.info("batch %d: splitting %d rows x %d tokens into %d parts before running it: the measured "
                        "peaks and out-of-memory errors keep at most %d rows of that width", item.number, rows,
                        width, len(sizes), cap)
        record.pre_split = True
        return sizes

    def _call_one(self, item: Item, record: BatchRecord, stack: list, done: _Done) -> None:
        """Runs pieces off ``stack`` until one call completes (lockstep), the stack is empty or the run stops."""
        while stack and (self.lockstep or not self.stop.is_set()):
            piece = stack[-1]  # on the stack until it finishes: an error in fn leaves it unfinished
            sizes = self._pre_split(item, record, piece)
            if sizes is not None:
                stack[-1:] = reversed(self._split(piece, sizes))
                continue
            rows, width = batch_shape(piece)
            measure = self.memory_device is not None and self.queue.should_measure(rows, width, self.lane)
            attempt = call_guarded(self.fn, piece, measure_on=self.memory_device if measure else None,
                                   prepare=self._prepare, finish=lambda out, p=piece: self.splitter.split(out, p))
            if attempt.error is not None:
                if self._out_of_memory(item, record, attempt.error, stack, done) and self.lockstep and not stack:
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
            if self.hashes:
                done.hashes.append(self.queue.input_hashes(piece))
            done.count += rows
            done.tokens += real_tokens(piece)
            if self.lockstep:
                if not self._stand_in_ran:  # a row that ran: what a stand-in call repeats
                    self._stand_in_ran, self._stand_in = True, self.queue.take(piece, [0])
                return

    def _out_of_memory(self, item: Item, record: BatchRecord, error: BaseException, stack: list,
                       done: _Done) -> bool:
        """Splits the piece on top of ``stack``, which ran out of memory (``False``), or skips it if it is one row
        (``True``; ``on_oom="raise"`` raises)."""
        piece = stack[-1]
        rows, width = batch_shape(piece)
        record.oom_events += 1
        self.failed_shapes.append((rows, width))
        self.queue.observe_out_of_memory(rows, width, self.lane)
        if rows > 1:
            sizes = split_sizes(rows)
            logger.warning("batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %s rows",
                           item.number, rows, width, _brief(error), " + ".join(map(str, sizes)))
            record.oom_splits += 1
            stack[-1:] = reversed(self._split(piece, sizes))
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
        self.failed.append(position)
        done.failed.append(position)
        done.count += 1
        return True

    def _finish(self, item: Item, record: BatchRecord, done: _Done, start: float) -> None:
        """Hands the item's finished rows to the sink and records it (rows: those finished or failed here)."""
        if done.positions:
            positions = np.concatenate(done.positions)
            self.writer.write(positions, done.rows, np.concatenate(done.hashes) if done.hashes else None,
                              varying=self.splitter.varying(done.rows[0]))
            self.queue.finish(positions)
        self.queue.finish(np.asarray(done.failed, dtype=np.int64))
        if self.bar is not None and done.count:
            self._tokens += done.tokens
            self.bar.update(done.count)
            elapsed = time.perf_counter() - self._started
            self.bar.set_postfix_str(f"{self._tokens / max(elapsed, 1e-9):,.0f} tokens/s", refresh=False)
        if not done.count:
            return
        record.rows = done.count
        record.seconds = time.perf_counter() - start
        self.report.records.append(record)
        if self.report.budget_bytes is None and record.peak_bytes is not None:
            self.report.budget_bytes = record.peak_bytes


class Prefetcher:
    """Hands a worker ``(item, batch)`` pairs, building its next ``depth`` batches in a background thread.

    In measured mode the planner sizes a batch only once the peaks before it are measured, so the batches built ahead
    are the planner's answer *as it stands* (:meth:`~dynabatch.inference.source.BatchQueue.peek`); one that a later
    peak re-sized is built again, never run stale (``rebuilt`` counts them). Rows the sink already holds are taken out
    first.
    """

    def __init__(self, executor: Executor, depth: int) -> None:
        self.executor, self.queue, self.depth = executor, executor.queue, depth
        self.ahead: deque[tuple[np.ndarray, Batch]] = deque()  # positions -> their batch, built ahead
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynabatch-prefetch") if depth else None
        self._filling: Future | None = None
        self.rebuilt = 0

    def next(self) -> tuple[Item, Batch | None] | None:
        """The next item still to run (stored rows taken out) and its batch if built ahead; ``None`` when done."""
        while (item := self.queue.next_item(self.executor.lane)) is not None:
            todo = self.queue.without_stored(item)
            if todo is None:
                self.executor.join_step(item)
                continue
            batch = self._take(todo.positions) if todo.batch is None else None
            if self._pool is not None:
                self._filling = self._pool.submit(self._fill)
            return todo, batch
        return None

    def _take(self, positions: np.ndarray) -> Batch | None:
        filling, self._filling = self._filling, None
        if filling is not None:
            filling.result()  # an error building a batch raises here
        while self.ahead:
            built, batch = self.ahead.popleft()
            if np.array_equal(built, positions):
                return batch
            self.rebuilt += 1
        return None

    def _fill(self) -> None:
        """The background thread's turn: the planner's next batches as they stand, built (asking the planner
        costs time too, off the device's thread)."""
        for positions in self.queue.peek(self.depth, self.executor.lane)[len(self.ahead):]:
            if self.queue.done is not None and self.queue.done[positions[positions < len(self.queue.done)]].any():
                break  # rows a resumed run has: built once they are taken out
            self.ahead.append((positions, self.executor.build(Item(-1, positions))))

    def close(self) -> None:
        """Stops the background thread (after the batch it is building) and drops what it built."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self.ahead.clear()


def run_workers(targets: Sequence[Any], make_executor: Callable[[Any, int], Executor], queue: BatchQueue,
                prefetch: int, stop: threading.Event) -> list[Executor]:
    """Runs the queue to its end on every target: one worker in the calling thread, or a thread per device.

    ``make_executor(target, i)`` is called in the worker's thread, once the device is current there (so is the
    ``make_fn`` inside it). Returns the executors that started. On any exit every thread has stopped: on an error or
    ``KeyboardInterrupt``, ``stop`` is set and each worker ends its call in progress.
    """
    executors: list[Executor | None] = [None] * len(targets)
    errors: list[BaseException] = []  # what stops the run
    crashes: list[BaseException] = []  # what stopped one worker, its rows re-queued
    busy = [0]  # workers holding an item (one that crashes puts its rows back: the others wait for that)
    lock = threading.Lock()
    several = len(targets) > 1

    def next_item(prefetcher: Prefetcher) -> tuple[Item, Batch | None] | None:
        while not stop.is_set():
            with lock:
                got = prefetcher.next()
                if got is not None or not busy[0]:
                    busy[0] += got is not None
                    return got
            stop.wait(0.01)  # the queue is empty while another worker runs: it may put rows back
        return None

    def work(i: int, target: Any) -> None:
        if several:
            make_current(target)
        executor = executors[i] = make_executor(target, i)
        prefetcher = Prefetcher(executor, prefetch)
        try:
            while (got := next_item(prefetcher)) is not None:
                item, batch = got
                try:
                    queue.observe_item(item, executor.run_item(item, batch), executor.lane)
                except Exception as exc:
                    if not (several and _requeue(queue, executor.unfinished, target, exc)):
                        raise
                    crashes.append(exc)
                    return
                finally:
                    with lock:
                        busy[0] -= 1
        finally:
            executor.report.rebuilt_batches = prefetcher.rebuilt
            prefetcher.close()

    def guarded_work(i: int, target: Any) -> None:
        try:
            work(i, target)
        except BaseException as exc:  # noqa: BLE001 (raised by run_workers, in the calling thread)
            logger.error("device %s: its worker stopped: %s", target, _brief(exc))
            errors.append(exc)
            stop.set()

    if not several:
        work(0, targets[0])
        return [e for e in executors if e is not None]
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
    left = queue.next_item()
    if left is not None:  # every worker stopped, each on other rows
        raise WorkerCrash(f"every device's worker stopped with batches left (batch {left.number} first): "
                          f"{_brief(crashes[0])}") from crashes[0]
    return [e for e in executors if e is not None]


def _requeue(queue: BatchQueue, rest: Item | None, device: Any, exc: BaseException) -> bool:
    """Puts the unfinished rows of a batch whose worker crashed back once (``True``); ``False`` on their second
    crash."""
    if rest is None or not len(rest.positions):
        return True
    if rest.crashes:
        logger.error("device %s: batch %d failed again (%s); it made another worker fail before", device,
                     rest.number, _brief(exc))
        return False
    logger.error("device %s: its worker stopped on batch %d (%s); its %d unfinished rows go back to the queue",
                 device, rest.number, _brief(exc), len(rest.positions))
    rest.crashes += 1
    rest.whole = False
    queue.requeue(rest)
    return True

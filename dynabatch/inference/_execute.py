"""Running one batch for :func:`dynabatch.run`: out-of-memory splitting, records, results.

:class:`Executor` runs an item through the out-of-memory guard and policy
(:mod:`dynabatch.memory.oom`): a piece that runs out of memory is split in
halves and retried, down to one row; a piece at least as large (rows and
width) as one that failed is split before it is tried, and so is a piece with
more rows than the queue allows (:meth:`~dynabatch.inference._queue.BatchQueue.max_call_rows`),
into the fewest equal parts that fit. Each piece is measured when the queue says
so (:meth:`~dynabatch.inference._queue.BatchQueue.should_measure`). Each item
leaves a :class:`~dynabatch.inference.report.BatchRecord` and its rows'
results: kept in memory, or written to the results store
(:mod:`dynabatch.inference.store`) and not kept, so memory stays flat in the
number of inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dynabatch.data.collate import Batch, batch_shape, real_tokens, take_rows
from dynabatch.data.collate import split_rows as split_batch
from dynabatch.inference._explain import explain_index_errors
from dynabatch.inference._queue import BatchQueue, Item, Lane
from dynabatch.inference.outputs import RowSplitter
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.results import BatchOutOfMemoryError, RunResult
from dynabatch.memory.device import pins_memory
from dynabatch.memory.oom import call_guarded, dominating, equal_parts, split_sizes
from dynabatch.sampling.ranks import reduce_across_ranks

if TYPE_CHECKING:
    from dynabatch.inference.store import ResultsStore

logger = logging.getLogger(__name__)


def _brief(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text[:200]}"


@dataclass
class _Done:
    """What an item's finished calls gave: positions, results, and measured ``(rows, width, peak)``; with a store,
    each piece's input hashes (and, until the store's layout is known, its real tokens per row)."""

    positions: list[int] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    measured: list[tuple[int, int, int]] = field(default_factory=list)
    hashes: list[np.ndarray] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    rows: int = 0  # rows finished (or skipped), and their real tokens: the progress bar moves when the item does,
    tokens: int = 0  # so an item a crashed worker leaves to another is not counted twice


class Executor:
    """Runs items one at a time: OOM splitting, the learned failed shapes, records and results.

    ``lockstep`` (several ranks): every rank makes the same number of completed
    calls per item, so a ``fn`` with collectives never waits for a rank that
    has left (see :meth:`run_item`). ``store``: the results store rows are
    written to (with each row's input hash). ``skipped``: input positions the loader planned into no batch (bad inputs).
    """

    def __init__(self, fn: Callable[[Batch], Any], queue: BatchQueue, *, device: Any, on_oom: str,
                 memory_device: Any, bar: Any, lockstep: bool = False, store: ResultsStore | None = None,
                 skipped: np.ndarray | None = None, rank: int | str = 0, token_outputs: str = "auto",
                 lane: Lane | None = None) -> None:
        self.fn = explain_index_errors(fn)  # an embedding IndexError names its likely cause
        self.queue = queue
        self.lane = queue.lane if lane is None else lane  # this device's peaks and planner cursor
        self.device = device
        self.pinned = pins_memory(device)  # batches built in pinned memory: the copy to the device is asynchronous
        self._prepare = (lambda b: b.to(device, non_blocking=self.pinned)) if device is not None else None
        self.on_oom = on_oom
        self.rows = RowSplitter(queue.pad_token_id, token_outputs, queue.padding_side)  # fn's rule, kept for the run
        self.memory_device = memory_device
        self.store = store
        self.writer = store.writer(rank=rank) if store is not None else None
        self.bar = bar
        self.results: dict[int, Any] = {}  # without a store only
        self.last_position = -1  # the largest input position seen (a plain iterable's count)
        self.failed: list[int] = [] if skipped is None else skipped.tolist()
        self.failed_shapes: list[tuple[int, int]] = []
        self.report = RunReport(skipped_inputs=0 if skipped is None else len(skipped))
        self.started = time.perf_counter()
        self.tokens = 0
        self.lockstep = lockstep
        self._stand_in: Batch | None = None  # one row: the call a rank without work makes in a round
        self._stand_in_ran = False  # whether that row ran already (else it is the first row planned)

    def stored(self, positions: np.ndarray) -> np.ndarray:
        """Which of ``positions`` the results store already holds (none without a store)."""
        done = np.zeros(len(positions), dtype=bool)
        if self.store is not None:
            stored = self.store.done
            inside = positions < len(stored)
            done[inside] = stored[positions[inside]]
        return done

    def skip_done(self, item: Item) -> Item | None:
        """The item without the rows the results store already holds; ``None`` if none is left."""
        if item.positions.size:
            self.last_position = max(self.last_position, int(item.positions.max()))
        if self.store is None:
            return item
        done = self.stored(item.positions)
        if self.store.check_later and done.any():  # stored rows of a streamed corpus: theirs, or refused
            from dynabatch.inference.store import batch_input_hashes

            stored = self.queue.restrict(item, np.flatnonzero(done))
            self.store.check_inputs(stored.positions, batch_input_hashes(self.queue.build(stored)))
        if done.all():
            return None
        return self.queue.restrict(item, np.flatnonzero(~done)) if done.any() else item

    def _split(self, piece: Batch, sizes: list[int]) -> list[Batch]:
        return split_batch(piece, sizes, padding_side=self.queue.padding_side,
                           pad_to_multiple_of=self.queue.pad_to_multiple_of)

    def build(self, item: Item) -> Batch:
        """The item's tensors (built here, or as they came), in pinned memory when the device copies from it."""
        batch = self.queue.build(item)
        return batch.pin_memory() if self.pinned else batch

    def run_item(self, item: Item, batch: Batch | None = None) -> list[tuple[int, int, int]]:
        """Runs ``item`` (split as needed; ``batch``: its tensors, built ahead); returns ``(rows, width, peak
        bytes)`` of every measured call.

        In lockstep (several ranks, see :meth:`join_step`), the item runs in
        rounds: each round every rank makes exactly one call that completes,
        its next piece or, when it has none left while another rank has, a
        stand-in call on one row it already ran (its result dropped). A piece
        that runs out of memory is retried at once, in halves, within the round.
        """
        start = time.perf_counter()
        batch = self.build(item) if batch is None else batch
        rows, width = batch_shape(batch)
        record = BatchRecord(batch=item.number, rows=rows, width=width, real_tokens=real_tokens(batch),
                             padded_tokens=0, seconds=0.0)
        done = _Done()
        if self.lockstep and self._stand_in is None:
            self._stand_in = take_rows(batch, [0], padding_side=self.queue.padding_side,
                                       pad_to_multiple_of=self.queue.pad_to_multiple_of)
        stack = [batch]
        del batch
        try:
            while self._round(bool(stack)):
                if stack:
                    self._call_one(item, record, stack, done, start)
                else:
                    self._call_stand_in()
        finally:
            stack.clear()
        self._finish(record, done, start)
        return done.measured

    def join_step(self, item: Item) -> None:
        """In lockstep: takes part in the rounds of a step whose rows this rank already has (a resumed run)."""
        if not self.lockstep:
            return
        if self._stand_in is None:
            first = self.queue.restrict(item, np.array([0]))
            self._stand_in = self.queue.build(first)
        while self._round(False):
            self._call_stand_in()

    def _round(self, have_work: bool) -> bool:
        """Whether a round is to run: this rank has work, or (lockstep) any rank has."""
        if not self.lockstep:
            return have_work
        (anyone,) = reduce_across_ranks([float(have_work)], "max")
        return anyone > 0

    def _call_stand_in(self) -> None:
        attempt = call_guarded(self.fn, self._stand_in, prepare=self._prepare)
        if attempt.error is not None:
            logger.warning("a stand-in call (one row, to keep the ranks in step) ran out of memory: %s",
                           _brief(attempt.error))

    def _call_one(self, item: Item, record: BatchRecord, stack: list, done: _Done, start: float) -> None:
        """Runs pieces off ``stack`` until one call completes (lockstep) or the stack is empty."""
        while stack:
            piece = stack.pop()
            piece_rows, piece_width = batch_shape(piece)
            failed_shape = dominating(self.failed_shapes, piece_rows, piece_width) if piece_rows > 1 else None
            if failed_shape is not None:
                record.pre_split = True
                logger.info("batch %d: splitting %d rows x %d tokens before trying it, as large as %d x %d "
                            "which ran out of memory", item.number, piece_rows, piece_width, *failed_shape)
                stack.extend(reversed(self._split(piece, split_sizes(piece_rows))))
                continue
            cap = self.queue.max_call_rows(piece_width, self.lane) if piece_rows > 1 else None
            if cap is not None and piece_rows > cap:
                sizes = equal_parts(piece_rows, cap)
                record.pre_split = True
                logger.info("batch %d: splitting %d rows x %d tokens into %d parts before running it: the measured "
                            "peaks and out-of-memory errors keep at most %d rows of that width", item.number,
                            piece_rows, piece_width, len(sizes), cap)
                stack.extend(reversed(self._split(piece, sizes)))
                continue
            measure = self.memory_device is not None and self.queue.should_measure(piece_rows, piece_width, self.lane)
            attempt = call_guarded(
                self.fn, piece, measure_on=self.memory_device if measure else None,
                prepare=self._prepare,
                finish=lambda out, piece=piece: self.rows.split(out, piece),
            )
            if attempt.error is not None:
                skipped = self._out_of_memory(item, record, piece, attempt.error, stack, done, start)
                if skipped and self.lockstep and not stack:
                    self._call_stand_in()  # the round still owes the other ranks a call
                    return
                continue
            if attempt.peak_bytes is not None:
                peak = attempt.peak_bytes
                record.peak_bytes = peak if record.peak_bytes is None else max(record.peak_bytes, peak)
                done.measured.append((piece_rows, piece_width, peak))
            record.padded_tokens += piece_rows * piece_width
            done.positions.extend(piece.indices.tolist())
            done.results.extend(attempt.output)
            if self.writer is not None:
                done.hashes.append(self.store.hashes_of(piece))
                mask = piece.get("attention_mask")
                if self.writer.layout is None and mask is not None:  # real tokens per row: spots per-token outputs
                    done.lengths.append(mask.sum(1).cpu().numpy())
            done.rows += piece_rows
            done.tokens += real_tokens(piece)
            if self.lockstep:
                if not self._stand_in_ran:  # a row that ran: what a stand-in call repeats
                    self._stand_in_ran = True
                    self._stand_in = take_rows(piece, [0], padding_side=self.queue.padding_side,
                                               pad_to_multiple_of=self.queue.pad_to_multiple_of)
                return

    def _out_of_memory(self, item: Item, record: BatchRecord, piece: Batch, error: BaseException, stack: list,
                       done: _Done, start: float) -> bool:
        """Splits a piece that ran out of memory onto the stack (``False``), or raises / skips a single row (``True``)."""
        piece_rows, piece_width = batch_shape(piece)
        record.oom_events += 1
        self.failed_shapes.append((piece_rows, piece_width))
        self.queue.observe_out_of_memory(piece_rows, piece_width, self.lane)
        if piece_rows > 1:
            sizes = split_sizes(piece_rows)
            logger.warning("batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %s rows",
                           item.number, piece_rows, piece_width, _brief(error), " + ".join(map(str, sizes)))
            record.oom_splits += 1
            stack.extend(reversed(self._split(piece, sizes)))
            return False
        position = int(piece.indices[0])
        if self.on_oom == "raise":
            self._finish(record, done, start)
            raise BatchOutOfMemoryError(
                f"input position {position} ran out of memory on its own (1 row x {piece_width} "
                f"tokens, batch {item.number}), so it cannot be split further: {_brief(error)}; "
                "the error's .partial holds the finished rows; on_oom='skip' skips such rows",
                position=position,
                partial=self.result(failed=self.failed),
            ) from error
        logger.warning("batch %d: input position %d ran out of memory on its own (1 row x %d tokens); "
                       "skipping it (result None)", item.number, position, piece_width)
        record.failed_rows += 1
        self.failed.append(position)
        done.rows += 1
        return True

    def _finish(self, record: BatchRecord, done: _Done, start: float) -> None:
        self._progress(done.rows, done.tokens)
        getattr(self.queue.plan, "stream", None) is not None and self.queue.plan.stream.consumed(done.positions)
        if self.writer is not None:
            if done.positions:
                lengths = np.concatenate(done.lengths) if done.lengths else None
                self.writer.write(np.asarray(done.positions, dtype=np.int64), done.results, np.concatenate(done.hashes),
                                  lengths if lengths is not None and len(lengths) == len(done.positions) else None)
        else:
            self.results.update(zip(done.positions, done.results))
        record.seconds = time.perf_counter() - start
        self.report.records.append(record)
        if self.report.budget_bytes is None and record.peak_bytes is not None:
            self.report.budget_bytes = record.peak_bytes

    def _progress(self, rows: int, tokens: int) -> None:
        if self.bar is None:
            return
        self.tokens += tokens
        elapsed = time.perf_counter() - self.started
        self.bar.update(rows)
        if elapsed > 0:
            self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)

    def close(self) -> None:
        """Commits the rows the store's writer still buffers."""
        if self.writer is not None:
            self.writer.close()

    def result(self, failed: list[int] | None = None) -> Any:
        """The rows so far: a :class:`RunResult`, or with a store a
        :class:`~dynabatch.inference.results.StoredRunResult` reading the whole store (``failed``: ``None`` for
        every input without a stored row, as after a finished run of several ranks)."""
        n = self.queue.n_inputs
        if n is None:
            n = self.last_position + 1
        if self.store is not None:
            self.writer.flush()
            return self.store.result(n, report=self.report, failed=failed)
        values = [self.results.get(p) for p in range(n)]
        return RunResult(values, report=self.report, failed=self.failed)

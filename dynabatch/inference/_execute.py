"""Running one batch for :func:`dynabatch.run`: out-of-memory splitting, records, results.

:class:`Executor` runs an item through the out-of-memory guard
(:func:`~dynabatch.memory.guard.call_guarded`): a piece that runs out of memory
is split in halves and retried, down to one row; a piece at least as large
(rows and width) as one that failed is split before it is tried. Each item
leaves a :class:`~dynabatch.inference.report.BatchRecord` and its rows'
results (appended to the results file when there is one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dynabatch.data.collate import Batch, batch_shape, halves, real_tokens
from dynabatch.inference._queue import BatchQueue, Item
from dynabatch.inference._resume import ResultsFile
from dynabatch.inference.outputs import split_rows
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.results import BatchOutOfMemoryError, RunResult
from dynabatch.memory.guard import call_guarded

logger = logging.getLogger(__name__)


def _brief(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text[:200]}"


class Executor:
    """Runs items one at a time: OOM splitting, the learned failed shapes, records and results."""

    def __init__(self, fn: Callable[[Batch], Any], queue: BatchQueue, *, device: Any, on_oom: str,
                 memory_device: Any, results_file: ResultsFile | None, bar: Any) -> None:
        self.fn = fn
        self.queue = queue
        self.device = device
        self.on_oom = on_oom
        self.memory_device = memory_device
        self.results_file = results_file
        self.bar = bar
        self.results: dict[int, Any] = {}
        self.failed: list[int] = []
        self.failed_shapes: list[tuple[int, int]] = []
        self.item_failed_shapes: list[tuple[int, int]] = []  # (rows, width) that ran out of memory in the last item
        self.report = RunReport()
        self.started = time.perf_counter()
        self.tokens = 0

    def skip_done(self, item: Item) -> Item | None:
        """The item without the rows the results file already holds (their results taken); ``None`` if none is left."""
        done_rows = self.results_file.done if self.results_file is not None else None
        if not done_rows:
            return item
        done = np.fromiter((p in done_rows for p in item.positions.tolist()), dtype=bool, count=len(item.positions))
        for p in item.positions[done].tolist():
            self.results[p] = done_rows[p]
        if done.all():
            return None
        return self.queue.restrict(item, np.flatnonzero(~done)) if done.any() else item

    def _dominated(self, rows: int, width: int) -> tuple[int, int] | None:
        for failed_rows, failed_width in self.failed_shapes:
            if rows >= failed_rows and width >= failed_width:
                return failed_rows, failed_width
        return None

    def _halves(self, piece: Batch) -> tuple[Batch, Batch]:
        return halves(piece, padding_side=self.queue.padding_side, pad_to_multiple_of=self.queue.pad_to_multiple_of)

    def run_item(self, item: Item) -> list[tuple[int, int, int]]:
        """Runs ``item`` (split as needed); returns ``(rows, width, peak bytes)`` of every measured call."""
        start = time.perf_counter()
        batch = self.queue.build(item)
        rows, width = batch_shape(batch)
        record = BatchRecord(batch=item.number, rows=rows, width=width, real_tokens=real_tokens(batch),
                             padded_tokens=0, seconds=0.0)
        positions: list[int] = []
        results: list[Any] = []
        measured: list[tuple[int, int, int]] = []
        self.item_failed_shapes = []
        stack = [batch]
        del batch
        try:
            while stack:
                piece = stack.pop()
                piece_rows, piece_width = batch_shape(piece)
                failed_shape = self._dominated(piece_rows, piece_width) if piece_rows > 1 else None
                if failed_shape is not None:
                    record.pre_split = True
                    logger.info("batch %d: splitting %d rows x %d tokens before trying it, as large as %d x %d "
                                "which ran out of memory", item.number, piece_rows, piece_width, *failed_shape)
                    stack.extend(reversed(self._halves(piece)))
                    continue
                attempt = call_guarded(
                    self.fn, piece, measure_on=self.memory_device,
                    prepare=(lambda b: b.to(self.device)) if self.device is not None else None,
                    finish=lambda out, piece=piece: split_rows(out, piece, pad_token_id=self.queue.pad_token_id),
                )
                if attempt.error is not None:
                    self._out_of_memory(item, record, piece, attempt.error, stack, positions, results, start)
                    continue
                if attempt.peak_bytes is not None:
                    peak = attempt.peak_bytes
                    record.peak_bytes = peak if record.peak_bytes is None else max(record.peak_bytes, peak)
                    measured.append((piece_rows, piece_width, peak))
                record.padded_tokens += piece_rows * piece_width
                positions.extend(piece.indices.tolist())
                results.extend(attempt.output)
                self._progress(piece_rows, real_tokens(piece))
        finally:
            stack.clear()
        self._finish(record, positions, results, start)
        return measured

    def _out_of_memory(self, item: Item, record: BatchRecord, piece: Batch, error: BaseException, stack: list,
                       positions: list[int], results: list[Any], start: float) -> None:
        """Splits a piece that ran out of memory onto the stack, or raises / skips a single row."""
        piece_rows, piece_width = batch_shape(piece)
        record.oom_events += 1
        self.failed_shapes.append((piece_rows, piece_width))
        self.item_failed_shapes.append((piece_rows, piece_width))
        if piece_rows > 1:
            first, second = self._halves(piece)
            logger.warning("batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %d + %d rows",
                           item.number, piece_rows, piece_width, _brief(error), len(first.indices),
                           len(second.indices))
            record.oom_splits += 1
            stack.extend([second, first])
            return
        position = int(piece.indices[0])
        if self.on_oom == "raise":
            self._finish(record, positions, results, start)
            raise BatchOutOfMemoryError(
                f"input position {position} ran out of memory on its own (1 row x {piece_width} "
                f"tokens, batch {item.number}), so it cannot be split further: {_brief(error)}; "
                "the error's .partial holds the finished rows; on_oom='skip' skips such rows",
                position=position,
                partial=self.result(),
            ) from error
        logger.warning("batch %d: input position %d ran out of memory on its own (1 row x %d tokens); "
                       "skipping it (result None)", item.number, position, piece_width)
        record.failed_rows += 1
        self.failed.append(position)
        self.results[position] = None
        self._progress(1, 0)

    def _finish(self, record: BatchRecord, positions: list[int], results: list[Any], start: float) -> None:
        if self.results_file is not None and positions:
            results = self.results_file.write(positions, results)
        self.results.update(zip(positions, results))
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

    def result(self) -> RunResult:
        n = self.queue.n_inputs
        if n is None:
            n = max(self.results, default=-1) + 1
        values = [self.results.get(p) for p in range(n)]
        return RunResult(values, report=self.report, failed=self.failed)

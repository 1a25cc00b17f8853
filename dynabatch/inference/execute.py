"""The executor of :func:`dynabatch.run`: one item at a time on one device, through the one out-of-memory policy
and the halving of a batch ``fn`` raises on (``docs/inference.md``: "When fn raises", "Out-of-memory errors"); an
item gives an :class:`Outcome`."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch._validation import brief_error, first_few
from dynabatch.data.collate import Batch, batch_shape, real_tokens
from dynabatch.inference.build import Built
from dynabatch.inference.outputs import RowSplitter
from dynabatch.inference.report import BatchRecord
from dynabatch.inference.source import Item
from dynabatch.memory.device import backend_of, is_device_failure, is_out_of_memory_error
from dynabatch.memory.oom import Attempt, call_guarded, split_sizes

__all__ = ["BatchOutOfMemoryError", "Executor", "Failures", "Outcome", "explain_index_errors"]

logger = logging.getLogger(__name__)

_EMBEDDING_MESSAGE = "index out of range in self"  # torch's message for an embedding index out of range


class BatchOutOfMemoryError(RuntimeError):
    """A single row (input ``position``) ran out of memory on its own (``on_oom="raise"``); chained from the
    original error. ``partial``: the result so far, the rows not finished ``None``."""

    def __init__(self, message: str, *, position: int | None = None, partial: Any = None) -> None:
        super().__init__(message)
        self.position, self.partial = position, partial


def explain_index_errors(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn``, with torch's bare ``IndexError: index out of range in self`` from an embedding lookup (rows longer than
    the position embeddings, or ids of another tokenizer) raised again naming its likely cause; other errors unchanged.

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


@dataclass(frozen=True)
class Failures:
    """What a worker does with a failing row: ``on_oom`` and ``on_error`` (``"raise"``, or ``"skip"`` a row that runs
    out of memory, or that ``fn`` raises on, alone), and the loader's ``ids`` (a ``pyarrow`` array) an error's note
    names (``None``: positions only)."""

    on_oom: str = "raise"
    on_error: str = "raise"
    ids: Any = None


@dataclass
class Outcome:
    """What running an item gave, a value: the input ``positions`` finished and their ``rows`` (results, in that
    order), the inputs set aside (``failed``: position -> cause), the ``measured`` calls ``(rows, width, peak bytes)``,
    the ``(rows, width)`` of each call that ran ``out_of_memory`` (but those a row set aside alone explains), the
    ``unfinished`` rows as an item (the run stopped, or a call raised), the real ``tokens`` finished, the ``record``
    (``None`` when no row finished or was set aside), ``seconds`` by stage (``"device"``: copy, call, rows back) and
    which rows are ``varying`` in length."""

    item: Item
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rows: list = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    measured: list[tuple[int, int, int]] = field(default_factory=list)
    out_of_memory: list[tuple[int, int]] = field(default_factory=list)
    unfinished: Item | None = None
    tokens: int = 0
    record: BatchRecord | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {"device": 0.0})
    varying: Any = None


class _FnFailed(Exception):
    """Carries an error ``fn`` itself raised (``args[0]``: not out of memory, not a device failure) past the guard."""


class Executor:
    """One worker's executor: runs items on its device one call at a time (``start``, ``step`` while ``pending``,
    ``outcome``).

    Args:
        fn: what runs a batch on this worker's device.
        copier: moves a batch to the device (:func:`dynabatch.memory.device.copier`); ``None`` leaves it.
        memory_device: where peaks are measured; ``None``: not measured.
        splitter: the run's row rule (shared by every worker: each field's reading is fixed once).
        failures: what a failing row does (:class:`Failures`).

    Example:
        >>> import numpy as np, torch
        >>> from dynabatch.data.collate import Batch
        >>> from dynabatch.inference.build import Built
        >>> from dynabatch.inference.outputs import RowSplitter
        >>> from dynabatch.inference.source import Item
        >>> batch = Batch({"input_ids": torch.ones(3, 4, dtype=torch.long)}, indices=torch.tensor([7, 8, 9]))
        >>> executor = Executor(lambda b: b["input_ids"].sum(dim=1), copier=None, memory_device=None,
        ...                     splitter=RowSplitter(0, "auto", None))
        >>> executor.start(Item(0, np.array([7, 8, 9])), Built(batch))
        >>> while executor.pending:
        ...     _ = executor.step()
        >>> outcome = executor.outcome()
        >>> outcome.positions.tolist(), [int(r) for r in outcome.rows], outcome.unfinished
        ([7, 8, 9], [4, 4, 4], None)
    """

    def __init__(self, fn: Callable[[Batch], Any], *, copier: Callable | None, memory_device: Any,
                 splitter: RowSplitter, failures: Failures = Failures()) -> None:
        self.fn = explain_index_errors(fn)
        self._memory_device, self._splitter, self._failures = memory_device, splitter, failures
        self._prepare = None if copier is None else (
            lambda b: Batch(copier(b), indices=b.indices, texts=getattr(b, "texts", None)))
        self._stack: list[Batch] = []  # the item in progress's pieces left to run, the last one next
        self._widest_ran = 0  # the widest call that ran on this worker: a row failing alone narrower is its own fault
        if memory_device is not None:  # as the worker starts: not in its first batch's device time
            backend_of(memory_device).prime_peak_tracker(memory_device)

    def start(self, item: Item, built: Built | None) -> None:
        """Starts ``item`` (``built``: its tensors; ``None`` when the store holds every row of it)."""
        record = None if built is None else BatchRecord(
            batch=item.number, rows=len(item.positions), width=batch_shape(built.batch)[1],
            real_tokens=0, padded_tokens=0, seconds=0.0)  # kept once a row finished
        self._outcome, self._built, self._start = Outcome(item, record=record), built, time.perf_counter()
        self._stack, self._finished = [] if built is None else [built.batch], []  # the finished pieces' positions
        self._oom_positions: list[np.ndarray] = []  # the positions of each piece in outcome.out_of_memory
        self._raised: tuple[int, Exception, np.ndarray] | None = None  # on_error="raise": the piece fn raised on
        # (its stack depth, the error, its positions) while its halves are tried to find the row it raises on

    @property
    def pending(self) -> bool:
        """Whether the item started has pieces left to run."""
        return bool(self._stack)

    def step(self) -> Batch | None:
        """Tries the next piece of the item: splits it before it runs (its sizing says so), or calls ``fn`` on it.
        Returns the piece when its call completed, else ``None`` (split, ran out of memory, or set aside)."""
        outcome, stack = self._outcome, self._stack
        item, record, piece = outcome.item, outcome.record, stack[-1]  # on the stack until it finishes
        rows, width = batch_shape(piece)
        split = item.sizing.split(rows, width, outcome.out_of_memory) if item.sizing is not None else None
        if split is not None:
            logger.info("batch %d: splitting %d rows x %d tokens into %d parts before trying it: %s",
                        item.number, rows, width, len(split.sizes), split.reason)
            record.pre_split = True
            stack[-1:] = reversed(self._built.padding.split(piece, split.sizes))
            return None
        measure = self._memory_device is not None and (item.sizing is None or item.sizing.measure(rows, width))
        attempt = self._attempt(piece, self._memory_device if measure else None,
                                lambda out: self._splitter.split(out, piece))
        if attempt.error is not None:
            if is_out_of_memory_error(attempt.error):
                self._out_of_memory(attempt.error, rows, width)
            else:
                self._fn_failed(attempt.error)
            return None
        stack.pop()
        self._widest_ran = max(self._widest_ran, width)
        if attempt.peak_bytes is not None:
            record.peak_bytes = max(record.peak_bytes or 0, attempt.peak_bytes)
            outcome.measured.append((rows, width, attempt.peak_bytes))
        record.padded_tokens += rows * width
        self._finished.append(piece.indices.numpy())
        outcome.rows.extend(attempt.output)
        outcome.tokens += real_tokens(piece)
        if self._raised is not None and len(stack) <= self._raised[0]:  # every part of the failed piece ran
            _, error, positions = self._raised
            error.add_note(f"dynabatch.run: fn(batch) raised on {self._describe(positions)}, but on none of its "
                           "parts when retried in halves to find the row: the error depends on the batch as a whole "
                           "(its size or width) or comes and goes, not on one input; its rows ran in the halves (a "
                           "store keeps them); on_error='skip' (--on-error skip on the command line) goes on past "
                           "such an error")
            raise error
        return piece

    def call(self, batch: Batch) -> BaseException | None:
        """One guarded call of ``fn`` on ``batch``, its result dropped: the out-of-memory error it met, or ``None``;
        an error ``fn`` raises is raised."""
        error = self._attempt(batch).error
        if error is not None and not is_out_of_memory_error(error):
            raise error
        return error

    def _attempt(self, piece: Batch, measure_on: Any = None, finish: Callable | None = None) -> Attempt:
        """One guarded call of ``fn`` on ``piece``, timed; an error ``fn`` raised is the attempt's error too."""
        start = time.perf_counter()  # the copy in, the call and the rows back on the CPU (which waits for the device)
        try:
            return call_guarded(self._call, piece, measure_on=measure_on, prepare=self._prepare, finish=finish)
        except _FnFailed as failed:
            return Attempt(error=failed.args[0])
        finally:
            self._outcome.seconds["device"] += time.perf_counter() - start

    def _call(self, batch: Batch) -> Any:
        try:
            return self.fn(batch)
        except Exception as exc:
            if is_out_of_memory_error(exc) or is_device_failure(exc):
                raise
            raise _FnFailed(exc) from None

    def _describe(self, positions: np.ndarray) -> str:
        """The rows at ``positions`` of the item in progress, by position and id, for a note or a log line."""
        number, ids = self._outcome.item.number, self._failures.ids
        shown = positions[:5].tolist()
        named = f" (id{'s' if len(positions) > 1 else ''} {first_few(ids.take(shown).to_pylist())})" \
            if ids is not None else ""
        if len(positions) == 1:
            return f"input position {shown[0]}{named}, alone (a row of batch {number})"
        return f"batch {number}: {len(positions)} rows at input positions {first_few(positions.tolist())}{named}"

    def _fn_failed(self, error: Exception) -> None:
        """``fn`` raised on the piece on top of the stack: halves it to find the row it raises on (at most
        ``2 * ceil(log2(rows))`` more calls, whose rows that ran are finished); on one row, raises the error noting
        that row (``on_error="raise"``) or sets the row aside."""
        piece = self._stack[-1]
        positions = piece.indices.numpy()
        if len(positions) > 1:
            if self._failures.on_error == "raise" and self._raised is None:
                self._raised = (len(self._stack) - 1, error, positions)
            sizes = split_sizes(len(positions))
            logger.warning("%s: fn(batch) raised (%s); retrying as %s rows to find the rows it fails on",
                           self._describe(positions), brief_error(error), " + ".join(map(str, sizes)))
            self._stack[-1:] = reversed(self._built.padding.split(piece, sizes))
            return
        if self._failures.on_error == "raise":
            error.add_note(f"dynabatch.run: fn(batch) raised on {self._describe(positions)}; on_error='skip' "
                           "(--on-error skip on the command line) sets the rows it raises on alone aside")
            raise error
        logger.warning("%s: fn(batch) raised on it (%s); set aside (result None, in failed)",
                       self._describe(positions), brief_error(error))
        self._outcome.record.error_rows += 1
        self._stack.pop()
        self._outcome.failed[int(positions[0])] = brief_error(error)

    def _out_of_memory(self, error: BaseException, rows: int, width: int) -> None:
        """Halves the piece on top of the stack that ran out of memory; one row is set aside or raised (``on_oom``)."""
        outcome, piece, number = self._outcome, self._stack[-1], self._outcome.item.number
        outcome.record.oom_events += 1
        outcome.out_of_memory.append((rows, width))
        self._oom_positions.append(piece.indices.numpy())
        if rows > 1:
            sizes = split_sizes(rows)
            logger.warning("batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %s rows",
                           number, rows, width, brief_error(error), " + ".join(map(str, sizes)))
            outcome.record.oom_splits += 1
            self._stack[-1:] = reversed(self._built.padding.split(piece, sizes))
            return
        position = int(piece.indices[0])
        if self._failures.on_oom == "raise":
            raise BatchOutOfMemoryError(
                f"input position {position} ran out of memory on its own (1 row x {width} tokens, batch "
                f"{number}), so it cannot be split further: {brief_error(error)}; the error's .partial holds the "
                "finished rows; on_oom='skip' skips such rows", position=position) from error
        logger.warning("batch %d: input position %d ran out of memory on its own (1 row x %d tokens); skipping it "
                       "(result None)", number, position, width)
        outcome.record.failed_rows += 1
        self._stack.pop()
        outcome.failed[position] = f"out of memory alone: {brief_error(error)}"
        if self._widest_ran >= width:
            self._forget_failures_of(position)

    def _forget_failures_of(self, position: int) -> None:
        """Drops the out-of-memory shapes of the pieces that held ``position``, a row that failed alone where a call
        at least as wide ran: that row, not their size, explains them. As evidence of the device's limit they would
        hold every later call under one row of that row's cost (one row at its width, and any two rows at any width:
        the failed call's cost a row is a floor), so that one text too large for the device ran the rest of the run
        one row at a time. Where nothing as wide ran, the width may be what fails: they are kept, so later rows as
        wide run alone at once rather than fail in halves first."""
        keep = [i for i, positions in enumerate(self._oom_positions) if position not in positions]
        self._outcome.out_of_memory = [self._outcome.out_of_memory[i] for i in keep]
        self._oom_positions = [self._oom_positions[i] for i in keep]

    def outcome(self) -> Outcome:
        """Ends the item started, however its steps ended: what it gave, the pieces not run its ``unfinished`` rows."""
        outcome, stack, self._stack = self._outcome, self._stack, []
        if self._finished:
            outcome.positions = np.concatenate(self._finished)
            # Every row's paths: a row whose value is None at a path says nothing of how that path is read.
            outcome.varying = list({tuple(path) for row in outcome.rows for path in self._splitter.varying(row)})
        if stack:
            batch = self._built.batch
            rows_left = np.flatnonzero(np.isin(batch.indices.numpy(),
                                               np.concatenate([piece.indices.numpy() for piece in stack])))
            outcome.unfinished = Item(outcome.item.number, batch.indices.numpy()[rows_left], batch, rows_left,
                                      whole=False, crashes=outcome.item.crashes)
        if count := len(outcome.positions) + len(outcome.failed):  # rows finished or set aside
            outcome.record.rows = count
            # the real tokens of the pieces that ran to completion, as padded_tokens counts theirs: rows set aside
            # ran none (counting the whole batch's gave a padding share above 100%)
            outcome.record.real_tokens = outcome.tokens
            outcome.record.seconds = time.perf_counter() - self._start
        else:
            outcome.record = None
        return outcome

"""The executor of :func:`dynabatch.run`: one item at a time on one device, through the one out-of-memory policy.

A piece that runs out of memory is split in halves and retried, down to one row; one the item's
:class:`~dynabatch.inference.scheduler.Sizing` says to split is split before it is tried. An error ``fn`` raises
splits its batch in halves until the rows that fail are alone, then is raised with a note naming the row
(``on_error="raise"``) or the row is set aside (``"skip"``). What the item gave comes back as a value, an
:class:`Outcome`, which the worker's loop (:mod:`~dynabatch.inference.loop`) hands to the other stages.
"""

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
from dynabatch.memory.device import is_device_failure, is_out_of_memory_error
from dynabatch.memory.oom import call_guarded, split_sizes

__all__ = ["BatchOutOfMemoryError", "Executor", "Failures", "Outcome", "explain_index_errors"]

logger = logging.getLogger(__name__)

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
    """What a worker does with a failing row: ``on_oom`` (``"raise"`` or ``"skip"`` a single row that runs out of
    memory), ``on_error`` (``"raise"`` the error ``fn`` raises, or ``"skip"`` the rows it raises on alone), and the
    loader's ``ids`` (a ``pyarrow`` array) an error's note names (``None``: positions only)."""

    on_oom: str = "raise"
    on_error: str = "raise"
    ids: Any = None


@dataclass
class Outcome:
    """What running an item gave, handed by the worker's loop to the other stages.

    Attributes:
        item: the item that ran.
        positions: the input positions finished, in the order of ``rows`` (one result each).
        failed: the inputs set aside, position -> cause.
        measured: the measured calls, ``(rows, width, peak bytes)``.
        out_of_memory: the ``(rows, width)`` of each call that ran out of memory.
        unfinished: the rows that did not finish (the run stopped, or a call raised), as an item, or ``None``.
        tokens: the real tokens of the rows finished.
        record: the item's record (``None`` when no row finished or was set aside).
        seconds: seconds by stage (``"device"``: the copies in, the calls and the rows back on the CPU).
        varying: the row rule's reading of which rows vary in length (what the sink stores them as).
    """

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


@dataclass
class _Run:
    """An item in progress: its pieces left (the last runs next), what finished, and the error being narrowed down."""

    outcome: Outcome  # its record kept only once a row finished or was set aside
    built: Built | None
    stack: list[Batch]
    start: float
    positions: list[np.ndarray] = field(default_factory=list)
    raised: tuple[int, Exception, np.ndarray] | None = None  # on_error="raise": a failed piece's stack depth, error
    # and positions, while its halves are tried to find the row it raises on


class _FnFailed(Exception):
    """Carries an error ``fn`` itself raised (not out of memory, not a device failure) past the guard's handling."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Executor:
    """One worker's executor: runs items on its device one call at a time (``start``, ``step``, ``outcome``).

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
        self._run: _Run | None = None

    def start(self, item: Item, built: Built | None) -> None:
        """Starts ``item`` (``built``: its tensors; ``None`` when the store holds every row of it)."""
        if built is None:
            self._run = _Run(Outcome(item), None, [], time.perf_counter())
            return
        rows, width = batch_shape(built.batch)
        record = BatchRecord(batch=item.number, rows=rows, width=width, real_tokens=real_tokens(built.batch),
                             padded_tokens=0, seconds=0.0)
        self._run = _Run(Outcome(item, record=record), built, [built.batch], time.perf_counter())

    @property
    def pending(self) -> bool:
        """Whether the item started has pieces left to run."""
        return self._run is not None and bool(self._run.stack)

    def step(self) -> Batch | None:
        """Tries the next piece of the item: splits it before it runs (its sizing says so), or calls ``fn`` on it.
        Returns the piece when its call completed, else ``None`` (split, ran out of memory, or set aside)."""
        run = self._run
        item, record, stack = run.outcome.item, run.outcome.record, run.stack
        piece = stack[-1]  # on the stack until it finishes: an error in fn leaves it unfinished
        rows, width = batch_shape(piece)
        split = item.sizing.split(rows, width, run.outcome.out_of_memory) if item.sizing is not None else None
        if split is not None:
            logger.info("batch %d: splitting %d rows x %d tokens into %d parts before trying it: %s",
                        item.number, rows, width, len(split.sizes), split.reason)
            record.pre_split = True
            stack[-1:] = reversed(run.built.padding.split(piece, split.sizes))
            return None
        measure = self._memory_device is not None and (item.sizing is None or item.sizing.measure(rows, width))
        attempt, error = self._attempt(piece, measure=measure, finish=True)
        if error is not None:
            self._fn_failed(error)
            return None
        if attempt.error is not None:
            self._out_of_memory(attempt.error)
            return None
        stack.pop()
        if attempt.peak_bytes is not None:
            record.peak_bytes = max(record.peak_bytes or 0, attempt.peak_bytes)
            run.outcome.measured.append((rows, width, attempt.peak_bytes))
        record.padded_tokens += rows * width
        run.positions.append(piece.indices.numpy())
        run.outcome.rows.extend(attempt.output)
        run.outcome.tokens += real_tokens(piece)
        if run.raised is not None and len(stack) <= run.raised[0]:  # every part of the failed piece ran
            raise self._not_alone(*run.raised[1:])
        return piece

    def call(self, batch: Batch) -> BaseException | None:
        """One guarded call of ``fn`` on ``batch``, its result dropped: the out-of-memory error it met, or ``None``;
        an error ``fn`` raises is raised."""
        attempt, error = self._attempt(batch, measure=False, finish=False)
        if error is not None:
            raise error
        return attempt.error

    def _attempt(self, piece: Batch, *, measure: bool, finish: bool) -> tuple[Any, Exception | None]:
        """One guarded call of ``fn`` on ``piece``: ``(attempt, None)``, or ``(None, error)`` for an error ``fn``
        raised (handled here, outside the ``except`` block: it is raised again with no context of ours)."""
        start = time.perf_counter()  # the copy in, the call and the rows back on the CPU (which waits for the device)
        try:
            return call_guarded(self._call, piece, measure_on=self._memory_device if measure else None,
                                prepare=self._prepare,
                                finish=(lambda out: self._splitter.split(out, piece)) if finish else None), None
        except _FnFailed as failed:
            error = failed.error
        finally:
            if self._run is not None:
                self._run.outcome.seconds["device"] += time.perf_counter() - start
        return None, error

    def _call(self, batch: Batch) -> Any:
        try:
            return self.fn(batch)
        except Exception as exc:
            if is_out_of_memory_error(exc) or is_device_failure(exc):
                raise
            raise _FnFailed(exc) from None

    def _describe(self, positions: np.ndarray) -> str:
        """The rows at ``positions`` of the item in progress, by position and id, for a note or a log line."""
        number, ids = self._run.outcome.item.number, self._failures.ids
        shown = positions[:5].tolist()
        named = f" (id{'s' if len(positions) > 1 else ''} {first_few(ids.take(shown).to_pylist())})" \
            if ids is not None else ""
        if len(positions) == 1:
            return f"input position {shown[0]}{named}, alone (a row of batch {number})"
        return f"batch {number}: {len(positions)} rows at input positions {first_few(positions.tolist())}{named}"

    def _set_aside(self, position: int, cause: str) -> None:
        run = self._run
        run.stack.pop()
        run.outcome.failed[position] = cause

    def _fn_failed(self, error: Exception) -> None:
        """``fn`` raised on the piece on top of the stack: splits it in halves to find the row it raises on; on one
        row, raises the error noting that row (``on_error="raise"``) or sets the row aside.

        Each halving tries the first half, and the second only if the first ran: at most ``2 * ceil(log2(rows))``
        more calls, whose rows that ran are finished; an ``fn`` that raises on every call is named after
        ``ceil(log2(rows))`` calls.
        """
        run = self._run
        piece = run.stack[-1]
        positions = piece.indices.numpy()
        if len(positions) > 1:
            if self._failures.on_error == "raise" and run.raised is None:
                run.raised = (len(run.stack) - 1, error, positions)
            sizes = split_sizes(len(positions))
            logger.warning("%s: fn(batch) raised (%s); retrying as %s rows to find the rows it fails on",
                           self._describe(positions), brief_error(error), " + ".join(map(str, sizes)))
            run.stack[-1:] = reversed(run.built.padding.split(piece, sizes))
            return
        if self._failures.on_error == "raise":
            error.add_note(f"dynabatch.run: fn(batch) raised on {self._describe(positions)}; {_SET_ASIDE}")
            raise error
        logger.warning("%s: fn(batch) raised on it (%s); set aside (result None, in failed)",
                       self._describe(positions), brief_error(error))
        run.outcome.record.error_rows += 1
        self._set_aside(int(positions[0]), brief_error(error))

    def _not_alone(self, error: Exception, positions: np.ndarray) -> Exception:
        """``error``, which ``fn`` raised on the rows at ``positions`` whose halves then all ran: noted so."""
        error.add_note(f"dynabatch.run: fn(batch) raised on {self._describe(positions)}, but on none of its "
                       "parts when retried in halves to find the row: the error depends on the batch as a whole "
                       "(its size or width) or comes and goes, not on one input; its rows ran in the halves (a store "
                       "keeps them); on_error='skip' (--on-error skip on the command line) goes on past such an error")
        return error

    def _out_of_memory(self, error: BaseException) -> None:
        """Splits the piece on top of the stack, which ran out of memory, or sets it aside if it is one row
        (``on_oom="raise"`` raises)."""
        run = self._run
        piece, number = run.stack[-1], run.outcome.item.number
        rows, width = batch_shape(piece)
        run.outcome.record.oom_events += 1
        run.outcome.out_of_memory.append((rows, width))
        if rows > 1:
            sizes = split_sizes(rows)
            logger.warning("batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %s rows",
                           number, rows, width, brief_error(error), " + ".join(map(str, sizes)))
            run.outcome.record.oom_splits += 1
            run.stack[-1:] = reversed(run.built.padding.split(piece, sizes))
            return
        position = int(piece.indices[0])
        if self._failures.on_oom == "raise":
            raise BatchOutOfMemoryError(
                f"input position {position} ran out of memory on its own (1 row x {width} tokens, batch "
                f"{number}), so it cannot be split further: {brief_error(error)}; the error's .partial holds the "
                "finished rows; on_oom='skip' skips such rows", position=position) from error
        logger.warning("batch %d: input position %d ran out of memory on its own (1 row x %d tokens); skipping it "
                       "(result None)", number, position, width)
        run.outcome.record.failed_rows += 1
        self._set_aside(position, f"out of memory alone: {brief_error(error)}")

    def outcome(self) -> Outcome:
        """Ends the item started, however its steps ended: what it gave (:class:`Outcome`), the pieces not run
        as its :attr:`~Outcome.unfinished` rows."""
        run, self._run = self._run, None
        outcome = run.outcome
        if run.positions:
            outcome.positions = np.concatenate(run.positions)
            outcome.varying = self._splitter.varying(outcome.rows[0])
        if run.stack:
            batch = run.built.batch
            rows_left = np.flatnonzero(np.isin(batch.indices.numpy(),
                                               np.concatenate([piece.indices.numpy() for piece in run.stack])))
            outcome.unfinished = Item(outcome.item.number, batch.indices.numpy()[rows_left], batch, rows_left,
                                      whole=False, crashes=outcome.item.crashes)
        if count := sum(map(len, run.positions)) + len(outcome.failed):  # rows finished or set aside
            outcome.record.rows = count
            outcome.record.seconds = time.perf_counter() - run.start
        else:
            outcome.record = None
        return outcome

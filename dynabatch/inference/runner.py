"""``run``: call a model on every batch, recover from out-of-memory errors, get rows back in input order.

:func:`run` takes a callable and a dynabatch DataLoader (or any iterable of
:class:`~dynabatch.data.collate.Batch`), calls ``fn(batch)`` on every batch and
returns a :class:`RunResult`: a list with one result per input text, in input
order, plus a :class:`~dynabatch.inference.report.RunReport` of what each batch did.

* A batch that runs out of memory is split in halves, each trimmed to its
  longest row, and retried, down to single rows; later batches at least as
  large (rows and width) as a shape that failed are split before they are tried.
* ``output_path`` appends each finished batch to a JSONL file; a rerun with the
  same inputs and path runs only what is missing (a killed run resumes).
* ``measure_memory`` records each batch's peak memory against the first's;
  ``adapt=True`` closes the loop: the sizes of batches not yet run follow the
  measured peaks (:class:`~dynabatch.memory.feedback.MemoryFeedback`), the
  classifier's plan being the prior.
* Under ``torch.distributed``, each rank runs a cost-balanced share of the
  batches and rank 0 gathers every result.

Example:
    >>> from transformers import AutoTokenizer
    >>> from dynabatch import build_dynamic_batch_dataloader, run
    >>> from dynabatch.demo import minilm_path
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> texts = ["In the beginning", "And God said", "Let there be light", ""]
    >>> loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=2, max_input_token_length=16,
    ...                                         num_workers=0)
    >>> lengths = run(lambda batch: batch["attention_mask"].sum(dim=1), loader, progress=False)
    >>> [int(n) for n in lengths]  # one result per text, in input order
    [5, 5, 6, 2]
    >>> lengths.report.rows, lengths.report.batches, lengths.failed
    (4, 2, [])
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from dynabatch.inference._resume import FORMAT, ResultsFile, rank_path
from dynabatch.inference._rows import batch_shape, halves, real_tokens, split_rows
from dynabatch.inference._source import Item, Source, unwrap_prepared
from dynabatch._validation import bad_type, bad_value, check_non_negative_int
from dynabatch.data.collate import Batch
from dynabatch.memory.measure import is_out_of_memory_error, track_peak_memory
from dynabatch.inference.report import BatchRecord, RunReport

__all__ = ["BatchOutOfMemoryError", "RunResult", "run"]

logger = logging.getLogger(__name__)

_ON_OOM = ("raise", "skip")


class RunResult(list):
    """One result per input text, in input order, with what the run did.

    A plain ``list`` otherwise: ``result[p]`` belongs to input ``p``.

    Attributes:
        report: the :class:`~dynabatch.inference.report.RunReport` of the batches that ran.
        failed: sorted input positions that ran out of memory on their own and
            were skipped (``on_oom="skip"``); their results are ``None``.
    """

    def __init__(
        self, results: Iterable[Any] = (), *, report: RunReport | None = None, failed: Iterable[int] = ()
    ) -> None:
        super().__init__(results)
        self.report = report if report is not None else RunReport()
        self.failed = sorted(failed)


class BatchOutOfMemoryError(RuntimeError):
    """A single row ran out of memory on its own (``on_oom="raise"``).

    Chained from the original out-of-memory error.

    Attributes:
        position: the input position of the row.
        partial: the :class:`RunResult` so far: finished rows filled, the others ``None``.
    """

    def __init__(self, message: str, *, position: int | None = None, partial: RunResult | None = None) -> None:
        super().__init__(message)
        self.position = position
        self.partial = partial

    def __reduce__(self) -> tuple:
        return type(self), (str(self),), {"position": self.position, "partial": self.partial}


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Runner:
    """Runs items one at a time: OOM splitting, the learned failed shapes, records and results."""

    def __init__(
        self,
        fn: Callable[[Batch], Any],
        source: Source,
        *,
        device: Any,
        on_oom: str,
        memory_device: Any,
        results_file: ResultsFile | None,
        bar: Any,
    ) -> None:
        self.fn = fn
        self.source = source
        self.device = device
        self.on_oom = on_oom
        self.memory_device = memory_device
        self.results_file = results_file
        self.bar = bar
        self.results: dict[int, Any] = {}
        self.failed: list[int] = []
        self.failed_shapes: list[tuple[int, int]] = []
        self.report = RunReport()
        self.measured: list[tuple[int, int]] = []  # (rows, peak bytes) of each call of the last item that ran
        self.started = time.perf_counter()
        self.tokens = 0

    def _dominated(self, rows: int, width: int) -> tuple[int, int] | None:
        for failed_rows, failed_width in self.failed_shapes:
            if rows >= failed_rows and width >= failed_width:
                return failed_rows, failed_width
        return None

    def _attempt(self, piece: Batch) -> tuple[list | None, int | None, BaseException | None]:
        """Rows of ``fn(piece)`` and its peak bytes, or the out-of-memory error it raised."""
        try:
            moved = piece.to(self.device) if self.device is not None else piece
            if self.memory_device is not None:
                with track_peak_memory(self.memory_device) as mem:
                    output = self.fn(moved)
                peak = mem.peak_bytes
            else:
                output = self.fn(moved)
                peak = None
            rows = split_rows(output, piece, pad_token_id=self.source.pad_token_id)
        except Exception as exc:
            if not is_out_of_memory_error(exc):
                raise
            return None, None, exc
        return rows, peak, None

    def _halves(self, piece: Batch) -> tuple[Batch, Batch]:
        return halves(piece, padding_side=self.source.padding_side, pad_to_multiple_of=self.source.pad_to_multiple_of)

    def run_item(self, item: Item) -> None:
        start = time.perf_counter()
        batch = self.source.build(item)
        rows, width = batch_shape(batch)
        record = BatchRecord(
            batch=item.number, rows=rows, width=width, real_tokens=real_tokens(batch), padded_tokens=0, seconds=0.0
        )
        positions: list[int] = []
        results: list[Any] = []
        self.measured = []
        stack = [batch]
        del batch
        try:
            while stack:
                piece = stack.pop()
                piece_rows, piece_width = batch_shape(piece)
                failed_shape = self._dominated(piece_rows, piece_width) if piece_rows > 1 else None
                if failed_shape is not None:
                    record.pre_split = True
                    logger.info(
                        "batch %d: splitting %d rows x %d tokens before trying it, as large as %d x %d "
                        "which ran out of memory",
                        item.number,
                        piece_rows,
                        piece_width,
                        *failed_shape,
                    )
                    stack.extend(reversed(self._halves(piece)))
                    continue
                rows_out, peak, error = self._attempt(piece)
                if error is not None:
                    record.oom_events += 1
                    self.failed_shapes.append((piece_rows, piece_width))
                    if piece_rows > 1:
                        first, second = self._halves(piece)
                        logger.warning(
                            "batch %d: %d rows x %d tokens ran out of memory (%s); retrying as %d + %d rows",
                            item.number,
                            piece_rows,
                            piece_width,
                            _brief(error),
                            len(first.indices),
                            len(second.indices),
                        )
                        error = None  # its traceback holds the failed call's tensors
                        _free_memory()
                        record.oom_splits += 1
                        stack.extend([second, first])
                        continue
                    position = int(piece.indices[0])
                    if self.on_oom == "raise":
                        self._finish(item, record, positions, results, start)
                        partial = self.result()
                        raise BatchOutOfMemoryError(
                            f"input position {position} ran out of memory on its own (1 row x {piece_width} "
                            f"tokens, batch {item.number}), so it cannot be split further: {_brief(error)}; "
                            "the error's .partial holds the finished rows; on_oom='skip' skips such rows",
                            position=position,
                            partial=partial,
                        ) from error
                    error = None
                    _free_memory()
                    logger.warning(
                        "batch %d: input position %d ran out of memory on its own (1 row x %d tokens); "
                        "skipping it (result None)",
                        item.number,
                        position,
                        piece_width,
                    )
                    record.failed_rows += 1
                    self.failed.append(position)
                    self.results[position] = None
                    self._progress(1, 0)
                    continue
                if peak is not None:
                    record.peak_bytes = peak if record.peak_bytes is None else max(record.peak_bytes, peak)
                    self.measured.append((piece_rows, peak))
                record.padded_tokens += piece_rows * piece_width
                positions.extend(piece.indices.tolist())
                results.extend(rows_out)
                self._progress(piece_rows, real_tokens(piece))
        finally:
            stack.clear()
        self._finish(item, record, positions, results, start)

    def _finish(self, item: Item, record: BatchRecord, positions: list[int], results: list[Any], start: float) -> None:
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

    def result(self, n_inputs: int | None = None) -> RunResult:
        n = n_inputs if n_inputs is not None else self.source.n_inputs
        if n is None:
            n = max(self.results, default=-1) + 1
        values = [self.results.get(p) for p in range(n)]
        return RunResult(values, report=self.report, failed=self.failed)


def _brief(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text[:200]}"


class _Feedback:
    """Measured mode: hands out batches sized by :class:`~dynabatch.memory.feedback.MemoryFeedback` from the peaks so far."""

    def __init__(self, source: Source, loader: Any) -> None:
        from dynabatch.memory.feedback import MemoryFeedback

        batches = loader.batch_sampler.batches  # plan order: sorted longest first
        self.order = np.concatenate(batches) if batches else np.empty(0, dtype=np.int64)
        lengths = source.collator.tokenized.lengths[self.order]
        self.model = MemoryFeedback(lengths, [len(b) for b in batches])
        self.source = source
        source.pending.clear()
        self.start = 0
        self.number = 0
        self.last: tuple[Item, int] | None = None  # the item handed out and the records before it

    def next_item(self, runner: _Runner) -> Item | None:
        if self.last is not None:
            item, seen = self.last
            record = runner.report.records[-1] if len(runner.report.records) > seen else None
            if record is not None and len(item.positions) == record.rows:
                self.model.observe_parts(runner.measured)  # one call, or the parts of a split batch
        size = self.model.next_size(self.start, None if self.last is None else len(self.last[0].positions))
        if size == 0:
            return None
        item = Item(self.number, self.order[self.start : self.start + size])
        self.start += size
        self.number += 1
        self.last = (item, len(runner.report.records))
        return item


def _check_arguments(
    fn: Any, device: Any, output_path: Any, on_oom: Any, measure_memory: Any, progress: Any, distributed: Any,
    adapt: Any = False, pad_token_id: Any = None,
) -> None:
    if not isinstance(adapt, bool):
        raise bad_type("adapt", "a bool", adapt)
    if not callable(fn):
        raise bad_type("fn", "a callable taking a batch", fn)
    if device is not None and not isinstance(device, (str, torch.device)):
        raise bad_type("device", "None, a str or a torch.device", device)
    if output_path is not None and not isinstance(output_path, (str, os.PathLike)):
        raise bad_type("output_path", "None, a str or an os.PathLike (a .jsonl file)", output_path)
    if not isinstance(on_oom, str):
        raise bad_type("on_oom", f"one of {_ON_OOM}", on_oom)
    if on_oom not in _ON_OOM:
        raise bad_value("on_oom", f"one of {_ON_OOM}", on_oom)
    if not isinstance(measure_memory, (bool, str, torch.device)):
        raise bad_type("measure_memory", "a bool, or the device to measure (a str or torch.device)", measure_memory)
    if not isinstance(progress, bool):
        raise bad_type("progress", "a bool", progress)
    if distributed is not None and not isinstance(distributed, bool):
        raise bad_type("distributed", "None (auto), True or False", distributed)
    if pad_token_id is not None:
        check_non_negative_int("pad_token_id", pad_token_id)



def run(
    fn: Callable[[Batch], Any],
    loader: Any,
    *,
    device: str | torch.device | None = None,
    output_path: str | os.PathLike | None = None,
    on_oom: str = "raise",
    measure_memory: bool | str | torch.device = False,
    progress: bool = True,
    distributed: bool | None = None,
    adapt: bool = False,
    pad_token_id: int | None = None,
) -> RunResult:
    """Calls ``fn(batch)`` on every batch of ``loader`` and returns one result per input, in input order.

    ``fn`` is called as it is: wrap the call in ``torch.no_grad()`` (or
    ``torch.inference_mode()``) yourself for inference.

    Args:
        fn: takes a :class:`~dynabatch.data.collate.Batch` and returns its rows'
            results: a tensor with the batch dimension first, a list or tuple
            with one item per row, a dict or ``ModelOutput`` of batched tensors
            (one dict per row; values without a batch dimension, such as a
            loss or a cache, are left out), or ``None``. A 2-D integer tensor
            is taken as token ids (``generate``): each row loses its trailing
            pad ids and, when the tensor starts with the batch's ``input_ids``
            (a decoder-only model echoes its left-padded prompt), its own left
            padding; pad ids between real tokens stay. Return ``list(tensor)``
            to keep rows exactly as they are. Tensors come back detached, on the CPU.
        loader: a DataLoader from :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader`,
            or any iterable of :class:`~dynabatch.data.collate.Batch` (``.indices`` required).
        device: where to move each batch (``batch.to(device)``) before ``fn``; ``None`` leaves it.
        output_path: a JSONL file to save each finished batch to (flushed and
            fsynced), headed by a fingerprint of the inputs and plan. Running
            again with the same inputs and path runs only the rows not in the
            file, so a killed run resumes; a line cut off mid-write is ignored.
            Results must be JSON-storable (tensors are stored as nested lists),
            and with ``output_path`` set **every** returned result is the JSON
            value, as stored (lists, numbers, str, dicts), whether it ran now or
            was read back, so its type never depends on resuming. Rows skipped
            by ``on_oom="skip"`` are not saved, so a rerun tries them again.
            Under ``torch.distributed`` each rank writes its own file,
            ``name.rank{r}-of-{n}.jsonl``.
        on_oom: what to do with a single row that runs out of memory on its
            own: ``"raise"`` a :class:`BatchOutOfMemoryError`, or ``"skip"``
            it (result ``None``, position in ``result.failed``, a warning logged).
            Larger batches are always split in halves (each trimmed to its
            longest row) and retried, and a later batch with at least the rows
            and the width of a shape that ran out of memory is split before it
            is tried. Out-of-memory errors are ``torch.OutOfMemoryError`` and
            the CPU allocator's; every event and split is logged and counted
            in the report.
        measure_memory: ``False``, or ``True`` / a device to measure each
            call's peak memory on (``True``: ``device``, else ``"cpu"``), with
            :func:`~dynabatch.memory.measure.track_peak_memory`; the first batch's
            peak is the report's budget.
        progress: show a ``tqdm`` progress bar (rows/s and tokens/s).
        distributed: ``None`` runs distributed when ``torch.distributed`` is
            initialized with more than one process; ``True``/``False`` force it.
            Distributed: each rank runs its share of the batches, balanced by
            cost (rows x width), and rank 0 gathers every result; other ranks
            get only their own rows (``None`` elsewhere). Every rank must be
            given the same, whole loader (a per-rank share is refused on every
            rank). Under ``accelerate`` pass the loader as it is; one passed
            through ``Accelerator.prepare`` is unwrapped, its whole plan sharded once.
        adapt: measured mode (needs a dynabatch loader, one process): every
            batch's peak is measured (on ``measure_memory``'s device, else
            ``device``, else the CPU tracker) and the batches not yet run are
            re-sized so that, at the last measured peak per row (a bound, since
            rows only get shorter), they stay at or under 0.9 of the first
            batch's: smaller than planned after a spike, larger where the plan
            leaves memory unused (see :mod:`dynabatch.memory.feedback`). A batch split
            after running out of memory counts by its parts: the largest peak
            that fitted (the budget, if it was the first batch) and the costliest
            row. Batches then run longest first, whatever the loader's ``shuffle``.
        pad_token_id: the pad id stripped from token-id rows (see ``fn``);
            ``None`` takes the loader's collator's (a dynabatch loader always
            has one). Give it for a plain iterable of batches whose ``generate``
            rows should lose their padding.

    Returns:
        A :class:`RunResult`: a list with one result per input position, plus
        ``.report`` and ``.failed``.

    Raises:
        TypeError: a bad argument type, a loader whose batches have no
            ``.indices``, or (with ``output_path``) a result JSON cannot store.
        ValueError: a bad ``on_oom``, an ``output_path`` holding another run's
            results, or ``fn`` results that do not match the batch's rows.
        BatchOutOfMemoryError: with ``on_oom="raise"``, a single row that ran out of memory.
    """
    _check_arguments(fn, device, output_path, on_oom, measure_memory, progress, distributed, adapt, pad_token_id)
    memory_device = None
    if adapt and measure_memory is False:
        measure_memory = True
    if measure_memory is not False:
        memory_device = (device if device is not None else "cpu") if measure_memory is True else measure_memory

    rank, world_size = 0, 1
    if distributed is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        from dynabatch.inference.distributed import world

        rank, world_size = world()
        distributed = world_size > 1

    loader = unwrap_prepared(loader)
    source = Source(loader, pad_token_id)
    if adapt and source.collator is None:
        raise bad_value("adapt", "False for a loader that is not a dynabatch DataLoader (measured mode re-plans "
                        "its batches)", adapt)
    if adapt and distributed:
        raise bad_value("adapt", "False under torch.distributed (each rank's share is fixed up front)", adapt)
    fingerprint = None
    if output_path is not None:
        fingerprint = source.fingerprint()  # before sharding: it covers every batch
    if distributed:
        from dynabatch.inference.distributed import _check_same_batches, shard_batches

        source.materialize()
        items = list(source.pending)
        _check_same_batches([i.positions for i in items])
        costs = [float(rows * width) for rows, width in map(source.shape, items)]
        share = shard_batches(costs, world_size, rank)
        source.pending = deque(items[b] for b in share if b >= 0)
        logger.info("rank %d of %d: %d of %d batches", rank, world_size, len(source.pending), len(items))

    results_file = None
    if output_path is not None:
        path = os.fspath(output_path)
        if distributed:
            path = rank_path(path, rank, world_size)
        header = {"format": FORMAT, "n_inputs": source.n_inputs, "fingerprint": fingerprint}
        results_file = ResultsFile(path, header)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = sum(len(i.positions) for i in source.pending) if source.stream is None else source.n_inputs
        if total is None:
            try:
                total = len(loader.dataset) or None
            except (AttributeError, TypeError):
                total = None
        if total is not None and results_file is not None:
            total = max(0, total - len(results_file.done))  # the bar counts the rows that run now
        bar = tqdm(total=total, unit="row", desc="dynabatch", dynamic_ncols=True)

    runner = _Runner(
        fn, source, device=device, on_oom=on_oom, memory_device=memory_device, results_file=results_file, bar=bar
    )
    mine: list[int] = []
    feedback = _Feedback(source, loader) if adapt else None
    try:
        while (item := source.next_item() if feedback is None else feedback.next_item(runner)) is not None:
            if results_file is not None and results_file.done:
                done = np.fromiter(
                    (p in results_file.done for p in item.positions.tolist()), dtype=bool, count=len(item.positions)
                )
                for p in item.positions[done].tolist():
                    runner.results[p] = results_file.done[p]
                mine.extend(item.positions[done].tolist())
                if done.all():
                    continue
                if done.any():
                    item = source.restrict(item, np.flatnonzero(~done))
            mine.extend(item.positions.tolist())
            runner.run_item(item)
    finally:
        if bar is not None:
            bar.close()
        if results_file is not None:
            results_file.close()

    result = runner.result()
    if not distributed:
        return result
    from dynabatch.inference.distributed import gather_results

    n = source.n_inputs
    gathered = gather_results(mine, [result[p] for p in mine], n)
    failed = set(runner.failed)
    flags = gather_results(mine, [p in failed for p in mine], n)
    if gathered is None:  # not rank 0: only this rank's rows
        return RunResult(result, report=runner.report, failed=runner.failed)
    return RunResult(gathered, report=runner.report, failed=[p for p, f in enumerate(flags) if f])

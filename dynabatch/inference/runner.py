"""``run``: call a model on every batch, recover from out-of-memory errors, get rows back in input order.

One path read top to bottom: options resolved, the sink opened, a resumed run's stored inputs checked before any
batch, each device's or rank's loop (:mod:`~dynabatch.inference.loop`), and the sink's accounting of every input.

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

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dynabatch._background import stage_seconds, timing_stages
from dynabatch._validation import bad_type, brief, first_few
from dynabatch.data.collate import Batch
from dynabatch.inference.build import Builder
from dynabatch.inference.distributed import Lockstep, job_token, share_outcome
from dynabatch.inference.execute import BatchOutOfMemoryError, Executor, Failures
from dynabatch.inference.loader import BAD_TEXT, NO_TOKEN, LoaderPlan, plan_of
from dynabatch.inference.loop import Stages, WorkerParts, run_workers
from dynabatch.inference.meter import Meter, TextCosts, background_shares
from dynabatch.inference.options import RunOptions, check_run_options, resolve_options
from dynabatch.inference.outputs import RowSplitter
from dynabatch.inference.report import RunReport
from dynabatch.inference.results import RunResult, StoredRunResult
from dynabatch.inference.scheduler import Scheduler
from dynabatch.inference.sink import MemorySink, StoreSink, open_sink
from dynabatch.inference.source import Source
from dynabatch.memory.device import copier, pins_memory

__all__ = ["BAD_INPUT", "BatchOutOfMemoryError", "IncompleteRunError", "RunResult", "StoredRunResult",
           "check_run_options", "run"]

logger = logging.getLogger(__name__)

BAD_INPUT = BAD_TEXT
"""The cause of a text the loader planned into no batch (a pre-tokenized item: ``loader.BAD_ROW``)."""


class IncompleteRunError(RuntimeError):
    """A run that cannot account for every input: some are neither returned (or stored) nor in ``failed``;
    ``missing``: their positions, sorted; ``partial``: the result as the sink holds it."""

    def __init__(self, message: str, *, missing: list[int], partial: Any = None) -> None:
        super().__init__(message)
        self.missing, self.partial = missing, partial

    def __reduce__(self) -> tuple:
        return type(self), (str(self),), {"missing": self.missing, "partial": self.partial}


def run(
    fn: Callable[[Batch], Any] | None = None,
    loader: Any = None,
    *,
    make_fn: Callable[[torch.device], Callable[[Batch], Any]] | None = None,
    devices: list[str | torch.device] | None = None,
    device: str | torch.device | None = None,
    memory: str = "auto",
    ranks: str = "auto",
    on_oom: str = "raise",
    on_error: str = "raise",
    output_path: str | os.PathLike | None = None,
    key: str | None = None,
    token_outputs: str = "auto",
    pad_token_id: int | None = None,
    prefetch: int | None = None,
    progress: bool = True,
) -> RunResult | StoredRunResult:
    """Calls ``fn(batch)`` on every batch of ``loader`` and returns one result per input, in input order.

    ``fn`` is called as it is (wrap it in ``torch.inference_mode()`` yourself). When ``run`` returns, every input has
    a result (returned, or stored at ``output_path``) or is in ``result.failed`` with its cause in
    ``result.failures``, as the sink holds them. Every rule in full: ``docs/inference.md``.

    Args:
        fn: takes a :class:`~dynabatch.data.collate.Batch`; what it returns is split into rows (on the CPU) by the row
            rule (:mod:`dynabatch.inference.outputs`).
        loader: a dynabatch DataLoader (batches built here from its plan, to be split, re-sized or shared before
            their tensors exist), or any iterable of batches with ``.indices``.
        make_fn: with ``devices`` only: ``make_fn(device)`` returns that device's ``fn``, in its worker thread.
        devices: several devices, a worker thread each; a failed device's unfinished rows go to the others once.
        device: where each batch is moved before ``fn``; ``None`` leaves it.
        memory: ``"measured"`` (batches re-sized so that no peak exceeds the first batch's), ``"guarded"`` (a batch
            bound above the first batch's peak split before it runs), ``"record"``, ``"off"``, or ``"auto"``.
        ranks: under ``torch.distributed``: ``"lockstep"`` (the same calls on every rank), ``"claim"`` (ranks claim
            chunks; no collectives in ``fn``), ``"single"``, or ``"auto"`` (lockstep under several ranks).
        on_oom: a row out of memory on its own (larger batches are halved and retried): ``"raise"`` or ``"skip"``.
        on_error: a batch ``fn`` raises on is halved until such rows are alone: ``"raise"`` or ``"skip"`` them.
        output_path: a directory for the results store (or an opened store); a rerun runs only the rows not stored.
        key: with ``output_path``, what computed the rows (model, revision, settings): the one record of what ``fn``
            computes with, which ``run`` cannot see; a rerun under another key is refused, one without a key on a
            store without one resumes it whatever model ``fn`` calls.
        token_outputs: how a tensor as wide as the batch is read: ``"auto"``, ``"per_token"``, ``"generated"``,
            ``"whole"``.
        pad_token_id: the pad id stripped from generated rows; ``None``: the loader's collator's.
        prefetch: batches built ahead in a background thread; ``None``: 2, or 0 with ``devices``.
        progress: a progress display on standard error.

    Returns:
        A :class:`RunResult` (a list by input position, with ``.report``, ``.failed`` and ``.failures``), or with
        ``output_path`` a :class:`StoredRunResult` reading the rows from the store.

    Raises:
        TypeError: a bad argument type; batches without ``.indices``; a row the store cannot hold.
        ValueError: a bad option or combination; a store of another ``key`` or inputs; ``fn`` rows that do not fit.
        BatchOutOfMemoryError: with ``on_oom="raise"``, a single row that ran out of memory.
        IncompleteRunError: inputs neither returned (or stored) nor in ``failed``.
        Exception: what ``fn`` raised (``on_error="raise"``), with its note.
    """
    plan = plan_of(loader)
    options = resolve_options(fn, loader, plan, make_fn=make_fn, devices=devices, device=device, memory=memory,
                              ranks=ranks, on_oom=on_oom, on_error=on_error, output_path=output_path, key=key,
                              token_outputs=token_outputs, pad_token_id=pad_token_id, prefetch=prefetch,
                              progress=progress)
    # the run's own stage counter: its threads' seconds, none of another run's at the same time (the report's)
    with _one_run_of(plan, loader), timing_stages():
        source = Source(loader, plan)
        # one token for this job's ranks, for the store's job lock: a collective (but under torchrun), so made on
        # every rank, with a store or not, for a rank without one to reach the check that refuses it (share)
        job = None if options.ranks == "single" else job_token()
        sink = open_sink(options.output_path, key=options.key, n=source.n_inputs,
                         ids=None if plan is None else plan.ids, gather=options.ranks != "single",
                         job=None if options.output_path is None else job)
        try:
            return _run(source, sink, options)
        finally:
            sink.end()


_plans_running: set[int] = set()  # id() of the loader plans a run of this process is running (each held alive by it)
_plans_lock = threading.Lock()


@contextlib.contextmanager
def _one_run_of(plan: LoaderPlan | None, loader: Any) -> Iterator[None]:
    """Holds ``plan`` for this run: a second run of the same loader while this one runs (in another thread, or in
    ``fn``) is refused. Measured mode hands out the plan's batches from the one pass of its planner, which the runs
    would share: each would run part of the batches, and both lose the rest (``IncompleteRunError``)."""
    if plan is None:  # an iterable of batches: each run iterates it itself
        yield
        return
    with _plans_lock:
        if id(plan) in _plans_running:
            raise ValueError(f"loader should be run by one run at a time (the runs would share its plan's one pass: "
                             f"each would run part of its batches and lose the rest), but got loader={brief(loader)} "
                             "while another run of it has not ended (in another thread, or in fn): build a loader "
                             "for each run, or run them one after the other")
        _plans_running.add(id(plan))
    try:
        yield
    finally:
        with _plans_lock:
            _plans_running.discard(id(plan))


def _run(source: Source, sink: MemorySink | StoreSink, options: RunOptions) -> RunResult | StoredRunResult:
    """The stages, from the resume check to the accounted result."""
    plan, stored = source.plan, sink.stored
    if stored is not None and stored.any():  # a resumed run: the inputs the store holds, checked before any batch
        unchecked = sink.unchecked()  # rows its caller checked already (the command line's) are not hashed again
        # None for a plain iterable of batches: its rows are checked as they are built
        inputs = source.input_hashes(unchecked) if unchecked.size else None
        if inputs is not None:
            sink.check_inputs(*inputs)
        logger.info("the store holds %d of this run's rows: they are not run again", int(stored.sum()))
    try:
        try:
            report = _share_and_execute(source, sink, options, stored)
        except Exception as exc:
            if options.ranks == "single":
                raise
            share_outcome(exc)  # raises exc here and RankFailedError on the others: none waits for this rank
            raise
        if options.ranks != "single":
            share_outcome(None)  # raises RankFailedError where another rank failed (its rows were not all run)
    finally:
        source.close()
    if options.output_path is not None and options.ranks != "single":
        torch.distributed.barrier()  # every rank's shards are in: each rank reads the whole store
    result, missing = sink.result(source.total_inputs, report=report)
    if missing.size:
        # six ids: first_few writes "..." after five where there are more
        ids = plan.ids.take(missing[:6]).to_pylist() if plan is not None and plan.ids is not None else None
        raise IncompleteRunError(
            f"run should account for every input (a result, or a place in failed with its cause), but got "
            f"{missing.size} of {len(result)} inputs with neither (positions {first_few(missing.tolist())}"
            + (f"; ids {first_few(ids)}" if ids is not None else "") + "): an iterable of batches may have left them "
            "out, or their rows were lost on the way to the sink; with output_path, a rerun runs only them",
            missing=missing.tolist(), partial=result)
    return result


def _share_and_execute(source: Source, sink: MemorySink | StoreSink, options: RunOptions,
                       stored: np.ndarray | None) -> RunReport:
    """This rank's share of the batches, run into the sink (rank 0 also lists the inputs the loader skipped)."""
    plan = source.plan
    source.share(options.ranks, options.rank, options.world_size, store=options.output_path is not None)
    scheduler = Scheduler(source, memory=options.memory, sparse=options.sparse, stored=stored,
                          read_ahead=options.prefetch)
    builder = Builder(plan, source.loader, pad_token_id=options.pad_token_id,
                      pinned=any(pins_memory(t) for t in options.targets), hashes=isinstance(sink, StoreSink))
    skipped = plan.skipped if plan is not None else np.zeros(0, dtype=np.int64)
    if options.rank == 0:  # rank 0 answers for the inputs the loader planned into no batch
        _fail_skipped(sink, "rank0.loader", skipped, plan)
    report = _execute(source, scheduler, builder, sink, options, skipped, stored)
    if source.streamed and (options.rank == 0 or options.ranks == "claim"):
        # a stream's texts of no token, found as their chunks were tokenized (each rank claiming tokenizes its own
        # chunks; in lockstep every rank tokenizes every chunk, and rank 0 answers)
        found = np.setdiff1d(plan.stream.no_token, skipped)
        _fail_skipped(sink, f"rank{options.rank}.no_token", found, plan, NO_TOKEN)
        report.skipped_inputs += len(found)
    return report


def _fail_skipped(sink: MemorySink | StoreSink, name: str, positions: np.ndarray, plan: Any,
                  cause: str | None = None) -> None:
    """Lists the inputs at ``positions`` failed, with ``cause`` (``None``: the plan's cause of each)."""
    if not positions.size:
        return
    writer = sink.writer(name)
    try:
        writer.fail(positions, None, plan.causes(positions) if cause is None else [cause] * len(positions))
    finally:
        writer.close()


def _meter(source: Source, options: RunOptions, skipped: np.ndarray, stored: np.ndarray | None) -> Meter:
    """The run's meter, over the inputs that run now: neither skipped nor stored; under ranks claiming chunks, the
    whole corpus (this rank counting for every rank), its closing line this rank's own rows, named; in lockstep, this
    rank's dealt share, shown as the rank's."""
    n, desc = source.n_inputs, "dynabatch"
    runs, held = None, stored
    if n is not None:  # a store opened for n inputs holds n flags (open_sink refuses another n)
        runs = np.ones(n, dtype=bool) if stored is None else ~stored
        runs[skipped] = False
        if (dealt := source.dealt(n)) is not None:  # the ranks run their shares in rounds: this one's sets the pace
            runs &= dealt
            held = None if stored is None else stored & dealt
            n, desc = int(dealt.sum()), f"dynabatch rank {options.rank}"
    sizes = source.text_sizes()  # what the time left is counted in: the plan's token lengths, a stream's characters
    costs = None if sizes is None else TextCosts(sizes[0], exact=sizes[1], max_length=sizes[2], runs=runs)
    return Meter(costs, total_rows=None if runs is None else int(runs.sum()), scale=source.scale,
                 stream=sys.stderr if options.progress else None, stored=0 if held is None else int(held.sum()),
                 inputs=n, desc=desc, claiming_rank=options.rank if source.scale > 1 else None)


def _execute(source: Source, scheduler: Scheduler, builder: Builder, sink: MemorySink | StoreSink,
             options: RunOptions, skipped: np.ndarray, stored: np.ndarray | None) -> RunReport:
    """Runs the scheduler's items on every target (a worker each) into the sink; returns the report. Each worker's
    writer is closed however the run ends; ``BatchOutOfMemoryError`` gets the rows finished so far as ``.partial``."""
    splitter = RowSplitter(builder.pad_token_id, options.token_outputs, builder.padding.side)  # fn's rule, for the run
    failures = Failures(options.on_oom, options.on_error, None if source.plan is None else source.plan.ids)
    background = stage_seconds()
    meter = _meter(source, options, skipped, stored)
    names = [str(t) for t in options.targets]
    names = [f"{name} (worker {i})" if names.count(name) > 1 else name for i, name in enumerate(names)]
    stages = Stages(source, scheduler, builder, sink, meter, threading.Event(), options.prefetch,
                    (lambda: Lockstep(builder.stand_in)) if source.lockstep else None)

    def start_worker(target: Any, i: int) -> WorkerParts:
        fn = options.make_fn(target)
        if not callable(fn):
            raise bad_type("make_fn", f"a callable returning fn(batch) for a device (make_fn({str(target)!r}) "
                           "returned no callable)", fn)
        lane = scheduler.lane(options.memory_devices[i])  # an absolute max_memory is read on this device now
        executor = Executor(fn, copier=copier(target), memory_device=options.memory_devices[i], splitter=splitter,
                            failures=failures)
        writer = sink.writer(f"rank{options.rank}" if len(options.targets) == 1 else f"rank{options.rank}.{i}")
        return WorkerParts(executor, lane, writer, names[i])

    def report() -> RunReport:
        merged = stages.report
        merged.skipped_inputs = len(skipped)
        merged.wall_seconds = meter.clock() - meter.started  # the workers ended: their rows handed on, committed
        merged.background = background_shares(background, merged.wall_seconds)
        merged.tokenize_cores = source.tokenize_cores
        merged.accounting_seconds = meter.accounting
        return merged

    try:
        run_workers(options.targets, start_worker, stages)  # each worker's writer closed as it ends
        meter.drained = True  # every item ran: under ranks="claim", the counter had no chunk left for this rank
    except BatchOutOfMemoryError as exc:
        exc.partial = sink.result(source.total_inputs, report=report(), gather=False)[0]
        raise
    finally:
        stages.stop.set()
        meter.close()
    return report()

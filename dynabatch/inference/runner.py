"""``run``: call a model on every batch, recover from out-of-memory errors, get rows back in input order.

One path, read top to bottom in :func:`run`: the options are resolved or refused
(:mod:`~dynabatch.inference.options`); the source hands out batches (:mod:`~dynabatch.inference.source`); the sink, in
memory or a results store, is opened and checked before any row is written (:mod:`~dynabatch.inference.sink`); the
executor runs the batches on each device or rank, splitting on out-of-memory errors and cutting rows by the row rule
(:mod:`~dynabatch.inference.execute`, :mod:`~dynabatch.inference.outputs`); the sink assembles the result.

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

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type
from dynabatch.data.collate import Batch
from dynabatch.inference.execute import BatchOutOfMemoryError, Executor, run_workers
from dynabatch.inference.loader import plan_of
from dynabatch.inference.options import RunOptions, check_run_options, resolve_options, translate_deprecated
from dynabatch.inference.outputs import RowSplitter
from dynabatch.inference.report import RunReport
from dynabatch.inference.results import RunResult, StoredRunResult
from dynabatch.inference.sink import MemorySink, open_sink
from dynabatch.inference.source import BatchQueue

__all__ = ["BatchOutOfMemoryError", "RunResult", "StoredRunResult", "check_run_options", "run"]

logger = logging.getLogger(__name__)


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
    output_path: str | os.PathLike | None = None,
    key: str | None = None,
    token_outputs: str = "auto",
    pad_token_id: int | None = None,
    prefetch: int | None = None,
    progress: bool = True,
    **deprecated: Any,
) -> RunResult | StoredRunResult:
    """Calls ``fn(batch)`` on every batch of ``loader`` and returns one result per input, in input order.

    ``fn`` is called as it is: wrap the call in ``torch.inference_mode()``
    yourself. ``docs/inference.md`` has every rule below as a table, with examples.

    Args:
        fn: takes a :class:`~dynabatch.data.collate.Batch`; what it returns is split into one result per row by
            the row rule (:mod:`dynabatch.inference.outputs`): a batch-first tensor (or a tuple, list or dict of
            them) gives each row its slice; a :class:`~dynabatch.inference.outputs.PerRow` is one item per row. A
            tensor is cut to each row's real tokens only where that is certain; a 2-D tensor as wide as the batch
            is refused at the first batch unless ``token_outputs`` declares it. Rows come back on the CPU.
        loader: a dynabatch DataLoader (its batches are built here from its plan, so they can be split, re-sized
            or shared before their tensors exist), or any iterable of batches with ``.indices``.
        make_fn: with ``devices``: ``make_fn(device)`` returns the ``fn`` for that device (a model copy moved
            there), called once per device in that device's worker thread.
        devices: several devices at once (``["cuda:0", "cuda:1"]``), a worker thread each over one shared queue,
            each measuring and splitting on its own; a worker whose ``fn`` raises stops and its unfinished rows
            go back to the queue once.
        device: where each batch is moved before ``fn``; ``None`` leaves it.
        memory: ``"measured"`` (a dynabatch loader's batches re-sized from measured peaks so that none exceeds
            the first batch's), ``"guarded"`` (batches in their own order, one bound above the first batch's
            peak split before it runs), ``"record"`` (batches as they come, every peak recorded), ``"off"``, or
            ``"auto"``: measured where the batches can be re-planned, else guarded; off where memory cannot be
            measured (:mod:`dynabatch.inference.options`).
        ranks: under ``torch.distributed``: ``"lockstep"`` (the same calls of ``fn`` on every rank: collectives
            in ``fn`` stay matched), ``"claim"`` (ranks claim chunks of the corpus; no collectives in ``fn``),
            ``"single"`` (this process runs everything); ``"auto"``: lockstep under more than one rank. Without
            ``output_path`` rank 0 gathers every row.
        on_oom: a single row out of memory on its own: ``"raise"`` :class:`BatchOutOfMemoryError` (``.partial``:
            the rows finished) or ``"skip"`` it (``None``, in ``result.failed``). Larger batches are split in
            halves and retried, and later batches planned under what the errors teach.
        output_path: a directory for the results store (:mod:`dynabatch.inference.store`): Parquet shards, one
            row per input, written as rows finish, committed however the run ends (Ctrl-C too); a rerun with
            the same ``key`` runs only the rows not stored, and stored rows of other inputs are refused before
            any row is written.
        key: with ``output_path``, what computed the rows (model, revision, settings).
        token_outputs: declares how a tensor as wide as the batch is read: ``"auto"`` (certain readings only),
            ``"per_token"``, ``"generated"`` (padding stripped) or ``"whole"``.
        pad_token_id: the pad id stripped from generated rows; ``None``: the loader's collator's.
        prefetch: batches built ahead in a background thread; ``None``: 2, or 0 with ``devices``.
        progress: a ``tqdm`` progress bar (rows/s, tokens/s).
        **deprecated: ``adapt``, ``measure_memory``, ``distributed``, ``lockstep`` of earlier versions,
            translated with a ``DeprecationWarning`` naming ``memory=`` or ``ranks=``.

    Returns:
        A :class:`RunResult`, a list of one result per input position with ``.report`` and ``.failed``; with
        ``output_path`` a :class:`StoredRunResult` reading the same rows from the store.

    Raises:
        TypeError: a bad argument type; batches without ``.indices``; a row the store cannot hold.
        ValueError: a bad option or combination of options; a store of another ``key`` or of other inputs; an
            ``fn`` result whose rows are ambiguous or do not match the batch.
        BatchOutOfMemoryError: with ``on_oom="raise"``, a single row that ran out of memory.
    """
    memory, ranks = translate_deprecated(deprecated, memory, ranks)
    plan = plan_of(loader)
    options = resolve_options(fn, loader, plan, make_fn=make_fn, devices=devices, device=device, memory=memory,
                              ranks=ranks, on_oom=on_oom, output_path=output_path, key=key,
                              token_outputs=token_outputs, pad_token_id=pad_token_id, prefetch=prefetch,
                              progress=progress)
    queue = BatchQueue(loader, plan, memory=options.memory, sparse=options.sparse, pad_token_id=options.pad_token_id)
    feed = None
    if options.ranks == "lockstep":
        queue.shard(options.rank, options.world_size)
    elif options.ranks == "claim":
        from dynabatch.inference.distributed import claimed_planner

        planner, feed = claimed_planner(plan)
        queue.claim(planner)
    skipped = plan.skipped if plan is not None else np.zeros(0, dtype=np.int64)
    try:
        sink = open_sink(options.output_path, key=options.key, n=queue.n_inputs,
                         ids=plan.ids if plan is not None else None, gather=options.ranks != "single",
                         inputs_at=queue.inputs_at)
        queue.done = getattr(sink, "done", None)
        queue.read_ahead(options.prefetch)
        report, failed = _execute(queue, sink, options, skipped)
    finally:
        queue.close()
        if feed is not None:
            feed.close()
        if plan is not None and plan.stream is not None:
            plan.stream.pause()  # its tokenizing thread ends with the run; a later use of the loader goes on
    if options.output_path is not None and options.ranks != "single":
        torch.distributed.barrier()  # every rank's shards are in: each rank reads the whole store
        return sink.result(queue.count, report=report, failed=None)
    return sink.result(queue.count, report=report, failed=failed)


def _execute(queue: BatchQueue, sink: Any, options: RunOptions, skipped: np.ndarray) -> tuple[RunReport, list[int]]:
    """Runs the queue on every target (a worker each) into the sink; ``(report, failed positions)``: the rows that
    ran out of memory alone and were skipped, and the bad inputs the loader planned into no batch (``skipped``;
    rank 0 answers for them).

    Every worker's writer is closed (its rows committed) however the run ends; ``BatchOutOfMemoryError`` gets the rows
    finished so far as ``.partial``.
    """
    splitter = RowSplitter(queue.pad_token_id, options.token_outputs, queue.padding_side)  # fn's rule, for the run
    bar = _progress_bar(queue) if options.progress else None
    stop = threading.Event()
    names = [str(t) for t in options.targets]
    names = [f"{n} (worker {i})" if names.count(n) > 1 else n for i, n in enumerate(names)]  # ["cpu", "cpu"]
    writers, executors = [], []

    def make_executor(target: Any, i: int) -> Executor:
        fn = options.make_fn(target)
        if not callable(fn):
            raise bad_type("make_fn", f"a callable returning fn(batch) for a device (make_fn({str(target)!r}) "
                           "returned no callable)", fn)
        writers.append(sink.writer(f"rank{options.rank}" if len(options.targets) == 1 else f"rank{options.rank}.{i}"))
        lane = queue.lane if i == 0 else queue.new_lane()
        queue.set_budget(lane, options.memory_devices[i])  # an absolute max_memory, read on this device now
        executors.append(Executor(fn, queue, writer=writers[-1], hashes=options.output_path is not None,
                                  device=target, memory_device=options.memory_devices[i], splitter=splitter,
                                  on_oom=options.on_oom, bar=bar, lockstep=options.ranks == "lockstep", stop=stop,
                                  lane=lane, name=names[i]))
        return executors[-1]

    def failed() -> list[int]:
        return sorted([*(f for e in executors for f in e.failed), *(skipped.tolist() if options.rank == 0 else [])])

    def report() -> RunReport:
        merged = executors[0].report if len(executors) == 1 else RunReport.merge(
            [e.report for e in executors], [e.name for e in executors])
        merged.skipped_inputs = len(skipped)
        return merged

    try:
        run_workers(options.targets, make_executor, queue, options.prefetch, stop)
    except BatchOutOfMemoryError as exc:
        _close(writers, bar)
        if isinstance(sink, MemorySink):
            sink.gather = False  # this rank's rows: gathering is a collective the other ranks are not in
        exc.partial = sink.result(queue.count, report=report(), failed=failed())
        raise
    finally:
        stop.set()
        _close(writers, bar)  # the rows buffered are committed, after an error or Ctrl-C too
    return report(), failed()


def _close(writers: list, bar: Any) -> None:
    while writers:
        writers.pop().close()
    if bar is not None:
        bar.close()


def _progress_bar(queue: BatchQueue) -> Any:
    """The run's ``tqdm`` bar over the rows that run now (those already stored left out)."""
    from tqdm.auto import tqdm

    total = queue.total_rows
    if total is not None and queue.done is not None:
        total = max(0, total - int(queue.done.sum()))
    return tqdm(total=total, unit="row", desc="dynabatch", dynamic_ncols=True)

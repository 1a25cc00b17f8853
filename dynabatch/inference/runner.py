"""``run``: call a model on every batch, recover from out-of-memory errors, get rows back in input order.

One path, read top to bottom in :func:`run`: the options are resolved or
refused (:mod:`~dynabatch.inference.options`); the source hands out batches
(:mod:`~dynabatch.inference.source`); the sink, in memory or a results store,
is opened and checked before any row is written (:mod:`~dynabatch.inference.sink`);
the executor runs the batches on each device or rank, splitting on
out-of-memory errors and cutting rows by the row rule
(:mod:`~dynabatch.inference.execute`, :mod:`~dynabatch.inference.outputs`);
the sink assembles the result.

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

    ``fn`` is called as it is: wrap the call in ``torch.no_grad()`` (or
    ``torch.inference_mode()``) yourself for inference. ``docs/inference.md``
    has every rule below as a table, with examples.

    Args:
        fn: takes a :class:`~dynabatch.data.collate.Batch`, returns its rows' results, which the row rule
            (:mod:`dynabatch.inference.outputs`) splits into one result per row: a batch-first tensor gives each
            row its slice (a tuple, list or dict (``ModelOutput``) of them: a tuple, list or dict per row; values
            without a batch dimension, such as a loss, are left out); a
            :class:`~dynabatch.inference.outputs.PerRow` or a list of one non-tensor item per row is one item per
            row; ``None`` gives ``None``. A tensor is cut to each row's real tokens only where that is certain
            (3-D or more with dimension 1 the batch's width) and generated ids that echo ``input_ids`` lose the
            padding; a 2-D tensor as wide as the batch is ambiguous and refused at the first batch (see
            ``token_outputs``). Tensors come back detached, on the CPU.
        loader: a DataLoader from :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader` (its
            batches are built here, from its plan, so they can be split, re-sized or shared before their tensors
            exist), or any iterable of :class:`~dynabatch.data.collate.Batch` (``.indices`` required).
        make_fn: with ``devices``: ``make_fn(device)`` returns the ``fn`` for that device (say, a model copy
            moved there); called once per device, in that device's worker thread.
        devices: run on several devices at once (``["cuda:0", "cuda:1"]``), a worker thread each, taking the
            next batch from one shared queue (longest first), each measuring its own memory under its own first
            batch and splitting only its own batches. A worker whose ``fn`` raises stops and its unfinished rows
            go back to the queue once; rows that fail a second worker raise.
        device: where to move each batch (``batch.to(device)``) before ``fn``; ``None`` leaves it.
        memory: how memory bounds the batches (:mod:`dynabatch.inference.options`). ``"measured"``: each
            batch's peak is measured (CUDA allocator statistics; on the CPU a storage tracker, only on calls
            whose peak could let later batches grow) and a dynabatch loader's batches not yet run are re-sized
            so that none exceeds 0.9 of the first batch's peak (with a ``memory_model``, the model is refined
            and sizes them at ``1 - memory_margin`` of its budget); batches run longest first. ``"guarded"``:
            batches run in their own order and one the measured peaks bound above the first batch's peak is
            split into equal parts before it runs. ``"record"``: batches run as they come, every call's peak
            recorded in the report. ``"off"``: nothing measured. ``"auto"``: measured for a dynabatch loader in
            plan order (not shuffled, not in lockstep), else guarded; off where memory cannot be measured.
        ranks: under ``torch.distributed``: ``"lockstep"`` (every rank the same number of calls of ``fn`` per
            batch, so collectives inside ``fn``, FSDP or tensor parallelism, stay matched; a rank with nothing
            left in a round repeats one row it ran and drops the result; the plan, the same on every rank, is
            shared by :mod:`dynabatch.sampling.ranks`), ``"claim"`` (no collectives in ``fn``: ranks claim
            chunks of a dynabatch loader's corpus from one atomic counter, each runs measured mode under its
            own first batch; a streaming loader's rank tokenizes only its chunks), or ``"single"`` (this process
            runs every batch). ``"auto"``: lockstep under a process group of more than one rank. Without
            ``output_path`` rank 0 gathers every row (other ranks get their own); with it every rank writes into
            the one store and reads all of it back.
        on_oom: a single row that runs out of memory on its own: ``"raise"`` a :class:`BatchOutOfMemoryError`
            (its ``.partial`` holds the rows finished), or ``"skip"`` it (``None``, in ``result.failed``).
            Larger batches are always split in halves and retried; a later batch at least as large (rows and
            width) as one that failed is split before it is tried, and later batches are planned under the
            lower limit errors teach (:class:`~dynabatch.memory.oom.OutOfMemoryLimit`).
        output_path: a directory for the results store (:mod:`dynabatch.inference.store`): Parquet shards, one
            row per input (``position``, ``id`` with the loader's ``ids=``, ``input_hash``, the output
            columns), written as rows finish, each shard whole or not at all; pandas, polars, ``datasets`` and
            ``pyarrow.dataset`` read it. A rerun with the same ``key`` runs only the rows not stored (a killed
            run resumes; more texts appended; with ids, a grown or reordered corpus). Stored rows of other
            inputs at the same positions or ids are refused before any row is written. Rows that finished are
            committed however the run ends, Ctrl-C included.
        key: with ``output_path``, what computed the rows (model, revision, settings); a rerun with another key
            is refused naming both.
        token_outputs: how a tensor as wide as the batch is read: ``"auto"`` (certain readings only; an
            ambiguous one refused), ``"per_token"`` (cut by the attention mask), ``"generated"`` (every 2-D
            integer tensor is generated ids: padding stripped, as an encoder-decoder's replies), ``"whole"``
            (nothing cut). Each field's reading is fixed at its first batch.
        pad_token_id: the pad id stripped from generated rows; ``None`` takes the loader's collator's.
        prefetch: batches built (collated; pinned on CUDA and XPU) ahead of the running one in a background
            thread; a batch a later peak re-sized is built again (``report.rebuilt_batches``). ``None``: 2, or
            0 with ``devices`` (each device's thread builds its own batches while the others run).
        progress: show a ``tqdm`` progress bar (rows/s and tokens/s).
        **deprecated: ``adapt``, ``measure_memory``, ``distributed``, ``lockstep`` of earlier versions, each
            translated with a ``DeprecationWarning`` naming the new spelling (``memory=``, ``ranks=``).

    Returns:
        A :class:`RunResult`: a list with one result per input position, plus ``.report`` and ``.failed``;
        with ``output_path`` a :class:`StoredRunResult`, the same rows read from the store. Both stack every
        row with ``.numpy()``, ``.stack()`` and ``.to_arrow()``.

    Raises:
        TypeError: a bad argument type; a loader whose batches have no ``.indices``; a result the store cannot
            hold.
        ValueError: a bad option or combination of options; an ``output_path`` holding rows of another ``key``
            or of other inputs; an ``fn`` result whose rows are ambiguous or do not match the batch's.
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
        sink = open_sink(options.output_path, key=options.key, n=queue.n_inputs, ids=plan.ids if plan is not None else None,
                         gather=options.ranks != "single", inputs_at=queue.inputs_at)
        queue.done = getattr(sink, "done", None)
        queue.read_ahead(options.prefetch)
        report, failed = _execute(queue, sink, options)
    finally:
        queue.close()
        if feed is not None:
            feed.close()
    failed = sorted([*failed, *(skipped.tolist() if options.rank == 0 else [])])  # bad inputs: rank 0 answers
    report.skipped_inputs = len(skipped)
    n = queue.n_inputs if queue.n_inputs is not None else queue.seen + 1
    if options.output_path is not None and options.ranks != "single":
        torch.distributed.barrier()  # every rank's shards are in: each rank reads the whole store
        return sink.result(n, report=report, failed=None)
    return sink.result(n, report=report, failed=failed)


def _execute(queue: BatchQueue, sink: Any, options: RunOptions) -> tuple[RunReport, list[int]]:
    """Runs the queue on every target (a worker each) into the sink; ``(report, failed positions)``.

    Every worker's writer is closed (its rows committed) however the run ends;
    ``BatchOutOfMemoryError`` gets the rows finished so far as ``.partial``.
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
        executors.append(Executor(fn, queue, writer=writers[-1], hashes=options.output_path is not None,
                                  device=target, memory_device=options.memory_devices[i], splitter=splitter,
                                  on_oom=options.on_oom, bar=bar, lockstep=options.ranks == "lockstep", stop=stop,
                                  lane=queue.lane if i == 0 else queue.new_lane(), name=names[i]))
        return executors[-1]

    try:
        run_workers(options.targets, make_executor, queue, options.prefetch, stop)
    except BatchOutOfMemoryError as exc:
        _close(writers, bar)
        if isinstance(sink, MemorySink):
            sink.gather = False  # this rank's rows: gathering is a collective the other ranks are not in
        exc.partial = sink.result(queue.n_inputs if queue.n_inputs is not None else queue.seen + 1,
                                  report=_report(executors), failed=sorted(f for e in executors for f in e.failed))
        raise
    finally:
        stop.set()
        _close(writers, bar)  # the rows buffered are committed, after an error or Ctrl-C too
    return _report(executors), [f for e in executors for f in e.failed]


def _close(writers: list, bar: Any) -> None:
    while writers:
        writers.pop().close()
    if bar is not None:
        bar.close()


def _report(executors: list[Executor]) -> RunReport:
    if len(executors) == 1:
        return executors[0].report
    return RunReport.merge([e.report for e in executors], [e.name for e in executors])


def _progress_bar(queue: BatchQueue) -> Any:
    """The run's ``tqdm`` bar over the rows that run now (those already stored left out)."""
    from tqdm.auto import tqdm

    total = queue.total_rows
    if total is not None and queue.done is not None:
        total = max(0, total - int(queue.done.sum()))
    return tqdm(total=total, unit="row", desc="dynabatch", dynamic_ncols=True)

"""``run``: call a model on every batch, recover from out-of-memory errors, get rows back in input order.

:func:`run` takes a callable and a dynabatch DataLoader (or any iterable of
:class:`~dynabatch.data.collate.Batch`), calls ``fn(batch)`` on every batch and
returns a :class:`RunResult`: a list with one result per input text, in input
order, plus a :class:`~dynabatch.inference.report.RunReport` of what each batch did.

* A batch that runs out of memory is split in halves, each trimmed to its
  longest row, and retried, down to single rows; later batches at least as
  large (rows and width) as a shape that failed are split before they are tried.
* ``output_path`` streams finished rows into a Parquet results store (a
  directory of shards, :mod:`dynabatch.inference.store`) and the result reads
  them back on demand; a rerun with the same ``key`` runs only the rows the
  store does not hold, and refuses rows stored from other inputs.
* By default no batch peaks above the first batch's peak: memory is measured
  on the device the batches run on (the allocator's statistics, free; on the
  CPU a storage tracker, measuring only the batches whose peak could let later
  ones grow), and a dynabatch loader's batches are re-sized from the measured
  peaks (measured mode: the plan is the prior, later batches bounded by the
  measured peak per row); where batches cannot be re-planned (a plain
  iterable, a shuffled loader, ``torch.distributed``) a batch the measured
  peaks bound above the first's is split before it runs (guarded mode).
  ``adapt=False`` runs the plan as it is; ``measure_memory`` records each
  batch's peak against the first's.
* Under ``torch.distributed``, every rank runs the same number of the plan's
  batches (the one routine of :mod:`dynabatch.sampling.ranks`), in lockstep;
  rank 0 gathers every result, or, with ``output_path``, every rank writes
  into the one store and reads all of it back.

The loop: :class:`~dynabatch.inference._queue.BatchQueue` hands out the next
batch, :class:`~dynabatch.inference._execute.Executor` runs it (splitting on
out-of-memory errors) and records it, and measured peaks go back to the queue's
planner.

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
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.data.collate import Batch
from dynabatch.inference._execute import Executor
from dynabatch.inference._options import (
    check_arguments,
    check_devices,
    check_run_options,
    memory_device_of,
    mode,
    progress_bar,
    world_of,
)
from dynabatch.inference._queue import BatchQueue
from dynabatch.inference._workers import PREFETCH_DEPTH, Prefetcher, run_devices
from dynabatch.inference.loader import plan_of
from dynabatch.inference.report import RunReport
from dynabatch.inference.results import BatchOutOfMemoryError, RunResult, StoredRunResult

__all__ = ["BatchOutOfMemoryError", "RunResult", "StoredRunResult", "check_run_options", "run"]

logger = logging.getLogger(__name__)

def run(
    fn: Callable[[Batch], Any],
    loader: Any,
    *,
    device: str | torch.device | None = None,
    output_path: str | os.PathLike | None = None,
    on_oom: str = "raise",
    measure_memory: bool | str | torch.device | None = None,
    progress: bool = True,
    distributed: bool | None = None,
    adapt: bool | None = None,
    pad_token_id: int | None = None,
    key: str | None = None,
    token_outputs: str = "auto",
    devices: list[str | torch.device] | None = None,
    prefetch: int = PREFETCH_DEPTH,
    lockstep: bool = True,
) -> RunResult | StoredRunResult:
    """Calls ``fn(batch)`` on every batch of ``loader`` and returns one result per input, in input order.

    ``fn`` is called as it is: wrap the call in ``torch.no_grad()`` (or
    ``torch.inference_mode()``) yourself for inference.

    Args:
        fn: takes a :class:`~dynabatch.data.collate.Batch` and returns its rows'
            results, split into rows by one written rule (the table in
            ``docs/inference.md``; :mod:`dynabatch.inference.outputs`): a
            tensor with the batch dimension first gives each row its slice; a
            tuple, list or dict (``ModelOutput``) of such tensors gives each row
            a tuple, list or dict of its slices (dict values without a batch
            dimension, such as a loss or a cache, are left out); a list of one
            item per row that are not batch-first tensors, or a
            :class:`~dynabatch.inference.outputs.PerRow`, is one item per row;
            ``None`` gives ``None``. A per-token tensor (dimension 1 equal to
            the batch's width) is cut to each row's real tokens by the attention
            mask; generated ids (a 2-D integer tensor of another width than the
            batch's, or starting with its ``input_ids``) lose the batch's
            padding. What is ambiguous (a list of as many batch-first tensors as
            rows) raises ``ValueError`` saying how to return it. Tensors come
            back detached, on the CPU.
        loader: a DataLoader from :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader`,
            or any iterable of :class:`~dynabatch.data.collate.Batch` (``.indices`` required).
            A dynabatch loader's batches are built here, in this process, from
            its plan and token store (padding only, no tokenizer call), so
            that a batch can be split or re-sized before its tensors exist:
            the loader's ``num_workers`` start no processes under ``run``.
        device: where to move each batch (``batch.to(device)``) before ``fn``; ``None`` leaves it.
        output_path: a directory to store the results in, as they finish: a
            Parquet dataset (shards of bounded size, each written whole or not
            at all) that pandas, polars, ``datasets`` and ``pyarrow.dataset``
            read as it is, one row per input: ``position``, ``id`` (with the
            loader's ``ids=``), ``input_hash`` and the output (``output``; one
            column per key of a dict; ``output_0``, ``output_1``, ... of a
            tuple). Tensors keep their dtype and shape. Rows are not kept in
            memory: the result reads them back on demand
            (:class:`StoredRunResult`), exactly as without ``output_path``.
            Running again with the same ``output_path`` and ``key`` runs only
            the rows the store does not hold, with the same plan or another
            (a killed run resumes; a lower ``batch_size`` after an
            out-of-memory error; more texts appended; with ``ids``, a grown or
            reordered corpus). Stored rows whose inputs differ from this run's
            at the same position (or id) are refused. Rows without a result
            (``on_oom="skip"``, bad inputs) are not stored, so a rerun tries
            them again. Under ``torch.distributed`` every rank writes into the
            same store and, once all have finished, reads all of it back.
        key: with ``output_path``, what computed the rows: the model, its
            revision and the settings (``"minilm@v2 mean-pool"``). A rerun
            with another key, or without a key on a store that has one (and
            the reverse), is refused naming both.
        on_oom: what to do with a single row that runs out of memory on its
            own: ``"raise"`` a :class:`BatchOutOfMemoryError`, or ``"skip"``
            it (result ``None``, position in ``result.failed``, a warning logged).
            Larger batches are always split in halves (each trimmed to its
            longest row) and retried, and a later batch with at least the rows
            and the width of a shape that ran out of memory is split before it
            is tried. Later batches are also planned (measured mode) or split
            (guarded mode) under the lower limit an error shows, which rises
            again only on measured successes (:class:`~dynabatch.memory.oom.OutOfMemoryLimit`).
            Out-of-memory errors are ``torch.OutOfMemoryError`` and each
            device's own (:func:`~dynabatch.memory.device.is_out_of_memory_error`);
            every event and split is logged and counted in the report.
        measure_memory: where each call's peak memory is measured, with
            :func:`~dynabatch.memory.measure.track_peak_memory`; the first
            measured call's peak is the report's budget. ``None`` (auto): the
            device the batches run on (``device``; else the accelerator on which a
            model holds memory; else the CPU), unless ``adapt=False``; on the
            CPU only the calls that can let later batches grow are measured
            (the tracker costs up to ~15% of a call; see ``adapt``). ``True``:
            that device, every call. A device: that device, every call.
            ``False``: nothing is measured (with ``adapt=None`` the plan runs
            as it is).
        progress: show a ``tqdm`` progress bar (rows/s and tokens/s).
        distributed: ``None`` runs distributed when ``torch.distributed`` is
            initialized with more than one process; ``True``/``False`` force it.
            Distributed: each rank runs its share of the batches (every rank
            the same number: the largest split, then dealt in steps of
            neighbouring batches, as every dynabatch sampler deals) and rank 0
            gathers every result; other ranks get only their own rows (``None``
            elsewhere). With ``output_path`` nothing is gathered: every rank
            writes its rows into the store and, after a barrier, every rank's
            result reads the whole store. The ranks run in lockstep: every rank makes the same
            number of calls of ``fn`` per batch, so collectives inside ``fn``
            (FSDP, tensor parallelism) stay matched even when a rank splits a
            batch that ran out of memory (it retries at once; a rank with
            nothing left in a round calls ``fn`` on one row it already ran and
            drops the result). That holds when the error strikes before ``fn``'s
            first collective of the call; one raised between collectives leaves
            the other ranks inside a collective no call can match. Every rank
            must be given the same, whole loader (a per-rank share is refused on
            every rank). Under ``accelerate`` pass the loader as it is; one passed
            through ``Accelerator.prepare`` is unwrapped, its whole plan shared once.
        adapt: ``None`` (auto, the default) keeps every batch at or under the
            first batch's measured peak whenever memory is measured (see
            ``measure_memory``): measured mode for a dynabatch loader in plan
            order in one process; guarded mode for a plain iterable of batches,
            a shuffled loader, or under ``torch.distributed``, where batches
            cannot be re-planned. ``True``: measured mode, every call measured.
            ``False``: the batches as they come (a dynabatch loader's plan as
            is: the classifier's estimate, which large-vocabulary ``generate``
            calls can exceed; ``measure_memory`` then only records peaks).

            Measured mode (needs a dynabatch loader, one process): the batches
            not yet run are re-sized by the loader's planner so that, bounded
            by the measured peak per row of batches at least as wide (a bound,
            since rows only get shorter), they stay at or under 0.9 of the
            first batch's: smaller than planned after a spike, larger where the
            plan leaves memory unused (see :mod:`dynabatch.memory.feedback`).
            With a loader planned by a ``memory_model``, the model is refined by
            every measured peak and sizes the batches at ``1 - memory_margin``
            of the budget; save it afterwards (``memory_model.save(path)``) so
            the next job on the same model starts calibrated. A batch split
            after running out of memory counts by its parts: the largest peak
            that fitted (the budget, if it was the first batch) and each part's
            rows at its width. Batches run longest first.

            Guarded mode: the batches run in their own order; a call whose
            rows exceed what the measured calls at least as wide keep at or
            under the first call's peak (``rows x`` their peak per row, or
            their peak for fewer rows) is split into equal parts before it
            runs (``pre_split`` in the report). A plain iterable's first batch
            is its budget, and a batch wider than every call measured so far
            runs as it comes (sort batches longest first to be covered). Under
            ``torch.distributed`` each rank's budget is its own first call's
            peak, that call capped at the plan's first-batch rows (so at most
            the plan's first batch's peak); splitting stays in lockstep.
        pad_token_id: the pad id stripped from generated rows (see ``fn``);
            ``None`` takes the loader's collator's (a dynabatch loader always
            has one). Give it for a plain iterable of batches whose ``generate``
            rows should lose their padding.
        token_outputs: how token-shaped tensors are read: ``"auto"`` (the rule
            under ``fn``), ``"per_token"`` (never generated ids: a 2-D integer
            tensor as wide as the batch, such as tags, is cut by the attention
            mask), ``"generated"`` (every 2-D integer tensor is generated ids,
            say an encoder-decoder's replies that may be as wide as the batch),
            or ``"whole"`` (nothing is cut: rows as the batch padded them).
            Each field's reading is fixed at its first batch and kept for the
            run; a later output that contradicts it raises ``ValueError``.
        devices: run on several devices at once (``["cuda:0", "cuda:1"]``):
            ``fn`` is then ``make_fn``, called once per device in that device's
            worker thread as ``make_fn(device)``, returning the ``fn(batch)``
            for that device (say, a model copy moved there). The workers take
            the next batch from one shared queue, longest first, so no device
            idles while work remains; each measures its own peaks against its
            own first batch (measured mode per device: GPUs of different sizes
            work), and an out-of-memory error splits only its own batch. A
            worker whose ``fn`` raises stops and its batch goes back to the
            queue once; a batch that fails on a second worker raises. Results
            land in input order (one store with ``output_path``), the report
            tags each batch with its device. Threads, not processes: no
            ``__main__`` guard, works in a notebook. Not with ``device`` nor
            under ``torch.distributed``.
        prefetch: batches built (collated; pinned, on CUDA and XPU) ahead of
            the running one in a background thread, so the device does not
            wait for the host; 0 builds each when it runs. In measured mode a
            batch built ahead that a later peak re-sized is built again, not
            run stale (``report.rebuilt_batches``). With ``devices``, every
            device's thread builds its own batches beside the others' calls.
        lockstep: under ``torch.distributed``, ``True`` runs the ranks in
            lockstep (see ``distributed``: for an ``fn`` with collectives, such
            as FSDP or tensor parallelism). ``False`` is for an ``fn`` without
            collectives (a model copy per rank): the ranks claim chunks of the
            corpus from one atomic counter in ``torch.distributed``'s store,
            each chunk by one rank, whichever asks first, so no rank waits for
            another; a streaming loader's rank tokenizes only the chunks it
            claims. Each rank runs measured mode on its own device, under its
            own first batch's peak. With ``output_path`` every rank writes into
            the one store and nothing is gathered; without it rank 0 gathers
            every result. Needs a dynabatch loader, the same on every rank.

    Returns:
        A :class:`RunResult`: a list with one result per input position, plus
        ``.report`` and ``.failed``; with ``output_path`` a
        :class:`StoredRunResult`, the same rows read from the store. Both stack
        every row with ``.numpy()``, ``.stack()`` and ``.to_arrow()``.

    Raises:
        TypeError: a bad argument type, a loader whose batches have no
            ``.indices``, or (with ``output_path``) a result Arrow cannot store
            (raised at the first batch that returns it).
        ValueError: a bad ``on_oom``; an ``output_path`` holding results of
            another ``key``, of other inputs at the same positions or ids, or a
            JSONL results file of earlier versions; ``fn`` results that do not
            match the batch's rows.
        BatchOutOfMemoryError: with ``on_oom="raise"``, a single row that ran out of memory.
    """
    check_arguments(fn, device, output_path, on_oom, measure_memory, progress, distributed, adapt, pad_token_id,
                    key, token_outputs, prefetch, lockstep)
    rank, world_size, distributed = world_of(distributed)
    targets = check_devices(devices, device, distributed, measure_memory)
    memory_device = memory_device_of(measure_memory, adapt, device if targets is None else targets[0])
    plan = plan_of(loader)
    in_lockstep = distributed and lockstep
    if distributed and not lockstep and plan is None:
        raise bad_value("lockstep", "True for a loader that is not a dynabatch DataLoader (ranks claim chunks of "
                        "a dynabatch loader's plan)", lockstep)
    adapt, guard, sparse = mode(plan, adapt, measure_memory, memory_device, in_lockstep)
    queue = BatchQueue(loader, plan, pad_token_id, adapt=adapt, guard=guard, sparse=sparse)
    if adapt and in_lockstep:
        raise bad_value("adapt", "False under torch.distributed in lockstep (each rank's share is fixed up front; "
                        "lockstep=False re-sizes per rank)", adapt)
    if in_lockstep:
        from dynabatch.inference.distributed import check_same_batches

        queue.materialize()
        check_same_batches([i.positions for i in queue.pending])
    store = _open_store(output_path, key, queue, plan) if output_path is not None else None  # every input's rows
    feed = None
    if in_lockstep:
        queue.shard(rank, world_size)
    elif distributed:
        from dynabatch.inference.distributed import claimed_planner

        claimed, feed = claimed_planner(plan)
        queue.use_planner(claimed, adapt=adapt)
    bar = progress_bar(loader, queue, store) if progress else None
    options = {"on_oom": on_oom, "bar": bar, "store": store, "token_outputs": token_outputs,
               "skipped": plan.skipped if plan is not None else None}
    if targets is not None:
        return _run_devices(fn, targets, queue, options, measure_memory, adapt)
    executor = Executor(fn, queue, device=device, memory_device=memory_device, lockstep=in_lockstep, rank=rank,
                        **options)
    # Without a store under torch.distributed: every input position this rank answers for (gathered to rank 0).
    mine = np.zeros(queue.n_inputs or 0, dtype=bool) if distributed and store is None else None
    if mine is not None and rank == 0 and plan is not None:
        mine[plan.skipped] = True  # bad inputs run on no rank: rank 0 answers for them (None, failed)
    prefetcher = Prefetcher(executor, depth=prefetch)
    try:
        while (got := prefetcher.next()) is not None:
            item, batch = got
            if mine is not None:
                mine[item.positions] = True
            queue.observe_item(item, executor.run_item(item, batch), executor.lane)
    finally:
        prefetcher.close()
        if feed is not None:
            feed.close()
        executor.report.rebuilt_batches = prefetcher.rebuilt
        if bar is not None:
            bar.close()
        executor.close()  # the rows still buffered are committed, after an error too
    if store is None:
        if not distributed:
            return executor.result()
        from dynabatch.inference.distributed import gather_run_result

        return gather_run_result(executor.result(), mine, queue.n_inputs)
    if distributed:
        torch.distributed.barrier()  # every rank's shards are in: each rank reads the whole store
        return executor.result(failed=None)
    return executor.result(failed=executor.failed)


def _open_store(output_path: Any, key: str | None, queue: BatchQueue, plan: Any) -> Any:
    """The results store of ``output_path`` for this run, its stored rows checked against this run's inputs before
    any row is written: a dynabatch loader's inputs hashed from its token store (a streamed one tokenized whole
    first, only when the store holds rows); a plain iterable's from its batches, read once more before the run only
    when the store holds rows (whole, when it is a one-shot iterator)."""
    from dynabatch.data.input_hashes import batch_input_hashes, token_store_hashes
    from dynabatch.inference._queue import positions_of
    from dynabatch.inference.store import open_store

    store = open_store(output_path, key=key, n=queue.n_inputs, ids=plan.ids if plan is not None else None)
    if not store.done.any():
        return store
    if plan is not None:
        tokenized = plan.stream.tokenized if plan.stream is not None else plan.collator.tokenized
        store.check_inputs(np.arange(queue.n_inputs), token_store_hashes(tokenized))
        return store
    if queue.stream is not None and isinstance(queue.loader, Iterator):
        queue.materialize()  # a one-shot iterator can be read only once
    batches = (i.batch for i in queue.pending) if queue.stream is None else iter(queue.loader)
    positions, hashes = [], []
    for batch in batches:
        positions.append(positions_of(batch, queue.loader))
        hashes.append(batch_input_hashes(batch))
    positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    if queue.n_inputs is None:
        queue.n_inputs = int(positions.max()) + 1 if positions.size else 0
    store = open_store(output_path, key=key, n=queue.n_inputs)
    store.check_inputs(positions, np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64))
    return store


def _run_devices(make_fn: Callable[[Any], Callable[[Batch], Any]], targets: list[torch.device], queue: BatchQueue,
                 options: dict, measure_memory: Any, adapt: bool) -> RunResult | StoredRunResult:
    """Runs the queue on every device of ``targets`` at once; one result over every device's rows."""
    executors: list[Executor | None] = [None] * len(targets)

    def make_executor(target: torch.device, i: int) -> Executor:
        fn = make_fn(target)
        if not callable(fn):
            raise bad_type("make_fn", f"a callable returning fn(batch) for a device (make_fn({str(target)!r}) "
                           "returned no callable)", fn)
        executors[i] = Executor(fn, queue, device=target, memory_device=memory_device_of(measure_memory, adapt, target),
                                rank=f"{target.type}{i}", lane=queue.new_lane(), **options)
        return executors[i]

    try:
        run_devices(targets, make_executor, queue)
    finally:
        if options["bar"] is not None:
            options["bar"].close()
        for executor in executors:
            if executor is not None:
                executor.close()
    running = [e for e in executors if e is not None]
    names = [str(t) for t in targets]
    names = [f"{n} (worker {i})" if names.count(n) > 1 else n for i, n in enumerate(names)]  # ["cpu", "cpu"]
    report = RunReport.merge([e.report for e in running], [n for n, e in zip(names, executors) if e])
    failed = sorted(set().union(*(e.failed for e in running)))
    n = queue.n_inputs if queue.n_inputs is not None else max(e.last_position for e in running) + 1
    if options["store"] is not None:
        return options["store"].result(n, report=report, failed=failed)
    values: list[Any] = [None] * n
    for executor in running:
        for position, value in executor.results.items():
            values[position] = value
    return RunResult(values, report=report, failed=failed)

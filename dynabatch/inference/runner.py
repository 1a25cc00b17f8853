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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_non_negative_int
from dynabatch.data.collate import Batch
from dynabatch.inference._execute import Executor
from dynabatch.inference._queue import BatchQueue
from dynabatch.inference.loader import LoaderPlan, plan_of
from dynabatch.inference.outputs import check_token_outputs
from dynabatch.inference.results import BatchOutOfMemoryError, RunResult, StoredRunResult
from dynabatch.memory.device import device_in_use, measurable
from dynabatch.memory.measure import check_device, check_measurable_device

__all__ = ["BatchOutOfMemoryError", "RunResult", "StoredRunResult", "run"]

logger = logging.getLogger(__name__)

_ON_OOM = ("raise", "skip")


def check_run_options(device: Any, on_oom: Any, measure_memory: Any, adapt: Any) -> None:
    """Checks the options that say how :func:`run` runs the batches (also given ahead, as to a Ray predictor)."""
    if adapt is not None and not isinstance(adapt, bool):
        raise bad_type("adapt", "None (auto), True or False", adapt)
    if device is not None:
        check_device("device", device, "None, a str or a torch.device")
    if not isinstance(on_oom, str):
        raise bad_type("on_oom", f"one of {_ON_OOM}", on_oom)
    if on_oom not in _ON_OOM:
        raise bad_value("on_oom", f"one of {_ON_OOM}", on_oom)
    if measure_memory is not None and not isinstance(measure_memory, (bool, str, torch.device)):
        raise bad_type("measure_memory", "None (auto), a bool, or the device to measure (a str or torch.device)",
                       measure_memory)
    if isinstance(measure_memory, (str, torch.device)):
        check_measurable_device("measure_memory", measure_memory)


def _check_arguments(
    fn: Any, device: Any, output_path: Any, on_oom: Any, measure_memory: Any, progress: Any, distributed: Any,
    adapt: Any = None, pad_token_id: Any = None, key: Any = None, token_outputs: Any = "auto",
) -> None:
    if not callable(fn):
        raise bad_type("fn", "a callable taking a batch", fn)
    if isinstance(fn, torch.nn.Module) and isinstance(getattr(fn, "main_input_name", None), str):
        # A Hugging Face model takes tensors as keywords: model(batch) would fail inside its forward.
        raise bad_type("fn", "a callable taking a dynabatch.Batch (a dict of tensors), such as "
                       "lambda batch: model(**batch) or lambda batch: model.generate(**batch)", fn)
    check_run_options(device, on_oom, measure_memory, adapt)
    if output_path is not None and not isinstance(output_path, (str, os.PathLike)):
        raise bad_type("output_path", "None, a str or an os.PathLike (a directory for the results store)", output_path)
    if key is not None and not isinstance(key, str):
        raise bad_type("key", "None or a str naming the model, revision and settings", key)
    if key is not None and output_path is None:
        raise bad_value("key", "None without output_path (it identifies the results stored there)", key)
    if not isinstance(progress, bool):
        raise bad_type("progress", "a bool", progress)
    if distributed is not None and not isinstance(distributed, bool):
        raise bad_type("distributed", "None (auto), True or False", distributed)
    if pad_token_id is not None:
        check_non_negative_int("pad_token_id", pad_token_id)
    check_token_outputs(token_outputs)


def _memory_device(measure_memory: Any, adapt: bool | None, device: Any) -> Any:
    """The device to measure each call's peak on, or ``None`` (measured mode always measures; ``None`` is auto:
    the device the batches run on, unless ``adapt=False``)."""
    if adapt and measure_memory is False:
        measure_memory = True
    if measure_memory is False or (measure_memory is None and adapt is False):
        return None
    if measure_memory is not True and measure_memory is not None:
        return measure_memory
    target = _running_device(device)
    if measure_memory is None and (target is None or not measurable(target)):
        logger.info("run: batches run on %s, whose memory cannot be measured: they run as planned", device)
        return None
    return device if target is None else target


def _running_device(device: Any) -> torch.device | None:
    """Where the batches run: ``device`` (``None`` if torch cannot parse it), else the accelerator on which a model
    holds memory, else the CPU."""
    if device is not None:
        try:
            return torch.device(device)
        except RuntimeError:
            return None  # batch.to(device) names the error when the first batch runs
    return device_in_use() or torch.device("cpu")


def _mode(plan: LoaderPlan | None, adapt: bool | None, measure_memory: Any, memory_device: Any,
          distributed: bool) -> tuple[bool, bool, bool]:
    """``(adapt, guard, sparse)``: measured mode, guarded mode, and whether to measure only some calls.

    ``adapt=None`` (auto) with a device to measure: measured mode for a dynabatch
    loader in plan order in one process, guarded mode otherwise. ``sparse``:
    auto on the CPU (the tracker's cost), where a call the bound already covers
    runs unmeasured.
    """
    if adapt is not None or memory_device is None:
        return bool(adapt), False, False
    replannable = plan is not None and not distributed and not getattr(plan.sampler, "shuffle", False)
    sparse = measure_memory is None and torch.device(memory_device).type == "cpu"
    logger.info("run: %s, measuring %s on %s", "measured mode (batches re-sized from measured peaks)" if replannable
                else "guarded mode (batches split where measured peaks bound them above the first's)",
                "only calls that can let batches grow" if sparse else "every call", memory_device)
    return replannable, not replannable, sparse


def _world(distributed: bool | None) -> tuple[int, int, bool]:
    """``(rank, world_size, distributed)``: distributed only under a process group of more than one rank."""
    if distributed is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed:
        return 0, 1, False
    from dynabatch.inference.distributed import world

    rank, world_size = world()
    return rank, world_size, world_size > 1


def _progress_bar(loader: Any, queue: BatchQueue, store: Any) -> Any:
    from tqdm.auto import tqdm

    total = sum(len(i.positions) for i in queue.pending) if queue.stream is None else queue.n_inputs
    if queue.planner is not None:
        total = queue.total_rows
    if total is None:
        try:
            total = len(loader.dataset) or None
        except (AttributeError, TypeError):
            total = None
    if total is not None and store is not None:
        total = max(0, total - int(store.done.sum()))  # the bar counts the rows that run now
    return tqdm(total=total, unit="row", desc="dynabatch", dynamic_ncols=True)


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
    _check_arguments(fn, device, output_path, on_oom, measure_memory, progress, distributed, adapt, pad_token_id,
                     key, token_outputs)
    memory_device = _memory_device(measure_memory, adapt, device)
    rank, world_size, distributed = _world(distributed)
    plan = plan_of(loader)
    adapt, guard, sparse = _mode(plan, adapt, measure_memory, memory_device, distributed)
    queue = BatchQueue(loader, plan, pad_token_id, adapt=adapt, guard=guard, sparse=sparse)
    if adapt and distributed:
        raise bad_value("adapt", "False under torch.distributed (each rank's share is fixed up front)", adapt)
    if distributed:
        from dynabatch.inference.distributed import check_same_batches

        queue.materialize()
        check_same_batches([i.positions for i in queue.pending])
    if output_path is not None:
        from dynabatch.inference.store import open_store
    store = open_store(output_path, key, queue, plan) if output_path is not None else None  # every input's rows
    if distributed:
        queue.shard(rank, world_size)
    bar = _progress_bar(loader, queue, store) if progress else None
    executor = Executor(fn, queue, device=device, on_oom=on_oom, memory_device=memory_device, bar=bar,
                        lockstep=distributed, store=store, rank=rank, skipped=plan.skipped if plan is not None else None,
                        token_outputs=token_outputs)
    # Without a store under torch.distributed: every input position this rank answers for (gathered to rank 0).
    mine = np.zeros(queue.n_inputs or 0, dtype=bool) if distributed and store is None else None
    if mine is not None and rank == 0 and plan is not None:
        mine[plan.skipped] = True  # bad inputs run on no rank: rank 0 answers for them (None, failed)
    try:
        while (item := queue.next_item()) is not None:
            if mine is not None:
                mine[item.positions] = True
            todo = executor.skip_done(item)  # rows a resumed run already has
            if todo is not None:
                queue.observe_item(todo, executor.run_item(todo))
            else:
                executor.join_step(item)
    finally:
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

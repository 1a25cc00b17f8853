"""The options of :func:`dynabatch.run`: their checks, and the mode and devices they choose."""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_non_negative_int
from dynabatch.inference.loader import LoaderPlan
from dynabatch.inference.outputs import check_token_outputs
from dynabatch.memory.device import device_in_use, measurable
from dynabatch.memory.measure import check_device, check_measurable_device

logger = logging.getLogger("dynabatch.inference.runner")  # what run() logs, under run's own name

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


def check_arguments(
    fn: Any, device: Any, output_path: Any, on_oom: Any, measure_memory: Any, progress: Any, distributed: Any,
    adapt: Any = None, pad_token_id: Any = None, key: Any = None, token_outputs: Any = "auto", prefetch: Any = 0,
    lockstep: Any = True,
) -> None:
    """Checks :func:`dynabatch.run`'s arguments (``fn`` is ``make_fn`` with several devices)."""
    if not callable(fn):
        raise bad_type("fn", "a callable taking a batch", fn)
    if isinstance(fn, torch.nn.Module) and isinstance(getattr(fn, "main_input_name", None), str):
        # A Hugging Face model takes tensors as keywords: model(batch) would fail inside its forward.
        raise bad_type("fn", "a callable taking a dynabatch.Batch (a dict of tensors), such as "
                       "lambda batch: model(**batch) or lambda batch: model.generate(**batch)", fn)
    check_run_options(device, on_oom, measure_memory, adapt)
    check_store_arguments(output_path, key)
    if not isinstance(progress, bool):
        raise bad_type("progress", "a bool", progress)
    if distributed is not None and not isinstance(distributed, bool):
        raise bad_type("distributed", "None (auto), True or False", distributed)
    if pad_token_id is not None:
        check_non_negative_int("pad_token_id", pad_token_id)
    check_token_outputs(token_outputs)
    check_non_negative_int("prefetch", prefetch)
    if not isinstance(lockstep, bool):
        raise bad_type("lockstep", "a bool", lockstep)


def check_store_arguments(output_path: Any, key: Any) -> None:
    """Refuses a bad ``output_path`` (a directory for the results store; not what earlier versions wrote, a JSONL
    file or per-rank JSONL files, nor a path meant for them) or ``key`` (a str, only with a store)."""
    if output_path is not None and not isinstance(output_path, (str, os.PathLike)):
        raise bad_type("output_path", "None, a str or an os.PathLike (a directory for the results store)", output_path)
    root, ext = os.path.splitext(os.fspath(output_path)) if output_path is not None else ("", "")
    ranks = sorted(os.path.basename(r) for r in glob.glob(glob.escape(root) + ".rank*-of-*" + glob.escape(ext))) \
        if ext else []
    what = ("a file of JSONL results written by an earlier dynabatch" if ext.lower() == ".jsonl" else "a file") \
        if output_path is not None and os.path.isfile(output_path) else f"per-rank JSONL files ({', '.join(ranks)})" \
        if ranks else f"a path ending in {ext}" if ext.lower() in (".jsonl", ".json") else None
    if what is not None:
        raise ValueError(f"output_path should be a directory for a Parquet results store (say 'results/'), but got "
                         f"output_path={os.fspath(output_path)!r}, {what}: results are now stored as Parquet shards "
                         "with a key; pass a new directory (rerunning there recomputes the rows: a JSONL file cannot "
                         "tell which model made it)")
    if key is not None and not isinstance(key, str):
        raise bad_type("key", "None or a str naming the model, revision and settings", key)
    if key is not None and output_path is None:
        raise bad_value("key", "None without output_path (it identifies the results stored there)", key)


def memory_device_of(measure_memory: Any, adapt: bool | None, device: Any) -> Any:
    """The device to measure each call's peak on, or ``None`` (measured mode always measures; ``None`` is auto:
    the device the batches run on, unless ``adapt=False``)."""
    if adapt and measure_memory is False:
        measure_memory = True
    if measure_memory is False or (measure_memory is None and adapt is False):
        return None
    if measure_memory is not True and measure_memory is not None:
        return measure_memory
    target = running_device(device)
    if measure_memory is None and (target is None or not measurable(target)):
        logger.info("run: batches run on %s, whose memory cannot be measured: they run as planned", device)
        return None
    return device if target is None else target


def running_device(device: Any) -> torch.device | None:
    """Where the batches run: ``device`` (``None`` if torch cannot parse it), else the accelerator on which a model
    holds memory, else the CPU."""
    if device is not None:
        try:
            return torch.device(device)
        except RuntimeError:
            return None  # batch.to(device) names the error when the first batch runs
    return device_in_use() or torch.device("cpu")


def mode(plan: LoaderPlan | None, adapt: bool | None, measure_memory: Any, memory_device: Any,
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


def world_of(distributed: bool | None) -> tuple[int, int, bool]:
    """``(rank, world_size, distributed)``: distributed only under a process group of more than one rank."""
    if distributed is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed:
        return 0, 1, False
    from dynabatch.inference.distributed import world

    rank, world_size = world()
    return rank, world_size, world_size > 1


def check_devices(devices: Any, device: Any, distributed: bool, measure_memory: Any) -> list[torch.device] | None:
    """``devices`` as ``torch.device`` s (``None`` for one device): a list of at least one, none with ``device``,
    a device to measure, or ``torch.distributed``; an accelerator at most once (its peak statistics are its own)."""
    if devices is None:
        return None
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, (list, tuple)):
        raise bad_type("devices", "None or a list of devices (['cuda:0', 'cuda:1'])", devices)
    if not devices:
        raise bad_value("devices", "None or a list of at least one device", devices)
    if device is not None:
        raise bad_value("device", "None when devices is given (each device's batches move to it)", device)
    if distributed:
        raise bad_value("devices", "None under torch.distributed (each rank runs on its own device)", devices)
    if measure_memory is not None and not isinstance(measure_memory, bool):
        raise bad_value("measure_memory", "None, True or False when devices is given (each device measures its "
                        "own memory)", measure_memory)
    parsed = []
    for i, d in enumerate(devices):
        parsed.append(check_device(f"devices[{i}]", d, "a str or torch.device"))
    accelerators = [str(d) for d in parsed if d.type != "cpu"]
    if len(set(accelerators)) < len(accelerators):
        raise bad_value("devices", "a list naming each accelerator once, with its index (its memory statistics "
                        "are its own)", devices)
    return parsed


def progress_bar(loader: Any, queue: Any, store: Any) -> Any:
    """The run's ``tqdm`` bar over the rows that run now (the stored ones left out)."""
    from tqdm.auto import tqdm

    if queue.plan is not None:
        total = queue.total_rows  # None for a rank's claimed share
    else:
        total = sum(len(i.positions) for i in queue.pending) if queue.stream is None else None
    if total is None and queue.plan is None:
        try:
            total = len(loader.dataset) or None
        except (AttributeError, TypeError):
            total = None
    if total is not None and store is not None:
        total = max(0, total - int(store.done.sum()))  # the bar counts the rows that run now
    return tqdm(total=total, unit="row", desc="dynabatch", dynamic_ncols=True)

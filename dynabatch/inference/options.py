"""The options of :func:`dynabatch.run`, resolved or refused in one place: :func:`resolve_options`.

Each option says one thing and no option silently changes what another says: what a combination cannot mean is
refused here, before any batch runs, naming the options and what to do.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_bool, check_choice, check_non_negative_int
from dynabatch.inference.outputs import TOKEN_OUTPUTS
from dynabatch.memory.device import device_in_use, measurable
from dynabatch.memory.measure import check_device

__all__ = ["MEMORY_MODES", "ON_ERROR", "ON_OOM", "RANKS", "RunOptions", "check_run_options", "check_store_arguments",
           "resolve_options"]

logger = logging.getLogger("dynabatch.inference.runner")  # what run() logs, under run's own name

# The values of run()'s memory=, ranks=, on_oom= and on_error=.
MEMORY_MODES = ("auto", "measured", "guarded", "record", "off")
RANKS = ("auto", "lockstep", "claim", "single")
ON_OOM = ("raise", "skip")
ON_ERROR = ("raise", "skip")
PREFETCH_DEPTH = 2
"""Batches built ahead of the one running (one device): enough to hide collation, few enough to bound host memory."""


@dataclass(frozen=True)
class RunOptions:
    """What :func:`resolve_options` decided, every field final: ``memory`` (measured, guarded, record or off),
    ``sparse`` (measure only calls that can let batches grow: the CPU tracker's cost), ``ranks`` (single, lockstep or
    claim), ``targets`` (a worker's device each; ``None`` leaves batches where they are built) and
    ``memory_devices`` (where each measures; ``None``: not), ``make_fn`` (one device: returns ``fn``)."""

    memory: str
    sparse: bool
    ranks: str
    rank: int
    world_size: int
    targets: tuple
    memory_devices: tuple
    make_fn: Callable[[Any], Callable]
    prefetch: int
    on_oom: str
    on_error: str
    token_outputs: str
    pad_token_id: int | None
    output_path: Any  # a path, or the store opened for the run
    key: str | None
    progress: bool


def check_store_arguments(output_path: Any, key: Any) -> None:
    """Refuses a bad ``output_path`` (a directory for the results store, or the store opened for the run; not a
    JSONL file nor per-rank JSONL files as earlier versions wrote, nor a path meant for them) or ``key`` (a str, only
    with a store)."""
    from dynabatch.inference.store import Store

    if isinstance(output_path, Store):
        return
    if output_path is not None and not isinstance(output_path, (str, os.PathLike)):
        raise bad_type("output_path", "None, a str or an os.PathLike (a directory for the results store), or the "
                       "store opened for the run (open_store)", output_path)
    if output_path is not None:
        _refuse_jsonl(os.path.expanduser(os.fspath(output_path)))
    if key is not None and not isinstance(key, str):
        raise bad_type("key", "None or a str naming the model, revision and settings", key)
    if key is not None and output_path is None:
        raise bad_value("key", "None without output_path (it identifies the results stored there)", key)


def _refuse_jsonl(path: str) -> None:
    root, ext = os.path.splitext(path)
    ranks = sorted(os.path.basename(r) for r in glob.glob(glob.escape(root) + ".rank*-of-*" + glob.escape(ext))) \
        if ext else []
    if os.path.isfile(path):
        what = "a file of JSONL results written by an earlier dynabatch" if ext.lower() == ".jsonl" else "a file"
    elif ranks:
        what = f"per-rank JSONL files ({', '.join(ranks)})"
    elif ext.lower() in (".jsonl", ".json"):
        what = f"a path ending in {ext}"
    else:
        return
    raise ValueError(f"output_path should be a directory for a Parquet results store (say 'results/'), but got "
                     f"output_path={path!r}, {what}: results are now stored as Parquet shards with a key; pass a "
                     "new directory (rerunning there recomputes the rows: a JSONL file cannot tell which model made "
                     "it)")


def check_run_options(device: Any = None, on_oom: Any = "raise", memory: Any = "auto", on_error: Any = "raise") -> None:
    """Checks the options that say how batches run (also given ahead, as to a Ray predictor)."""
    check_choice("memory", memory, MEMORY_MODES)
    check_choice("on_oom", on_oom, ON_OOM)
    check_choice("on_error", on_error, ON_ERROR)
    if device is not None:
        check_device("device", device, "None, a str or a torch.device")


def resolve_options(fn: Any, loader: Any, plan: Any, *, make_fn: Any, devices: Any, device: Any, memory: Any,
                    ranks: Any, on_oom: Any, on_error: Any, output_path: Any, key: Any, token_outputs: Any,
                    pad_token_id: Any, prefetch: Any, progress: Any) -> RunOptions:
    """Every option of :func:`dynabatch.run` checked and resolved (``plan``: the loader's ``LoaderPlan`` or ``None``).

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option's value, or a combination no run can honour.
    """
    make_fn = _resolve_fn(fn, make_fn, devices)
    if plan is None and (isinstance(loader, (str, bytes, dict)) or not isinstance(loader, Iterable)):
        raise bad_type("loader", "a dynabatch DataLoader or an iterable of dynabatch Batches", loader)
    check_run_options(device, on_oom, memory, on_error)
    check_choice("ranks", ranks, RANKS)
    check_store_arguments(output_path, key)
    check_choice("token_outputs", token_outputs, TOKEN_OUTPUTS)
    check_bool("progress", progress)
    if pad_token_id is not None:
        check_non_negative_int("pad_token_id", pad_token_id)
    if prefetch is not None:
        check_non_negative_int("prefetch", prefetch)
    rank, world_size, ranks = _resolve_ranks(ranks, plan)
    targets = _resolve_targets(devices, device, ranks)
    if devices is not None and prefetch:
        raise bad_value("prefetch", "None or 0 with devices (each device's thread builds its own batches while the "
                        "other devices run theirs)", prefetch)
    if prefetch is None:
        prefetch = 0 if devices is not None else PREFETCH_DEPTH
    memory, sparse, memory_devices = _resolve_memory(memory, plan, ranks, targets)
    return RunOptions(memory, sparse, ranks, rank, world_size, targets, memory_devices, make_fn, prefetch, on_oom,
                      on_error, token_outputs, pad_token_id, output_path, key, progress)


def _resolve_fn(fn: Any, make_fn: Any, devices: Any) -> Callable[[Any], Callable]:
    """``make_fn``: given (with ``devices``), or (one device) one returning ``fn``."""
    if devices is not None and make_fn is None and fn is not None:
        raise bad_value("fn", "None with devices (fn is always fn(batch); pass make_fn=, which makes the fn of each "
                        "device: run(make_fn=make_fn, loader=loader, devices=[...]))", fn)
    if (fn is None) == (make_fn is None):
        raise bad_value("fn", "given, or make_fn given with devices (one of the two)", fn)
    if make_fn is not None:
        if not callable(make_fn):
            raise bad_type("make_fn", "a callable taking a device and returning fn(batch) for it", make_fn)
        if devices is None:
            raise bad_value("make_fn", "None without devices (pass fn for one device, or devices=[...])", make_fn)
        return make_fn
    if not callable(fn):
        raise bad_type("fn", "a callable taking a batch", fn)
    if isinstance(fn, torch.nn.Module) and isinstance(getattr(fn, "main_input_name", None), str):
        # A Hugging Face model takes tensors as keywords: model(batch) would fail inside its forward.
        raise bad_type("fn", "a callable taking a dynabatch.Batch (a dict of tensors), such as "
                       "lambda batch: model(**batch) or lambda batch: model.generate(**batch)", fn)
    return lambda _device: fn


def _resolve_ranks(ranks: str, plan: Any) -> tuple[int, int, str]:
    """``(rank, world_size, ranks)`` with ``ranks`` one of lockstep, claim or single."""
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if ranks == "single" or (ranks == "auto" and not group):
        return 0, 1, "single"
    if not group:
        raise bad_value("ranks", "'auto' or 'single' without a torch.distributed process group (initialize one, "
                        "as torchrun does, to share the batches among ranks)", ranks)
    from dynabatch.inference.distributed import world

    rank, world_size = world()
    if ranks == "auto":
        ranks = "lockstep" if world_size > 1 else "single"
    if ranks == "claim" and plan is None:
        raise bad_value("ranks", "'lockstep' or 'single' for a loader that is not a dynabatch DataLoader (ranks "
                        "claim chunks of a dynabatch loader's plan)", ranks)
    if ranks == "claim" and plan.sampler.shuffle:
        raise bad_value("ranks", "'lockstep' or 'single' for a shuffled loader (ranks claim chunks of the plan in "
                        "its planned order; build the loader with shuffle=False to claim)", ranks)
    if ranks == "lockstep" and plan is not None and plan.stream is not None:
        logger.info("run: ranks='lockstep' reads the streaming loader's whole plan first (every rank must hold the "
                    "same batches); ranks='claim' tokenizes each chunk on the rank that claims it")
    return rank, world_size, ranks


def _resolve_targets(devices: Any, device: Any, ranks: str) -> tuple:
    """The devices a worker each runs on: ``devices`` parsed (each accelerator once), else ``(device,)``."""
    if devices is None:
        return (device,)
    if not isinstance(devices, (list, tuple)):
        raise bad_type("devices", "None or a list of devices (['cuda:0', 'cuda:1'])", devices)
    if not devices:
        raise bad_value("devices", "None or a list of at least one device", devices)
    if device is not None:
        raise bad_value("device", "None when devices is given (each device's batches move to it)", device)
    if ranks != "single":
        raise bad_value("devices", "None under torch.distributed (each rank runs on its own device; or pass "
                        "ranks='single' to run every batch in this process)", devices)
    parsed = tuple(check_device(f"devices[{i}]", d, "a str or torch.device") for i, d in enumerate(devices))
    accelerators = [str(d) for d in parsed if d.type != "cpu"]
    if len(set(accelerators)) < len(accelerators):
        raise bad_value("devices", "a list naming each accelerator once, with its index (its memory statistics "
                        "are its own)", devices)
    return parsed


def _resolve_memory(memory: str, plan: Any, ranks: str, targets: tuple) -> tuple[str, bool, tuple]:
    """``(mode, sparse, memory device per target)``: ``"auto"`` chosen, a mode no run can honour refused. A worker
    measures where its batches run: its target, else the accelerator on which a model holds memory, else the CPU."""
    running = [torch.device(t) if t is not None else device_in_use() or torch.device("cpu") for t in targets]
    where = ", ".join(map(str, running))
    can_measure = all(measurable(r) for r in running)
    replannable = plan is not None and ranks != "lockstep" and not plan.sampler.shuffle
    if memory == "auto" and not can_measure:
        logger.info("run: batches run on %s, whose memory cannot be measured: they run as planned", where)
        memory = "off"
    elif memory == "auto":
        memory = "measured" if replannable else "guarded"
    elif memory == "measured" and not replannable:
        why = ("a loader that is not a dynabatch DataLoader has no plan to re-size" if plan is None else
               "each rank's share is fixed up front under ranks='lockstep' (ranks='claim' re-sizes per rank)"
               if ranks == "lockstep" else "a shuffled loader's order cannot be kept: batches are re-planned "
               "longest first (build the loader with shuffle=False)")
        raise bad_value("memory", f"'guarded', 'record' or 'off' here ({why})", memory)
    if memory != "off" and not can_measure:
        raise bad_value("memory", f"'off' on {where}, whose memory cannot be measured", memory)
    estimator = getattr(getattr(plan, "planner", None), "estimator", None)
    if memory != "measured" and getattr(estimator, "refit", False) is True:
        # only the planner of measured mode gives peaks to the loader's memory model: in another mode the model
        # asked to be refitted in place would be left as built, and the caller saving it would not know
        logger.warning("run: the loader's refit_memory_model=True, but memory=%r: only measured mode refits its "
                       "memory_model (from the peaks it re-plans by); this run leaves the model as built (pass "
                       "memory='measured' with a loader in plan order to refine it)", memory)
    if memory == "off":
        return memory, False, (None,) * len(targets)
    sparse = memory in ("measured", "guarded") and all(r.type == "cpu" for r in running)
    logger.info("run: memory=%r on %s%s", memory, where, ", measuring only calls that can let batches grow" if sparse
                else "")
    return memory, sparse, tuple(running)

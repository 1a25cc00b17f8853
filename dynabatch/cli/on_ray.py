"""``--ray [ADDRESS]``: a corpus job of the command line run on a Ray cluster, into the same store.

``dynabatch embed corpus/ embeddings/ --ray auto`` is the job the command runs
on one machine, with its actors on a Ray cluster (``auto``: the cluster this
machine belongs to, else a local Ray started for the job; or an address as
``ray.init`` takes it, such as ``ray://head:10001`` or ``head:6379``):

* the same checks, before Ray is reached: the command's own, in its order,
  and the store opened and its job lock taken by this process (the driver),
  so that a bad input or a store another job writes is one line, exit status
  2, before any actor starts;
* the same model: each actor runs the command's own loading function
  (:func:`dynabatch.cli.embed` ``_load``, handed here as a value) on its
  device, with the options the driver checked: the same ``fn``, tokenizer and
  length limit as one machine;
* the same store: the rows keyed as the command keys them (``--id-column``'s
  ids, else each text's position), each with its input hash, under the same
  job key; every actor holds the store for the driver's job (its lock's job
  string), so a second job is refused while any of them writes. A store
  written by one machine resumes on a cluster and the reverse;
* windows of the corpus (:func:`window_rows`), each planned by the planner on
  its actor (:class:`~dynabatch.integrations.ray.DynamicBatchPredictor`, which
  carries what it measured to its next windows); the rows the store holds are
  checked (tokenized, their hashes compared) and not run again; each window's
  new rows are one shard named after its rows, so a window Ray runs again (an
  actor killed mid-window, restarted) replaces its shard: no row twice;
* one actor per GPU of the cluster, or one per CPU without GPUs;
* the same progress bar (rows, time left, rows/s and tokens/s, a window at a
  time), summary and exit status, all read from what the store holds.

The corpus is read by the driver, as the command reads it (every format), and
sent to the cluster in blocks of one window each through Ray's object store.
The store folder must be one every node reaches at the same path (a shared file
system), as for :func:`~dynabatch.integrations.ray.map_texts`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dynabatch._validation import bad_value
from dynabatch.cli import job
from dynabatch.cli._checks import extra, refusing
from dynabatch.cli.output import Output
from dynabatch.inference.report import RunReport
from dynabatch.inference.results import RunResult
from dynabatch.integrations.ray import DynamicBatchPredictor, default_window

__all__ = ["ActorModel", "CommandPredictor", "check_arguments", "plain", "run_on_ray", "window_rows"]

logger = logging.getLogger(__name__)

_REPORT = "report"  # the summary row's column of each window's report
_WINDOWS_PER_ACTOR = 4  # a small corpus is cut into at least this many windows per actor, so every actor works


def check_arguments(args: argparse.Namespace, command: str = "embed") -> None:
    """Refuses ``--ray`` where it does not apply: ``dynabatch generate`` (not on Ray yet), without Ray installed,
    with ``--devices`` (Ray places the actors), an absolute ``--max-memory`` (each actor plans under the peak it
    measured) or under ``torchrun``."""
    if args.ray is None:
        return
    import importlib.util

    if command != "embed":
        raise bad_value("--ray", f"left out of dynabatch {command} (on a Ray cluster: dynabatch embed, for now)",
                        args.ray)
    if not args.ray.strip():
        raise bad_value("--ray", "auto or the address of a Ray cluster (head:6379, ray://head:10001)", args.ray)
    if importlib.util.find_spec("ray") is None:
        raise ValueError(f"--ray should be given with Ray installed ({extra('ray')}), but got --ray={args.ray!r} "
                         "and no ray module")
    if args.devices is not None:
        raise bad_value("--devices", "left out with --ray (Ray places one actor per GPU, or per CPU without GPUs)",
                        args.devices)
    if args.max_memory != "auto":
        raise bad_value("--max-memory", "auto with --ray (each actor plans its windows under the peak it measured)",
                        args.max_memory)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise bad_value("--ray", "left out under torchrun (Ray runs the job's processes)", args.ray)


def plain(args: argparse.Namespace) -> argparse.Namespace:
    """The options alone, for the actors (not the command's function and parser)."""
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("command", "parser")})


def window_rows(n: int, actors: int, batch_size: int) -> int:
    """Rows per window: :func:`~dynabatch.integrations.ray.default_window`, cut so that ``n`` rows make at least
    4 windows per actor, but never under 4 first batches.

    Example:
        >>> window_rows(1_000_000, 8, 64), window_rows(2_000, 2, 64), window_rows(100, 2, 64)
        (4096, 256, 256)
    """
    return max(4 * batch_size, min(default_window(batch_size), -(-n // (_WINDOWS_PER_ACTOR * actors))))


@dataclass
class ActorModel:
    """What each actor loads, by the command's own code: ``load(spec, args)`` gives ``(tokenizer, limit, make_fn,
    model)`` for ``spec`` placed on the actor's device; ``loader_options(args, limit)`` the loader's keywords."""

    load: Callable[[Any, argparse.Namespace], tuple[Any, int, Callable, Any]]
    spec: Any  # the command's checked job, without its texts, ids and store (the driver's)
    args: argparse.Namespace
    loader_options: Callable[[argparse.Namespace, int], dict[str, Any]]

    def __call__(self, device: Any) -> tuple[Any, Callable, int, dict[str, Any]]:
        """``(tokenizer, fn, limit, loader keywords)`` on ``device`` (``None``: the CPU)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the command downloads nothing, on any node
        device = torch.device(device or "cpu")
        spec = dataclasses.replace(self.spec, place=job.Placement(0, 1, [device]))
        tokenizer, limit, make_fn, model = self.load(spec, self.args)
        return tokenizer, make_fn(device), limit, {**self.loader_options(self.args, limit), "model": model}


class CommandPredictor(DynamicBatchPredictor):
    """The predictor of a command's job: its model loaded by :class:`ActorModel` (``model``), each window's batches
    tagged with the actor that ran them (host and process), so the summary reads the busiest actor's time."""

    def __init__(self, *, model: ActorModel, **kwargs: Any) -> None:
        self.model = model
        self.actor = f"{socket.gethostname()} pid {os.getpid()}"
        super().__init__(**kwargs)

    def setup(self) -> tuple[Any, Callable]:
        tokenizer, fn, self.max_input_token_length, options = self.model(self.device)
        self.loader_kwargs.update(options)
        return tokenizer, fn

    def window_done(self, report: RunReport, plan: str) -> None:
        for record in report.records:
            record.device = self.actor
        super().window_done(report, plan)


@dataclass
class ClusterPlacement(job.Placement):
    """The summary's placement line: the cluster and its actors."""

    cluster: str = ""

    def describe(self) -> str:
        return self.cluster


def _connect(address: str) -> bool:
    """Ray initialized at ``address`` (``auto``: the running cluster, else a local one); whether this call started
    it (a process that initialized Ray itself keeps its own)."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if address != "auto":
            ray.init(address=address, **quiet)
            return True
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # no cluster running: a local one for this job
            ray.init(include_dashboard=False, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()
        raise ValueError(f"--ray should be auto or the address of a running Ray cluster, but got --ray={address!r}: "
                         f"{type(exc).__name__}: {text[0] if text else ''}") from exc
    return True


def _cluster(address: str) -> tuple[int, float, str]:
    """``(actors, GPUs per actor, the summary's line)``: one actor per GPU of the cluster, else one per CPU."""
    import ray

    resources = ray.cluster_resources()
    cpus, gpus = int(resources.get("CPU", 1)), int(resources.get("GPU", 0))
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    actors, per = (gpus, 1.0) if gpus else (max(1, cpus), 0.0)
    each = "a GPU" if gpus else "a CPU"
    return actors, per, f"Ray cluster {address} ({nodes} nodes, {cpus} CPUs, {gpus} GPUs): {actors} actors, {each} each"


def _texts(texts: Any, start: int, stop: int) -> pa.Array:
    """Rows ``start:stop`` of a :class:`~dynabatch.data.text_source.TextSource` as Arrow strings."""
    if getattr(texts, "arrow", None) is not None:
        return texts.arrow.slice(start, stop - start).combine_chunks()
    return pa.array(texts.take(np.arange(start, stop)), type=pa.large_string())


def _dataset(texts: Any, ids: pa.Array | None, window: int) -> Any:
    """The corpus as a Ray dataset of one block per window: ``position``, ``text`` (and ``id``)."""
    import ray
    import ray.data

    refs = []
    for start in range(0, len(texts), window):
        stop = min(len(texts), start + window)
        columns = {"position": pa.array(np.arange(start, stop, dtype=np.int64)), "text": _texts(texts, start, stop)}
        if ids is not None:
            columns["id"] = ids.slice(start, stop - start)
        refs.append(ray.put(pa.table(columns)))
    return ray.data.from_arrow_refs(refs)


def _cause(exc: BaseException) -> BaseException:
    """The error an actor raised, out of Ray's wrappers (its task error, Ray Data's user-code error)."""
    import ray.exceptions

    seen = exc
    for _ in range(8):
        inner = getattr(seen, "cause", None) if isinstance(seen, ray.exceptions.RayTaskError) else None
        inner = inner or seen.__cause__
        if inner is None:
            break
        seen = inner
        if not type(seen).__module__.startswith("ray"):
            return seen
    return exc


def _run_windows(ds: Any, kwargs: dict[str, Any], *, actors: int, gpus: float, window: int, total: int,
                 progress: bool) -> RunResult:
    """Runs the windows on the actors (each commits its rows to the store); a result holding the job's report: every
    window's batches, each tagged with its actor."""
    import ray.data
    from tqdm.auto import tqdm

    remote = {"num_gpus": gpus} if gpus else {}
    compute = ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1)
    out = ds.map_batches(CommandPredictor, fn_constructor_kwargs=kwargs, batch_size=window, compute=compute,
                         **remote)
    bar = tqdm(total=total, unit="row", desc="dynabatch", dynamic_ncols=True) if progress else None
    records: list[Any] = []
    budget, tokens, began = None, 0, time.perf_counter()
    try:
        for summary in out.iter_batches(batch_size=None, batch_format="numpy"):
            for ran, failed, text in zip(summary["ran"], summary["failed"], summary[_REPORT]):
                report = RunReport.from_dict(json.loads(text))
                records.extend(report.records)
                budget = budget if budget is not None else report.budget_bytes
                tokens += report.real_tokens
                if bar is not None:
                    bar.update(int(ran))
                    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - began, 1e-9):,.0f} tokens/s",
                                        refresh=False)
    except Exception as exc:  # noqa: BLE001 (the actor's own error, as one machine's run raises it)
        cause = _cause(exc)
        if cause is exc:
            raise
        raise cause from exc
    finally:
        if bar is not None:
            bar.close()
    return RunResult(report=RunReport(records, budget_bytes=budget))


def run_on_ray(command: str, *, model: ActorModel, texts: Any, ids: pa.Array | None, key: str, output: Output,
               args: argparse.Namespace, parser: argparse.ArgumentParser, start: float, what: str, model_line: str,
               run_options: dict[str, Any] | None = None) -> int:
    """Runs a checked job (its store opened and held by ``output``) on the Ray cluster of ``--ray``; prints the
    summary and returns the exit status, as the command does on one machine.

    ``model``: what each actor loads; ``texts``, ``ids``: the corpus as the command read it; ``key``: the store's
    job key; ``what``: the rows' name (``"texts"``); ``run_options``: more keywords of :func:`dynabatch.run`."""
    import ray
    import ray.data

    with refusing(parser):
        started = _connect(args.ray)
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # the command's own bar and summary say it all
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars, context.print_on_execution_start = False, False
        actors, gpus, line = _cluster(args.ray)
        window = window_rows(len(texts), actors, args.batch_size)
        kwargs = {"model": model, "batch_size": args.batch_size, "max_input_token_length": 1,  # the actor's own
                  "on_oom": args.on_oom, "on_error": args.on_error, "device": "cuda" if gpus else None,
                  "run_kwargs": run_options, "key": key,
                  "output_path": os.path.abspath(output.path),  # actors run in their own folders
                  "id_column": "id" if ids is not None else "position",
                  "keyed_by": "id" if ids is not None else "position", "job": output.store.lock.job,
                  "report_column": _REPORT}
        before = int(output.before.sum()) if output.before is not None else 0
        logger.info("%s: %d windows of %d rows on %s", command, -(-len(texts) // window), window, line)
        output.started = True
        try:
            result, tally, error = job.run_accounted(
                lambda: _run_windows(_dataset(texts, ids, window), kwargs, actors=actors, gpus=gpus, window=window,
                                     total=len(texts) - before, progress=not args.no_progress),
                output, len(texts), parser, what=what, on_error=args.on_error)
        finally:
            output.store.close(job_done=True)  # the actors' holds too: the job is over
        place = ClusterPlacement(0, 1, [torch.device("cuda" if gpus else "cpu")], cluster=line)
        columns = ["id" if ids is not None else "position", "output"]
        return job.finish(command, result, tally, error, args, place, start=start, model=model_line, what=what,
                          columns=columns)
    finally:
        if started:
            ray.shutdown()

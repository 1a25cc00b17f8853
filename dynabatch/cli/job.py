"""What the corpus jobs of the command line share: where they run, the store they resume, the run, the summary.

* :func:`placement`: every accelerator of the machine (or ``--devices``), or
  under ``torchrun`` this rank's device (``LOCAL_RANK``); :func:`process_group`
  starts and ends ``torch.distributed`` around the job.
* :func:`job_key`: the store's key, what computed the rows: the command, the
  model (its folder's name and :func:`model_digest`) and every setting that
  changes a row. A rerun with the same key resumes; another key is refused.
* :func:`check_store`: the store at the output path, opened as the run will
  open it, before any model loads (another job's store, a folder of other files).
* :func:`run_job`: the one call of :func:`dynabatch.run` with several devices or ranks.
* :func:`summary`, :func:`finish`: the screen after the run, ``--report`` and ``--plot``.
* :func:`add_input_arguments`, :func:`add_run_arguments`: the options every corpus job takes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynabatch._digest import fingerprint
from dynabatch._validation import bad_value

__all__ = ["Placement", "add_input_arguments", "add_run_arguments", "check_outputs", "check_store", "finish",
           "job_key", "model_digest", "placement", "process_group", "run_job", "summary"]

logger = logging.getLogger(__name__)

_SAMPLE_BLOCKS, _BLOCK = 16, 64 * 1024  # a large file is identified by its size and 16 blocks spread over it


def add_input_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """The corpus in (``what``: "document", "prompt") and the store out."""
    from dynabatch.cli.corpus import FORMATS

    p.add_argument("input", help=f"Parquet file, folder or glob; JSONL file; text file (one {what} a line); or a "
                   "datasets folder (save_to_disk)")
    p.add_argument("output", help="the store: a new folder, or this job's folder to resume it")
    p.add_argument("--text-column", default="text", help=f"the column of {what}s (default: text)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="the input's format (default: auto, told by its path)")


def add_run_arguments(p: argparse.ArgumentParser, what: str, batch_size: int, devices: str) -> None:
    """How the job runs and what it writes besides the store (``what``: "text", "prompt")."""
    from dynabatch.cli._checks import DTYPES

    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the weights (default: auto, float16 on a GPU and float32 on the CPU)")
    p.add_argument("--batch-size", type=int, default=batch_size, help=f"on the CPU, rows of the first (longest) "
                   f"batch, {batch_size} by default; later batches grow under its measured peak memory")
    p.add_argument("--devices", default=None, help=devices)
    p.add_argument("--max-memory", default="auto",
                   help="the memory every batch is planned under, read once the model is loaded: auto (default: 90%% "
                   "of a GPU's free memory; on the CPU, no batch above the first batch's measured peak), a percentage "
                   "(80%%), a size (20GB, 20GiB) or bytes")
    p.add_argument("--on-oom", choices=("raise", "skip"), default="raise",
                   help=f"a {what} that runs out of memory alone: stop (default), or skip it (a rerun retries it)")
    p.add_argument("--report", type=Path, default=None, help="write the run's report (every batch) as JSON")
    p.add_argument("--plot", type=Path, default=None, help="draw the run's batches as a PNG (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_outputs(args: argparse.Namespace) -> None:
    """``--report`` and ``--plot`` can be written (and matplotlib imports for ``--plot``)."""
    from dynabatch.cli._checks import check_plot, check_writable

    if args.report is not None:
        check_writable("--report", args.report)
    check_plot(args.plot)


@dataclass
class Placement:
    """Where this process runs: its rank among ``world`` processes and its devices."""

    rank: int
    world: int
    devices: list[torch.device]

    @property
    def main(self) -> bool:
        """Whether this process prints (rank 0)."""
        return self.rank == 0

    @property
    def accelerated(self) -> bool:
        return self.devices[0].type != "cpu"

    def describe(self) -> str:
        names = ", ".join(str(d) for d in self.devices)
        return f"{names}, rank {self.rank} of {self.world} (torchrun)" if self.world > 1 else names


def placement(devices: list[torch.device] | None) -> Placement:
    """Every accelerator of the machine, ``devices`` when given, or under ``torchrun`` the rank's own device."""
    from dynabatch.memory.device import default_accelerator, device_count

    world = int(os.environ.get("WORLD_SIZE", "1"))
    kind = default_accelerator()
    if world > 1:
        if devices is not None:
            raise bad_value("--devices", "left out under torchrun (each rank runs on the device of its LOCAL_RANK)",
                            ",".join(str(d) for d in devices))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(kind.type, local) if kind is not None else torch.device("cpu")
        return Placement(int(os.environ.get("RANK", "0")), world, [device])
    if devices is not None:
        return Placement(0, 1, devices)
    if kind is None:
        return Placement(0, 1, [torch.device("cpu")])
    return Placement(0, 1, [torch.device(kind.type, i) for i in range(device_count(kind.type))])


@contextlib.contextmanager
def process_group(place: Placement) -> Iterator[None]:
    """``torch.distributed`` started for a ``torchrun`` job (NCCL on CUDA, else gloo) and ended after it."""
    import torch.distributed as dist

    if place.world == 1 or dist.is_initialized():
        yield
        return
    from dynabatch.memory.device import make_current

    make_current(place.devices[0])
    dist.init_process_group("nccl" if place.devices[0].type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def model_digest(folder: str) -> str:
    """A digest of a model folder: every file's name and size (``.md`` and hidden files left out), the contents
    of the small files (configs, vocabularies) and 16 blocks spread over each large one (weights).

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "config.json").write_text('{"hidden_size": 32}')
        >>> before = model_digest(str(folder))
        >>> _ = (folder / "config.json").write_text('{"hidden_size": 64}')
        >>> before == model_digest(str(folder)), len(before)
        (False, 16)
    """
    parts: list[Any] = []
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name.startswith(".") or "/." in name or name.endswith(".md"):
            continue
        size = path.stat().st_size
        parts.append((name, size))
        with open(path, "rb") as f:
            if size <= _SAMPLE_BLOCKS * _BLOCK:
                parts.append(np.frombuffer(f.read(), dtype=np.uint8))
                continue
            for offset in np.linspace(0, size - _BLOCK, _SAMPLE_BLOCKS).astype(np.int64).tolist():
                f.seek(offset)
                parts.append(np.frombuffer(f.read(_BLOCK), dtype=np.uint8))
    return fingerprint(*parts)


def job_key(command: str, model_name: str, model_folder: str, **settings: Any) -> str:
    """The store's key: ``"embed model=NAME@DIGEST pooling=mean ..."``; what computed the rows, read by a person."""
    named = " ".join(f"{k}={v}" for k, v in settings.items())
    return f"{command} model={model_name}@{model_digest(model_folder)} {named}"


def check_store(output: str, key: str, n: int, ids: Any) -> None:
    """Refuses, before a model loads, an output path the run would refuse: another job's store (another key),
    a store keyed otherwise, a file, or a folder holding other files."""
    if not os.path.exists(output):
        return
    from dynabatch.inference.store import open_store

    try:
        open_store(output, key=key, n=n, ids=ids, verify=False)
    except ValueError as exc:
        raise ValueError(f"output should be a new folder, or this same job's store to resume it, but got "
                         f"output={output!r}: {str(exc).splitlines()[0]}") from exc


def run_job(make_fn: Callable[[torch.device], Callable], loader: Any, place: Placement, **options: Any) -> Any:
    """The one call of :func:`dynabatch.run` on several devices or ranks: ``make_fn(device)`` gives ``fn(batch)``.

    Under ``torchrun`` the ranks claim chunks of the corpus (each its own
    device); in one process, every device of ``place`` takes batches from one
    shared queue. ``options`` are ``run``'s (``output_path``, ``key``, ...).
    """
    from dynabatch import run

    if place.world > 1:
        return run(make_fn(place.devices[0]), loader, device=place.devices[0], ranks="claim", **options)
    if len(place.devices) > 1:
        return run(loader=loader, make_fn=make_fn, devices=place.devices, **options)
    return run(make_fn(place.devices[0]), loader, device=place.devices[0], **options)


def _rate(value: float | None, unit: str) -> str:
    return f"{value:,.0f} {unit}/s" if value is not None else f"- {unit}/s"


def summary(command: str, result: Any, *, output: str, what: str, model: str, place: Placement, seconds: float,
            columns: list[str]) -> str:
    """The screen after a job: rows, time, throughput, padding, out-of-memory events, the store and how to read it."""
    report = result.report
    n = len(result)
    missing = len(result.failed)
    ran = report.rows
    if place.world > 1:
        done = f"rank {place.rank} ran {ran:,} of them now"
    else:
        done = f"{ran:,} run now, {max(0, n - missing - ran):,} stored before"
    efficiency = f"{report.padding_efficiency:.0%}" if report.padding_efficiency is not None else "-"
    lines = [
        f"dynabatch {command}: {n - missing:,} of {n:,} {what} stored in {output} ({done})",
        f"  model      {model}, on {place.describe()}",
        f"  time       {seconds:.1f} s in all, {report.seconds:.1f} s running {report.batches:,} batches: "
        f"{_rate(report.rows_per_s, what)}, {_rate(report.tokens_per_s, 'tokens')}",
        f"  padding    {efficiency} of the padded tokens were real tokens",
        f"  memory     {report.oom_events} out-of-memory events, {report.oom_splits} batches split after one, "
        f"{report.pre_split_batches} split before running",
        f"  store      {os.path.abspath(output)} (Parquet, one row per input: {', '.join(columns)})",
        f"  read it    pyarrow.dataset.dataset({output!r}).to_table(columns={columns!r})  (or pandas, polars, "
        "datasets)",
    ]
    if missing:
        lines.append(f"  missing    {missing:,} inputs have no row (ran out of memory alone, --on-oom skip): "
                     "the same command again retries them")
    return "\n".join(lines)


def finish(command: str, result: Any, args: argparse.Namespace, place: Placement, *, start: float, model: str,
           what: str, columns: list[str]) -> None:
    """Writes ``--report`` and ``--plot`` (a rank's own, named ``.rankN`` under torchrun but for rank 0) and
    prints the summary (rank 0)."""
    written = []
    for path, write in ((args.report, result.report.to_json), (args.plot, result.report.plot)):
        if path is None:
            continue
        if not place.main:
            path = path.with_name(f"{path.stem}.rank{place.rank}{path.suffix}")
        write(path)
        written.append(str(path))
    if place.main:
        print(summary(command, result, output=args.output, what=what, model=model, place=place,
                      seconds=time.perf_counter() - start, columns=columns))
        for path in written:
            print(f"  wrote      {path}")
    sys.stdout.flush()

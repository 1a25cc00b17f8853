"""``--ray [ADDRESS]``: a corpus job of the command line run on a Ray cluster, into the same store.

``dynabatch embed corpus/ embeddings/ --ray auto`` and ``dynabatch generate
prompts/ replies/ --model M --ray auto`` are the jobs the commands run on one
machine, with their actors on a Ray cluster (``auto``: the cluster this machine
belongs to, else a local Ray started for the job; or an address as ``ray.init``
takes it, such as ``ray://head:10001`` or ``head:6379``):

* the same checks, before Ray is reached: the command's own, in its order,
  and the store opened and its job lock taken by this process (the driver),
  so that a bad input or a store another job writes is one line, exit status
  2, before any actor starts;
* the same model: each actor runs the command's own loading (``embed``: its
  loading function, handed here as a value, :class:`ActorModel`;
  ``generate``: the model folder with the driver's tokenizer and generate
  options, :class:`GenerateModel`, through the functions
  :func:`dynabatch.generate` runs) on its device, with the options the driver
  checked;
* the same store: the rows keyed as the command keys them (``--id-column``'s
  ids, else each row's position), each with its input hash, under the same
  job key; every actor holds the store for the driver's job (its lock's job
  string), so a second job is refused while any of them writes. A store
  written by one machine resumes on a cluster and the reverse;
* windows of the corpus (:func:`window_rows`), each planned by the planner on
  its actor (:class:`~dynabatch.integrations.ray.DynamicBatchPredictor`, which
  carries what it measured to its next windows); the rows the store holds are
  checked (tokenized, their hashes compared) and not run again; each window's
  new rows are one shard named after its rows, so a window Ray runs again (an
  actor killed mid-window, restarted) replaces its shard: no row twice;
* one actor per GPU of the cluster, or one per CPU without GPUs, but no more than the corpus has windows;
* the same meter (:class:`~dynabatch.inference.meter.Meter`: rows, time left,
  texts/s and tokens/s, a window at a time), summary (its bound line from the
  actors' stages) and exit status, all read from what the store holds.

The input: rows keyed by ``--id-column`` in CSV/TSV files are read on the
cluster by Ray Data's readers (:func:`_read`), in blocks of one window; the
rest (rows keyed by position, which Ray's readers do not number; Parquet and
JSON lines, see :func:`_read`; text files, ``datasets`` folders, rendered
chats) are read by the driver, as the command reads them, and sent in blocks
of one window each through Ray's object store, the rows sorted longest first in
characters so that a window holds texts of like lengths (:func:`window_order`).
The input, model and store folders must be ones every node reaches at the same
path (a shared file system), as for :func:`~dynabatch.integrations.ray.map_texts`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from dynabatch._distribution import extra
from dynabatch._validation import bad_value
from dynabatch.cli import job
from dynabatch.cli._checks import refusing
from dynabatch.cli.output import Output
from dynabatch.inference.report import BatchRecord, RunReport
from dynabatch.inference.results import RunResult
from dynabatch.integrations.ray import DynamicBatchPredictor, default_window

__all__ = ["ActorModel", "CommandPredictor", "GenerateModel", "Windows", "check_arguments", "plain", "run_generate",
           "run_on_ray", "window_order", "window_rows"]

logger = logging.getLogger(__name__)

_REPORT = "report"  # the summary row's column of each window's report
_WINDOWS_PER_ACTOR = 4  # a small corpus is cut into at least this many windows per actor, so every actor works


def check_arguments(args: argparse.Namespace) -> None:
    """Refuses ``--ray`` where it does not apply: without Ray installed, with ``--devices`` (Ray places the actors),
    a ``--max-memory`` but ``auto`` (each actor plans under the peak it measured) or under ``torchrun``."""
    if args.ray is None:
        return
    import importlib.util

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

    def truncated(self) -> int:
        """How many inputs of the actor's last window were truncated: none counted (as on one machine)."""
        return 0


@dataclass
class GenerateModel:
    """What each actor of ``dynabatch generate`` loads: ``--model``'s weights in ``--dtype`` (a seq2seq or a causal
    LM, as its config says), the driver's tokenizer (its pad token set as the command sets it) and the command's
    generate options, so that every actor's replies are those of one machine's run."""

    folder: str
    dtype: Any
    tokenizer: Any
    limit: int
    options: dict[str, Any]  # model.generate's keywords, as the command passes them
    chat: bool  # prompts rendered by the chat template on the driver: no special tokens added again
    seed: int
    truncation: Any = None  # the actor's TruncatedPrompts, made where it loads the model

    def __call__(self, device: Any) -> tuple[Any, Callable, int, dict[str, Any]]:
        """``(tokenizer, fn, limit, loader keywords)`` on ``device`` (``None``: the CPU)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

        from dynabatch.inference.generation import TruncatedPrompts, generation_loader, reply_function

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        device = torch.device(device or "cpu")
        seq2seq = getattr(AutoConfig.from_pretrained(self.folder), "is_encoder_decoder", False)
        auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        model = auto.from_pretrained(self.folder, dtype=self.dtype).to(device).eval()
        torch.manual_seed(self.seed)  # the actor's own generator: sampling draws from it
        padder, loader = generation_loader(model, self.tokenizer, self.options, chat=self.chat)
        self.truncation = TruncatedPrompts(padder, self.limit, "chat" if self.chat else "text")
        fn = self.truncation.noting(reply_function(model, self.tokenizer, self.options))  # batches carry their texts
        return padder, fn, self.limit, loader

    def truncated(self) -> int:
        """How many prompts of the actor's last window were longer than the limit (and truncated), forgotten then."""
        return len(self.truncation.take()) if self.truncation is not None else 0


class CommandPredictor(DynamicBatchPredictor):
    """The predictor of a command's job: its model loaded by :class:`ActorModel` or :class:`GenerateModel`
    (``model``); each window's report tagged with the actor that ran it (host and process): its batches, and its
    wall (the window's planning and tokenizing, ``"plan"``, beside the run's stages) and when its run began, so that
    the summary reads the busiest actor's time and names what bound the actors (:func:`_job_report`)."""

    def __init__(self, *, model: Callable[[Any], tuple[Any, Callable, int, dict[str, Any]]], **kwargs: Any) -> None:
        self.model = model
        self.actor = f"{socket.gethostname()} pid {os.getpid()}"
        self.began, loading = time.perf_counter(), time.time()
        super().__init__(**kwargs)
        self.loaded = [loading, time.time()]  # when this actor began and ended loading its model (the clock's time)

    def setup(self) -> tuple[Any, Callable]:
        tokenizer, fn, self.max_input_token_length, options = self.model(self.device)
        self.loader_kwargs.update(options)
        return tokenizer, fn

    def __call__(self, batch: Any) -> Any:
        self.began = time.perf_counter()
        return super().__call__(batch)

    def window_done(self, report: RunReport, plan: str) -> None:
        report.truncated_inputs = self.model.truncated()  # as dynabatch.generate counts them on one machine
        for record in report.records:
            record.device = self.actor
        stages: dict[str, float] = {}
        for worker in report.workers.values():
            for stage, seconds in worker["stages"].items():
                stages[stage] = stages.get(stage, 0.0) + seconds
        wall = time.perf_counter() - self.began
        stages["plan"] = stages.get("plan", 0.0) + max(0.0, wall - sum(stages.values()))
        # "began": when the window's run began (the clock's time), which its batches' finished are counted from
        report.workers = {self.actor: {"wall": sum(stages.values()), "stages": stages,
                                       "began": time.time() - (report.wall_seconds or 0.0)}}
        if self.windows == 1:  # its first window: the actor's start with it, for the driver's log
            report.workers[self.actor]["loaded"] = self.loaded
        super().window_done(report, plan)


@dataclass
class ClusterPlacement(job.Placement):
    """The summary's placement line: the cluster and its actors."""

    cluster: str = ""

    def describe(self) -> str:
        return self.cluster


# How long the driver waits for an address of --ray (or RAY_ADDRESS) to take a connection before it refuses it.
CONNECT_SECONDS = 10


def _answers(address: str) -> None:
    """Raises ``ConnectionError`` where nothing takes a connection at ``address`` (``host:port`` or
    ``ray://host:port``; ``auto`` and ``local`` are not addresses): ``ray.init`` waits minutes there before it says
    so."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {host}:{port} ({type(exc).__name__}: {exc})") from exc


def _connect(address: str) -> bool:
    """Ray initialized at ``address`` (``auto``: the running cluster, else a local one); whether this call started
    it (a process that initialized Ray itself keeps its own)."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    command_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        _answers(address if address != "auto" else os.environ.get("RAY_ADDRESS", "auto"))  # auto reads RAY_ADDRESS
        if address != "auto":
            ray.init(address=address, **quiet)
            return True
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # no cluster running: a local one for this job
            ray.init(include_dashboard=False, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()
        env = f" (RAY_ADDRESS={os.environ['RAY_ADDRESS']!r})" if address == "auto" and "RAY_ADDRESS" in os.environ else ""
        raise ValueError(f"--ray should be auto or the address of a running Ray cluster, but got --ray={address!r}"
                         f"{env}: {type(exc).__name__}: {text[0] if text else ''}") from exc
    finally:
        # ray.init sets its own SIGTERM handler (sys.exit(15)), which ended the job with no line and exit status 15:
        # the command's is put back, so that SIGTERM stops a job on Ray as on one machine (what the store kept, 143).
        if command_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, command_sigterm)
    return True


def _cluster(address: str, n: int, batch_size: int) -> tuple[int, float, int, str]:
    """``(actors, GPUs per actor, rows per window, the summary's line)`` for ``n`` rows: one actor per GPU of the
    cluster, else one per CPU, but no more actors than windows (:func:`window_rows`): an actor without a window
    would hold its GPU or CPU and load the model for nothing, and Ray warns of the pool it cannot fill."""
    import ray

    resources = ray.cluster_resources()
    cpus, gpus = int(resources.get("CPU", 1)), int(resources.get("GPU", 0))
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    actors, per = (gpus, 1.0) if gpus else (max(1, cpus), 0.0)
    window = window_rows(n, actors, batch_size)
    actors = min(actors, -(-n // window))
    each = "a GPU" if gpus else "a CPU"
    return actors, per, window, (f"Ray cluster {address} ({nodes} nodes, {cpus} CPUs, {gpus} GPUs): {actors} "
                                 f"actor{'s' if actors > 1 else ''}, {each} each")


def _texts(texts: Any, positions: np.ndarray) -> pa.Array:
    """The texts at ``positions`` (of a :class:`~dynabatch.data.text_source.TextSource`, or a list) as Arrow
    strings."""
    if getattr(texts, "arrow", None) is not None:
        return texts.arrow.take(pa.array(positions)).combine_chunks()
    rows = texts.take(positions) if hasattr(texts, "take") else [texts[p] for p in positions.tolist()]
    return pa.array(list(rows), type=pa.large_string())


def window_order(chars: np.ndarray, window: int) -> np.ndarray:
    """The rows' positions in the order the windows take them: longest first in characters, so that each window
    holds texts of like lengths and pads as little as one longest-first plan of the corpus; the windows then taken
    long, short, next long, next short, ..., so that the rate of the last few windows, which the meter reads for the
    time left, is near the rate of all that is left.

    Example:
        >>> window_order(np.array([1, 5, 3, 9, 7, 2]), 2).tolist()  # windows [9, 7], [2, 1], [5, 3]
        [3, 4, 5, 0, 1, 2]
    """
    order = np.argsort(-np.asarray(chars), kind="stable")
    starts = np.arange(0, len(order), window)
    k = len(starts)
    taken = np.empty(k, dtype=np.int64)
    taken[0::2], taken[1::2] = np.arange((k + 1) // 2), np.arange(k - 1, (k + 1) // 2 - 1, -1)
    return np.concatenate([order[s:s + window] for s in starts[taken]]) if k else order


def _sent(texts: Any, ids: pa.Array | None, window: int) -> Any:
    """The corpus as the driver read it, as a Ray dataset of one block per window (:func:`window_order`):
    ``position``, ``text`` (and ``id``), each block put in Ray's object store."""
    import ray
    import ray.data

    chars = texts.char_lengths() if hasattr(texts, "char_lengths") else np.fromiter(map(len, texts), np.int64,
                                                                                      len(texts))
    order, refs = window_order(chars, window), []
    for start in range(0, len(texts), window):
        positions = order[start:start + window]
        columns = {"position": pa.array(positions.astype(np.int64)), "text": _texts(texts, positions)}
        if ids is not None:
            columns["id"] = ids.take(pa.array(positions))
        refs.append(ray.put(pa.table(columns)))
    return ray.data.from_arrow_refs(refs)


def _as_text_and_id(table: pa.Table, *, text: str, id_column: str) -> pa.Table:
    """A block of the input's own columns as the windows' ``text`` and ``id``."""
    return pa.table({"text": table.column(text), "id": table.column(id_column)})


def _read(args: argparse.Namespace, text_column: str) -> Any:
    """The input read by Ray Data's readers on the cluster, as ``text`` and ``id``: CSV and TSV files with rows keyed
    by ``--id-column`` (``None`` where the driver reads it: rows keyed by position, which Ray's readers do not
    number; Parquet, whose read under Ray 2.60 waited forever beside an actor pool holding every CPU of a 2-CPU
    cluster; JSON lines, whose Ray read is not tested yet)."""
    import ray.data
    from pyarrow import csv

    from dynabatch.cli.corpus import open_corpus

    if args.id_column is None or args.format not in ("auto", "csv", "tsv"):
        return None
    corpus = open_corpus(args.input, args.format, exclude=args.output, keep=[text_column, args.id_column])
    if corpus.format not in ("csv", "tsv"):
        return None
    kept = [text_column, args.id_column]
    # The reads hold no CPU: the actor pool holds one per actor, every CPU of a cluster without GPUs, and Ray Data
    # starts it before the reads that feed it, which would wait for a CPU forever. A read is light beside a window.
    ds = ray.data.read_csv(
        [os.path.abspath(f) for f, _ in corpus.file_columns], num_cpus=0, file_extensions=None,
        parse_options=csv.ParseOptions(delimiter="\t" if corpus.format == "tsv" else ",", newlines_in_values=True),
        convert_options=csv.ConvertOptions(column_types={c: pa.large_string() for c in kept}, include_columns=kept))
    return ds.map_batches(_as_text_and_id, batch_format="pyarrow", batch_size=None, num_cpus=0,
                          fn_kwargs={"text": text_column, "id_column": args.id_column})


def _cause(exc: BaseException) -> BaseException:
    """The error an actor raised, out of Ray's wrappers (its task error, Ray Data's user-code error); an actor
    that died (:func:`_died`) as one line that says why."""
    import ray.exceptions

    seen = exc
    for _ in range(8):
        if isinstance(seen, ray.exceptions.RayActorError):
            return _died(seen)
        inner = getattr(seen, "cause", None) if isinstance(seen, ray.exceptions.RayTaskError) else None
        inner = inner or seen.__cause__
        if inner is None:
            break
        seen = inner
        if not type(seen).__module__.startswith("ray"):
            return seen
    return exc


# Ray Data replaces an actor that dies as it starts (its process killed, its node lost, its model's loading
# raising) this many times in a row before it stops the job with that actor's error (Ray Data's default, none,
# stops a whole job for one actor that died as it started).
ACTOR_START_DEATHS = 2


class DeadActorError(RuntimeError):
    """An actor of the job died: its start raised (``at_start``), or its process ended (:func:`_died` says which,
    in one line)."""

    def __init__(self, message: str, *, at_start: bool = False) -> None:
        super().__init__(message)
        self.at_start = at_start


def _died(error: BaseException) -> DeadActorError:
    """A Ray actor's death as one line: the error its start raised (the last line of the traceback Ray carries
    as text), else what Ray says of its process.

    Example:
        >>> import ray.exceptions
        >>> _died(ray.exceptions.RayActorError(error_msg="Traceback ...\\n  raise ...\\nOSError: no model.bin",
        ...                                    actor_init_failed=True))
        DeadActorError('an actor of the job failed as it started, 3 times in a row: OSError: no model.bin')
        >>> _died(ray.exceptions.RayActorError(error_msg="The actor died.\\n\\tpid: 71\\nIts process was killed."))
        DeadActorError('an actor of the job died: The actor died. Its process was killed.')
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not set(line.strip()) <= {"^"}]
    if getattr(error, "actor_init_failed", False):
        return DeadActorError(f"an actor of the job failed as it started, {ACTOR_START_DEATHS + 1} times in a row: "
                              f"{lines[-1] if lines else type(error).__name__}", at_start=True)
    said = " ".join(line for line in lines if not line.startswith(("class_name:", "actor_id:", "pid:", "ip:",
                                                                     "name:", "namespace:")))
    return DeadActorError(f"an actor of the job died: {said or type(error).__name__}")


def _job_report(reports: list[RunReport], *, wall_seconds: float, sent: float, accounting: float) -> RunReport:
    """The windows' reports as the job's one: every batch (tagged with its actor) on the job's clock
    (:func:`_on_job_clock`); each actor's wall and stages summed over its windows, and its first measured peak
    (``device_budgets``, as each device's in a run on several); the background stages' shares
    (:func:`_background_shares`); the windows' skipped inputs, rebuilt batches, truncated inputs and accounting
    seconds summed.

    ``wall_seconds``: the driver's, from sending the windows to the last one back (stored: a window commits its rows
    before it returns); ``sent``: the clock's time (``time.time()``) it sent them; ``accounting``: the driver's own
    accounting seconds (its meter's)."""
    workers: dict[str, dict[str, Any]] = {}
    budgets: dict[str, int] = {}
    records: list[BatchRecord] = []
    batch = 0  # the next window's first batch number
    for report in reports:
        for actor, worker in report.workers.items():
            into = workers.setdefault(actor, {"wall": 0.0, "stages": {}})
            into["wall"] += worker["wall"]
            for stage, seconds in worker["stages"].items():
                into["stages"][stage] = into["stages"].get(stage, 0.0) + seconds
            if report.budget_bytes is not None:
                budgets.setdefault(actor, report.budget_bytes)
        window = _on_job_clock(report, batch, sent)
        batch = max((record.batch + 1 for record in window), default=batch)
        records += window
    budget = next((r.budget_bytes for r in reports if r.budget_bytes is not None), None)
    return RunReport(records, budget_bytes=budget, device_budgets=budgets, workers=workers, wall_seconds=wall_seconds,
                     background=_background_shares(reports, workers),
                     skipped_inputs=sum(r.skipped_inputs for r in reports),
                     rebuilt_batches=sum(r.rebuilt_batches for r in reports),
                     truncated_inputs=sum(r.truncated_inputs for r in reports),
                     accounting_seconds=accounting + sum(r.accounting_seconds for r in reports))


def _on_job_clock(report: RunReport, first: int, sent: float) -> list[BatchRecord]:
    """A window's batches numbered on from ``first`` (each window numbers its own from 0), and each one's
    ``finished`` counted from ``sent``, the clock's time the driver sent the windows, where the window says when its
    run began (``None`` where not): one machine's clock, comparable on one node (across nodes, to their clocks'
    difference)."""
    began = next((worker["began"] for worker in report.workers.values() if "began" in worker), None)
    return [dataclasses.replace(record, batch=first + record.batch,
                                finished=None if began is None or record.finished is None
                                else began - sent + record.finished) for record in report.records]


def _background_shares(reports: list[RunReport], workers: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each background stage's share of the job's wall as :attr:`RunReport.stage_shares` counts the stages': its
    working seconds in each actor (each window's share of its run's wall, in seconds) over that actor's wall,
    averaged over the actors."""
    worked: dict[str, dict[str, float]] = {}
    for report in reports:
        for actor in report.workers:
            into = worked.setdefault(actor, {})
            for stage, share in report.background.items():
                into[stage] = into.get(stage, 0.0) + share * (report.wall_seconds or 0.0)
    timed = [actor for actor, worker in workers.items() if worker["wall"]]
    shares: dict[str, float] = {}
    for actor in timed:
        for stage, seconds in worked.get(actor, {}).items():
            shares[stage] = shares.get(stage, 0.0) + seconds / workers[actor]["wall"] / len(timed)
    return shares


@dataclass
class Windows:
    """How the job's windows run: the actors' keywords, the pool, the rows per window, the rows in all (``n``) and
    those the store held when the job began (``before``)."""

    kwargs: dict[str, Any]
    actors: int
    gpus: float
    window: int
    n: int
    before: int


def _run_windows(ds: Any, windows: Windows, *, progress: bool) -> RunResult:
    """Runs the windows on the actors (each commits its rows to the store), shown by the run's meter; a result
    holding the job's report (:func:`_job_report`). Raises when the windows' rows are not the input's ``n``."""
    import ray.data

    from dynabatch.inference.meter import Meter

    remote = {"num_gpus": windows.gpus} if windows.gpus else {}
    compute = ray.data.ActorPoolStrategy(size=windows.actors, max_tasks_in_flight_per_actor=1)
    out = ds.map_batches(CommandPredictor, fn_constructor_kwargs=windows.kwargs, batch_size=windows.window,
                         compute=compute, **remote)
    # Windows of like lengths, taken long and short in turn (window_order; those of Ray's readers: slices of the
    # input): the rate of the last few windows is a fair rate for the time left, which the meter reads without costs.
    meter = Meter(None, total_rows=windows.n - windows.before, stream=sys.stderr if progress else None,
                  stored=windows.before, inputs=windows.n)
    reports: list[RunReport] = []
    rows, began, sent, first, last = 0, time.perf_counter(), time.time(), None, 0.0
    try:
        for summary in out.iter_batches(batch_size=None, batch_format="numpy"):
            last = time.perf_counter() - began  # a window back: its rows stored (committed before it returns)
            first = first if first is not None else last  # the actors' start, and a window
            for window_rows_, ran, text in zip(summary["rows"], summary["ran"], summary[_REPORT]):
                reports.append(RunReport.from_dict(json.loads(text)))
                rows += int(window_rows_)
                meter.add(None, rows=int(ran), padded_tokens=reports[-1].padded_tokens,
                          real_tokens=reports[-1].real_tokens)
    except Exception as exc:  # noqa: BLE001 (the actor's own error, as one machine's run raises it)
        cause = _cause(exc)
        if cause is exc:
            raise
        raise cause from exc
    finally:
        meter.close()
    report = _job_report(reports, wall_seconds=last, sent=sent, accounting=meter.accounting)
    loads = [w["loaded"] for r in reports for w in r.workers.values() if "loaded" in w]
    logger.info("windows: the first back %.1f s after they were sent, the last %.1f s; the busiest actor's windows "
                "took %.1f s; the actors began loading their model %s s after, loading took %s s (one machine's "
                "clock: comparable on one node)", first or 0.0, last,
                max((w["wall"] for w in report.workers.values()), default=0.0),
                ", ".join(f"{start - sent:.1f}" for start, _ in loads),
                ", ".join(f"{end - start:.1f}" for start, end in loads))
    if rows != windows.n:
        raise ValueError(f"input should read as the {windows.n:,} rows the driver read, but Ray's readers read "
                         f"{rows:,} rows of it on the cluster")
    return RunResult(report=report)


# Ray Data stops a job for an actor whose process ended where it cannot restart it (its node lost, say): the job's
# windows then run once more, each window's stored rows checked and not run again. An actor whose start raised is
# the job's error at once.
JOB_RUNS = 2


def _run_job(ds: Any, windows: Windows, *, progress: bool) -> RunResult:
    """:func:`_run_windows`, run again (up to :data:`JOB_RUNS` in all) where an actor's process ended."""
    for _ in range(JOB_RUNS - 1):
        try:
            return _run_windows(ds, windows, progress=progress)
        except DeadActorError as exc:
            if exc.at_start:
                raise
            logger.warning("%s; the job's windows run again (the rows the store holds are checked, not run again)",
                           exc)
    return _run_windows(ds, windows, progress=progress)


def run_on_ray(command: str, *, model: Callable[[Any], tuple[Any, Callable, int, dict[str, Any]]], texts: Any,
               ids: pa.Array | None, key: str, output: Output, args: argparse.Namespace,
               parser: argparse.ArgumentParser, start: float, what: str, model_line: str,
               run_options: dict[str, Any] | None = None, text_column: str | None = None) -> int:
    """Runs a checked job (its store opened and held by ``output``) on the Ray cluster of ``--ray``; prints the
    summary and returns the exit status, as the command does on one machine.

    ``model``: what each actor loads (:class:`ActorModel`, :class:`GenerateModel`); ``texts``, ``ids``: the corpus
    as the command read it; ``key``: the store's job key; ``what``: the rows' name (``"texts"``); ``run_options``:
    more keywords of :func:`dynabatch.run`; ``text_column``: the input's column of texts where Ray's readers may
    read it (:func:`_read`; ``None``: the driver sends ``texts``)."""
    if job.all_stored(output):  # a finished job's rerun starts no Ray and no actor to run nothing
        place = ClusterPlacement(0, 1, [torch.device("cpu")], cluster=f"no Ray started (--ray={args.ray!r})")
        return job.conclude(command, None, args, parser, place, output, n=len(texts), start=start, model=model_line,
                            what=what, keyed=ids is not None)
    import ray
    import ray.data

    began = time.perf_counter()
    with refusing(parser):
        started = _connect(args.ray)
    logger.info("%s: Ray connected %.1f s after the command started, in %.1f s", command, began - start,
                time.perf_counter() - began)
    try:
        # The command's own meter, summary and error line say it all (an actor's error: _cause).
        logging.getLogger("ray.data").setLevel(logging.CRITICAL)
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars, context.print_on_execution_start = False, False
        context.max_consecutive_actor_init_deaths = ACTOR_START_DEATHS
        # An actor's own error as raised (Ray's task error wrapping it, which _cause opens), not Ray Data's
        # UserCodeException, whose cause does not reach the driver: a stale row is the command's one line, exit 2.
        context.raise_original_map_exception = True
        actors, gpus, window, line = _cluster(args.ray, len(texts), args.batch_size)
        with refusing(parser):
            ds = _read(args, text_column) if text_column is not None else None
        keyed = "id" if ids is not None else "position"
        windows = Windows({"model": model, "batch_size": args.batch_size, "max_input_token_length": 1,  # the actor's
                           "on_oom": args.on_oom, "on_error": args.on_error, "device": "cuda" if gpus else None,
                           "run_kwargs": run_options, "key": key,
                           "output_path": os.path.abspath(output.path),  # actors run in their own folders
                           "id_column": keyed, "keyed_by": keyed, "job": output.store.lock.job,
                           "report_column": _REPORT},
                          actors, gpus, window, len(texts),
                          int(output.before.sum()) if output.before is not None else 0)
        logger.info("%s: windows of %d rows on %s, read by %s", command, windows.window, line,
                    "Ray's readers" if ds is not None else "the driver")
        output.started = True
        try:
            result, tally, error = job.run_accounted(
                lambda: _run_job(ds if ds is not None else _sent(texts, ids, windows.window), windows,
                                 progress=not args.no_progress),
                output, len(texts), parser, what=what, on_error=args.on_error)
        finally:
            output.store.close(job_done=True)  # the actors' holds too: the job is over
        place = ClusterPlacement(0, 1, [torch.device("cuda" if gpus else "cpu")], cluster=line)
        return job.finish(command, result, tally, error, args, place, start=start, model=model_line, what=what,
                          columns=[keyed, "output"])
    finally:
        if started:
            ray.shutdown()


def run_generate(spec: dict[str, Any], args: argparse.Namespace, parser: argparse.ArgumentParser, *,
                 start: float) -> int:
    """``dynabatch generate --ray``: the checked job of the command (``spec``: its prompts, tokenizer, limits,
    options, key and store) on the cluster; chat conversations are rendered here by the tokenizer's template, as
    :func:`dynabatch.generate` renders them."""
    from dynabatch.inference.generation import render_chats

    chat = args.messages_column is not None
    prompts = render_chats(spec["tokenizer"], spec["prompts"], {}) if chat else spec["prompts"]
    options = {**spec["options"], "pad_token_id": spec["tokenizer"].pad_token_id}
    folder = os.path.abspath(args.model)  # as every actor reads it: they run in folders of their own
    model = GenerateModel(folder, spec["dtype"], spec["tokenizer"], spec["max_length"], options, chat, args.seed)
    line = (f"{os.path.basename(folder)}, {str(spec['dtype']).removeprefix('torch.')}, prompts "
            f"of {spec['max_length']} tokens at most, {args.max_new_tokens} new tokens at most, "
            + ("sampled" if args.sample else "greedy"))
    return run_on_ray("generate", model=model, texts=prompts, ids=spec["ids"], key=spec["key"], output=spec["output"],
                      args=args, parser=parser, start=start, what="replies", model_line=line,
                      text_column=None if chat else args.text_column)

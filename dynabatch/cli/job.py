"""What the corpus jobs of the command line share: where they run, the store's key, the run, the summary.

* :func:`placement`: every accelerator of the machine (or ``--devices``), or
  under ``torchrun`` this rank's device (``LOCAL_RANK``); :func:`process_group`
  starts and ends ``torch.distributed`` around the job.
* :func:`job_key`: the store's key, what computed the rows: the command, the
  model's content (:func:`model_digest` of its files, not where they lie) and
  every setting that changes a row. A rerun with the same key resumes; another
  key is refused (:mod:`dynabatch.cli.output`).
* :func:`run_job`: the one call of :func:`dynabatch.run` with several devices or
  ranks; :func:`run_accounted` ends it with what the store holds
  (:class:`~dynabatch.cli.output.Tally`), whatever way the run ended.
* :func:`summary`, :func:`finish`: the screen after the run, ``--report`` and
  ``--plot``, and the exit status: 0 when every input is stored or listed
  failed (with its cause, retried by a rerun), 1 otherwise.
* :func:`add_input_arguments`, :func:`add_run_arguments`: the options every corpus job takes.

The skeleton of a corpus command, so that a new command is one file of what is
its own (its options, its model, its call):

* :func:`command_parser` (then the command's options, then :func:`add_run_arguments`);
* :func:`prepared` runs the command's checks in one line's refusal: :func:`open_input`
  (the shared option checks, the corpus and its columns), :func:`read_input`
  (its ids and inputs, read and checked), :func:`place_job` (the devices and
  ``--max-memory`` there), :func:`open_store` (the store opened under the
  job's key), :func:`check_stored_inputs` (its rows computed from these texts),
  :func:`check_tokens` (no text of no token), :func:`check_first_batch`;
* :func:`running` around the model's load and the run, :func:`conclude` the
  run accounted and summed up: the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from dynabatch._digest import FileDigests, fingerprint
from dynabatch._validation import bad_value, first_few
from dynabatch.cli._checks import Parser, model_files
from dynabatch.cli.output import KEY_FORM, Output, Tally

__all__ = ["EXIT_STATUSES", "MODEL_IDENTITY", "STORED_PIECE", "Placement", "add_input_arguments", "add_run_arguments",
           "all_stored", "check_first_batch", "check_outputs", "check_stored_inputs", "check_tokens", "command_parser",
           "conclude", "digest_cache", "finish", "job_key", "model_digest", "open_input", "open_store", "place_job",
           "placement", "prepared", "process_group", "read_input", "run_accounted", "run_job", "running",
           "sampled_identity", "summary"]

logger = logging.getLogger(__name__)

EXIT_STATUSES = """exit status:
  0    every input stored, or listed failed with its cause (--on-oom skip, --on-error skip; the summary names them)
  1    an input neither stored nor listed failed, or the run stopped on an error (the same command runs the rest)
  2    a bad option or input, refused in one line on stderr (before any model loads where it can be told then)
  130  Ctrl-C; 143 SIGTERM (the rows that finished are kept: the same command resumes)"""
"""The exit statuses of the corpus commands, as their help (and ``dynabatch --help``) says them."""

MODEL_IDENTITY = "v2"
"""The form of a job key's ``model=``: ``v2.`` and a digest of every byte of the model's files."""


def command_parser(sub: Any, name: str, command: Callable[..., int], *, help: str, description: str,  # noqa: A002
                   examples: str, item: str, rows: str) -> Parser:
    """A corpus command's parser (``item``: "document", "prompt"; ``rows``: what the store keys, "rows", "replies"):
    its input, its store and ``--id-column``; the command adds its own options, then :func:`add_run_arguments`."""
    p = sub.add_parser(name, help=help, description=description, epilog=f"{examples}\n\n{EXIT_STATUSES}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_arguments(p, item)
    p.add_argument("--id-column", default=None,
                   help=f"a column of unique ids (str or int) to key {rows} by; default: {rows} keyed by position")
    p.set_defaults(command=command, parser=p)
    return p


def add_input_arguments(p: Parser, what: str) -> None:
    """The corpus in (``what``: "document", "prompt") and the store out."""
    from dynabatch.cli._checks import Tie
    from dynabatch.data.corpus import COMPRESSIONS, FORMATS, SUFFIXES

    p.add_argument("input", help=f"a file, a folder or a glob of files ({', '.join(SUFFIXES)}; a CSV, TSV, JSONL or "
                   f"text file compressed too: {', '.join(COMPRESSIONS)}), or a datasets folder (save_to_disk); a .txt "
                   f"file is one {what} a line")
    p.add_argument("output", help="the store: a new folder, or this job's folder to resume it")
    p.add_tied("--text-column", tie=Tie(default="text"), help=f"the column of {what}s")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help=f"the input's format (default: auto, told by the suffix; --format text reads any file as one "
                   f"{what} a line)")


def _memory_option(value: str) -> str | None:
    """``--max-memory``'s value as the library takes it: ``none`` is ``None`` (the relative rule)."""
    return None if value.strip().lower() == "none" else value


def add_run_arguments(p: argparse.ArgumentParser, what: str, batch_size: int, devices: str) -> None:
    """How the job runs and what it writes besides the store (``what``: "text", "prompt")."""
    from dynabatch.cli._checks import DTYPES

    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the weights (default: auto, float16 on a GPU and float32 on the CPU)")
    p.add_argument("--batch-size", type=int, default=batch_size, help=f"on the CPU, rows of the first (longest) "
                   f"batch, {batch_size} by default; later batches grow under its measured peak memory")
    p.add_argument("--devices", default=None, help=devices)
    p.add_argument("--max-memory", default="auto", type=_memory_option,
                   help="the memory every batch is planned under, read once the model is loaded: auto (default: 90%% "
                   "of a GPU's free memory; on the CPU, none), none (no budget: no batch above the first batch's "
                   "measured peak), a percentage of a GPU's free memory (80%%), a size (20GB, 20GiB) or bytes; "
                   "auto alone with --ray")
    p.add_argument("--on-oom", choices=("raise", "skip"), default="raise",
                   help=f"a {what} that runs out of memory alone: stop (default), or skip it (a rerun retries it)")
    p.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help=f"a {what} whose model call raises: stop, naming it (default), or set it aside, listed with "
                   "its error (a rerun retries it)")
    p.add_argument("--report", type=Path, default=None, help="write the run's report (every batch) as JSON")
    p.add_argument("--plot", type=Path, default=None, help="draw the run's batches as a PNG (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run the job on a Ray cluster, into the same store: auto (the cluster this machine belongs "
                   "to, else a local one; the default with no ADDRESS) or an address as ray.init takes it "
                   "(head:6379, ray://head:10001); one actor per GPU, or per CPU without GPUs")


def check_outputs(args: argparse.Namespace) -> None:
    """``--report`` and ``--plot`` lie outside the store's folder and the input, are two files, can be written (and
    matplotlib imports for ``--plot``); they and the store lie outside a ``--model`` folder, whose every file is the
    model's identity (a store written there would refuse its own resume as another model's)."""
    from dynabatch.cli._checks import check_outputs_apart, check_plot, check_writable

    store = os.path.join(os.path.realpath(args.output), "")
    for flag, path in (("--report", args.report), ("--plot", args.plot)):
        # the store's folder holds its own files alone: the run would write the file there, and the same command
        # again would refuse the folder as no store (checked first: the folder may not be made yet)
        if path is not None and os.path.realpath(path).startswith(store):
            raise ValueError(f"{flag} should be a file outside the output folder (the store holds its own files "
                             f"alone: a rerun would refuse it), but got {flag}={str(path)!r} inside "
                             f"output={args.output!r}")
    check_outputs_apart({"--report": args.report, "--plot": args.plot}, {"input": args.input})
    model = getattr(args, "model", None)
    if model is not None and os.path.isdir(model):  # its files are the model's identity: one written there changes it
        check_outputs_apart({"OUTPUT": args.output, "--report": args.report, "--plot": args.plot}, {"--model": model})
    if args.report is not None:
        check_writable("--report", args.report)
    check_plot(args.plot)


def check_first_batch(texts: Any, tokenizer: Any, *, config: Any, dtype: Any, device: Any, max_memory: Any,
                      batch_size: int, max_length: int, max_tokens: int | None = None, max_new_tokens: int = 0) -> None:
    """Refuses, before any weights load, a ``max_tokens`` (``--max-batch-tokens``) or an absolute ``max_memory``
    (``--max-memory``) that the run's first batch cannot keep, by the run's own rules: the loader's first chunk
    (its longest texts by characters, :class:`~dynabatch.data.streaming.TokenStream`'s) tokenized as the loader
    tokenizes it, planned by the loader's planner under the model's
    :class:`~dynabatch.memory.footprint.Footprint` read from its ``config`` in ``dtype`` (no weights). The library
    names its arguments; :func:`~dynabatch.cli._checks.as_flags` says them as flags.

    ``texts``: what the loader is given; ``None`` (chat prompts, rendered by the run) judges one row of one token,
    the least any prompt holds. A percentage is read on ``device`` now, before the weights take their share: the
    run reads it again once they have, and refuses then what only the loaded model rules out.
    """
    import copy

    import numpy as np

    from dynabatch.data.streaming import FIRST_CHUNK
    from dynabatch.data.text_source import open_texts
    from dynabatch.data.tokenization import ParallelTokenizer
    from dynabatch.memory.footprint import Footprint
    from dynabatch.sampling.estimators import BudgetEstimator
    from dynabatch.sampling.planner import BatchPlanner, PlanSettings

    estimator = BudgetEstimator(Footprint.from_model(config, max_new_tokens=max_new_tokens, dtype=dtype),
                                max_memory=max_memory, device=device)
    if estimator.relative and max_tokens is None:
        return
    lengths = np.ones(1, dtype=np.int64)
    if texts is not None:
        source, _ = open_texts(texts, "skip")  # a text that is not one is the run's to refuse, by its rule
        first = _longest_by_characters(source.char_lengths(), max(FIRST_CHUNK, 4 * batch_size))
        if not first.size:
            return
        tokenize = ParallelTokenizer(copy.deepcopy(tokenizer), max_length, {}, cores=1)  # as the stream does
        lengths = tokenize(source.take(first)).lengths
    BatchPlanner(lengths, PlanSettings(batch_size, max_length, max_tokens=max_tokens), estimator).sizes()


def check_tokens(texts: Any, tokenizer: Any, max_length: int, ids: Any, flag: str, column: str) -> None:
    """Refuses, before any weights load, the texts of ``flag`` (``column``) that the loader's tokenization of
    ``tokenizer`` turns into no token: the loader's bad input, which a stream finds only as it tokenizes the chunk
    (the shortest texts, last: after most of the corpus ran and was stored). The candidates, texts empty or of
    characters a tokenizer's normalizer may drop alone (whitespace, control, zero-width, combining:
    :meth:`~dynabatch.data.text_source.TextSource.no_token_candidates`, one RE2 pass of Arrow's), are tokenized once
    each, as the loader does; a tokenizer adding special tokens to every text refuses none. Rows are named by
    position, and by their ``ids`` (``--id-column``) where given."""
    import copy

    import numpy as np

    from dynabatch.data.tokenization import ParallelTokenizer

    positions, distinct, which = texts.no_token_candidates()
    if not distinct:
        return
    lengths = ParallelTokenizer(copy.deepcopy(tokenizer), max_length, {}, cores=1)(distinct).lengths
    bad = positions[np.isin(which, np.flatnonzero(lengths == 0))]
    if not bad.size:
        return
    named = f" (--id-column {first_few([repr(i) for i in ids.take(bad[:6]).to_pylist()])})" if ids is not None else ""
    raise ValueError(f"{flag} should name a column of texts that each hold a token once tokenized (the model's "
                     f"tokenizer adds no special token to a text: an empty one would be padding alone), but got "
                     f"{flag}={column!r} with {bad.size} texts of no token (empty, or of characters its tokenizer "
                     f"drops: whitespace, control, zero-width), at rows {first_few(bad.tolist())}{named}: fill or "
                     "drop them")


def prepared(command: str, args: argparse.Namespace, parser: argparse.ArgumentParser,
             prepare: Callable[[argparse.Namespace], Any]) -> Any:
    """``prepare(args)``: every check of a ``command`` job and its store opened, before any weights load; a refusal
    is one line, exit status 2 (the tied options settled first, :func:`~dynabatch.cli._checks.settle`, then
    ``--ray`` checked, where given)."""
    from dynabatch.cli._checks import refusing, settle

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with refusing(parser):
        settle(args, parser)
        if args.ray is not None:
            from dynabatch.cli import on_ray  # Ray's path (torch and the actors' predictor): only when asked for

            on_ray.check_arguments(args)
        return prepare(args)


def open_input(args: argparse.Namespace, flag: str, column: str, kinds: tuple[str, ...]) -> Any:
    """The checks every corpus command makes of its options (``--batch-size``, ``--max-length``, ``--max-memory``,
    ``--report``, ``--plot``), then its corpus opened (:mod:`dynabatch.cli.corpus`), with the column of its inputs
    (``flag``: the option naming ``column``, of ``kinds``) and ``--id-column`` checked; no text read yet."""
    from dynabatch.cli._checks import check_positive
    from dynabatch.cli.corpus import open_corpus
    from dynabatch.memory.units import check_max_memory

    check_positive(args, "batch_size", "max_length")
    check_max_memory(args.max_memory, "--max-memory")
    check_outputs(args)
    corpus = open_corpus(args.input, args.format, exclude=args.output,
                         keep=[c for c in (column, args.id_column) if c is not None])
    corpus.require(flag, column, kinds)
    if args.id_column is not None:
        corpus.require("--id-column", args.id_column, ("string", "integer"))
    return corpus


def place_job(args: argparse.Namespace, *, one_device: str | None = None) -> Placement:
    """Where the job runs (:func:`placement` of ``--devices``), ``--max-memory`` checked there; ``one_device``: the
    rule of a command that runs on one device (more refused, naming it)."""
    from dynabatch.cli._checks import check_device_names
    from dynabatch.memory.units import check_max_memory

    devices = check_device_names(args.devices)
    if one_device is not None and devices is not None and len(devices) > 1:
        raise bad_value("--devices", one_device, args.devices)
    place = placement(devices)
    if one_device is not None:
        place.devices = place.devices[:1]
    check_max_memory(args.max_memory, "--max-memory", devices=place.devices)
    return place


def read_input(corpus: Any, args: argparse.Namespace, read: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``(ids, inputs)``: the ids of ``--id-column`` (``None`` without it) and ``read(corpus)``, the command's inputs,
    read right after :func:`open_input`, before the output folder, the devices and the model (whose imports and
    folder reads take seconds): the checks of the corpus's values (a ragged CSV row, missing or repeated ids,
    missing texts, bad conversations) refuse it in the time of the one read the run needs anyway."""
    ids = corpus.ids(args.id_column) if args.id_column is not None else None
    return ids, read(corpus)


def open_store(output: Output, args: argparse.Namespace, key: str, n: int, ids: Any) -> str:
    """``output``'s store opened under ``key`` for the ``n`` inputs (``ids``: of ``--id-column``); a store another
    job writes, or one of rows computed otherwise, is refused now. Returns the key the run is to pass: ``key``, or
    this job's key as the store holds it, written before keys said their form (:meth:`Output.open`)."""
    return output.open(key=key, n=n, ids=ids, id_column=args.id_column)


STORED_PIECE = 65_536
"""Stored texts tokenized at a time by :func:`check_stored_inputs`: their tokens are dropped after each piece (the
hashes kept, 8 bytes a row), so a store of millions of rows is checked in flat memory."""


def check_stored_inputs(output: Output, texts: Any, tokenizer: Any, max_length: int, *,
                        chat_template_kwargs: dict[str, Any] | None = None) -> None:
    """Refuses, before any weights load, a store whose rows were computed from other texts at the same ids or
    positions (another ``--text-column`` or ``--messages-column``, an edited or reordered corpus): the texts of the
    rows ``output``'s store holds are tokenized as the loader tokenizes them (``tokenizer`` at ``max_length``), in
    pieces of :data:`STORED_PIECE`, and their input hashes checked by the store's own rule
    (:meth:`~dynabatch.inference.store.Store.check_inputs`), which the run would apply only once the model loaded.
    ``texts``: a :class:`~dynabatch.data.text_source.TextSource`, or, where ``chat_template_kwargs`` is given, the
    chat conversations, rendered and tokenized as :func:`dynabatch.generate` does with those keywords."""
    import copy

    import numpy as np

    from dynabatch.data.input_hashes import token_store_hashes
    from dynabatch.data.tokenization import ParallelTokenizer

    stored = np.flatnonzero(output.store.done)
    if not stored.size:
        return
    take, tokenizer_kwargs = (texts.take, {}) if chat_template_kwargs is None else _chat_taker(texts, tokenizer,
                                                                                               chat_template_kwargs)
    # as the loader does, on every core
    tokenize = ParallelTokenizer(copy.deepcopy(tokenizer), max_length, tokenizer_kwargs)
    hashes = np.concatenate([token_store_hashes(tokenize(take(piece), positions=piece))
                             for piece in np.array_split(stored, -(-stored.size // STORED_PIECE))])
    output.store.check_inputs(stored, hashes)


def _chat_taker(conversations: list, tokenizer: Any,
                chat_template_kwargs: dict[str, Any]) -> tuple[Callable[[Any], list[str]], dict[str, Any]]:
    """``(take, tokenizer_kwargs)`` of :func:`check_stored_inputs` for chats: ``take(rows)`` the texts
    :func:`dynabatch.generate` renders for the conversations at ``rows`` (only those, a piece at a time), and the
    keywords its loader tokenizes them with."""
    from dynabatch.inference.generation import RENDERED_CHAT_TOKENIZER_KWARGS, render_chats

    def take(rows: Any) -> list[str]:
        return render_chats(tokenizer, [conversations[i] for i in rows.tolist()], chat_template_kwargs)

    return take, dict(RENDERED_CHAT_TOKENIZER_KWARGS)


@contextlib.contextmanager
def running(place: Placement, output: Output) -> Iterator[None]:
    """Around the model's load and the run: ``torch.distributed`` under ``torchrun``, and the store closed after
    (taken back, where the run never began)."""
    try:
        with process_group(place):
            yield
    finally:
        output.end()


def all_stored(output: Output) -> bool:
    """Whether ``output``'s store held every input when it was opened (none failed, none missing): a rerun of a
    finished job, which loads no model to run nothing (:func:`conclude` with no call)."""
    return output.before is not None and bool(output.before.all())


def _nothing_to_run() -> Any:
    """The run of a job whose store holds every input: no batch."""
    from dynabatch.inference.results import RunResult

    return RunResult()


def conclude(command: str, call: Callable[[], Any] | None, args: argparse.Namespace, parser: argparse.ArgumentParser,
             place: Placement, output: Output, *, n: int, start: float, model: str, what: str, keyed: bool) -> int:
    """Runs ``call()`` (the run of the ``n`` inputs into ``output``'s store; ``None`` where :func:`all_stored`: no
    model was loaded) and ends the job: what the store holds (:func:`run_accounted`), ``--report``, ``--plot`` and
    the summary (:func:`finish`); returns the exit status. ``keyed``: rows keyed by ``--id-column`` (else by
    position)."""
    output.started = True
    call = call if call is not None else _nothing_to_run
    result, tally, error = run_accounted(call, output, n, parser, what=what, on_error=args.on_error)
    return finish(command, result, tally, error, args, place, start=start, model=model, what=what,
                  columns=["id" if keyed else "position", "output"])


def _longest_by_characters(chars: Any, k: int) -> Any:
    """The positions of the streaming loader's first chunk: the ``k`` texts longest in characters, ties to the
    earlier position (:class:`~dynabatch.data.streaming.TokenStream`'s stable order), texts that are not str (``-1``)
    left out; found in linear time, no sort of the corpus.

    Example:
        >>> import numpy as np
        >>> _longest_by_characters(np.array([3, 9, 5, 9, -1, 5]), 3).tolist()
        [1, 3, 2]
    """
    import numpy as np

    k = min(k, int((chars >= 0).sum()))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    kth = np.partition(chars, len(chars) - k)[len(chars) - k]  # the k-th longest
    above = np.flatnonzero(chars > kth)
    first = np.concatenate([above, np.flatnonzero(chars == kth)[: k - len(above)]])
    return first[np.argsort(-chars[first], kind="stable")]


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
    import torch

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


def digest_cache() -> Path:
    """The file of remembered file digests: under ``$DYNABATCH_CACHE_DIR`` (else ``~/.cache/dynabatch``), never in
    the model's folder."""
    from dynabatch.memory.classifier import cache_dir

    return cache_dir() / "file-digests.json"


def model_digest(folder: str) -> str:
    """The model's identity: ``"v2."`` and a digest of every file's name (relative to ``folder``) and every byte
    (``.md`` and hidden files left out), so any changed byte of the weights changes it, and the same files
    elsewhere keep it. Files unchanged since an earlier run (size, times, inode: :class:`FileDigests`) are not
    read again. The earlier identity (16 hex digits, no ``"v2."``) sampled 16 blocks of each large file.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "config.json").write_text('{"hidden_size": 32}')
        >>> before = model_digest(str(folder))
        >>> _ = (folder / "config.json").write_text('{"hidden_size": 64}')
        >>> before == model_digest(str(folder)), before[:3], len(before)
        (False, 'v2.', 19)
    """
    from dynabatch.data.workers import available_cores

    with FileDigests(digest_cache(), cores=available_cores()).held() as files:  # torchrun's ranks: one hashes
        parts = [(path.relative_to(folder).as_posix(), files.digest(path)) for path in model_files(folder)]
    if files.hashed_bytes:
        logger.info("model identity of %s: %.2f GB read", folder, files.hashed_bytes / 1e9)
    return f"{MODEL_IDENTITY}.{fingerprint(*parts)}"


def sampled_identity(digest: str) -> bool:
    """Whether a job key's ``model=`` value is the earlier identity, which sampled the weights (16 hex digits)."""
    return len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)


def job_key(command: str, model_folder: str, **settings: Any) -> str:
    """The store's key: ``"embed key_form=2 model=DIGEST pooling=mean ..."``: the key's form
    (:data:`~dynabatch.cli.output.KEY_FORM`: a store keyed in an earlier form is refused saying so), then what
    computed the rows (the model's files, every setting that changes a row, as applied), never where the model
    lies; read by a person."""
    named = " ".join(f"{k}={v}" for k, v in settings.items())
    return f"{command} key_form={KEY_FORM} model={model_digest(model_folder)} {named}"


def run_job(make_fn: Callable[[torch.device], Callable], loader: Any, place: Placement, output: Output,
            **options: Any) -> Any:
    """The one call of :func:`dynabatch.run` on several devices or ranks, into ``output``'s store:
    ``make_fn(device)`` gives ``fn(batch)``.

    Under ``torchrun`` the ranks claim chunks of the corpus (each its own
    device); in one process, every device of ``place`` takes batches from one
    shared queue. ``options`` are ``run``'s (``key``, ``on_oom``, ...).
    """
    from dynabatch import run

    options["output_path"] = output.store  # the store the command opened (and holds) before the model loaded
    if place.world > 1:
        return run(make_fn(place.devices[0]), loader, device=place.devices[0], ranks="claim", **options)
    if len(place.devices) > 1:
        return run(loader=loader, make_fn=make_fn, devices=place.devices, **options)
    return run(make_fn(place.devices[0]), loader, device=place.devices[0], **options)


def _with_notes(exc: BaseException) -> str:
    """An error's first line and its notes (the inputs it names), on one line."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    notes = [" ".join(str(n).split()) for n in getattr(exc, "__notes__", ()) if str(n).strip()]
    return line + (f" ({'; '.join(notes)})" if notes else "")


def _unaccounted(tally: Tally, what: str) -> str:
    """How many inputs, and which, are neither stored nor listed failed."""
    shown = f" ({tally.shown(tally.missing)})" if tally.missing.size else ""
    return f"{tally.missing.size:,} of {tally.n:,} {what} are neither stored nor listed failed{shown}"


def run_accounted(call: Callable[[], Any], output: Output, n: int, parser: argparse.ArgumentParser, *,
                  what: str, on_error: str = "raise") -> tuple[Any, Tally, BaseException | None]:
    """Runs ``call()`` (the run) and reads what ``output``'s store holds for the ``n`` inputs after it:
    ``(result or None, tally, error or None)``.

    A run that cannot account for every input (``IncompleteRunError``) ends
    here with its error: the summary says what is missing. A run refusing its
    inputs (``ValueError``, ``TypeError``: a store of other texts under the same
    ids, ``fn`` raising on named inputs) is one line on stderr, exit status 2,
    saying ``--on-error skip`` (``on_error``: the run's) where the error names
    inputs and the run stopped on it; the library's arguments it names are named by their flags
    (:func:`~dynabatch.cli._checks.as_flags`). Any other error is printed with
    its traceback, then what the store holds: exit status 1. Ctrl-C (SIGTERM) is one line of what the store kept,
    exit status 130 (143).
    """
    from dynabatch.cli._checks import as_flags, stopped_by
    from dynabatch.inference.runner import IncompleteRunError

    try:
        result = call()
    except KeyboardInterrupt as stop:  # the run stopped its workers and committed what finished: say what was kept
        name, status = stopped_by(stop)
        tally = output.tally(n)
        sys.stderr.write(f"{parser.prog}: stopped ({name}): {tally.stored:,} of {n:,} {what} stored in {output.path}; "
                         "the same command resumes\n")
        raise SystemExit(status) from None
    except Exception as exc:  # noqa: BLE001 (every way the run ends is followed by what the store holds)
        if isinstance(exc, IncompleteRunError):
            return None, output.tally(n, exc.partial), exc
        if isinstance(exc, (ValueError, TypeError)):
            named = getattr(exc, "__notes__", None) and on_error == "raise"
            hint = ": --on-error skip sets the inputs it names aside (a rerun retries them)" if named else ""
            parser.error(as_flags(_with_notes(exc)) + hint)
        traceback.print_exc()
        tally = output.tally(n)
        sys.stderr.write(f"{parser.prog}: error: the run stopped ({type(exc).__name__}: {_with_notes(exc)}); "
                         f"{tally.stored:,} of {n:,} {what} stored in {output.path}; {_unaccounted(tally, what)}: the "
                         "same command again runs them\n")
        raise SystemExit(1) from None
    return result, output.tally(n, result), None


def _rate(value: float | None, unit: str) -> str:
    return f"{value:,.0f} {unit}/s" if value is not None else f"- {unit}/s"


def _failed_lines(tally: Tally, what: str, report_path: Path | None) -> list[str]:
    """The failed and missing inputs, the first few named; where each failure's cause is listed (``report_path``:
    ``--report``'s file, ``None`` when not given)."""
    lines = []
    if tally.failures:
        failed = sorted(tally.failures)
        named = failed[:3]
        causes = "; ".join(f"{name!r}: {tally.failures[p][:120]}" for p, name in zip(named, tally.names(named)))
        listed = f"each with its cause in {report_path}" if report_path is not None else \
            "--report FILE lists each with its cause"
        lines.append(f"  failed     {len(failed):,} {what} listed failed ({causes}{'; ...' if len(failed) > 3 else ''})"
                     f": {listed}; the same command again retries them")
    if tally.missing.size:
        lines.append(f"  missing    {tally.missing.size:,} {what} neither stored nor listed failed "
                     f"({tally.shown(tally.missing)}): the same command again runs them")
    return lines


def _read_it(output: str, columns: list[str]) -> str:
    """How to read the store: its rows lie in the order they were stored (longest texts first, shard by shard), so
    a store keyed by position is sorted by it; one keyed by id is matched to the corpus by id."""
    read = f"pyarrow.dataset.dataset({output!r}).to_table(columns={columns!r})"
    if columns[0] == "position":
        return f"  read it    {read}.sort_by('position')  (input order; or pandas, polars, datasets)"
    return (f"  read it    {read}  (rows in the order stored, not the input's: match them to the corpus by id; or "
            "pandas, polars, datasets)")


def summary(command: str, report: Any, tally: Tally, *, output: str, what: str, model: str, place: Placement,
            seconds: float, columns: list[str], report_path: Path | None = None) -> str:
    """The screen after a job: what the store holds (``tally``), time, throughput, padding, out-of-memory events
    (``report``: this process's run; ``None`` when the run ended without one), how to read the store, what failed
    (``report_path``: ``--report``'s file, where each failure is listed)."""
    lines = [(f"dynabatch {command}: {tally.stored:,} of {tally.n:,} {what} stored in {output} ({tally.now:,} run "
             f"now, {tally.before:,} stored before)"),
             f"  model      {model}, on {place.describe()}"]
    if report is not None and not report.batches:  # nothing left to run: no rate, padding or bound to speak of
        done = "nothing to run: every one was stored before" if tally.before == tally.n else "no batch ran"
        lines.append(f"  time       {seconds:.1f} s in all; {done}")
    elif report is not None:
        efficiency = f"{report.padding_efficiency:.0%}" if report.padding_efficiency is not None else "-"
        ran = f" (rank {place.rank}'s)" if place.world > 1 else ""
        lines += [(f"  time       {seconds:.1f} s in all, {report.seconds:.1f} s running {report.batches:,} batches"
                  f"{ran}: {_rate(report.rows_per_s, what)}, {_rate(report.tokens_per_s, 'tokens')}"),
                  f"  padding    {efficiency} of the padded tokens were real tokens",
                  (f"  memory     {report.oom_events} out-of-memory events, {report.oom_splits} batches split after "
                  f"one, {report.pre_split_batches} split before running")]
        if report.bound is not None:
            lines.append(f"  bound      {report.bound}{ran}")
    if report is not None and report.truncated_inputs:  # counted by dynabatch.generate, whose warning names them
        lines.append(f"  truncated  {report.truncated_inputs:,} of the inputs were longer than --max-length tokens, "
                     "cut to it on the tokenizer's truncation_side (their outputs are of the cut text): a larger "
                     "--max-length keeps them whole, or leave them out")
    if tally.others:  # a reader of the whole store (the read-it line) reads them too: never a silent extra row
        keys = "ids" if tally.ids is not None else "positions"
        lines.append(f"  others     {tally.others:,} rows stored besides one per input of this corpus (of inputs not in "
                     f"it: an earlier, other corpus'), read by whatever reads the whole store: keep this corpus' "
                     f"{keys} when you read it, or use another output folder for this corpus alone")
    lines += [f"  store      {os.path.abspath(output)} (Parquet, one row per input: {', '.join(columns)})",
              _read_it(output, columns)]
    return "\n".join(lines + _failed_lines(tally, what, report_path))


def _write_report(path: Path, report: Any, tally: Tally) -> None:
    """The run's report (every batch) with what the store holds: ``"store"``, from :meth:`Tally.to_dict`."""
    from dynabatch.inference.report import RunReport

    (report if report is not None else RunReport()).to_json(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["store"] = tally.to_dict()
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def finish(command: str, result: Any, tally: Tally, error: BaseException | None, args: argparse.Namespace,
           place: Placement, *, start: float, model: str, what: str, columns: list[str]) -> int:
    """Writes ``--report`` and ``--plot`` (a rank's own, named ``.rankN`` under torchrun but for rank 0), prints the
    summary (rank 0) and returns the exit status: 1 when an input is neither stored nor listed failed, or the run
    ended with an error; else 0."""
    report = result.report if result is not None else None
    written = []
    for path, write in ((args.report, lambda p: _write_report(p, report, tally)),
                        (args.plot, report.plot if report is not None else None)):
        if path is None or write is None:
            continue
        if not place.main:
            path = path.with_name(f"{path.stem}.rank{place.rank}{path.suffix}")
        write(path)
        written.append(str(path))
    if place.main:
        print(summary(command, report, tally, output=args.output, what=what, model=model, place=place,
                      seconds=time.perf_counter() - start, columns=columns, report_path=args.report))
        for path in written:
            print(f"  wrote      {path}")
    sys.stdout.flush()
    if error is None and not tally.missing.size:
        return 0
    if place.main:
        raised = f"the run raised {type(error).__name__}: {_with_notes(error)}; " if error is not None else ""
        sys.stderr.write(f"dynabatch {command}: error: {raised}{_unaccounted(tally, what)}: the same command again "
                         "runs them\n")
    return 1

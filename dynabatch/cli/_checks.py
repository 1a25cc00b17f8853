"""What every command of ``python -m dynabatch`` checks before a model loads, written once.

A command refuses a bad option with one line on stderr and exit status 2, no
traceback and no usage dump (:class:`Parser`): the message follows the
library's template, ``"{flag} should be {rule}, but got {flag}={value!r}"``,
so the flag, the rule and the value are named. The checks here raise
``ValueError`` (or ``TypeError``) with such a message, and the command turns
it into that line (:func:`refusing`).

What the library's own rules refuse (a ``max_tokens`` the first batch cannot
keep, a ``max_memory`` below one row of the longest text: judged before the
weights load by :func:`dynabatch.cli.job.check_first_batch`, and again by the
run) names the library's arguments; :func:`as_flags` says it in the flags the
user typed (:data:`FLAGS`), wherever a command turns an error into that line.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fnmatch
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from dynabatch._distribution import extra
from dynabatch._validation import bad_value

__all__ = ["DTYPES", "FLAGS", "INTERRUPTED", "TERMINATED", "WEIGHTS", "DefaultsFormatter", "Parser", "Terminated", "Tie",
           "as_flags", "check_device_names", "check_dtype", "check_model_folder", "check_outputs_apart", "check_plot",
           "check_positive", "check_writable", "flag_of", "model_files", "refusing", "settle", "stop_on_sigterm",
           "stopped_by"]

DTYPES = ("auto", "float32", "float16", "bfloat16")
INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)."""
TERMINATED = 143
"""The exit status of a command stopped by SIGTERM (128 + SIGTERM)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop, a preemption), raised in the main thread where Ctrl-C raises
    ``KeyboardInterrupt``, so that a run stops as after Ctrl-C: every worker after its call in progress, the rows that
    finished committed, the store's job lock given up (a rerun on another machine need not wait out its lease)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated`, in the main thread (elsewhere Python sets no handler)
    and not under ``torchrun``: its agent passes a SIGTERM on to every rank and waits 30 s for them before SIGKILL,
    and a rank waiting in a collective for a rank that is gone runs no Python until then, so a rank ends at once, as
    SIGKILL would end it (its store resumes either way)."""
    if threading.current_thread() is not threading.main_thread() or "TORCHELASTIC_RUN_ID" in os.environ:
        yield
        return

    def terminated(signum: int, frame: Any) -> NoReturn:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_by(stop: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped a command, as its line on stderr names it, and its exit status."""
    return ("SIGTERM", TERMINATED) if isinstance(stop, Terminated) else ("Ctrl-C", INTERRUPTED)

FLAGS = {
    "batch_size": "--batch-size",
    "max_tokens": "--max-batch-tokens",
    "max_memory": "--max-memory",
    "max_input_token_length": "--max-length",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "on_oom": "--on-oom",
    "on_error": "--on-error",
}
"""The library's argument names that the corpus commands pass a flag's value to, and those flags."""

_NONE = {"--max-memory": "none"}  # a flag's word for the library's None, where it has one
_NAMED = re.compile(r"(?<![\w.-])(" + "|".join(FLAGS) + r")(=None\b)?(?!\w)")
_STORE = (("output_path=", "output="), ("another output_path", "another output folder"),
          (", or give the loader ids= to key rows by id (a grown or reordered corpus)",
           " (with --id-column, a grown or reordered corpus reruns only its new ids)"))
"""The run's refusals of its store (``output_path``, the command's ``OUTPUT``), in the command's words."""


def as_flags(message: str) -> str:
    """A library refusal of one of :data:`FLAGS` (the library's template starts with the argument's name) with
    each of them named by its flag (``max_tokens=3`` is ``--max-batch-tokens=3``; ``max_memory=None`` is
    ``--max-memory=none``); a refusal of the run's store (``output_path``) naming the command's ``output`` and
    ``--id-column``; any other message (a command's own, in flags already) as it is.

    Example:
        >>> as_flags("max_tokens should be at least 30 x 9 = 270 padded tokens (the batch_size=30 longest texts); "
        ...          "pass a larger max_tokens, or max_memory=None, but got max_tokens=3")
        '--max-batch-tokens should be at least 30 x 9 = 270 padded tokens (the --batch-size=30 longest texts); pass a larger --max-batch-tokens, or --max-memory=none, but got --max-batch-tokens=3'
        >>> as_flags("--temperature should be given with --sample (greedy decoding has no temperature)")
        '--temperature should be given with --sample (greedy decoding has no temperature)'
        >>> as_flags("output_path='out' should hold results of these inputs at their positions, but got 1 stored "
        ...          "rows computed from other inputs (positions 0): ...; use another output_path, or give the loader "
        ...          "ids= to key rows by id (a grown or reordered corpus)")
        "output='out' should hold results of these inputs at their positions, but got 1 stored rows computed from other inputs (positions 0): ...; use another output folder (with --id-column, a grown or reordered corpus reruns only its new ids)"
    """
    if message.startswith("output_path"):  # the store the command opened at OUTPUT, and the ids of --id-column
        for library, command in _STORE:
            message = message.replace(library, command)
        return message
    if message.split(" ", 1)[0] not in FLAGS:
        return message

    def flag(found: re.Match) -> str:
        name = FLAGS[found.group(1)]
        if found.group(2) is None:
            return name
        return f"{name}={_NONE[name]}" if name in _NONE else f"no {name}"

    return _NAMED.sub(flag, message)


def flag_of(name: str) -> str:
    """The flag of an option's name in the parsed arguments (``max_new_tokens`` is ``--max-new-tokens``)."""
    return f"--{name.replace('_', '-')}"


@dataclass(frozen=True)
class Tie:
    """What an option of :meth:`Parser.add_tied` means something only beside: ``needs`` (``(name, value)``: it is
    given only where the option ``name`` holds ``value``, ``True`` for a switch) or ``excludes`` (``name``: it is
    given only where that option is left out); ``why``: the reason its refusal says; ``default``: its value where
    it is left out."""

    default: Any = None
    needs: tuple[str, Any] | None = None
    excludes: str | None = None
    why: str = ""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``prog: error: message``), exit status 2, and
    whose tied options (:meth:`add_tied`) tell a given value from their default (:func:`settle`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: list[str] = []  # every long option, for the likely one of a misspelled option
        super().__init__(*args, **kwargs)
        self.ties: dict[str, Tie] = {}

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.flags += [flag for flag in action.option_strings if flag.startswith("--")]
        return action

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.splitlines()[0] if message else 'bad arguments'}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """As argparse's, but an option no parser knows is refused by the command's own parser (argparse names the
        top one: ``dynabatch: error``), with the command's option it is likely a misspelling of."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            where = getattr(parsed, "parser", self)  # the command's parser (each command sets it)
            close = {flag for extra in extras if extra.startswith("--")
                     for flag in difflib.get_close_matches(extra.split("=", 1)[0], where.flags, n=1, cutoff=0.75)}
            hint = f" (did you mean {' or '.join(sorted(close))}?)" if close else ""
            where.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def add_tied(self, *flags: str, tie: Tie, help: str, **kwargs: Any) -> argparse.Action:  # noqa: A002
        """An option that means something only beside another (``tie``): its parser default is ``None``, so
        that :func:`settle` tells it given from left out before it sets ``tie.default``; the help names that
        default."""
        said = f" (default: {tie.default})" if tie.default is not None else ""
        action = self.add_argument(*flags, default=None, help=help + said, **kwargs)
        self.ties[action.dest] = tie
        return action


def settle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuses a tied option (:meth:`Parser.add_tied`) given where it means nothing: beside the option it excludes,
    or without the value of the one it needs; then sets those left out to their defaults. The one place the
    command line resolves them, before any other check reads them."""
    ties = getattr(parser, "ties", {})
    for name, tie in ties.items():
        value = getattr(args, name)
        if value is None:
            continue
        if tie.excludes is not None and (other := getattr(args, tie.excludes)) is not None:
            flag, against = flag_of(name), flag_of(tie.excludes)
            raise ValueError(f"{flag} should be left out with {against} ({tie.why}), but got {flag}={value!r} and "
                             f"{against}={other!r}")
        if tie.needs is not None and getattr(args, tie.needs[0]) != tie.needs[1]:
            wanted, holds = flag_of(tie.needs[0]), tie.needs[1]
            raise bad_value(flag_of(name), f"given with {wanted}{'' if holds is True else f' {holds}'} ({tie.why})",
                            value)
    for name, tie in ties.items():
        if getattr(args, name) is None:
            setattr(args, name, tie.default)


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help naming each option's default, but where it is ``None`` (such an option's help says what it means; a tied
    option's, :meth:`Parser.add_tied`, names its default itself) or the option is a flag (off unless given); the
    description and the examples after the options kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        plain = action.default is None or action.nargs == 0
        return action.help if plain else super()._get_help_string(action)


@contextlib.contextmanager
def refusing(parser: argparse.ArgumentParser, *errors: type[BaseException]) -> Iterator[None]:
    """Turns the errors a check raises (``ValueError``, ``TypeError`` and ``errors``) into ``parser.error``, the
    library's arguments named by their flags (:func:`as_flags`)."""
    try:
        yield
    except (ValueError, TypeError, *errors) as exc:
        parser.error(as_flags(str(exc).strip() or type(exc).__name__))


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Each option of ``names`` that is set is an integer >= 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise bad_value(flag_of(name), "a positive integer", value)


def check_writable(flag: str, path: Path) -> None:
    """``path`` can be written as a file (checked by opening it; a file made for the check is removed)."""
    value = str(path)
    if path.is_dir():
        raise ValueError(f"{flag} should be a file to write, but got {flag}={value!r}, a folder")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} should be a file in an existing folder, but got {flag}={value!r} "
                         f"(no folder {str(path.parent)!r})")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} should be a file this user can write, but got {flag}={value!r} "
                         f"({exc.strerror})") from exc


def _reads(path: str, source: str) -> bool:
    """Whether an input ``source`` (a file, a folder, a glob) holds the file ``path`` (a real path), or would once it
    is written."""
    if any(c in source for c in "*?["):
        return fnmatch.fnmatch(path, os.path.abspath(source))
    there = os.path.realpath(source)
    return path == there or os.path.isdir(there) and path.startswith(os.path.join(there, ""))


def check_outputs_apart(outputs: dict[str, Path | None], inputs: dict[str, Any]) -> None:
    """Each file an option writes (``outputs``: flag to path, ``None`` where not given) is none of the others' and
    lies outside each input the command reads (``inputs``: name to a file, folder or glob): writing it there would
    overwrite what another option wrote, or the input itself."""
    written: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if real in written:
            raise ValueError(f"{flag} should be another file than {written[real]} (each writes its own file), but got "
                             f"{flag}={str(path)!r}")
        written[real] = flag
        for name, source in inputs.items():
            if source is not None and _reads(real, str(source)):
                raise ValueError(f"{flag} should lie outside {name} (the command reads it: writing there would "
                                 f"overwrite or add to it), but got {flag}={str(path)!r} and {name}={str(source)!r}")


def check_plot(path: Path | None) -> None:
    """``--plot`` can be written, matplotlib imports, and its suffix is a format matplotlib writes (none: its
    default, PNG): a file matplotlib cannot write was found only once the run had ended, as a traceback."""
    if path is None:
        return
    check_writable("--plot", path)
    try:
        import matplotlib  # noqa: F401  (itself first: a submodule already imported is found without it)
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ValueError(f"--plot should be given with matplotlib installed ({extra('plot')}), but got "
                         f"--plot={str(path)!r} and {exc}") from exc
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix and suffix not in formats:
        raise bad_value("--plot", f"a file of a format matplotlib writes ({', '.join('.' + f for f in formats)})",
                        str(path))


WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
"""The suffixes of the files a model's weights are saved in (an index of shards ends in ``.json``: its shards in
these)."""


def model_files(folder: str) -> list[Path]:
    """The files of a model folder that make its identity: every file but ``.md`` and hidden ones (a hub cache's
    ``.cache`` folder, an editor's backups), in path order, under the names the folder gives them. A linked folder
    in it (a sentence-transformers module's ``2_Dense`` linked to where it was trained) is read through, as the
    model's load reads it; a link back to a folder it is in (a loop) is not. The one walk of a model folder: its
    identity (:func:`dynabatch.cli.job.model_digest`) and its weights (:func:`check_model_folder`)."""
    root = Path(folder)
    files = []
    within = {os.fspath(root): {os.path.realpath(root)}}  # each folder walked: the real folders it lies in
    for where, folders, names in os.walk(root, followlinks=True):
        outer = within.pop(where)
        kept = [f for f in folders if not f.startswith(".") and os.path.realpath(os.path.join(where, f)) not in outer]
        within.update({os.path.join(where, f): outer | {os.path.realpath(os.path.join(where, f))} for f in kept})
        folders[:] = kept
        files += [Path(where, name) for name in names if not name.startswith(".") and not name.endswith(".md")
                  and os.path.isfile(os.path.join(where, name))]
    return sorted(files)


def check_model_folder(flag: str, folder: str) -> Any:
    """A local Hugging Face model folder: its config (read, no weights), and a file of weights among its files
    (:func:`model_files`: in it or a folder under it, a sentence-transformers module's, linked folders read through)
    found by name."""
    from transformers import AutoConfig

    if not Path(folder).is_dir():
        raise bad_value(flag, "a local model folder (nothing is downloaded)", folder)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} should be a Hugging Face model folder (with a config.json), but got "
                         f"{flag}={folder!r}: {str(exc).splitlines()[0]}") from exc
    if not any(path.suffix in WEIGHTS for path in model_files(folder)):
        raise ValueError(f"{flag} should be a model folder holding its weights (a {' or '.join(WEIGHTS[:2])} file; "
                         f"the load refuses it otherwise), but got {flag}={folder!r} with no file named "
                         f"*{', *'.join(WEIGHTS)}")
    return config


def check_dtype(value: str, accelerated: bool) -> Any:
    """The ``torch.dtype`` of ``--dtype`` (``auto``: float16 on an accelerator, float32 on the CPU)."""
    import torch

    if value == "auto":
        return torch.float16 if accelerated else torch.float32
    return getattr(torch, value)


def check_device_names(value: str | None) -> list[Any] | None:
    """``--devices`` (``cuda:0,cuda:1``) as devices this machine has; ``None`` for every accelerator."""
    from dynabatch.memory.measure import check_device

    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise bad_value("--devices", "a comma-separated list of devices such as 'cuda:0,cuda:1'", value)
    devices = [check_device("--devices", name) for name in names]
    twice = [str(d) for i, d in enumerate(devices) if d.type != "cpu" and d in devices[:i]]
    if twice:  # an accelerator's memory statistics are its own: one worker each
        raise bad_value("--devices", f"a list naming each accelerator once (twice: {', '.join(twice)})", value)
    return devices


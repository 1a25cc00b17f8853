"""What the two loader-comparison examples share: options, timed runs and the comparison table.

``embed_kjv.py`` and ``seq2seq_generate.py`` both run one model over the same
texts twice, once through a plain fixed-size ``DataLoader`` and once through
``build_dynamic_batch_dataloader``, and print the same table. This private
module holds that common part; each example supplies only its model call (a
``step`` that maps one padded batch to a tensor) and how it assembles the
outputs.

The examples are run as ``python examples/NAME.py``, so ``examples/`` is
``sys.path[0]`` and they import this module as ``_common``. It is not part of
the ``dynabatch`` package.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from dynabatch import build_dynamic_batch_dataloader, restore_order

Step = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class RunStats:
    """What one loader did over all texts."""

    method: str
    n_texts: int
    batches: int
    largest_batch: int
    real_tokens: int
    padded_cells: int
    seconds: float
    cpu_seconds: float  # CPU time of this process (all its threads): what other jobs on the machine barely move

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_cells

    @property
    def texts_per_second(self) -> float:
        return self.n_texts / self.seconds


def add_text_options(parser: argparse.ArgumentParser, n_texts: int, max_length_help: str) -> None:
    """Adds ``--n-texts``, ``--max-words``, ``--batch-size`` and ``--max-length`` to ``parser``.

    Args:
        parser: The example's parser.
        n_texts: Default of ``--n-texts``.
        max_length_help: Help text of ``--max-length``.
    """
    parser.add_argument("--n-texts", type=int, default=n_texts,
                        help="number of KJV texts, cut to 1..--max-words words (log-uniform lengths)")
    parser.add_argument("--max-words", type=int, default=200, help="longest text, in words")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="rows per batch of the plain loader; rows of dynabatch's first (longest) batch")
    parser.add_argument("--max-length", type=int, default=256, help=max_length_help)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """Adds ``--threads`` and ``--seed`` to ``parser``.

    Kept apart from :func:`add_text_options` so an example can add its own
    options in between, where they stand in ``--help``.

    Args:
        parser: The example's parser.
    """
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(THREADS); None keeps torch's own setting (on a busy "
                        "machine 1 is often fastest)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text sampling")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each method, in alternating order after a warm-up of each; "
                        "the fastest run of each is compared")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (on stderr)")


def step(what: str) -> None:
    """Says on stderr what the example does next, before a step that takes a while."""
    print(f"{what} ...", file=sys.stderr, flush=True)


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str]) -> None:
    """Exits through ``parser.error`` at the first option in ``names`` that is below 1.

    An option left at ``None`` (such as ``--threads``) passes.

    Args:
        parser: The parser that produced ``args``; reports the error.
        args: The parsed options.
        names: Attribute names of the options to check, in the order to check them.
    """
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {value}")


def pad_with_tokenizer(batch_texts: list[str], tokenizer, max_length: int):
    """The plain loader's ``collate_fn``: the texts tokenized and padded to the longest in the batch."""
    return tokenizer(batch_texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")


def _steps(step: Step, loader, n_texts: int,
           finish: Callable[[list[torch.Tensor], list], Any]) -> Generator[float, None, Any]:
    """Runs ``step`` on every batch of ``loader``, yielding the fraction of rows done after each batch.

    Returns (through ``StopIteration``) ``finish(outputs, indices)``, the
    batch count, the largest batch, the real tokens and the padded cells.
    """
    outputs, indices = [], []
    largest = real = cells = rows = 0
    for batch in loader:
        mask = batch["attention_mask"]
        largest = max(largest, mask.shape[0])
        real += int(mask.sum())
        cells += mask.numel()
        rows += mask.shape[0]
        outputs.append(step(batch))
        indices.append(getattr(batch, "indices", None))
        yield rows / n_texts
    return finish(outputs, indices), len(outputs), largest, real, cells


def plain_run(step: Step, finish: Callable[[list[torch.Tensor]], Any], tokenizer, texts: list[str],
              batch_size: int, max_length: int) -> Generator[float, None, tuple]:
    """A plain ``DataLoader`` over ``texts`` in input order, a batch at a time (see :func:`_steps`).

    Args:
        step: The model call on one padded batch.
        finish: Turns the per-batch outputs into the result.
        tokenizer: Pads each batch in the loader's ``collate_fn``.
        texts: The texts, in input order.
        batch_size: Rows per batch.
        max_length: Truncation limit per text, in tokens.
    """
    loader = DataLoader(texts, batch_size=batch_size, shuffle=False,
                        collate_fn=partial(pad_with_tokenizer, tokenizer=tokenizer, max_length=max_length))
    return (yield from _steps(step, loader, len(texts), lambda outputs, _: finish(outputs)))


def dynabatch_run(step: Step, finish: Callable[[list[torch.Tensor]], Any], tokenizer, texts: list[str],
                  batch_size: int, max_length: int, **loader_kwargs: Any) -> Generator[float, None, tuple]:
    """``build_dynamic_batch_dataloader`` over ``texts``, a batch at a time; tokenizing and planning are its first step.

    Args:
        step: The model call on one padded batch.
        finish: Turns the output rows, restored to input order, into the result.
        tokenizer: Tokenizes the texts for dynabatch.
        texts: The texts, in input order.
        batch_size: Rows of the first (longest) batch.
        max_length: Truncation limit per text, in tokens.
        **loader_kwargs: More keywords of ``build_dynamic_batch_dataloader``
            (such as ``model_shape``).
    """
    loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size, max_length, num_workers=0, progress=False,
                                            **loader_kwargs)
    yield 0.0
    return (yield from _steps(step, loader, len(texts),
                              lambda outputs, indices: finish(restore_order(outputs, indices))))


def interleave(runs: dict[str, Generator[float, None, tuple]], expected: dict[str, float] | None = None,
               bar: Any = None) -> dict[str, tuple[Any, float, float, float]]:
    """Advances several runs a batch at a time, always the one furthest behind; times each step of each.

    A run's progress is its seconds so far over ``expected[name]`` (its
    seconds in an earlier round) or, without an estimate, its fraction of
    rows done. Advancing the run furthest behind keeps every run at the same
    share of its work at any moment, so a slow or fast spell of a shared
    machine falls on all of them alike instead of on whichever ran then.

    ``bar`` (a ``tqdm`` bar with a total of ``len(runs)``, or None) is
    advanced by each step's share of its run; its updates are not timed.

    Returns:
        For each name: the run's return value, its wall seconds and its CPU
        seconds (``time.process_time``, all threads of this process), each
        the sum over its steps, and the wall seconds of its first step.
    """
    wall = dict.fromkeys(runs, 0.0)
    cpu = dict.fromkeys(runs, 0.0)
    progress = dict.fromkeys(runs, 0.0)
    first: dict[str, float] = {}
    share = dict.fromkeys(runs, 0.0)  # of its rows: what the bar shows
    done: dict[str, tuple[Any, float, float, float]] = {}
    while len(done) < len(runs):
        name = min((n for n in runs if n not in done), key=progress.__getitem__)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            fraction = next(runs[name])
            value = None
        except StopIteration as stop:
            fraction, value = 1.0, stop.value
        seconds = time.perf_counter() - start
        first.setdefault(name, seconds)
        wall[name] += seconds
        cpu[name] += time.process_time() - cpu_start
        progress[name] = wall[name] / expected[name] if expected else fraction
        if bar is not None:
            share[name] = min(fraction, 1.0)
            bar.n = min(sum(share.values()), bar.total)  # set, never added up: float steps cannot pass the total
            bar.update(0)
        if value is not None:
            done[name] = (value, wall[name], cpu[name], first[name])
    return done


def compare(step: Step, plain_finish: Callable[[list[torch.Tensor]], Any],
            dyn_finish: Callable[[list[torch.Tensor]], Any], tokenizer, texts: list[str], batch_size: int,
            max_length: int, repeats: int, progress: bool = True,
            **loader_kwargs: Any) -> tuple[RunStats, Any, RunStats, Any, float]:
    """Times both methods fairly: a warm-up of each, then ``repeats`` rounds that interleave their batches.

    The warm-up runs each method end to end on the ``2 * batch_size`` longest
    texts, so one-off costs (the first model call at a large shape, the
    allocator, thread pools, loading the spike classifier) land on neither
    timed run. In every timed round both methods run over all texts, a batch
    of one then a batch of the other, each kept at the same share of its
    work (:func:`interleave`; from the second round on, shares of the time
    it took in the round before), so the load of other jobs on a shared
    machine weighs on both alike. Each method's time is the sum over its own
    batches; it keeps its fastest wall time and its least CPU time
    (``time.process_time``, all threads of this process) over the rounds.

    Args:
        step: The model call on one padded batch.
        plain_finish: Turns the plain loader's per-batch outputs into its result.
        dyn_finish: Turns dynabatch's output rows, in input order, into its result.
        tokenizer: The tokenizer both methods use.
        texts: The texts, in input order.
        batch_size: Rows per plain batch; rows of dynabatch's first batch.
        max_length: Truncation limit per text, in tokens.
        repeats: Timed rounds.
        progress: Show a progress bar per round (warm-up included) on stderr.
        **loader_kwargs: More keywords of ``build_dynamic_batch_dataloader``.

    Returns:
        The plain loader's stats and result, dynabatch's stats and result
        (stats of the fastest round, with the least CPU time of all rounds),
        and the seconds dynabatch took to tokenize and plan in its fastest round.
    """
    def runs(subset: list[str]) -> dict[str, Generator[float, None, tuple]]:
        return {"plain DataLoader": plain_run(step, plain_finish, tokenizer, subset, batch_size, max_length),
                "dynabatch": dynabatch_run(step, dyn_finish, tokenizer, subset, batch_size, max_length,
                                           **loader_kwargs)}

    def bar(label: str) -> Any:
        return tqdm(total=2, desc=label, disable=not progress, file=sys.stderr, leave=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]")

    with bar(f"warm-up (both methods, the {2 * batch_size} longest texts)") as warm:
        interleave(runs(sorted(texts, key=len)[-2 * batch_size:]), bar=warm)
    rounds, expected = [], None
    for number in range(1, repeats + 1):
        with bar(f"timed round {number} of {repeats} (both methods, {len(texts)} texts)") as timed:
            rounds.append(interleave(runs(texts), expected, bar=timed))
        expected = {name: run[1] for name, run in rounds[-1].items()}

    def stats(name: str) -> tuple[RunStats, Any, float]:
        (result, batches, largest, real, cells), seconds, _, first = min((r[name] for r in rounds),
                                                                         key=lambda run: run[1])
        cpu = min(r[name][2] for r in rounds)
        return RunStats(name, len(texts), batches, largest, real, cells, seconds, cpu), result, first

    def times(name: str) -> str:
        return ", ".join(f"{r[name][1]:.2f}s ({r[name][2]:.2f}s CPU)" for r in rounds)

    print(f"timed rounds (after a warm-up of each; batches of the two methods interleaved): "
          f"plain {times('plain DataLoader')}; dynabatch {times('dynabatch')}; "
          f"fastest wall time and least CPU time of each compared\n")
    (plain, plain_result, _), (dyn, dyn_result, setup) = stats("plain DataLoader"), stats("dynabatch")
    return plain, plain_result, dyn, dyn_result, setup


def print_table(runs: Sequence[RunStats]) -> None:
    """Prints one row per run: batches, largest batch, padding efficiency, wall time, texts/s, CPU time."""
    header = (f"{'method':<18} {'batches':>8} {'largest batch':>14} {'padding eff.':>13} {'wall time':>10} "
              f"{'texts/s':>9} {'CPU time':>9}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r.method:<18} {r.batches:>8} {r.largest_batch:>14} {r.padding_efficiency:>12.1%} "
              f"{r.seconds:>9.2f}s {r.texts_per_second:>9.1f} {r.cpu_seconds:>8.2f}s")


def print_comparison(plain: RunStats, dyn: RunStats, setup: float) -> None:
    """Prints the table of both runs and the speed-up of dynabatch over the plain loader."""
    print_table([plain, dyn])
    print(f"\nspeed-up of dynabatch over the plain loader: {plain.seconds / dyn.seconds:.2f}x in wall time, "
          f"{plain.cpu_seconds / dyn.cpu_seconds:.2f}x in CPU time (the steadier figure on a shared machine; "
          f"dynabatch's includes {setup:.2f}s to tokenize and plan)")


def report_check(ok: bool, result: str, error: str, note: str = "") -> int:
    """Prints the outcome of checking dynabatch's outputs against the plain loader's.

    Args:
        ok: Whether the check passed.
        result: What was compared and found; ``(OK)`` or ``(FAIL)`` is printed after it.
        error: Printed to stderr after ``error: `` when the check failed.
        note: Added inside the parentheses, after OK or FAIL (such as ``", tolerance 0.0001"``).

    Returns:
        The exit status: 0 when the check passed, 1 when it failed.
    """
    print(f"{result} ({'OK' if ok else 'FAIL'}{note})")
    if not ok:
        print(f"error: {error}", file=sys.stderr)
    return 0 if ok else 1

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
import dataclasses
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils.data import DataLoader

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
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of each method, in alternating order after a warm-up of each; "
                        "the fastest run of each is compared")


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


def run_loader(step: Step, loader) -> tuple[list[torch.Tensor], list, int, int, int]:
    """Runs ``step`` on every batch of ``loader``.

    Returns:
        The per-batch outputs, the per-batch indices (``None`` for a plain
        batch), the largest batch, the real tokens and the padded cells.
    """
    outputs, indices = [], []
    largest = real = cells = 0
    for batch in loader:
        mask = batch["attention_mask"]
        largest = max(largest, mask.shape[0])
        real += int(mask.sum())
        cells += mask.numel()
        outputs.append(step(batch))
        indices.append(getattr(batch, "indices", None))
    return outputs, indices, largest, real, cells


def run_plain(step: Step, finish: Callable[[list[torch.Tensor]], Any], tokenizer, texts: list[str],
              batch_size: int, max_length: int) -> tuple[RunStats, Any]:
    """Times a plain ``DataLoader`` over ``texts`` in input order.

    Args:
        step: The model call on one padded batch.
        finish: Turns the per-batch outputs into the result (timed too).
        tokenizer: Pads each batch in the loader's ``collate_fn``.
        texts: The texts, in input order.
        batch_size: Rows per batch.
        max_length: Truncation limit per text, in tokens.

    Returns:
        The stats and ``finish``'s result.
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    loader = DataLoader(texts, batch_size=batch_size, shuffle=False,
                        collate_fn=partial(pad_with_tokenizer, tokenizer=tokenizer, max_length=max_length))
    outputs, _, largest, real, cells = run_loader(step, loader)
    result = finish(outputs)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return RunStats("plain DataLoader", len(texts), len(outputs), largest, real, cells, seconds, cpu), result


def run_dynabatch(step: Step, finish: Callable[[list[torch.Tensor]], Any], tokenizer, texts: list[str],
                  batch_size: int, max_length: int, **loader_kwargs: Any) -> tuple[RunStats, Any, float]:
    """Times ``build_dynamic_batch_dataloader`` over ``texts``, tokenizing and planning included.

    Args:
        step: The model call on one padded batch.
        finish: Turns the output rows, restored to input order, into the result (timed too).
        tokenizer: Tokenizes the texts for dynabatch.
        texts: The texts, in input order.
        batch_size: Rows of the first (longest) batch.
        max_length: Truncation limit per text, in tokens.
        **loader_kwargs: More keywords of ``build_dynamic_batch_dataloader``
            (such as ``model_shape``).

    Returns:
        The stats, ``finish``'s result and the setup (tokenize + plan) seconds.
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size, max_length, num_workers=0,
                                            **loader_kwargs)
    setup = time.perf_counter() - start
    outputs, indices, largest, real, cells = run_loader(step, loader)
    result = finish(restore_order(outputs, indices))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return RunStats("dynabatch", len(texts), len(outputs), largest, real, cells, seconds, cpu), result, setup


def compare(step: Step, plain_finish: Callable[[list[torch.Tensor]], Any],
            dyn_finish: Callable[[list[torch.Tensor]], Any], tokenizer, texts: list[str], batch_size: int,
            max_length: int, repeats: int, **loader_kwargs: Any) -> tuple[RunStats, Any, RunStats, Any, float]:
    """Times both methods fairly: a warm-up of each, then ``repeats`` runs of each in alternating order.

    The warm-up runs each method end to end on the ``2 * batch_size`` longest
    texts, so one-off costs (the first model call at a large shape, the
    allocator, thread pools, loading the spike classifier) land on neither
    timed run. Round ``r`` runs the plain loader first when ``r`` is even and
    dynabatch first when it is odd. Each method keeps its fastest wall time
    and its least CPU time (``time.process_time``, all threads of this
    process): on a machine other jobs share, wall times swing with their load
    while CPU time measures the work each method did.

    Args:
        step: The model call on one padded batch.
        plain_finish: Turns the plain loader's per-batch outputs into its result.
        dyn_finish: Turns dynabatch's output rows, in input order, into its result.
        tokenizer: The tokenizer both methods use.
        texts: The texts, in input order.
        batch_size: Rows per plain batch; rows of dynabatch's first batch.
        max_length: Truncation limit per text, in tokens.
        repeats: Timed runs of each method.
        **loader_kwargs: More keywords of ``build_dynamic_batch_dataloader``.

    Returns:
        The plain loader's stats and result, dynabatch's stats and result
        (stats of the fastest run, with the least CPU time of all runs), and
        the setup seconds of dynabatch's fastest run.
    """
    warm = sorted(texts, key=len)[-2 * batch_size:]
    run_plain(step, plain_finish, tokenizer, warm, batch_size, max_length)
    run_dynabatch(step, dyn_finish, tokenizer, warm, batch_size, max_length, **loader_kwargs)
    plains, dyns = [], []
    for r in range(repeats):
        for method in (("plain", "dyn") if r % 2 == 0 else ("dyn", "plain")):
            if method == "plain":
                plains.append(run_plain(step, plain_finish, tokenizer, texts, batch_size, max_length))
            else:
                dyns.append(run_dynabatch(step, dyn_finish, tokenizer, texts, batch_size, max_length,
                                          **loader_kwargs))
    def times(runs: list) -> str:
        return ", ".join(f"{run[0].seconds:.2f}s ({run[0].cpu_seconds:.2f}s CPU)" for run in runs)

    print(f"timed runs (after a warm-up of each, alternating order): plain {times(plains)}; "
          f"dynabatch {times(dyns)}; fastest wall time and least CPU time of each compared\n")
    plain, plain_result = min(plains, key=lambda run: run[0].seconds)
    dyn, dyn_result, setup = min(dyns, key=lambda run: run[0].seconds)
    plain = dataclasses.replace(plain, cpu_seconds=min(run[0].cpu_seconds for run in plains))
    dyn = dataclasses.replace(dyn, cpu_seconds=min(run[0].cpu_seconds for run in dyns))
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

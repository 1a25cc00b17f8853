"""What ``dynabatch.run``'s safe defaults cost: wall time of ``run(fn, loader)`` against the unmeasured plan.

On the workloads of ``benchmarks/inference.py`` (the real all-MiniLM-L6-v2
forward over 2000 KJV texts at 256 tokens; the Marian-shaped encoder-decoder
``generate`` of ``examples/seq2seq_generate.py`` over 800 texts at 128 tokens;
same texts, seeds and batch size 16), one loader per workload
(``build_dynamic_batch_dataloader(texts, tokenizer, 16, max_length,
num_workers=0)``) runs three ways, side by side, in interleaved rounds (each
round rotates their order), under ``torch.inference_mode()``:

1. **defaults**: ``run(fn, loader, progress=False)``: measured mode, the plan
   as the prior; on the CPU the storage tracker measures only the calls that
   can let later batches grow (see ``dynabatch.memory.feedback``);
2. **plan, unmeasured**: ``run(fn, loader, memory="off",
   progress=False)``: the classifier's plan as it is, nothing measured
   (what the defaults were before, and what ``for batch in loader`` runs);
3. **defaults' batches, unmeasured**: the very calls the defaults made in the
   first round, built by the loader's collator and run by ``run(fn, batches,
   memory="off")``: the defaults without the measuring.

*overhead vs plan* = defaults / plan - 1: the whole cost of the safe default
on that workload (measuring, and batches re-sized, smaller after a spike and
larger where the plan left memory unused); *measuring cost* = defaults /
defaults' batches unmeasured - 1: the tracker's part alone. Both are given on
wall seconds and on CPU seconds (``time.process_time``, this process's
threads), medians of ``--rounds`` runs (min-max in brackets). On a machine
shared with other jobs, wall time swings by 2x and more from run to run while
CPU seconds do not, so the CPU figures are the ones to read there (with one
torch thread, ``--threads 1``, the default, CPU seconds are the wall time of an
idle machine).

``--schedule GAIN,DROP,GROWTH`` overrides the sparse-measuring constants of
``dynabatch.memory.feedback`` (an experiment knob; defaults: the library's).

Run it with::

    python benchmarks/default_overhead.py --rounds 7
    python benchmarks/default_overhead.py --workloads generate --rounds 3 --schedule 0.1,0.5,2
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np
import torch

from dynabatch import build_dynamic_batch_dataloader, run
from dynabatch.demo import vary_lengths
from dynabatch.memory import feedback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _assets  # the text, tokenizer and encoder inference.py uses
from inference import MAX_WORDS, TEXT_SEED, WORKLOADS  # the workloads are inference.py's, not a copy of them

WAYS = ("defaults", "plan, unmeasured", "defaults' batches, unmeasured")


def workload(name: str, n_texts: int | None) -> Any:
    """One workload of ``benchmarks/inference.py`` with its defaults (8 new tokens for ``generate``), on the CPU."""
    return WORKLOADS[name](argparse.Namespace(device="cpu", n_texts=n_texts, batch_size=None, max_length=None,
                                              new_tokens=8))


def timed(fn: Any, batches: Any, **kwargs: Any) -> tuple[tuple[float, float], Any]:
    """``((wall s, CPU s), result)`` of one ``run``."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        result = run(fn, batches, progress=False, **kwargs)
    return (time.perf_counter() - start, time.process_time() - cpu), result


def _spread(values: list[float]) -> str:
    return f"{float(np.median(values)):.2f} ({min(values):.2f}-{max(values):.2f})"


def bench(name: str, args: argparse.Namespace, tokenizer: Any) -> str:
    work = workload(name, args.n_texts)
    fn, n_texts, max_length = work.fn, work.n_texts, work.max_length
    texts = vary_lengths(list(_assets.kjv_passages()), n=n_texts, max_words=MAX_WORDS, seed=TEXT_SEED)
    loader = build_dynamic_batch_dataloader(texts, tokenizer, work.batch_size, max_length, num_workers=0,
                                            progress=False, **work.tokenizer_kwargs)
    collator = loader.plan.collator
    calls: list[np.ndarray] = []

    def recorded(batch: Any) -> Any:
        calls.append(batch.indices.numpy().copy())
        return fn(batch)

    with torch.inference_mode():
        fn(collator(np.asarray(loader.plan.sampler.batches[-1])))  # warm-up
    _, first = timed(recorded, loader)  # the defaults' calls, run once before the timed rounds
    times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    results: dict[str, Any] = {}
    for round_ in range(args.rounds):
        ways = WAYS[round_ % 3:] + WAYS[:round_ % 3]
        for way in ways:
            if way == "defaults":
                seconds, result = timed(fn, loader)
            elif way == "plan, unmeasured":
                seconds, result = timed(fn, loader, memory="off")
            else:
                seconds, result = timed(fn, (collator(p) for p in calls), memory="off")
            times[way].append(seconds)
            results.setdefault(way, result)
            print(f"{name} round {round_ + 1}: {way}: {seconds[0]:.2f} s wall, {seconds[1]:.2f} s CPU", file=sys.stderr,
                  flush=True)
    wall = {way: [t[0] for t in ts] for way, ts in times.items()}
    cpu = {way: [t[1] for t in ts] for way, ts in times.items()}

    def change(clock: dict[str, list[float]], way: str, base: str) -> str:
        return f"{float(np.median(clock[way])) / float(np.median(clock[base])) - 1:+.1%}"

    report = first.report
    measured = sum(r.peak_bytes is not None for r in report.records)
    lines = [f"### {name}", "",
             (f"{n_texts} texts, max_length {max_length}, batch_size {work.batch_size}; the defaults ran {report.batches} batches "
              f"({measured} measured), the plan {len(loader)}"), "",
             "| way | batches | wall s | CPU s | overhead vs plan (wall / CPU) | measuring cost (wall / CPU) |",
             "|---|---:|---:|---:|---:|---:|"]
    for way in WAYS:
        vs_plan = f"{change(wall, way, WAYS[1])} / {change(cpu, way, WAYS[1])}"
        cost = f"{change(wall, way, WAYS[2])} / {change(cpu, way, WAYS[2])}" if way == "defaults" else ""
        lines.append(f"| {way} | {results[way].report.batches} | {_spread(wall[way])} | {_spread(cpu[way])} "
                     f"| {vs_plan} | {cost} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workloads", default="encoder,generate", help="comma-separated: encoder, generate")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-texts", type=int, default=None, help="default 2000 (encoder), 800 (generate)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--schedule", default=None, help="GAIN,DROP,GROWTH of sparse measuring (experiment knob)")
    args = parser.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names or any(w not in ("encoder", "generate") for w in names):
        parser.error(f"--workloads should be names from encoder, generate, but got {args.workloads!r}")
    if args.rounds < 1:
        parser.error(f"--rounds should be a positive integer, but got {args.rounds}")
    if args.schedule:
        feedback.SPARSE_GAIN, feedback.SPARSE_MAX_DROP, feedback.SPARSE_ROWS_GROWTH = map(float,
                                                                                         args.schedule.split(","))
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = _assets.tokenizer()
    command = shlex.join(["python", "benchmarks/default_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    schedule = (f"sparse schedule: gain {feedback.SPARSE_GAIN}, max drop {feedback.SPARSE_MAX_DROP}, rows growth "
                f"{feedback.SPARSE_ROWS_GROWTH}")
    header = (f"Command: `{command}`; torch {torch.__version__}, {len(os.sched_getaffinity(0))} CPUs "
              f"(load average {os.getloadavg()[0]:.1f} at start), {args.threads} torch threads; {schedule}; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(header + "\n")
    for name in names:
        print(bench(name, args, tokenizer) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

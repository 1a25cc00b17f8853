"""Host side: the README's first path with a model that takes no time, against one batched fast-tokenizer call, on one
core and on two.

What the host does per text (tokenizing, planning, collating, running the batches' bookkeeping, gathering the rows)
with the device out of the way. Held-out texts (``vary_lengths(kjv_passages(), n, max_words=128, seed=29)``, a seed
no test uses), the real all-MiniLM-L6-v2 tokenizer, 256 tokens, two ways, each in a fresh process pinned to the cores
(``os.sched_setaffinity`` before torch or tokenizers start their thread pools), its imports and a warm-up on 2,000
texts before its clock starts:

1. **tokenizer call**: ``tokenizer(texts, truncation=True, max_length=256)``, one batched call (a fast tokenizer's
   Rust backend spreads it over its thread pool);
2. **README path**: ``build_dynamic_batch_dataloader(texts, tokenizer, batch_size=32, max_input_token_length=256)``
   then ``dynabatch.run(fn, loader)``, as the README's Quick Start (progress bars off), with a model that takes no
   time: ``fn`` holds an activation of 384 float32 per padded cell (so the measured mode re-sizes batches as it
   would for an encoder) and returns 384 values per row.

``TOKENIZERS_PARALLELISM`` is left as the caller's environment has it (unset: the tokenizer's default). Every repeat
runs the four processes (two ways, one and two cores) back to back, so each ratio is taken side by side; the table
gives each ratio's median over the repeats and its spread (min-max). The targets: on two cores the README path at
least 1.6x its own speed on one core, and at least 0.85x the texts/s of the tokenizer call on the same cores.

Run it with::

    python benchmarks/host.py                          # 100,000 texts, 3 repeats
    python benchmarks/host.py --n-texts 20000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

N_TEXTS, MAX_LENGTH, BATCH, SEED, DIM = 100_000, 256, 32, 29, 384
SPEEDUP_TARGET, CALL_TARGET = 1.6, 0.85
WAYS = {"call": "tokenizer call", "run": "README path"}


def _texts(n: int) -> list[str]:
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n, max_words=128, seed=SEED)


def _model_that_takes_no_time():
    import torch

    def fn(batch):
        rows, width = batch["input_ids"].shape
        hidden = torch.empty(rows, width, DIM)  # an activation per padded cell, as an encoder's hidden states
        del hidden
        return torch.zeros(rows, DIM)

    return fn


def worker(way: str, n: int) -> dict:
    """One way over ``n`` texts in this (fresh, pinned) process: its seconds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer

    import dynabatch
    from dynabatch.demo import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts, fn = _texts(n), _model_that_takes_no_time()

    def call(items: list[str]) -> None:
        encoded = tokenizer(items, truncation=True, max_length=MAX_LENGTH)
        assert len(encoded["input_ids"]) == len(items)

    def readme(items: list[str]) -> None:
        loader = dynabatch.build_dynamic_batch_dataloader(items, tokenizer, batch_size=BATCH,
                                                          max_input_token_length=MAX_LENGTH, progress=False)
        with torch.inference_mode():
            rows = dynabatch.run(fn, loader, progress=False)
        assert len(rows) == len(items) and not rows.failed

    job = call if way == "call" else readme
    job(texts[:2000])  # warm-up: imports, the classifier, the tokenizer's caches
    start = time.perf_counter()
    job(texts)
    return {"way": way, "n": n, "seconds": time.perf_counter() - start, "cores": sorted(os.sched_getaffinity(0))}


def _measure(way: str, n: int, cores: list[int]) -> dict:
    command = [sys.executable, __file__, "--worker", way, "--n-texts", str(n), "--cores", ",".join(map(str, cores))]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{WAYS[way]} on cores {cores} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-texts", type=int, default=N_TEXTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", default=None, help="the cores to pin to: two cores, e.g. 0,1 (default: the first "
                        "two this process may use); the one-core runs take the first")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])  # before any thread pool starts
        print(json.dumps(worker(args.worker, args.n_texts)))
        return
    two = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))[:2]
    if len(two) != 2:
        parser.error(f"--cores should name two cores this process may use, but got --cores={args.cores!r}")
    runs = []
    for repeat in range(args.repeats):
        got = {}
        for cores in ([two[0]], two):
            for way, name in WAYS.items():
                got[way, len(cores)] = _measure(way, args.n_texts, cores)["seconds"]
                print(f"repeat {repeat + 1}, {name} on {len(cores)} core(s): {got[way, len(cores)]:.2f} s",
                      file=sys.stderr, flush=True)
        runs.append(got)
    n = args.n_texts
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM", "unset")
    title = (f"## Host side: {n:,} texts, a model that takes no time (TOKENIZERS_PARALLELISM {parallelism}, "
             f"{args.repeats} repeats)")
    lines = [title, "",
             "| way | cores | wall s | texts/s |", "|---|---:|---:|---:|"]
    for way, name in WAYS.items():
        for count in (1, 2):
            seconds = [r[way, count] for r in runs]
            lines.append(f"| {name} | {count} | {_spread(seconds)} | {n / statistics.median(seconds):,.0f} |")
    speedup = [r["run", 1] / r["run", 2] for r in runs]
    versus_call = [r["call", 2] / r["run", 2] for r in runs]
    call_speedup = [r["call", 1] / r["call", 2] for r in runs]
    versus_call_one = [r["call", 1] / r["run", 1] for r in runs]
    gained = (f"- README path, 2 cores vs 1: {_spread(speedup)}x (target >= {SPEEDUP_TARGET}: "
              f"{'met' if statistics.median(speedup) >= SPEEDUP_TARGET else 'missed'}); the tokenizer call gains "
              f"{_spread(call_speedup)}x")
    versus = (f"- README path vs the tokenizer call, texts/s on 2 cores: {_spread(versus_call)}x (target >= "
              f"{CALL_TARGET}: {'met' if statistics.median(versus_call) >= CALL_TARGET else 'missed'}); on 1 core "
              f"{_spread(versus_call_one)}x")
    lines += ["", "Ratios, median (min-max) over the repeats, each taken within one repeat:", "", gained, versus]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

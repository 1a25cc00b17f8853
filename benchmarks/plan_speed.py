"""How fast dynabatch gets from texts to a batch plan: the tokenize stage and the planner, timed.

In one run, on the same texts, the script times:

1. the raw batched tokenizer call ``tokenizer(texts, truncation=True,
   max_length=M)`` (the MiniLM WordPiece fast tokenizer), the floor for any
   method that needs token lengths;
2. dynabatch's length stage ``tokenize_texts(texts, tokenizer, M)`` (the same
   tokenization plus the flat token store), and its ratio to (1)
   (target <= 1.3x);
3. loading the bundled spike classifier (``load_classifier()``, a one-off cost
   reported on its own row), then the planner ``plan_batches(lengths,
   batch_size, M)`` on ``--n-lengths`` lengths drawn from a real distribution:
   the token lengths measured in (2) on KJV texts, resampled with a seeded
   ``numpy.random.default_rng``; for each batch size (target <= 1 s for 1M
   lengths), with the number of batches and the largest batch;
4. the planning throughput in texts/s, next to the ~4,300 texts/s quoted for
   the published dynabatch package (a quoted figure, not measured here).

Every timing is the best of ``--repeats`` runs (the classifier load happens
once: it is cached after the first call). The machine and thread counts are
printed first: timings on a busy machine are upper bounds.

Needs the ``examples`` extra (``pip install dynabatch[examples]``); runs
offline. Run it with::

    python benchmarks/plan_speed.py
    python benchmarks/plan_speed.py --n-texts 2000 --n-lengths 20000 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from dynabatch import load_classifier, plan_batches, tokenize_texts  # noqa: E402
from dynabatch.demo import kjv_passages, minilm_path, vary_lengths  # noqa: E402

PUBLISHED_TEXTS_PER_SECOND = 4300  # quoted for the published dynabatch package, not measured here
TOKENIZE_TARGET_RATIO = 1.3
PLAN_TARGET_SECONDS = 1.0
PLAN_TARGET_LENGTHS = 1_000_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time the raw tokenizer, dynabatch's tokenize stage and the batch planner on KJV text lengths.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--n-texts", type=int, default=100_000,
                        help="KJV texts (1..--max-words words, log-uniform) to tokenize in stages 1 and 2")
    parser.add_argument("--max-words", type=int, default=300, help="longest text, in words")
    parser.add_argument("--n-lengths", type=int, default=1_000_000,
                        help="lengths to plan in stage 3, resampled from the measured token lengths")
    parser.add_argument("--max-length", type=int, default=256, help="truncation limit per text, in tokens")
    parser.add_argument("--batch-sizes", type=str, default="16,64",
                        help="comma-separated first-batch sizes to plan with")
    parser.add_argument("--repeats", type=int, default=3, help="time each stage this many times and keep the best")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text sampling and the length resampling")
    args = parser.parse_args(argv)
    for name in ("n_texts", "max_words", "n_lengths", "max_length", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {getattr(args, name)}")
    try:
        args.batch_sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--batch-sizes should be comma-separated integers, but got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes should be positive integers, but got {args.batch_sizes}")
    return args


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Seconds one call of ``fn`` took, and its result."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """The shortest of ``repeats`` timed calls, and the last call's result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        seconds, result = timed(fn)
        best = min(best, seconds)
    return best, result


def machine_line(tokenizer) -> str:
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", load average {:.1f}".format(os.getloadavg()[0]) if hasattr(os, "getloadavg") else ""
    return (f"machine: {platform.machine()} {platform.processor() or platform.system()}, {cpus} usable CPUs"
            f"{load}; python {platform.python_version()}, numpy {np.__version__}, torch threads "
            f"{torch.get_num_threads()}, TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}, "
            f"fast tokenizer={getattr(tokenizer, 'is_fast', False)}")


def resample_lengths(lengths: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` lengths drawn with replacement from the measured ones (seeded)."""
    return np.random.default_rng(seed).choice(lengths, size=n, replace=True)


def print_rows(rows: list[tuple[str, str, str, str, str]]) -> None:
    header = ("stage", "size", "best time", "texts/s", "note")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{widths[i]}}}" for i in range(len(header) - 1))
    line += "  {}"
    print(line.format(*header))
    print("-" * (sum(widths) + 2 * (len(header) - 1)))
    for row in rows:
        print(line.format(*row))


def plan_verdict(seconds: float, n_lengths: int) -> str:
    """Planner time against the target, which is set for 1M lengths (planning cost is not linear in n)."""
    if n_lengths < PLAN_TARGET_LENGTHS:
        return f"target <= {PLAN_TARGET_SECONDS:g}s is for {PLAN_TARGET_LENGTHS:,} lengths"
    return f"target <= {PLAN_TARGET_SECONDS:g}s: {'OK' if seconds <= PLAN_TARGET_SECONDS else 'MISSED'}"


def versus_quoted(texts_per_second: float) -> str:
    return f"{texts_per_second / PUBLISHED_TEXTS_PER_SECOND:,.1f}x the quoted ~{PUBLISHED_TEXTS_PER_SECOND:,} texts/s"


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}" if seconds > 0 else "inf"


def time_tokenization(texts: list[str], tokenizer, max_length: int, repeats: int):
    """Best seconds of the raw tokenizer call and of ``tokenize_texts``, and the token store.

    The two alternate, so both see the same machine state.
    """
    raw_s = ours_s = float("inf")
    tokenized = None
    for _ in range(repeats):
        seconds, _ = timed(lambda: tokenizer(texts, truncation=True, max_length=max_length))
        raw_s = min(raw_s, seconds)
        seconds, tokenized = timed(lambda: tokenize_texts(texts, tokenizer, max_length))
        ours_s = min(ours_s, seconds)
    return raw_s, ours_s, tokenized


def time_planner(lengths: np.ndarray, batch_sizes: list[int], max_length: int,
                 repeats: int) -> tuple[list[tuple[str, ...]], list[float]]:
    """Table rows and best seconds of ``plan_batches`` for each batch size (classifier already loaded)."""
    rows, times = [], []
    k = len(lengths)
    for batch_size in batch_sizes:
        seconds, batches = best_time(lambda: plan_batches(lengths, batch_size, max_length), repeats)
        times.append(seconds)
        rows.append((f"3. plan_batches(batch_size={batch_size})", f"{k:,} lengths", f"{seconds:.3f}s",
                     rate(k, seconds), f"{len(batches):,} batches, largest {max(map(len, batches))}; "
                     f"{plan_verdict(seconds, k)}"))
    return rows, times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=args.max_words, seed=args.seed)
    m, n, k = args.max_length, len(texts), args.n_lengths
    print(machine_line(tokenizer))
    print(f"{n:,} KJV texts (1..{args.max_words} words), max_length={m}, best of {args.repeats}\n")

    raw_s, ours_s, tokenized = time_tokenization(texts, tokenizer, m, args.repeats)
    ratio = ours_s / raw_s
    load_s, _ = timed(load_classifier)
    lengths = resample_lengths(tokenized.lengths, k, args.seed)
    rows = [
        ("1. tokenizer(texts, truncation=True)", f"{n:,} texts", f"{raw_s:.3f}s", rate(n, raw_s), "raw batched call"),
        ("2. tokenize_texts (length stage)", f"{n:,} texts", f"{ours_s:.3f}s", rate(n, ours_s),
         f"{ratio:.2f}x of (1), target <= {TOKENIZE_TARGET_RATIO}x: "
         f"{'OK' if ratio <= TOKENIZE_TARGET_RATIO else 'MISSED'}"),
        ("3. load_classifier() (once)", "-", f"{load_s:.3f}s", "-", "one-off, cached after"),
    ]
    plan_rows, plan_times = time_planner(lengths, args.batch_sizes, m, args.repeats)
    rows += plan_rows
    slowest = max(plan_times)
    per_text = ours_s / n + slowest / k  # seconds per text, texts to plan
    rows.append(("4. planning throughput (planner only)", f"{k:,} lengths", f"{slowest:.3f}s", rate(k, slowest),
                 f"slowest batch size; {versus_quoted(k / slowest)}"))
    rows.append(("4. texts to plan (tokenize_texts + planner)", "per text", f"{per_text * 1e6:.1f}us",
                 rate(1, per_text), versus_quoted(1 / per_text)))
    rows.append(("4. published dynabatch (QUOTED figure)", "-", "-", f"~{PUBLISHED_TEXTS_PER_SECOND:,}",
                 "quoted, not measured here"))
    print_rows(rows)
    print(f"\nlengths planned in (3): {k:,} resampled from the {n:,} measured token lengths "
          f"(mean {tokenized.lengths.mean():.1f}, median {np.median(tokenized.lengths):.0f}, "
          f"truncated at {m}: {np.mean(tokenized.lengths == m):.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast dynabatch gets from texts to a batch plan: cold start, the tokenize stage and the planner, timed.

In one run the script measures, and prints as one markdown table:

1. cold start, each in its own fresh Python process (``--cold-repeats``
   processes of each kind, in alternating order; the median is reported, with
   the min-max), with an empty ``DYNABATCH_CACHE_DIR``, importing a copy of
   dynabatch with compiled bytecode, as installed (see :func:`installed_copy`):

   a. what ``import dynabatch`` adds to ``import torch, transformers`` (both
      timed in the same process, one after the other; target <= 0.3 s);
   b. the first ``build_dynamic_batch_dataloader(texts, tokenizer, 16, M)``
      of a process against the first raw ``tokenizer(texts, truncation=True,
      max_length=M)`` of another, on the same ``--cold-texts`` KJV passages
      (target: the build <= 1.3x the raw call);

2. warm, in this process, on ``--n-texts`` KJV texts of 1..``--max-words``
   words: the raw batched tokenizer call (the floor for any method that needs
   token lengths) and dynabatch's length stage ``tokenize_texts`` (target
   <= 1.3x), alternating, best of ``--repeats``;
3. loading the bundled spike classifier (``load_classifier()``, once), then
   the planner ``plan_batches(lengths, batch_size, M)`` on ``--n-lengths``
   lengths resampled (seeded) from the token lengths measured in (2), for
   each of ``--batch-sizes`` (target <= 0.5 s for 1M lengths at any batch
   size), with the number of batches and the largest batch;
4. the planning throughput, next to the ~4,300 texts/s quoted for the
   published dynabatch package (a quoted figure, not measured here).

The machine and thread counts are printed first: timings on a busy machine
are upper bounds, and the ratios are what to compare. The table goes to
stdout; ``--output PATH`` also writes it (and the machine line) to PATH.
Nothing is written anywhere else.

Needs the ``examples`` extra (``pip install -e ".[examples]"``); runs
offline. Run it with::

    python benchmarks/plan_speed.py
    python benchmarks/plan_speed.py --n-texts 2000 --n-lengths 20000 --repeats 1 --cold-repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

PUBLISHED_TEXTS_PER_SECOND = 4300  # quoted for the published dynabatch package, not measured here
TOKENIZE_TARGET_RATIO = 1.3
FIRST_BUILD_TARGET_RATIO = 1.3
IMPORT_TARGET_SECONDS = 0.3
PLAN_TARGET_SECONDS = 0.5
PLAN_TARGET_LENGTHS = 1_000_000
COLD_BATCH_SIZE = 16

# Run in a fresh interpreter: times the imports, then one first call (raw tokenizer or dynabatch's build).
_COLD_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch, transformers
imported = time.perf_counter()
import dynabatch
with_dynabatch = time.perf_counter()
from transformers import AutoTokenizer
from dynabatch.demo import kjv_passages, minilm_path
mode, n, max_length, batch_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(minilm_path())
texts = kjv_passages()[:n]
begin = time.perf_counter()
if mode == "raw":
    tokenizer(texts, truncation=True, max_length=max_length)
else:
    dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size, max_length, num_workers=0)
end = time.perf_counter()
print(json.dumps({"torch_transformers": imported - start, "dynabatch": with_dynabatch - imported,
                  "call": end - begin, "texts": len(texts), "sklearn": "sklearn" in sys.modules,
                  "module": dynabatch.__file__}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time dynabatch's cold start, the raw tokenizer, dynabatch's tokenize stage and the batch "
                    "planner on KJV texts; print one markdown table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--n-texts", type=int, default=100_000,
                        help="KJV texts (1..--max-words words, log-uniform) to tokenize in stage 2")
    parser.add_argument("--max-words", type=int, default=300, help="longest text of stage 2, in words")
    parser.add_argument("--n-lengths", type=int, default=1_000_000,
                        help="lengths to plan in stage 3, resampled from the measured token lengths")
    parser.add_argument("--max-length", type=int, default=256, help="truncation limit per text, in tokens")
    parser.add_argument("--batch-sizes", type=str, default="1,16,64,256",
                        help="comma-separated first-batch sizes to plan with")
    parser.add_argument("--repeats", type=int, default=3, help="time each warm stage this many times and keep the best")
    parser.add_argument("--cold-texts", type=int, default=24_408,
                        help="KJV passages (in canonical order, as they are) for the cold-start rows")
    parser.add_argument("--cold-repeats", type=int, default=5,
                        help="fresh processes of each kind (raw call, first build) for the cold-start rows")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text sampling and the length resampling")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the machine line and the table to this file (default: stdout only)")
    args = parser.parse_args(argv)
    for name in ("n_texts", "max_words", "n_lengths", "max_length", "repeats", "cold_texts", "cold_repeats"):
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


def machine_line() -> str:
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", load average {:.1f}".format(os.getloadavg()[0]) if hasattr(os, "getloadavg") else ""
    return (f"machine: {platform.machine()} {platform.processor() or platform.system()}, {cpus} usable CPUs"
            f"{load}; python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), TOKENIZERS_PARALLELISM="
            f"{os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}")


def resample_lengths(lengths: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` lengths drawn with replacement from the measured ones (seeded)."""
    return np.random.default_rng(seed).choice(lengths, size=n, replace=True)


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:,.0f}" if seconds > 0 else "inf"


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def spread(values: list[float]) -> str:
    """Median, and the min-max when there are several values."""
    median = statistics.median(values)
    return f"{median:.2f} s" if len(values) == 1 else f"{median:.2f} s ({min(values):.2f}-{max(values):.2f})"


def installed_copy(folder: Path) -> Path:
    """A copy of the dynabatch package in ``folder/site`` with its bytecode compiled, as ``pip install`` leaves it.

    The cold-start processes import it from there: their import time is then what an installed dynabatch costs,
    also where ``PYTHONDONTWRITEBYTECODE`` is set (as on the machine this was written on, where every import of
    the checkout would otherwise compile its modules from source). torch and transformers are imported as installed.
    """
    import compileall
    import importlib.util
    import shutil

    source = Path(importlib.util.find_spec("dynabatch").origin).parent
    site = folder / "site"
    shutil.copytree(source, site / "dynabatch", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if not compileall.compile_dir(site / "dynabatch", quiet=1):
        raise RuntimeError(f"could not compile the copy of dynabatch in {site}")
    return site


def cold_runs(n_texts: int, max_length: int, repeats: int) -> dict[str, list[dict]]:
    """``repeats`` fresh processes timing the raw tokenizer call and as many timing the first build, alternating."""
    runs: dict[str, list[dict]] = {"raw": [], "build": []}
    with tempfile.TemporaryDirectory() as folder:
        site = installed_copy(Path(folder))
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "DYNABATCH_CACHE_DIR": str(Path(folder) / "cache"),
               "PYTHONPATH": path}
        for i in range(repeats):
            for mode in ("raw", "build") if i % 2 == 0 else ("build", "raw"):
                out = subprocess.run(
                    [sys.executable, "-c", _COLD_CHILD, mode, str(n_texts), str(max_length), str(COLD_BATCH_SIZE)],
                    capture_output=True, text=True, env=env, cwd=folder, check=False)
                if out.returncode != 0:
                    raise RuntimeError(f"the cold-start process ({mode}) failed:\n{out.stderr}")
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                if not runs[mode][-1]["module"].startswith(str(site)):
                    raise RuntimeError(f"the cold-start process imported {runs[mode][-1]['module']}, not the copy")
                print(f"cold start ({mode}, process {i + 1} of {repeats}): {runs[mode][-1]}", file=sys.stderr)
    return runs


def cold_rows(runs: dict[str, list[dict]], max_length: int) -> list[tuple[str, ...]]:
    """Table rows of the cold-start measurements."""
    every = runs["raw"] + runs["build"]
    base = [r["torch_transformers"] for r in every]
    added = [r["dynabatch"] for r in every]
    raw = [r["call"] for r in runs["raw"]]
    build = [r["call"] for r in runs["build"]]
    n = runs["raw"][0]["texts"]
    ratio = statistics.median(build) / statistics.median(raw)
    sklearn = "imported" if any(r["sklearn"] for r in runs["build"]) else "not imported"
    procs = plural(len(every), "fresh process", "fresh processes")
    return [
        ("`import torch, transformers`", procs, spread(base), "-", "what dynabatch's import is added to"),
        ("`import dynabatch` after them", procs, spread(added), "-",
         f"target <= {IMPORT_TARGET_SECONDS:g} s: {verdict(statistics.median(added) <= IMPORT_TARGET_SECONDS)}"),
        (f"first raw `tokenizer(texts, truncation=True, max_length={max_length})`", f"{n:,} KJV passages",
         spread(raw), rate(n, statistics.median(raw)), plural(len(raw), "fresh process", "fresh processes")),
        (f"first `build_dynamic_batch_dataloader(texts, tokenizer, {COLD_BATCH_SIZE}, {max_length})`",
         f"{n:,} KJV passages", spread(build), rate(n, statistics.median(build)),
         f"{ratio:.2f}x the raw call, target <= {FIRST_BUILD_TARGET_RATIO:g}x: "
         f"{verdict(ratio <= FIRST_BUILD_TARGET_RATIO)}; scikit-learn {sklearn}"),
    ]


def time_tokenization(texts: list[str], tokenizer, max_length: int, repeats: int):
    """Best seconds of the raw tokenizer call and of ``tokenize_texts``, and the token store.

    The two alternate, so both see the same machine state, and each starts from a collected heap: the raw
    call's output (a list per text) is dropped at once, not left for the garbage collector to walk during the
    next call.
    """
    import gc

    from dynabatch import tokenize_texts

    raw_s = ours_s = float("inf")
    tokenized = None
    for _ in range(repeats):
        gc.collect()
        raw_s = min(raw_s, timed(lambda: tokenizer(texts, truncation=True, max_length=max_length))[0])
        gc.collect()
        seconds, tokenized = timed(lambda: tokenize_texts(texts, tokenizer, max_length))
        ours_s = min(ours_s, seconds)
    return raw_s, ours_s, tokenized


def plan_verdict(seconds: float, n_lengths: int) -> str:
    """Planner time against the target, which is set for 1M lengths (planning cost is not linear in n)."""
    if n_lengths < PLAN_TARGET_LENGTHS:
        return f"target <= {PLAN_TARGET_SECONDS:g} s is for {PLAN_TARGET_LENGTHS:,} lengths"
    return f"target <= {PLAN_TARGET_SECONDS:g} s: {verdict(seconds <= PLAN_TARGET_SECONDS)}"


def time_planner(lengths: np.ndarray, batch_sizes: list[int], max_length: int,
                 repeats: int) -> tuple[list[tuple[str, ...]], list[float]]:
    """Table rows and best seconds of ``plan_batches`` for each batch size (classifier already loaded)."""
    from dynabatch.sampling.planner import plan_batches

    rows, times = [], []
    k = len(lengths)
    for batch_size in batch_sizes:
        seconds, batches = best_time(lambda: plan_batches(lengths, batch_size, max_length), repeats)
        times.append(seconds)
        rows.append((f"`plan_batches`, `batch_size={batch_size}`", f"{k:,} lengths", f"{seconds:.2f} s",
                     rate(k, seconds), f"{len(batches):,} batches, largest {max(map(len, batches))}; "
                     f"{plan_verdict(seconds, k)}"))
    return rows, times


def versus_quoted(texts_per_second: float) -> str:
    return f"{texts_per_second / PUBLISHED_TEXTS_PER_SECOND:,.1f}x the ~{PUBLISHED_TEXTS_PER_SECOND:,} texts/s quoted"


def markdown(rows: list[tuple[str, ...]]) -> str:
    lines = ["| stage | size | time | texts/s | note |", "|---|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = cold_runs(args.cold_texts, args.max_length, args.cold_repeats)

    from transformers import AutoTokenizer

    from dynabatch.demo import kjv_passages, minilm_path, vary_lengths
    from dynabatch.memory.classifier import load_classifier

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=args.max_words, seed=args.seed)
    m, n, k = args.max_length, len(texts), args.n_lengths
    raw_s, ours_s, tokenized = time_tokenization(texts, tokenizer, m, args.repeats)
    ratio = ours_s / raw_s
    load_s, _ = timed(load_classifier)
    lengths = resample_lengths(tokenized.lengths, k, args.seed)
    plan_rows, plan_times = time_planner(lengths, args.batch_sizes, m, args.repeats)
    slowest = max(plan_times)
    per_text = ours_s / n + slowest / k  # seconds per text, texts to plan

    rows = cold_rows(runs, m) + [
        (f"raw `tokenizer(texts, truncation=True, max_length={m})`", f"{n:,} texts", f"{raw_s:.2f} s", rate(n, raw_s),
         "raw batched call, warm"),
        ("`tokenize_texts` (length stage + flat token store)", f"{n:,} texts", f"{ours_s:.2f} s", rate(n, ours_s),
         f"{ratio:.2f}x the raw call, target <= {TOKENIZE_TARGET_RATIO:g}x: {verdict(ratio <= TOKENIZE_TARGET_RATIO)}"),
        ("`load_classifier()`, once", "-", f"{load_s:.3f} s", "-", "compiled trees, cached after"),
        *plan_rows,
        ("planning throughput (planner only)", f"{k:,} lengths", f"{slowest:.2f} s", rate(k, slowest),
         f"slowest batch size; {versus_quoted(k / slowest)}"),
        ("texts to plan (`tokenize_texts` + planner)", "per text", f"{per_text * 1e6:.1f} us", rate(1, per_text),
         versus_quoted(1 / per_text)),
    ]
    command = " ".join(["python benchmarks/plan_speed.py", *(sys.argv[1:] if argv is None else argv)])
    header = (f"`{command}`: cold start on {runs['raw'][0]['texts']:,} KJV passages in fresh processes (median, "
              f"min-max; dynabatch imported with its bytecode compiled, as installed, and an empty cache); warm stages on {n:,} KJV texts of 1-{args.max_words} words, `max_length={m}`, best of "
              f"{args.repeats}; planning on {k:,} lengths resampled from theirs (mean {tokenized.lengths.mean():.1f}, "
              f"truncated at {m}: {np.mean(tokenized.lengths == m):.1%}).")
    report = f"{machine_line()}\n\n{header}\n\n{markdown(rows)}\n"
    print(report)
    if args.output is not None:
        args.output.write_text(report, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

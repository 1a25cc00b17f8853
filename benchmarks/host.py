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

**The loader build in every configuration** (``--builds``): how the loader tokenizes (its own threads, this thread,
worker processes) against one tokenizer call of the same configuration, cold. Four configurations, each in fresh
processes: the fast tokenizer with ``TOKENIZERS_PARALLELISM`` unset (``unset``) and ``false`` (``false``), a slow
(pure Python) tokenizer of the same vocabulary (``slow``: ``BertTokenizerLegacy``), and the fast tokenizer's class
with its own ``__call__`` (``custom``: the backend rule sends it through its call); two corpora, the KJV passages above
and the Python standard library's docstrings (``docstrings``: every module, class and function docstring ``ast``
finds under ``sysconfig.get_paths()["stdlib"]``, tests left out, cycled past their count: long texts, most cut at 256
tokens). Per configuration, corpus and size, one fresh process (imports and the tokenizer loaded before any clock):
the first ``build_dynamic_batch_dataloader(texts, tokenizer, batch_size=16, max_input_token_length=256,
num_workers=0)`` of the process (**cold**: its one-time costs included), one batched call ``tokenizer(texts,
truncation=True, max_length=256)``, then a second build (warm); the import of ``dynabatch`` is timed too. At the
largest size, the cold build again in processes pinned to one core, for the speed-up. Targets (issue 49): the cold
build <= 1.0x the call, and >= 1.5x its one-core speed at 100,000 texts where the tokenizer itself can use two
cores; ids equal to one thread (``tests/data/test_tokenization.py``)::

    python benchmarks/host.py --builds --sizes 1000,10000,100000
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


CONFIGURATIONS = ("unset", "false", "slow", "custom")
CORPORA = ("kjv", "docstrings")
BUILD_BATCH = 16


def _docstrings() -> list[str]:
    """Every module, class and function docstring of the Python standard library (tests left out), in file order."""
    import ast
    import pathlib
    import sysconfig

    found = []
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "site-packages", "idle_test"} & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and text.strip():
                    found.append(text)
    return found


def _corpus(name: str, n: int, docstrings: str | None) -> list[str]:
    if name == "kjv":
        return _texts(n)
    with open(docstrings, encoding="utf-8") as file:
        found = json.load(file)
    return [found[i % len(found)] for i in range(n)]


def _tokenizer(configuration: str):
    from transformers import AutoTokenizer, BertTokenizerLegacy

    from dynabatch.demo import minilm_path

    if configuration == "slow":
        return BertTokenizerLegacy.from_pretrained(minilm_path())
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    if configuration == "custom":
        tokenizer.__class__ = OwnCall
    return tokenizer


def _own_call_class():
    from transformers import BertTokenizer

    class OwnCall(BertTokenizer):  # a fast tokenizer with a __call__ of its own: the backend rule goes through it
        def __call__(self, text, *args, **kwargs):
            return super().__call__([t.replace("\t", " ") for t in text], *args, **kwargs)

    OwnCall.__qualname__ = OwnCall.__name__ = "OwnCall"
    return OwnCall


def build_worker(configuration: str, corpus: str, n: int, docstrings: str | None, only_build: bool) -> dict:
    """The cold build, the call and a second build of one configuration in this (fresh) process: their seconds."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if configuration == "false":
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    else:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    start = time.perf_counter()
    import dynabatch

    imports = time.perf_counter() - start
    tokenizer, texts = _tokenizer(configuration), _corpus(corpus, n, docstrings)

    def build() -> float:
        start = time.perf_counter()
        loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=BUILD_BATCH,
                                                          max_input_token_length=MAX_LENGTH, num_workers=0,
                                                          progress=False)
        seconds = time.perf_counter() - start
        assert len(loader.dataset) == n
        return seconds

    got = {"imports": imports, "cold": build(), "cores": len(os.sched_getaffinity(0))}
    if not only_build:
        start = time.perf_counter()
        encoded = tokenizer(texts, truncation=True, max_length=MAX_LENGTH)
        got["call"] = time.perf_counter() - start
        assert len(encoded["input_ids"]) == n
        got["second"] = build()
    return got


def _build_run(configuration: str, corpus: str, n: int, cores: list[int], docstrings: str,
               only_build: bool = False) -> dict:
    command = [sys.executable, __file__, "--build-worker", configuration, "--corpus", corpus, "--n-texts", str(n),
               "--cores", ",".join(map(str, cores)), "--docstrings", docstrings] + (["--only-build"] * only_build)
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{configuration} on {corpus}, {n} texts failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def builds(sizes: list[int], two: list[int], configurations: list[str], corpora: list[str]) -> str:
    """The table of the loader build against one call, every configuration, corpus and size, side by side."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        docstrings = os.path.join(folder, "docstrings.json")
        with open(docstrings, "w", encoding="utf-8") as file:
            json.dump(_docstrings(), file)
        lines = [f"| configuration | corpus | texts | call s | build, cold s (x call) | build, second s (x call) | "
                 f"import s |", "|---|---|---:|---:|---:|---:|---:|"]
        speed = ["| configuration | corpus | texts | build on 1 core s | on 2 cores s | speed-up |",
                 "|---|---|---:|---:|---:|---:|"]
        for n in sizes:
            for corpus in corpora:
                for configuration in configurations:
                    got = _build_run(configuration, corpus, n, two, docstrings)
                    print(f"{configuration}, {corpus}, {n}: {got}", file=sys.stderr, flush=True)
                    lines.append(f"| {configuration} | {corpus} | {n:,} | {got['call']:.2f} | {got['cold']:.2f} "
                                 f"({got['cold'] / got['call']:.2f}x) | {got['second']:.2f} "
                                 f"({got['second'] / got['call']:.2f}x) | {got['imports']:.1f} |")
                    if n == max(sizes):
                        one = _build_run(configuration, corpus, n, two[:1], docstrings, only_build=True)["cold"]
                        speed.append(f"| {configuration} | {corpus} | {n:,} | {one:.2f} | {got['cold']:.2f} | "
                                     f"{one / got['cold']:.2f}x |")
    return "\n".join(lines + [""] + speed)


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
    parser.add_argument("--builds", action="store_true", help="the loader build in every configuration")
    parser.add_argument("--sizes", default="1000,10000,100000", help="with --builds: texts, comma-separated")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS), help="with --builds: of "
                        f"{', '.join(CONFIGURATIONS)}")
    parser.add_argument("--corpora", default=",".join(CORPORA), help=f"with --builds: of {', '.join(CORPORA)}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--build-worker", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--docstrings", help=argparse.SUPPRESS)
    parser.add_argument("--only-build", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.build_worker:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])  # before any thread pool starts
        got = (worker(args.worker, args.n_texts) if args.worker else
               build_worker(args.build_worker, args.corpus, args.n_texts, args.docstrings, args.only_build))
        print(json.dumps(got))
        return
    two = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))[:2]
    if len(two) != 2:
        parser.error(f"--cores should name two cores this process may use, but got --cores={args.cores!r}")
    if args.builds:
        print(builds([int(n) for n in args.sizes.split(",")], two, args.configurations.split(","),
                     args.corpora.split(",")))
        return
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


OwnCall = _own_call_class() if __name__ == "__main__" else None  # importable by name in worker processes

if __name__ == "__main__":
    main()

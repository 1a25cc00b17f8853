"""Corpus scale: wall time, RSS growth and bytes on disk of embedding 10k, 100k and 1M texts three ways.

Held-out texts (``vary_lengths(kjv_passages(), n, max_words=128, seed=25)``,
a seed no test uses), the real all-MiniLM-L6-v2 tokenizer, truncation at 256
tokens, and a model-free ``fn`` that returns 384 ``float32`` values per text
computed from the batch (a fixed random embedding table, mean-pooled over the
attention mask with ``embedding_bag``): what an embedding job's storage and
bookkeeping cost, without a model's time hiding them. Each method runs end to end (texts in, every
text's 384 values out) in a fresh process, one after the other, its libraries
(torch, transformers, pyarrow, and what a first run imports once: ``torch._dynamo``, which the CPU
memory tracker's dispatch mode imports, and pandas, which pyarrow imports when it first writes a table)
imported before its clock starts:

1. **run**: ``build_dynamic_batch_dataloader(texts, tokenizer, 32, 256,
   num_workers=0)``, then ``dynabatch.run(fn, loader)`` with its defaults: a
   list of tensors in memory;
2. **run, output_path**: the same with ``output_path=`` a fresh directory: the
   rows go to the Parquet results store, the result reads them on demand;
3. **by hand (sentence-transformers' way)**: sort the texts by length, longest
   first; tokenize each batch of 32 with padding; ``fn``; rows into one
   preallocated array;
4. **flat**: **run, output_path** over texts read from a Parquet file
   (``read_texts(path)``, inside the measured run: the texts are never a Python
   list, whose 400,000 strings alone take 60+ MB), so the loader streams them.

With **run, output_path**, the same worker then times, on the finished store, the job lock (taken and given up:
``JobLock``) and the end-of-run accounting read (``store.located(n)``, one scan: which inputs have a
row or a failure record), as a share of the run's wall (target: within 2%).

5. **shards** (``--methods shards``, its own table): a store of ``n`` rows of 16 ``float32`` written a shard per
   100 rows (what a slow job's commits every 10 s leave), once with the writer merging small shards (the default)
   and once without: shards on disk, seconds to write, to open it for a run (every shard read whole, checksums
   verified) and for a check (keys only), to read every row back (``StoredRunResult.to_arrow()``), and the job
   lock and the accounting read as above.

``TOKENIZERS_PARALLELISM`` is left as the caller's environment has it (unset: texts are tokenized on every core).

Per method: wall seconds and texts/s; RSS growth (the peak resident memory
during the method over the resident memory before it, the texts already in
memory; Linux's ``VmHWM``, reset first); bytes on disk (the store). The
targets: ``output_path`` costs at most 10% wall time over ``run``; RSS growth
with ``output_path`` stays within the token store (``input_ids`` and the
tokenizer's extras) plus 300 MB; the store holds at most 1.15x the raw tensor
bytes (``n * 384 * 4``); **flat** in the number of texts: RSS growth of the
**flat** method at 400,000 texts at most 50 MB above that at 100,000 (the
tokens of finished chunks are freed; what stays per text is a few arrays).

Run it with (all three sizes, and the flat rows at 100,000 and 400,000 texts; the 1M row takes several
minutes a method)::

    python benchmarks/scale.py
    python benchmarks/scale.py --sizes 10000 --threads 1 --methods run,store
    python benchmarks/scale.py --methods flat          # the flat-memory rows only
    python benchmarks/scale.py --methods shards --sizes 100000,1000000   # small shards vs merged

``--sizes`` sets every method's sizes; without it the flat rows run at 100,000
and 400,000 texts, the sizes their target names (``--flat-sizes`` overrides).
A flat row is the median of three fresh processes (``--flat-repeats``): a peak
is the largest of many short-lived allocations that meet by chance, and one
run's moves by 20-30 MB. The flat line also gives the peak of the anonymous
memory alone (``RssAnon``): ``VmHWM`` counts the pages of shared libraries
(libtorch's alone is 55 MB), which the kernel drops and faults back in as other
processes need memory, so on a shared machine it moves with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = {"run": "run", "store": "run, output_path", "by-hand": "by hand (sentence-transformers' way)",
           "flat": "run, output_path, texts streamed from Parquet", "shards": "a store of small shards"}
SHARD_DIM, SHARD_ROWS = 16, 100  # the shards method: rows of 16 float32, a shard per 100 rows (a slow job's commits)
DIM, BATCH, MAX_LENGTH, SEED = 384, 32, 256, 25
FLAT_SIZES, FLAT_LIMIT = "100000,400000", 50
MB = 10**6


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _AnonPeak:
    """The peak of the process's anonymous resident memory (``RssAnon``: its own heap, not the pages of shared
    libraries or memory-mapped files, which the kernel may drop and fault back in at any time), sampled every 10 ms
    in a thread from :meth:`start` until :meth:`stop` returns it."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes("RssAnon"))
            self._stop.wait(0.01)

    def start(self) -> _AnonPeak:
        self.peak = _rss_bytes("RssAnon")
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_bytes("RssAnon"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident size, to the current one


def _embedder(vocab: int):
    """The model-free ``fn``: a fixed random embedding table mean-pooled over each row's real tokens, computed by
    ``embedding_bag`` (no ``(rows, width, 384)`` temporary whose varying sizes would fragment the C heap, so RSS
    growth measures the run's own memory)."""
    import torch

    table = torch.randn(vocab, DIM, generator=torch.Generator().manual_seed(0))

    def fn(batch):
        mask = batch["attention_mask"].to(torch.float32)
        pooled = torch.nn.functional.embedding_bag(batch["input_ids"], table, per_sample_weights=mask, mode="sum")
        return pooled / mask.sum(1, keepdim=True)

    return fn


def _by_hand(texts, tokenizer, fn):
    import numpy as np
    import torch

    order = np.argsort([-len(t) for t in texts], kind="stable")  # sentence-transformers sorts by characters
    out = np.empty((len(texts), DIM), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(texts), BATCH):
            index = order[start:start + BATCH]
            batch = tokenizer([texts[i] for i in index], padding=True, truncation=True, max_length=MAX_LENGTH,
                              return_tensors="pt")
            out[index] = fn(batch).numpy()
    return out


def _texts(n: int) -> list[str]:
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n, max_words=128, seed=SEED)


def _write_parquet(n: int, folder: str) -> str:
    """The ``n`` texts as one Parquet file (row groups of 65,536 texts) in ``folder``; its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(folder, f"corpus-{n}.parquet")
    pq.write_table(pa.table({"text": _texts(n)}), path, row_group_size=65_536)
    return path


def worker(method: str, n: int, threads: int | None, parquet: str | None = None) -> dict:
    """One method on ``n`` texts (``flat``: read from the Parquet file ``parquet``), in this (fresh) process: its
    figures as a dict."""
    # Imports a method triggers once, whatever the number of texts (fixed costs, not what this measures): the CPU
    # tracker's dispatch mode imports torch._dynamo (~1,100 modules, sympy among them), pyarrow imports pandas when
    # it first writes a table, and pyarrow itself takes a second.
    import pandas  # noqa: F401
    import torch
    import torch._dynamo
    from transformers import AutoTokenizer

    import dynabatch.inference.store  # noqa: F401
    from dynabatch import build_dynamic_batch_dataloader, read_texts, run
    from dynabatch.demo import minilm_path

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    fn = _embedder(len(tokenizer))
    texts = _texts(n) if method != "flat" else None
    store = tempfile.mkdtemp(prefix="dynabatch-scale-") if method in ("store", "flat") else None
    before, anon_before = _rss_bytes("VmRSS"), _rss_bytes("RssAnon")
    _reset_peak()
    anon = _AnonPeak().start() if method == "flat" else None
    start = time.perf_counter()
    token_store = None
    if method in ("run", "store", "flat"):
        if method == "flat":
            texts = read_texts(parquet)
        loader = build_dynamic_batch_dataloader(texts, tokenizer, BATCH, MAX_LENGTH, num_workers=0, progress=False)
        path = os.path.join(store, "results") if store else None
        with torch.inference_mode():
            result = run(fn, loader, output_path=path, progress=False)
        assert len(result) == n and not result.failed
        if loader.plan.stream is not None:  # a streamed corpus (above 16,384 texts): its chunks' tokens
            token_store = loader.plan.stream.token_bytes
        else:
            tokenized = loader.plan.collator.tokenized
            token_store = tokenized.input_ids.nbytes + sum(v.nbytes for v in tokenized.extras.values())
    else:
        result = _by_hand(texts, tokenizer, fn)
        assert result.shape == (n, DIM)
    seconds = time.perf_counter() - start
    peak = _rss_bytes("VmHWM")
    anon_growth = anon.stop() - anon_before if anon is not None else None
    lock_s = accounting_s = None
    if method == "store":
        lock_s, accounting_s = _store_costs(os.path.join(store, "results"), n)
    disk = 0
    if store:
        for root, _, files in os.walk(store):
            disk += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        shutil.rmtree(store)  # measured: a 1M-text store is gigabytes
    return {"method": METHODS[method], "n": n, "seconds": seconds, "rss_growth": peak - before, "disk": disk,
            "anon_growth": anon_growth, "lock_s": lock_s, "accounting_s": accounting_s,
            "token_store": token_store}


def _store_costs(path: str, n: int, key: str | None = None) -> tuple[float, float]:
    """Seconds to take and give up the store's job lock, and to read its accounting (which of ``n`` inputs have a
    row or a failure record), on the finished store at ``path``: what every run pays for them."""
    from dynabatch.inference.store import open_store
    from dynabatch.inference.store_lock import JobLock

    start = time.perf_counter()
    JobLock(path).release()
    lock = time.perf_counter() - start
    store = open_store(path, key=key, n=n, verify=False)
    start = time.perf_counter()
    store.located(n)  # the rows and the failure records: the run's one scan
    accounting = time.perf_counter() - start
    store.close()
    return lock, accounting


def shards_worker(n: int, merge: bool) -> dict:
    """A store of ``n`` rows written a shard per :data:`SHARD_ROWS` rows (``merge``: small shards merged as the
    writer does by default), then opened and read back: its figures as a dict."""
    import numpy as np
    import torch

    from dynabatch.inference import store as store_module
    from dynabatch.inference import store_writer
    from dynabatch.inference.results import StoredRunResult

    store_writer.COMMIT = store_writer.CommitPolicy(rows=SHARD_ROWS, compact=store_writer.COMMIT.compact if merge else n + 1)
    path = tempfile.mkdtemp(prefix="dynabatch-scale-shards-")
    rows = list(torch.randn(SHARD_ROWS, SHARD_DIM, generator=torch.Generator().manual_seed(0)))
    start = time.perf_counter()
    store = store_module.open_store(path, key="scale", n=n)
    writer = store.writer("0")
    for first in range(0, n, SHARD_ROWS):
        positions = np.arange(first, min(n, first + SHARD_ROWS))
        writer.write(positions, rows[:len(positions)], positions.astype(np.uint64))
    writer.close()
    store.close()
    figures = {"n": n, "merge": merge, "write_s": time.perf_counter() - start,
               "files": sum(name.endswith(".parquet") for name in os.listdir(path))}
    for name, verify in (("open_s", True), ("check_s", False)):
        start = time.perf_counter()
        store_module.open_store(path, key="scale", n=n, verify=verify).close()
        figures[name] = time.perf_counter() - start
    start = time.perf_counter()
    store = store_module.open_store(path, key="scale", n=n, verify=False)
    assert StoredRunResult(store.located(n)).to_arrow().num_rows == n
    store.close()
    figures["read_s"] = time.perf_counter() - start
    figures["lock_s"], figures["accounting_s"] = _store_costs(path, n, "scale")
    shutil.rmtree(path)
    return figures


def _shards_table(rows: list[dict]) -> str:
    header = ("| rows | small shards merged | shards on disk | write s | open s (verified) | open s (keys) | read s | "
              "lock ms | accounting ms |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']:,} | {'yes' if r['merge'] else 'no'} | {r['files']:,} | {r['write_s']:.1f} | "
                     f"{r['open_s']:.2f} | {r['check_s']:.2f} | {r['read_s']:.2f} | {r['lock_s'] * 1e3:.1f} | "
                     f"{r['accounting_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def _measure(method: str, n: int, threads: int | None, repeats: int = 1) -> dict:
    """The method's figures on ``n`` texts from a fresh process; ``flat``: the median of ``repeats`` fresh processes
    (a peak is the largest of many short-lived allocations meeting by chance: one run's is noisy), all of them kept
    under ``"rss_growths"``."""
    command = [sys.executable, __file__, "--worker", method, "--sizes", str(n)]
    if threads:
        command += ["--threads", str(threads)]
    if method == "shards":
        return [_run_worker([*command, "--merge", merge], method, n) for merge in ("yes", "no")]
    if method != "flat":
        return _run_worker(command, method, n)
    with tempfile.TemporaryDirectory(prefix="dynabatch-scale-corpus-") as folder:
        command += ["--parquet", _write_parquet(n, folder)]
        runs = [_run_worker(command, method, n) for _ in range(repeats)]
    middle = sorted(runs, key=lambda r: r["rss_growth"])[len(runs) // 2]
    return {**middle, "seconds": statistics.median(r["seconds"] for r in runs),
            "rss_growths": [r["rss_growth"] for r in runs],
            "anon_growth": statistics.median(r["anon_growth"] for r in runs)}


def _run_worker(command: list[str], method: str, n: int) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{method} on {n} texts failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows: list[dict]) -> str:
    lines = ["| texts | method | wall s | texts/s | RSS growth MB | on disk MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        disk = f"{r['disk'] / MB:,.1f}" if r["disk"] else "-"
        lines.append(f"| {r['n']:,} | {r['method']} | {r['seconds']:.1f} | {r['n'] / r['seconds']:,.0f} | "
                     f"{r['rss_growth'] / MB:,.0f} | {disk} |")
    return "\n".join(lines)


def _targets(rows: list[dict]) -> str:
    lines = []
    for n in sorted({r["n"] for r in rows}):
        got = {r["method"]: r for r in rows if r["n"] == n}
        plain, stored = got.get("run"), got.get("run, output_path")
        if stored and stored.get("lock_s") is not None:
            share = (stored["lock_s"] + stored["accounting_s"]) / stored["seconds"]
            lines.append(f"- {n:,} texts: the job lock {stored['lock_s'] * 1e3:,.1f} ms and the store's accounting read "
                         f"{stored['accounting_s'] * 1e3:,.1f} ms: {share:.2%} of the run's wall (target <= 2%: "
                         f"{'met' if share <= 0.02 else 'missed'})")
        if not (plain and stored):
            continue
        ratio = stored["seconds"] / plain["seconds"]
        limit = stored["token_store"] + 300 * MB
        size = stored["disk"] / (n * DIM * 4)
        lines.append(
            f"- {n:,} texts: output_path / run wall time {ratio:.2f}x (target <= 1.10: "
            f"{'met' if ratio <= 1.10 else 'missed'}); RSS growth with output_path {stored['rss_growth'] / MB:,.0f} MB "
            f"vs token store {stored['token_store'] / MB:,.0f} MB + 300 MB (target: "
            f"{'met' if stored['rss_growth'] <= limit else 'missed'}); store / raw tensor bytes {size:.3f}x "
            f"(target <= 1.15: {'met' if size <= 1.15 else 'missed'})")
    flat = sorted((r for r in rows if r["method"] == METHODS["flat"]), key=lambda r: r["n"])
    if len(flat) >= 2:
        small, large = flat[0], flat[-1]
        growth = (large["rss_growth"] - small["rss_growth"]) / MB
        anon = (large["anon_growth"] - small["anon_growth"]) / MB

        def runs(r: dict) -> str:
            return ", ".join(f"{g / MB:,.0f}" for g in r["rss_growths"])

        lines.append(
            f"- flat in N (texts streamed from Parquet, output_path; median of runs {runs(small)} and {runs(large)}): "
            f"RSS growth {small['rss_growth'] / MB:,.0f} MB at {small['n']:,} texts, {large['rss_growth'] / MB:,.0f} "
            f"MB at {large['n']:,}: {growth:+,.0f} MB (target <= {FLAT_LIMIT} MB: "
            f"{'met' if growth <= FLAT_LIMIT else 'missed'}); its anonymous memory (RssAnon, sampled every 10 ms) "
            f"{small['anon_growth'] / MB:,.0f} and {large['anon_growth'] / MB:,.0f} MB: {anon:+,.0f} MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated numbers of texts (default 10000,100000,1000000)")
    parser.add_argument("--flat-sizes", default=None,
                        help=f"the flat method's sizes (default: --sizes when given, else {FLAT_SIZES})")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--flat-repeats", type=int, default=3, help="fresh processes per flat row (their median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--parquet", help=argparse.SUPPRESS)
    parser.add_argument("--merge", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in (args.sizes or "10000,100000,1000000").split(",")]
    flat_sizes = [int(s) for s in (args.flat_sizes or args.sizes or FLAT_SIZES).split(",")]
    if args.worker == "shards":
        print(json.dumps(shards_worker(sizes[0], args.merge == "yes")))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, sizes[0], args.threads, args.parquet)))
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods should be of {', '.join(METHODS)}, but got {', '.join(unknown)}")
    rows, shard_rows = [], []
    runs = [(n, m) for n in sizes for m in methods if m not in ("flat", "shards")]
    runs += [(n, "flat") for n in flat_sizes if "flat" in methods]
    for n, method in runs:
        rows.append(_measure(method, n, args.threads, args.flat_repeats))
        print(f"{n:,} texts, {METHODS[method]}: {rows[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    for n in sizes if "shards" in methods else []:
        shard_rows += _measure("shards", n, args.threads)
        print(f"{n:,} rows, {METHODS['shards']}: done", file=sys.stderr, flush=True)
    if rows:
        print(f"## Corpus scale: {DIM} float32 per text, model-free fn (threads: {args.threads or 'torch default'})\n")
        print(_table(rows))
        print()
        print(_targets(rows))
    if shard_rows:
        print(f"\n## A store of small shards: {SHARD_DIM} float32 per row, a shard per {SHARD_ROWS} rows\n")
        print(_shards_table(shard_rows))


if __name__ == "__main__":
    main()

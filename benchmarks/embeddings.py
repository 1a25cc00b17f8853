"""sentence-transformers ``model.encode`` against ``dynabatch.sentence_transformers.encode``, side by side.

Both embed the same texts with the same model (the real all-MiniLM-L6-v2,
``SentenceTransformer(dynabatch.demo.minilm_path())``, offline) and the same
``batch_size``:

* ``model.encode``: sentence-transformers' own loop: texts sorted by character
  length, longest first, a fixed ``batch_size``, each batch tokenized when it runs;
* ``dynabatch encode``: ``dynabatch.sentence_transformers.encode(model, texts,
  batch_size=...)``: every text tokenized once by the model's own
  ``preprocess``, sorted by token length, ``batch_size`` rows in the first
  (longest) batch and later batches grown under its measured peak memory,
  through ``dynabatch.run`` (its defaults: measured mode).

Texts: held-out King James Bible text (passages from the 12,000th on, which
neither the bundled classifier's profiles nor the tests use), cut to 1-300
words (``dynabatch.demo.vary_lengths``, log-uniform), ``--n`` of them (5,000).
Each method runs ``--repeats`` times, alternating, after one warm-up call of
each; the table gives the median wall time, texts per second, the speed-up
against ``model.encode`` and the largest absolute difference of any vector
component from ``model.encode``'s. The machine may be shared: compare the
ratio within one run.

Run: ``python benchmarks/embeddings.py`` (``--n 500 --repeats 1`` for a quick look;
``--output PATH`` also writes the table to a file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def held_out_texts(n: int) -> list[str]:
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages()[12_000:], n=n, max_words=300, seed=5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="texts to embed")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from dynabatch.demo import minilm_path
    from dynabatch.sentence_transformers import encode

    if args.threads:
        torch.set_num_threads(args.threads)
    model = SentenceTransformer(minilm_path(), device="cpu")
    texts = held_out_texts(args.n)
    methods = {
        "model.encode": lambda: model.encode(texts, batch_size=args.batch_size),
        "dynabatch encode": lambda: encode(model, texts, batch_size=args.batch_size),
    }
    model.encode(texts[:64], batch_size=args.batch_size)
    encode(model, texts[:64], batch_size=args.batch_size)  # warm-up of both: first calls, lazy imports

    seconds: dict[str, list[float]] = {name: [] for name in methods}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(args.repeats):
        for name, run in methods.items():
            start = time.perf_counter()
            vectors[name] = run()
            seconds[name].append(time.perf_counter() - start)

    reference = statistics.median(seconds["model.encode"])
    lines = [(f"## all-MiniLM-L6-v2 on {args.n} held-out texts (1-300 words), batch_size={args.batch_size}, "
              f"cpu, {torch.get_num_threads()} threads"), "",
             "| method | wall s (median) | texts/s | speed-up | max abs diff vs model.encode |", "|---|---|---|---|---|"]
    for name in methods:
        wall = statistics.median(seconds[name])
        diff = float(np.abs(vectors[name] - vectors["model.encode"]).max())
        lines.append(f"| {name} | {wall:.2f} | {args.n / wall:,.0f} | {reference / wall:.2f}x | {diff:.1e} |")
    lines += ["", f"{args.repeats} timed runs per method, alternating; all runs: "
              + "; ".join(f"{name} {', '.join(f'{s:.2f}' for s in seconds[name])}" for name in methods)]
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()

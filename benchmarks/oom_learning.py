"""Out-of-memory errors on a device whose real limit the measured peaks do not show: how many, and what runs.

A ``fn`` runs a real forward (``--model``) and raises ``torch.OutOfMemoryError``
for any call over ``--limit-rows`` rows, whatever its width: per-row memory
the measured peaks do not show, as a ``generate`` call's logits over a large
vocabulary on a GPU, while the peaks the CPU tracker measures fall with width.
Texts are KJV passages of varied lengths (``vary_lengths``, seed 3), run
longest first, so measured mode grows the batches as the texts get shorter
until they pass the limit.

Two ways of running ``dynabatch.run(fn, ...)`` over them:

* **measured**: a dynabatch loader, ``run``'s defaults (measured mode: the
  planner sizes every next batch);
* **guarded**: a plain iterable of batches (a first batch of ``--batch-size``
  longest texts, then batches of ``--guarded-rows``), which ``run`` splits but
  never re-plans (guarded mode).

Each is compared, row by row, with the same inputs run without errors.
Columns: batches (the report's), calls (of ``fn``, failed ones included),
OOM events, pre-split batches, the most rows of a call after the last error,
the largest difference from the error-free results, wall seconds.

The script uses only the public API, so the same command run against another
checkout (``PYTHONPATH=/path/to/it``) measures that code. Run it with::

    python benchmarks/oom_learning.py
    python benchmarks/oom_learning.py --model minilm --n-texts 300 --batch-size 8
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _encoder(name: str) -> Any:
    if name == "minilm":
        from transformers import AutoModel

        from dynabatch.demo import minilm_path

        model = AutoModel.from_pretrained(minilm_path()).eval()
        return lambda b: model(**b).last_hidden_state[:, 0]
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(vocab_size=30522, d_model=32, encoder_layers=1, decoder_layers=1,
                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=512, pad_token_id=0, decoder_start_token_id=0)
    torch.manual_seed(0)
    encoder = MarianMTModel(config).eval().get_encoder()
    return lambda b: encoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state[:, 0]


def _limited(fn: Any, limit_rows: int) -> Any:
    def call(batch: Any) -> Any:
        call.rows.append(len(batch["input_ids"]))
        if len(batch["input_ids"]) > limit_rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: more than {limit_rows} rows)")
        return fn(batch)

    call.rows = []
    return call


def _guarded_batches(loader: Any, first: int, rows: int) -> list[Any]:
    order, collate = loader.plan.planner.order, loader.plan.collator
    sizes = [min(first, len(order))]
    while sum(sizes) < len(order):
        sizes.append(min(rows, len(order) - sum(sizes)))
    starts = np.cumsum([0, *sizes])
    return [collate(order[a:b]) for a, b in itertools.pairwise(starts)]


def _row(mode: str, inputs: Any, fn: Any, args: argparse.Namespace) -> str:
    from dynabatch import run

    limited = _limited(fn, args.limit_rows)
    start = time.perf_counter()
    got = run(limited, inputs, progress=False)
    seconds = time.perf_counter() - start
    want = run(fn, inputs, progress=False)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    report = got.report
    failed = [i for i, n in enumerate(limited.rows) if n > args.limit_rows]
    after_last = limited.rows[failed[-1] + 1 :] if failed else []
    most = max(after_last) if after_last else "-"
    return (f"| {mode} | {report.batches} | {len(limited.rows)} | {report.oom_events} | {report.pre_split_batches} "
            f"| {most} | {diff:.1e} | {seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["encoder", "minilm"], default="encoder",
                        help="a Marian-shaped 1-layer encoder with random weights, or the real all-MiniLM-L6-v2")
    parser.add_argument("--n-texts", type=int, default=400)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--limit-rows", type=int, default=24)
    parser.add_argument("--guarded-rows", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from dynabatch import build_dynamic_batch_dataloader
    from dynabatch.demo import kjv_passages, minilm_path, vary_lengths

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=args.max_words, seed=3)
    loader = build_dynamic_batch_dataloader(texts, tokenizer, args.batch_size, args.max_length, num_workers=0,
                                            progress=False, return_token_type_ids=args.model == "minilm")
    fn = _encoder(args.model)
    print(f"## {args.n_texts} texts, batch_size {args.batch_size}, max_length {args.max_length}, model {args.model}; "
          f"any call over {args.limit_rows} rows runs out of memory\n")
    print("| mode | batches | calls | OOM events | pre-split | most rows after the last error | max diff | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        print(_row("measured (a dynabatch loader)", loader, fn, args))
        batches = _guarded_batches(loader, args.batch_size, args.guarded_rows)
        print(_row(f"guarded (batches of {args.guarded_rows} rows)", batches, fn, args))


if __name__ == "__main__":
    main()

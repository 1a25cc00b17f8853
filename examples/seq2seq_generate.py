"""Greedy ``model.generate`` with an encoder-decoder: a plain DataLoader against dynabatch.

The model is Marian-shaped (``MarianMTModel`` from a ``MarianConfig``: d_model
256, 2 encoder + 2 decoder layers, a 58,101-token vocabulary so every generated
row carries real per-row logits memory) with RANDOM weights
(``torch.manual_seed(0)``): no model hub is reachable here, so no trained
translation model can be downloaded. The generated tokens are therefore
meaningless text. That does not matter for what this example shows: memory and
speed depend on the shapes of the batches, not on the values of the weights.
The inputs are KJV texts of varied lengths, tokenized with the offline
all-MiniLM-L6-v2 WordPiece tokenizer (its ids, < 30,522, fit the vocabulary).

Both loaders run in one process, on the same texts and the same model:

* plain: ``torch.utils.data.DataLoader`` over the texts in input order with a
  fixed ``batch_size``, each batch padded by the tokenizer in ``collate_fn``;
* dynabatch: ``build_dynamic_batch_dataloader`` (longest texts first, batches
  growing as texts get shorter, under the first batch's peak memory).

Each batch runs ``model.generate(**batch, max_new_tokens=8, min_new_tokens=8,
do_sample=False, num_beams=1)`` under ``torch.inference_mode()``. The script
prints a table (batches, largest batch, padding efficiency = real input tokens
/ padded input cells, wall time, texts/s) and the speed-up of dynabatch, then
puts the dynabatch outputs back in input order with ``restore_order`` and
compares them with the plain loader's token for token (trailing padding
stripped). It exits with status 1 unless every row is equal.

With the defaults (800 texts) it took 47 s with ``--threads 1`` on a 2-core
machine shared with a background job; with torch's two threads fighting that
job for the cores it took 2 min 44 s, so on a shared machine pass
``--threads 1`` (an idle machine is faster with two). Runs offline. Run it
with::

    python examples/seq2seq_generate.py
    python examples/seq2seq_generate.py --n-texts 200 --batch-size 16 --threads 2
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

PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 102  # [SEP] of the MiniLM tokenizer


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
        description="Greedy generation with a random-weight Marian-shaped encoder-decoder over KJV texts, once "
        "with a plain fixed-size DataLoader and once with dynabatch; print a comparison table and check that "
        "both generate the same tokens.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--n-texts", type=int, default=800,
                        help="number of KJV texts, cut to 1..--max-words words (log-uniform lengths)")
    parser.add_argument("--max-words", type=int, default=200, help="longest text, in words")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="rows per batch of the plain loader; rows of dynabatch's first (longest) batch")
    parser.add_argument("--max-length", type=int, default=256, help="truncation limit per input text, in tokens")
    parser.add_argument("--new-tokens", type=int, default=8,
                        help="tokens generated per text (max_new_tokens = min_new_tokens)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads(THREADS); None keeps torch's own setting (on a busy "
                        "machine 1 is often fastest)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the text sampling")
    args = parser.parse_args(argv)
    for name in ("n_texts", "max_words", "batch_size", "max_length", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads should be a positive integer, but got {args.threads}")
    return args


def build_model() -> torch.nn.Module:
    """A Marian-shaped encoder-decoder with random weights (seeded)."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=58101,
        d_model=256,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        max_position_embeddings=512,
        pad_token_id=PAD_TOKEN_ID,
        decoder_start_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    return MarianMTModel(config).eval()


def generate(model: torch.nn.Module, batch, new_tokens: int) -> torch.Tensor:
    # The BERT tokenizer also returns token_type_ids, which Marian's generate refuses.
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          num_beams=1)


def pad_with_tokenizer(batch_texts: list[str], tokenizer, max_length: int):
    return tokenizer(batch_texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")


def strip_padding(row: torch.Tensor) -> list[int]:
    """The generated ids without trailing padding (the leading decoder start token is kept)."""
    ids = row.tolist()
    end = len(ids)
    while end > 1 and ids[end - 1] == PAD_TOKEN_ID:
        end -= 1
    return ids[:end]


def run_loader(model: torch.nn.Module, loader, new_tokens: int) -> tuple[list[torch.Tensor], list, int, int, int]:
    """Generates for every batch: (per-batch outputs, per-batch indices, largest batch, real tokens, padded cells)."""
    outputs, indices = [], []
    largest = real = cells = 0
    for batch in loader:
        mask = batch["attention_mask"]
        largest = max(largest, mask.shape[0])
        real += int(mask.sum())
        cells += mask.numel()
        outputs.append(generate(model, batch, new_tokens))
        indices.append(getattr(batch, "indices", None))
    return outputs, indices, largest, real, cells


def run_plain(model, tokenizer, texts: list[str], args: argparse.Namespace) -> tuple[RunStats, list[list[int]]]:
    start = time.perf_counter()
    loader = DataLoader(texts, batch_size=args.batch_size, shuffle=False,
                        collate_fn=partial(pad_with_tokenizer, tokenizer=tokenizer, max_length=args.max_length))
    outputs, _, largest, real, cells = run_loader(model, loader, args.new_tokens)
    rows = [strip_padding(row) for out in outputs for row in out]
    seconds = time.perf_counter() - start
    return RunStats("plain DataLoader", len(texts), len(outputs), largest, real, cells, seconds), rows


def run_dynabatch(model, tokenizer, texts: list[str],
                  args: argparse.Namespace) -> tuple[RunStats, list[list[int]], float]:
    """Returns the stats, the generated rows in input order and the setup (tokenize + plan) seconds."""
    start = time.perf_counter()
    loader = build_dynamic_batch_dataloader(texts, tokenizer, args.batch_size, args.max_length, num_workers=0)
    setup = time.perf_counter() - start
    outputs, indices, largest, real, cells = run_loader(model, loader, args.new_tokens)
    rows = [strip_padding(row) for row in restore_order(outputs, indices)]
    seconds = time.perf_counter() - start
    return RunStats("dynabatch", len(texts), len(outputs), largest, real, cells, seconds), rows, setup


def warm_up(model, tokenizer, texts: list[str], args: argparse.Namespace) -> None:
    """One small generate call, so neither timed run pays for the first call's set-up."""
    generate(model, pad_with_tokenizer(texts[:2], tokenizer, args.max_length), args.new_tokens)


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
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # random weights: no "generation config" chatter
    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=args.max_words, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = build_model()
    print(f"{len(texts)} KJV texts (1..{args.max_words} words), Marian-shaped model with RANDOM weights "
          f"(d_model 256, 2+2 layers, vocab 58101), {args.new_tokens} new tokens greedy, "
          f"batch_size={args.batch_size}, max_length={args.max_length}, torch threads={torch.get_num_threads()}\n")

    with torch.inference_mode():
        warm_up(model, tokenizer, texts, args)
        plain, plain_rows = run_plain(model, tokenizer, texts, args)
        dyn, dyn_rows, setup = run_dynabatch(model, tokenizer, texts, args)

    print_table([plain, dyn])
    print(f"\nspeed-up of dynabatch over the plain loader: {plain.seconds / dyn.seconds:.2f}x "
          f"(dynabatch time includes {setup:.2f}s to tokenize, load the classifier and plan)")

    equal = sum(a == b for a, b in zip(plain_rows, dyn_rows))
    ok = len(plain_rows) == len(dyn_rows) == len(texts) and equal == len(texts)
    print(f"generated tokens restored to input order vs plain loader: {equal}/{len(texts)} rows equal "
          f"({'OK' if ok else 'FAIL'})")
    if not ok:
        print(f"error: {len(texts) - equal} of {len(texts)} rows differ between dynabatch and the plain loader",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

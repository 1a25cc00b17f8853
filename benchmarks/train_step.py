"""Packed training steps on a device: dynabatch's packing path end to end, checked against padded batches.

A Llama-shaped decoder (random weights, seeded; ``--hidden`` wide, ``--layers`` layers, the tokenizer's
vocabulary, sdpa attention) trains for ``--steps`` optimizer steps (AdamW) on KJV passages packed by
``MultipackBatchSampler`` into rows of at most ``--capacity`` tokens, ``--bins`` rows a batch, keeping
every passage (``drop_last=False``), collated by ``PackedCollator`` (position ids restarting per
sequence, the 4D block-diagonal causal mask). It checks and reports:

* **packed = padded**: the first batch's loss, packed, against the loss of the same sequences padded
  one per row (the same tokens scored): equal within ``--tolerance`` (relative) when the block mask
  and the position ids keep the sequences apart on this device's kernels;
* **it trains**: every step's loss is finite, and the last step's loss is below the first's;
* **throughput and memory**: real tokens per second of forward + backward + optimizer step (after
  one warm-up step, synchronized on CUDA), the padding share of the packed rows, and the peak memory
  of one step (``dynabatch.track_peak_memory(device)``: CUDA statistics, or the CPU tracker).

The text and tokenizer are ``benchmarks/_assets.py``'s (the PyPI demo assets, else the copies in
``benchmarks/assets/``). Prints a markdown table (``--output`` also writes it) and exits 1 when a
check fails. Run it with::

    python benchmarks/train_step.py --device cuda
    python benchmarks/train_step.py --device cpu --steps 3 --hidden 32 --layers 1 --capacity 256 --n-texts 400
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from dynabatch import MultipackBatchSampler, PackedCollator, track_peak_memory
from dynabatch.data.packing import packed_dataloader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps, the first a warm-up")
    parser.add_argument("--n-texts", type=int, default=24408, help="KJV passages (the first N)")
    parser.add_argument("--capacity", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--bins", type=int, default=8, help="packed rows per batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="packed vs padded loss, relative")
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    for name in ("steps", "n_texts", "capacity", "bins", "hidden", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {getattr(args, name)}")
    if args.steps < 2:
        parser.error(f"--steps should be at least 2 (a warm-up step, then timed ones), but got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    return args


def build_model(vocab_size: int, args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.capacity)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(args.device)


def padded_loss(model: Any, sequences: list[list[int]], pad_id: int, device: str) -> float:
    """The loss of ``sequences`` padded one per row (labels -100 on the padding)."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, seq in enumerate(sequences):
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, : len(seq)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        return float(model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = _assets.tokenizer()
    texts = list(_assets.kjv_passages()[: args.n_texts])
    ids = tokenizer(texts, truncation=True, max_length=args.capacity)["input_ids"]
    lengths = np.array([len(x) for x in ids])
    examples = [{"input_ids": x} for x in ids]
    sampler = MultipackBatchSampler(list(range(len(ids))), args.bins, args.capacity, lengths, drop_last=False)
    collator = PackedCollator(pad_token_id=tokenizer.pad_token_id, block_mask="float",
                              return_flash_attn_kwargs=False)
    loader = packed_dataloader(examples, sampler, collator)
    model = build_model(len(tokenizer), args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    batches = iter(zip(loader, sampler))
    first, first_bins = next(batches)
    sequences = [ids[i] for bins in first_bins for i in bins]
    with torch.no_grad():
        packed_first = float(model(**{k: v.to(args.device) for k, v in first.items()}).loss)
    padded_first = padded_loss(model, sequences, tokenizer.pad_token_id, args.device)
    gap = abs(packed_first - padded_first) / abs(padded_first)

    losses, real, slots, seconds, peak = [], 0, 0, 0.0, 0
    batch, bins = first, first_bins
    for step in range(args.steps):
        if step:
            batch, bins = next(batches, (None, None))
            if batch is None:  # fewer batches than steps: start the epoch again
                batches = iter(zip(loader, sampler))
                batch, bins = next(batches)
        batch = {k: v.to(args.device) for k, v in batch.items()}
        _sync(args.device)
        start = time.perf_counter()
        with track_peak_memory(args.device) if step == 1 else contextlib.nullcontext() as mem:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(args.device)
        losses.append(float(loss.detach()))
        if step:  # the first step warms kernels and the allocator up
            seconds += time.perf_counter() - start
            real += int(sum(lengths[b].sum() for b in bins))
            slots += int(batch["input_ids"].numel())
        if mem is not None:
            peak = mem.peak_bytes

    checks = {
        "packed loss = padded loss": gap <= args.tolerance,
        "every loss finite": all(math.isfinite(x) for x in losses),
        "loss went down": losses[-1] < losses[0],
    }
    gpu = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
    lines = [
        f"## Packed training steps on {args.device}{gpu}",
        "",
        (f"Llama-shaped decoder (hidden {args.hidden}, {args.layers} layers, vocab {len(tokenizer):,}, sdpa, "
         f"random weights), {len(ids):,} KJV passages, {_assets.tokenizer_name()} tokenizer, "
         f"MultipackBatchSampler: {args.bins} rows of {args.capacity} tokens a batch, {len(sampler)} batches an "
         f"epoch; torch {torch.__version__}"),
        "",
        "| check or figure | value |",
        "|---|---|",
        f"| packed vs padded loss (first batch) | {packed_first:.6f} vs {padded_first:.6f} (relative gap {gap:.1e}) |",
        f"| loss, first -> last step | {losses[0]:.4f} -> {losses[-1]:.4f} ({args.steps} steps) |",
        f"| real tokens/s (forward, backward, step) | {real / seconds:,.0f} |",
        f"| padding in packed rows | {1 - real / slots:.1%} |",
        f"| peak memory of one step | {peak / 2**20:,.1f} MiB |",
        *(f"| {name} | {'ok' if ok else 'FAILED'} |" for name, ok in checks.items()),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

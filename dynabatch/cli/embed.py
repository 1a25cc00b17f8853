"""``dynabatch embed INPUT OUTPUT``: a corpus in, one embedding per text out, into a Parquet store that resumes.

::

    dynabatch embed corpus/ embeddings/ --text-column text --id-column id
    torchrun --nproc-per-node 8 -m dynabatch embed corpus/ embeddings/ --id-column id   # one rank per GPU

The input is whatever :mod:`dynabatch.cli.corpus` opens (Parquet, CSV or TSV
files, JSONL, text lines, a ``datasets`` folder). The model is a local folder:

* a sentence-transformers folder (it has ``modules.json``) runs its own modules
  (tokenization, prompts, pooling, Normalize) through
  :func:`dynabatch.integrations.sentence_transformers.corpus_embedder`: the vectors of
  ``model.encode``. Its max length, prompts and modules are what
  sentence-transformers itself reads from the folder, whichever version saved
  it: the folder is opened by ``SentenceTransformer`` with its weights on the
  meta device (none read) before anything runs;
* any other Hugging Face folder loads with ``AutoModel`` (an encoder-decoder's
  encoder) and is pooled by ``--pooling``: ``mean`` over the real tokens,
  ``cls`` (the first real token) or ``last`` (the last real token), then
  scaled to unit length with ``--normalize``.

The default model is the demo's all-MiniLM-L6-v2 (the ``examples`` extra), so
the command runs offline after install. The store holds ``id`` (with
``--id-column``; else rows are keyed by ``position``), ``position`` and
``output`` (the vector, in ``--dtype``); its key is what computed the rows (a
digest of the model's files, wherever they lie, the pooling, the dtype, the
length limit and the prompt's text, whichever flag or the model's default
names it), so the same command again resumes, the same
model files under another folder too, and another model or setting is refused,
naming what differs.

``--on-error skip`` sets a text whose model call raises (not out of memory)
aside, listed with its error in the summary and ``--report``; the same command
again retries it. Without it, the error names the positions and ids of the batch the model raised on.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dynabatch._distribution import extra
from dynabatch._validation import bad_value
from dynabatch.cli import job
from dynabatch.cli._checks import (
    Tie,
    check_dtype,
    check_model_folder,
    check_positive,
    refusing,
)
from dynabatch.cli.output import Output

__all__ = ["ENCODER_BATCH_TOKENS", "POOLINGS", "add_parser", "embed_command", "pooled"]

POOLINGS = ("auto", "mean", "cls", "last")
ENCODER_BATCH_TOKENS = 16_384
"""Padded tokens a batch of an encoder's forward holds by default (``dynabatch embed --max-batch-tokens``).

Where more rows stop paying: to be confirmed on a GPU by ``benchmarks/encoder_curve.py`` (throughput against
batch tokens for MiniLM-, BERT-base- and 0.5B-decoder-shaped embedders); no GPU has run it yet. Until then it is
text-embeddings-inference's default ``--max-batch-tokens``, which that server reaches after a warm-up at that
size, and past the knee by arithmetic: 16,384 tokens of BERT-base are ~3.6 TFLOP, ~9 ms of an H100/H200 at 40%
of its 989 dense TFLOP/s, against ~1 ms of kernel launches a forward, so the device, not the host, bounds such a
batch; MiniLM's ~0.7 TFLOP (~2 ms) is on a par with the host's per-batch work (collate, copy, launch)."""
_ST = "sentence-transformers"

_DESCRIPTION = "A corpus in, one embedding per text out, into a Parquet store; the same command again resumes it."
_EXAMPLES = """examples:
  dynabatch embed corpus/ embeddings/ --text-column text --id-column id
  dynabatch embed docs.jsonl embeddings/ --model ./e5-base --pooling mean --normalize
  torchrun --nproc-per-node 8 -m dynabatch embed corpus/ embeddings/ --id-column id"""


def add_parser(sub: Any) -> None:
    """The ``embed`` subcommand's options."""
    p = job.command_parser(sub, "embed", embed_command, help="embed a corpus into a Parquet store (resumable, every "
                           "GPU)", description=_DESCRIPTION, examples=_EXAMPLES, item="document", rows="rows")
    p.add_argument("--model", default=None,
                   help="a local model folder: sentence-transformers or any transformers AutoModel (default: the "
                   "demo's all-MiniLM-L6-v2)")
    p.add_argument("--pooling", choices=POOLINGS, default="auto",
                   help="auto (default): a sentence-transformers folder's own modules, else mean; or mean, cls or last "
                   "token of a transformers model")
    p.add_argument("--normalize", action="store_true", help="scale every vector to unit length")
    p.add_tied("--prompt-name", tie=Tie(excludes="prompt", why="--prompt is the prompt itself, --prompt-name names "
                                        "one the model saved: give one"),
               help="a sentence-transformers model's prompt (e.g. query)")
    p.add_argument("--prompt", default=None, help="a prompt prepended to every text (sentence-transformers)")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per text at most (default: the model's own: a sentence-transformers folder's "
                   "max_seq_length, else its positions)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help=f"padded tokens per batch at most (default: {ENCODER_BATCH_TOKENS:,}, or the first batch's "
                   "--batch-size x --max-length where more)")
    job.add_run_arguments(p, "text", 64, "comma-separated devices (default: every GPU, else the CPU)")


@dataclass
class _Job:
    """An embed job with every option checked, before any weights load."""

    place: job.Placement
    folder: str
    name: str
    config: Any
    pooling: str  # "sentence-transformers", "mean", "cls" or "last"
    dtype: torch.dtype
    max_length: int
    texts: Any
    ids: Any
    key: str
    output: Output
    tokenizer: Any = None  # a transformers folder's (a sentence-transformers model tokenizes by its own rules)

    def describe(self, max_length: int) -> str:
        """The model line of the summary, with the max length the run used."""
        how = "its sentence-transformers modules" if self.pooling == _ST else f"{self.pooling} pooling"
        return f"{self.name} ({how}), {str(self.dtype).removeprefix('torch.')}, max length {max_length}"


def _model_folder(value: str | None) -> tuple[str, str]:
    """``(folder, name)`` of ``--model`` (default: the demo's all-MiniLM-L6-v2); the folder absolute, as every
    process of the job reads it (``--ray``'s actors run in folders of their own)."""
    if value is not None:
        return os.path.abspath(value), Path(value).resolve().name
    try:
        from dynabatch.demo import minilm_path

        return minilm_path(), "all-MiniLM-L6-v2"
    except ImportError as exc:
        # exc names the extra that installs it (dynabatch.demo's import_extra)
        raise ValueError(f"--model should be given, or the demo's all-MiniLM-L6-v2 installed, but got no --model and "
                         f"{exc}") from exc


def _sentence_transformer(folder: str) -> Any:
    """The folder as sentence-transformers reads it, its modules built on the meta device (no weights read): its
    ``max_seq_length``, ``prompts`` and ``default_prompt_name`` are those ``model.encode`` runs with, whichever
    version saved the folder."""
    import logging

    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as transformers_logging

    quiet = logging.getLogger("sentence_transformers")
    level, bar = quiet.level, transformers_logging.is_progress_bar_enabled()
    quiet.setLevel(logging.ERROR)  # it notes that device_map overrides device
    transformers_logging.disable_progress_bar()  # no weights are loaded: no "Loading weights" bar
    # use_kernels=False: transformers>=5.25 swaps in hub kernels at load by default, and refuses the meta device
    # there (kernels has no meta kernels); the modules read here never run
    try:
        return SentenceTransformer(folder, device="cpu", local_files_only=True,
                                   model_kwargs={"device_map": "meta", "use_kernels": False})
    except Exception as exc:  # whatever it raises, the run's load would raise too: say it now, in one line
        raise ValueError(f"--model should be a folder sentence-transformers loads, but got --model={folder!r}: "
                         f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                         ) from exc
    finally:
        quiet.setLevel(level)
        if bar:
            transformers_logging.enable_progress_bar()


def _saved_json(folder: str, name: str) -> Any:
    """A sentence-transformers file of the folder as JSON; ``None`` where it is missing or unreadable (what
    sentence-transformers then makes of the folder is said where it loads it)."""
    path = Path(folder) / name
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _saved_max_seq_length(folder: str) -> int | None:
    """The ``max_seq_length`` a sentence-transformers folder's ``sentence_bert_config.json`` keeps (versions up to
    5.3 write it there), for a folder run as a transformers ``AutoModel``."""
    saved = _saved_json(folder, "sentence_bert_config.json")
    trained = saved.get("max_seq_length") if isinstance(saved, dict) else None
    return trained if isinstance(trained, int) and not isinstance(trained, bool) and trained > 0 else None


def _check_sentence_transformer_folder(folder: str) -> None:
    """Refuses a sentence-transformers folder whose own model is not what ``SentenceTransformer(folder).encode`` runs:
    another kind (``model_type`` in its ``config_sentence_transformers.json``: a ``SparseEncoder``, ``CrossEncoder``,
    ``MultiVectorEncoder``), which ``SentenceTransformer`` converts with a warning to its transformer and a mean
    pooling (the sparse head, the classifier dropped), or a ``Router`` first (a route per task; the command names
    none)."""
    config = _saved_json(folder, "config_sentence_transformers.json")
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in (None, "SentenceTransformer"):
        method = "predict or .rank" if kind == "CrossEncoder" else "encode"
        raise ValueError(f"--model should be a SentenceTransformer folder (or be given --pooling mean, cls or last to "
                         f"pool its transformer's outputs), but got --model={folder!r}, a {kind} (the model_type of "
                         f"its config_sentence_transformers.json): call sentence_transformers.{kind}(folder).{method} "
                         "for it")
    modules = _saved_json(folder, "modules.json")
    first = modules[0] if isinstance(modules, list) and modules and isinstance(modules[0], dict) else {}
    if str(first.get("type", "")).rsplit(".", 1)[-1] == "Router":
        raise ValueError(f"--model should be a sentence-transformers folder whose first module is a Transformer, but "
                         f"got --model={folder!r}, whose first module is a Router (a route per task, such as query "
                         "and document, which the command does not choose): call model.encode_query or "
                         "model.encode_document for it")


def _pooling(args: argparse.Namespace, folder: str) -> str:
    """``--pooling`` (``auto``: sentence-transformers' own for a folder with ``modules.json``, else ``mean``), with
    the flags and the folder checked for it."""
    is_st = (Path(folder) / "modules.json").is_file()
    pooling = (_ST if is_st else "mean") if args.pooling == "auto" else args.pooling
    if pooling == _ST and importlib.util.find_spec("sentence_transformers") is None:
        raise ValueError(f"--model should be run by sentence-transformers (its folder has modules.json: "
                         f"{extra('sentence-transformers')}), or given --pooling mean, cls or last to run it as a "
                         f"transformers AutoModel, but got --model={folder!r} and no sentence_transformers module")
    if pooling != _ST and (args.prompt is not None or args.prompt_name is not None):
        flag = "--prompt" if args.prompt is not None else "--prompt-name"
        raise bad_value(flag, "given with a sentence-transformers model (--pooling auto on a folder with "
                        "modules.json)", args.prompt if args.prompt is not None else args.prompt_name)
    if pooling == _ST:
        _check_sentence_transformer_folder(folder)
    return pooling


def _check_sentence_transformer(args: argparse.Namespace, config: Any, st: Any) -> tuple[int, Any, str | None]:
    """``--prompt-name`` checked against the model's prompts, the model against what runs on dynamic batches
    (:func:`~dynabatch.integrations.sentence_transformers.corpus_embedder`'s checks); ``--max-length``, or the max
    length sentence-transformers runs the folder at (``st``: it as :func:`_sentence_transformer` read it), refused
    above its positions. Returns that length, the model's own tokenization at it (the run's loader's) and the prompt
    it prepends to every text, as ``model.encode`` resolves ``--prompt``, ``--prompt-name`` and the model's
    ``default_prompt_name`` (``None``: none)."""
    from dynabatch.integrations.sentence_transformers import corpus_embedder, length_limit, resolve_prompt
    from dynabatch.memory.calibrate import check_positions

    if args.prompt_name is not None and args.prompt_name not in st.prompts:
        raise bad_value("--prompt-name", f"one of the model's prompts {sorted(st.prompts)}", args.prompt_name)
    if args.max_length is not None:  # the model cut at it first: one of no length limit of its own runs at it
        check_positions(config, args.max_length, 0, length_name="--max-length")
        _cut_at(st, args.max_length)
    else:
        try:
            length_limit(st)
        except ValueError as exc:
            raise bad_value("--max-length", "given: the model's folder, config and tokenizer set no length limit "
                            "(no max_seq_length, no positions, as a relative-position encoder's)", None) from exc
    try:  # the run's own checks (its tokenization, what every batch shares), on the weightless model
        tokenizer, cut_at, _ = corpus_embedder(st, prompt_name=args.prompt_name, prompt=args.prompt)
    except ValueError as exc:
        raise ValueError(f"--model should be a sentence-transformers model that runs on dynamic batches (or be given "
                         f"--pooling mean, cls or last), but got --model={args.model!r}: {exc}") from exc
    # what the model's tokenization adds to every text (special tokens, the prompt), at the folder's own length: a
    # length that holds no more keeps no token of any text, and every vector is the same (a transformers folder is
    # refused so by its tokenizer's special tokens: _max_length)
    added = len(next(iter(tokenizer([""]).values()))[0])
    length = args.max_length if args.max_length is not None else cut_at  # the longest row the model's own cut gives
    prompt = resolve_prompt(st, args.prompt, args.prompt_name)
    if length <= added:
        what = "its special tokens and the prompt" if prompt else "its special tokens"
        if args.max_length is not None:
            raise bad_value("--max-length", f"at least {added + 1} (the model's tokenization adds {added} tokens to "
                            f"every text: {what})", args.max_length)
        raise bad_value("--max-length", f"given above {added}: the max_seq_length={length} sentence-transformers "
                        f"reads from the folder holds only the tokens its tokenization adds to every text ({what})",
                        None)
    if args.max_length is None:  # a given one was checked and applied before the first corpus_embedder above
        try:
            check_positions(config, length, 0, length_name="--max-length")
        except ValueError as exc:
            raise bad_value("--max-length", f"given: the max_seq_length={length} sentence-transformers reads from "
                            "the folder is above the model's positions", None) from exc
        _cut_at(st, length)
        tokenizer = corpus_embedder(st, prompt_name=args.prompt_name, prompt=args.prompt)[0]
    return length, tokenizer, prompt


def _cut_at(model: Any, length: int) -> None:
    """Sets a sentence-transformers model to cut every row at ``length``: its ``max_seq_length`` and, where its
    Transformer sets a text ``max_length`` of its own (``processing_kwargs``, which ``preprocess`` applies over
    ``max_seq_length``), that one too: else ``--max-length`` was silently not applied to such a folder."""
    model.max_seq_length = length
    own = getattr(model[0], "processing_kwargs", None)
    if isinstance(own, dict) and isinstance(own.get("text"), dict) and "max_length" in own["text"]:
        own["text"]["max_length"] = length


def _max_length(args: argparse.Namespace, config: Any, folder: str, tokenizer: Any) -> int:
    """``--max-length``, or a transformers model's own limit (a sentence-transformers folder's saved
    ``max_seq_length``, its positions, its tokenizer's ``model_max_length``: the smallest); refused above the
    positions or the tokenizer's, or with no room for a text after the special tokens."""
    from dynabatch.data.tokenization import check_length_fits, model_max_length
    from dynabatch.memory.calibrate import check_model_max_length, check_positions
    from dynabatch.memory.shape import position_limit

    length = args.max_length
    if length is None:
        limits = [found[2]] if (found := position_limit(config)) is not None else []
        if (trained := _saved_max_seq_length(folder)) is not None:
            limits.append(trained)
        if model_max_length(tokenizer) is not None:
            limits.append(model_max_length(tokenizer))
        if not limits:
            raise bad_value("--max-length", "given: the model's config and tokenizer set no length limit", None)
        length = min(limits)
    check_positions(config, length, 0, length_name="--max-length")
    check_model_max_length(tokenizer, length, length_name="--max-length")
    check_length_fits(tokenizer, length, {})  # room for a text after the special tokens: the loader's rule, now
    return length


def _prepare(args: argparse.Namespace) -> _Job:
    """Every check of an embed job, in the order a user fixes them, and the store opened (its job lock taken); no
    weights load."""
    check_positive(args, "max_batch_tokens")
    corpus = job.open_input(args, "--text-column", args.text_column, ("string",))
    ids, texts = job.read_input(corpus, args, lambda c: c.texts(args.text_column))  # read once (memory-mapped)
    with Output(args.output).checked() as output:  # made and written to: the next thing a user fixes
        place = job.place_job(args)
        folder, name = _model_folder(args.model)
        pooling = _pooling(args, folder)  # first: a sentence-transformers folder may have no config.json of its own
        config = check_model_folder("--model", folder)
        dtype = check_dtype(args.dtype, place.accelerated)
        tokenizer = prompt = None
        if pooling == _ST:
            max_length, loader_tokenizer, prompt = _check_sentence_transformer(args, config,
                                                                               _sentence_transformer(folder))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
            if tokenizer.pad_token is None and tokenizer.eos_token is not None:
                tokenizer.pad_token = tokenizer.eos_token  # pooling reads the attention mask: padding never counts
            max_length = _max_length(args, config, folder, tokenizer)
            loader_tokenizer = tokenizer
        job.check_tokens(texts, loader_tokenizer, max_length, ids, "--text-column", args.text_column)
        settings = {"pooling": pooling, "normalize": args.normalize, "dtype": str(dtype).removeprefix("torch."),
                    "max_length": max_length}
        if pooling == _ST:  # the prompt applied, whichever flag (or the model's default) names it: the rows' own
            settings["prompt"] = json.dumps(prompt) if prompt is not None else None
        key = job.job_key("embed", folder, **settings)
        key = job.open_store(output, args, key, len(texts), ids)
        job.check_stored_inputs(output, texts, loader_tokenizer, max_length)
        job.check_first_batch(texts, loader_tokenizer, config=config, dtype=dtype,
                              device=place.devices[0], max_memory=args.max_memory, batch_size=args.batch_size,
                              max_length=max_length, max_tokens=args.max_batch_tokens)
    return _Job(place, folder, name, config, pooling, dtype, max_length, texts, ids, key, output, tokenizer)


def pooled(model: Any, pooling: str, normalize: bool) -> Any:
    """``fn(batch)``: the model's last hidden states pooled over each row's real tokens (by the attention mask,
    whichever side pads): ``mean``, ``cls`` (the first real token) or ``last`` (the last one); computed in
    float32, returned in the model's dtype.

    Example:
        >>> import torch
        >>> class Echo(torch.nn.Module):  # its hidden states are its input ids
        ...     def forward(self, input_ids, attention_mask):
        ...         return (input_ids.unsqueeze(-1).float(),)
        >>> batch = {"input_ids": torch.tensor([[5, 7, 0], [0, 2, 4]]),
        ...          "attention_mask": torch.tensor([[1, 1, 0], [0, 1, 1]])}
        >>> [pooled(Echo(), p, False)(batch)[:, 0].tolist() for p in ("mean", "cls", "last")]
        [[6.0, 3.0], [5.0, 2.0], [7.0, 4.0]]
    """
    import torch

    accepted = set(inspect.signature(model.forward).parameters)

    def fn(batch: Any) -> torch.Tensor:
        with torch.inference_mode():  # thread-local: entered in the thread that runs the batch
            out = model(**{k: v for k, v in batch.items() if k in accepted})
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            mask = batch["attention_mask"].to(hidden.device)
            states = hidden.float()
            if pooling == "mean":
                weights = mask.unsqueeze(-1).to(states.dtype)
                vectors = (states * weights).sum(1) / weights.sum(1).clamp(min=1)
            else:
                place = torch.arange(mask.shape[1], device=mask.device)
                token = mask.argmax(1) if pooling == "cls" else (mask * place).argmax(1)  # first / last real token
                vectors = states[torch.arange(len(states), device=states.device), token]
            if normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            return vectors.to(hidden.dtype)

    return fn


def _load(spec: _Job, args: argparse.Namespace) -> tuple[Any, int, Any, Any]:
    """``(tokenizer, max_length, make_fn, model for the loader's checks)``, the weights on the first device."""
    import torch

    first = spec.place.devices[0]
    if spec.pooling == _ST:
        from sentence_transformers import SentenceTransformer

        from dynabatch.integrations.sentence_transformers import corpus_embedder

        model = SentenceTransformer(spec.folder, device=str(first), model_kwargs={"dtype": spec.dtype})
        _cut_at(model, spec.max_length)
        tokenizer, limit, make_fn = corpus_embedder(model, prompt_name=args.prompt_name, prompt=args.prompt,
                                                    normalize_embeddings=args.normalize)
        return tokenizer, limit, make_fn, model.transformers_model
    from transformers import AutoModel

    model = AutoModel.from_pretrained(spec.folder, dtype=spec.dtype).to(first).eval()
    encoder = model.get_encoder() if getattr(spec.config, "is_encoder_decoder", False) else model

    def make_fn(device: torch.device) -> Any:  # one copy per accelerator; CPU threads share the weights
        import copy

        on = encoder if torch.device(device) == first or torch.device(device).type == "cpu" else \
            copy.deepcopy(encoder).to(device)
        return pooled(on, spec.pooling, args.normalize)

    return spec.tokenizer, spec.max_length, make_fn, model


def _loader_options(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    """The loader's keywords that follow from the options and the length limit."""
    return {"max_tokens": args.max_batch_tokens or max(ENCODER_BATCH_TOKENS, args.batch_size * limit)}


def embed_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``dynabatch embed``; returns the exit status."""
    start = time.perf_counter()
    spec = job.prepared("embed", args, parser, _prepare)
    from dynabatch.inference.loader import build_dynamic_batch_dataloader  # torch: once every option is checked

    place = spec.place
    if args.ray is not None:  # the same job, its actors on a Ray cluster
        from dynabatch.cli import on_ray

        try:
            model = on_ray.ActorModel(_load, replace(spec, texts=None, ids=None, output=None),
                                      on_ray.plain(args), _loader_options)
            return on_ray.run_on_ray("embed", model=model, texts=spec.texts, ids=spec.ids, key=spec.key,
                                     output=spec.output, args=args, parser=parser, start=start, what="texts",
                                     model_line=spec.describe(spec.max_length), run_options={"token_outputs": "whole"},
                                     text_column=args.text_column)
        finally:
            spec.output.end()
    with job.running(place, spec.output):
        call, limit = None, spec.max_length
        if not job.all_stored(spec.output):  # a finished job's rerun loads no model to run nothing
            tokenizer, limit, make_fn, model = _load(spec, args)
            with refusing(parser):  # what only the loaded model can judge: one line, naming the flags
                loader = build_dynamic_batch_dataloader(spec.texts, tokenizer, args.batch_size, limit, ids=spec.ids,
                                                        model=model, max_memory=args.max_memory, stream=True,
                                                        **_loader_options(args, limit), num_workers=0, progress=False)
            call = lambda: job.run_job(make_fn, loader, place, spec.output, key=spec.key,  # noqa: E731
                                       on_oom=args.on_oom, on_error=args.on_error, token_outputs="whole",
                                       progress=place.main and not args.no_progress)
        return job.conclude("embed", call, args, parser, place, spec.output, n=len(spec.texts), start=start,
                            model=spec.describe(limit), what="texts", keyed=spec.ids is not None)

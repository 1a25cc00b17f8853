"""``dynabatch generate INPUT OUTPUT --model FOLDER``: prompts in, one reply per prompt out, into a Parquet store.

::

    dynabatch generate prompts.txt replies/ --model ./my-model --max-new-tokens 256
    dynabatch generate chats.jsonl replies/ --model ./my-chat-model --messages-column messages --sample --temperature 0.7

Prompts are a column of strings (``--text-column``; a text file's lines), or
chat conversations (``--messages-column``: each row a list of
``{"role": ..., "content": ...}`` messages, rendered by the tokenizer's chat
template; a message without a role or a content, or with either null, is
refused naming its row, before any weights load). Replies come from :func:`dynabatch.generate` (a decoder-only or
encoder-decoder ``transformers`` model): each prompt's reply alone, the prompt
not repeated, ending at its first EOS; greedy unless ``--sample``; ``--min-new-tokens`` tokens at least where
given. A decoder-only folder whose ``generation_config.json`` sets ``min_length`` (it counts the prompt, padded to
its batch's longest) is refused before any weights load, unless ``--min-new-tokens`` is given, as is a setting
of it that :func:`dynabatch.generate` refuses beside the options (``num_return_sequences: 2`` when greedy). The store
holds ``id`` (with ``--id-column``; else rows are keyed by ``position``, the
prompt's row in the input) and ``output`` (the reply);
its key names the model, the dtype, the length limits and every generation
option as ``model.generate`` applies it (a flag left to the model's generation config and the same value given
are one job), so the same command again generates only the prompts not stored.

Sampled replies (``--sample``) are drawn from a generator seeded by ``--seed`` (0 unless given; refused without ``--sample``);
they depend on which prompts share a batch, as with any batched sampling, so
a resumed run's new replies are not those an uninterrupted run would draw, and on Ray (``--ray``) two runs of one
job draw differently (an actor's batches depend on the windows it ran before).

It runs on one device (the first GPU, else the CPU; ``--devices`` names
another), or under ``torchrun`` one rank per GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._validation import bad_value
from dynabatch.cli import job
from dynabatch.cli._checks import Tie, check_dtype, check_model_folder, check_positive, flag_of
from dynabatch.cli.output import Output

__all__ = ["add_parser", "generate_command"]

_SAMPLING = ("temperature", "top_p", "top_k")
_SEEDS = (-(2**63), 2**64)  # torch.manual_seed's range

_DESCRIPTION = "Prompts in, one reply per prompt out, into a Parquet store; the same command again resumes it."
_EXAMPLES = """examples:
  dynabatch generate prompts.txt replies/ --model ./my-model --max-new-tokens 256
  dynabatch generate chats.jsonl replies/ --model ./my-chat-model --messages-column messages --sample --temperature 0.7"""


def add_parser(sub: Any) -> None:
    """The ``generate`` subcommand's options."""
    p = job.command_parser(sub, "generate", generate_command, help="generate a reply to every prompt into a Parquet "
                           "store (resumable)", description=_DESCRIPTION, examples=_EXAMPLES, item="prompt",
                           rows="replies")
    p.add_argument("--model", required=True, help="a local transformers model folder (causal or seq2seq LM)")
    p.add_tied("--messages-column", tie=Tie(excludes="text_column", why="the prompts are one column, the texts of "
                                             "--text-column or the conversations of --messages-column: give one"),
               help="a column of chat conversations (lists of {role, content}) instead of --text-column")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply at most (default: 128)")
    p.add_argument("--min-new-tokens", type=int, default=None,
                   help="tokens per reply at least (default: the model's; a min_length of its generation_config.json, "
                   "which counts the prompt, is refused unless this is given)")
    p.add_argument("--sample", action="store_true", help="sample (default: greedy decoding)")
    sampling = Tie(needs=("sample", True), why="greedy decoding has no temperature, top-p or top-k")
    p.add_tied("--temperature", type=float, tie=sampling, help="with --sample (default: the model's)")
    p.add_tied("--top-p", type=float, tie=sampling, help="with --sample (default: the model's)")
    p.add_tied("--top-k", type=int, tie=sampling, help="with --sample (default: the model's)")
    p.add_tied("--seed", type=int, tie=Tie(default=0, needs=("sample", True), why="greedy decoding draws nothing to "
                                           "seed"), help="with --sample: seeds sampling")
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt tokens at most (default: the model's positions less --max-new-tokens)")
    job.add_run_arguments(p, "prompt", 16, "the device (default: the first GPU, else the CPU)")


def _check_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The generation options: greedy, or sampling with the options given (each checked; given without
    ``--sample``, they are refused before, by their tie, :meth:`~dynabatch.cli._checks.Parser.add_tied`)."""
    if not _SEEDS[0] <= args.seed < _SEEDS[1]:
        raise bad_value("--seed", f"an integer in [{_SEEDS[0]}, {_SEEDS[1]}) (the seeds torch takes)", args.seed)
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.sample}
    if args.min_new_tokens is not None:
        if args.min_new_tokens > args.max_new_tokens:
            raise bad_value("--min-new-tokens", f"at most --max-new-tokens={args.max_new_tokens}", args.min_new_tokens)
        options["min_new_tokens"] = args.min_new_tokens
    for name in _SAMPLING:
        value = getattr(args, name)
        if value is None:
            continue
        flag = flag_of(name)
        if name == "temperature" and not 0 < value < math.inf or name == "top_p" and not 0 < value <= 1:
            raise bad_value(flag, "a finite number above 0" if name == "temperature" else "a number in (0, 1]", value)
        options[name] = value
    return options


def _generation_config_file(folder: str) -> str:
    """The file the model's load reads its generation config from: ``generation_config.json``, else ``config.json``."""
    return "generation_config.json" if (Path(folder) / "generation_config.json").is_file() else "config.json"


def _generation_config(folder: str) -> Any:
    """The model's generation config, read from the folder as its load reads it (no weights)."""
    from transformers import GenerationConfig

    file = _generation_config_file(folder)
    try:
        return GenerationConfig.from_pretrained(folder, config_file_name=file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model's {file} should be a generation config transformers reads, but got "
                         f"--model={folder!r}: {str(exc).splitlines()[0]}") from exc


def _applied_options(generation_config: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The generation options as the store's key holds them: the values ``model.generate`` applies
    (:func:`~dynabatch.inference.generation.applied_setting`), so that a flag left to the model's default and the
    same value given are one job; ``--min-new-tokens`` where one applies, the sampling options when sampling."""
    from dynabatch.inference.generation import applied_setting

    names = ("min_new_tokens", *(_SAMPLING if options["do_sample"] else ()))
    applied = {name: applied_setting(generation_config, options, name) for name in names}
    return {"max_new_tokens": options["max_new_tokens"], "do_sample": options["do_sample"],
            **{name: value for name, value in applied.items() if value is not None}}


def _check_lengths(folder: str, config: Any, generation_config: Any, options: dict[str, Any]) -> None:
    """A decoder-only model's ``generation_config`` (:func:`_generation_config`) sets no length that counts the prompt
    beside the options, by the library's rule (:func:`~dynabatch.inference.generation.counting_the_prompt`)."""
    from dynabatch.inference.generation import counting_the_prompt

    if getattr(config, "is_encoder_decoder", False):
        return
    file = _generation_config_file(folder)
    found = counting_the_prompt(generation_config, options, where="")
    if found is not None:
        setting, new, value = found
        raise ValueError(f"--model's {file} should set no {setting} (it counts the prompt, which a batch pads to its "
                         f"longest row, so a reply's length would depend on its batch): give {flag_of(new)} (the "
                         f"tokens of each reply), or remove {setting} from {Path(folder) / file}; but got "
                         f"{setting}={value!r} in --model={folder!r}")


def _check_settings(folder: str, generation_config: Any, options: dict[str, Any]) -> None:
    """The options on the model's ``generation_config`` (:func:`_generation_config`) are settings
    :func:`dynabatch.generate` takes (:func:`~dynabatch.inference.generation.check_generation_settings`): its refusal
    is said before any weights load, naming the file (a greedy run of a folder that sets ``num_return_sequences=2``,
    ``output_scores`` or ``prompt_lookup_num_tokens``)."""
    from dynabatch.inference.generation import check_generation_settings

    file = _generation_config_file(folder)
    try:
        check_generation_settings(generation_config, options, where="")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--model's {file} should hold settings model.generate takes with the options given, but "
                         f"{exc} (with {Path(folder) / file}): change the options (--sample) or the file, or use "
                         f"another model folder; --model={folder!r}") from exc


def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise bad_value("--model", "a folder whose tokenizer has a pad or an EOS token (batches are padded)",
                            folder)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _prompt_limit(args: argparse.Namespace, config: Any, tokenizer: Any) -> int:
    """``--max-length``, or the most the model's positions hold beside the new tokens (and the tokenizer's limit)."""
    from dynabatch.data.tokenization import model_max_length
    from dynabatch.memory.calibrate import check_positions
    from dynabatch.memory.shape import position_limit

    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    length = args.max_length
    if length is None:
        limits = [] if model_max_length(tokenizer) is None else [model_max_length(tokenizer)]
        if (found := position_limit(config)) is not None:
            limits.append(found[2] - (0 if encoder_decoder else args.max_new_tokens))
        if not limits:
            raise bad_value("--max-length", "given: the model's config and tokenizer set no length limit", None)
        length = min(limits)
        if length < 1:
            raise bad_value("--max-new-tokens", f"less than the model's {found[0]}={found[1]} positions, which hold "
                            "the prompt too", args.max_new_tokens)
    check_positions(config, length, args.max_new_tokens, length_name="--max-length", new_name="--max-new-tokens")
    return length


def _prompts(args: argparse.Namespace, corpus: Any) -> Any:
    """The prompts: the texts of ``--text-column`` (a TextSource), or the conversations of ``--messages-column``,
    each checked."""
    if args.messages_column is None:
        return corpus.texts(args.text_column)  # taken once the model's tokenizer has judged them (_prepare)
    conversations = corpus.values(args.messages_column, "--messages-column")
    for i, conversation in enumerate(conversations):
        if not conversation or not all(map(_is_message, conversation)):
            raise ValueError(f"--messages-column should hold lists of {{'role': ..., 'content': ...}} messages (a "
                             f"role and a content in each, neither missing nor null), but got row {i}: "
                             f"{json.dumps(conversation)[:200]}")
    return conversations


def _is_message(message: Any) -> bool:
    """A chat message: a str role and a content. A table gives every message each key any message of the column
    has, a missing one as null (JSONL and Parquet alike): a null content is a missing one, which a chat template
    renders as an empty turn, so the reply would answer another prompt (an assistant's tool call alone has none)."""
    return (isinstance(message, dict) and isinstance(message.get("role"), str)
            and (message.get("content") is not None or message.get("tool_calls") is not None))


def _prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Every check of a generate job, and the store opened (its job lock taken); no weights load."""
    check_positive(args, "max_new_tokens", "min_new_tokens", "top_k")
    options = _check_sampling(args)
    if args.messages_column is None:
        corpus = job.open_input(args, "--text-column", args.text_column, ("string",))
    else:
        corpus = job.open_input(args, "--messages-column", args.messages_column, ("list",))
    ids, prompts = job.read_input(corpus, args, lambda c: _prompts(args, c))
    with Output(args.output).checked() as output:  # made and written to: the next thing a user fixes
        place = job.place_job(args, one_device="one device (generate runs on one device, or one rank per GPU under "
                              "torchrun)")
        config = check_model_folder("--model", args.model)
        generation_config = _generation_config(args.model)
        _check_lengths(args.model, config, generation_config, options)
        _check_settings(args.model, generation_config, options)
        dtype = check_dtype(args.dtype, place.accelerated)
        tokenizer = _tokenizer(args.model)
        if args.messages_column is not None and not getattr(tokenizer, "chat_template", None):
            raise bad_value("--messages-column", "given with a model whose tokenizer has a chat template",
                            args.messages_column)
        max_length = _prompt_limit(args, config, tokenizer)
        if args.messages_column is None:
            job.check_tokens(prompts, tokenizer, max_length, ids, "--text-column", args.text_column)
        settings = {"dtype": str(dtype).removeprefix("torch."), "max_length": max_length,
                    "prompts": "messages" if args.messages_column is not None else "text",
                    **_applied_options(generation_config, options), **({"seed": args.seed} if args.sample else {})}
        key = job.job_key("generate", args.model, **settings)
        key = job.open_store(output, args, key, len(prompts), ids)
        # chats rendered with no keyword of the template's, as the run renders them (generate's and on_ray's)
        job.check_stored_inputs(output, prompts, tokenizer, max_length,
                                chat_template_kwargs=None if args.messages_column is None else {})
        if args.messages_column is None:
            prompts = prompts.take(np.arange(len(prompts)))
        job.check_first_batch(prompts if args.messages_column is None else None, tokenizer, config=config,
                              dtype=dtype, device=place.devices[0], max_memory=args.max_memory,
                              batch_size=args.batch_size, max_length=max_length, max_new_tokens=args.max_new_tokens)
    return {"place": place, "config": config, "dtype": dtype, "tokenizer": tokenizer, "max_length": max_length,
            "prompts": prompts, "ids": ids, "options": options, "key": key, "output": output}


def generate_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs ``dynabatch generate``; returns the exit status."""
    start = time.perf_counter()
    spec = job.prepared("generate", args, parser, _prepare)
    import torch  # once every option is checked
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from dynabatch.inference.generation import generate

    place, config, output = spec["place"], spec["config"], spec["output"]
    if args.ray is not None:  # the same job, its actors on a Ray cluster
        from dynabatch.cli import on_ray

        try:
            return on_ray.run_generate(spec, args, parser, start=start)
        finally:
            output.end()
    with job.running(place, output):
        call = None
        if not job.all_stored(output):  # a finished job's rerun loads no model to run nothing
            auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
            model = auto.from_pretrained(args.model, dtype=spec["dtype"]).to(place.devices[0]).eval()
            torch.manual_seed(args.seed)  # this process's own generator: sampling draws from it
            call = lambda: generate(model, spec["tokenizer"], spec["prompts"], batch_size=args.batch_size,  # noqa: E731
                                    max_memory=args.max_memory, max_input_token_length=spec["max_length"],
                                    device=place.devices[0], ids=spec["ids"], output_path=output.store,
                                    key=spec["key"], on_oom=args.on_oom, on_error=args.on_error,
                                    progress=place.main and not args.no_progress,
                                    pad_token_id=spec["tokenizer"].pad_token_id, **spec["options"])
        model_line = (f"{Path(args.model).resolve().name}, {str(spec['dtype']).removeprefix('torch.')}, prompts "
                      f"of {spec['max_length']} tokens at most, {args.max_new_tokens} new tokens at most, "
                      + ("sampled" if args.sample else "greedy"))
        return job.conclude("generate", call, args, parser, place, output, n=len(spec["prompts"]), start=start,
                            model=model_line, what="replies", keyed=spec["ids"] is not None)

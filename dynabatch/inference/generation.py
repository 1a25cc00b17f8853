"""``dynabatch.generate``: replies to many prompts from ``model.generate``, through :func:`dynabatch.run`.

Prompts (strings, chat conversations or pre-tokenized ids) are tokenized once into dynabatch's loader, longest
first; ``model.generate`` runs on every batch through :func:`dynabatch.run` (out-of-memory splitting, measured mode,
``output_path`` resume), and each prompt's reply is returned alone, in input order, equal to the reply of generating
that prompt alone. The rules (prompts, padding, replies, limits) are in ``docs/integrations.md``; why few, large
calls pay (a small model's decoding step is bound by the host) is in ``docs/memory.md``.

Example:
    >>> import torch
    >>> from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    >>> import dynabatch
    >>> from dynabatch.demo import minilm_path
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> _ = torch.manual_seed(0)
    >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
    ...                                    n_positions=64, pad_token_id=0, eos_token_id=102)).eval()
    >>> replies = dynabatch.generate(model, tokenizer, ["In the beginning", "And God said"], return_ids=True,
    ...                              max_new_tokens=3, min_new_tokens=3, do_sample=False, progress=False)
    >>> [len(reply) for reply in replies], replies.report.rows
    ([3, 3], 2)
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.token_ids import are_token_ids
from dynabatch.data.tokenization import check_tokenizer, model_max_length
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.outputs import PerRow
from dynabatch.inference.results import RunResult, StoredRunResult
from dynabatch.inference.runner import run
from dynabatch.memory.budget import is_absolute
from dynabatch.memory.units import check_max_memory
from dynabatch.memory.footprint import Footprint
from dynabatch.memory.shape import ModelShape, check_position_limit, position_limit

__all__ = ["generate", "generation_loader", "render_chats", "reply_function"]

logger = logging.getLogger(__name__)

_PROMPTS_RULE = ("a non-empty list of prompts, all of one kind: str, chat conversations (lists of "
                 "{'role': ..., 'content': ...} dicts) or pre-tokenized ids (lists of int)")


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


def _prompt_kind(prompts: Any) -> str:
    """``"text"``, ``"chat"`` or ``"ids"``, from the first prompt; every other prompt must be of that kind."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
        raise bad_type("prompts", _PROMPTS_RULE, prompts)
    if not len(prompts):
        raise bad_value("prompts", _PROMPTS_RULE, prompts)
    first = prompts[0]
    kind = "text" if isinstance(first, str) else "chat" if _is_conversation(first) else "ids"
    if kind == "ids" and not are_token_ids(prompts):
        raise bad_type("prompts[0]", "a str, a chat conversation or a list of int token ids", first)
    same = {"text": lambda p: isinstance(p, str), "chat": _is_conversation,
            "ids": lambda p: not isinstance(p, str) and not _is_conversation(p)}[kind]
    for i, prompt in enumerate(prompts):
        if not same(prompt):
            raise bad_type(f"prompts[{i}]", f"a prompt of the kind of prompts[0] ({kind})", prompt)
    return kind


def render_chats(tokenizer: Any, conversations: Sequence[Any], chat_template_kwargs: dict[str, Any]) -> list[str]:
    """Each conversation rendered once by the tokenizer's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_value("tokenizer.chat_template", "set for chat prompts (the template renders each "
                        "conversation; set tokenizer.chat_template)", getattr(tokenizer, "chat_template", None))
    kwargs = {"add_generation_prompt": True, **chat_template_kwargs}
    return [tokenizer.apply_chat_template(list(c), tokenize=False, **kwargs) for c in conversations]


def _setting(model: Any, generate_kwargs: dict[str, Any], name: str) -> Any:
    """A setting of the call: its argument, else the model's generation config's; ``None`` if unset."""
    value = generate_kwargs.get(name)
    return getattr(getattr(model, "generation_config", None), name, None) if value is None else value


def _new_tokens(model: Any, generate_kwargs: dict[str, Any]) -> int | None:
    value = _setting(model, generate_kwargs, "max_new_tokens")
    return None if value is None else check_positive_int("max_new_tokens", value)


def _default_limit(model: Any, tokenizer: Any, new_tokens: int, encoder_decoder: bool) -> int:
    """The longest prompt the model can take: its positions (less the new tokens, decoder-only) and the tokenizer's."""
    limits = []
    found = position_limit(model)
    if found is not None:
        limits.append(found[2] - (0 if encoder_decoder else new_tokens))
    if model_max_length(tokenizer) is not None:
        limits.append(model_max_length(tokenizer))
    if not limits:
        raise bad_value("max_input_token_length", "given when neither the model's config nor the tokenizer "
                        "sets a length limit", None)
    return max(1, min(limits))


def _padding_tokenizer(tokenizer: Any, encoder_decoder: bool) -> Any:
    """The tokenizer, or a copy padding on the left for a decoder-only model (the caller's is left as it is)."""
    if encoder_decoder or getattr(tokenizer, "padding_side", "left") == "left":
        return tokenizer
    left = copy.copy(tokenizer)
    left.padding_side = "left"
    return left


def _eos_ids(model: Any, generate_kwargs: dict[str, Any]) -> set[int]:
    eos = _setting(model, generate_kwargs, "eos_token_id")
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}


_STOPS_WITHOUT_EOS = ("stop_strings", "stopping_criteria", "max_time")  # generate arguments ending rows early


def reply_ids(sequences: torch.Tensor, prompt_width: int, *, encoder_decoder: bool, eos_ids: set[int],
              pad_token_id: int | None) -> list[list[int]]:
    """Each row's reply: the new tokens (decoder-only) or the decoder sequence (its start token kept), ended at the
    first EOS (kept); a row without EOS loses its trailing pad ids when ``pad_token_id`` is given.

    Example:
        >>> rows = torch.tensor([[0, 7, 8, 5, 2, 2], [0, 0, 9, 6, 3, 4]])  # prompt of width 3, EOS 2 == pad
        >>> reply_ids(rows, 3, encoder_decoder=False, eos_ids={2}, pad_token_id=None)
        [[5, 2], [6, 3, 4]]
        >>> reply_ids(torch.tensor([[0, 0, 0]]), 0, encoder_decoder=True, eos_ids={1}, pad_token_id=None)
        [[0, 0, 0]]
        >>> reply_ids(torch.tensor([[0, 5, 0]]), 0, encoder_decoder=True, eos_ids={1}, pad_token_id=0)
        [[0, 5]]
    """
    new = sequences if encoder_decoder else sequences[:, prompt_width:]
    first = 1 if encoder_decoder else 0  # the decoder start token never ends a reply
    replies = []
    for row in new.tolist():
        end = next((i for i in range(first, len(row)) if row[i] in eos_ids), None)
        if end is not None:
            row = row[: end + 1]
        elif pad_token_id is not None:
            end = len(row)
            while end > first and row[end - 1] == pad_token_id:
                end -= 1
            row = row[:end]
        replies.append(row)
    return replies


def generation_loader(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any], *,
                      chat: bool = False) -> tuple[Any, dict[str, Any]]:
    """What the loader of a ``generate`` call takes besides the texts: the tokenizer that pads its batches (a copy
    padding on the left for a decoder-only model) and its keywords: the model's shape through the new tokens, and
    no special tokens added to rendered chats (``chat``: the template holds its own)."""
    encoder_decoder = _check_model(model)
    shape = ModelShape.from_model(model, max_new_tokens=_new_tokens(model, generate_kwargs) or 0,
                                  num_beams=generate_kwargs.get("num_beams", 1))
    options: dict[str, Any] = {"model_shape": shape, **({"add_special_tokens": False} if chat else {})}
    return _padding_tokenizer(tokenizer, encoder_decoder), options


def reply_function(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any], *, return_ids: bool = False,
                   skip_special_tokens: bool = True, padding_id: int | None = None) -> Callable[[Any], PerRow]:
    """``fn(batch)`` for :func:`dynabatch.run`: ``model.generate`` on the batch with ``generate_kwargs``, each row's
    reply alone (the rules of :mod:`~dynabatch.inference.generation`), decoded unless ``return_ids``;
    ``padding_id``: the batches' pad id, dropped from the end of a row that can end without EOS."""
    encoder_decoder = _check_model(model)
    returns = check_positive_int("num_return_sequences", generate_kwargs.get("num_return_sequences", 1))
    eos_ids = _eos_ids(model, generate_kwargs)
    stops_early = any(generate_kwargs.get(name) is not None for name in _STOPS_WITHOUT_EOS)
    pad_token_id = padding_id if stops_early else None  # else rows without EOS are whole

    def replies(batch: Any) -> PerRow:
        out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **generate_kwargs)
        sequences = getattr(out, "sequences", out)  # return_dict_in_generate=True: the sequences alone
        rows = reply_ids(sequences, batch["input_ids"].shape[1], encoder_decoder=encoder_decoder, eos_ids=eos_ids,
                         pad_token_id=pad_token_id)
        if not return_ids:
            rows = tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
        if returns > 1:  # generate's rows come prompt by prompt, k each
            rows = [rows[i : i + returns] for i in range(0, len(rows), returns)]
        return PerRow(rows)

    return replies


def _memory_options(model: Any, max_memory: Any, device: Any, new_tokens: int | None,
                    generate_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The loader's options for ``max_memory``: where it is an absolute budget on ``device``, passed through as
    given with the model's footprint of this ``generate`` call (the run reads the budget on its device once, as it
    starts: the scheduler's one decision); else nothing (the relative rule)."""
    if not is_absolute(max_memory, device):
        return {}
    if new_tokens is None:  # generate's own limit: max_length counts the prompt too, so this errs high
        new_tokens = int(_setting(model, {}, "max_length") or 20)
    footprint = Footprint.from_model(model, max_new_tokens=new_tokens, num_beams=generate_kwargs.get("num_beams") or 1,
                                     num_return_sequences=generate_kwargs.get("num_return_sequences") or 1)
    return {"memory_model": footprint, "max_memory": max_memory}


def _check_model(model: Any) -> bool:
    """Whether ``model`` is an encoder-decoder; refuses an object without ``generate``."""
    if not callable(getattr(model, "generate", None)):
        raise bad_type("model", "a model with a generate method (a transformers generative model)", model)
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    return_ids: bool = False,
    skip_special_tokens: bool = True,
    batch_size: int = 16,
    max_memory: Any = "auto",
    max_input_token_length: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    ids: Any = None,
    output_path: Any = None,
    key: Any = None,
    on_oom: str = "raise",
    on_error: str = "raise",
    memory: str = "auto",
    progress: bool = True,
    **generate_kwargs: Any,
) -> RunResult | StoredRunResult:
    """Generates a reply to every prompt with ``model.generate``, in input order, through :func:`dynabatch.run`.

    Args:
        model: a ``transformers`` generative model (decoder-only or encoder-decoder), in eval mode.
        tokenizer: its tokenizer (with a pad token; left alone: a copy pads decoder-only prompts on the left).
        prompts: all str, all chat conversations (lists of message dicts, rendered by
            ``tokenizer.apply_chat_template``) or all pre-tokenized ids (lists of int, taken as they are).
        return_ids: return each reply's token ids (a list of int, its EOS kept) instead of the decoded string.
        skip_special_tokens: passed to ``tokenizer.batch_decode``.
        batch_size: under the relative rule (the CPU, or ``max_memory=None``), rows of the first (longest)
            batch, later batches grown under its measured peak; an absolute budget sizes every batch itself.
        max_memory: the memory every batch is planned under (by the model's
            :class:`~dynabatch.memory.footprint.Footprint`, refined by the measured peaks), read on ``device`` when the
            call starts: ``"auto"`` (90% of a GPU's free memory, the relative rule on the CPU), ``"80%"``, ``"20GB"``,
            ``"20GiB"`` or bytes; ``None``: the relative rule.
        max_input_token_length: prompts are truncated to it. ``None``: the most the model's positions take (less
            ``max_new_tokens`` on a decoder-only model) and the tokenizer's ``model_max_length``, whichever is smaller.
        chat_template_kwargs: more arguments of ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``).
        device: where batches run; ``None``: the model's device.
        ids: one stable id per prompt (str or int, unique), or ``None``: the loader's ``ids`` (a store keys its rows
            by them).
        output_path, key, on_oom, on_error, memory, progress: :func:`dynabatch.run`'s.
        **generate_kwargs: passed to every ``model.generate`` call (``max_new_tokens``, ``do_sample``, ...). With
            ``num_return_sequences=k > 1`` each prompt's result is a list of ``k`` replies.

    Returns:
        A :class:`~dynabatch.inference.results.RunResult` (with ``output_path``, a
        :class:`~dynabatch.inference.results.StoredRunResult`): one reply per prompt, with ``.report``.

    Raises:
        TypeError: a model without ``generate``, or prompts of mixed or unknown kinds.
        ValueError: chat prompts with a tokenizer without chat template, or a prompt limit (plus the new tokens)
            above the model's positions.
    """
    encoder_decoder = _check_model(model)
    check_tokenizer(tokenizer)
    check_max_memory(max_memory)
    kind = _prompt_kind(prompts)
    if not isinstance(return_ids, bool):
        raise bad_type("return_ids", "a bool", return_ids)
    new_tokens = _new_tokens(model, generate_kwargs)
    check_positive_int("num_return_sequences", generate_kwargs.get("num_return_sequences", 1))
    if max_input_token_length is None:
        max_input_token_length = _default_limit(model, tokenizer, new_tokens or 0, encoder_decoder)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    check_position_limit(model, max_input_token_length, max_new_tokens=new_tokens or 0)
    texts = render_chats(tokenizer, prompts, dict(chat_template_kwargs or {})) if kind == "chat" else prompts
    if device is None:
        device = getattr(model, "device", None)
    budget = _memory_options(model, max_memory, device, new_tokens, generate_kwargs)
    padder, options = generation_loader(model, tokenizer, generate_kwargs, chat=kind == "chat")
    loader = build_dynamic_batch_dataloader(texts, padder, batch_size, max_input_token_length, num_workers=0,
                                            progress=progress, ids=ids, **budget, **options)
    fn = reply_function(model, tokenizer, generate_kwargs, return_ids=return_ids,
                        skip_special_tokens=skip_special_tokens, padding_id=loader.plan.collator.pad_token_id)

    options = {"key": key} if key is not None else {}  # run's key= (the results store) only when asked for
    with torch.inference_mode():
        return run(fn, loader, device=device, output_path=output_path, on_oom=on_oom, on_error=on_error,
                   memory=memory, progress=progress, **options)

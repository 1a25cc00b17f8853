"""``dynabatch.generate``: replies to many prompts from ``model.generate``, through :func:`dynabatch.run`.

Prompts (strings, chat conversations or pre-tokenized ids) are tokenized once into dynabatch's loader, and each
prompt's reply is returned alone, in input order, equal to the reply of generating that prompt alone (greedy or beam
search; a sampled reply depends on the batch it ran in). The rules
(prompts, padding, replies, limits) are in ``docs/integrations.md``; why few, large calls pay, in ``docs/memory.md``.

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
import inspect
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_bool, check_positive_int, did_you_mean, first_few
from dynabatch.data.token_ids import are_token_ids
from dynabatch.data.tokenization import check_tokenizer, model_max_length, tokenize_texts
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.outputs import PerRow
from dynabatch.inference.results import RunResult, StoredRunResult
from dynabatch.inference.runner import run
from dynabatch.memory.budget import is_absolute
from dynabatch.memory.device import known_backend
from dynabatch.memory.footprint import Footprint
from dynabatch.memory.measure import track_peak_memory
from dynabatch.memory.shape import ModelShape, check_position_limit, position_limit
from dynabatch.memory.units import check_max_memory

__all__ = ["RENDERED_CHAT_TOKENIZER_KWARGS", "applied_setting", "check_generate_kwargs", "check_generation_settings",
           "counting_the_prompt", "generate", "generation_loader", "render_chats", "reply_function",
           "TruncatedPrompts"]

logger = logging.getLogger(__name__)

_PROMPTS_RULE = ("a non-empty list of prompts, all of one kind: str, chat conversations (lists of "
                 "{'role': ..., 'content': ...} dicts) or pre-tokenized ids (lists of int)")


def _kind(prompt: Any) -> str:
    """``"text"``, ``"chat"`` (a conversation: a list of message dicts) or ``"ids"`` (anything else)."""
    if isinstance(prompt, str):
        return "text"
    return "chat" if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping) else "ids"


def _prompt_kind(prompts: Any) -> str:
    """The kind of the first prompt, which every other prompt must be of."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
        raise bad_type("prompts", _PROMPTS_RULE, prompts)
    if not len(prompts):
        raise bad_value("prompts", _PROMPTS_RULE, prompts)
    kind = _kind(prompts[0])
    if kind == "ids" and not are_token_ids(prompts):
        raise bad_type("prompts[0]", "a str, a chat conversation or a list of int token ids", prompts[0])
    for i, prompt in enumerate(prompts):
        if _kind(prompt) != kind:
            raise bad_type(f"prompts[{i}]", f"a prompt of the kind of prompts[0] ({kind})", prompt)
    return kind


def render_chats(tokenizer: Any, conversations: Sequence[Any], chat_template_kwargs: dict[str, Any]) -> list[str]:
    """Each conversation rendered once by the tokenizer's chat template, ready for the reply: with
    ``add_generation_prompt=True`` unless ``chat_template_kwargs`` says otherwise or continues the final message."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_value("tokenizer.chat_template", "set for chat prompts (the template renders each "
                        "conversation; set tokenizer.chat_template)", getattr(tokenizer, "chat_template", None))
    # a header for the reply, unless the reply continues the conversation's last message (the template refuses both)
    kwargs = {"add_generation_prompt": not chat_template_kwargs.get("continue_final_message"), **chat_template_kwargs}
    return [tokenizer.apply_chat_template(list(c), tokenize=False, **kwargs) for c in conversations]


def _template_kwargs(chat_template_kwargs: Any, kind: str) -> dict[str, Any]:
    """``chat_template_kwargs`` as a dict, checked: a mapping, given only for chat prompts (the one kind the template
    renders: with strings or ids it would be dropped without a word)."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise bad_type("chat_template_kwargs", "a dict of apply_chat_template's arguments, or None",
                       chat_template_kwargs)
    if chat_template_kwargs and kind != "chat":
        given = "strings" if kind == "text" else "pre-tokenized ids"
        raise bad_value("chat_template_kwargs", f"None or empty with prompts of {given} (the chat template renders "
                        "chat conversations alone: give the prompts as lists of {'role': ..., 'content': ...} "
                        "messages, or leave it out)", chat_template_kwargs)
    return dict(chat_template_kwargs)


RENDERED_CHAT_TOKENIZER_KWARGS: Mapping[str, Any] = MappingProxyType({"add_special_tokens": False})
"""How chats rendered by :func:`render_chats` are tokenized: no special token added (the template holds its own)."""


def _setting(model: Any, generate_kwargs: dict[str, Any], name: str) -> Any:
    """A setting of the call, by ``model.generate``'s precedence: its argument (``None`` given unsets it), else that of
    the ``generation_config`` it was given, else the model's generation config's; ``None`` if unset."""
    return _found(getattr(model, "generation_config", None), generate_kwargs, name)[1]


def _found(model_config: Any, generate_kwargs: dict[str, Any], name: str,
           where: str = "model.generation_config.") -> tuple[str, Any]:
    """``(where, value)`` of :func:`_setting`, ``model_config`` the model's generation config: ``where`` names it as
    a message should (``name``, ``generation_config.name`` or, by the ``where`` given,
    ``model.generation_config.name``). An argument given as ``None`` is the value: ``generate`` sets its config's
    field to it (``eos_token_id=None``: no EOS, whatever the configs say)."""
    if name in generate_kwargs:
        return name, generate_kwargs[name]
    for prefix, config in (("generation_config.", generate_kwargs.get("generation_config")), (where, model_config)):
        if getattr(config, name, None) is not None:
            return f"{prefix}{name}", getattr(config, name)
    return name, None


def applied_setting(model_config: Any, generate_kwargs: dict[str, Any], name: str) -> Any:
    """The value of ``name`` that ``model.generate`` applies: its argument in ``generate_kwargs``, else that of the
    ``generation_config`` given there, else ``model_config``'s (the model's generation config), else transformers'
    own default (what ``generate`` fills into a field no one set); ``None`` where there is none.

    Example:
        >>> from transformers import GenerationConfig
        >>> config = GenerationConfig(temperature=0.7)
        >>> [applied_setting(config, {"top_k": 5}, name) for name in ("top_k", "temperature", "top_p")]
        [5, 0.7, 1.0]
    """
    value = _found(model_config, generate_kwargs, name)[1]
    return value if value is not None else _generate_default(name)


def _generate_default(name: str) -> Any:
    """What ``model.generate`` applies for a field no one set: transformers 5.x leaves it ``None`` in every config and
    fills in its documented defaults (``GenerationConfig._get_default_generation_params``) as it generates; 4.x's
    configs hold their class defaults."""
    from transformers import GenerationConfig

    filled = getattr(GenerationConfig, "_get_default_generation_params", None)
    value = filled().get(name) if callable(filled) else None
    return value if value is not None else _class_default(name)


_DEFAULT_NEW_TOKENS = 20  # model.generate's when no length is set: max_length 20 past the prompt
_COUNT_THE_PROMPT = {"max_length": "max_new_tokens", "min_length": "min_new_tokens"}  # each, and its per-reply twin


def counting_the_prompt(model_config: Any, generate_kwargs: dict[str, Any],
                        where: str = "model.generation_config.") -> tuple[str, str, Any] | None:
    """The rule of a decoder-only model's lengths: ``max_length`` and ``min_length`` count the prompt, which a batch
    pads to its longest row, so a reply's length would depend on its batch; either set (given, in the
    ``generation_config=`` given or in ``model_config``, the model's generation config, named by ``where``) without
    its ``*_new_tokens`` twin is refused. Returns the first so set, ``(where it is set, its twin, its value)``, else
    ``None``.

    Example:
        >>> from transformers import GenerationConfig
        >>> counting_the_prompt(GenerationConfig(min_length=5), {"max_new_tokens": 8})
        ('model.generation_config.min_length', 'min_new_tokens', 5)
        >>> counting_the_prompt(GenerationConfig(min_length=5), {"min_new_tokens": 2}) is None
        True
    """
    for total, new in _COUNT_THE_PROMPT.items():
        place, value = _found(model_config, generate_kwargs, total, where)
        if place != total and value == _class_default(total):  # a config's own default, set by no one (4.x: 20)
            continue
        if value and _found(model_config, generate_kwargs, new)[1] is None:
            return place, new, value
    return None


def _class_default(name: str) -> Any:
    """``GenerationConfig``'s default of ``name``: transformers 4.x fills ``max_length=20`` into every config, which
    says nothing of the model (5.x leaves it ``None``)."""
    from transformers import GenerationConfig

    return getattr(GenerationConfig(), name, None)


def _new_tokens(model: Any, generate_kwargs: dict[str, Any], encoder_decoder: bool) -> int:
    """The call's ``max_new_tokens``: unset, ``generate``'s default on a decoder-only model, else 0. A decoder-only
    model's lengths that count the prompt are refused (:func:`counting_the_prompt`); an encoder-decoder's count
    its decoder's own tokens."""
    found = None if encoder_decoder else counting_the_prompt(getattr(model, "generation_config", None), generate_kwargs)
    if found is not None:
        where, new, value = found
        raise bad_value(where, f"unset on a decoder-only model unless {new} is set: it counts the prompt, which a "
                        "batch pads to its longest row, so a reply's length would depend on its batch "
                        f"(give {new}, the tokens of each reply)", value)
    value = _setting(model, generate_kwargs, "max_new_tokens")
    if value is not None:
        return check_positive_int("max_new_tokens", value)
    return 0 if encoder_decoder else _DEFAULT_NEW_TOKENS


def _default_limit(model: Any, tokenizer: Any, new_tokens: int, encoder_decoder: bool) -> int:
    """The longest prompt the model can take: its positions (less the new tokens, decoder-only) and the tokenizer's."""
    found = position_limit(model)
    positions = None if found is None else found[2] - (0 if encoder_decoder else new_tokens)
    limits = [limit for limit in (positions, model_max_length(tokenizer)) if limit is not None]
    if not limits:
        raise bad_value("max_input_token_length", "given when neither the model's config nor the tokenizer "
                        "sets a length limit", None)
    return max(1, min(limits))


_FROM_PROMPTS = ("input_ids", "attention_mask")  # what each batch gives model.generate itself
_TAKEN_BY_GENERATE = ("tokenizer", "assistant_tokenizer", "trust_remote_code")  # its **kwargs it takes as its own


def check_generate_kwargs(model: Any, generate_kwargs: dict[str, Any]) -> None:
    """Refuses, before any batch runs, a keyword ``model.generate`` would refuse in every batch (where ``on_error``
    would first split the batch row by row): a name that is neither a ``GenerationConfig`` field, nor an argument of
    ``generate``, nor a model input (a ``TypeError`` with the closest name), or a value ``GenerationConfig``'s own
    ``validate`` refuses (a ``ValueError`` naming it). Only a transformers model's ``generate`` is read: a wrapper's
    own ``generate`` says what it takes."""
    from transformers import GenerationConfig, GenerationMixin

    if not isinstance(model, GenerationMixin):
        return
    for name in _FROM_PROMPTS:
        if name in generate_kwargs:
            raise bad_type(name, "left out: each batch gives model.generate the prompts' own", generate_kwargs[name])
    own = set(inspect.signature(type(model).generate).parameters) | set(_TAKEN_BY_GENERATE)
    settings = {k: v for k, v in generate_kwargs.items() if k not in own}
    base = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None) or GenerationConfig()
    fields = _config_fields(base, settings)
    inputs = _model_inputs(model)
    unknown = [name for name in settings if name not in fields.keys() | inputs]
    if unknown:
        name = unknown[0]
        raise TypeError(f"generate() got an unexpected keyword argument {name!r}"
                        f"{did_you_mean(name, set(base.to_dict()) | inputs | own)}: it is no GenerationConfig field, "
                        f"no argument of {type(model).__name__}.generate and no input of the model; but got "
                        f"{name}={settings[name]!r}")
    _check_values(base, fields)


def _config_fields(base: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """The ``settings`` that are fields of the generation config ``base`` (not its methods), in their order."""
    return {k: v for k, v in settings.items() if hasattr(base, k) and not callable(getattr(base, k))}


def _model_inputs(model: Any) -> set[str]:
    """What ``model.generate`` passes on to the model: the arguments of its ``forward`` and
    ``prepare_inputs_for_generation`` (and of its encoder's ``forward``), and the attention keywords every
    transformers model takes."""
    functions = [model.forward, getattr(model, "prepare_inputs_for_generation", None)]
    if getattr(model.config, "is_encoder_decoder", False) and callable(getattr(model, "get_encoder", None)):
        functions.append(model.get_encoder().forward)
    names = {n for f in functions if callable(f) for n in inspect.signature(f).parameters}
    try:
        from transformers.utils import TransformersKwargs
    except ImportError:  # older transformers: the models name them in forward
        return names
    return names | set(TransformersKwargs.__optional_keys__)


def _check_values(base: Any, settings: dict[str, Any]) -> None:
    """``base`` updated with ``settings`` as ``model.generate`` updates it, its refusal raised naming the keyword
    (the first that ``validate`` refuses alone, else every one given)."""
    try:
        copy.deepcopy(base).update(**settings)
        return
    except (ValueError, TypeError) as error:
        refused = error
    for name, value in settings.items():
        try:
            copy.deepcopy(base).update(**{name: value})
        except (ValueError, TypeError):
            break
    else:
        name, value = ", ".join(settings), settings
    rule = f"what transformers' GenerationConfig.validate takes ({str(refused).strip()})"
    raise (bad_type if isinstance(refused, TypeError) else bad_value)(name, rule, value) from refused


_PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def check_generation_settings(model_config: Any, settings: dict[str, Any],
                              where: str = "model.generation_config.") -> None:
    """The checks of :func:`reply_function` that need no model, for a command to make before any weights load:
    ``settings`` on ``model_config`` (the model's generation config, named by ``where`` as :func:`_found` names it)
    as ``GenerationConfig.validate`` takes them, no per-step output asked for (:func:`_check_replies_only`) and no
    setting taken on one prompt alone (:func:`_check_batchable`).

    Example:
        >>> from transformers import GenerationConfig
        >>> sampled_twice = GenerationConfig(do_sample=True, num_return_sequences=2)
        >>> check_generation_settings(sampled_twice, {"do_sample": True, "max_new_tokens": 4}, where="")
        >>> try:
        ...     check_generation_settings(sampled_twice, {"do_sample": False}, where="")
        ... except ValueError as refused:
        ...     print(str(refused).split(" (")[0])
        do_sample should be what transformers' GenerationConfig.validate takes
    """
    from transformers import GenerationConfig

    base = model_config if model_config is not None else GenerationConfig()
    _check_values(base, _config_fields(base, settings))
    _check_replies_only(model_config, settings, where)
    _check_batchable(model_config, settings, where)


def _check_replies_only(model_config: Any, generate_kwargs: dict[str, Any], where: str) -> None:
    """Refuses a setting asking ``model.generate`` for more than the sequences (its per-step scores, logits, attentions
    or hidden states), wherever set (:func:`_setting`'s precedence): a reply is built from the sequences alone, so
    they would be computed, held on the device and dropped without a word; :func:`dynabatch.run` with one's own
    ``fn`` keeps them."""
    for name in _PER_STEP_OUTPUTS:
        place, value = _found(model_config, generate_kwargs, name, where)
        if value:
            raise bad_value(place, "unset or False: dynabatch.generate returns each prompt's reply (its ids or text), "
                            "not generate's per-step outputs, which are of the padded batch (call dynabatch.run "
                            "with your own fn calling model.generate to keep them)", value)


_ONE_PROMPT_AT_A_TIME = ("streamer", "assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def _check_batchable(model_config: Any, generate_kwargs: dict[str, Any], where: str) -> None:
    """Refuses, before any batch runs, a setting ``model.generate`` takes on one prompt at a time alone: a streamer
    (transformers' raise on a batch of two) and assisted generation (an assistant model, prompt lookup, early exit
    or multi-token prediction: "only supported for batch_size = 1"). Every batch would fail, each first split row by
    row by ``on_error``'s isolation."""
    for name in _ONE_PROMPT_AT_A_TIME:
        place, value = _found(model_config, generate_kwargs, name, where)
        if value is not None and value is not False:
            raise bad_value(place, "left out: model.generate takes it on one prompt at a time (a batch of one), and "
                            "dynabatch.generate batches prompts (call model.generate on each prompt for it)", value)


_STOPS_WITHOUT_EOS = ("stopping_criteria", "max_time")  # generate arguments ending rows early, untold where


def reply_ids(sequences: torch.Tensor, prompt_width: int, *, encoder_decoder: bool, eos_ids: set[int],
              pad_token_id: int | None, stopped: torch.Tensor | None = None) -> list[list[int]]:
    """Each row's reply: the new tokens (decoder-only) or the decoder sequence (its start token kept), ended at the
    first EOS or the first token ``stopped`` marks (kept); a row without either loses its trailing pad ids when
    ``pad_token_id`` is given. ``stopped``: a bool tensor of the new tokens' shape, True where a stop string ended.

    Example:
        >>> rows = torch.tensor([[0, 7, 8, 5, 2, 2], [0, 0, 9, 6, 3, 4]])  # prompt of width 3, EOS 2 == pad
        >>> reply_ids(rows, 3, encoder_decoder=False, eos_ids={2}, pad_token_id=None)
        [[5, 2], [6, 3, 4]]
        >>> reply_ids(rows, 3, encoder_decoder=False, eos_ids={2}, pad_token_id=None,
        ...           stopped=torch.tensor([[False, False, False], [False, True, False]]))
        [[5, 2], [6, 3]]
        >>> reply_ids(torch.tensor([[0, 0, 0]]), 0, encoder_decoder=True, eos_ids={1}, pad_token_id=None)
        [[0, 0, 0]]
        >>> reply_ids(torch.tensor([[0, 5, 0]]), 0, encoder_decoder=True, eos_ids={1}, pad_token_id=0)
        [[0, 5]]
    """
    new = sequences if encoder_decoder else sequences[:, prompt_width:]
    first = 1 if encoder_decoder else 0  # the decoder start token never ends a reply
    stops = [[False] * new.shape[1]] * len(new) if stopped is None else stopped.tolist()
    replies = []
    for row, stop in zip(new.tolist(), stops):
        end = next((i + 1 for i in range(first, len(row)) if row[i] in eos_ids or stop[i]), None)
        if end is None:
            end = len(row)
            while pad_token_id is not None and end > first and row[end - 1] == pad_token_id:
                end -= 1
        replies.append(row[:end])
    return replies


_PROMPT_CONTEXT = 5  # prompt tokens a reply is decoded after: vLLM's incremental detokenizer starts from as many


def reply_texts(tokenizer: Any, replies: list[list[int]], contexts: list[list[int]] | None = None, *,
                skip_special_tokens: bool = True) -> list[str]:
    """Each reply's text: the text decoding it after its ``contexts`` (its prompt's last tokens) adds to theirs, from
    where ``decode(context + reply)`` first differs from ``decode(context)``; ``contexts=None`` (an encoder-decoder's
    replies, which continue no prompt): each decoded alone. A reply decoded alone loses the space that begins it with
    a SentencePiece tokenizer (Llama, Mistral: decode strips the first token's "▁"), so that prompt + reply read
    "Helloworld"; a byte-level BPE's (GPT-2's) decodes the same either way. Two ``batch_decode`` calls.

    Example:
        >>> from tokenizers import Tokenizer, decoders, models
        >>> from transformers import PreTrainedTokenizerFast
        >>> pieces = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2}, unk_token="<unk>"))
        >>> pieces.decoder = decoders.Metaspace()  # SentencePiece's: each "▁" a space, the text's first dropped
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=pieces)
        >>> tokenizer.batch_decode([[2]]), reply_texts(tokenizer, [[2]], [[1]])
        (['world'], [' world'])
    """
    if contexts is None:
        return tokenizer.batch_decode(replies, skip_special_tokens=skip_special_tokens)
    before = tokenizer.batch_decode(contexts, skip_special_tokens=skip_special_tokens)
    whole = tokenizer.batch_decode([c + r for c, r in zip(contexts, replies)], skip_special_tokens=skip_special_tokens)
    # where decoding the reply changes the context's own text (a character its bytes complete), the reply starts there
    return [text[len(start) if text.startswith(start) else len(os.path.commonprefix([start, text])):]
            for start, text in zip(before, whole)]


def _prompt_contexts(batch: Any, returns: int) -> list[list[int]]:
    """The last ``_PROMPT_CONTEXT`` tokens of each prompt of a batch padded on the left (``generation_loader``'s),
    once per reply of it (``returns``)."""
    ids = batch["input_ids"][:, -_PROMPT_CONTEXT:].tolist()
    real = batch["attention_mask"][:, -_PROMPT_CONTEXT:].tolist()
    contexts = [[token for token, kept in zip(row, mask) if kept] for row, mask in zip(ids, real)]
    return [context for context in contexts for _ in range(returns)]


def _stop_strings(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any]) -> Callable[[torch.Tensor, int], Any]:
    """``stopped(sequences, start)``: where each row's text first ended in one of the call's stop strings (the bool
    tensor of :func:`reply_ids`; ``None`` without stop strings), by ``model.generate``'s own criterion, applied
    to each length of the rows: a row it stopped is padded after, with a pad id the model may also generate."""
    stop_strings = _setting(model, generate_kwargs, "stop_strings")
    if not stop_strings:
        return lambda sequences, start: None
    from transformers import StopStringCriteria

    criterion = StopStringCriteria(tokenizer, stop_strings)
    return lambda sequences, start: torch.stack(
        [criterion(sequences[:, : end + 1], None) for end in range(start, sequences.shape[1])], dim=1)


def _stop_tokenizer(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``model.generate`` takes besides the call's keywords: stop strings are matched on text, so it needs the
    tokenizer (which ``generate``'s own argument of that name takes before it could reach ``generate_kwargs``)."""
    return {"tokenizer": tokenizer} if _setting(model, generate_kwargs, "stop_strings") else {}


def generation_loader(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any], *,
                      chat: bool = False) -> tuple[Any, dict[str, Any]]:
    """What the loader of a ``generate`` call takes besides the texts: the tokenizer that pads its batches (a copy
    padding on the left for a decoder-only model) and its keywords: the model's shape through the new tokens, and
    no special tokens added to rendered chats (``chat``: the template holds its own)."""
    encoder_decoder = _check_model(model)
    shape = ModelShape.from_model(model, max_new_tokens=_new_tokens(model, generate_kwargs, encoder_decoder),
                                  num_beams=_setting(model, generate_kwargs, "num_beams") or 1)
    options: dict[str, Any] = {"model_shape": shape, **(RENDERED_CHAT_TOKENIZER_KWARGS if chat else {})}
    if encoder_decoder or getattr(tokenizer, "padding_side", "left") == "left":
        return tokenizer, options
    left = copy.copy(tokenizer)  # the caller's tokenizer is left as it is
    left.padding_side = "left"
    return left, options


def reply_function(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any], *, return_ids: bool = False,
                   skip_special_tokens: bool = True) -> Callable[[Any], PerRow]:
    """``fn(batch)`` for :func:`dynabatch.run`: ``model.generate`` on the batch with ``generate_kwargs``, each row's
    reply alone (the rules of :mod:`~dynabatch.inference.generation`), decoded (:func:`reply_texts`: a decoder-only
    reply after its prompt's last tokens) unless ``return_ids``; its keywords checked first
    (:func:`check_generate_kwargs`, :func:`_check_replies_only`, :func:`_check_batchable`)."""
    encoder_decoder = _check_model(model)
    check_generate_kwargs(model, generate_kwargs)
    model_config = getattr(model, "generation_config", None)
    _check_replies_only(model_config, generate_kwargs, "model.generation_config.")
    _check_batchable(model_config, generate_kwargs, "model.generation_config.")
    returns = check_positive_int("num_return_sequences", _setting(model, generate_kwargs, "num_return_sequences") or 1)
    eos = _setting(model, generate_kwargs, "eos_token_id")  # an int, a list of them or a tensor
    eos_ids = [] if eos is None else [int(e) for e in torch.as_tensor(eos).reshape(-1).tolist()]
    stops_early = any(_setting(model, generate_kwargs, name) is not None for name in _STOPS_WITHOUT_EOS)
    fill = _setting(model, generate_kwargs, "pad_token_id")  # what generate pads a finished row with: its EOS unset
    fill = eos_ids[0] if fill is None and eos_ids else fill
    pad_token_id = fill if stops_early else None  # else rows without EOS are whole
    stopped = _stop_strings(model, tokenizer, generate_kwargs)
    stop_tokenizer = _stop_tokenizer(model, tokenizer, generate_kwargs)

    def replies(batch: Any) -> PerRow:
        out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **stop_tokenizer,
                             **generate_kwargs)
        sequences = getattr(out, "sequences", out)  # return_dict_in_generate=True: the sequences alone
        width = batch["input_ids"].shape[1]
        rows = reply_ids(sequences, width, encoder_decoder=encoder_decoder, eos_ids=set(eos_ids),
                         pad_token_id=pad_token_id, stopped=stopped(sequences, 0 if encoder_decoder else width))
        if not return_ids:
            rows = reply_texts(tokenizer, rows, None if encoder_decoder else _prompt_contexts(batch, returns),
                               skip_special_tokens=skip_special_tokens)
        if returns > 1:  # generate's rows come prompt by prompt, k each
            rows = [rows[i : i + returns] for i in range(0, len(rows), returns)]
        return PerRow(rows)

    return replies


def _footprint(model: Any, tokenizer: Any, generate_kwargs: dict[str, Any], new_tokens: int, device: Any) -> Footprint:
    """The :class:`~dynabatch.memory.footprint.Footprint` of the call, its ``step_bytes`` measured on ``device``:
    what a decoding step's logits processors, sampling and beam search hold a prompt besides the prior (none for
    plain greedy; several vocabulary-wide copies for top-p sampling), as the slope of two calls of 2 and 4
    one-token prompts of 2 new tokens over the prior's (the RNG left as it was). An encoder-decoder's
    ``max_length`` (generate's own limit, unset ``max_new_tokens``) counts the start token too: this errs high."""
    settings = {"num_beams": _setting(model, generate_kwargs, "num_beams") or 1,
                "num_return_sequences": _setting(model, generate_kwargs, "num_return_sequences") or 1}
    max_new_tokens = new_tokens or int(_setting(model, generate_kwargs, "max_length") or _DEFAULT_NEW_TOKENS)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if not getattr(known_backend(dev.type), "measurable", False):
        return Footprint.from_model(model, max_new_tokens=max_new_tokens, **settings)
    prior = Footprint.from_model(model, max_new_tokens=2, **settings)
    stop_tokenizer = _stop_tokenizer(model, tokenizer, generate_kwargs)
    peaks = []
    with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev], device_type=dev.type), \
            torch.inference_mode():
        for rows in (2, 4):
            ids = torch.full((rows, 1), int(getattr(tokenizer, "pad_token_id", 0) or 0), device=dev)
            with track_peak_memory(dev) as mem:
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **stop_tokenizer,
                               **{**generate_kwargs, "max_new_tokens": 2})
            peaks.append(mem.peak_bytes or 0)
    step_bytes = max(0, math.ceil((peaks[1] - peaks[0]) / 2 - float(prior.row_bytes(1))))
    logger.debug("generate: a decoding step holds %d bytes a prompt besides the footprint's prior", step_bytes)
    return Footprint.from_model(model, max_new_tokens=max_new_tokens, step_bytes=step_bytes, **settings)


class TruncatedPrompts:
    """Which prompts the loader truncated to ``limit`` tokens. :meth:`noting` wraps a run's ``fn`` to note its
    batches' rows of ``limit`` tokens, the only prompts the loader may have truncated (a batch narrower than the limit
    holds none, and costs no look at its mask), with their texts where the batch carries them; :meth:`take`, after
    the run, tells which of them were longer and forgets them, so that one object serves run after run (each window
    of a Ray actor: ``dynabatch generate --ray``).

    Args:
        tokenizer: the tokenizer that padded the batches, which tokenizes the noted texts again as the loader did.
        limit: the loader's ``max_input_token_length``.
        kind: the prompts' kind: ``"ids"`` (pre-tokenized: their lengths tell), ``"chat"`` (rendered conversations,
            tokenized without special tokens added) or ``"text"``.
    """

    def __init__(self, tokenizer: Any, limit: int, kind: str = "text") -> None:
        self.tokenizer, self.limit, self.kind = tokenizer, limit, kind
        self.full: dict[int, Any] = {}  # input position -> its text as the batch carried it (None: it carried none)

    def noting(self, fn: Callable[[Any], PerRow]) -> Callable[[Any], PerRow]:
        """``fn``, noting each batch's rows of ``limit`` tokens by input position."""
        def noted(batch: Any) -> PerRow:
            indices = getattr(batch, "indices", None)
            if indices is not None and batch["input_ids"].shape[1] >= self.limit:
                at_limit = (batch["attention_mask"].sum(dim=1) == self.limit).cpu()
                texts = getattr(batch, "texts", None)
                for row in at_limit.nonzero().flatten().tolist():
                    self.full[int(indices[row])] = None if texts is None else texts[row]
            return fn(batch)

        return noted

    def take(self, prompts: Sequence[Any] | None = None) -> list[int]:
        """The positions, in order, of the noted prompts that were longer than ``limit``, forgotten then: a noted
        prompt's text as its batch carried it, else ``prompts[position]`` (the run's texts, or its token ids);
        texts are tokenized again to ``limit + 1`` tokens (a text of more than ``limit`` keeps ``limit + 1``)."""
        full, self.full = self.full, {}
        positions = sorted(full)
        seen = [full[p] if full[p] is not None else prompts[p] for p in positions]
        if self.kind == "ids" or not positions:
            return [p for p, ids in zip(positions, seen) if len(ids) > self.limit]
        kwargs = RENDERED_CHAT_TOKENIZER_KWARGS if self.kind == "chat" else {}
        lengths = tokenize_texts(seen, self.tokenizer, self.limit + 1, progress=False, tokenize_cores=1,
                                 texts_name="prompts", **kwargs).lengths
        return [p for p, length in zip(positions, lengths.tolist()) if length > self.limit]


def _warn_truncated(positions: list[int], limit: int, side: str) -> None:
    """One warning naming the prompts truncated to ``limit`` tokens on ``side``, and what keeps them whole."""
    lost = ("their ends (a chat's generation prompt with them: its reply continues the cut text)" if side == "right"
            else "their beginnings")
    logger.warning("%d prompts (prompts[%s]) were longer than max_input_token_length=%d tokens and were truncated on "
                   "the tokenizer's truncation_side=%r, losing %s; set tokenizer.truncation_side='left' to keep their "
                   "ends, give a larger max_input_token_length, or leave them out", len(positions),
                   first_few(positions), limit, side, lost)


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
    on_bad_input: str = "raise",
    memory: str = "auto",
    progress: bool = True,
    **generate_kwargs: Any,
) -> RunResult | StoredRunResult:
    """Generates a reply to every prompt with ``model.generate``, in input order, through :func:`dynabatch.run`.

    Args:
        model: a ``transformers`` generative model (decoder-only or encoder-decoder), in eval mode.
        tokenizer: its tokenizer (with a pad token; left alone: a copy pads decoder-only prompts on the left).
        prompts: all str, all chat conversations (lists of message dicts, rendered by ``apply_chat_template``) or all
            pre-tokenized ids (lists of int, taken as they are).
        return_ids: return each reply's token ids (a list of int, its EOS kept) instead of the decoded string.
        skip_special_tokens: passed to ``tokenizer.batch_decode``, which decodes a decoder-only model's reply after
            its prompt's last tokens: its text is what it adds to theirs, so prompt + reply read as the whole (a
            SentencePiece reply keeps the space that begins it).
        batch_size: under the relative rule (the CPU, or ``max_memory=None``), rows of the first (longest) batch,
            later batches grown under its measured peak; an absolute budget sizes every batch itself.
        max_memory: what every batch is planned under (the model's :class:`~dynabatch.memory.footprint.Footprint`,
            its step's copies of the logits measured by two small calls first, refined by measured peaks), read on
            ``device`` as the call starts: ``"auto"`` (90% of a GPU's free memory, the relative rule on the CPU),
            ``"80%"``, ``"20GB"``, ``"20GiB"`` or bytes; ``None``: the relative rule.
        max_input_token_length: prompts are truncated to it (on the tokenizer's ``truncation_side``: the right
            cuts a chat's generation prompt), with one warning naming them, counted in
            ``.report.truncated_inputs``; ``None``: the smaller of the model's positions (less
            ``max_new_tokens``, 20 unset, on a decoder-only model) and the tokenizer's ``model_max_length``.
        chat_template_kwargs: more arguments of ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``), for
            chat prompts (refused with strings or ids, which no template renders).
        device: where batches run; ``None``: the model's device.
        ids: one stable id per prompt (str or int, unique; a store keys its rows by them), or ``None``: the loader's.
        output_path, key, on_oom, on_error, memory, progress: :func:`dynabatch.run`'s.
        on_bad_input: a prompt of no token (``[]``, or a text that tokenizes to nothing with a tokenizer that adds no
            BOS): ``"raise"`` refuses it (a ``ValueError`` naming its position, ``prompts[i]``: the prompt, a chat as
            rendered), ``"skip"`` lists it failed (``None``, its cause in ``.failures``) and replies to the others.
        **generate_kwargs: passed to every ``model.generate`` call (``max_new_tokens``, ``do_sample``, ...); with
            ``num_return_sequences=k > 1`` each prompt's result is a list of ``k`` replies. A sampled reply
            (``do_sample=True``) is drawn with its batch's, so it depends on the batch it ran in, not on a seed alone.

    Returns:
        A :class:`~dynabatch.inference.results.RunResult` (a ``StoredRunResult`` with ``output_path``): one reply per
        prompt, with ``.report``.

    Raises:
        TypeError: a model without ``generate``, prompts of mixed or unknown kinds, ``return_ids`` or
            ``skip_special_tokens`` not a bool, ``chat_template_kwargs`` not a mapping, or a keyword
            ``model.generate`` takes not (:func:`check_generate_kwargs`).
        ValueError: a keyword's value ``GenerationConfig.validate`` refuses, per-step outputs asked for
            (``output_scores``, ``output_logits``, ``output_attentions``, ``output_hidden_states``: a reply holds
            none), a setting ``model.generate`` takes on one prompt alone (``streamer``, ``assistant_model``,
            ``prompt_lookup_num_tokens``), a non-empty ``chat_template_kwargs`` with prompts of strings or ids,
            chat prompts with a tokenizer without chat template, a prompt limit
            (plus the new tokens) above the model's positions, a prompt of no token (``on_bad_input="raise"``), or
            a decoder-only model's ``max_length`` or ``min_length`` (they count the padded prompt) without
            ``max_new_tokens`` or ``min_new_tokens``.
    """
    encoder_decoder = _check_model(model)
    check_tokenizer(tokenizer)
    check_max_memory(max_memory)
    kind = _prompt_kind(prompts)
    template_kwargs = _template_kwargs(chat_template_kwargs, kind)
    check_bool("return_ids", return_ids)
    check_bool("skip_special_tokens", skip_special_tokens)
    new_tokens = _new_tokens(model, generate_kwargs, encoder_decoder)
    if not encoder_decoder and _setting(model, generate_kwargs, "max_new_tokens") is None:
        # the default said outright: a config's max_length (4.x's 20) would count the padded prompt
        generate_kwargs = {**generate_kwargs, "max_new_tokens": new_tokens}
    fn = reply_function(model, tokenizer, generate_kwargs, return_ids=return_ids,
                        skip_special_tokens=skip_special_tokens)
    if max_input_token_length is None:
        max_input_token_length = _default_limit(model, tokenizer, new_tokens, encoder_decoder)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    check_position_limit(model, max_input_token_length, max_new_tokens=new_tokens)
    texts = render_chats(tokenizer, prompts, template_kwargs) if kind == "chat" else prompts
    device = getattr(model, "device", None) if device is None else device
    budget = {}  # the relative rule, unless max_memory is an absolute budget on device: planned by the footprint
    if is_absolute(max_memory, device):
        budget = {"memory_model": _footprint(model, tokenizer, generate_kwargs, new_tokens, device),
                  "max_memory": max_memory}
    padder, options = generation_loader(model, tokenizer, generate_kwargs, chat=kind == "chat")
    loader = build_dynamic_batch_dataloader(texts, padder, batch_size, max_input_token_length, num_workers=0,
                                            progress=progress, ids=ids, on_bad_input=on_bad_input,
                                            texts_name="prompts", **budget, **options)
    truncation = TruncatedPrompts(padder, max_input_token_length, kind)
    with torch.inference_mode():
        result = run(truncation.noting(fn), loader, device=device,
                     output_path=output_path, key=key, on_oom=on_oom, on_error=on_error, memory=memory,
                     progress=progress)
    truncated = truncation.take(prompts if kind == "ids" else texts)
    if truncated:
        _warn_truncated(truncated, max_input_token_length, getattr(padder, "truncation_side", "right"))
    result.report.truncated_inputs = len(truncated)
    return result

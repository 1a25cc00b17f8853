"""What the planner may know of the model and the call: :class:`ModelShape`, and its one check.

Example:
    >>> from dynabatch.memory.shape import ModelShape, check_model_shape
    >>> check_model_shape(ModelShape(vocab_size=32_000, hidden_size=512, max_new_tokens=16)).num_beams
    1
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dynabatch._validation import bad_type, bad_value, check_non_negative_int, check_positive_int

__all__ = ["ModelShape", "check_model_shape", "check_position_limit", "position_limit", "resolve_model_shape",
           "text_config"]

_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length",
                    "max_sequence_length")
"""Config fields that bound the positions a model embeds, in the order they are read."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the planner may know of the model and the call: enough for ``memory_ratio_estimate``.

    Args:
        vocab_size: rows of the output embedding (logits per generated token).
        hidden_size: width of the model's hidden states.
        max_new_tokens: tokens ``generate`` adds per row; 0 for a forward call.
        num_beams: beams per row of ``generate``.

    Example:
        >>> from transformers import GPT2Config
        >>> ModelShape.from_model(GPT2Config(), max_new_tokens=32)
        ModelShape(vocab_size=50257, hidden_size=768, max_new_tokens=32, num_beams=1)
    """

    vocab_size: int
    hidden_size: int
    max_new_tokens: int = 0
    num_beams: int = 1

    def __post_init__(self) -> None:
        check_positive_int("vocab_size", self.vocab_size)
        check_positive_int("hidden_size", self.hidden_size)
        check_non_negative_int("max_new_tokens", self.max_new_tokens)
        check_positive_int("num_beams", self.num_beams)

    @classmethod
    def from_model(cls, model: Any, *, max_new_tokens: int = 0, num_beams: int = 1) -> ModelShape:
        """Reads the shape from a transformers model (or its config) and the call's settings.

        Args:
            model: a ``transformers`` model or ``PretrainedConfig``; for
                multimodal or composite configs the text part is read.
            max_new_tokens: what ``generate`` will be called with; 0 for ``model(**batch)``.
            num_beams: what ``generate`` will be called with.

        Raises:
            TypeError: if ``model`` has no transformers config.
        """
        text = text_config(model)
        vocab_size = getattr(text, "vocab_size", None)
        hidden_size = getattr(text, "hidden_size", None)
        if vocab_size is None or hidden_size is None:
            raise bad_type("model", "a transformers model or config with vocab_size and hidden_size", model)
        return cls(int(vocab_size), int(hidden_size), max_new_tokens, num_beams)


def text_config(model: Any) -> Any:
    """The config of a model's text part (a multimodal or composite config's text config; the config itself else)."""
    config = getattr(model, "config", model)
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def _position_offset(model: Any) -> int:
    """Positions a model's position embedding reserves before the first token (RoBERTa: ``padding_idx + 1``)."""
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return 0
    for module in modules():
        padding_idx = getattr(module, "padding_idx", None)
        embedding = getattr(module, "position_embeddings", None)
        if isinstance(padding_idx, int) and hasattr(embedding, "num_embeddings"):
            return padding_idx + 1
    return 0


def position_limit(model: Any) -> tuple[str, int, int] | None:
    """``(field, value, usable)``: the config field bounding a model's positions, its value and the positions
    a row may use; ``None`` when the config has none (relative positions, as T5).

    ``field`` is the name the config stores (GPT-2's ``max_position_embeddings``
    is an alias of ``n_positions``). ``usable`` is ``value`` less the positions a
    model's position embedding reserves (RoBERTa's ``padding_idx + 1``, read
    when ``model`` is the model, not its config).

    Example:
        >>> from transformers import GPT2Config
        >>> position_limit(GPT2Config(n_positions=64))
        ('n_positions', 64, 64)
    """
    config = text_config(model)
    aliases = getattr(config, "attribute_map", {}) or {}
    for name in _POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return aliases.get(name, name), value, value - _position_offset(model)
    return None


def check_position_limit(model: Any, max_input_token_length: int, *, max_new_tokens: int = 0,
                         length_name: str = "max_input_token_length") -> None:
    """Refuses a length limit the model cannot embed, naming the config field and its value.

    A decoder-only model embeds the prompt and the ``max_new_tokens`` that
    ``generate`` adds; an encoder-decoder model embeds the input in its
    encoder and the decoder start token plus the new tokens in its decoder.
    ``length_name`` is what the message calls the limit (the setting its caller read it from).

    Raises:
        ValueError: the limit (with the new tokens) is above the model's positions.

    Example:
        >>> from transformers import GPT2Config
        >>> check_position_limit(GPT2Config(n_positions=64), 48, max_new_tokens=32)
        Traceback (most recent call last):
        ...
        ValueError: max_input_token_length should be at most 32 (the model's config.n_positions=64 positions, \
less max_new_tokens=32 that generate adds), but got max_input_token_length=48
    """
    found = position_limit(model)
    if found is None:
        return
    field, value, usable = found
    where = f"the model's config.{field}={value} positions" + (
        f", {value - usable} of them reserved before the first token" if usable != value else "")
    encoder_decoder = bool(getattr(getattr(model, "config", model), "is_encoder_decoder", False))
    if max_new_tokens and not encoder_decoder:
        if max_new_tokens >= usable:  # no room left for a prompt: the limit itself is not what to change
            raise bad_value("max_new_tokens", f"at most {usable - 1} ({where}, which hold the prompt too: one "
                            "token at least)", max_new_tokens)
        if max_input_token_length + max_new_tokens > usable:
            raise bad_value(length_name, f"at most {usable - max_new_tokens} ({where}, less "
                            f"max_new_tokens={max_new_tokens} that generate adds)", max_input_token_length)
        return
    if max_input_token_length > usable:
        raise bad_value(length_name, f"at most {usable} ({where})", max_input_token_length)
    if max_new_tokens + 1 > usable:
        raise bad_value("max_new_tokens", f"at most {usable - 1} ({where}, one for the decoder start token)",
                        max_new_tokens)


def check_model_shape(model_shape: Any) -> ModelShape | None:
    """Validates ``model_shape`` (so a loader can refuse it before tokenizing)."""
    if model_shape is not None and not isinstance(model_shape, ModelShape):
        raise bad_type("model_shape", "a ModelShape (ModelShape.from_model(model, ...)) or None", model_shape)
    return model_shape


def resolve_model_shape(model_shape: Any = None, model: Any = None) -> ModelShape | None:
    """``model_shape`` checked, or read from ``model`` (``ModelShape.from_model(model)``: a forward call).

    Raises:
        TypeError: ``model_shape`` not a ModelShape, or ``model`` without a transformers config.
        ValueError: both given.
    """
    check_model_shape(model_shape)
    if model is None:
        return model_shape
    if model_shape is not None:
        raise ValueError(
            "model should be None when model_shape is given (the shape is read from one of them), but got "
            f"model of type {type(model).__name__} and model_shape={model_shape!r}"
        )
    return ModelShape.from_model(model)

"""What the planner may know of the model and the call: :class:`ModelShape`, and its one check.

Example:
    >>> from dynabatch.memory.shape import ModelShape, check_model_shape
    >>> check_model_shape(ModelShape(vocab_size=32_000, hidden_size=512, max_new_tokens=16)).num_beams
    1
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dynabatch._validation import bad_type, check_non_negative_int, check_positive_int

__all__ = ["ModelShape", "check_model_shape", "resolve_model_shape"]


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
        config = getattr(model, "config", model)
        text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
        vocab_size = getattr(text, "vocab_size", None)
        hidden_size = getattr(text, "hidden_size", None)
        if vocab_size is None or hidden_size is None:
            raise bad_type("model", "a transformers model or config with vocab_size and hidden_size", model)
        return cls(int(vocab_size), int(hidden_size), max_new_tokens, num_beams)


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

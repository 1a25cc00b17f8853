"""The checks :func:`~dynabatch.memory.calibrate.calibrate` makes before its first probe, and its probe lengths.

A bad argument fails in a second rather than minutes in: the devices, the
longest probe against the tokenizer's ``model_max_length``, the prompt plus
``max_new_tokens`` against the model's positions. The command line
(``python -m dynabatch calibrate``) runs the same checks.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import pad_token_id_of
from dynabatch.data.tokenization import check_tokenizer, model_max_length
from dynabatch.memory.device import default_device
from dynabatch.memory.measure import check_measurable_device

__all__ = [
    "MIN_LENGTH",
    "check_model_max_length",
    "check_positions",
    "check_probe_lengths",
    "check_probe_tokenizer",
    "hookable",
    "measure_device",
    "probe_lengths",
]

MIN_LENGTH = 4
"""The shortest base probe, in tokens."""


def probe_lengths(max_input_token_length: int, shortest: int = MIN_LENGTH) -> list[int]:
    """The base probe lengths: the limit halved down to ``shortest``, ascending.

    Example:
        >>> probe_lengths(256)
        [4, 8, 16, 32, 64, 128, 256]
        >>> probe_lengths(100)
        [4, 6, 12, 25, 50, 100]
    """
    out, length = [], float(max_input_token_length)
    while round(length) >= shortest:
        out.append(round(length))
        length /= 2
    if not out or out[-1] > shortest:
        out.append(min(shortest, max_input_token_length))
    return sorted(set(out))


# -- checks made before the first probe --------------------------------------------------------------


def _positions(config: Any, *names: str) -> tuple[str, int] | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
            return name, int(value)
    return None


def check_positions(config: Any, max_input_token_length: int, max_new_tokens: int = 0, *,
                    length_name: str = "max_input_token_length", new_name: str = "max_new_tokens") -> None:
    """Refuses a prompt plus new tokens beyond the positions of a model (its Hugging Face ``config``).

    A decoder-only model holds the prompt and the new tokens in one sequence:
    ``max_input_token_length + max_new_tokens`` may not exceed its
    ``max_position_embeddings`` (``n_positions`` on GPT-2). An encoder-decoder
    model's encoder takes the prompt and its decoder the new tokens. A config
    without a positions limit (relative positions, as T5's) passes.
    ``length_name`` and ``new_name`` are the arguments' names in the message
    (the command line's are ``--max-length`` and ``--max-new-tokens``).

    Raises:
        ValueError: the model has too few positions.
    """
    if config is None:
        return
    general = ("max_position_embeddings", "n_positions")
    if getattr(config, "is_encoder_decoder", False) is True:
        checks = [(_positions(config, "max_source_positions", *general), max_input_token_length, length_name,
                   "its encoder's positions, for the prompt"),
                  (_positions(config, "max_target_positions", *general), max_new_tokens, new_name,
                   "its decoder's positions, for the new tokens")]
        for found, value, name, what in checks:
            if found is not None and value > found[1]:
                raise bad_value(name, f"at most the model's {found[0]}={found[1]} ({what})", value)
        return
    found = _positions(config, *general)
    if found is None:
        return
    limit_name, limit = found
    if max_new_tokens >= limit:
        raise bad_value(new_name, f"less than the model's {limit_name}={limit} (positions for the prompt and the "
                        "new tokens)", max_new_tokens)
    if max_input_token_length + max_new_tokens > limit:
        rule = (f"at most {limit - max_new_tokens}: the model's {limit_name}={limit} positions hold the prompt and "
                f"the {new_name}={max_new_tokens} new tokens" if max_new_tokens else
                f"at most the model's {limit_name}={limit}")
        raise bad_value(length_name, rule, max_input_token_length)


def check_model_max_length(tokenizer: Any, max_input_token_length: int, *,
                           length_name: str = "max_input_token_length") -> None:
    """Refuses a longest probe beyond the tokenizer's ``model_max_length`` (when the tokenizer sets one).

    Raises:
        ValueError: ``max_input_token_length`` is above it.
    """
    limit = model_max_length(tokenizer)
    if limit is not None and max_input_token_length > limit:
        raise bad_value(length_name, f"at most the tokenizer's model_max_length={limit} (the longest probe has "
                        f"that many tokens; set tokenizer.model_max_length if the model takes longer inputs)",
                        max_input_token_length)


def measure_device(measure_memory: Any, device: Any, model: Any) -> torch.device:
    if measure_memory in ("auto", True):
        if device is not None:
            return check_measurable_device("device", device)
        params = list(model.parameters())[:1] if callable(getattr(model, "parameters", None)) else []
        if params:
            return params[0].device
        return default_device()
    return check_measurable_device("measure_memory", measure_memory, "'auto' or a device ('cpu', 'cuda:0')")


def check_probe_lengths(lengths: Any, max_input_token_length: int) -> list[int]:
    if lengths is None:
        return probe_lengths(max_input_token_length)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise bad_type("lengths", "None or a sequence of positive integers", lengths)
    grid = set()
    for i, value in enumerate(lengths):
        grid.add(check_positive_int(f"lengths[{i}]", int(value) if isinstance(value, np.integer) else value))
    if not grid:
        raise bad_value("lengths", "None or a non-empty sequence of positive integers", lengths)
    if max(grid) > max_input_token_length:
        raise bad_value("lengths", f"at most max_input_token_length={max_input_token_length}", lengths)
    return sorted(grid | {max_input_token_length})


def check_probe_tokenizer(tokenizer: Any, texts: Any) -> None:
    check_tokenizer(tokenizer)
    pad_token_id_of(tokenizer)
    if texts is None and not (isinstance(getattr(tokenizer, "vocab_size", None), int)
                              and callable(getattr(tokenizer, "decode", None))):
        raise bad_value("texts", "given for a tokenizer without vocab_size and decode() to draw token ids from",
                        None)


def hookable(model: Any) -> torch.nn.Module | None:
    return model if isinstance(model, torch.nn.Module) else None

"""The loader's checks of its tokenizer arguments: keywords the tokenizer takes, a length that fits."""

from __future__ import annotations

import difflib
import inspect
import warnings
from typing import Any

from dynabatch._validation import bad_value
from dynabatch.data.tokenization import model_max_length

__all__ = ["accepted_keywords", "check_length_fits", "check_tokenizer_kwargs"]


def accepted_keywords(tokenizer: Any) -> set[str] | None:
    """Keywords a call of ``tokenizer`` takes; ``None`` when it takes any (a plain ``**kwargs`` callable).

    A Hugging Face tokenizer's ``__call__`` ends in ``**kwargs`` but only uses
    its named arguments and those of ``_encode_plus`` (e.g. ``split_special_tokens``).
    """
    names: set[str] = set()
    takes_any = False
    for function in (tokenizer.__call__, getattr(tokenizer, "_encode_plus", None)):  # callable: check_tokenizer ran
        if function is None:
            continue
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # no signature to read: accept anything
            return None
        for p in parameters:
            if p.kind is p.VAR_KEYWORD:
                takes_any = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(p.name)
    if takes_any and not hasattr(tokenizer, "_encode_plus"):
        return None
    return names - {"text", "self"}


def check_tokenizer_kwargs(tokenizer: Any, tokenizer_kwargs: dict[str, Any]) -> None:
    """A misspelt keyword (``batchsize=8``) names itself instead of vanishing into the tokenizer call."""
    accepted = accepted_keywords(tokenizer)
    if accepted is None:
        return
    from dynabatch.inference.loader import build_dynamic_batch_dataloader

    own = set(inspect.signature(build_dynamic_batch_dataloader).parameters) - {"tokenizer_kwargs"}
    for key, value in tokenizer_kwargs.items():
        if key in accepted:
            continue
        close = difflib.get_close_matches(key, sorted(own | accepted), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"build_dynamic_batch_dataloader() got an unexpected keyword argument {key!r}{hint}: extra keywords "
            f"go to the tokenizer, and {type(tokenizer).__name__} does not take it; "
            f"but got {key}={value!r}"
        )


def check_length_fits(tokenizer: Any, max_input_token_length: int, tokenizer_kwargs: dict[str, Any]) -> None:
    """``max_input_token_length`` leaves room for text after the special tokens, and fits the model."""
    count_special = getattr(tokenizer, "num_special_tokens_to_add", None)
    if tokenizer_kwargs.get("add_special_tokens", True) and callable(count_special):
        special = count_special(pair=False)
        if max_input_token_length <= special:
            raise bad_value(
                "max_input_token_length",
                f"at least {special + 1} (the tokenizer adds {special} special tokens to every text)",
                max_input_token_length,
            )
    limit = model_max_length(tokenizer)
    if limit is not None and max_input_token_length > limit:
        warnings.warn(
            f"max_input_token_length={max_input_token_length} is above the tokenizer's "
            f"model_max_length={limit}: a model with {limit} positions fails on longer rows; "
            f"pass max_input_token_length<={limit}",
            UserWarning,
            stacklevel=3,
        )

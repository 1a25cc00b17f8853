"""The tokenize stage: every text tokenized once, into one flat token store.

:func:`tokenize_texts` calls the tokenizer once per chunk of texts (a batched
call, so a fast tokenizer encodes the chunk in parallel) and keeps the result
as a :class:`TokenizedTexts`: one flat ``int32`` array of token ids in input
order plus ``offsets``, instead of a million small Python lists. Planning reads
:attr:`TokenizedTexts.lengths`; the collate stage
(:class:`dynabatch.data.collate.TokenCollator`) pads batches straight from the store,
so the tokenizer never runs twice on a text.

Texts are truncated to ``max_input_token_length`` tokens, special tokens
included, exactly as ``tokenizer(texts, truncation=True, max_length=...)``
would; ``tokenizer_kwargs`` (e.g. ``add_special_tokens=False``) are passed on
to every call.

**The backend rule.** A fast tokenizer's Rust backend is called directly (it
skips the Python-side conversion of every encoding into dicts, which holds the
GIL while a device waits) only where that provably gives what the tokenizer's
own call gives: :func:`fast_backend` says where. The rule is on the class, not
on a sample of texts: the tokenizer is a transformers ``TokenizersBackend``
(``PreTrainedTokenizerFast``), and every method that shapes what its call
returns (:data:`CALL_PATH`: ``__call__``, the encode methods, text
preprocessing such as ``prepare_for_tokenization``, truncation and padding
set-up, the conversion of encodings) resolves, through the class's MRO and
with nothing set on the instance, to transformers' own generic
implementation; the loader passes no tokenizer argument but
``add_special_tokens``. A subclass that overrides any of them (a
``__call__`` that rewrites URLs, say), a slow tokenizer or any other callable
goes through its own call, chunk after chunk.

Example:
    >>> from transformers import AutoTokenizer
    >>> from dynabatch.demo import minilm_path
    >>> from dynabatch.data.tokenization import tokenize_texts
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> tokens = tokenize_texts(["In the beginning", "", "And God said"], tokenizer, max_input_token_length=4)
    >>> len(tokens), tokens.lengths.tolist()
    (3, [4, 2, 4])
    >>> tokens.row(1).tolist()  # [CLS] [SEP]
    [101, 102]
    >>> sorted(tokens.extras)
    ['token_type_ids']
"""

from __future__ import annotations

import collections.abc
import inspect
import itertools
import json
import logging
import operator
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch._background import StopRequested, ordered_map, progress_bar
from dynabatch._malloc import trim
from dynabatch._validation import bad_type, bad_value, brief, check_positive_int, did_you_mean, first_few
from dynabatch.data.workers import Pieces, available_cores, choose_mechanism, guard_forks, tokenizers_parallelism

__all__ = ["CALL_PATH", "FORBIDDEN_TOKENIZER_KWARGS", "PIECE_TOKENS", "TOKENS_PER_CALL",
           "TRIM_TOKENS", "ParallelTokenizer", "TokenizedTexts", "accepted_keywords", "as_items", "bad_input_error",
           "check_encodable", "check_length_fits", "check_tokenizer", "check_tokenizer_kwargs", "fast_backend",
           "log_skipped", "model_max_length", "plain_text", "split_bad_texts", "split_no_token", "tokenize_texts",
           "validate_texts"]

logger = logging.getLogger(__name__)

FORBIDDEN_TOKENIZER_KWARGS: dict[str, str] = {
    "max_length": "dynabatch sets it from max_input_token_length",
    "truncation": "dynabatch always truncates to max_input_token_length",
    "padding": "dynabatch pads each batch itself",
    "padding_side": "dynabatch pads each batch on the tokenizer's side: set tokenizer.padding_side instead",
    "pad_to_multiple_of": "set it on the collator instead",
    "return_tensors": "dynabatch builds the tensors of each batch itself",
    "return_attention_mask": "dynabatch builds the attention mask of each batch itself",
    "return_overflowing_tokens": "dynabatch keeps one row per text",
    "is_split_into_words": "dynabatch takes one str per text",
    "text_pair": "dynabatch takes one str per text, and reorders the texts by length: pass each pair tokenized, as a "
                 "row of token ids",
    "text_target": "dynabatch batches the texts' own token ids only: tokenize the targets yourself",
    "text_pair_target": "dynabatch batches the texts' own token ids only: tokenize the targets yourself",
    "tokenizer_kwargs": "pass each tokenizer keyword as a keyword of its own, such as add_special_tokens=False: "
                        "dynabatch checks and applies them one by one",
}
"""Tokenizer arguments the loader owns, with the reason each is refused."""

_SKIPPED_KEYS = frozenset({"input_ids", "attention_mask", "special_tokens_mask", "offset_mapping", "length"})

_TEXTS_RULE = "a list of str (or a tuple, pandas Series, numpy array or other non-str sequence of str)"


@dataclass(frozen=True, eq=False, repr=False)
class TokenizedTexts:
    """Token ids of many texts, stored flat.

    Attributes:
        input_ids: ``int32``, every text's token ids concatenated in input order.
        offsets: ``int64`` of shape ``(n + 1,)`` with ``offsets[0] == 0``; text
            ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``.
        extras: other per-token outputs of the tokenizer (e.g.
            ``"token_type_ids"``), flat ``int32`` arrays sharing ``offsets``.
            The attention mask is not stored: it is all ones before padding.
    """

    input_ids: np.ndarray
    offsets: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        offsets = self.offsets
        if not isinstance(offsets, np.ndarray) or offsets.ndim != 1 or offsets.size < 1:
            raise bad_type("offsets", "a 1-D numpy array of n + 1 ints", offsets)
        if offsets[0] != 0 or offsets[-1] != len(self.input_ids):
            raise bad_value(
                "offsets", f"an array from 0 to len(input_ids)={len(self.input_ids)}", offsets
            )
        for key, values in self.extras.items():
            if len(values) != len(self.input_ids):
                raise bad_value(
                    f"len(extras[{key!r}])", f"len(input_ids)={len(self.input_ids)}", len(values)
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(texts={len(self)}, tokens={len(self.input_ids)}, extras={sorted(self.extras)})"

    @property
    def lengths(self) -> np.ndarray:
        """Number of tokens of each text, ``int64`` (special tokens included)."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        """Token ids of text ``i`` (a view into :attr:`input_ids`); negative ``i`` counts from the end."""
        n = len(self)
        i = operator.index(i)
        if not -n <= i < n:
            raise IndexError(f"i should be in range(-{n}, {n}), but got i={i!r}")
        if i < 0:
            i += n
        return self.input_ids[self.offsets[i] : self.offsets[i + 1]]

    def take(self, rows: Any) -> TokenizedTexts:
        """The store of the texts at ``rows`` (row numbers, in that order), one gather per array.

        Example:
            >>> tokens = TokenizedTexts(np.array([5, 6, 7, 8], dtype=np.int32), np.array([0, 3, 4]))
            >>> picked = tokens.take([1, 0])
            >>> picked.input_ids.tolist(), picked.offsets.tolist()
            ([8, 5, 6, 7], [0, 1, 4])
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        starts = self.offsets[rows]
        lengths = self.offsets[rows + 1] - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return TokenizedTexts(self.input_ids[index], offsets, {key: v[index] for key, v in self.extras.items()})


_UNSET_MODEL_MAX_LENGTH = 10**9  # Hugging Face sets a huge sentinel (int(1e30)) when the limit is unknown


def check_tokenizer(tokenizer: Any) -> None:
    """Refuses what is not a tokenizer object (None, a model name) before any other check on it."""
    if isinstance(tokenizer, str):
        raise TypeError(
            f"tokenizer should be a tokenizer object, not a model name: load it first with "
            f"AutoTokenizer.from_pretrained({tokenizer!r}); but got tokenizer={tokenizer!r} of type str"
        )
    if not callable(tokenizer):
        raise bad_type("tokenizer", "a tokenizer object (e.g. AutoTokenizer.from_pretrained(...))", tokenizer)


def model_max_length(tokenizer: Any) -> int | None:
    """The tokenizer's ``model_max_length`` when it sets one; ``None`` when unset (Hugging Face's huge sentinel)."""
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < _UNSET_MODEL_MAX_LENGTH else None


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


def check_tokenizer_kwargs(tokenizer: Any, tokenizer_kwargs: dict[str, Any], caller: Callable[..., Any]) -> None:
    """A misspelt keyword (``batchsize=8``) of ``caller``'s ``**tokenizer_kwargs`` names itself (and the closest
    keyword of ``caller`` or of the tokenizer) instead of vanishing into the tokenizer call."""
    accepted = accepted_keywords(tokenizer)
    if accepted is None:
        return
    own = set(inspect.signature(caller).parameters) - {"tokenizer_kwargs"}
    for key, value in tokenizer_kwargs.items():
        if key in accepted:
            continue
        setting = getattr(type(tokenizer), key, None) if isinstance(key, str) else None
        if isinstance(setting, str) or (key in getattr(tokenizer, "__dict__", {}) and not callable(setting)):
            # a setting of the tokenizer object (truncation_side), which its call ignores silently
            # (transformers 5 drops the keyword): the tokenizer applies it where it is set
            hint = f" (set it on the tokenizer instead: tokenizer.{key} = {value!r})"
        else:  # the keywords dynabatch refuses are no hint
            hint = did_you_mean(key, (own | accepted) - set(FORBIDDEN_TOKENIZER_KWARGS))
        raise TypeError(
            f"{caller.__name__}() got an unexpected keyword argument {key!r}{hint}: extra keywords "
            f"go to the tokenizer, and {type(tokenizer).__name__} does not take it; "
            f"but got {key}={value!r}"
        )


def check_length_fits(tokenizer: Any, max_input_token_length: int, tokenizer_kwargs: dict[str, Any]) -> None:
    """``max_input_token_length`` leaves room for text after the special tokens; a limit above the tokenizer's
    ``model_max_length`` warns."""
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


CALL_PATH = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "encode", "encode_plus",
             "batch_encode_plus", "prepare_for_tokenization", "tokenize", "_convert_encoding",
             "set_truncation_and_padding", "_get_padding_truncation_strategies", "_switch_to_input_mode",
             "_switch_to_target_mode")
"""The methods that shape what a transformers tokenizer's call returns for a batch of texts (the call, the encode
methods, text preprocessing, truncation and padding set-up, the conversion of encodings): the backend rule
(:func:`fast_backend`) holds when each resolves to transformers' own generic implementation or is not defined."""

TOKENS_PER_CALL = 2**18
"""Tokens at the truncation limit that one tokenizer call of :func:`tokenize_texts` is sized for (by default)."""

PIECE_TOKENS = 2**16
"""Tokens at the truncation limit of a piece, at most, where this thread and worker processes share a call with the
default ``chunk_size`` (and four pieces a core, 16 texts at least): small enough that the first piece, timed, decides
early whether workers pay, and that the pieces balance."""

TRIM_TOKENS = 2**18
"""Tokens assembled between two trims of the C heap (:func:`~dynabatch._malloc.trim`, 1-6 ms with torch loaded, ~5%
of a 1,000-text call): the freed lists of a few pieces (a few tens of MB at most) wait for the next trim rather than
each piece paying one, and a call of fewer tokens leaves them to the allocations that follow."""

_BACKEND_KWARGS = frozenset({"add_special_tokens"})  # the tokenizer arguments the backend call applies itself


def fast_backend(tokenizer: Any, tokenizer_kwargs: dict[str, Any]) -> Any | None:
    """The tokenizer's Rust backend (a ``tokenizers.Tokenizer``) when encoding through it gives exactly what
    ``tokenizer(texts, truncation=True, max_length=..., padding=False, return_attention_mask=False,
    **tokenizer_kwargs)`` gives; ``None`` when that is not provable, and the tokenizer's own call is used.

    It is provable when ``tokenizer`` is a transformers ``TokenizersBackend`` (``PreTrainedTokenizerFast``)
    whose every method of :data:`CALL_PATH` is either not defined or resolves, through its class's MRO, to
    ``TokenizersBackend`` or ``PreTrainedTokenizerBase`` (none set on the instance), and ``tokenizer_kwargs`` holds
    no key but ``add_special_tokens``. The one place that reads transformers' tokenizer internals (by name, on the
    classes); if they cannot be read (another transformers version), the call is used.

    Example:
        >>> from transformers import AutoTokenizer
        >>> from dynabatch.demo import minilm_path
        >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
        >>> type(fast_backend(tokenizer, {})).__name__
        'Tokenizer'
        >>> class Lowered(type(tokenizer)):
        ...     def __call__(self, text, *args, **kwargs):
        ...         return super().__call__([t.lower() for t in text], *args, **kwargs)
        >>> tokenizer.__class__ = Lowered
        >>> fast_backend(tokenizer, {}) is None
        True
    """
    if set(tokenizer_kwargs) - _BACKEND_KWARGS:
        return None
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not issubclass(cls, TokenizersBackend):
        return None
    generic = (TokenizersBackend, PreTrainedTokenizerBase)
    on_instance = getattr(tokenizer, "__dict__", {})
    for name in CALL_PATH:
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if name in on_instance or (owner is not None and owner not in generic):
            return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def as_items(texts: Any) -> list:
    """``texts`` as a non-empty list (items not checked yet); ``TypeError`` / ``ValueError`` for what is not a sequence."""
    if isinstance(texts, list):
        items = texts
    elif isinstance(texts, tuple):
        items = list(texts)
    elif isinstance(texts, np.ndarray):
        if texts.ndim != 1:
            raise bad_type("texts", _TEXTS_RULE, texts)
        items = texts.tolist()
    elif "pandas" in sys.modules and isinstance(texts, sys.modules["pandas"].Series):
        items = texts.tolist()
    elif isinstance(texts, collections.abc.Sequence) and not isinstance(texts, (str, bytes, bytearray)):
        items = list(texts)
    elif isinstance(texts, collections.abc.Mapping):  # a dict of texts: say how to pass them, do not print them
        raise bad_type("texts", f"{_TEXTS_RULE}; of a mapping, pass its texts (e.g. list(texts.values()))", texts)
    elif hasattr(texts, "shape") and hasattr(texts, "columns"):  # a DataFrame: name it, do not print it
        raise TypeError(
            f"texts should be {_TEXTS_RULE}; pick one column (e.g. frame['text']), but got "
            f"texts=<{type(texts).__name__} of shape {tuple(texts.shape)}, columns {list(texts.columns)[:5]!r}>"
        )
    else:
        raise bad_type("texts", _TEXTS_RULE, texts)
    if not items:
        raise bad_value("texts", "a non-empty sequence of str", texts)
    return items


_SHOWN_BAD = 10  # bad positions an error message names


def split_bad_texts(texts: Any) -> tuple[list[str], np.ndarray]:
    """``(items, bad)``: the texts as a list of str with ``""`` in place of every item that is not a str
    (``None``, a pandas NaN, bytes, a number), and the ``int64`` positions of those items.

    Example:
        >>> items, bad = split_bad_texts(["a", None, "b", float("nan")])
        >>> items, bad.tolist()
        (['a', '', 'b', ''], [1, 3])
    """
    items = as_items(texts)
    types = set(map(type, items))
    if types == {str}:
        return items, np.zeros(0, dtype=np.int64)
    bad = np.fromiter((not isinstance(item, str) for item in items), dtype=bool, count=len(items))
    return [plain_text(item) for item in items], np.flatnonzero(bad)


def plain_text(item: Any) -> str:
    """``item`` as the tokenizer takes it: a str as it is, a str subclass (``numpy.str_``) as a plain str, and
    ``""`` for what is not a str (a bad input, planned into no batch)."""
    if type(item) is str:
        return item
    return str.__str__(item) if isinstance(item, str) else ""


def _positions(bad: np.ndarray) -> str:
    """The first :data:`_SHOWN_BAD` of the positions ``bad``, for a message."""
    return first_few(bad, _SHOWN_BAD)  # an array: only the first few become str


def log_skipped(skipped: np.ndarray, n: int, what: str) -> None:
    """Logs the positions of the ``skipped`` of ``n`` inputs (``what`` they are: ``"texts that are not str"``), whose
    results are None (``on_bad_input="skip"``)."""
    if skipped.size:
        logger.warning("skipping %d of %d %s (positions %s): their results are None", skipped.size, n, what,
                       _positions(skipped))


def bad_input_error(refusal: str, bad: np.ndarray, n: int, what: str, *, fix: str = "clean them",
                    error: type[Exception] = TypeError) -> Exception:
    """The refusal of the ``bad`` of ``n`` inputs under ``on_bad_input="raise"``: ``refusal`` (the first one's own),
    how many there are (``what`` they are: ``"texts are not str"``) and where, and what to do (``fix``, or skip them),
    as an ``error`` (a ``TypeError`` for items of another type, a ``ValueError`` for values)."""
    return error(f"{refusal}; {bad.size} of {n} {what} (positions {_positions(bad)}): {fix}, or pass "
                 "on_bad_input='skip' to skip them (their results are None)")


# what each text (or pre-tokenized row) must hold: a bad input otherwise, by on_bad_input
_NO_TOKEN_RULE = ("at least one token (a row of no token is padding alone: a mean pooling divides by zero, "
                  "generate continues nothing)")


def split_no_token(lengths: np.ndarray, on_bad_input: str, item: Callable[[int], Any], *, positions: Any = None,
                   skipped: Any = None, texts_name: str = "texts") -> np.ndarray:
    """The input positions of the rows of no token (``lengths[i] == 0``; row ``i`` is input ``positions[i]``, else
    ``i``; the ``skipped`` ones, bad already, left out): bad inputs, known only once tokenized. ``"raise"`` refuses
    them with a ``ValueError`` naming the first (``item(position)``: its input, as ``texts_name[position]``: the
    caller's argument that holds the inputs) and what to do; ``"skip"`` logs them, and the caller plans them into
    no batch.

    Example:
        >>> split_no_token(np.array([2, 0, 0, 3]), "skip", ["a", "", None, "b"].__getitem__, skipped=[2]).tolist()
        [1]
    """
    empty = np.flatnonzero(np.asarray(lengths) == 0)
    counted = texts_name
    if positions is not None:  # a chunk of the inputs (a stream's): sorted, and counted among the chunk's
        empty, counted = np.sort(np.asarray(positions, dtype=np.int64)[empty]), f"{texts_name} of its chunk"
    if skipped is not None and len(skipped):
        empty = np.setdiff1d(empty, skipped)
    n = len(lengths)
    if empty.size and on_bad_input == "raise":
        first = int(empty[0])
        refusal = bad_value(f"{texts_name}[{first}]", _NO_TOKEN_RULE, item(first))
        raise bad_input_error(f"{refusal}, of no token", empty, n, f"{counted} hold no token", error=ValueError,
                              fix="keep the tokenizer's special tokens (add_special_tokens=True, a BOS), or leave "
                              f"out or fill the empty {texts_name}")
    log_skipped(empty, n, f"{counted} that hold no token")
    return empty


def validate_texts(texts: Any) -> list[str]:
    """Checks that ``texts`` is a non-empty sequence of str and returns it as a list.

    Accepts a list or tuple, a pandas Series, a 1-D numpy array, or any other
    non-str :class:`collections.abc.Sequence` (a Hugging Face ``datasets``
    column is one). Empty strings and duplicates are valid texts.

    Raises:
        TypeError: ``texts`` is not such a sequence (a bare str, a generator,
            an int), or items of it are not str (the message names the first,
            how many there are and the positions of the first ten).
        ValueError: ``texts`` is empty.
    """
    items, bad = split_bad_texts(texts)
    if bad.size:
        raw = as_items(texts)
        first = int(bad[0])
        raise bad_input_error(bad_type(f"texts[{first}]", "a str", raw[first]), bad, len(raw), "texts are not str")
    return items


def _check_tokenizer_kwargs(tokenizer_kwargs: dict[str, Any]) -> None:
    for key, reason in FORBIDDEN_TOKENIZER_KWARGS.items():
        if key in tokenizer_kwargs:
            raise ValueError(
                f"tokenizer_kwargs should not set {key!r} ({reason}), "
                f"but got tokenizer_kwargs={brief(tokenizer_kwargs)}"  # a list of pairs is not printed whole
            )


_Flat = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]  # a piece's ids (int32), lengths (int64), extras


def _flatten(rows: Any, total: int) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=total)


def _call_rows(tokenizer: Callable[..., Any], chunk: list[str], max_length: int,
               tokenizer_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The chunk through the tokenizer's own call: its ``input_ids`` rows, and every other output with one row per
    text (what may be per token; :func:`_flat_rows` keeps those whose lengths match)."""
    encoded = tokenizer(chunk, truncation=True, max_length=max_length, padding=False, return_attention_mask=False,
                        **tokenizer_kwargs)
    if not isinstance(encoded, collections.abc.Mapping):
        raise TypeError(
            "type(tokenizer(texts)) should be a mapping with 'input_ids', "
            f"but got type(tokenizer(texts))={type(encoded)!r}"
        )
    if "input_ids" not in encoded:
        raise bad_value("tokenizer(texts).keys()", "a collection including 'input_ids'", sorted(encoded.keys()))
    rows = encoded["input_ids"]
    if len(rows) != len(chunk):
        raise bad_value("len(tokenizer(texts)['input_ids'])", f"{len(chunk)}, one row per text", len(rows))
    others = {key: values for key, values in encoded.items()
              if key not in _SKIPPED_KEYS and isinstance(values, collections.abc.Sequence)}
    return rows, others


def _flat_rows(rows: Any, others: dict[str, Any], n: int) -> _Flat:
    """Rows of ids (and other outputs) as flat arrays; an other output is kept when it has one value per token."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    total = int(lengths.sum())
    extras = {}
    for key, values in others.items():
        try:
            if len(values) != n or sum(map(len, values)) != total:
                continue
        except TypeError:  # one value per text, not per token
            continue
        extras[key] = _flatten(values, total)
    return _flatten(rows, total), lengths, extras


def _constant_type_id(backend: Any) -> int | None:
    """The one type id the backend gives every token of a single text, when its post-processor fixes it (none: 0; a
    template whose single-text pieces share one type id); ``None`` when each encoding's must be read."""
    processor = backend.post_processor
    if processor is None:
        return 0
    try:
        state = json.loads(processor.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    if state.get("type") != "TemplateProcessing":
        return None
    type_ids = {piece["type_id"] for entry in state.get("single", []) for piece in entry.values()}
    return type_ids.pop() if len(type_ids) == 1 else None


def _backend(tokenizer: Any, max_length: int) -> tuple[Any, int | None]:
    """The fast tokenizer's backend, set up as the tokenizer's call sets it up (see :func:`fast_backend`): truncation
    (longest first, no stride, the tokenizer's side), no padding, its ``split_special_tokens``; and the one type id
    its tokens get, when fixed (:func:`_constant_type_id`)."""
    backend = tokenizer.backend_tokenizer
    backend.no_padding()
    backend.enable_truncation(max_length, stride=0, strategy="longest_first", direction=tokenizer.truncation_side)
    backend.encode_special_tokens = bool(tokenizer.split_special_tokens)
    return backend, _constant_type_id(backend)


def _batch_encoder(backend: Any) -> Callable[..., list[Any]]:
    """The backend's batch encode that skips the character offsets (``encode_batch_fast``, ~10% less CPU on
    all-MiniLM-L6-v2's WordPiece): the same ids and type ids, and the loader reads nothing else; ``encode_batch``
    where the installed ``tokenizers`` lacks it."""
    return getattr(backend, "encode_batch_fast", backend.encode_batch)


@dataclass(frozen=True)
class _Encoder:
    """What encodes a piece of texts anywhere (this process or a worker's): the tokenizer and its arguments."""

    tokenizer: Any
    max_length: int
    tokenizer_kwargs: dict[str, Any]
    backend: bool  # the fast backend provably gives the tokenizer's rows (fast_backend)

    def encode(self, chunk: list[str]) -> _Flat:
        """The chunk's flat arrays, on this thread alone (a backend's ``encode`` per text: no thread pool)."""
        if not self.backend:
            return _flat_rows(*_call_rows(self.tokenizer, chunk, self.max_length, self.tokenizer_kwargs), len(chunk))
        backend, type_id = _backend(self.tokenizer, self.max_length)
        if tokenizers_parallelism() is False:  # one call, and the backend runs it on this thread
            encodings = _batch_encoder(backend)(chunk, add_special_tokens=self.special_tokens)
        else:
            encodings = [backend.encode(text, add_special_tokens=self.special_tokens) for text in chunk]
        return self.flatten(encodings, type_id)

    @property
    def special_tokens(self) -> bool:
        return self.tokenizer_kwargs.get("add_special_tokens", True)

    def flatten(self, encodings: list[Any], type_id: int | None) -> _Flat:
        """The backend's encodings as flat arrays: ids, and ``token_type_ids`` when among the tokenizer's
        ``model_input_names`` (``type_id`` for every token when not ``None``)."""
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        total = int(lengths.sum())
        extras = {}
        if "token_type_ids" in self.tokenizer.model_input_names:
            extras["token_type_ids"] = (np.full(total, type_id, dtype=np.int32) if type_id is not None
                                        else _flatten((e.type_ids for e in encodings), total))
        return _flatten((e.ids for e in encodings), total), lengths, extras


def _encode_in_worker(encoder: _Encoder, chunk: list[str]) -> _Flat:
    return encoder.encode(chunk)


class ParallelTokenizer:
    """Tokenizes lists of texts into :class:`TokenizedTexts` on every core, each text exactly as one thread would.

    Args:
        tokenizer: the tokenizer (see :func:`tokenize_texts`).
        max_input_token_length: the truncation limit, in tokens.
        tokenizer_kwargs: passed to every tokenizer call; the arguments the loader owns are refused.
        cores: cores to use at most; ``None``: every core this process may use
            (:func:`~dynabatch.data.workers.available_cores`).
        chunk_size: texts per tokenizer call, see :func:`tokenize_texts`.
        texts_name: what an error calls the texts (see :func:`tokenize_texts`).

    Each call picks its mechanism (:func:`~dynabatch.data.workers.choose_mechanism`):
    the backend's own threads where the backend rule holds, or a thread of ours
    per core calling the backend where ``TOKENIZERS_PARALLELISM`` keeps its
    threads off; else this thread, joined by the process's worker processes
    where the cost rule says they pay (:class:`~dynabatch.data.workers.Pieces`:
    pieces of :data:`PIECE_TOKENS` tokens at the limit, so the first one, timed,
    decides early). The mechanism never changes a token id: the backend's
    one-thread and batch encodings are the same function per text, and a worker
    runs the same call on an unpickled copy of the tokenizer.
    """

    def __init__(self, tokenizer: Any, max_input_token_length: int, tokenizer_kwargs: dict[str, Any], *,
                 cores: int | None = None, chunk_size: int | None = None, texts_name: str = "texts") -> None:
        self.texts_name = texts_name
        self.max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
        _check_tokenizer_kwargs(tokenizer_kwargs)
        self._default_size = chunk_size is None  # a size given is each call's; the default one is cut finer to share
        if chunk_size is None:
            chunk_size = min(8192, max(64, TOKENS_PER_CALL // max_input_token_length))
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.cores = available_cores(cores)
        self._encoder = _Encoder(tokenizer, self.max_input_token_length, dict(tokenizer_kwargs),
                                 fast_backend(tokenizer, tokenizer_kwargs) is not None)
        self._workers_allowed = True  # False once workers failed or lost for this tokenizer (cannot be pickled, ...)
        self.mechanisms: collections.Counter = collections.Counter()  # calls per mechanism, for logs and tests

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cores={self.cores}, backend={self._encoder.backend})"

    def __call__(self, items: list[str], *, progress: bool = False, later: float = 0.0,
                 positions: Any = None, stop: threading.Event | None = None) -> TokenizedTexts:
        """The token store of ``items`` (a list of str, already validated); ``later``: the work of the calls still
        to come for the same job (a stream's later chunks), as a multiple of this call's, which the cost rule of
        worker processes weighs with this call's rest (:class:`~dynabatch.data.workers.Pieces`); ``positions``: the
        input position of each item (a stream's chunk), which an error names (``None``: the items' own); ``stop``:
        an event watched between pieces (a stream's tokenizing thread, paused), so a stop waits for one piece.

        Raises:
            ValueError: a text holds a lone surrogate (:func:`check_encodable`), where the tokenizer failed on it; a
                row is longer than ``max_input_token_length`` (the tokenizer's call ignored ``max_length``).
            StopRequested: ``stop`` was set before the last piece (nothing is kept of the call).
        """
        try:
            tokens = self._tokenized(items, progress=progress, later=later, stop=stop)
        except Exception as exc:
            # A fast tokenizer refuses a text that is not valid Unicode with a TypeError naming neither the text nor
            # its position; checking every text up front would cost a copy of the corpus: only a failed call looks
            check_encodable(items, positions, exc, texts_name=self.texts_name)
            raise
        self._check_truncated(tokens, positions)
        return tokens

    def _check_truncated(self, tokens: TokenizedTexts, positions: Any) -> None:
        """Refuses rows longer than the limit, naming the first by its input position: a callable whose call ignores
        ``truncation``/``max_length``, or a limit below the special tokens a tokenizer adds (which it keeps), was
        otherwise refused by the planner, as ``lengths`` that name no text."""
        longer = tokens.lengths > self.max_input_token_length
        if not longer.any():
            return
        first = int(np.argmax(longer))
        where = first if positions is None else int(positions[first])
        limit = self.max_input_token_length
        raise bad_value(f"len(tokenizer({self.texts_name}[{where}])['input_ids'])",
                        f"at most max_input_token_length={limit} (the tokenizer is called with truncation=True, "
                        f"max_length={limit}: make its call honour them, and pass a limit above the special tokens it "
                        "adds)", int(tokens.lengths[first]))

    def _tokenized(self, items: list[str], *, progress: bool, later: float,
                   stop: threading.Event | None) -> TokenizedTexts:
        mechanism = choose_mechanism(backend=self._encoder.backend, cores=self.cores)
        if mechanism == "shared" and not self._workers_allowed:
            mechanism = "one"  # no worker joins this tokenizer's calls (they failed or lost): whole chunks
        size = self.chunk_size
        if mechanism in ("shared", "parallel calls") and self._default_size:
            # pieces the cores share out: of PIECE_TOKENS, four a core, 16 texts at least
            size = min(size, max(16, min(PIECE_TOKENS // self.max_input_token_length,
                                         -(-len(items) // (4 * self.cores)))))
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        pieces = None
        if mechanism in ("threads", "parallel calls"):
            encode_flat = self._backend_encoder()
            flats: Any = (map(encode_flat, chunks) if mechanism == "threads"
                          else ordered_map(encode_flat, chunks, threads=self.cores, name="dynabatch-tokenize-calls"))
        elif mechanism == "shared":
            flats = pieces = Pieces(_encode_in_worker, self._encoder, chunks, cores=self.cores, later=later,
                                    alone_size=self.chunk_size)
        else:
            flats = (self._encoder.encode(chunk) for chunk in chunks)
        with progress_bar(progress, total=len(items), desc="tokenizing", unit="text") as bar:
            tokens = _assemble(_shown(flats, bar, stop), len(items))
        if pieces is not None:
            self._workers_allowed = not (pieces.unpicklable or pieces.failed or pieces.lost)
            mechanism = "processes" if pieces.used_workers else "one"
        self.mechanisms[mechanism] += 1
        logger.debug("tokenized %d texts into %d tokens (max_input_token_length=%d, extras=%s, %s, %s)", len(items),
                     len(tokens.input_ids), self.max_input_token_length, sorted(tokens.extras),
                     "the fast backend" if self._encoder.backend else "the tokenizer's call", mechanism)
        return tokens

    def _backend_encoder(self) -> Callable[[list[str]], _Flat]:
        """A chunk's flat arrays from one batch call of the backend, set up here first: its setters take the
        backend whole, so none may run while another thread's call encodes. With ``TOKENIZERS_PARALLELISM`` on, the
        call runs on the backend's thread pool (forks guarded); off, on the calling thread."""
        if tokenizers_parallelism() is not False:
            guard_forks()
        backend, type_id = _backend(self._encoder.tokenizer, self.max_input_token_length)
        encode, special = _batch_encoder(backend), self._encoder.special_tokens
        return lambda chunk: self._encoder.flatten(encode(chunk, add_special_tokens=special), type_id)

    def close(self) -> None:
        """Kept for callers that end their tokenizer: the worker processes are the process's, shared by every
        tokenizer (:func:`~dynabatch.data.workers.release_pool` ends them)."""


def check_encodable(items: list[str], positions: Any, cause: BaseException,
                    refused_by: str = "the tokenizer", *, texts_name: str = "texts") -> None:
    """Raises a ``ValueError`` from ``cause`` naming the first text that does not encode as UTF-8 (a lone surrogate,
    e.g. from bytes decoded with ``errors="surrogateescape"``), by its input position (``positions[i]`` of item
    ``i``, else ``i``) in the caller's argument ``texts_name``; returns where every text encodes (``cause`` is
    ``refused_by``'s own error)."""
    for i, text in enumerate(items):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = i if positions is None else int(positions[i])
            raise ValueError(
                f"{texts_name}[{where}] should be text that encodes as UTF-8, but got {texts_name}[{where}]="
                f"{text[:40]!r} holding "
                f"{exc.reason} at character {exc.start}, which {refused_by} refused ({type(cause).__name__}: "
                f"{cause}): clean it (e.g. text.encode('utf-8', 'replace').decode())"
            ) from cause


def _shown(flats: Any, bar: Any, stop: threading.Event | None = None) -> Iterator[Any]:
    """``flats`` as they come, each counted on the progress ``bar`` by its texts (``None``: no bar); raises
    :class:`~dynabatch._background.StopRequested` before the next piece once ``stop`` is set (every mechanism's
    pieces pass here, so a stop waits for the piece in progress, not the call)."""
    flats = iter(flats)
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested("stopped part-way through a tokenizer call, at the caller's request")
        flat = next(flats, None)
        if flat is None:
            return
        yield flat
        if bar is not None:
            bar.update(len(flat[1]))


def _assemble(flats: Any, n: int) -> TokenizedTexts:
    """One store from the pieces' flat arrays, in order; an extra is kept when every piece has it."""
    id_chunks: list[np.ndarray] = []
    length_chunks: list[np.ndarray] = []
    extra_chunks: dict[str, list[np.ndarray]] | None = None
    since_trim = 0  # tokens assembled since the heap was last trimmed
    for ids, lengths, extras in flats:
        id_chunks.append(ids)
        length_chunks.append(lengths)
        if extra_chunks is None:
            extra_chunks = {key: [values] for key, values in extras.items()}
        else:
            for key in list(extra_chunks):
                if key in extras:
                    extra_chunks[key].append(extras[key])
                else:
                    del extra_chunks[key]
        since_trim += len(ids)
        if since_trim >= TRIM_TOKENS:  # the pieces' lists are freed: their heap goes back, memory grows with the store
            trim()
            since_trim = 0
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.concatenate(length_chunks), out=offsets[1:])
    input_ids = id_chunks[0] if len(id_chunks) == 1 else np.concatenate(id_chunks)
    extras = {key: values[0] if len(values) == 1 else np.concatenate(values)
              for key, values in (extra_chunks or {}).items()}
    del id_chunks, length_chunks, extra_chunks
    if len(input_ids) >= TRIM_TOKENS:  # a smaller call's freed lists are few, and the next allocations reuse them
        trim()
    return TokenizedTexts(input_ids=input_ids, offsets=offsets, extras=extras)


def tokenize_texts(
    texts: Any,
    tokenizer: Callable[..., Any],
    max_input_token_length: int,
    *,
    chunk_size: int | None = None,
    progress: bool = True,
    tokenize_cores: int | None = None,
    texts_name: str = "texts",
    **tokenizer_kwargs: Any,
) -> TokenizedTexts:
    """Tokenizes every text once, truncated to ``max_input_token_length`` tokens, on every core.

    The tokenizer is called once per chunk of ``chunk_size`` texts as
    ``tokenizer(chunk, truncation=True, max_length=max_input_token_length,
    padding=False, return_attention_mask=False, **tokenizer_kwargs)``, so
    special tokens are counted unless ``add_special_tokens=False`` is passed;
    or, where the module's backend rule proves it gives the same
    (:func:`fast_backend`), through the fast tokenizer's Rust backend. The
    chunks run on up to ``tokenize_cores`` cores (:class:`ParallelTokenizer`);
    the ids are those of one thread.

    Args:
        texts: the texts, see :func:`validate_texts`.
        tokenizer: a Hugging Face tokenizer, or any callable that takes a list
            of str and returns a mapping whose ``"input_ids"`` holds one list
            of ids per text, of at most ``max_length`` ids.
        max_input_token_length: the truncation limit, in tokens.
        chunk_size: texts per tokenizer call; ``None``: as many as hold
            :data:`TOKENS_PER_CALL` tokens at the limit (64 to 8,192 texts).
            A call's encodings take about 100 bytes a token until they are
            flattened into the store (222 MB for 8,192 texts of 170 tokens),
            so a bounded call keeps that transient small.
        progress: show a tqdm progress bar over the chunks.
        tokenize_cores: cores to tokenize on, at most; ``None``: every core
            this process may use (``len(os.sched_getaffinity(0))``, fewer under a
            cgroup CPU quota); ``1``: this thread alone (see :mod:`dynabatch.data.workers`).
        texts_name: what an error calls ``texts`` (the caller's own argument
            holding them: ``dynabatch.generate``'s ``"prompts"``).
        **tokenizer_kwargs: passed to every tokenizer call, and to be applied
            the same way when batches are built; the arguments the loader owns
            (:data:`FORBIDDEN_TOKENIZER_KWARGS`) are refused.

    Returns:
        The token store; extra per-token outputs such as ``token_type_ids``
        are kept in :attr:`TokenizedTexts.extras`.

    Raises:
        TypeError: bad ``texts``, a non-callable ``tokenizer``, or a tokenizer
            that does not return a mapping with ``"input_ids"``.
        ValueError: empty ``texts``, a non-positive limit, chunk size or core
            count, a refused key in ``tokenizer_kwargs``, or a row longer than
            the limit (a tokenizer call that does not truncate).
    """
    items = validate_texts(texts)
    if not callable(tokenizer):
        raise bad_type(
            "tokenizer",
            "a callable tokenizer (e.g. a Hugging Face PreTrainedTokenizerBase) returning a mapping with 'input_ids'",
            tokenizer,
        )
    tokenize = ParallelTokenizer(tokenizer, max_input_token_length, tokenizer_kwargs, cores=tokenize_cores,
                                 chunk_size=chunk_size, texts_name=texts_name)
    return tokenize(items, progress=progress)

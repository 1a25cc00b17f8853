"""Argument checks shared by every public entry point.

Every message follows one template, ``"{name} should be {rule}, but got
{name}={value!r}"``, so that a user sees the argument, the rule and the value.
Wrong types raise :class:`TypeError`, wrong values :class:`ValueError`. A value
whose repr is long (a dict of texts, a model) is shown by :func:`brief`: its
type, its size and the start of its repr.
"""

from __future__ import annotations

import difflib
import math
import numbers
import reprlib
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "bad_type",
    "bad_value",
    "brief",
    "brief_error",
    "check_bool",
    "check_fraction",
    "check_lengths",
    "check_non_negative_int",
    "check_positive_int",
    "check_positive_number",
    "did_you_mean",
    "first_few",
]


_LONG_REPR = 1000  # characters: a longer (or multi-line) repr is shown by brief()
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 40, 40
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = 3


def brief(value: Any) -> str:
    """``repr(value)``, or for a long or multi-line one its type, size and start.

    Example:
        >>> brief([1, 2, 3])
        '[1, 2, 3]'
        >>> brief("word " * 1000)
        "<str of 5000 characters: 'word word word wo...rd word word word '>"
        >>> brief(list(range(10**6)))
        '<list of 1000000 items: [0, 1, 2, ...]>'
    """
    sized = isinstance(value, (str, bytes, list, tuple, dict, set, frozenset))
    if not (sized and len(value) > _LONG_REPR):  # a huge container's repr is not even built
        text = repr(value)
        if len(text) <= _LONG_REPR and "\n" not in text:
            return text
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple):
        size = f" of shape {tuple(int(n) for n in shape)}"
    else:
        try:
            count = len(value)
            unit = "characters" if isinstance(value, (str, bytes)) else "item" if count == 1 else "items"
            size = f" of {count} {unit}"
        except TypeError:
            size = ""
    start = " ".join(_SHORT.repr(value).split()) if sized else ""
    return f"<{type(value).__name__}{size}{': ' + start if start else ''}>"


def brief_error(error: BaseException | None) -> str:
    r"""An error in one line for a log or a cause: its type and the first line of its message (200 characters).

    Example:
        >>> from dynabatch._validation import brief_error
        >>> brief_error(ValueError("bad row\nmore"))
        'ValueError: bad row'
    """
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else type(error).__name__
    return f"{type(error).__name__}: {text[:200]}"


def first_few(values, n: int = 5) -> str:
    """The first ``n`` of ``values`` for a message, ``", ..."`` after them when there are more.

    Example:
        >>> from dynabatch._validation import first_few
        >>> first_few([3, 1, 4, 1, 5, 9]), first_few(["a"])
        ('3, 1, 4, 1, 5, ...', 'a')
    """
    return ", ".join(map(str, values[:n])) + (", ..." if len(values) > n else "")


def did_you_mean(name: Any, names: Iterable[str]) -> str:
    """For a message on a misspelt ``name``: ``" (did you mean 'x'?)"`` with the closest of ``names``, else ``""``.

    Example:
        >>> from dynabatch._validation import did_you_mean
        >>> did_you_mean("batchsize", ["batch_size", "device"]), did_you_mean("zzz", ["batch_size"])
        (" (did you mean 'batch_size'?)", '')
    """
    close = difflib.get_close_matches(name, sorted(names), n=1) if isinstance(name, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _got(name: str, value: Any) -> str:
    return f"{name}={brief(value)}"


def bad_value(name: str, rule: str, value: Any, error: type[ValueError] = ValueError) -> ValueError:
    """Builds the ValueError (or ``error``, a subclass a caller can catch by itself) for ``name`` breaking ``rule``."""
    return error(f"{name} should be {rule}, but got {_got(name, value)}")


def bad_type(name: str, rule: str, value: Any) -> TypeError:
    """Builds the TypeError for ``name`` breaking ``rule``; the type is named."""
    return TypeError(
        f"{name} should be {rule}, but got {_got(name, value)} of type {type(value).__name__}"
    )


def check_bool(name: str, value: Any) -> bool:
    """Returns ``value`` if it is a bool (``1``, ``"yes"`` or ``None`` are refused: a flag is said as itself)."""
    if not isinstance(value, bool):
        raise bad_type(name, "a bool", value)
    return value


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Refuses ``value`` unless it is one of the strings ``choices``."""
    if not isinstance(value, str):
        raise bad_type(name, f"one of {choices}", value)
    if value not in choices:
        raise bad_value(name, f"one of {choices}", value)


def _check_int(name: str, value: Any, rule: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise bad_type(name, rule, value)
    if value < minimum:
        raise bad_value(name, rule, value)
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """Returns ``value`` if it is an int >= 1 (bool is refused)."""
    return _check_int(name, value, "a positive integer", 1)


def check_non_negative_int(name: str, value: Any) -> int:
    """Returns ``value`` if it is an int >= 0 (bool is refused)."""
    return _check_int(name, value, "a non-negative integer", 0)


def check_positive_number(name: str, value: Any, *, finite: bool = False, rule: str | None = None) -> float:
    """Returns ``value`` as float if it is a real number > 0 (bool is refused), and not infinite with ``finite``
    (a number of bytes); ``rule``: what the message says it should be, where the caller says it otherwise."""
    rule = rule or ("a finite positive number" if finite else "a positive number")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_type(name, rule, value)
    if not (value > 0 and (not finite or math.isfinite(value))):  # also refuses NaN
        raise bad_value(name, rule, value)
    return float(value)


def check_fraction(name: str, value: Any) -> float:
    """Returns ``value`` as float if it is a real number in [0, 1]."""
    rule = "a number in [0, 1]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_type(name, rule, value)
    if not 0.0 <= value <= 1.0:  # also refuses NaN
        raise bad_value(name, rule, value)
    return float(value)


def check_lengths(name: str, value: Any, *, fields: bool = False, positive: bool = False,
                  what: str = "token lengths", longest_first: bool = False) -> np.ndarray:
    """The one check of token lengths: ``value`` as an int64 array, 1-D (or ``(n, k)`` key fields with ``fields``).

    Lists, tuples, numpy arrays and tensors are taken (``what`` names the
    values in the message, for integer ids checked the same way). A value that is not a
    sequence of integers raises ``TypeError``; a wrong shape or a negative
    (with ``positive``, a non-positive) length raises ``ValueError`` naming the
    first bad element. With ``longest_first`` the lengths must be sorted longest
    first (what every planner over sorted lengths takes); the first row longer
    than the one before it is named.

    Example:
        >>> check_lengths("lengths", [3, 0, 5]).tolist()
        [3, 0, 5]
        >>> check_lengths("lengths", [3, -1])
        Traceback (most recent call last):
        ...
        ValueError: lengths[1] should be a non-negative length, but got lengths[1]=-1
    """
    shape_rule = "1-D or 2-D (one column per key field)" if fields else "1-D"
    rule = f"a {shape_rule} sequence of integer {what}"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise bad_type(name, rule, value)
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged rows (key fields of unequal counts): numpy's message names no argument
        raise bad_value(name, f"{rule}, every row with as many fields", value) from None
    if arr.size == 0:
        width = arr.shape[1] if fields and arr.ndim == 2 else None
        return np.zeros((0, width) if width else 0, dtype=np.int64)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise bad_type(name, rule, value if arr.size <= 8 else f"<array of dtype {arr.dtype}>")
    if arr.ndim not in ((1, 2) if fields else (1,)) or (arr.ndim == 2 and arr.shape[1] == 0):
        raise bad_value(name, rule, f"<array of shape {arr.shape}>")
    low = 1 if positive else 0
    if arr.min() < low:
        at = np.unravel_index(int(np.argmin(arr)), arr.shape)
        where = f"{name}[{', '.join(str(int(i)) for i in at)}]"
        noun = "length" if what == "token lengths" else what.rstrip("s")
        raise bad_value(where, f"a positive {noun}" if positive else f"a non-negative {noun}", int(arr[at]))
    if longest_first and arr.ndim == 1 and arr.size > 1:
        rises = np.flatnonzero(arr[1:] > arr[:-1])
        if rises.size:
            i = int(rises[0])
            raise bad_value(f"{name}[{i + 1}]", f"at most {name}[{i}]={int(arr[i])} (sorted longest first)",
                            int(arr[i + 1]))
    return arr.astype(np.int64, copy=False)

"""The one fingerprint: a short, process-independent digest of data and settings.

A sampler's saved state, a results file and a plan are identified by what they
were made from: arrays of lengths and positions, numbers, strings, and the
settings objects (constraints, budgets) of the library or of its users. The
digest must be the same in every process that holds the same data, so it
never reads a ``repr`` that may carry a memory address:

* arrays and tensors: their dtype, shape and bytes;
* ``None``, bools, integers, floats and strings: a tagged canonical text;
* lists, tuples and dicts: their items (dict keys sorted by their text);
* an object with a ``key()`` method (every dynabatch constraint and budget):
  what ``key()`` returns; so a user's constraint may say what identifies it;
* any other object: its class's module and qualified name and, recursively, the
  attributes in its ``__dict__`` (a plain settings object is identified by its
  settings, two instances with equal settings alike); a function or class by
  its module and qualified name (and a function's own attributes). Attributes
  whose names start with ``_`` (caches, internals) are left out.

Example:
    >>> import numpy as np
    >>> fingerprint(np.arange(3), "x") == fingerprint(np.arange(3), "x")
    True
    >>> fingerprint(np.arange(3)) == fingerprint(np.arange(3, dtype=np.int32))
    False
    >>> class Rule:  # a user's constraint without key(): its settings identify it
    ...     def __init__(self, limit):
    ...         self.limit = limit
    >>> fingerprint(Rule(4)) == fingerprint(Rule(4)) != fingerprint(Rule(5))
    True
"""

from __future__ import annotations

import hashlib
import math
import numbers
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["fingerprint"]

_DEPTH = 8  # objects nested deeper are identified by their class only


def _update(digest: Any, part: Any, depth: int) -> None:
    if isinstance(part, np.ndarray) or type(part).__module__.startswith("torch") and hasattr(part, "numpy"):
        array = np.ascontiguousarray(part.detach().cpu().numpy() if not isinstance(part, np.ndarray) else part)
        digest.update(f"a{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    elif part is None or isinstance(part, (bool, np.bool_)):
        digest.update(f"b{part!s}".encode())
    elif isinstance(part, numbers.Integral):
        digest.update(f"i{int(part)}".encode())
    elif isinstance(part, numbers.Real):
        value = float(part)
        digest.update(f"f{value.hex() if math.isfinite(value) else value}".encode())
    elif isinstance(part, (str, bytes)):
        data = part.encode() if isinstance(part, str) else part
        digest.update(f"s{len(data)}:".encode())
        digest.update(data)
    elif isinstance(part, (list, tuple)):
        digest.update(f"l{len(part)}".encode())
        for item in part:
            _update(digest, item, depth + 1)
    elif isinstance(part, Mapping):
        items = sorted(part.items(), key=lambda kv: str(kv[0]))
        digest.update(f"d{len(items)}".encode())
        for k, v in items:
            _update(digest, str(k), depth + 1)
            _update(digest, v, depth + 1)
    else:
        cls = type(part)
        name = f"{getattr(part, '__module__', cls.__module__)}.{getattr(part, '__qualname__', cls.__qualname__)}"
        digest.update(f"o{name}".encode())
        key = None if isinstance(part, type) else getattr(part, "key", None)
        if callable(key) and not isinstance(part, types.FunctionType):
            _update(digest, key(), depth + 1)
        elif depth < _DEPTH and not isinstance(part, type) and hasattr(part, "__dict__"):
            _update(digest, {k: v for k, v in vars(part).items() if not k.startswith("_")}, depth + 1)
    digest.update(b"\x00")


def fingerprint(*parts: Any) -> str:
    """A 16-hex-digit sha256 digest of ``parts`` (see the module docs for what each kind contributes)."""
    digest = hashlib.sha256()
    for part in parts:
        _update(digest, part, 0)
    return digest.hexdigest()[:16]

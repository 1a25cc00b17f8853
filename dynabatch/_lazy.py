"""Names a module exports but imports only on first use (numba, ``transformers.Trainer``: seconds to import)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(module: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``where[name]`` and returns its ``name`` on first use.

    Example:
        >>> __getattr__ = lazy_attributes("mine", {"sqrt": "math"})
        >>> __getattr__("sqrt")(9.0)
        3.0
    """

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__

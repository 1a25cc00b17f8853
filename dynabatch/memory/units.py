"""The one unit of memory: bytes inside, and the one parser of memory sizes.

Every memory size dynabatch takes is parsed here, by :func:`parse_memory`, and
every argument or figure in other units converts through this module's
constants, so ``"GB"`` means the same number of bytes everywhere:

* ``B``, ``KB``, ``MB``, ``GB``, ``TB``: powers of 1000 (as accelerate parses them);
* ``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024;
* ``"80%"``: a percentage of a device's free memory, read through
  :func:`dynabatch.memory.device.free_bytes` where the device has memory of its own
  (:func:`dynabatch.memory.device.knows_memory`: an accelerator, or a simulated CPU device).

An argument named ``*_mb`` (the multi-task system's ``max_memory_mb``,
``record_actual_memory``'s ``actual_memory_mb``, the monitor's
``memory_allocated_mb``) is in :data:`MB`, 10**6 bytes: that system documents
``max_memory_mb = 30000`` as a "30GB GPU memory limit". A figure named ``*_gb``
is in :data:`GB`. :data:`MIB` and :data:`GIB` are for what dynabatch prints in
binary units (a probe's ``12.5 MiB``).

Example:
    >>> parse_memory("12GB"), parse_memory("512 MiB"), parse_memory(1e9)
    (12000000000.0, 536870912.0, 1000000000.0)
    >>> 30000 * MB == 30 * GB
    True
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from dynabatch._validation import bad_type, bad_value

__all__ = ["GB", "GIB", "KIB", "MB", "MIB", "check_max_memory", "check_percentage", "parse_memory", "split_memory"]

MB = 10.0**6
"""A megabyte, as parsed from ``"MB"`` and meant by every ``*_mb`` argument: 10**6 bytes."""
GB = 10.0**9
"""A gigabyte, as parsed from ``"GB"`` and meant by every ``*_gb`` value: 10**9 bytes."""
KIB = float(2**10)
"""A kibibyte, ``"KiB"``: 2**10 bytes."""
MIB = float(2**20)
"""A mebibyte, ``"MiB"``: 2**20 bytes."""
GIB = float(2**30)
"""A gibibyte, ``"GiB"``: 2**30 bytes."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
_MEMORY_RULE = ("a number of bytes > 0, a size such as '12GB' or '512MiB', or a percentage such as '80%' "
                "(of a device's free memory)")
_MAX_MEMORY_RULE = ("None (the relative rule), 'auto', a number of bytes > 0, a size such as '20GB', or a "
                    "percentage such as '90%' of the device's free memory")


def check_percentage(name: str, value: str, number: float) -> None:
    """Refuses a percentage outside (0%, 100%]: a share of free memory over 1 cannot be allocated."""
    if not 0 < number <= 100:
        raise bad_value(name, "a percentage in (0%, 100%] of the device's free memory", value)


def _percent_of_free(name: str, value: str, number: float, device: Any, of: float | None) -> float:
    from dynabatch.memory.device import default_accelerator, free_bytes, knows_memory

    check_percentage(name, value, number)
    on = (default_accelerator() or ("cpu" if knows_memory("cpu") else None)) if device is None else device
    if of is None and (on is None or not knows_memory(on)):
        where = "cpu" if on is None else str(on)
        raise bad_value(name, f"bytes or a size such as '20GB' on {where} (no device memory is known there: a "
                        "percentage is a share of a device's free memory)", value)
    return (free_bytes(on) if of is None else of) * number / 100


def split_memory(value: Any, name: str = "max_memory") -> tuple[float, str]:
    """``(number, unit)`` of a memory size, its syntax checked but a percentage not resolved (``unit`` ``"%"``,
    else ``"B"`` with the number in bytes): what can be refused before any device is asked.

    Example:
        >>> split_memory("90%"), split_memory("2KiB"), split_memory(10)
        ((90.0, '%'), (2048.0, 'B'), (10.0, 'B'))
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise bad_type(name, _MEMORY_RULE, value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).upper() if match else None
        if match is None or (unit != "%" and unit not in _UNITS):
            raise bad_value(name, _MEMORY_RULE, value)
        number = float(match.group(1))
        if unit == "%":
            check_percentage(name, value, number)
            return number, "%"
        nbytes = number * _UNITS[unit]
    else:
        nbytes = float(value)
    if not (nbytes > 0 and math.isfinite(nbytes)):
        raise bad_value(name, _MEMORY_RULE, value)
    return float(nbytes), "B"


def parse_memory(value: Any, name: str = "max_memory", *, device: Any = None, of: float | None = None) -> float | None:
    """A memory size in bytes: the one parser of every memory size dynabatch takes.

    Args:
        value: ``None``; a number of bytes > 0; a string of a number and a unit
            (``B``, ``KB``/``MB``/``GB``/``TB`` in powers of 1000,
            ``KiB``/``MiB``/``GiB``/``TiB`` in powers of 1024, any case); or a
            percentage in (0, 100] of a device's free memory
            (:func:`~dynabatch.memory.device.free_bytes`), refused on a device
            without memory of its own (the CPU, unless simulated).
        name: the argument's name, for error messages.
        device: the device of a percentage (default: the first accelerator).
        of: the bytes a percentage is of (default: the accelerator's free
            memory now; a training limit adds what its model already holds).

    Raises:
        TypeError: not a number or str.
        ValueError: not positive, an unknown unit, a percentage outside (0, 100]
            or on a device whose memory is not known.

    Example:
        >>> parse_memory("12XB")
        Traceback (most recent call last):
        ...
        ValueError: max_memory should be a number of bytes > 0, a size such as '12GB' or '512MiB', or a percentage such as '80%' (of a device's free memory), but got max_memory='12XB'
    """
    if value is None:
        return None
    number, unit = split_memory(value, name)
    if unit == "%":
        number = _percent_of_free(name, value, number, device, of)
        if not number > 0:
            raise bad_value(name, f"a share of free memory > 0 bytes (the device has {number:.0f} bytes free)", value)
    return float(number)


def check_max_memory(value: Any, name: str = "max_memory", devices: Any = None) -> Any:
    """Refuses a ``max_memory`` no device could resolve (a bad size, a percentage over 100%), before anything
    loads; with ``devices`` (where the batches will run), a percentage of a device whose memory is not known (the
    CPU) too. Returns it as given.

    Example:
        >>> check_max_memory("90%"), check_max_memory(None), check_max_memory("auto", devices=["cpu"])
        ('90%', None, 'auto')
        >>> check_max_memory("150%")
        Traceback (most recent call last):
        ...
        ValueError: max_memory should be a percentage in (0%, 100%] of the device's free memory, but got max_memory='150%'
        >>> check_max_memory("90%", devices=["cpu"])
        Traceback (most recent call last):
        ...
        ValueError: max_memory should be bytes or a size such as '20GB' on cpu (no device memory is known there: a percentage is a share of a device's free memory), but got max_memory='90%'
    """
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise bad_type(name, _MAX_MEMORY_RULE, value)
    _, unit = split_memory(value, name)
    for device in devices if unit == "%" and devices is not None else ():
        parse_memory(value, name, device=device)  # a share of what that device reports free now
    return value

"""Planning to a memory budget with a calibrated memory model. Pure numpy.

Lengths sorted longest first are cut into consecutive batches; a batch
starting at sorted position ``p`` has padded length ``L = sorted_lengths[p]``
and takes as many rows as the memory model allows there (one vectorised
:meth:`~dynabatch.memory.model.MemoryModel.max_rows` call over all positions,
then one walk over the batches).

* **Relative** (``max_memory=None``, the spec's semantics): the first batch is
  exactly the ``batch_size`` longest texts and its *predicted* peak is the
  budget. Every later batch takes the most rows whose predicted peak is at or
  under ``(1 - memory_margin)`` x budget, and never fewer than ``batch_size``:
  ``batch_size`` rows of a text no longer than the first batch's are never
  predicted above the first batch's peak (the model grows with length), so when
  even they do not fit under the margin they are what the batch takes.
* **Absolute** (``max_memory`` in bytes, ``"12GB"``, ``"512MiB"``, or ``"80%"``
  of the CUDA device's free memory): every batch, the first included, takes the
  most rows predicted at or under ``(1 - memory_margin) x max_memory``;
  ``batch_size`` plays no part. A text whose single row is predicted above it
  is a batch of one row on its own, counted and logged as a warning.

With ``granularity``, a batch's rows are rounded down to a multiple of it when
at least one multiple fits (the last batch takes what remains).

Example:
    >>> import numpy as np
    >>> from dynabatch.memory.model import MemoryModel
    >>> from dynabatch.sampling.budget import plan_batch_sizes_to_budget
    >>> shapes = [(1, 8), (4, 64), (32, 16), (4, 128)]  # measured peaks: 1000 + 100 bytes a token
    >>> mm = MemoryModel().fit(*zip(*shapes), [1000 + r * 100 * L for r, L in shapes])
    >>> lengths = np.array([128] * 4 + [64] * 8 + [16] * 40)
    >>> plan_batch_sizes_to_budget(lengths, mm, batch_size=4).tolist()  # 0.9 x (1000 + 4 x 12800) = 46980
    [4, 7, 7, 28, 6]
    >>> plan_batch_sizes_to_budget(lengths, mm, max_memory=20_000, memory_margin=0).tolist()
    [1, 1, 1, 1, 2, 2, 2, 2, 11, 11, 11, 7]
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from typing import Any

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_positive_int,
    check_token_lengths,
)

__all__ = [
    "check_memory_margin",
    "parse_max_memory",
    "plan_batch_sizes_to_budget",
    "plan_batches_to_budget",
    "plan_to_budget",
]

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)\s*$")
_MAX_RULE = "a number of bytes > 0, a size such as '12GB' or '512MiB', or a percentage such as '80%' (CUDA)"


def _free_cuda_bytes(device: Any) -> int:
    import torch

    if not torch.cuda.is_available():
        raise bad_value("max_memory", "bytes or a size such as '12GB' without a CUDA device (a percentage is of "
                        "a CUDA device's free memory)", None)
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise bad_value("device", "a CUDA device for a percentage max_memory", str(device))
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free)


def parse_max_memory(max_memory: Any, device: Any = None) -> float | None:
    """``max_memory`` in bytes.

    Args:
        max_memory: ``None``; a number of bytes > 0; a string of a number and a
            unit (``B``, ``KB``/``MB``/``GB``/``TB`` in powers of 1000,
            ``KiB``/``MiB``/``GiB``/``TiB`` in powers of 1024, any case); or a
            percentage in (0, 100] of the CUDA device's free memory
            (``torch.cuda.mem_get_info``), which needs CUDA.
        device: the CUDA device of a percentage (default: the current one).

    Raises:
        TypeError: not a number or str.
        ValueError: not positive, an unknown unit, a percentage outside (0, 100]
            or without a CUDA device.

    Example:
        >>> parse_max_memory("12GB"), parse_max_memory("512 MiB"), parse_max_memory(1e9)
        (12000000000.0, 536870912.0, 1000000000.0)
        >>> parse_max_memory("12XB")
        Traceback (most recent call last):
        ...
        ValueError: max_memory should be a number of bytes > 0, a size such as '12GB' or '512MiB', or a percentage such as '80%' (CUDA), but got max_memory='12XB'
    """
    if max_memory is None:
        return None
    if isinstance(max_memory, bool) or not isinstance(max_memory, (numbers.Real, str)):
        raise bad_type("max_memory", _MAX_RULE, max_memory)
    if isinstance(max_memory, str):
        match = _SIZE.match(max_memory)
        unit = match.group(2).upper() if match else None
        if match is None or (unit != "%" and unit not in _UNITS):
            raise bad_value("max_memory", _MAX_RULE, max_memory)
        number = float(match.group(1))
        if unit == "%":
            if not 0 < number <= 100:
                raise bad_value("max_memory", "a percentage in (0%, 100%] of the CUDA device's free memory",
                                max_memory)
            try:
                free = _free_cuda_bytes(device)
            except ValueError as exc:
                raise bad_value("max_memory", "bytes or a size such as '12GB' on the CPU (a percentage is of a "
                                "CUDA device's free memory)", max_memory) from exc
            value = free * number / 100
        else:
            value = number * _UNITS[unit]
    else:
        value = float(max_memory)
    if not (value > 0 and math.isfinite(value)):
        raise bad_value("max_memory", _MAX_RULE, max_memory)
    return float(value)


def check_memory_margin(memory_margin: Any) -> float:
    """``memory_margin`` as a float in [0, 1) (the share of the budget kept free)."""
    if isinstance(memory_margin, bool) or not isinstance(memory_margin, numbers.Real):
        raise bad_type("memory_margin", "a number in [0, 1)", memory_margin)
    if not 0 <= memory_margin < 1:  # also refuses NaN
        raise bad_value("memory_margin", "a number in [0, 1)", memory_margin)
    return float(memory_margin)


def _check_model(memory_model: Any) -> Any:
    for method in ("predict", "max_rows"):
        if not callable(getattr(memory_model, method, None)):
            raise bad_type("memory_model", "a MemoryModel (dynabatch.calibrate or MemoryModel.load)", memory_model)
    return memory_model


def _check_sorted(sorted_lengths: Any) -> np.ndarray:
    arr = check_token_lengths("sorted_lengths", sorted_lengths)
    if arr.size > 1 and (arr[1:] > arr[:-1]).any():
        raise bad_value("sorted_lengths", "sorted longest first", "an unsorted array")
    return arr


def plan_batch_sizes_to_budget(
    sorted_lengths: Any,
    memory_model: Any,
    *,
    batch_size: int | None = None,
    max_memory: Any = None,
    memory_margin: float = 0.10,
    granularity: int | None = None,
    device: Any = None,
) -> np.ndarray:
    """Batch sizes over lengths sorted longest first, each the most rows the memory model allows.

    Args:
        sorted_lengths: token lengths, longest first.
        memory_model: has ``predict(rows, padded_length)`` and
            ``max_rows(padded_length, budget_bytes)`` (a :class:`~dynabatch.memory.model.MemoryModel`).
        batch_size: relative mode: the first batch's rows (required there).
        max_memory: ``None`` (relative) or the budget (see :func:`parse_max_memory`).
        memory_margin: predicted peaks stay at or under ``(1 - memory_margin)`` x budget; in [0, 1).
        granularity: round rows down to a multiple of it where one fits.
        device: the CUDA device of a percentage ``max_memory``.

    Returns:
        ``int64`` sizes; batch ``i`` is ``sorted_lengths[sum(sizes[:i]):sum(sizes[:i + 1])]``.
    """
    memory_model = _check_model(memory_model)
    lengths = _check_sorted(sorted_lengths)
    budget = parse_max_memory(max_memory, device)
    margin = check_memory_margin(memory_margin)
    if granularity is not None:
        granularity = check_positive_int("granularity", granularity)
    if budget is None:
        if batch_size is None:
            raise bad_value("batch_size", "a positive integer in relative mode (max_memory=None)", batch_size)
        batch_size = check_positive_int("batch_size", batch_size)
    n = len(lengths)
    if n == 0:
        return np.empty(0, dtype=np.int64)

    first = 0
    if budget is None:  # relative: the first batch of batch_size longest texts sets the budget
        first = min(batch_size, n)
        budget = float(np.asarray(memory_model.predict(first, int(lengths[0]))))
    limit = (1.0 - margin) * budget
    # One max_rows call per distinct length (lengths are sorted, so runs are contiguous).
    starts = np.flatnonzero(np.r_[True, lengths[1:] != lengths[:-1]])
    per_length = np.asarray(memory_model.max_rows(lengths[starts], limit), dtype=np.int64)
    if granularity is not None:
        rounded = per_length - per_length % granularity
        per_length = np.where(rounded > 0, rounded, per_length)
    floor = batch_size if first else 1
    per_length = np.maximum(per_length, floor).tolist()
    ends = np.r_[starts[1:], n].tolist()

    # One step per run of equal lengths: every batch starting inside a run has that run's rows
    # (the last one may reach into the next, shorter run).
    pieces = [np.array([first], dtype=np.int64)] if first else []
    pos, run = first, 0
    while pos < n:
        while ends[run] <= pos:
            run += 1
        rows = per_length[run]
        count = -(-(ends[run] - pos) // rows)
        pieces.append(np.full(count, rows, dtype=np.int64))
        pos += count * rows
    out = np.concatenate(pieces)
    out[-1] -= pos - n if pos > n else 0
    if not first:
        over = int(np.count_nonzero(np.asarray(memory_model.max_rows(lengths[np.cumsum(out) - out], limit)) == 0))
        if over:
            logger.warning("%d texts are predicted above the memory budget of %.0f bytes on their own; each is a "
                           "batch of one row", over, limit)
    return out


def plan_batches_to_budget(lengths: Any, memory_model: Any, **kwargs: Any) -> list[np.ndarray]:
    """Batches of input positions (longest first) from token lengths in input order.

    The keyword arguments are those of :func:`plan_batch_sizes_to_budget`.
    Every position appears exactly once.

    Example:
        >>> from dynabatch.memory.model import MemoryModel
        >>> mm = MemoryModel().fit([1, 2, 4], [4, 8, 2], [10, 40, 20])  # 2.5 bytes a token
        >>> [b.tolist() for b in plan_batches_to_budget([2, 8, 4, 8], mm, max_memory=40, memory_margin=0)]
        [[1, 3], [2, 0]]
    """
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise bad_type("lengths", "a 1-D array of token counts", lengths)
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise bad_value("lengths", "a 1-D array of integer token counts", f"array of dtype {arr.dtype}")
    order = np.argsort(-arr.astype(np.int64), kind="stable")
    sizes = plan_batch_sizes_to_budget(arr[order], memory_model, **kwargs)
    return np.split(order, np.cumsum(sizes)[:-1]) if len(sizes) else []


def plan_to_budget(sorted_lengths: Any, options: Any, settings: Any) -> np.ndarray:
    """:func:`plan_batch_sizes_to_budget` for a planner's objects.

    Args:
        sorted_lengths: token lengths, longest first.
        options: anything with ``memory_model``, ``max_memory``,
            ``memory_margin`` and ``granularity`` attributes (the loader's estimator).
        settings: anything with a ``batch_size`` attribute, or the batch size itself.
    """
    batch_size = getattr(settings, "batch_size", settings)
    return plan_batch_sizes_to_budget(
        sorted_lengths, options.memory_model, batch_size=batch_size, max_memory=options.max_memory,
        memory_margin=options.memory_margin, granularity=getattr(options, "granularity", None),
        device=getattr(options, "device", None),
    )

"""The largest batch a call runs at each length, found on the device itself under a memory limit.

Calibrating (:func:`~dynabatch.memory.calibrate.calibrate`) measures a few
designed probes and fits a model of the peak; a probe at the limit, as NVIDIA
NeMo's OOMptimizer does for training, instead runs the real call at the limit
and looks for the most rows that still run. :func:`probe_limit` runs ``work``
(a training step: forward, backward and the optimizer's step) on probe batches
built as calibration builds them (:class:`~dynabatch.memory._probes.Prober`):

* **the limit.** On CUDA (and XPU) the caching allocator itself is capped at
  ``limit_bytes`` for the whole search (:meth:`~dynabatch.memory.device.DeviceBackend.capped`):
  the weights, the optimizer state, the cached blocks and their fragmentation
  count as they will in training, and the cache is not emptied between steps.
  On the CPU, the storage tracker raises an out-of-memory error once a step
  holds more than ``limit_bytes - resident_bytes`` (a simulated device).
* **the search.** Lengths longest first; at each, rows double from the most
  that ran at the longer length (from 1 at the longest) until a step runs out
  of memory, then the gap between the most that ran and the fewest that failed
  is bisected until it is within ``tolerance`` (5%) of the rows that ran.
* **the result.** Every step is measured and recorded in a
  :class:`~dynabatch.memory.model.MemoryModel` (the failures as out of memory),
  so it plans as a calibrated model does, and a
  :class:`~dynabatch.memory.budget.MemoryBudget` on it refuses every shape at
  least as large as one that failed. ``metadata["max_rows"]`` holds the most
  rows that ran at each length.

Example (a simulated device of 64 KB on the CPU):
    >>> import torch
    >>> from transformers import AutoTokenizer
    >>> from dynabatch.demo import minilm_path
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> def work(batch):  # 256 bytes a token slot
    ...     return torch.ones(batch["input_ids"].numel(), 64).sum()
    >>> mm = probe_limit(work, tokenizer, limit_bytes=64_000, max_input_token_length=32, progress=False)
    >>> mm.metadata["max_rows"]  # the most rows under 64,000 bytes at each length: rows x length x 256 bytes
    {32: 7, 16: 15, 8: 31, 4: 62}
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dynabatch._background import progress_bar
from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import Batch
from dynabatch.memory._calibrate_checks import (
    check_model_max_length,
    check_positions,
    check_probe_lengths,
    check_probe_tokenizer,
    measure_device,
    probe_lengths,
)
from dynabatch.memory._probes import Prober, long_texts, vocabulary_texts
from dynabatch.memory.device import backend_of
from dynabatch.memory.model import MemoryModel

__all__ = ["probe_limit"]

logger = logging.getLogger(__name__)

SHORTEST_SHARE = 8
"""By default the probe lengths go down to the longest over this (fewer, longer lengths than calibration's)."""


def probe_limit(
    work: Callable[[Batch], Any],
    tokenizer: Any,
    *,
    limit_bytes: float,
    max_input_token_length: int,
    resident_bytes: float = 0.0,
    lengths: Any = None,
    device: Any = None,
    model: Any = None,
    texts: Any = None,
    tolerance: float = 0.05,
    max_rows: int = 4096,
    cleanup: Callable[[], None] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> MemoryModel:
    """Finds the most rows ``work`` runs at each length under ``limit_bytes``, on the device itself.

    Args:
        work: the call on one batch (a training step); its result is dropped.
        tokenizer: the tokenizer the batches are built with.
        limit_bytes: what this process may hold on the device at any time
            (everything: weights, optimizer state, gradients, activations, the
            allocator's cache).
        max_input_token_length: the longest probe length.
        resident_bytes: what the process holds there before a step (weights,
            buffers, optimizer state); on the CPU the simulated device holds
            ``limit_bytes - resident_bytes`` for a step.
        lengths: the probe lengths; ``None``: ``max_input_token_length`` halved
            down to an eighth of it.
        device: where the probe batches go, and whose memory is capped
            (default: ``model``'s device, else the CPU).
        model: the model ``work`` runs (recorded in the result; its positions are checked).
        texts: texts to draw probe tokens from; ``None``: the tokenizer's vocabulary.
        tolerance: stop bisecting once the gap between the most rows that ran
            and the fewest that failed is at most this share of the former.
        max_rows: the most rows tried at any length.
        cleanup: called after every step (drop gradients a failed step left).
        seed: seeds the probe tokens.
        progress: show a progress bar.

    Returns:
        A :class:`MemoryModel` of every step run (``metadata["max_rows"]``:
        length -> most rows that ran; ``metadata["steps"]``, ``["seconds"]``).

    Raises:
        ValueError: a bad argument, a device that can be neither capped nor
            simulated, or a limit under which one row of the longest length does not run.
    """
    if not callable(work):
        raise bad_type("work", "a callable taking a dynabatch.Batch", work)
    check_probe_tokenizer(tokenizer, texts)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    max_rows = check_positive_int("max_rows", max_rows)
    for name, value in (("limit_bytes", limit_bytes), ("resident_bytes", resident_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise bad_value(name, "a number of bytes >= 0", value)
    if not limit_bytes > resident_bytes:
        raise bad_value("limit_bytes", f"above resident_bytes={resident_bytes:.0f} (what the device holds before a "
                        "step)", limit_bytes)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise bad_value("tolerance", "a number in (0, 1)", tolerance)
    grid = check_probe_lengths(lengths, max_input_token_length) if lengths is not None else probe_lengths(
        max_input_token_length, max(1, max_input_token_length // SHORTEST_SHARE))
    check_model_max_length(tokenizer, max_input_token_length)
    check_positions(getattr(model, "config", None), max_input_token_length)
    dev = measure_device("auto", device, model)
    backend = backend_of(dev)
    simulated = dev.type == "cpu"
    if not (simulated or backend.cappable):
        raise bad_value("device", "the CPU (a simulated device) or a device whose memory can be capped "
                        "(CUDA, XPU)", str(dev))
    rng = np.random.default_rng(seed)
    pool = (vocabulary_texts(tokenizer, 2 * max_input_token_length + 8, rng) if texts is None
            else long_texts(list(texts), tokenizer, max_input_token_length, rng, {}))
    mm = MemoryModel(device=dev, model=model, knots=grid, metadata={
        "limit_bytes": float(limit_bytes), "resident_bytes": float(resident_bytes), "tolerance": tolerance})
    start = time.perf_counter()
    cap = contextlib.nullcontext() if simulated else backend.capped(dev, limit_bytes)
    with progress_bar(progress, desc="probing the limit", unit="step") as bar, cap:
        prober = Prober(work, tokenizer, pool, max_input_token_length, device=device, memory_device=dev,
                        limit_bytes=int(limit_bytes - resident_bytes) if simulated else None, cleanup=cleanup,
                        pad_to_multiple_of=None, tokenizer_kwargs={}, model=mm, bar=bar, hooked=None, steps=None)
        prober.warm_up(1, grid[0])
        found: dict[int, int] = {}
        ran = 0
        for length in reversed(grid):
            ran = _most_rows(prober, length, ran, max_rows, tolerance)
            if ran == 0:
                raise bad_value("limit_bytes", f"above what one row of {length} tokens needs (one step ran out "
                                f"of memory under {limit_bytes:.0f} bytes)", limit_bytes)
            found[length] = ran
    mm.metadata.update(max_rows=found, steps=prober.run_, seconds=round(time.perf_counter() - start, 2))
    logger.info("probed the limit in %d steps, %.1f s: most rows %s", prober.run_, mm.metadata["seconds"], found)
    return mm


def _most_rows(prober: Prober, length: int, ran: int, max_rows: int, tolerance: float) -> int:
    """The most rows that run at ``length``, knowing ``ran`` rows do: doubling, then bisecting."""
    if ran >= max_rows:
        return ran
    rows = max(1, 2 * ran)
    while True:
        rows = min(rows, max_rows)
        if prober.probe(rows, length, "limit") is None:
            break
        ran = rows
        if ran == max_rows:
            return ran
        rows *= 2
    failed = rows
    while failed - ran > max(1.0, tolerance * ran):
        middle = (ran + failed) // 2
        if prober.probe(middle, length, "limit") is None:
            failed = middle
        else:
            ran = middle
    return ran

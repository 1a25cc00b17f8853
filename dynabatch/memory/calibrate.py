"""Calibrating a memory model: run a few designed probe batches, measure each peak, fit.

:func:`calibrate` runs ``work`` (the callable ``run()`` takes: a
:class:`~dynabatch.data.collate.Batch` in) on probe batches built exactly as the
loader builds batches (the tokenizer's padding side and extras, via
:class:`~dynabatch.data.collate.TokenCollator`), measures each peak with
:func:`~dynabatch.memory.measure.track_peak_memory` (CUDA memory statistics on
CUDA, the storage tracker on the CPU) and fits a
:class:`~dynabatch.memory.model.MemoryModel`.

Every argument is checked before the first probe runs, so that a bad one fails
in a second rather than minutes in: the devices, the longest probe against the
tokenizer's ``model_max_length``, the prompt plus ``max_new_tokens`` against the
model's positions. The design, in order:

1. *lengths*: ``max_input_token_length`` halved down to 4 tokens (or the
   ``lengths`` given); every probe's rows alternate full-length rows and rows
   an eighth shorter, so it is padded as real batches are;
2. *base*: ``batch_size`` rows at every length, shortest first; a probe that
   runs out of memory is recorded and every probe at least as large in both
   rows and length is skipped;
3. *budget*: at every shorter length, the rows the fit so far says fit
   ``(1 - memory_margin)`` of the first batch's predicted peak (``batch_size``
   rows at the longest length), or of ``budget_bytes`` when given (an absolute
   budget, such as a training step's share of a memory limit): where the
   planner will put its batches;
4. *refine*: between neighbouring lengths, the geometric middle length at
   those budget rows; where its measured peak is off the prediction by more
   than ``tolerance``, both halves are refined again (at most ``max_probes``
   probes in all).

*Decoding steps.* Given ``max_new_tokens`` and ``model``, every probe is
measured in segments, one per call of ``model``'s forward (the prefill, then
one decoding step each; :meth:`~dynabatch.memory.measure.PeakMemory.mark`). A
decoding step's peak grows linearly in the step, by the same bytes per row at
every length (the KV cache and the generated ids gain a token a step). The first
probe runs whole: its largest growth a step, per row, is measured, and its first
steps extrapolated along that line must reach its measured peak (else every
probe runs whole). Every later probe stops after the prefill and 2 decoding
steps: its peak is the largest segment measured, or its last step's peak grown
to ``max_new_tokens`` steps at the steeper of its own measured step and the
first probe's growth for its rows. A 64-token ``generate`` then costs a probe 3
forward calls instead of 64, and the probes' peaks are those of the whole call
to within the 512-byte blocks of the tracker (high rather than low).

A warm-up call (not measured) runs first. Token ids are drawn with a local,
seeded generator from the tokenizer's vocabulary (special tokens excluded), or
come from your own ``texts`` when given (joined, round again as often as
needed, to reach the longest length; texts too bare to reach it, blank
ones, are refused).

Example:
    >>> import torch
    >>> from transformers import AutoTokenizer
    >>> from dynabatch.demo import minilm_path
    >>> from dynabatch.memory.calibrate import calibrate
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> weight = torch.randn(64, 64)
    >>> def work(batch):  # a stand-in model: an embedding and one layer per token
    ...     x = torch.nn.functional.one_hot(batch["input_ids"] % 64, 64).float()
    ...     return (x @ weight).relu().sum()
    >>> mm = calibrate(work, tokenizer, batch_size=4, max_input_token_length=32, progress=False)
    >>> mm.loo_error_ < 0.02, int(mm.max_rows(32, mm.predict(4, 32))[()]) >= 4
    (True, True)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np

from dynabatch._background import progress_bar
from dynabatch._validation import (
    bad_type,
    bad_value,
    check_bool,
    check_non_negative_int,
    check_positive_int,
    check_positive_number,
)
from dynabatch.data.collate import Batch
from dynabatch.data.tokenization import check_tokenizer_kwargs, validate_texts
from dynabatch.memory._calibrate_checks import (
    check_model_max_length,
    check_positions,
    check_probe_lengths,
    check_probe_tokenizer,
    hookable,
    measure_device,
    probe_lengths,
)
from dynabatch.memory._probes import Prober, long_texts, vocabulary_texts
from dynabatch.memory.budget import MemoryBudget, check_memory_margin
from dynabatch.memory.measure import check_device
from dynabatch.memory.model import MemoryModel

__all__ = ["calibrate", "check_model_max_length", "check_positions", "probe_lengths"]

logger = logging.getLogger(__name__)

_MAX_ROWS_FACTOR = 64  # probes hold at most this many times batch_size rows


def calibrate(
    work: Callable[[Batch], Any],
    tokenizer: Any,
    *,
    batch_size: int,
    max_input_token_length: int,
    max_new_tokens: int | None = None,
    measure_memory: Any = "auto",
    texts: Any = None,
    device: Any = None,
    model: Any = None,
    lengths: Any = None,
    memory_margin: float = 0.10,
    budget_bytes: float | None = None,
    max_probes: int = 40,
    tolerance: float = 0.02,
    limit_bytes: int | None = None,
    cleanup: Callable[[], None] | None = None,
    pad_to_multiple_of: int | None = None,
    tokenizer_kwargs: dict[str, Any] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> MemoryModel:
    """Measures ``work`` on a designed set of probe batches and fits a :class:`MemoryModel`.

    Args:
        work: your call on one batch (``lambda b: model.generate(**b, max_new_tokens=64)``);
            what ``run()`` takes. Its result is dropped.
        tokenizer: the Hugging Face tokenizer the loader will use (pad token,
            padding side and extras are taken from it).
        batch_size: rows of the loader's first batch; probes go from it to
            several times it.
        max_input_token_length: the loader's truncation limit: the longest
            probe. At most the tokenizer's ``model_max_length``, and with
            ``max_new_tokens`` within the model's positions.
        max_new_tokens: the most tokens ``work`` generates per row (its
            ``generate``'s ``max_new_tokens``), or ``None`` for work that does
            not generate. With ``model`` given, each probe measures the prefill
            and 2 decoding steps and extrapolates the rest (see the module
            docs): seconds instead of minutes for a long ``generate``. On a
            shared CPU, ``torch.set_num_threads(1)`` speeds calibration up
            many times (the probes are many small ops).
        measure_memory: ``"auto"`` (``device``, else ``model``'s device, else
            CUDA when available, else the CPU tracker) or the device to measure.
        texts: your own texts to draw probe tokens from; ``None`` draws token
            ids from the tokenizer's vocabulary.
        device: where to move each probe batch before ``work`` (not measured).
        model: the model ``work`` runs, recorded in the saved file (name,
            class, parameters, dtype, attention) so that loading it for another model
            warns; its config's positions are checked, and its forward calls
            are the decoding steps counted for ``max_new_tokens``.
        lengths: the base probe lengths; ``None`` for :func:`probe_lengths`.
        memory_margin: the planner's margin; budget probes target
            ``(1 - memory_margin)`` of the first batch's predicted peak.
        budget_bytes: the absolute budget batches will be planned to (peak
            bytes beyond what is allocated before a call); budget probes then
            target ``(1 - memory_margin)`` of it. ``None``: the first batch's peak.
        max_probes: the most probes measured (base ones always run).
        tolerance: refine between two lengths while the middle is predicted
            worse than this (relative error).
        limit_bytes: CPU only: simulate a device with this much free memory
            (probes above it run out of memory and are recorded as such).
        cleanup: called after every probe, before garbage collection.
        pad_to_multiple_of, tokenizer_kwargs: as given to the loader.
        seed: seeds the token ids and the pool of texts (a local generator); an int >= 0.
        progress: show a tqdm progress bar.

    Returns:
        The fitted :class:`MemoryModel` (``mm.report()`` prints the probe table).

    Raises:
        TypeError: ``work`` not callable, or a bad argument type.
        ValueError: a bad argument value (checked before the first probe), a
            ``max_new_tokens`` under the forward calls ``work`` makes, or peaks
            of 0 bytes on every probe (``measure_memory`` is not the device
            ``work`` runs on).
        RuntimeError: ``work`` raised something other than out-of-memory on a
            probe, or ran out of memory on every probe.
    """
    if not callable(work):
        raise bad_type("work", "a callable taking a dynabatch.Batch", work)
    check_probe_tokenizer(tokenizer, texts)
    batch_size = check_positive_int("batch_size", batch_size)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    if max_new_tokens is not None:
        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    max_probes = check_positive_int("max_probes", max_probes)
    memory_margin = check_memory_margin(memory_margin)
    if budget_bytes is not None:  # finite too: the budget the probes aim at is parsed as a max_memory, which refuses
        # an infinite one only after the base probes have run
        budget_bytes = check_positive_number("budget_bytes", budget_bytes, finite=True,
                                             rule="None or a finite positive number of bytes")
    tolerance = check_positive_number("tolerance", tolerance)
    check_bool("progress", progress)  # as the loader checks it: a truthy "no" would show the bar
    if limit_bytes is not None:
        limit_bytes = check_positive_int("limit_bytes", limit_bytes)
    # numpy's generator would refuse it only at its first draw, without naming seed ("expected non-negative integer")
    seed = check_non_negative_int("seed", int(seed) if isinstance(seed, np.integer) else seed)
    if cleanup is not None and not callable(cleanup):
        raise bad_type("cleanup", "a callable or None", cleanup)
    grid = check_probe_lengths(lengths, max_input_token_length)
    check_model_max_length(tokenizer, max_input_token_length)
    check_positions(getattr(model, "config", None), max_input_token_length, max_new_tokens or 0)
    if device is not None:
        check_device("device", device, "None, a str or a torch.device")
    memory_device = measure_device(measure_memory, device, model)
    if limit_bytes is not None and memory_device.type != "cpu":
        raise bad_value("limit_bytes", "None when measuring a CUDA device (its own memory is the limit)", limit_bytes)
    if tokenizer_kwargs is not None and not isinstance(tokenizer_kwargs, dict):
        raise bad_type("tokenizer_kwargs", "None or a dict of the tokenizer's keywords, as given to the loader",
                       tokenizer_kwargs)
    tokenizer_kwargs = dict(tokenizer_kwargs or {})
    check_tokenizer_kwargs(tokenizer, tokenizer_kwargs, calibrate)  # a misspelt one vanished into the tokenizer call
    user_texts = None if texts is None else validate_texts(texts)
    hooked = hookable(model)
    if max_new_tokens is not None and hooked is None:
        logger.info("max_new_tokens without a torch model=: every probe runs whole (its forward calls are the "
                    "decoding steps counted)")
    rng = np.random.default_rng(seed)

    start = time.perf_counter()
    if user_texts is None:
        pool = vocabulary_texts(tokenizer, 2 * max_input_token_length + 8, rng)
    else:
        pool = long_texts(user_texts, tokenizer, max_input_token_length, rng, tokenizer_kwargs)

    mm = MemoryModel(device=memory_device, model=model, knots=grid, metadata={
        "batch_size": batch_size, "max_input_token_length": max_input_token_length,
        "memory_margin": float(memory_margin), "texts": "vocabulary" if texts is None else "user texts",
        "seed": seed})
    with progress_bar(progress, total=len(grid), desc="calibrating", unit="probe") as bar:
        prober = Prober(work, tokenizer, pool, max_input_token_length, device=device, memory_device=memory_device,
                         limit_bytes=limit_bytes, cleanup=cleanup, pad_to_multiple_of=pad_to_multiple_of,
                         tokenizer_kwargs=tokenizer_kwargs, model=mm, bar=bar, hooked=hooked, steps=max_new_tokens)
        prober.warm_up(min(batch_size, 2), grid[0])
        for length in grid:
            prober.probe(batch_size, length, "base")
        prober.expect()
        prober.probe(4 * batch_size, grid[0], "base")  # a second row count: what a row costs vs the constant
        if not prober.measured:
            raise RuntimeError(
                f"work ran out of memory on every probe, even {batch_size} rows x {grid[0]} tokens; "
                f"work(batch) should fit batch_size={batch_size} rows on the device")
        if all(p["peak_bytes"] == 0 for p in mm.probes_ if not p["out_of_memory"]):
            raise bad_value("measure_memory", f"the device work runs on (every probe measured 0 bytes on "
                            f"{memory_device})", measure_memory)
        _grow(prober, mm, grid, batch_size, memory_margin, max_probes, tolerance, budget_bytes)
    mm.metadata["seconds"] = round(time.perf_counter() - start, 2)
    if max_new_tokens is not None:
        mm.metadata["max_new_tokens"] = max_new_tokens
        mm.metadata["forward_calls_measured"] = prober.stop_after  # None: every probe ran whole
    logger.info("calibrated on %d probes in %.1f s; leave-one-out error %.1f%%", prober.run_,
                mm.metadata["seconds"], 100 * mm.loo_error_)
    return mm


def _grow(prober: Prober, mm: MemoryModel, grid: list[int], batch_size: int, memory_margin: float,
          max_probes: int, tolerance: float, budget_bytes: float | None) -> None:
    """The budget and refine probes (steps 3 and 4 of the design)."""
    top = grid[-1]
    cap = _MAX_ROWS_FACTOR * batch_size

    def target() -> float:
        if budget_bytes is not None:
            return (1 - memory_margin) * float(budget_bytes)
        return (1 - memory_margin) * float(mm.predict_unchecked(np.array(float(batch_size)), np.array(float(top))))

    def rows_at(length: int) -> int:
        # At most 4x the most rows measured so far: a fit from few probes may be far off.
        most = max(p["rows"] for p in mm.probes_ if not p["out_of_memory"])
        rows = int(MemoryBudget(mm, target(), memory_margin=0.0).rows_allowed(length))
        return int(min(cap, 4 * most, max(2, rows)))  # two rows at least: a probe is padded as batches are

    for length in reversed(grid if budget_bytes is not None else grid[:-1]):  # the longest too, when absolute
        if prober.run_ >= max_probes:
            return
        rows = rows_at(length)
        if abs(rows - batch_size) > 0.1 * batch_size:
            prober.expect()
            prober.probe(rows, length, "budget")
    pending = list(pairwise(grid))
    while pending and prober.run_ < max_probes:
        low, high = pending.pop(0)
        middle = round(math.sqrt(low * high))
        if middle <= low or middle >= high:
            continue
        rows = rows_at(middle)
        expected = float(mm.predict_unchecked(np.array(float(rows)), np.array(float(middle))))
        mm.knots = sorted(set(mm.knots or []) | {middle})
        prober.expect()
        peak = prober.probe(rows, middle, "refine")
        if peak is not None and abs(expected / max(peak, 1) - 1) > tolerance:
            pending += [(low, middle), (middle, high)]

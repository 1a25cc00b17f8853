"""Calibrating a memory model: run a few designed probe batches, measure each peak, fit.

:func:`calibrate` runs ``work`` (the callable ``run()`` takes: a
:class:`~dynabatch.data.collate.Batch` in) on probe batches built exactly as the
loader builds batches (the tokenizer's padding side and extras, via
:class:`~dynabatch.data.collate.TokenCollator`), measures each peak with
:func:`~dynabatch.memory.measure.track_peak_memory` (CUDA memory statistics on
CUDA, the storage tracker on the CPU) and fits a
:class:`~dynabatch.memory.model.MemoryModel`. The design, in order:

1. *lengths*: ``max_input_token_length`` halved down to 4 tokens (or the
   ``lengths`` given); every probe's rows alternate full-length rows and rows
   an eighth shorter, so it is padded as real batches are;
2. *base*: ``batch_size`` rows at every length, shortest first; a probe that
   runs out of memory is recorded and every probe at least as large in both
   rows and length is skipped;
3. *budget*: at every shorter length, the rows the fit so far says fit
   ``(1 - memory_margin)`` of the first batch's predicted peak (``batch_size``
   rows at the longest length): where the planner will put its batches;
4. *refine*: between neighbouring lengths, the geometric middle length at
   those budget rows; where its measured peak is off the prediction by more
   than ``tolerance``, both halves are refined again (at most ``max_probes``
   probes in all).

A warm-up call (not measured) runs first. Token ids are drawn with a local,
seeded generator from the tokenizer's vocabulary (special tokens excluded), or
come from your own ``texts`` when given (joined to reach the longest length).

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
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import Batch, TokenCollator
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts, validate_texts
from dynabatch.memory.budget import MemoryBudget
from dynabatch.memory.guard import call_guarded, is_out_of_memory_error
from dynabatch.memory.model import MemoryModel

__all__ = ["calibrate", "probe_lengths"]

logger = logging.getLogger(__name__)

_POOL = 32  # distinct texts in the probe pool (rows cycle through them)
_MIN_LENGTH = 4
_MAX_ROWS_FACTOR = 64  # probes hold at most this many times batch_size rows


def probe_lengths(max_input_token_length: int, shortest: int = _MIN_LENGTH) -> list[int]:
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


def _measure_device(measure_memory: Any, device: Any, model: Any) -> torch.device:
    if measure_memory in ("auto", True):
        if device is not None:
            return torch.device(device)
        params = list(model.parameters())[:1] if callable(getattr(model, "parameters", None)) else []
        if params:
            return params[0].device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(measure_memory, (str, torch.device)):
        raise bad_type("measure_memory", "'auto' or a device ('cpu', 'cuda:0')", measure_memory)
    return torch.device(measure_memory)


def _vocabulary_texts(tokenizer: Any, n_tokens: int, rng: np.random.Generator) -> list[str]:
    size = getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int) or not callable(getattr(tokenizer, "decode", None)):
        raise bad_value("texts", "given for a tokenizer without vocab_size and decode() to draw token ids from",
                        None)
    special = np.array(sorted(set(getattr(tokenizer, "all_special_ids", []) or [])), dtype=np.int64)
    texts = []
    for _ in range(_POOL):
        ids = rng.integers(0, size, size=n_tokens)
        ids = ids[~np.isin(ids, special)]
        texts.append(tokenizer.decode(ids.tolist(), skip_special_tokens=True))
    return texts


def _long_texts(texts: list[str], tokenizer: Any, length: int, rng: np.random.Generator,
                tokenizer_kwargs: dict[str, Any]) -> list[str]:
    """A pool of texts each reaching ``length`` tokens, joining consecutive user texts where needed."""
    pool = []
    starts = rng.integers(0, len(texts), size=_POOL)
    for start in starts.tolist():
        parts, i = [], start
        while len(parts) < 4 * len(texts):
            parts.append(texts[i % len(texts)])
            i += 1
            if len(parts) % 8 == 0 or len(parts) == len(texts):
                joined = " ".join(parts)
                if tokenize_texts([joined], tokenizer, length, progress=False, **tokenizer_kwargs).lengths[0] >= length:
                    break
        pool.append(" ".join(parts))
    return pool


def _cut(store: TokenizedTexts, length: int, suffix: int) -> TokenizedTexts:
    """Every row truncated to ``length`` tokens as the tokenizer truncates: its last ``suffix`` (special) tokens kept."""
    rows = []
    for i in range(len(store)):
        lo, hi = int(store.offsets[i]), int(store.offsets[i + 1])
        keep = min(hi - lo, length)
        tail = min(suffix, keep)
        rows.append(np.r_[np.arange(lo, lo + keep - tail), np.arange(hi - tail, hi)].astype(np.int64))
    index = np.concatenate(rows)
    return TokenizedTexts(
        input_ids=store.input_ids[index],
        offsets=np.r_[0, np.cumsum([len(r) for r in rows])].astype(np.int64),
        extras={key: values[index] for key, values in store.extras.items()},
    )


def _concat(a: TokenizedTexts, b: TokenizedTexts) -> TokenizedTexts:
    return TokenizedTexts(
        input_ids=np.concatenate([a.input_ids, b.input_ids]),
        offsets=np.concatenate([a.offsets, b.offsets[1:] + a.offsets[-1]]),
        extras={key: np.concatenate([a.extras[key], b.extras[key]]) for key in a.extras if key in b.extras},
    )


def _trailing_specials(store: TokenizedTexts, tokenizer: Any) -> int:
    """How many special tokens end every row (``[SEP]``, ``</s>``): kept when a row is cut shorter."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    count = 0
    while all(store.offsets[i + 1] - store.offsets[i] > count
              and int(store.input_ids[store.offsets[i + 1] - 1 - count]) in special for i in range(len(store))):
        count += 1
    return count


class _Prober:
    """Builds, runs and records the probe batches of one calibration."""

    def __init__(self, work: Callable[[Batch], Any], tokenizer: Any, pool: list[str], max_length: int, *, device: Any,
                 memory_device: torch.device, limit_bytes: int | None, cleanup: Callable[[], None] | None,
                 pad_to_multiple_of: int | None, tokenizer_kwargs: dict[str, Any], model: MemoryModel,
                 bar: Any) -> None:
        self.work = work
        self.tokenizer = tokenizer
        self.pool = pool
        self.device = device
        self.memory_device = memory_device
        self.limit_bytes = limit_bytes
        self.cleanup = cleanup
        self.pad_to_multiple_of = pad_to_multiple_of
        self.tokenizer_kwargs = tokenizer_kwargs
        self.model = model
        self.bar = bar
        self.collators: dict[int, TokenCollator] = {}
        self.store = tokenize_texts(pool, tokenizer, max_length, progress=False, **tokenizer_kwargs)
        self.suffix = _trailing_specials(self.store, tokenizer)
        self.failed: list[tuple[int, int]] = []
        self.measured = 0
        self.run_ = 0

    def batch(self, rows: int, length: int) -> Batch:
        if length not in self.collators:
            short = max(1, length - max(1, length // 8))
            store = _concat(_cut(self.store, length, self.suffix), _cut(self.store, short, self.suffix))
            self.collators[length] = TokenCollator.from_tokenizer(store, self.tokenizer,
                                                                  pad_to_multiple_of=self.pad_to_multiple_of)
        i = np.arange(rows)
        positions = (i // 2) % len(self.pool) + np.where(i % 2 == 1, len(self.pool), 0)
        return self.collators[length](positions)

    def _call(self, batch: Batch) -> None:
        try:
            self.work(batch)
        except Exception as exc:
            if is_out_of_memory_error(exc):
                raise
            rows, width = batch["input_ids"].shape
            raise RuntimeError(f"work(batch) should run on a dynabatch.Batch, but work raised "
                               f"{type(exc).__name__} on a probe batch of {rows} rows x {width} tokens: {exc}") from exc

    def warm_up(self, rows: int, length: int) -> None:
        batch = self.batch(rows, length)
        call_guarded(self._call, batch.to(self.device) if self.device is not None else batch, cleanup=self.cleanup)

    def probe(self, rows: int, length: int, phase: str) -> int | None:
        """Measures one probe; its peak, or ``None`` when it ran out of memory or a failed one dominates it."""
        if any(rows >= r and length >= w for r, w in self.failed):
            return None
        batch = self.batch(rows, length)
        width = int(batch["input_ids"].shape[1])
        moved = batch.to(self.device) if self.device is not None else batch
        limit = self.limit_bytes if self.memory_device.type == "cpu" else None
        start = time.perf_counter()
        self.run_ += 1
        attempt = call_guarded(self._call, moved, measure_on=self.memory_device, limit_bytes=limit,
                               cleanup=self.cleanup)  # an out-of-memory error frees memory before it returns
        del moved, batch
        oom = attempt.error is not None
        peak = None if oom else int(attempt.peak_bytes)
        if oom:
            self.failed.append((rows, width))
            peak = limit  # the CPU tracker's limit is a known lower bound; CUDA's is not
            logger.info("probe of %d rows x %d tokens ran out of memory (%s): recorded, not grown further",
                        rows, width, type(attempt.error).__name__)
        seconds = round(time.perf_counter() - start, 3)
        self.model.observe(rows, width, peak, out_of_memory=oom, source=f"calibrate:{phase}", seconds=seconds)
        self.measured += not oom
        self.bar.update(1)
        self.bar.set_postfix_str(f"{rows}x{width} {'OOM' if oom else f'{peak / 2**20:.1f} MiB'}")
        return None if oom else peak


def calibrate(
    work: Callable[[Batch], Any],
    tokenizer: Any,
    *,
    batch_size: int,
    max_input_token_length: int,
    measure_memory: Any = "auto",
    texts: Any = None,
    device: Any = None,
    model: Any = None,
    lengths: Any = None,
    memory_margin: float = 0.10,
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
        max_input_token_length: the loader's truncation limit: the longest probe.
        measure_memory: ``"auto"`` (``device``, else ``model``'s device, else
            CUDA when available, else the CPU tracker) or the device to measure.
        texts: your own texts to draw probe tokens from; ``None`` draws token
            ids from the tokenizer's vocabulary.
        device: where to move each probe batch before ``work`` (not measured).
        model: the model ``work`` runs, recorded in the saved file (name,
            class, parameters, dtype) so that loading it for another model warns.
        lengths: the base probe lengths; ``None`` for :func:`probe_lengths`.
        memory_margin: the planner's margin; budget probes target
            ``(1 - memory_margin)`` of the first batch's predicted peak.
        max_probes: the most probes measured (base ones always run).
        tolerance: refine between two lengths while the middle is predicted
            worse than this (relative error).
        limit_bytes: CPU only: simulate a device with this much free memory
            (probes above it run out of memory and are recorded as such).
        cleanup: called after every probe, before garbage collection.
        pad_to_multiple_of, tokenizer_kwargs: as given to the loader.
        seed: seeds the token ids and the pool of texts (a local generator).
        progress: show a tqdm progress bar.

    Returns:
        The fitted :class:`MemoryModel` (``mm.report()`` prints the probe table).

    Raises:
        TypeError: ``work`` not callable, or a bad argument type.
        ValueError: a bad argument value, or peaks of 0 bytes on every probe
            (``measure_memory`` is not the device ``work`` runs on).
        RuntimeError: ``work`` raised something other than out-of-memory on a
            probe, or ran out of memory on every probe.
    """
    if not callable(work):
        raise bad_type("work", "a callable taking a dynabatch.Batch", work)
    batch_size = check_positive_int("batch_size", batch_size)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    max_probes = check_positive_int("max_probes", max_probes)
    if isinstance(memory_margin, bool) or not isinstance(memory_margin, (int, float)) or not 0 <= memory_margin < 1:
        raise bad_value("memory_margin", "a number in [0, 1)", memory_margin)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise bad_value("tolerance", "a positive number", tolerance)
    if limit_bytes is not None:
        limit_bytes = check_positive_int("limit_bytes", limit_bytes)
    if cleanup is not None and not callable(cleanup):
        raise bad_type("cleanup", "a callable or None", cleanup)
    if lengths is None:
        grid = probe_lengths(max_input_token_length)
    else:
        grid = sorted({check_positive_int("lengths[i]", int(v) if isinstance(v, np.integer) else v) for v in lengths})
        if grid[-1] > max_input_token_length:
            raise bad_value("lengths", f"at most max_input_token_length={max_input_token_length}", lengths)
        grid = sorted(set(grid) | {max_input_token_length})
    memory_device = _measure_device(measure_memory, device, model)
    if limit_bytes is not None and memory_device.type != "cpu":
        raise bad_value("limit_bytes", "None when measuring a CUDA device (its own memory is the limit)", limit_bytes)
    tokenizer_kwargs = dict(tokenizer_kwargs or {})
    rng = np.random.default_rng(seed)

    start = time.perf_counter()
    if texts is None:
        pool = _vocabulary_texts(tokenizer, 2 * max_input_token_length + 8, rng)
    else:
        pool = _long_texts(validate_texts(texts), tokenizer, max_input_token_length, rng, tokenizer_kwargs)

    mm = MemoryModel(device=memory_device, model=model, knots=grid, metadata={
        "batch_size": batch_size, "max_input_token_length": max_input_token_length,
        "memory_margin": float(memory_margin), "texts": "vocabulary" if texts is None else "user texts",
        "seed": seed})
    from tqdm.auto import tqdm

    with tqdm(total=len(grid), desc="calibrating", unit="probe", disable=not progress) as bar:
        prober = _Prober(work, tokenizer, pool, max_input_token_length, device=device, memory_device=memory_device, limit_bytes=limit_bytes,
                         cleanup=cleanup, pad_to_multiple_of=pad_to_multiple_of, tokenizer_kwargs=tokenizer_kwargs,
                         model=mm, bar=bar)
        prober.warm_up(min(batch_size, 2), grid[0])
        for length in grid:
            prober.probe(batch_size, length, "base")
        bar.total += 1
        prober.probe(4 * batch_size, grid[0], "base")  # a second row count: what a row costs vs the constant
        if not prober.measured:
            raise RuntimeError(
                f"work ran out of memory on every probe, even {batch_size} rows x {grid[0]} tokens; "
                f"work(batch) should fit batch_size={batch_size} rows on the device")
        if all(p["peak_bytes"] == 0 for p in mm.probes_ if not p["out_of_memory"]):
            raise bad_value("measure_memory", f"the device work runs on (every probe measured 0 bytes on "
                            f"{memory_device})", measure_memory)
        _grow(prober, mm, grid, batch_size, memory_margin, max_probes, tolerance)
    mm.metadata["seconds"] = round(time.perf_counter() - start, 2)
    logger.info("calibrated on %d probes in %.1f s; leave-one-out error %.1f%%", prober.run_,
                mm.metadata["seconds"], 100 * mm.loo_error_)
    return mm


def _grow(prober: _Prober, mm: MemoryModel, grid: list[int], batch_size: int, memory_margin: float,
          max_probes: int, tolerance: float) -> None:
    """The budget and refine probes (steps 3 and 4 of the design)."""
    top = grid[-1]
    cap = _MAX_ROWS_FACTOR * batch_size

    def target() -> float:
        return (1 - memory_margin) * float(mm.predict_unchecked(np.array(float(batch_size)), np.array(float(top))))

    def rows_at(length: int) -> int:
        # At most 4x the most rows measured so far: a fit from few probes may be far off.
        most = max(p["rows"] for p in mm.probes_ if not p["out_of_memory"])
        rows = int(MemoryBudget(mm, target(), memory_margin=0.0).max_rows(length))
        return int(min(cap, 4 * most, max(2, rows)))  # two rows at least: a probe is padded as batches are

    for length in reversed(grid[:-1]):
        if prober.run_ >= max_probes:
            return
        rows = rows_at(length)
        if abs(rows - batch_size) > 0.1 * batch_size:
            prober.bar.total += 1
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
        prober.bar.total += 1
        peak = prober.probe(rows, middle, "refine")
        if peak is not None and abs(expected / max(peak, 1) - 1) > tolerance:
            pending += [(low, middle), (middle, high)]

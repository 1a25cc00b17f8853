"""The probe batches of one calibration: their texts, how they are built, run and measured.

:class:`Prober` builds each probe exactly as the loader builds batches (the
tokenizer's padding side and extras, via :class:`~dynabatch.data.collate.TokenCollator`),
runs ``work`` on it through the out-of-memory guard, measures its peak (in
segments, one per decoding step, when ``max_new_tokens`` is given) and records
it in the :class:`~dynabatch.memory.model.MemoryModel`. See
:mod:`dynabatch.memory.calibrate` for the design the probes follow.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_value
from dynabatch.data.collate import Batch, TokenCollator
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts
from dynabatch.memory.device import is_out_of_memory_error
from dynabatch.memory.measure import track_peak_memory
from dynabatch.memory.model import MemoryModel
from dynabatch.memory.oom import call_guarded, dominating
from dynabatch.memory.units import MB

__all__ = ["DECODING_STEPS", "POOL", "Prober", "extrapolate_steps", "long_texts", "vocabulary_texts"]

logger = logging.getLogger(__name__)

POOL = 32  # distinct texts in the probe pool (rows cycle through them)
DECODING_STEPS = 2  # decoding steps a probe measures before the rest are extrapolated
_EXTRAPOLATION_SLACK = 1e-3  # the check probe's extrapolation may fall this far under its peak (block rounding)


# -- probe texts and batches -------------------------------------------------------------------------


def vocabulary_texts(tokenizer: Any, n_tokens: int, rng: np.random.Generator) -> list[str]:
    size = tokenizer.vocab_size
    special = np.array(sorted(set(getattr(tokenizer, "all_special_ids", []) or [])), dtype=np.int64)
    texts = []
    for _ in range(POOL):
        ids = rng.integers(0, size, size=n_tokens)
        ids = ids[~np.isin(ids, special)]
        texts.append(tokenizer.decode(ids.tolist(), skip_special_tokens=True))
    return texts


def long_texts(texts: list[str], tokenizer: Any, length: int, rng: np.random.Generator,
                tokenizer_kwargs: dict[str, Any]) -> list[str]:
    """A pool of texts each reaching ``length`` tokens, joining consecutive user texts (round again as often as needed).

    Raises:
        ValueError: the texts hold too few tokens to reach ``length`` at all (only empty or blank ones, say).
    """
    pool = []
    # Texts of a word or two reach a long length only after many rounds of them. Checked at doublings (a few
    # tokenizations per text); texts that added no token over a whole round since the last check (blank ones) never
    # reach it. A bound on the parts instead (one token a text) refused texts that do, where most are blank.
    for start in rng.integers(0, len(texts), size=POOL).tolist():
        parts, check_at, last = [], 1, (0, 0)  # last: (parts, tokens) at the last check
        while True:
            parts.append(texts[(start + len(parts)) % len(texts)])
            if len(parts) < check_at:
                continue
            joined = " ".join(parts)
            reached = tokenize_texts([joined], tokenizer, length, progress=False, **tokenizer_kwargs).lengths[0]
            if reached >= length:
                break
            if len(parts) - last[0] >= len(texts) and reached <= last[1]:
                raise bad_value("texts", f"texts that, joined, reach max_input_token_length={length} tokens (the "
                                f"longest probe; {len(parts)} of them joined made {reached}): give longer texts, or "
                                "texts=None to draw token ids from the vocabulary", f"<{len(texts)} texts>")
            last, check_at = (len(parts), reached), check_at * 2
        pool.append(joined)
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


# -- measuring the decoding steps ----------------------------------------------------------------------


class _EnoughSteps(BaseException):
    """Stops ``work`` once a probe has measured its decoding steps (a BaseException: ``except Exception`` in
    ``work`` or in the model's code lets it through, as it does ``KeyboardInterrupt``)."""


def extrapolate_steps(segments: list[int], calls: int, steps: int | None, slope: float = 0.0) -> int:
    """The peak of a call of ``steps`` forward calls, from the segments of one that ran the first ``calls``.

    ``segments[0]`` is the peak before the first forward call (an encoder, the
    inputs' preparation), ``segments[i]`` that of forward call ``i`` up to the
    next one (the prefill, then one decoding step each). From the second call on
    a step's peak grows linearly in the step: the answer is the largest segment,
    or the last step's peak grown at the steepest measured step (at least
    ``slope`` bytes a step), whichever is larger.

    Example:
        >>> extrapolate_steps([10, 500, 120, 130, 141, 150], calls=5, steps=64)  # 150 + 11 * 59
        799
        >>> extrapolate_steps([10, 500, 120, 130, 141, 150], calls=5, steps=64, slope=12.5)  # 150 + 12.5 * 59
        888
        >>> extrapolate_steps([10, 500, 120, 130, 141, 150], calls=5, steps=5)
        500
    """
    peak = max(segments)
    decoding = np.asarray(segments[2:calls + 1], dtype=np.int64)
    if steps is None or calls >= steps or decoding.size < 1:
        return int(peak)
    steepest = max(slope, float(np.diff(decoding).max()) if decoding.size > 1 else 0.0)
    return int(max(peak, math.ceil(decoding[-1] + steepest * (steps - calls))))


class Prober:
    """Builds, runs and records the probe batches of one calibration."""

    def __init__(self, work: Callable[[Batch], Any], tokenizer: Any, pool: list[str], max_length: int, *, device: Any,
                 memory_device: torch.device, limit_bytes: int | None, cleanup: Callable[[], None] | None,
                 pad_to_multiple_of: int | None, tokenizer_kwargs: dict[str, Any], model: MemoryModel,
                 bar: Any | None, hooked: torch.nn.Module | None, steps: int | None) -> None:
        self.work = work
        self.tokenizer = tokenizer
        self.pool = pool
        self.device = device
        self.memory_device = memory_device
        self.limit_bytes = limit_bytes
        self.cleanup = cleanup
        self.pad_to_multiple_of = pad_to_multiple_of
        self.model = model
        self.bar = bar
        self.hooked = hooked if steps is not None else None  # the model whose forward calls are the steps
        self.steps = steps
        self.stop_after: int | None = None  # forward calls a probe runs; None: whole (until checked)
        self.checked = False  # the first probe that ran checks the extrapolation of decoding steps
        self.step_bytes_per_row = 0.0  # the first probe's largest growth a decoding step, per row
        self.collators: dict[int, TokenCollator] = {}
        self.store = tokenize_texts(pool, tokenizer, max_length, progress=False, **tokenizer_kwargs)
        self.suffix = _trailing_specials(self.store, tokenizer)
        self.failed: list[tuple[int, int]] = []
        self.measured = 0
        self.run_ = 0

    def expect(self) -> None:
        """One more probe in the progress bar's total (``bar``: ``None`` where no bar is shown)."""
        if self.bar is not None:
            self.bar.total += 1

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

    def _steps_run(self, batch: Batch, stop_after: int | None,
                   mem: Any = None) -> int:
        """Calls ``work``, counting ``hooked``'s forward calls (a segment of ``mem`` each), ``stop_after`` at most."""
        calls = 0

        def hook(module: Any, args: Any) -> None:
            nonlocal calls
            if stop_after is not None and calls >= stop_after:
                raise _EnoughSteps
            if mem is not None:
                mem.mark()
            calls += 1

        handle = self.hooked.register_forward_pre_hook(hook) if self.hooked is not None else None
        try:
            self._call(batch)
        except _EnoughSteps:
            pass
        finally:
            if handle is not None:
                handle.remove()
        return calls

    def _measured(self, batch: Batch, stop_after: int | None) -> tuple[list[int], int]:
        with track_peak_memory(self.memory_device, limit_bytes=self.limit_bytes) as mem:  # None off the CPU
            calls = self._steps_run(batch, stop_after, mem)
        return mem.segment_peaks, calls

    def warm_up(self, rows: int, length: int) -> None:
        batch = self.batch(rows, length)
        stop_after = 1 + DECODING_STEPS if self.hooked is not None else None
        call_guarded(self._steps_run, batch.to(self.device) if self.device is not None else batch, stop_after,
                     cleanup=self.cleanup)

    def _check_steps(self, rows: int, segments: list[int], calls: int) -> None:
        """After the first probe (run whole): its decoding steps against ``max_new_tokens``, and the extrapolation.

        The probe's largest growth a step, per row, is every later probe's least
        growth a step per row (a step adds the same KV cache and ids to each
        row at any length); truncated probes are allowed only where the
        extrapolation from its first steps reaches its measured peak.
        """
        if calls > self.steps:
            raise bad_value("max_new_tokens", f"at least the decoding steps of work (model's forward ran {calls} times "
                            "in one call of work on the first probe)", self.steps)
        stop_after = 1 + DECODING_STEPS
        if calls <= stop_after + 1:
            logger.info("work called model's forward %d times on the first probe: every probe runs whole", calls)
            return
        # Its steepest step (block rounding alternates a step's growth between two sizes: the larger errs high),
        # the last segment left out: it runs on to the end of work, after the decoding.
        self.step_bytes_per_row = max(0.0, float(np.diff(np.asarray(segments[2:calls])).max()) / rows)
        peak = max(segments)
        estimate = extrapolate_steps(segments[:stop_after + 1], stop_after, calls, self.step_bytes_per_row * rows)
        if estimate < (1 - _EXTRAPOLATION_SLACK) * peak:
            logger.info("the first probe's peak (%d bytes) is above the extrapolation of its first %d forward calls "
                        "(%d bytes): every probe runs whole", peak, stop_after, estimate)
            return
        self.stop_after = stop_after

    def probe(self, rows: int, length: int, phase: str) -> int | None:
        """Measures one probe; its peak, or ``None`` when it ran out of memory or a failed one dominates it."""
        if dominating(self.failed, rows, length) is not None:
            return None
        batch = self.batch(rows, length)
        width = int(batch["input_ids"].shape[1])
        moved = batch.to(self.device) if self.device is not None else batch
        start = time.perf_counter()
        self.run_ += 1
        attempt = call_guarded(self._measured, moved, self.stop_after,
                               cleanup=self.cleanup)  # an out-of-memory error frees memory before it returns
        del moved, batch
        oom = attempt.error is not None
        peak = None
        if oom:
            self.failed.append((rows, width))
            peak = self.limit_bytes  # the CPU limit, a lower bound (None off the CPU: calibrate refuses it there)
            logger.info("probe of %d rows x %d tokens ran out of memory (%s): recorded, not grown further",
                        rows, width, type(attempt.error).__name__)
        else:
            segments, calls = attempt.output
            if self.hooked is not None and not self.checked:
                self.checked = True
                self._check_steps(rows, segments, calls)
            peak = extrapolate_steps(segments, calls, self.steps if self.hooked is not None else None,
                                      self.step_bytes_per_row * rows)
        seconds = round(time.perf_counter() - start, 3)
        self.model.observe(rows, width, peak, out_of_memory=oom, source=f"calibrate:{phase}", seconds=seconds)
        self.measured += not oom
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{rows}x{width} {'OOM' if oom else f'{peak / MB:.1f} MB'}")
        return None if oom else peak

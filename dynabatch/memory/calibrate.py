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
   rows at the longest length): where the planner will put its batches;
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
import numbers
import time
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import Batch, TokenCollator, pad_token_id_of
from dynabatch.data.tokenization import (
    TokenizedTexts,
    check_tokenizer,
    model_max_length,
    tokenize_texts,
    validate_texts,
)
from dynabatch.memory.budget import MemoryBudget
from dynabatch.memory.guard import call_guarded, is_out_of_memory_error
from dynabatch.memory.measure import check_device, check_measurable_device, track_peak_memory
from dynabatch.memory.model import MemoryModel

__all__ = ["calibrate", "check_model_max_length", "check_positions", "probe_lengths"]

logger = logging.getLogger(__name__)

_POOL = 32  # distinct texts in the probe pool (rows cycle through them)
_MIN_LENGTH = 4
_MAX_ROWS_FACTOR = 64  # probes hold at most this many times batch_size rows
_DECODING_STEPS = 2  # decoding steps a probe measures before the rest are extrapolated
_EXTRAPOLATION_SLACK = 1e-3  # the check probe's extrapolation may fall this far under its peak (block rounding)


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


# -- checks made before the first probe --------------------------------------------------------------


def _positions(config: Any, *names: str) -> tuple[str, int] | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
            return name, int(value)
    return None


def check_positions(config: Any, max_input_token_length: int, max_new_tokens: int = 0, *,
                    length_name: str = "max_input_token_length", new_name: str = "max_new_tokens") -> None:
    """Refuses a prompt plus new tokens beyond the positions of a model (its Hugging Face ``config``).

    A decoder-only model holds the prompt and the new tokens in one sequence:
    ``max_input_token_length + max_new_tokens`` may not exceed its
    ``max_position_embeddings`` (``n_positions`` on GPT-2). An encoder-decoder
    model's encoder takes the prompt and its decoder the new tokens. A config
    without a positions limit (relative positions, as T5's) passes.
    ``length_name`` and ``new_name`` are the arguments' names in the message
    (the command line's are ``--max-length`` and ``--max-new-tokens``).

    Raises:
        ValueError: the model has too few positions.
    """
    if config is None:
        return
    general = ("max_position_embeddings", "n_positions")
    if getattr(config, "is_encoder_decoder", False) is True:
        checks = [(_positions(config, "max_source_positions", *general), max_input_token_length, length_name,
                   "its encoder's positions, for the prompt"),
                  (_positions(config, "max_target_positions", *general), max_new_tokens, new_name,
                   "its decoder's positions, for the new tokens")]
        for found, value, name, what in checks:
            if found is not None and value > found[1]:
                raise bad_value(name, f"at most the model's {found[0]}={found[1]} ({what})", value)
        return
    found = _positions(config, *general)
    if found is None:
        return
    limit_name, limit = found
    if max_new_tokens >= limit:
        raise bad_value(new_name, f"less than the model's {limit_name}={limit} (positions for the prompt and the "
                        "new tokens)", max_new_tokens)
    if max_input_token_length + max_new_tokens > limit:
        rule = (f"at most {limit - max_new_tokens}: the model's {limit_name}={limit} positions hold the prompt and "
                f"the {new_name}={max_new_tokens} new tokens" if max_new_tokens else
                f"at most the model's {limit_name}={limit}")
        raise bad_value(length_name, rule, max_input_token_length)


def check_model_max_length(tokenizer: Any, max_input_token_length: int, *,
                           length_name: str = "max_input_token_length") -> None:
    """Refuses a longest probe beyond the tokenizer's ``model_max_length`` (when the tokenizer sets one).

    Raises:
        ValueError: ``max_input_token_length`` is above it.
    """
    limit = model_max_length(tokenizer)
    if limit is not None and max_input_token_length > limit:
        raise bad_value(length_name, f"at most the tokenizer's model_max_length={limit} (the longest probe has "
                        f"that many tokens; set tokenizer.model_max_length if the model takes longer inputs)",
                        max_input_token_length)


def _measure_device(measure_memory: Any, device: Any, model: Any) -> torch.device:
    if measure_memory in ("auto", True):
        if device is not None:
            return check_measurable_device("device", device)
        params = list(model.parameters())[:1] if callable(getattr(model, "parameters", None)) else []
        if params:
            return params[0].device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_measurable_device("measure_memory", measure_memory, "'auto' or a device ('cpu', 'cuda:0')")


def _check_lengths(lengths: Any, max_input_token_length: int) -> list[int]:
    if lengths is None:
        return probe_lengths(max_input_token_length)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise bad_type("lengths", "None or a sequence of positive integers", lengths)
    grid = set()
    for i, value in enumerate(lengths):
        grid.add(check_positive_int(f"lengths[{i}]", int(value) if isinstance(value, np.integer) else value))
    if not grid:
        raise bad_value("lengths", "None or a non-empty sequence of positive integers", lengths)
    if max(grid) > max_input_token_length:
        raise bad_value("lengths", f"at most max_input_token_length={max_input_token_length}", lengths)
    return sorted(grid | {max_input_token_length})


def _check_tokenizer(tokenizer: Any, texts: Any) -> None:
    check_tokenizer(tokenizer)
    pad_token_id_of(tokenizer)
    if texts is None and not (isinstance(getattr(tokenizer, "vocab_size", None), int)
                              and callable(getattr(tokenizer, "decode", None))):
        raise bad_value("texts", "given for a tokenizer without vocab_size and decode() to draw token ids from",
                        None)


def _hookable(model: Any) -> torch.nn.Module | None:
    return model if isinstance(model, torch.nn.Module) else None


# -- probe texts and batches -------------------------------------------------------------------------


def _vocabulary_texts(tokenizer: Any, n_tokens: int, rng: np.random.Generator) -> list[str]:
    size = tokenizer.vocab_size
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


# -- measuring the decoding steps ----------------------------------------------------------------------


class _EnoughSteps(BaseException):
    """Stops ``work`` once a probe has measured its decoding steps (a BaseException: ``except Exception`` in
    ``work`` or in the model's code lets it through, as it does ``KeyboardInterrupt``)."""


def _extrapolate_steps(segments: list[int], calls: int, steps: int | None, slope: float = 0.0) -> int:
    """The peak of a call of ``steps`` forward calls, from the segments of one that ran the first ``calls``.

    ``segments[0]`` is the peak before the first forward call (an encoder, the
    inputs' preparation), ``segments[i]`` that of forward call ``i`` up to the
    next one (the prefill, then one decoding step each). From the second call on
    a step's peak grows linearly in the step: the answer is the largest segment,
    or the last step's peak grown at the steepest measured step (at least
    ``slope`` bytes a step), whichever is larger.

    Example:
        >>> _extrapolate_steps([10, 500, 120, 130, 141, 150], calls=5, steps=64)  # 150 + 11 * 59
        799
        >>> _extrapolate_steps([10, 500, 120, 130, 141, 150], calls=5, steps=64, slope=12.5)  # 150 + 12.5 * 59
        888
        >>> _extrapolate_steps([10, 500, 120, 130, 141, 150], calls=5, steps=5)
        500
    """
    peak = max(segments)
    decoding = np.asarray(segments[2:calls + 1], dtype=np.int64)
    if steps is None or calls >= steps or decoding.size < 1:
        return int(peak)
    steepest = max(slope, float(np.diff(decoding).max()) if decoding.size > 1 else 0.0)
    return int(max(peak, math.ceil(decoding[-1] + steepest * (steps - calls))))


class _Prober:
    """Builds, runs and records the probe batches of one calibration."""

    def __init__(self, work: Callable[[Batch], Any], tokenizer: Any, pool: list[str], max_length: int, *, device: Any,
                 memory_device: torch.device, limit_bytes: int | None, cleanup: Callable[[], None] | None,
                 pad_to_multiple_of: int | None, tokenizer_kwargs: dict[str, Any], model: MemoryModel,
                 bar: Any, hooked: torch.nn.Module | None, steps: int | None) -> None:
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
        stop_after = 1 + _DECODING_STEPS if self.hooked is not None else None
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
        stop_after = 1 + _DECODING_STEPS
        if calls <= stop_after + 1:
            logger.info("work called model's forward %d times on the first probe: every probe runs whole", calls)
            return
        # Its steepest step (block rounding alternates a step's growth between two sizes: the larger errs high),
        # the last segment left out: it runs on to the end of work, after the decoding.
        self.step_bytes_per_row = max(0.0, float(np.diff(np.asarray(segments[2:calls])).max()) / rows)
        peak = max(segments)
        estimate = _extrapolate_steps(segments[:stop_after + 1], stop_after, calls, self.step_bytes_per_row * rows)
        if estimate < (1 - _EXTRAPOLATION_SLACK) * peak:
            logger.info("the first probe's peak (%d bytes) is above the extrapolation of its first %d forward calls "
                        "(%d bytes): every probe runs whole", peak, stop_after, estimate)
            return
        self.stop_after = stop_after

    def probe(self, rows: int, length: int, phase: str) -> int | None:
        """Measures one probe; its peak, or ``None`` when it ran out of memory or a failed one dominates it."""
        if any(rows >= r and length >= w for r, w in self.failed):
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
            peak = _extrapolate_steps(segments, calls, self.steps if self.hooked is not None else None,
                                      self.step_bytes_per_row * rows)
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
    max_new_tokens: int | None = None,
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
            class, parameters, dtype) so that loading it for another model
            warns; its config's positions are checked, and its forward calls
            are the decoding steps counted for ``max_new_tokens``.
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
        ValueError: a bad argument value (checked before the first probe), a
            ``max_new_tokens`` under the forward calls ``work`` makes, or peaks
            of 0 bytes on every probe (``measure_memory`` is not the device
            ``work`` runs on).
        RuntimeError: ``work`` raised something other than out-of-memory on a
            probe, or ran out of memory on every probe.
    """
    if not callable(work):
        raise bad_type("work", "a callable taking a dynabatch.Batch", work)
    _check_tokenizer(tokenizer, texts)
    batch_size = check_positive_int("batch_size", batch_size)
    max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
    if max_new_tokens is not None:
        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    max_probes = check_positive_int("max_probes", max_probes)
    if isinstance(memory_margin, bool) or not isinstance(memory_margin, (int, float)) or not 0 <= memory_margin < 1:
        raise bad_value("memory_margin", "a number in [0, 1)", memory_margin)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise bad_value("tolerance", "a positive number", tolerance)
    if limit_bytes is not None:
        limit_bytes = check_positive_int("limit_bytes", limit_bytes)
    if cleanup is not None and not callable(cleanup):
        raise bad_type("cleanup", "a callable or None", cleanup)
    grid = _check_lengths(lengths, max_input_token_length)
    check_model_max_length(tokenizer, max_input_token_length)
    check_positions(getattr(model, "config", None), max_input_token_length, max_new_tokens or 0)
    if device is not None:
        check_device("device", device, "None, a str or a torch.device")
    memory_device = _measure_device(measure_memory, device, model)
    if limit_bytes is not None and memory_device.type != "cpu":
        raise bad_value("limit_bytes", "None when measuring a CUDA device (its own memory is the limit)", limit_bytes)
    tokenizer_kwargs = dict(tokenizer_kwargs or {})
    user_texts = None if texts is None else validate_texts(texts)
    hooked = _hookable(model)
    if max_new_tokens is not None and hooked is None:
        logger.info("max_new_tokens without a torch model=: every probe runs whole (its forward calls are the "
                    "decoding steps counted)")
    rng = np.random.default_rng(seed)

    start = time.perf_counter()
    if user_texts is None:
        pool = _vocabulary_texts(tokenizer, 2 * max_input_token_length + 8, rng)
    else:
        pool = _long_texts(user_texts, tokenizer, max_input_token_length, rng, tokenizer_kwargs)

    mm = MemoryModel(device=memory_device, model=model, knots=grid, metadata={
        "batch_size": batch_size, "max_input_token_length": max_input_token_length,
        "memory_margin": float(memory_margin), "texts": "vocabulary" if texts is None else "user texts",
        "seed": seed})
    from tqdm.auto import tqdm

    with tqdm(total=len(grid), desc="calibrating", unit="probe", disable=not progress) as bar:
        prober = _Prober(work, tokenizer, pool, max_input_token_length, device=device, memory_device=memory_device,
                         limit_bytes=limit_bytes, cleanup=cleanup, pad_to_multiple_of=pad_to_multiple_of,
                         tokenizer_kwargs=tokenizer_kwargs, model=mm, bar=bar, hooked=hooked, steps=max_new_tokens)
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
    if max_new_tokens is not None:
        mm.metadata["max_new_tokens"] = max_new_tokens
        mm.metadata["forward_calls_measured"] = prober.stop_after  # None: every probe ran whole
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
        rows = int(MemoryBudget(mm, target(), memory_margin=0.0).rows_allowed(length))
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

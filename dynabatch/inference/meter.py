"""The meter of :func:`dynabatch.run`: what the user sees while a run goes and after it ends.

**Time left, weighted by cost.** Texts run longest first, so rows per second climbs all run long and a rows-based
estimate is wrong by 2-3x. What is left is measured in what it costs, known up front (:class:`TextCosts`: every
text's tokens, or a streamed plan's characters at a fitted rate), and turned into seconds by a time model fitted
online from the batches that ran (:class:`TimeModel`). **Where the wall went**: every worker's loop timed in laps
(:class:`Laps`), the bound named in one line (:func:`name_bound`). **The display**: one line redrawn on a terminal,
else a plain line every :data:`LOG_EVERY` seconds, both refreshed by a :class:`~dynabatch._background.Ticker`.

Example:
    >>> import io
    >>> import numpy as np
    >>> from dynabatch.inference.meter import Meter, TextCosts
    >>> costs = TextCosts(np.array([100, 100, 50, 50]), exact=True)  # every text's tokens, known up front
    >>> now = [0.0]
    >>> meter = Meter(costs, total_rows=4, stream=io.StringIO(), clock=lambda: now[0])
    >>> now[0] = 2.0; meter.add(np.array([0, 1]), rows=2, padded_tokens=200, real_tokens=200)
    >>> now[0] = 3.0; meter.add(np.array([2]), rows=1, padded_tokens=50, real_tokens=50)
    >>> round(meter.estimate().seconds_left, 2)  # 50 tokens left at 1 s per 50 tokens
    1.0
"""

from __future__ import annotations

import math
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from dynabatch._background import Ticker, stage_seconds, waited

__all__ = ["LOG_EVERY", "Estimate", "Laps", "Meter", "TextCosts", "TimeModel", "name_bound"]

LOG_EVERY = 15.0
"""Seconds between the plain lines of the display where its stream is not a terminal."""
REDRAW_EVERY = 1.0
"""Seconds between redraws of the terminal line while nothing finishes."""
_CHARS_PER_TOKEN = 4.0  # a streamed plan's rate before any batch that was not cut at the max length ran
_SPECIAL_TOKENS = 2.0  # tokens a tokenizer adds to every text (BERT's [CLS] and [SEP]), until fitted
_FINE_BINS = 1024  # sizes below this are binned exactly; above, geometrically


class TextCosts:
    """What every text that runs costs, up front, and what is left of it as batches finish, kept as a histogram of
    sizes (exact below 1,024, geometric above): an estimate costs the same at a thousand texts or ten million.

    Args:
        sizes: per input position, its tokens (``exact``), else its characters (turned into tokens at a rate fitted
            by :meth:`learn`, capped at ``max_length``).
        exact: ``sizes`` are token counts.
        max_length: the tokens a text is cut to (characters only).
        runs: which positions run (``None``: every one).
    """

    def __init__(self, sizes: np.ndarray, *, exact: bool, max_length: int | None = None,
                 runs: np.ndarray | None = None) -> None:
        self.sizes = np.maximum(np.asarray(sizes, dtype=np.int64), 0)
        self.exact, self.max_length = exact, max_length
        top = int(self.sizes.max(initial=0)) + 2
        coarse = np.geomspace(_FINE_BINS, max(top, _FINE_BINS + 1), 1024) if top > _FINE_BINS else np.zeros(0)
        self.edges = np.unique(np.concatenate([np.arange(min(top, _FINE_BINS)), np.floor(coarse)]).astype(np.int64))
        self.upper = np.append(self.edges[1:] - 1, top)  # the largest size in each bin
        self.bins = np.searchsorted(self.edges, self.sizes, side="right") - 1
        chosen = self.bins if runs is None else self.bins[runs]
        weights = self.sizes if runs is None else self.sizes[runs]
        self.count = np.bincount(chosen, minlength=len(self.edges)).astype(np.float64)
        self.total = np.bincount(chosen, weights=weights, minlength=len(self.edges)).astype(np.float64)
        self.rate, self.special = 1.0 / _CHARS_PER_TOKEN, _SPECIAL_TOKENS
        self._pending: list[tuple[np.ndarray, float]] = []  # positions done, taken off when an estimate is asked
        self._fit = np.zeros(5)  # sums over the batches not cut at the max length: chars^2, chars*rows, rows^2,
        # chars*tokens, rows*tokens

    def done(self, positions: np.ndarray, scale: float = 1.0) -> None:
        """``positions`` finished (``scale``: ranks claiming alike, each counting for ``scale``)."""
        self._pending.append((positions, scale))

    def _take_off(self) -> None:
        """Takes the positions done since the last estimate off what is left, in one pass."""
        pending, self._pending = self._pending, []
        for scale in {s for _, s in pending}:
            positions = np.concatenate([p for p, s in pending if s == scale])
            bins = self.bins[positions]
            self.count -= scale * np.bincount(bins, minlength=len(self.edges))
            self.total -= scale * np.bincount(bins, weights=self.sizes[positions], minlength=len(self.edges))

    def learn(self, positions: np.ndarray, real_tokens: int, width: int) -> None:
        """A batch of ``positions`` ran with ``real_tokens`` tokens and padded ``width``: where none of its rows
        was cut at the max length, it teaches the rate of tokens per character (least squares: tokens = rate *
        chars + special * rows)."""
        if self.exact or (self.max_length is not None and width >= self.max_length):
            return
        chars, rows = float(self.sizes[positions].sum()), float(len(positions))
        self._fit += (chars * chars, chars * rows, rows * rows, chars * real_tokens, rows * real_tokens)
        cc, cr, rr, ct, rt = self._fit
        det = cc * rr - cr * cr
        rate, special = ((ct * rr - cr * rt) / det, (cc * rt - cr * ct) / det) if det > 1e-9 * cc * rr else (0, -1)
        if rate <= 0 or special < 0:  # one width so far, or a fit the data cannot pin: the rate at the default
            special = min(_SPECIAL_TOKENS, rt / rr)
            rate = max(ct - special * cr, 0.0) / cc if cc else self.rate
        self.rate, self.special = rate, special

    def left(self) -> tuple[float, float]:
        """``(tokens, rows)`` left to run."""
        self._take_off()
        count, total = np.maximum(self.count, 0.0), np.maximum(self.total, 0.0)  # ranks counted alike may overshoot
        rows = float(count.sum())
        if self.exact:
            return float(total.sum()), rows
        tokens = self.rate * total + self.special * count
        if self.max_length is not None:
            cut = self.rate * self.edges + self.special >= self.max_length  # every text of the bin is cut
            tokens = np.where(cut, self.max_length * count, np.minimum(tokens, self.max_length * count))
        return float(tokens.sum()), rows


class TimeModel:
    """Seconds a batch takes from its padded tokens, its rows and the batch itself, fitted online.

    Least squares, each batch weighted by ``0.5 ** (age / half_life)`` (the half-life a quarter of the batches run,
    at least 8). The tokens come first; a part per row, then per batch, counts only for what the batches show apart
    from the tokens (shrunk by :attr:`RIDGE`), and every part is non-negative, so early batches of one width put the
    time on the tokens. The per-row part carries what a row costs whatever its length (``generate``'s new tokens).

    Example:
        >>> from dynabatch.inference.meter import TimeModel
        >>> model = TimeModel()
        >>> for tokens, rows in ((1000, 4), (800, 8), (600, 20), (500, 40)):
        ...     model.add(seconds=0.5 + tokens / 1000 + rows / 100, padded_tokens=tokens, rows=rows)
        >>> round(model.seconds(batches=2, padded_tokens=500, rows=50), 2)  # 2.0, less what the shrinking takes
        1.95
    """

    RIDGE = 1e-3  # of a part's own size: how far apart from the tokens the batches must vary before it counts

    def __init__(self) -> None:
        self._sums = [0.0] * 9  # features padded tokens, rows, 1 (the batch): pp, pr, p1, rr, r1, 11, yp, yr, y1
        self.batches = 0
        self._solved: tuple[int, np.ndarray | None] = (0, None)

    @property
    def coef(self) -> np.ndarray | None:
        """Seconds per padded token, per row and per batch (``None`` before any batch); solved when asked."""
        if self._solved[0] != self.batches:
            self._solved = (self.batches, self._solve())
        return self._solved[1]

    def add(self, *, seconds: float, padded_tokens: float, rows: float) -> None:
        keep = 0.5 ** (1.0 / max(8.0, self.batches / 4))
        p, r, y = float(padded_tokens), float(rows), float(seconds)
        new = (p * p, p * r, p, r * r, r, 1.0, y * p, y * r, y)
        self._sums = [keep * old + value for old, value in zip(self._sums, new)]
        self.batches += 1

    def _solve(self) -> np.ndarray:
        pp, pr, p1, rr, r1, one, yp, yr, y1 = self._sums
        self._xx = np.array([[pp, pr, p1], [pr, rr, r1], [p1, r1, one]])
        self._xy = np.array([yp, yr, y1])
        for kept in ([0, 1, 2], [0, 2], [0, 1], [0], [1], [2]):  # the first whose parts are all non-negative
            coef = self._fit(kept)
            if coef is not None and (coef >= 0).all():
                return coef
        return np.zeros(3)

    def _fit(self, kept: list[int]) -> np.ndarray | None:
        """Least squares on the features ``kept``, in order, each orthogonal to those before it (a Cholesky factor of
        their Gram matrix) and its part shrunk there."""
        gram = self._xx[np.ix_(kept, kept)]
        if gram[0, 0] <= 0:
            return None
        try:
            factor = np.linalg.cholesky(gram + 1e-12 * np.diag(np.diag(gram)) + 1e-300 * np.eye(len(kept)))
        except np.linalg.LinAlgError:
            return None
        theta = np.linalg.solve(factor, self._xy[kept])
        own = np.diag(factor) ** 2  # each feature's size apart from the features before it
        theta[1:] *= own[1:] / (own[1:] + self.RIDGE * np.diag(gram)[1:])
        coef = np.zeros(3)
        coef[kept] = np.linalg.solve(factor.T, theta)
        return coef

    def seconds(self, *, batches: float, padded_tokens: float, rows: float) -> float:
        """The seconds ``batches`` batches of ``padded_tokens`` and ``rows`` in all take (0 before any batch)."""
        coef = self.coef
        if coef is None:
            return 0.0
        return float(coef @ np.array([padded_tokens, rows, batches]))


@dataclass
class Estimate:
    """What the display shows: rows done of ``rows_total`` (``None``: unknown), the recent rates, and the seconds
    left (``None`` before an estimate can be made)."""

    rows_done: float
    rows_total: int | None
    elapsed: float
    texts_per_s: float | None
    tokens_per_s: float | None
    seconds_left: float | None


def _clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _Recent:
    """Exponentially weighted sums over the batches (half-life :attr:`HALF_LIFE` seconds of run time): the display's
    rates and a batch's typical padded tokens and padding."""

    HALF_LIFE = 30.0

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.at: float | None = None

    def add(self, now: float, **values: float) -> None:
        keep = 1.0 if self.at is None else 0.5 ** ((now - self.at) / self.HALF_LIFE)
        self.at = now
        for name, value in values.items():
            self.sums[name] = keep * self.sums.get(name, 0.0) + value

    def ratio(self, top: str, bottom: str) -> float | None:
        below = self.sums.get(bottom, 0.0)
        return self.sums.get(top, 0.0) / below if below > 0 else None


class Laps:
    """A worker's loop timed end to end, lap by lap: :meth:`lap` gives the time since the last lap first to the
    parts the caller measured (``known``), then to what the thread waited on background threads (``"wait <their
    stage>"``), the rest to ``stage``; the stages add up to the wall (:meth:`summary`).

    Example:
        >>> from dynabatch.inference.meter import Laps
        >>> laps = Laps()
        >>> time.sleep(0.02); added = laps.lap("build", {"device": 0.01})
        >>> sorted(added), abs(sum(laps.summary()["stages"].values()) - laps.summary()["wall"]) < 1e-9
        (['build', 'device'], True)
    """

    def __init__(self, origin: float | None = None) -> None:
        self.start = self._last = time.perf_counter()
        self.origin = self.start if origin is None else origin
        self.seconds: dict[str, float] = {}
        self._waits = waited()

    def lap(self, stage: str, known: dict[str, float] | None = None) -> dict[str, float]:
        """Ends a lap; returns the seconds it added, by stage."""
        now, waits = time.perf_counter(), waited()
        rest = now - self._last
        added: dict[str, float] = {}
        parts = list((known or {}).items())
        parts += [(f"wait {_STAGE_OF_THREAD.get(name, name)}", total - self._waits.get(name, 0.0))
                  for name, total in waits.items()]
        for name, value in parts:
            value = min(max(value, 0.0), rest)
            if value > 0:
                added[name] = added.get(name, 0.0) + value
                rest -= value
        added[stage] = added.get(stage, 0.0) + rest
        for name, value in added.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + value
        self._last, self._waits = now, waits
        return added

    def at(self) -> float:
        """Seconds from the origin (the run's start) to the last lap."""
        return self._last - self.origin

    def summary(self) -> dict[str, Any]:
        """``{"wall": seconds since the laps began, "stages": {stage: seconds}}`` up to the last lap."""
        return {"wall": self._last - self.start, "stages": dict(self.seconds)}


_STAGE_OF_THREAD = {"dynabatch-tokenize": "tokenize", "dynabatch-prefetch": "build", "dynabatch-read-ahead": "read"}
"""The stage each background thread runs, by its name (another name is its own stage)."""


class Meter:
    """The run's progress: fed by every worker's loop (:meth:`add`), shown on ``stream``, read by the report.

    Args:
        costs: what every text that runs costs (:class:`TextCosts`), or ``None``: unknown, the time left too.
        total_rows: rows that run (``None``: unknown).
        scale: ranks claiming chunks alike: this rank counts for ``scale`` of them (the main rank shows the whole).
        stream: where the display goes (``None``: no display; the figures are still kept).
        stored: rows a store held before the run (a resumed run says so first, of ``inputs`` in all).
        clock: the time (tests).
        desc: the display's name.
    """

    def __init__(self, costs: TextCosts | None, *, total_rows: int | None, scale: int = 1,
                 stream: TextIO | None = None, stored: int = 0, inputs: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, desc: str = "dynabatch") -> None:
        self.costs, self.total_rows, self.scale = costs, total_rows, scale
        self.stream, self.clock, self.desc = stream, clock, desc
        self.model, self.recent = TimeModel(), _Recent()
        self.rows = self.tokens = self.padded = self.batches = 0
        self.started = clock()
        self.first: float | None = None  # when the first batch finished
        self.last: float | None = None  # when the last batch finished
        self.accounting = 0.0  # CPU seconds spent in add() and the display: the meter's own cost
        self.terminal = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._lock = threading.Lock()
        self._shown_at = -math.inf
        self._closed = False
        self._ticker: Ticker | None = None
        if stream is not None and stored:
            of = f" of {inputs:,}" if inputs is not None else ""
            to_run = f"; {total_rows:,} to run" if total_rows is not None else ""
            self._write_line(f"{self.desc}: {stored:,}{of} stored before{to_run}\n")
        if stream is not None:
            self._ticker = Ticker(self._tick, seconds=REDRAW_EVERY if self.terminal else LOG_EVERY,
                                  name="dynabatch-meter")
            self._ticker.start()

    def add(self, positions: np.ndarray | None, *, rows: int, padded_tokens: int, real_tokens: int,
            width: int | None = None) -> None:
        """A batch finished: ``rows`` (finished or set aside) at input ``positions``, its padded and real tokens
        and its width."""
        start = time.thread_time()
        with self._lock:
            now = self.clock()
            interval = now - (self.last if self.last is not None else self.started)
            if self.first is not None:  # the first interval holds the start-up: left out of the fit
                self.model.add(seconds=interval, padded_tokens=padded_tokens, rows=rows)
            else:
                self.first = now
            self.last = now
            self.rows += rows
            self.tokens += real_tokens
            self.padded += padded_tokens
            self.batches += 1
            self.recent.add(now, rows=rows, tokens=real_tokens, padded=padded_tokens, batches=1,
                            seconds=interval)
            if self.costs is not None and positions is not None and len(positions):
                if width is not None:
                    self.costs.learn(positions, real_tokens, width)
                self.costs.done(positions, self.scale)
            if self.terminal and now - self._shown_at >= 0.2:
                self._show(now)
            self.accounting += time.thread_time() - start

    def estimate(self) -> Estimate:
        """The figures the display shows, now."""
        now = self.clock()
        rows_done = self.rows * self.scale
        texts = self.recent.ratio("rows", "seconds")
        tokens = self.recent.ratio("tokens", "seconds")
        return Estimate(rows_done, self.total_rows, now - self.started,
                        None if texts is None else texts * self.scale, None if tokens is None else tokens * self.scale,
                        self._seconds_left(now))

    def _seconds_left(self, now: float) -> float | None:
        if self.last is None:
            return None
        if self.costs is None:  # no costs: rows left at the recent rate
            rate = self.recent.ratio("rows", "seconds")
            left = None if self.total_rows is None or not rate else (self.total_rows - self.rows * self.scale)
            return None if left is None else max(0.0, left / (rate * self.scale) - (now - self.last))
        tokens, rows = self.costs.left()
        if rows <= 0:
            return 0.0
        padded = tokens * (self.recent.ratio("padded", "tokens") or 1.0)
        if self.model.coef is None:  # one batch so far: its own pace, start-up included
            seconds = (self.first - self.started) * padded / max(self.padded, 1)
        else:
            seconds = self.model.seconds(batches=self._batches_left(padded, rows), padded_tokens=padded, rows=rows)
        return max(0.0, seconds / self.scale - (now - self.last))

    def _batches_left(self, padded: float, rows: float) -> float:
        """Batches left: the geometric mean of as many as the recent batches' padded tokens make and as many as their
        rows make (batches hold fewer tokens and more rows as texts shorten)."""
        by_tokens = padded / (self.recent.ratio("padded", "batches") or 1.0)
        by_rows = rows / (self.recent.ratio("rows", "batches") or 1.0)
        return min(max(math.sqrt(by_tokens * by_rows), 1.0), rows)

    # -- the display ---------------------------------------------------------------------------------------------
    def line(self, *, final: bool = False) -> str:
        """The display's line now (``final``: the closing one, with the run's average rates)."""
        e = self.estimate()
        done = f"{int(e.rows_done):,}/{e.rows_total:,}" if e.rows_total is not None else f"{int(e.rows_done):,}"
        if final:
            seconds = (self.last or self.clock()) - self.started
            texts = self.rows * self.scale / seconds if seconds > 0 and self.rows else None
            tokens = self.tokens * self.scale / seconds if seconds > 0 and self.rows else None
            return (f"{self.desc}: {done} rows in {_clock_text(seconds)}, {_rate(texts, 'texts')}, "
                    f"{_rate(tokens, 'tokens')}")
        share = ""
        if e.rows_total:
            fraction = min(1.0, e.rows_done / e.rows_total)
            share = f"{fraction:4.0%} |{_bar(fraction)}| " if self.terminal else f"{fraction:.0%} "
        if self.last is None:
            return f"{self.desc}: {share}{done} rows, {_clock_text(e.elapsed)} elapsed, waiting for the first batch"
        left = f", {_clock_text(e.seconds_left)} left" if e.seconds_left is not None else ""
        return (f"{self.desc}: {share}{done} rows, {_clock_text(e.elapsed)} elapsed{left}, "
                f"{_rate(e.texts_per_s, 'texts')}, {_rate(e.tokens_per_s, 'tokens')}")

    def _show(self, now: float) -> None:
        self._shown_at = now
        text = self.line()
        if self.terminal:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self._write_line("\r" + text[:width].ljust(width))
        else:
            self._write_line(text + "\n")

    def _write_line(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the run goes on without its display
            self.stream = None

    def _tick(self) -> None:
        start = time.thread_time()
        with self._lock:
            if not self._closed and self.stream is not None:
                self._show(self.clock())
            self.accounting += time.thread_time() - start

    def close(self) -> None:
        """Stops the timed refresh and prints the final line, once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._ticker is not None:
            self._ticker.close()
        if self.stream is not None:
            end = "\r" + " " * (shutil.get_terminal_size((100, 20)).columns - 1) + "\r" if self.terminal else ""
            self._write_line(end + self.line(final=True) + "\n")


def _rate(value: float | None, unit: str) -> str:
    return f"{value:,.0f} {unit}/s" if value is not None else f"- {unit}/s"


def _bar(fraction: float, width: int = 20) -> str:
    filled = fraction * width
    whole = int(filled)
    return ("█" * whole + (" ▏▎▍▌▋▊▉"[int((filled - whole) * 8)] if whole < width else "")).ljust(width)


def name_bound(shares: dict[str, float], tokenize_share: float | None = None) -> str:
    """The one line that names what bound a run, from the shares of its wall by stage (``tokenize_share``: how much
    of the wall the tokenizing thread worked).

    Example:
        >>> from dynabatch.inference.meter import name_bound
        >>> name_bound({"device": 0.94, "store": 0.02})
        'device-bound: the device was busy 94% of the run'
        >>> name_bound({"device": 0.40, "wait tokenize": 0.55}, tokenize_share=0.61).split(";")[0]
        'host-bound: tokenizing took 61% of the wall while the device waited 60%'
    """
    device = shares.get("device", 0.0)
    waited = 1.0 - device
    groups = {"tokenize": shares.get("wait tokenize", 0.0), "read": shares.get("wait read", 0.0),
              "build": shares.get("build", 0.0) + shares.get("wait build", 0.0),
              "plan": shares.get("plan", 0.0), "store": shares.get("store", 0.0)}
    stage, share = max(groups.items(), key=lambda kv: kv[1])
    if device >= share:
        return f"device-bound: the device was busy {device:.0%} of the run"
    if stage == "tokenize":
        took = tokenize_share if tokenize_share is not None else share
        return (f"host-bound: tokenizing took {took:.0%} of the wall while the device waited {waited:.0%}; "
                "--tokenize-cores or more cores would help")
    if stage == "store":
        return (f"store-bound: writing the store took {share:.0%} of the wall while the device waited "
                f"{waited:.0%}; a faster disk for the output would help")
    what = {"read": "reading the input", "build": "building batches", "plan": "planning batches"}[stage]
    return f"host-bound: {what} took {share:.0%} of the wall while the device waited {waited:.0%}"


def background_shares(before: dict[str, tuple[float, float]], wall: float) -> dict[str, float]:
    """Each background stage's working seconds since ``before`` (a :func:`dynabatch._background.stage_seconds`
    snapshot), as a share of ``wall``."""
    shares: dict[str, float] = {}
    for name, (working, _) in stage_seconds().items():
        seconds = working - before.get(name, (0.0, 0.0))[0]
        if seconds > 0 and wall > 0:
            stage = _STAGE_OF_THREAD.get(name, name)
            shares[stage] = shares.get(stage, 0.0) + seconds / wall
    return shares


def meter_for(source: Any, *, total_rows: int | None, runs: np.ndarray | None, progress: bool, scale: int = 1,
              stored: int = 0, inputs: int | None = None) -> Meter:
    """The run's meter: costs from ``source``'s plan (token lengths, or a stream's characters), ``runs``: the
    positions that run."""
    sizes = source.text_sizes() if source is not None else None
    costs = None if sizes is None else TextCosts(sizes[0], exact=sizes[1], max_length=sizes[2], runs=runs)
    return Meter(costs, total_rows=total_rows, scale=scale, stream=sys.stderr if progress else None, stored=stored,
                 inputs=inputs)

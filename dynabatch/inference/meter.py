"""The meter of :func:`dynabatch.run`: what the user sees while a run goes and after it ends.

The time left is what the texts left cost (:class:`TextCosts`; they run longest first, so a rate of rows is wrong
by 2-3x) over a time model fitted online (:class:`TimeModel`); each worker's loop is timed in :class:`Laps` and
:func:`name_bound` names the bound. The display is one line redrawn on a terminal, else a plain line every
:data:`LOG_EVERY` seconds.

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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from dynabatch._background import Ticker, stage_seconds, waited

__all__ = ["LOG_EVERY", "Estimate", "Laps", "Meter", "TextCosts", "TimeModel", "name_bound"]

LOG_EVERY = 15.0  # seconds between the plain lines of the display where its stream is not a terminal
REDRAW_EVERY = 1.0  # seconds between redraws of the terminal line while nothing finishes
_CHARS_PER_TOKEN = 4.0  # a streamed plan's rate before any batch that was not cut at the max length ran
_SPECIAL_TOKENS = 2.0  # tokens a tokenizer adds to every text (BERT's [CLS] and [SEP]), until fitted
# the share of the rows' size apart from the characters' the batches must show before tokens per row are fitted:
# the first batches, all of long texts, hardly differ in characters per row, and a fit of three such put 88-144
# tokens on every row (the tokenizer adds 2), the time left of the short texts after them 2-3x the truth
_APART = 0.01
_FINE_BINS = 1024  # sizes below this are binned exactly; above, geometrically
_HALF_LIFE = 30.0  # seconds of run time: the half-life of the recent sums the display's rates are read from
# the stage each background thread runs, by its name (another name is its own stage)
_STAGE_OF_THREAD = {"dynabatch-tokenize": "tokenize", "dynabatch-prefetch": "build", "dynabatch-read-ahead": "read",
                    "dynabatch-store": "store"}


class TextCosts:
    """What the texts that run cost, less what finished: a histogram of sizes (exact below 1,024, geometric above),
    so an estimate costs the same at a thousand texts or ten million.

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
        coarse = np.geomspace(_FINE_BINS, top, 1024) if top > _FINE_BINS else np.zeros(0)
        self.edges = np.unique(np.concatenate([np.arange(min(top, _FINE_BINS)), np.floor(coarse)]).astype(np.int64))
        self.bins = np.searchsorted(self.edges, self.sizes, side="right") - 1
        running = slice(None) if runs is None else runs
        self.count = np.bincount(self.bins[running], minlength=len(self.edges)).astype(np.float64)
        self.total = np.bincount(self.bins[running], weights=self.sizes[running], minlength=len(self.edges))
        self.rate, self.special = 1.0 / _CHARS_PER_TOKEN, _SPECIAL_TOKENS
        self._pending: list[tuple[np.ndarray, float]] = []  # positions done, taken off when an estimate is asked
        self._fit = np.zeros(5)  # over the batches not cut: chars^2, chars*rows, rows^2, chars*tokens, rows*tokens

    def done(self, positions: np.ndarray, scale: float = 1.0) -> None:
        """``positions`` finished (``scale``: ranks claiming alike, each counting for ``scale``)."""
        self._pending.append((positions, scale))

    def learn(self, positions: np.ndarray, real_tokens: int, width: int) -> None:
        """A batch of ``positions`` ran with ``real_tokens`` tokens, padded to ``width``: unless a row was cut at the
        max length, it teaches the tokens per character (least squares: tokens = rate * chars + special * rows)."""
        if self.exact or (self.max_length is not None and width >= self.max_length):
            return
        chars, rows = float(self.sizes[positions].sum()), float(len(positions))
        self._fit += (chars * chars, chars * rows, rows * rows, chars * real_tokens, rows * real_tokens)
        cc, cr, rr, ct, rt = self._fit
        det = cc * rr - cr * cr  # over cc * rr: the share of the rows' size apart from the characters'
        rate, special = ((ct * rr - cr * rt) / det, (cc * rt - cr * ct) / det) if det > _APART * cc * rr else (0, -1)
        if rate <= 0 or special < 0:  # one width so far, or a fit the data cannot pin: the rate at the default
            special = min(_SPECIAL_TOKENS, rt / rr)
            rate = max(ct - special * cr, 0.0) / cc if cc else self.rate
        self.rate, self.special = rate, special

    def left(self) -> tuple[float, float]:
        """``(tokens, rows)`` left to run."""
        pending, self._pending = self._pending, []
        for scale in {s for _, s in pending}:  # the positions done since the last estimate, one pass a scale
            positions = np.concatenate([p for p, s in pending if s == scale])
            self.count -= scale * np.bincount(self.bins[positions], minlength=len(self.edges))
            self.total -= scale * np.bincount(self.bins[positions], weights=self.sizes[positions],
                                              minlength=len(self.edges))
        count, total = np.maximum(self.count, 0.0), np.maximum(self.total, 0.0)  # ranks counted alike may overshoot
        if self.exact:
            return float(total.sum()), float(count.sum())
        tokens = self.rate * total + self.special * count
        if self.max_length is not None:
            cut = self.rate * self.edges + self.special >= self.max_length  # every text of the bin is cut
            tokens = np.where(cut, self.max_length * count, np.minimum(tokens, self.max_length * count))
        return float(tokens.sum()), float(count.sum())


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

    def add(self, *, seconds: float, padded_tokens: float, rows: float) -> None:
        keep = 0.5 ** (1.0 / max(8.0, self.batches / 4))
        p, r, y = float(padded_tokens), float(rows), float(seconds)
        new = (p * p, p * r, p, r * r, r, 1.0, y * p, y * r, y)
        self._sums = [keep * old + value for old, value in zip(self._sums, new)]
        self.batches += 1

    @property
    def coef(self) -> np.ndarray | None:
        """Seconds per padded token, per row and per batch (``None`` before any batch), solved when asked: least
        squares on the first feature set below whose parts come out non-negative, each feature orthogonal to those
        before it (a Cholesky factor of their Gram matrix), its part shrunk there."""
        if not self.batches:
            return None
        pp, pr, p1, rr, r1, one, yp, yr, y1 = self._sums
        xx, xy = np.array([[pp, pr, p1], [pr, rr, r1], [p1, r1, one]]), np.array([yp, yr, y1])
        for kept in ([0, 1, 2], [0, 2], [0, 1], [0], [1], [2]):
            gram = xx[np.ix_(kept, kept)]
            if gram[0, 0] <= 0:
                continue
            try:
                factor = np.linalg.cholesky(gram + 1e-12 * np.diag(np.diag(gram)) + 1e-300 * np.eye(len(kept)))
            except np.linalg.LinAlgError:
                continue
            theta = np.linalg.solve(factor, xy[kept])
            own = np.diag(factor) ** 2  # each feature's size apart from the features before it
            theta[1:] *= own[1:] / (own[1:] + self.RIDGE * np.diag(gram)[1:])
            coef = np.zeros(3)
            coef[kept] = np.linalg.solve(factor.T, theta)
            if (coef >= 0).all():
                return coef
        return np.zeros(3)

    def seconds(self, *, batches: float, padded_tokens: float, rows: float) -> float:
        """The seconds ``batches`` batches of ``padded_tokens`` and ``rows`` in all take (0 before any batch)."""
        coef = self.coef
        return 0.0 if coef is None else float(coef @ np.array([padded_tokens, rows, batches]))


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


class Laps:
    """A worker's loop timed lap by lap: :meth:`lap` gives the time since the last lap first to the parts the caller
    measured (``known``), then to what the thread waited on background threads (``"wait <their stage>"``), the rest
    to ``stage``; the stages add up to the wall (:meth:`summary`).

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
        parts = [*(known or {}).items(), *((f"wait {_STAGE_OF_THREAD.get(name, name)}",
                                            total - self._waits.get(name, 0.0)) for name, total in waits.items())]
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
        claiming_rank: under ranks claiming chunks, this rank's number: its closing line counts the rows this rank
            ran, named (what the other ranks ran is theirs to say; the live line's estimate counts them as its own).
    """

    def __init__(self, costs: TextCosts | None, *, total_rows: int | None, scale: int = 1,
                 stream: TextIO | None = None, stored: int = 0, inputs: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, desc: str = "dynabatch",
                 claiming_rank: int | None = None) -> None:
        self.costs, self.total_rows, self.scale = costs, total_rows, scale
        self.stream, self.clock, self.desc, self.claiming_rank = stream, clock, desc, claiming_rank
        self.drained = False  # every item this worker's loop was given ran: a claiming rank found no chunk left
        self.model = TimeModel()
        # weighted by age; "busy": the seconds each batch took its worker (from its worker's batch before), "paced":
        # the wall those batches took (from any batch before): several workers (run's devices) run busy/paced at once
        self.recent = dict.fromkeys(("rows", "tokens", "padded", "batches", "seconds", "busy", "paced"), 0.0)
        self.rows = self.tokens = 0
        self.started = clock()
        self.last: float | None = None  # when the last batch finished
        self._last_of: dict[Any, float] = {}  # when each worker's last batch finished
        self.accounting = 0.0  # CPU seconds spent in add() and the display: the meter's own cost
        self.terminal = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._lock = threading.Lock()
        self._shown_at = -math.inf
        self._closed = False
        self._ticker = Ticker(self._tick, seconds=REDRAW_EVERY if self.terminal else LOG_EVERY, name="dynabatch-meter")
        if stream is not None and stored:
            of = f" of {inputs:,}" if inputs is not None else ""
            to_run = f"; {total_rows:,} to run" if total_rows is not None else ""
            self._write_line(f"{self.desc}: {stored:,}{of} stored before{to_run}\n")
        if stream is not None:
            self._ticker.start()

    def add(self, positions: np.ndarray | None, *, rows: int, padded_tokens: int, real_tokens: int,
            width: int | None = None, worker: Any = None, whole: bool = True) -> None:
        """A batch finished: ``rows`` (finished or set aside) at input ``positions``, its padded and real tokens,
        its width, the worker that ran it (any name, the same for each of its batches), and whether it ran
        ``whole`` (not halved to find a row that raised or ran out of memory).

        The time model is fitted on each worker's own time per batch: on several workers the wall between two
        batches says nothing of either (a pair that ends together is 0 s apart, the next pair a batch's time). A
        batch not run whole is left out of it: its time holds every call of its halves, its padded tokens only
        those of the rows that finished (one such batch among the first, alike ones put the time on the rows)."""
        start = time.thread_time()
        with self._lock:
            now = self.clock()
            interval = now - (self.last if self.last is not None else self.started)
            busy = paced = 0.0
            if worker in self._last_of:  # a worker's first batch holds the start-up: left out of the fit
                busy, paced = now - self._last_of[worker], interval
                if whole:
                    self.model.add(seconds=busy, padded_tokens=padded_tokens, rows=rows)
            self.last = self._last_of[worker] = now
            self.rows += rows
            self.tokens += real_tokens
            keep = 0.5 ** (interval / _HALF_LIFE)
            for name, value in (("rows", rows), ("tokens", real_tokens), ("padded", padded_tokens), ("batches", 1),
                                ("seconds", interval), ("busy", busy), ("paced", paced)):
                self.recent[name] = keep * self.recent[name] + value
            if self.costs is not None and positions is not None and len(positions):
                if width is not None:
                    self.costs.learn(positions, real_tokens, width)
                self.costs.done(positions, self.scale)
            if self.terminal and now - self._shown_at >= 0.2:
                self._show(now)
            self.accounting += time.thread_time() - start

    def _recent(self, top: str, bottom: str, times: float = 1.0) -> float | None:
        """``times`` ``top`` per ``bottom`` over the recent batches (``None`` before any)."""
        return times * self.recent[top] / self.recent[bottom] if self.recent[bottom] > 0 else None

    def estimate(self) -> Estimate:
        """The figures the display shows, now."""
        now = self.clock()
        done = self.rows * self.scale  # ranks claiming alike: an estimate, over the total where they did not
        if self.total_rows is not None:  # (one rank claimed a small corpus's only chunk: 14/7 rows on 2 ranks)
            done = min(done, self.total_rows)
        return Estimate(done, self.total_rows, now - self.started,
                        self._recent("rows", "seconds", self.scale), self._recent("tokens", "seconds", self.scale),
                        self._seconds_left(now))

    def _seconds_left(self, now: float) -> float | None:
        if self.last is None:
            return None
        if self.costs is None:  # no costs: rows left at the recent rate
            rate = self._recent("rows", "seconds")
            if self.total_rows is None or not rate:
                return None
            seconds = (self.total_rows - self.rows * self.scale) / rate
        else:
            tokens, rows = self.costs.left()
            if rows <= 0:
                return 0.0
            padded = tokens * (self._recent("padded", "tokens") or 1.0)
            if not self.model.batches:  # no worker's second batch yet: the pace so far, start-up included
                seconds = self.recent["seconds"] * padded / max(self.recent["padded"], 1)
            else:  # batches left: the geometric mean of as many as the recent batches' padded tokens make and as
                # many as their rows make (batches hold fewer tokens and more rows as texts shorten)
                by_tokens = padded / (self._recent("padded", "batches") or 1.0)
                by_rows = rows / (self._recent("rows", "batches") or 1.0)
                batches = min(max(math.sqrt(by_tokens * by_rows), 1.0), rows)
                at_once = self._recent("busy", "paced") or 1.0  # the workers' batches running at once
                seconds = self.model.seconds(batches=batches, padded_tokens=padded, rows=rows) / at_once
        return max(0.0, seconds / self.scale - (now - self.last))

    # -- the display ---------------------------------------------------------------------------------------------
    def line(self, *, final: bool = False) -> str:
        """The display's line now (``final``: the closing one, with the run's average rates)."""
        e = self.estimate()
        done = f"{int(e.rows_done):,}/{e.rows_total:,}" if e.rows_total is not None else f"{int(e.rows_done):,}"
        if final and self.claiming_rank is not None:
            return self._claimed_line(e.rows_total)
        if final:
            seconds = (self.last or self.clock()) - self.started
            texts = e.rows_done / seconds if seconds > 0 and self.rows else None
            tokens = self.tokens * e.rows_done / self.rows / seconds if seconds > 0 and self.rows else None
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

    def _claimed_line(self, total: int | None) -> str:
        """A claiming rank's closing line: the rows it ran of the whole, at its own rates; ``drained``: it ends
        because no chunk is left to claim (a rank that claimed none ran 0 rows, and is done)."""
        seconds = (self.last or self.clock()) - self.started
        texts = self.rows / seconds if seconds > 0 and self.rows else None
        tokens = self.tokens / seconds if seconds > 0 and self.rows else None
        of = f" of {total:,}" if total is not None else ""
        return (f"{self.desc} rank {self.claiming_rank}: {self.rows:,}{of} rows ran on this rank in "
                f"{_clock_text(seconds)}, {_rate(texts, 'texts')}, {_rate(tokens, 'tokens')}"
                + ("; no chunk left to claim" if self.drained else ""))

    def _show(self, now: float) -> None:
        self._shown_at = now
        if self.terminal:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self._write_line("\r" + self.line()[:width].ljust(width))
        else:
            self._write_line(self.line() + "\n")

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
        self._ticker.close()
        if self.stream is not None:
            end = "\r" + " " * (shutil.get_terminal_size((100, 20)).columns - 1) + "\r" if self.terminal else ""
            self._write_line(end + self.line(final=True) + "\n")


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _rate(value: float | None, unit: str) -> str:
    return f"{value:,.0f} {unit}/s" if value is not None else f"- {unit}/s"


def _bar(fraction: float, width: int = 20) -> str:
    filled = fraction * width
    whole = int(filled)
    return ("█" * whole + (" ▏▎▍▌▋▊▉"[int((filled - whole) * 8)] if whole < width else "")).ljust(width)


def name_bound(shares: dict[str, float], tokenize_share: float | None = None, *,
               tokenize_cores: Sequence[int] | None = None) -> str:
    """The one line that names what bound a run, from the shares of its wall by stage (``tokenize_share``: how much
    of the wall the tokenizing thread worked; ``tokenize_cores``: ``[cores it was allowed, cores this process may
    use]``, where a cap below the process's cores is what to raise before buying cores).

    Example:
        >>> from dynabatch.inference.meter import name_bound
        >>> name_bound({"device": 0.94, "store": 0.02})
        'device-bound: the device was busy 94% of the run'
        >>> name_bound({"device": 0.40, "wait tokenize": 0.55}, tokenize_share=0.61).split(";")[0]
        'host-bound: tokenizing took 61% of the wall while the device waited 60%'
        >>> name_bound({"device": 0.40, "wait tokenize": 0.55}, tokenize_cores=[1, 8]).split("; ")[1]
        'raise tokenize_cores (now 1 of 8 cores)'
    """
    device = shares.get("device", 0.0)
    took = {"tokenizing": shares.get("wait tokenize", 0.0), "reading the input": shares.get("wait read", 0.0),
            "building batches": shares.get("build", 0.0) + shares.get("wait build", 0.0),
            "planning batches": shares.get("plan", 0.0),
            "writing the store": shares.get("store", 0.0) + shares.get("wait store", 0.0)}
    what, share = max(took.items(), key=lambda kv: kv[1])
    if device >= share:
        return f"device-bound: the device was busy {device:.0%} of the run"
    if what == "tokenizing" and tokenize_share is not None:
        share = tokenize_share
    hint = {"tokenizing": "; more CPU cores would help",  # it ran on every core this process may use
            "writing the store": "; a faster disk for the output would help"}.get(what, "")
    if what == "tokenizing" and tokenize_cores is not None and tokenize_cores[0] < tokenize_cores[1]:
        hint = f"; raise tokenize_cores (now {tokenize_cores[0]} of {tokenize_cores[1]} cores)"  # the caller's cap
    bound = "store-bound" if what == "writing the store" else "host-bound"
    return f"{bound}: {what} took {share:.0%} of the wall while the device waited {1.0 - device:.0%}{hint}"


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

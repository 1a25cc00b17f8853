"""The spike search: the batch sizes the spike classifier allows over lengths sorted longest first. Pure numpy.

For a batch starting at sorted position ``p`` the candidates are
:meth:`PlanSettings.candidates <dynabatch.sampling.plan_settings.PlanSettings.candidates>`
capped at what remains; the batch takes the largest candidate such that it and
every smaller one have a spike probability at or below ``threshold``, or
``batch_size`` when none has; then at most the token cap at ``p``
(``max_tokens`` over the batch's padded width), when there is one. Features
come from prefix sums, so no Python loop runs over texts, and two shortcuts
give exactly that batch-by-batch result with few classifier calls:

* *runs of equal lengths*: when every candidate window from ``p`` lies inside
  one run of equal lengths ``L``, the features (and so the choice) depend on
  ``L`` alone; the choice for every such ``L`` comes from one classifier call,
  and the batches of a run are laid down at once;
* *speculation*: elsewhere one call checks the candidates at ``p`` together
  with, at the next positions the chosen size would reach, whether that size is
  still the choice there (two probabilities decide it for a classifier monotone
  in the candidate's rows, otherwise every candidate up to one past it). The
  token cap only grows as texts get shorter, so a size it did not cut at ``p``
  it does not cut at those later positions either.
"""

from __future__ import annotations

import numpy as np

from dynabatch.memory.classifier import SpikeClassifier
from dynabatch.memory.features import compute_features
from dynabatch.sampling.plan_settings import PlanSettings, distinct

__all__ = ["SpikeSearch"]

_MAX_SPECULATION = 1024


class SpikeSearch:
    """State of one spike-search pass over lengths sorted longest first."""

    def __init__(self, sorted_lengths: np.ndarray, settings: PlanSettings, clf: SpikeClassifier) -> None:
        self.lengths = sorted_lengths
        self.width = settings.width  # a batch's width: its longest row, padded as the collator pads it
        self.n = len(sorted_lengths)
        self.prefix = np.concatenate([[0], np.cumsum(sorted_lengths)])
        self.batch_size = settings.batch_size
        self.max_len = settings.max_input_token_length
        self.threshold = settings.threshold
        self.shape = settings.model_shape
        self.cands = settings.candidates
        self.clf = clf
        self.first = min(self.batch_size, self.n)
        self.token_cap = settings.token_cap(sorted_lengths)  # per position (never decreasing), or None
        self.calls = 0

    def _proba(self, starts: np.ndarray, sizes: np.ndarray, totals: np.ndarray | None = None) -> np.ndarray:
        stops = np.minimum(starts + sizes, self.n)
        if totals is None:
            totals = self.prefix[stops] - self.prefix[starts]
        f = compute_features(
            self.max_len, self.width(self.lengths[0]), self.first, self.prefix[self.first],
            self.width(self.lengths[starts]), stops - starts, totals, shape=self.shape,
        )
        self.calls += 1
        return self.clf.predict_spike_proba(f)

    def _safe_prefix(self, proba: np.ndarray) -> int:
        """How many leading candidates are safe before the first unsafe one."""
        unsafe = np.nonzero(proba > self.threshold)[0]
        return int(unsafe[0]) if len(unsafe) else len(proba)

    def _choice(self, found: int) -> int:
        return int(self.cands[found - 1]) if found else self.batch_size

    def _runs(self) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """Run starts, starts of runs long enough to hold every window, and the choice inside each of those."""
        run_starts = np.flatnonzero(np.diff(self.lengths)) + 1
        bounds = np.concatenate([[0], run_starts, [self.n]])
        cmax, k = int(self.cands[-1]), len(self.cands)
        long = bounds[:-1][np.diff(bounds) >= cmax]
        lengths = self.lengths[long]
        if not len(long):
            return run_starts, long, {}
        if self.clf.monotone_in_rows:  # bisection on the first unsafe candidate, every run at once
            lo, hi = np.full(len(long), -1), np.full(len(long), k)
            while (hi - lo > 1).any():
                mid = np.where(hi - lo > 1, (lo + hi) // 2, np.maximum(lo, 0))
                unsafe = self._proba(long, self.cands[mid], self.cands[mid] * lengths) > self.threshold
                move = hi - lo > 1
                hi = np.where(move & unsafe, mid, hi)
                lo = np.where(move & ~unsafe, mid, lo)
            found = hi
        else:
            proba = self._proba(np.repeat(long, k), np.tile(self.cands, len(long)),
                                np.tile(self.cands, len(long)) * np.repeat(lengths, k))
            found = [self._safe_prefix(row) for row in proba.reshape(len(long), k)]
        return run_starts, long, {int(n): int(f) for n, f in zip(lengths.tolist(), np.asarray(found).tolist())}

    def _window(self, pos: int, k: int, starts: np.ndarray, check: np.ndarray) -> tuple[int | None, np.ndarray]:
        """The safe prefix at ``pos`` from candidates around ``k`` (monotone classifier; ``None`` if undecided),
        and the probabilities of the ``check`` candidates at the speculative ``starts``, in one call."""
        last = len(self.cands) - 1
        lo, hi = max(k - 3, 0), min(k + 3, last)
        window = self.cands[lo : hi + 1]
        proba = self._proba(np.concatenate([np.full(len(window), pos), np.repeat(starts, len(check))]),
                            np.concatenate([window, np.tile(check, len(starts))]))
        unsafe = proba[: len(window)] > self.threshold
        if lo > 0 and unsafe[0]:
            found = None
        elif unsafe.any():
            found = lo + int(np.argmax(unsafe))
        else:
            found = last + 1 if hi == last else None
        return found, proba[len(window) :]

    def sizes(self) -> np.ndarray:
        if self.n == 0:
            return np.empty(0, dtype=np.int64)
        out, counts = [self.first], [1]  # batch sizes, run-length encoded
        pos = self.first
        n, cands, cmax = self.n, self.cands, int(self.cands[-1])
        run_starts, long_starts, choices = self._runs()
        monotone = self.clf.monotone_in_rows
        k = -1  # safe prefix of the last uncapped choice, to speculate on; -1: none
        width = 4  # speculative positions per call
        while pos < n:
            i = int(np.searchsorted(run_starts, pos, side="right"))
            end = int(run_starts[i]) if i < len(run_starts) else n
            if pos + cmax <= end:  # every candidate window inside a run of equal lengths
                k = choices[int(self.lengths[pos])]
                size = self._choice(k)
                if self.token_cap is not None and self.token_cap[pos] < size:  # the same cap all along the run
                    size, k = int(self.token_cap[pos]), -1
                count = (end - cmax - pos) // size + 1
                out.append(size)
                counts.append(count)
                pos += size * count
                continue
            caps = distinct(np.minimum(cands, n - pos))
            # The next run long enough for the shortcut: speculating past its start is wasted.
            j = int(np.searchsorted(long_starts, pos, side="right"))
            limit = int(long_starts[j]) if j < len(long_starts) else n
            starts = np.empty(0, dtype=np.int64)
            check = np.empty(0, dtype=np.int64)
            lo = 0
            if k >= 0:
                # Is the safe prefix still k at the positions this size would reach?
                # Candidates below k must be safe and candidate k (if any) unsafe.
                step = int(cands[k - 1]) if k else self.batch_size
                lo = max(k - 1, 0) if monotone else 0
                check = cands[lo : k + 1]
                starts = pos + step * np.arange(1, width + 1, dtype=np.int64)
                starts = starts[(starts + cmax <= n) & (starts < limit)]
            found = None
            if monotone and k >= 0 and len(caps) == len(cands):
                found, spec_proba = self._window(pos, k, starts, check)
            if found is None:
                proba = self._proba(np.concatenate([np.full(len(caps), pos), np.repeat(starts, len(check))]),
                                    np.concatenate([caps, np.tile(check, len(starts))]))
                found, spec_proba = self._safe_prefix(proba[: len(caps)]), proba[len(caps) :]
            size = int(caps[found - 1]) if found else min(self.batch_size, n - pos)
            capped = self.token_cap is not None and self.token_cap[pos] < size
            if capped:
                size = int(self.token_cap[pos])
            out.append(size)
            counts.append(1)
            pos += size
            if len(starts) and found == k and not capped:  # the size is step again: the speculation applies
                spec = spec_proba.reshape(len(starts), len(check)) <= self.threshold
                holds = (spec == (np.arange(lo, lo + len(check)) < k)).all(axis=1)
                hits = len(holds) if holds.all() else int(np.argmin(holds))
                out.append(size)
                counts.append(hits)
                pos += size * hits
                width = min(2 * width, _MAX_SPECULATION) if hits == len(holds) else max(4, 2 * hits)
            k = found if len(caps) == len(cands) and not capped else -1
        return np.repeat(np.asarray(out, dtype=np.int64), counts)

"""Planning as lengths arrive: :class:`ChunkedPlanner`, one :class:`~dynabatch.sampling.planner.BatchPlanner` per chunk.

A streamed corpus is tokenized in chunks, longest (by characters) first
(:class:`~dynabatch.data.streaming.TokenStream`), and a rank under
``run(ranks="claim")`` gets the chunks it claims. The chunked planner plans
each chunk as it arrives, with the one planner over that chunk's lengths
(sorted longest first within it), and hands its batches out before the next
chunk is asked for. It is the batch planner's online interface
(:meth:`next_batch`, :meth:`peek`, :meth:`cursor`, :meth:`observe_parts`,
:meth:`observe_out_of_memory`): a consumer's cursor (its measured peaks and its
budget, the first batch's peak) carries across chunks, so every batch of
every chunk is sized under the first batch's measured peak, and one estimator
learns from every chunk. A batch never spans two chunks.

Pure numpy over lengths: the chunks come from a callable.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.chunked_planner import ChunkedPlanner
    >>> from dynabatch.sampling.planner import PlanSettings
    >>> chunks = iter([(np.array([4, 0, 2]), np.array([9, 8, 8])), (np.array([1, 3]), np.array([3, 2]))])
    >>> planner = ChunkedPlanner(lambda block=True: next(chunks, None), PlanSettings(2, 9))
    >>> [planner.next_batch().tolist() for _ in range(3)], planner.next_batch()
    ([[4, 0], [2], [1, 3]], None)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dynabatch.memory.feedback import MemoryFeedback
from dynabatch.sampling.estimators import SpikeEstimator
from dynabatch.sampling.planner import BatchPlanner, PlanCursor, PlanSettings

__all__ = ["ChunkedPlanner"]

logger = logging.getLogger(__name__)


class ChunkedPlanner:
    """Plans chunk after chunk as their lengths arrive; consumers' cursors carry across chunks.

    Args:
        next_chunk: ``next_chunk(block=True)`` returns the next chunk's
            ``(input positions, token lengths)``, ``None`` when there is none;
            with ``block=False`` it may return any other object for "not yet".
        settings: the :class:`~dynabatch.sampling.planner.PlanSettings`.
        estimator: shared by every chunk's planner (``None``: the bundled spike classifier).
    """

    def __init__(self, next_chunk: Callable[..., Any], settings: PlanSettings, estimator: Any = None) -> None:
        self.settings = settings
        self.estimator = SpikeEstimator() if estimator is None else estimator
        self._next_chunk = next_chunk
        self._chunks: list[tuple[np.ndarray, BatchPlanner]] = []
        self._exhausted = False
        self._lock = threading.RLock()
        self.restart()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(chunks planned={len(self._chunks)}, exhausted={self._exhausted})"

    def _chunk(self, i: int, *, block: bool = True) -> tuple[np.ndarray, BatchPlanner] | None:
        """Chunk ``i``'s positions and planner, asking for chunks up to it; ``None`` past the end (or not ready)."""
        with self._lock:
            while len(self._chunks) <= i and not self._exhausted:
                got = self._next_chunk(block=block)
                if got is None:
                    self._exhausted = True
                elif isinstance(got, tuple):
                    positions, lengths = got
                    if len(positions):
                        self._chunks.append((np.asarray(positions, dtype=np.int64),
                                             BatchPlanner(lengths, self.settings, self.estimator)))
                else:
                    return None
            return self._chunks[i] if i < len(self._chunks) else None

    def restart(self, *, sparse: bool = False) -> None:
        """Starts handing out batches from the first chunk's first again (chunks already planned are kept), with
        the estimator as it was built."""
        with self._lock:
            self.estimator.restart()
            self._i = 0
            for _, planner in self._chunks:
                planner.restart()
            self._cursor = self.cursor(sparse=sparse)

    def cursor(self, *, sparse: bool = False) -> PlanCursor:
        """A new consumer of the pass (see :meth:`BatchPlanner.cursor <dynabatch.sampling.planner.BatchPlanner.cursor>`)."""
        return PlanCursor(MemoryFeedback(sparse=sparse))

    @property
    def feedback(self) -> MemoryFeedback:
        return self._cursor.feedback

    def budget_on(self, device: Any) -> float | None:
        """The absolute budget a run on ``device`` plans under (see :meth:`BatchPlanner.budget_on
        <dynabatch.sampling.planner.BatchPlanner.budget_on>`; the first chunk holds the longest texts)."""
        chunk = self._chunk(0)
        return chunk[1].budget_on(device) if chunk is not None else self.estimator.budget_on(device)

    def next_batch(self, cursor: PlanCursor | None = None) -> np.ndarray | None:
        """The input positions of the next batch (waiting for its chunk's tokens); ``None`` when done."""
        cursor = self._cursor if cursor is None else cursor
        with self._lock:
            while (chunk := self._chunk(self._i)) is not None:
                positions, planner = chunk
                local = planner.next_batch(cursor)
                if local is not None:
                    return positions[local]
                self._i += 1
            return None

    def peek(self, n: int, cursor: PlanCursor | None = None) -> list[np.ndarray]:
        """The next ``n`` batches as they stand now, from the chunks already tokenized (never waits for one)."""
        cursor = self._cursor if cursor is None else cursor
        out: list[np.ndarray] = []
        with self._lock:
            i, last = self._i, cursor.last
            while len(out) < n and (chunk := self._chunk(i, block=False)) is not None:
                positions, planner = chunk
                ahead = planner.peek(n - len(out), PlanCursor(cursor.feedback, last))
                out.extend(positions[b] for b in ahead)
                last = len(ahead[-1]) if ahead else last
                i += 1
        return out

    def observe_parts(self, parts: Any, cursor: PlanCursor | None = None) -> None:
        """Records the measured peaks of a batch that ran (see :meth:`BatchPlanner.observe_parts
        <dynabatch.sampling.planner.BatchPlanner.observe_parts>`)."""
        with self._lock:
            self._current().observe_parts(parts, self._cursor if cursor is None else cursor)

    def observe(self, rows: int, padded_length: int, peak_bytes: float) -> None:
        self.observe_parts([(rows, padded_length, peak_bytes)])

    def observe_out_of_memory(self, rows: int, padded_length: int, cursor: PlanCursor | None = None) -> None:
        """Records a call that ran out of memory (see :meth:`BatchPlanner.observe_out_of_memory
        <dynabatch.sampling.planner.BatchPlanner.observe_out_of_memory>`)."""
        with self._lock:
            self._current().observe_out_of_memory(rows, padded_length, self._cursor if cursor is None else cursor)

    def _current(self) -> BatchPlanner:
        return self._chunks[min(self._i, len(self._chunks) - 1)][1]

    def first_rows(self) -> int:
        """Rows of the plan's first batch (the first chunk's)."""
        chunk = self._chunk(0)
        return 0 if chunk is None else chunk[1].first_rows()

    def iter_batches(self) -> Iterator[np.ndarray]:
        """The plan (up front, unmeasured), chunk by chunk as each is tokenized."""
        i = 0
        while (chunk := self._chunk(i)) is not None:
            positions, planner = chunk
            for local in planner.batches():
                yield positions[local]
            i += 1

    def batches(self) -> list[np.ndarray]:
        """The whole plan (waits for every chunk)."""
        return list(self.iter_batches())

    def sizes(self) -> np.ndarray:
        """The whole plan's batch sizes (waits for every chunk)."""
        return np.asarray([len(b) for b in self.iter_batches()], dtype=np.int64)

"""The source of :func:`dynabatch.run`: the batches a loader plans, as :class:`Item` s, and what the inputs are.

A dynabatch DataLoader carries its plan (``loader.plan``), so its batches are known as input positions before their
tensors exist (built later, by the build stage, :mod:`~dynabatch.inference.build`): the scheduler
(:mod:`~dynabatch.inference.scheduler`) can share them among ranks, take out rows already stored, or in measured mode
have the loader's planner size each next batch. Any other iterable of :class:`~dynabatch.data.collate.Batch` is read
as it comes, ahead of the device (:class:`~dynabatch._background.Ahead`).

The source answers what a resumed run asks before its first batch (:meth:`Source.input_hashes`: the input hashes of
this run's inputs at the positions a store holds), and is never called back after that.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynabatch._background import Ahead
from dynabatch._validation import brief
from dynabatch.data.collate import Batch
from dynabatch.data.input_hashes import token_store_hashes

__all__ = ["Item", "Source", "positions_of"]

logger = logging.getLogger(__name__)

_NONE = np.zeros(0, dtype=np.int64)


@dataclass
class Item:
    """One batch to run: its number in the plan and its input positions.

    ``batch``: the tensors of a plain iterable's batch as it came, or of a batch built already (rows put back after a
    device failed); ``rows``: which of its rows run (row numbers within it; ``None``: all). A plan's batch has no
    tensors yet: the build stage collates its positions. ``stored``: positions taken out because a results store
    holds them (their tokens can be freed; a plain iterable's are checked against the store as the batch is built).
    """

    number: int
    positions: np.ndarray
    batch: Batch | None = None
    rows: np.ndarray | None = None
    whole: bool = True  # False once rows are taken out (stored, or finished before a device failed)
    crashes: int = 0  # times a device failed running it (several devices put its rows back once)
    stored: np.ndarray = field(default_factory=lambda: _NONE)

    def keep(self, keep: np.ndarray, *, whole: bool = False) -> Item:
        """The item with only its rows at ``keep`` (row numbers within :attr:`positions`); ``whole``: a batch of its
        own (a rank's share), else rows of a batch that was planned larger."""
        rows = None if self.batch is None else keep if self.rows is None else self.rows[keep]
        return Item(self.number, self.positions[keep], self.batch, rows, whole=whole, crashes=self.crashes)


def positions_of(batch: Any, loader: Any) -> np.ndarray:
    """The input positions of ``batch``'s rows (its ``.indices``), or a ``TypeError`` naming ``loader``."""
    indices = getattr(batch, "indices", None)
    if indices is None or not isinstance(batch, dict):
        raise TypeError(
            "loader should be a dynabatch DataLoader or an iterable of dynabatch Batches (dicts of tensors with "
            f".indices, the input positions of their rows), but got loader={brief(loader)} yielding a batch "
            f"of type {type(batch).__name__}" + ("" if indices is None else " (not a dict of tensors)")
        )
    return torch.as_tensor(indices).detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)


class Source:
    """The batches of ``loader`` in its order (``plan``: its :class:`~dynabatch.inference.loader.LoaderPlan`, or
    ``None`` for any iterable of batches).

    Attributes:
        n_inputs: how many inputs the loader was given (bad ones included); ``None`` for an iterable of batches,
            whose inputs are the positions its batches name.
        planner: the plan's planner (measured mode asks it for every next batch), or ``None``.
        streamed: the plan tokenizes its chunks as they are planned (its tokens are freed as rows finish).
    """

    def __init__(self, loader: Any, plan: Any) -> None:
        self.loader, self.plan = loader, plan
        self.n_inputs: int | None = None if plan is None else plan.n_inputs
        self.planner = None if plan is None else plan.planner
        self.streamed = plan is not None and plan.stream is not None
        self._reader: Ahead | None = None

    def items(self, *, read_ahead: int = 0) -> Iterator[Item]:
        """Every batch in the loader's order: a plan's as input positions, a plain iterable's with its tensors, read
        up to ``read_ahead`` batches ahead in a background thread (stopped by :meth:`close`)."""
        if self.plan is not None:
            return (Item(n, np.asarray(p, dtype=np.int64)) for n, p in enumerate(self.plan.sampler))
        items = (Item(n, positions_of(b, self.loader), b) for n, b in enumerate(self.loader))
        if not read_ahead:
            return items
        self._reader = Ahead(items, depth=read_ahead, name="dynabatch-read-ahead")
        return iter(self._reader.next, None)

    def first_rows(self) -> int:
        """Rows of the plan's first batch (its longest texts: fewer rows at any width never cost more)."""
        return self.planner.first_rows() if self.planner is not None else 0

    def text_sizes(self) -> tuple[np.ndarray, bool, int | None] | None:
        """Every input's size, known before it runs (what the time left is weighted by): ``(sizes, exact,
        max_length)``, a plan's token lengths (exact), or a streamed plan's lengths in characters with its max
        length in tokens; ``None`` for an iterable of batches."""
        if self.plan is None:
            return None
        if self.streamed:
            stream = self.plan.stream
            return stream.source.char_lengths(), False, stream.max_input_token_length
        return self.plan.collator.tokenized.lengths, True, None

    def input_hashes(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions, input hashes)`` of this run's inputs among ``positions`` (a plan's: those below
        :attr:`n_inputs`), as a results store hashes a row; ``None`` for an iterable of batches, whose rows are
        hashed as its batches are built.

        A plan hashes only those rows: from the token store, or (streamed) tokenized for it and not held.
        """
        if self.plan is None:
            return None
        positions = positions[positions < self.n_inputs]
        if self.streamed:
            return positions, self.plan.stream.input_hashes(positions)
        return positions, token_store_hashes(self.plan.collator.tokenized.take(positions))

    def close(self) -> None:
        """Stops reading ahead (after the batch being read), and a streamed plan's tokenizing thread (a later use of
        the loader goes on where it stopped)."""
        if self._reader is not None:
            self._reader.close()
        if self.streamed:
            self.plan.stream.pause()

"""The source of :func:`dynabatch.run`: a dynabatch loader's batches as input positions (:class:`Item` s, shared among
ranks by :meth:`Source.share`), or any iterable of batches read as it comes; and what is known of the inputs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dynabatch._background import Ahead
from dynabatch._validation import bad_value, brief, first_few
from dynabatch.data.collate import Batch
from dynabatch.data.input_hashes import token_store_hashes
from dynabatch.data.workers import available_cores, release_pool
from dynabatch.sampling.ranks import batches_needed, deal, most_replicas, split_for_replicas

__all__ = ["Item", "Source", "positions_of"]

logger = logging.getLogger(__name__)

_NONE = np.zeros(0, dtype=np.int64)


@dataclass
class Item:
    """One batch to run: its number in the plan and its input positions; ``batch``: its tensors where it came with
    them (a plain iterable's, or rows put back after a device failed), ``rows`` the rows of it that run (``None``:
    all); ``stored``: positions taken out because a results store holds them."""

    number: int
    positions: np.ndarray
    batch: Batch | None = None
    rows: np.ndarray | None = None
    whole: bool = True  # False once rows are taken out (stored, or finished before a device failed)
    crashes: int = 0  # times a device failed running it (several devices put its rows back once)
    stored: np.ndarray = field(default_factory=lambda: _NONE)
    sizing: Any = None  # its worker's lane (the scheduler's Sizing): how its pieces are split, which are measured

    def keep(self, keep: np.ndarray, *, whole: bool = False) -> Item:
        """The item with only its rows at ``keep`` (row numbers); ``whole``: a batch of its own (a rank's share)."""
        rows = None if self.batch is None else keep if self.rows is None else self.rows[keep]
        return Item(self.number, self.positions[keep], self.batch, rows, whole=whole, crashes=self.crashes)


def _too_few_for_lockstep(items: list[Item], world_size: int) -> ValueError:
    """The error for a plan whose batches cannot be split into an equal number for every rank (fewer inputs than
    ranks, or 3 one-input batches for 2): it names ``ranks``, what the user chose, not the sharing routine's
    ``num_replicas``, and what works instead."""
    inputs = sum(len(item.positions) for item in items)
    largest = most_replicas(len(items), inputs, world_size)
    return bad_value(
        "ranks",
        f"'claim' (an fn without collectives), or 'lockstep' on at most {largest} "
        f"process{'es' if largest > 1 else ''}, for {inputs} input{'s' if inputs != 1 else ''} in "
        f"{len(items)} batch{'es' if len(items) != 1 else ''}: 'lockstep' gives each of the {world_size} ranks the "
        f"same number of batches ({batches_needed(len(items), world_size)} in all), each of at least one input, "
        "and batches are only split, never merged or padded",
        "lockstep",
    )


def positions_of(batch: Any, loader: Any) -> np.ndarray:
    """The input positions of ``batch``'s rows (its ``.indices``), or a ``TypeError`` naming ``loader``."""
    indices = getattr(batch, "indices", None)
    if indices is None or not isinstance(batch, dict):
        raise TypeError(
            "loader should be a dynabatch DataLoader or an iterable of dynabatch Batches (dicts of tensors with "
            f".indices, the input positions of their rows), but got loader={brief(loader)} yielding a batch "
            f"of type {type(batch).__name__}" + ("" if indices is None else " (not a dict of tensors)")
        )
    indices = torch.as_tensor(indices).detach().cpu()
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"batch.indices should be integer input positions, but got batch.indices of dtype "
                        f"{indices.dtype}")
    positions = indices.numpy().astype(np.int64, copy=False).reshape(-1)
    if positions.size and positions.min() < 0:  # a result kept at -1 would stand for the last input
        raise bad_value("batch.indices", "input positions (integers >= 0)", positions.tolist())
    rows = getattr(batch.get("input_ids"), "shape", (positions.size,))[:1]
    if rows and rows[0] != positions.size:
        raise ValueError(f"batch.indices should name one input position per row of the batch ({rows[0]} rows), but "
                         f"got {positions.size} positions")
    return positions


class Source:
    """The batches of ``loader`` in its order (``plan``: its :class:`~dynabatch.inference.loader.LoaderPlan`, or
    ``None`` for any iterable of batches).

    Attributes:
        n_inputs: how many inputs the loader was given (bad ones included); ``None`` for an iterable of batches.
        planner: the planner measured mode asks for every next batch (of the chunks this rank claims under
            ``ranks="claim"``), or ``None``.
        streamed: the plan tokenizes its chunks as they are planned (and frees their tokens as rows finish).
        known: every batch is known up front as positions (the next ones can be built ahead).
        lockstep: the ranks run their shares in rounds (:class:`~dynabatch.inference.distributed.Lockstep`).
        scale: how many ranks this rank's progress counts for (ranks claiming alike).
    """

    def __init__(self, loader: Any, plan: Any) -> None:
        self.loader, self.plan = loader, plan
        self.n_inputs: int | None = None if plan is None else plan.n_inputs
        self.planner = None if plan is None else plan.planner
        self.streamed = plan is not None and plan.stream is not None
        self.known = plan is not None and not self.streamed
        self.lockstep, self.scale = False, 1
        self._mine: Any = None  # this rank's items: dealt in lockstep, or its claimed chunks planned as they come
        # close(): the stream's (its thread and the tokenizer worker processes), read-ahead's, feed's; an eager
        # loader's build may have started worker processes, kept for the next build until a run ends
        self._stops = [plan.stream.pause] if self.streamed else [release_pool]
        self._seen = -1  # the largest input position handed out (a plain iterable's inputs are those it names)
        self._given = np.zeros(0, dtype=bool)  # the positions a plain iterable's batches named so far

    def share(self, ranks: str, rank: int, world_size: int, *, store: bool = False) -> None:
        """Keeps only this rank's share of the batches under ``ranks`` (``"single"``: every batch; ``store``: the rows
        go to a results store, checked alike on every rank): ``"lockstep"``, every rank the same number of batches of
        the whole plan, dealt (:mod:`dynabatch.sampling.ranks`) and numbered from 0; ``"claim"``, the chunks of the
        plan this rank claims (a streamed plan tokenizes only those)."""
        from dynabatch.inference.distributed import check_same_batches, claimed_planner

        def split(item: Item, parts: int) -> list[Item]:
            return [item.keep(keep, whole=True) for keep in np.array_split(np.arange(len(item.positions)), parts)]

        if ranks == "claim":
            self.planner, feed = claimed_planner(self.plan, self.identity(), store=store)
            if feed is not None:
                self._stops.append(feed.close)
            self._mine, self.known = (Item(n, b) for n, b in enumerate(self.planner.iter_batches())), False
            self.scale = world_size
        elif ranks == "lockstep":
            items = list(self.items())
            check_same_batches("lockstep", [i.positions for i in items], self.identity(), store=store)
            try:
                shares = split_for_replicas(items, world_size, samples=lambda item: len(item.positions), split=split)
            except ValueError as exc:  # raised alike on every rank (each holds the whole plan): none is left waiting
                raise _too_few_for_lockstep(items, world_size) from exc
            self._mine, self.known, self.lockstep = deal(shares, world_size, rank), True, True
            for number, item in enumerate(self._mine):
                item.number = number
            logger.info("rank %d of %d: %d batches (%d rows) of %d batches (%d rows)", rank, world_size,
                        len(self._mine), sum(len(i.positions) for i in self._mine), len(items),
                        sum(len(i.positions) for i in items))

    def identity(self) -> np.ndarray | None:
        """What identifies this run's inputs before any runs, for the ranks to check they hold the same ones: a plan's
        every input's token hash; a streamed plan's texts' lengths in characters (its tokens are made as chunks are
        claimed, each on one rank: texts of the same lengths that differ pass); ``None`` for an iterable of
        batches."""
        if self.plan is None:
            return None
        if self.streamed:
            return self.plan.stream.source.char_lengths()
        return token_store_hashes(self.plan.collator.tokenized)

    def dealt(self, n: int) -> np.ndarray | None:
        """Under ``ranks="lockstep"``, which of the ``n`` input positions this rank's batches hold (``None``: not in
        lockstep)."""
        if not self.lockstep:
            return None
        mine = np.zeros(n, dtype=bool)
        for item in self._mine:
            mine[item.positions] = True
        return mine

    def items(self, *, read_ahead: int = 0) -> Iterator[Item]:
        """Every batch of this rank in the loader's order: a plan's as input positions, a plain iterable's with its
        tensors, read up to ``read_ahead`` batches ahead in a background thread (stopped by :meth:`close`)."""
        if self._mine is not None:
            return iter(self._mine)
        if self.plan is not None:
            return (Item(n, np.asarray(p, dtype=np.int64)) for n, p in enumerate(self.plan.sampler))
        items = (Item(n, positions_of(b, self.loader), b) for n, b in enumerate(self.loader))
        if read_ahead:
            reader = Ahead(items, depth=read_ahead, name="dynabatch-read-ahead")
            self._stops.append(reader.close)
            items = iter(reader.next, None)
        return (self._saw(item) for item in items)

    def _saw(self, item: Item) -> Item:
        """Notes the positions of a plain iterable's batch; one named before (by it or an earlier batch) is refused:
        its second result would replace the first, and two inputs would come back as one (loaders chained, each
        numbering its inputs from 0)."""
        positions = item.positions
        if not positions.size:
            return item
        top = int(positions.max())
        if top >= self._given.size:  # grown by doubling: a bit per input, not a set of every position
            self._given = np.pad(self._given, (0, max(top + 1, 2 * self._given.size) - self._given.size))
        unique, counts = np.unique(positions, return_counts=True)
        again = np.union1d(unique[counts > 1], positions[self._given[positions]])
        if again.size:
            raise ValueError(
                f"loader should name each input position once (batch.indices), but got input positions "
                f"{first_few(again.tolist())} again in batch {item.number}: its result would replace the other, and "
                "an input would be lost; loaders chained one after the other each number their inputs from 0: run "
                "each loader on its own, or give every input its own position"
            )
        self._given[positions] = True
        self._seen = max(self._seen, top)
        return item

    @property
    def total_inputs(self) -> int:
        """How many inputs the run has: the loader's, or (a plain iterable) the largest position named so far + 1."""
        return self.n_inputs if self.n_inputs is not None else self._seen + 1

    @property
    def tokenize_cores(self) -> list[int] | None:
        """``[cores the run's tokenizing may use, cores this process may use]``, where the run tokenizes (a streamed
        plan's chunks); ``None`` where every input was tokenized before the run."""
        return [self.plan.stream.cores, available_cores()] if self.streamed else None

    def text_sizes(self) -> tuple[np.ndarray, bool, int | None] | None:
        """Every input's size before it runs (what the time left is weighted by): ``(sizes, exact, max_length)``, a
        plan's token lengths, or a streamed plan's in characters with its max length in tokens; ``None``: no plan."""
        if self.plan is None:
            return None
        if self.streamed:
            return self.plan.stream.source.char_lengths(), False, self.plan.stream.max_input_token_length
        return self.plan.collator.tokenized.lengths, True, None

    def input_hashes(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions, input hashes)`` of this run's inputs among ``positions``, as a results store hashes a row;
        ``None`` for an iterable of batches, whose rows are hashed as its batches are built."""
        if self.plan is None:
            return None
        positions = positions[positions < self.n_inputs]
        if self.streamed:
            return positions, self.plan.stream.input_hashes(positions)
        return positions, token_store_hashes(self.plan.collator.tokenized.take(positions))

    def done(self, positions: np.ndarray) -> None:
        """The loop is done with these inputs' tokens (their rows are built, or stored): a streamed plan frees each
        chunk's tokens once every row of it is."""
        if self.streamed and len(positions):
            self.plan.stream.consumed(positions)

    def close(self) -> None:
        """Stops reading ahead and tokenizing (after the batch or chunk in progress; a later use of the loader goes
        on where it stopped), and ends the process's tokenizer worker processes (a later call starts them again)."""
        for stop in self._stops:
            stop()


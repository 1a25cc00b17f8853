"""The batches :func:`dynabatch.run` runs, as a queue it can re-plan: :class:`Source`.

A dynabatch DataLoader is read as planned input positions (tensors are built
by its collator only when a batch runs), so measured mode and the
distributed split can reorder or re-size batches before they exist; any
other iterable of :class:`~dynabatch.data.collate.Batch` is streamed as it comes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dynabatch.inference._resume import FORMAT
from dynabatch.inference._rows import batch_shape, take_rows
from dynabatch._validation import bad_type
from dynabatch.data.collate import Batch, TokenCollator

logger = logging.getLogger(__name__)


@dataclass
class Item:
    """One planned batch: its number in the plan and its input positions (or the batch itself)."""

    number: int
    positions: np.ndarray
    batch: Batch | None = None  # plain iterables: the batch as it came; dynabatch loaders: built when run


def is_dynabatch_loader(loader: Any) -> bool:
    """Whether ``loader`` came from :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader` (its plan is readable)."""
    from torch.utils.data import DataLoader

    from dynabatch.inference.loader import _Positions
    from dynabatch.sampling.sampler import DynamicBatchSampler

    return (
        isinstance(loader, DataLoader)
        and isinstance(loader.batch_sampler, DynamicBatchSampler)
        and isinstance(loader.collate_fn, TokenCollator)
        and isinstance(loader.dataset, _Positions)
    )


def unwrap_prepared(loader: Any) -> Any:
    """The dynabatch loader inside one passed through ``accelerate``'s ``prepare``, else ``loader`` itself.

    ``Accelerator.prepare`` wraps a DataLoader (``DataLoaderShard`` or
    ``DataLoaderDispatcher``) whose ``base_dataloader`` holds the original
    batch sampler, sharded (``BatchSamplerShard``) or not. :func:`dynabatch.run`
    shards the plan across ranks itself, by cost, so it reads the whole plan
    from under the wrapper rather than run one rank's share of it sharded again.
    """
    base = getattr(loader, "base_dataloader", None)
    if base is None or is_dynabatch_loader(loader):
        return loader
    from torch.utils.data import DataLoader

    from dynabatch.sampling.sampler import DynamicBatchSampler

    sampler = getattr(base, "batch_sampler", None)
    if not isinstance(sampler, DynamicBatchSampler):
        sampler = getattr(sampler, "batch_sampler", None)  # accelerate's BatchSamplerShard keeps the original here
    if not isinstance(sampler, DynamicBatchSampler):
        return loader
    unwrapped = DataLoader(base.dataset, batch_sampler=sampler, collate_fn=base.collate_fn, num_workers=0)
    if not is_dynabatch_loader(unwrapped):
        return loader
    logger.info("loader was prepared by accelerate: running the whole dynabatch plan under it (run shards it itself)")
    return unwrapped


def positions_of(batch: Any, loader: Any) -> np.ndarray:
    """The input positions of ``batch``'s rows (its ``.indices``), or a ``TypeError`` naming ``loader``."""
    indices = getattr(batch, "indices", None)
    if indices is None or not isinstance(batch, dict):
        raise TypeError(
            "loader should be a dynabatch DataLoader or an iterable of dynabatch Batches (dicts of tensors with "
            f".indices, the input positions of their rows), but got loader={short_repr(loader)} yielding a batch "
            f"of type {type(batch).__name__}" + ("" if indices is None else " (not a dict of tensors)")
        )
    return torch.as_tensor(indices).detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)


def short_repr(value: Any, limit: int = 80) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Source:
    """The batches to run, as a queue of :class:`Item` s.

    For a dynabatch loader every item is known up front (positions from its
    batch sampler, tensors built by its collator when the item runs), so the
    queue ``pending`` can be re-planned while the run goes on. Other iterables
    are streamed (``stream``) unless they must be read whole.
    """

    def __init__(self, loader: Any, pad_token_id: int | None = None) -> None:
        self.loader = loader
        self.collator: TokenCollator | None = None
        self.plan_fingerprint: str | None = None
        self.pending: deque[Item] = deque()
        self.stream: Iterator[Item] | None = None
        if is_dynabatch_loader(loader):
            self.collator = loader.collate_fn
            self.n_inputs: int | None = len(self.collator.tokenized)
            self.plan_fingerprint = loader.batch_sampler.fingerprint
            for number, positions in enumerate(loader.batch_sampler):
                self.pending.append(Item(number, np.asarray(positions, dtype=np.int64)))
        else:
            if isinstance(loader, (str, bytes, dict)) or not isinstance(loader, Iterable):
                raise bad_type("loader", "a dynabatch DataLoader or an iterable of dynabatch Batches", loader)
            self.n_inputs = None
            self.stream = self._items(loader)
        collate = getattr(loader, "collate_fn", None)
        pad = getattr(collate, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, (int, np.integer)) and not isinstance(pad, bool) else None
        side = getattr(collate, "padding_side", None)
        self.padding_side = side if side in ("left", "right") else None
        multiple = getattr(collate, "pad_to_multiple_of", None)
        self.pad_to_multiple_of = multiple if isinstance(multiple, int) else None

    def _items(self, batches: Iterable[Any]) -> Iterator[Item]:
        for number, batch in enumerate(batches):
            yield Item(number, positions_of(batch, self.loader), batch)

    def next_item(self) -> Item | None:
        if self.pending:
            return self.pending.popleft()
        if self.stream is not None:
            item = next(self.stream, None)
            if item is not None:
                return item
            self.stream = None
        return None

    def materialize(self) -> None:
        """Reads a streamed iterable whole into the queue."""
        if self.stream is not None:
            self.pending.extend(self.stream)
            self.stream = None
            self.n_inputs = max((int(i.positions.max()) + 1 for i in self.pending if i.positions.size), default=0)

    def build(self, item: Item) -> Batch:
        if item.batch is not None:
            return item.batch
        return self.collator(item.positions)

    def shape(self, item: Item) -> tuple[int, int]:
        """Planned ``(rows, width)`` of an item, without building its tensors."""
        if item.batch is not None:
            return batch_shape(item.batch)
        lengths = self.collator.tokenized.lengths[item.positions]
        width = int(lengths.max()) if lengths.size else 0
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return len(item.positions), width

    def restrict(self, item: Item, keep: np.ndarray) -> Item:
        """The item with only the rows at ``keep`` (row numbers within it)."""
        if item.batch is None:
            return Item(item.number, item.positions[keep])
        batch = take_rows(
            item.batch,
            torch.from_numpy(keep),
            padding_side=self.padding_side,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        return Item(item.number, item.positions[keep], batch)

    def fingerprint(self) -> str:
        """A sha256 identifying the inputs and the plan (reads a streamed iterable once more, or whole)."""
        digest = hashlib.sha256(FORMAT.encode())
        digest.update(json.dumps(self.pad_token_id).encode())  # it changes what token-id rows keep
        if self.collator is not None:
            tokenized = self.collator.tokenized
            digest.update(np.ascontiguousarray(tokenized.offsets, dtype=np.int64).tobytes())
            digest.update(np.ascontiguousarray(tokenized.input_ids).tobytes())
            for key in sorted(tokenized.extras):
                digest.update(key.encode())
                digest.update(np.ascontiguousarray(tokenized.extras[key]).tobytes())
            settings = [
                self.collator.pad_token_id,
                self.collator.padding_side,
                self.collator.pad_to_multiple_of,
                dict(sorted(self.collator.pad_values.items())),
                self.plan_fingerprint,
            ]
            digest.update(json.dumps(settings).encode())
            return digest.hexdigest()
        # Another iterable: the digest of its batches (their positions and tensors), in any order.
        if self.stream is not None and isinstance(self.loader, Iterator):
            self.materialize()  # a one-shot iterator can be read only once
        batches = (i.batch for i in self.pending) if self.stream is None else iter(self.loader)
        parts, n = [], 0
        for batch in batches:
            positions = positions_of(batch, self.loader)
            part = hashlib.sha256(positions.tobytes())
            for key in sorted(batch):
                value = batch[key]
                if isinstance(value, torch.Tensor):
                    part.update(key.encode())
                    part.update(value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
            parts.append(part.digest())
            n = max(n, int(positions.max()) + 1 if positions.size else 0)
        if self.n_inputs is None:
            self.n_inputs = n
        for part in sorted(parts):
            digest.update(part)
        return digest.hexdigest()

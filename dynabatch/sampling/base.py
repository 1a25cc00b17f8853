"""The shared base of the training batch samplers: order, epochs, resumption and sharding.

A strategy supplies one pure function, :meth:`PlannedBatchSampler.plan`: the
batches (arrays of dataset indices) covering the whole dataset for an epoch,
deterministic for ``(seed, epoch)``. This base turns that plan into a
``torch.utils.data.Sampler`` of batches:

* **Order.** With ``shuffle=True`` the batch order is a seeded permutation per
  epoch (``np.random.default_rng([seed, epoch])``, never the global state).
  The plan's first batch stays first, so a planner that puts its heaviest batch
  there shows an out-of-memory error at step 1 rather than an hour in.
* **Sharding with equal counts** (like ``DistributedSampler``: ``num_replicas``
  and ``rank`` default to the process group when one is initialised). If the
  plan's ``B`` batches are not a multiple of ``num_replicas``, the batches with
  the most rows are split in halves (contiguous halves, so a length-sorted
  batch gives two length-sorted batches) until they are. Splitting keeps every
  index exactly once and keeps every constraint the planners use (a part of a
  batch has no more rows, no longer row and no wider length spread). Nothing is
  dropped or repeated; a dataset with fewer samples than ranks is refused. The
  batches are then dealt in *steps* of ``num_replicas`` consecutive planned
  batches (neighbours in the plan, so of similar lengths: under DDP every rank
  waits for the slowest); the steps are what gets shuffled, and rank ``r``
  takes the ``r``-th batch of every step.
* **Resumption.** :meth:`state_dict` records the epoch and the batches handed
  out so far plus a fingerprint of the data and settings;
  :meth:`load_state_dict` continues that epoch exactly where it stopped, and
  refuses a state saved for other data, settings or world size.

``set_min_batches(n)`` makes every epoch at least ``n`` batches per rank (more
splits): for a loop that fixes the steps per epoch from the first epoch's
``len()`` (the HF ``Trainer``) while a plan's batch count varies by epoch.

``shard=False`` yields every rank's batches, step by step (the batch for rank
0, then rank 1, ...), a multiple of ``num_replicas`` in all: what a wrapper
that deals batch ``i`` to rank ``i % num_replicas`` needs (accelerate's
``BatchSamplerShard``, which ``Accelerator.prepare`` and the HF ``Trainer``
put in front of a custom batch sampler). Each rank then gets exactly the
batches ``shard=True`` would give it.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.base import PlannedBatchSampler
    >>> class Pairs(PlannedBatchSampler):
    ...     def plan(self, epoch):
    ...         return [np.array([i, i + 1]) for i in range(0, 10, 2)]
    ...     def identity(self):
    ...         return ("pairs", 10)
    >>> rank0 = Pairs(num_replicas=2, rank=0, seed=1)
    >>> rank1 = Pairs(num_replicas=2, rank=1, seed=1)
    >>> len(rank0), len(rank1)  # 5 batches -> one split -> 6, three per rank
    (3, 3)
    >>> sorted(i for b in list(rank0) + list(rank1) for i in b)
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    >>> it = iter(rank0); first = next(it)
    >>> state = rank0.state_dict()
    >>> resumed = Pairs(num_replicas=2, rank=0, seed=1)
    >>> resumed.load_state_dict(state)
    >>> list(resumed) == list(it)
    True
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import Sampler

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_non_negative_int,
    check_positive_int,
)

__all__ = [
    "EpochPasses",
    "PlannedBatchSampler",
    "fingerprint",
    "order_steps",
    "process_group",
    "resolve_world",
    "split_for_replicas",
]

logger = logging.getLogger(__name__)


def fingerprint(parts: Iterable[Any]) -> str:
    """A short sha256 digest of arrays (dtype, shape and bytes) and other values (their repr).

    Example:
        >>> import numpy as np
        >>> fingerprint([np.arange(3), "x"]) == fingerprint([np.arange(3), "x"])
        True
        >>> fingerprint([np.arange(3)]) == fingerprint([np.arange(4)])
        False
    """
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            array = np.ascontiguousarray(part)
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            digest.update(array.tobytes())
        else:
            digest.update(repr(part).encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def split_for_replicas(batches: list[np.ndarray], num_replicas: int, min_batches: int = 0) -> list[np.ndarray]:
    """Splits the batches with the most rows until their number is a multiple of ``num_replicas``.

    Every index stays exactly once; a batch split in ``k`` is replaced in place
    by its ``k`` contiguous parts. At most ``num_replicas - 1`` splits when the
    plan has at least ``num_replicas`` batches; more when ``min_batches`` (per
    replica) asks for more batches than the plan has.

    Raises:
        ValueError: fewer indices than ``num_replicas`` (a rank would get nothing).

    Example:
        >>> import numpy as np
        >>> [b.tolist() for b in split_for_replicas([np.array([0, 1, 2, 3]), np.array([4])], 3)]
        [[0, 1], [2, 3], [4]]
    """
    num_replicas = check_positive_int("num_replicas", num_replicas)
    target = max(len(batches), min_batches * num_replicas)
    missing = target + (-target) % num_replicas - len(batches)
    if len(batches) == 0 or missing == 0:
        return list(batches)
    total = sum(len(b) for b in batches)
    if total < len(batches) + missing:
        raise bad_value(
            "num_replicas",
            f"at most the number of samples ({total}) so that every rank gets {missing + len(batches)} "
            f"batches in all",
            num_replicas,
        )
    pieces = [1] * len(batches)
    # Max-heap on the rows of a batch's largest piece; ties go to the earlier batch.
    heap = [(-len(b), i) for i, b in enumerate(batches)]
    heapq.heapify(heap)
    for _ in range(missing):
        while True:
            _, i = heapq.heappop(heap)
            if len(batches[i]) > pieces[i]:
                break
        pieces[i] += 1
        heapq.heappush(heap, ((-len(batches[i])) // pieces[i], i))  # -ceil(rows / pieces)
    out: list[np.ndarray] = []
    for batch, count in zip(batches, pieces):
        out.extend(np.array_split(batch, count) if count > 1 else [batch])
    return out


def order_steps(num_batches: int, num_replicas: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The global batch order for an epoch: steps of ``num_replicas`` consecutive batches, steps shuffled.

    ``num_batches`` must be a multiple of ``num_replicas``. The first step
    (holding the plan's first batch) stays first.

    Example:
        >>> order_steps(6, 2, shuffle=False, seed=0, epoch=0).tolist()
        [0, 1, 2, 3, 4, 5]
        >>> order = order_steps(8, 2, shuffle=True, seed=0, epoch=3)
        >>> order[:2].tolist(), sorted(order.tolist()) == list(range(8))
        ([0, 1], True)
    """
    steps = num_batches // num_replicas
    step_order = np.arange(steps)
    if shuffle and steps > 2:
        rng = np.random.default_rng([seed, epoch])
        step_order = np.concatenate([[0], 1 + rng.permutation(steps - 1)])
    return (step_order[:, None] * num_replicas + np.arange(num_replicas)[None, :]).ravel()


def process_group() -> tuple[int, int] | None:
    """``(world_size, rank)`` of the initialised ``torch.distributed`` process group, or ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


def resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)`` checked; a ``None`` one is the process group's (else 1 and 0).

    Example:
        >>> resolve_world(None, None), resolve_world(4, 3)
        ((1, 0), (4, 3))
        >>> resolve_world(2, 2)
        Traceback (most recent call last):
        ...
        ValueError: rank should be in [0, num_replicas=2), but got rank=2
    """
    group = process_group()
    if num_replicas is None:
        num_replicas = group[0] if group else 1
    if rank is None:
        rank = group[1] if group else 0
    num_replicas = check_positive_int("num_replicas", num_replicas)
    rank = check_non_negative_int("rank", rank)
    if rank >= num_replicas:
        raise bad_value("rank", f"in [0, num_replicas={num_replicas})", rank)
    return num_replicas, rank


class EpochPasses:
    """Epochs, the position in one and resumption: what every dynabatch batch sampler shares.

    A subclass sets ``seed``, ``num_replicas``, ``shard``, ``_cache`` (its plan
    cache, ``None`` to replan) and calls :meth:`_start_epochs` in its
    constructor, and implements :meth:`identity` and :meth:`_current_batches`.
    ``iter()`` starts a pass at once (not at the first ``next()``), so a state
    saved between the two is the pass's start.
    """

    seed: int
    num_replicas: int
    shard: bool
    _cache: Any
    #: state keys that must equal this sampler's attributes to load (besides the fingerprint).
    _compared_state: tuple[str, ...] = ("seed", "num_replicas", "shard")
    #: further keys a state must have (the ones :meth:`_extra_state` adds and checks).
    _state_keys: tuple[str, ...] = ()
    #: values of compared keys that states saved by older versions lack.
    _state_defaults: ClassVar[dict[str, Any]] = {}
    #: how a fingerprint mismatch is explained: what must be the same, then what differs.
    _same_what = "data and settings"
    _differ_hint = ""

    def _start_epochs(self) -> None:
        self.epoch = 0
        self.min_batches = 0
        self._done = 0  # batches handed out in the current pass
        self._resume_at = 0  # where the next pass starts (a loaded state)

    def identity(self) -> Iterable[Any]:
        """What the plan depends on (lengths arrays, settings): hashed into :attr:`fingerprint`."""
        raise NotImplementedError

    def _current_batches(self, for_pass: bool = False) -> list[Any]:
        """The current epoch's batches for this sampler (``for_pass``: a pass over them begins)."""
        raise NotImplementedError

    def _output(self, batch: Any) -> Any:
        return batch

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_resumed_plan(self, state: dict[str, Any]) -> None:
        """Called by :meth:`load_state_dict` once the state's epoch is planned."""

    @property
    def fingerprint(self) -> str:
        """Digest of the class name and :meth:`identity`: a saved state only loads into a sampler with the same one."""
        return fingerprint([type(self).__name__, *self.identity()])

    def __len__(self) -> int:
        return len(self._current_batches())

    def __iter__(self) -> Iterator[Any]:
        # A plain method, not a generator: the pass starts (and state_dict() reports its
        # start) at iter(), not at the first next().
        batches = self._current_batches(for_pass=True)
        start, self._resume_at = self._resume_at, 0
        self._done = start
        return self._hand_out(batches[start:])

    def _hand_out(self, batches: list[Any]) -> Iterator[Any]:
        for batch in batches:
            self._done += 1
            yield self._output(batch)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, which with the seed decides the plan and the order.

        A resume point loaded with :meth:`load_state_dict` holds only for the
        epoch it was saved in; moving to another epoch starts that epoch from
        its beginning.
        """
        epoch = check_non_negative_int("epoch", epoch)
        if epoch != self.epoch:
            self._resume_at = 0
            self._done = 0
        self.epoch = epoch

    def set_min_batches(self, min_batches: int) -> None:
        """Every epoch yields at least ``min_batches`` batches per rank (the largest batches or bins are split).

        For a loop that fixes the steps per epoch once, like the HF ``Trainer``
        (``len`` of the first epoch): pass the most batches any epoch has
        (:meth:`max_len`), so no epoch ends before its batches do.
        """
        self.min_batches = check_non_negative_int("min_batches", min_batches)
        self._cache = None

    def max_len(self, epochs: int) -> int:
        """The most batches per rank any of epochs ``0 .. epochs - 1`` has (planning each)."""
        epochs = check_positive_int("epochs", epochs)
        current, most = self.epoch, 0
        try:
            for epoch in range(epochs):
                self.epoch = epoch
                most = max(most, len(self))
        finally:
            self.epoch = current
        if current != epochs - 1:
            len(self)  # the current epoch's plan (and what planning records) again
        return most

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch, plus what identifies the data, the settings and the world size."""
        state = {
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "shard": self.shard,
            "epoch": self.epoch,
            "batches_done": self._done,
        }
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state``: the next iteration continues that epoch where it stopped.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: the state belongs to other data or settings, another
                world size, or has a position past the epoch's end.
        """
        if not isinstance(state, dict):
            raise bad_type("state", f"a dict from {type(self).__name__}.state_dict()", state)
        keys = {"fingerprint", "epoch", "batches_done", *self._compared_state, *self._state_keys}
        missing = keys - set(self._state_defaults) - set(state)
        if missing:
            raise bad_value("state", f"a dict with the keys of state_dict() (missing {sorted(missing)})", state)
        state = {**self._state_defaults, **state}
        for key in self._compared_state:
            if state[key] != getattr(self, key):
                raise bad_value(f"state[{key!r}]", f"{getattr(self, key)!r} as in this sampler", state[key])
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"state should come from a sampler over the same {self._same_what} (fingerprint "
                f"{self.fingerprint!r}), but got state['fingerprint']={state['fingerprint']!r}{self._differ_hint}"
            )
        epoch = check_non_negative_int("state['epoch']", state["epoch"])
        done = check_non_negative_int("state['batches_done']", state["batches_done"])
        self.epoch = epoch
        self._check_resumed_plan(state)
        available = len(self)
        if done > available:
            raise bad_value("state['batches_done']", f"at most {available} (the batches of epoch {epoch})", done)
        self._resume_at = self._done = done


class PlannedBatchSampler(EpochPasses, Sampler[list[int]], ABC):
    """Base of the batch samplers over a pure plan: order, epochs, ``state_dict`` and sharding.

    Subclasses implement :meth:`plan` and :meth:`identity`.

    Args:
        shuffle: permute the batch order (by steps, see the module docs) every
            epoch, keeping the plan's first batch first.
        seed: seeds the permutation together with the epoch (and whatever
            randomness the plan uses); the global random state is never touched.
        num_replicas: number of ranks; defaults to the world size of the
            initialised process group, else 1.
        rank: this rank; defaults to the rank in the process group, else 0.
        shard: ``True`` yields this rank's batches; ``False`` yields every rank's
            batches step by step, for a wrapper that deals them out round-robin
            (accelerate / HF ``Trainer``).

    ``len(sampler)`` is the number of batches this rank gets in the current
    epoch (equal on every rank). Call :meth:`set_epoch` before each epoch.

    ``state_dict()`` counts the batches handed out by the sampler. A DataLoader
    with worker processes asks for batches ahead of the ones your loop has
    consumed; to resume exactly, save with ``num_workers=0`` or set
    ``state["batches_done"]`` to the number of batches your loop consumed.
    """

    _compared_state = ("shuffle", "seed", "num_replicas", "shard", "min_batches")
    _state_defaults: ClassVar[dict[str, Any]] = {"min_batches": 0}  # states saved before min_batches existed
    _differ_hint = ": the lengths, the constraint or the planning arguments differ"

    def __init__(
        self,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shard: bool = True,
    ) -> None:
        for name, value in (("shuffle", shuffle), ("shard", shard)):
            if not isinstance(value, bool):
                raise bad_type(name, "a bool", value)
        self.shuffle = shuffle
        self.shard = shard
        self.seed = check_non_negative_int("seed", seed)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self._start_epochs()
        self._cache: tuple[int, list[np.ndarray]] | None = None

    @abstractmethod
    def plan(self, epoch: int) -> list[np.ndarray]:
        """The batches (1-D integer arrays of dataset indices) of the whole dataset for ``epoch``.

        Must be deterministic for ``(self.seed, epoch)`` and identical on every
        rank; every index the epoch covers appears exactly once. Put the batch
        that needs the most memory first.
        """

    @abstractmethod
    def identity(self) -> Iterable[Any]:
        """What the plan depends on (lengths arrays, settings): hashed into :attr:`fingerprint`."""

    def epoch_batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The batches this sampler yields in ``epoch`` (default: the current one), in order."""
        epoch = self.epoch if epoch is None else check_non_negative_int("epoch", epoch)
        if self._cache is None or self._cache[0] != epoch:
            planned = [np.asarray(b, dtype=np.int64) for b in self.plan(epoch)]
            planned = split_for_replicas(planned, self.num_replicas, self.min_batches)
            order = order_steps(len(planned), self.num_replicas, shuffle=self.shuffle, seed=self.seed, epoch=epoch)
            if self.shard:
                order = order[self.rank :: self.num_replicas]
            self._cache = (epoch, [planned[i] for i in order.tolist()])
        return self._cache[1]

    def _current_batches(self, for_pass: bool = False) -> list[np.ndarray]:
        return self.epoch_batches()

    def _output(self, batch: np.ndarray) -> list[int]:
        return batch.tolist()

    def _extra_state(self) -> dict[str, Any]:
        return {"shuffle": self.shuffle, "min_batches": self.min_batches}

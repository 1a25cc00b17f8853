"""The one base of every dynabatch batch sampler: order, epochs, resumption and ranks.

A sampler supplies one pure function, :meth:`PlannedBatchSampler.plan`: the
batches covering the dataset for an epoch, deterministic for ``(seed, epoch)``,
and :meth:`~PlannedBatchSampler.identity`, what the plan depends on. This base
turns the plan into a ``torch.utils.data.Sampler`` of batches, the same way for
the inference loader's :class:`~dynabatch.sampling.inference_sampler.DynamicBatchSampler`,
the :class:`~dynabatch.sampling.smart.SmartBatchSampler`, the multi-task
``MemoryAwareBatchSampler`` and its step sampler, and the
:class:`~dynabatch.sampling.multipack.MultipackBatchSampler`:

* **Batches.** A batch is a 1-D array of dataset indices, or a list of them
  (*groups*: the bins of a packed row, the micro-batches of a step), handed
  out as :meth:`~PlannedBatchSampler._output` makes them (lists of ints by default).
* **Order.** With ``shuffle=True`` the batch order is a seeded permutation per
  epoch (``np.random.default_rng([seed, epoch])``, never the global state).
  The plan's first batch stays first, so a planner that puts its heaviest batch
  there shows an out-of-memory error at step 1 rather than an hour in.
* **Ranks** (:mod:`dynabatch.sampling.ranks`, the one routine): ``num_replicas``
  and ``rank`` default to the process group when one is initialised; the
  batches with the most samples are split until every rank gets the same
  number, then dealt in steps of consecutive batches. Nothing is dropped or
  repeated; an epoch whose samples cannot make as many batches for every rank
  (fewer samples than ranks, or one-sample batches that cannot be split) is refused. ``shard=False``
  yields every rank's batches, step by step (the batch for rank 0, then rank 1,
  ...), for a wrapper that deals batch ``i`` to rank ``i % num_replicas``
  (accelerate's ``BatchSamplerShard``, which the HF ``Trainer`` puts in front
  of a custom batch sampler); each rank then gets exactly its share.
* **Epochs and resumption.** :meth:`~PlannedBatchSampler.set_epoch` chooses the
  epoch; :meth:`~PlannedBatchSampler.state_dict` records the epoch and the
  batches handed out so far plus a :attr:`~PlannedBatchSampler.fingerprint` of
  the data and settings (:func:`dynabatch._digest.fingerprint`: stable across
  processes); :meth:`~PlannedBatchSampler.load_state_dict` continues that epoch
  exactly where it stopped and refuses a state saved for other data, settings
  or world size. A state taken after ``set_epoch`` moved to a new epoch is that
  epoch's start.
* **Steps per epoch.** ``set_min_batches(n)`` makes every epoch at least ``n``
  batches per rank (more splits), for a loop that fixes the steps per epoch
  from the first epoch's ``len()`` (the HF ``Trainer``);
  :meth:`~PlannedBatchSampler.max_len` gives the most any epoch needs.

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

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import Sampler

from dynabatch._digest import fingerprint
from dynabatch._validation import bad_type, bad_value, check_bool, check_non_negative_int, check_positive_int
from dynabatch.sampling.ranks import deal, order_steps, resolve_world, split_for_replicas

__all__ = ["PlannedBatchSampler"]

logger = logging.getLogger(__name__)


def _as_index_array(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values  # already what the plan needs: no copy (a packing plan has 100,000s of bins)
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _as_batch(batch: Any) -> Any:
    if isinstance(batch, (list, tuple)) and batch and not np.isscalar(batch[0]):
        return [_as_index_array(group) for group in batch]
    return _as_index_array(batch)


class PlannedBatchSampler(Sampler[list[int]], ABC):
    """Base of the batch samplers over a pure plan: order, epochs, ``state_dict`` and ranks.

    Subclasses implement :meth:`plan` and :meth:`identity`, and may override
    :meth:`_output` (what a batch is handed out as).

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

    ``len(sampler)`` is the number of batches this sampler yields in the current
    epoch (this rank's, equal on every rank; with ``shard=False`` every rank's).
    Call :meth:`set_epoch` before each epoch.

    ``state_dict()`` counts the batches handed out by the sampler. A DataLoader
    with worker processes asks for batches ahead of the ones your loop has
    consumed; to resume exactly, save with ``num_workers=0`` or set
    ``state["batches_done"]`` to the number of batches your loop consumed.
    """

    #: state keys that must equal this sampler's attributes to load (besides the fingerprint).
    _compared_state: tuple[str, ...] = ("shuffle", "seed", "num_replicas", "shard", "min_batches")
    #: further keys a state must have (the ones :meth:`_extra_state` adds).
    _state_keys: tuple[str, ...] = ()
    #: values of compared keys that states saved by older versions lack.
    _state_defaults: ClassVar[dict[str, Any]] = {"min_batches": 0}
    #: how a fingerprint mismatch is explained: what must be the same, then what differs.
    _same_what = "data and settings"
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
            check_bool(name, value)
        self.shuffle = shuffle
        self.shard = shard
        self.seed = check_non_negative_int("seed", seed)
        self.rank, self.num_replicas = resolve_world(rank, num_replicas)
        self.epoch = 0
        self.min_batches = 0
        self._done = 0  # batches handed out in the current pass
        self._resume_at = 0  # where the next pass starts (a loaded state)
        self._cache: tuple[int, list[Any]] | None = None

    # -- what a subclass supplies ---------------------------------------------
    @abstractmethod
    def plan(self, epoch: int) -> list[Any]:
        """The batches of the whole dataset for ``epoch`` (arrays of indices, or lists of them).

        Must be deterministic for ``(self.seed, epoch)`` and identical on every
        rank; every index the epoch covers appears exactly once. Put the batch
        that needs the most memory first.
        """

    @abstractmethod
    def identity(self) -> Iterable[Any]:
        """What the plan depends on (lengths arrays, settings): digested into :attr:`fingerprint`."""

    def _output(self, batch: Any) -> Any:
        """A batch as handed out: a list of ints, or a list of lists for a grouped batch."""
        if isinstance(batch, list):
            return [group.tolist() for group in batch]
        return batch.tolist()

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_resumed_plan(self, state: dict[str, Any]) -> None:
        """Called by :meth:`load_state_dict` once the state's epoch is planned."""

    # -- the epoch's batches ---------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """Digest of the class name and :meth:`identity`: a saved state only loads into a sampler with the same one."""
        return fingerprint(type(self).__name__, *self.identity())

    def epoch_batches(self, epoch: int | None = None) -> list[Any]:
        """The batches this sampler yields in ``epoch`` (default: the current one), in order."""
        epoch = self.epoch if epoch is None else check_non_negative_int("epoch", epoch)
        if self._cache is None or self._cache[0] != epoch:
            planned = [_as_batch(b) for b in self.plan(epoch)]
            planned = split_for_replicas(planned, self.num_replicas, self.min_batches)
            order = order_steps(len(planned), self.num_replicas, shuffle=self.shuffle, seed=self.seed, epoch=epoch)
            if self.shard:
                order = deal(order, self.num_replicas, self.rank)
            self._cache = (epoch, [planned[i] for i in order.tolist()])
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.epoch_batches())

    def __iter__(self) -> Iterator[Any]:
        # A plain method, not a generator: the pass starts (and state_dict() reports its
        # start) at iter(), not at the first next().
        batches = self.epoch_batches()
        start, self._resume_at = self._resume_at, 0
        self._done = start
        return self._hand_out(batches[start:])

    def _hand_out(self, batches: list[Any]) -> Iterator[Any]:
        for batch in batches:
            self._done += 1
            yield self._output(batch)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, which with the seed decides the plan and the order.

        Moving to another epoch starts it from its beginning: a resume point
        loaded with :meth:`load_state_dict` holds only for the epoch it was
        saved in, and a state taken now is the new epoch's start.
        """
        epoch = check_non_negative_int("epoch", epoch)
        if epoch != self.epoch:
            self._resume_at = 0
            self._done = 0
        self.epoch = epoch

    def set_min_batches(self, min_batches: int) -> None:
        """Every epoch yields at least ``min_batches`` batches per rank (the largest batches are split).

        For a loop that fixes the steps per epoch once, like the HF ``Trainer``
        (``len`` of the first epoch): pass the most batches any epoch has
        (:meth:`max_len`), so no epoch ends before its batches do.
        """
        self.min_batches = check_non_negative_int("min_batches", min_batches)
        self._cache = None

    def max_len(self, epochs: int) -> int:
        """The most batches per rank any of epochs ``0 .. epochs - 1`` has (planning each): what :meth:`set_min_batches` takes.

        With ``shard=False`` the sampler yields every rank's batches (a
        multiple of ``num_replicas``) for a wrapper to deal, and ``len`` counts
        them all; a rank gets ``1 / num_replicas`` of them.
        """
        epochs = check_positive_int("epochs", epochs)
        most = max(len(self.epoch_batches(epoch)) for epoch in range(epochs))
        self.epoch_batches()  # the current epoch's plan again (and what planning records)
        return most if self.shard else most // self.num_replicas

    # -- resumption --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch, plus what identifies the data, the settings and the world size."""
        state = {
            "fingerprint": self.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "shard": self.shard,
            "min_batches": self.min_batches,
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

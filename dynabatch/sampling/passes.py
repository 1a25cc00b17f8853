"""Epochs, the position in one, resumption and the world: what dynabatch's batch samplers share.

:class:`EpochPasses` is the part of
:class:`dynabatch.sampling.base.PlannedBatchSampler` and
:class:`dynabatch.sampling.multipack.MultipackBatchSampler` that does not
depend on what a batch is: ``set_epoch``, ``len``, ``iter`` (a pass that
counts the batches handed out), ``set_min_batches`` / ``max_len``,
``state_dict`` / ``load_state_dict`` (resume mid-epoch; refuse a state of other
data, settings or world size) and the :attr:`~EpochPasses.fingerprint`.
:func:`resolve_world` gives ``(num_replicas, rank)`` defaulting to the process
group's; :func:`reduce_across_ranks` reduces a few numbers over its ranks.

Example:
    >>> class Three(EpochPasses):
    ...     def __init__(self):
    ...         self.seed, self.num_replicas, self.shard, self._cache = 0, 1, True, None
    ...         self._start_epochs()
    ...     def identity(self):
    ...         return ["three"]
    ...     def _current_batches(self, for_pass=False):
    ...         return [[0, 1], [2], [3, 4]]
    >>> s = Three()
    >>> it = iter(s); first = next(it)
    >>> resumed = Three(); resumed.load_state_dict(s.state_dict())
    >>> first, list(resumed)
    ([0, 1], [[2], [3, 4]])
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from dynabatch._validation import (
    bad_type,
    bad_value,
    check_non_negative_int,
    check_positive_int,
)

__all__ = ["EpochPasses", "fingerprint", "process_group", "reduce_across_ranks", "resolve_world"]


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


def process_group() -> tuple[int, int] | None:
    """``(world_size, rank)`` of the initialised ``torch.distributed`` process group, or ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


def reduce_across_ranks(values: Sequence[float], op: str = "sum") -> list[float]:
    """``values`` reduced element-wise (``"sum"``, ``"min"`` or ``"max"``) over the process group's ranks.

    One float64 ``all_reduce``, on the device the group's backend takes (the
    current CUDA device under NCCL, else the CPU); without a process group
    (or with one rank) the values themselves. Every rank must call it with as
    many values.

    Example:
        >>> reduce_across_ranks([2, 3.5], "max")  # no process group here
        [2.0, 3.5]
    """
    if op not in ("sum", "min", "max"):
        raise bad_value("op", "one of 'sum', 'min', 'max'", op)
    values = [float(v) for v in values]
    group = process_group()
    if group is None or group[0] == 1:
        return values
    import torch
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=ops[op])
    return tensor.tolist()


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
        """The most batches per rank any of epochs ``0 .. epochs - 1`` has (planning each): what :meth:`set_min_batches` takes.

        With ``shard=False`` the sampler yields every rank's batches (a
        multiple of ``num_replicas``) for a wrapper to deal, and ``len`` counts
        them all; a rank gets ``1 / num_replicas`` of them.
        """
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
        return most if self.shard else most // self.num_replicas

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

"""A batch sampler over a prebuilt plan: order, epochs and resumption, nothing else.

The plan (batches of input positions, from :func:`dynabatch.sampling.planner.plan_batches`)
is fixed; the sampler decides only the order the batches are handed out in.
With ``shuffle=True`` the order is a seeded permutation per epoch that keeps the
first, hardest batch first, so an out-of-memory error shows at once rather than
an hour in. ``state_dict``/``load_state_dict`` resume mid-epoch, and refuse a
state saved for another plan.

Example:
    >>> from dynabatch.sampling.sampler import DynamicBatchSampler
    >>> sampler = DynamicBatchSampler([[4, 2], [0], [1, 3]], shuffle=True, seed=0)
    >>> list(sampler)[0], len(sampler)
    ([4, 2], 3)
    >>> it = iter(sampler); _ = next(it)
    >>> state = sampler.state_dict()
    >>> resumed = DynamicBatchSampler([[4, 2], [0], [1, 3]], shuffle=True, seed=0)
    >>> resumed.load_state_dict(state)
    >>> list(resumed) == list(it)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from dynabatch._validation import bad_type, bad_value, check_non_negative_int
from dynabatch.data.collate import fingerprint_batches

__all__ = ["DynamicBatchSampler"]


class DynamicBatchSampler(Sampler[list[int]]):
    """Yields the planned batches (lists of input positions), in plan order or shuffled.

    Args:
        batches: the plan: one sequence of input positions per batch, hardest first.
        shuffle: permute the batch order every epoch, keeping batch 0 first.
        seed: seeds the permutation (with the epoch); the global random state
            is never touched.

    ``len(sampler)`` is the number of batches. With ``shuffle=True`` call
    :meth:`set_epoch` before each epoch for a new order.

    ``state_dict()`` records the batches handed out so far in the current
    epoch. A DataLoader with worker processes asks for batches ahead of the
    ones your loop has consumed; to resume exactly, save the state with
    ``num_workers=0`` or correct ``state["batches_done"]`` to the number you
    consumed.

    A sampler made by :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader`
    also carries the loader's plan as ``sampler.plan`` (found under wrappers such
    as ``accelerate``'s), else ``None``.
    """

    def __init__(self, batches: Sequence[Sequence[int]], *, shuffle: bool = False, seed: int = 0) -> None:
        if isinstance(batches, (str, bytes)) or not hasattr(batches, "__len__"):
            raise bad_type("batches", "a sequence of sequences of input positions", batches)
        if not isinstance(shuffle, bool):
            raise bad_type("shuffle", "a bool", shuffle)
        self.seed = check_non_negative_int("seed", seed)
        self.shuffle = shuffle
        self.batches = [np.asarray(b, dtype=np.int64) for b in batches]
        self.fingerprint = fingerprint_batches(self.batches)[:16]
        self.epoch = 0
        self._done = 0  # batches handed out in the current epoch
        self._resume_at = 0
        self.plan: Any = None

    def __len__(self) -> int:
        return len(self.batches)

    def _order(self) -> np.ndarray:
        n = len(self.batches)
        if not self.shuffle or n < 3:
            return np.arange(n)
        rng = np.random.default_rng([self.seed, self.epoch])
        return np.concatenate([[0], 1 + rng.permutation(n - 1)])

    def __iter__(self) -> Iterator[list[int]]:
        start, self._resume_at = self._resume_at, 0
        self._done = start
        for i in self._order()[start:].tolist():
            self._done += 1
            yield self.batches[i].tolist()

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch, which with the seed decides the shuffled order.

        A resume point loaded with :meth:`load_state_dict` holds only for the
        epoch it was saved in; moving to another epoch starts it from the beginning.
        """
        epoch = check_non_negative_int("epoch", epoch)
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """The position in the current epoch, plus what identifies the plan and the order."""
        return {
            "fingerprint": self.fingerprint,
            "num_batches": len(self.batches),
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "batches_done": self._done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state``: the next iteration continues that epoch where it stopped.

        Raises:
            ValueError: the state belongs to another plan, or to other shuffle settings.
        """
        if not isinstance(state, dict):
            raise bad_type("state", "a dict from DynamicBatchSampler.state_dict()", state)
        missing = {"fingerprint", "shuffle", "seed", "epoch", "batches_done"} - set(state)
        if missing:
            raise bad_value("state", f"a dict with the keys of state_dict() (missing {sorted(missing)})", state)
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"state should come from the same plan (fingerprint {self.fingerprint!r}, "
                f"{len(self.batches)} batches), but got state['fingerprint']={state['fingerprint']!r}: "
                "the texts, tokenizer or planning arguments differ"
            )
        for key in ("shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise bad_value(f"state[{key!r}]", f"{getattr(self, key)!r} as in this sampler", state[key])
        self.epoch = check_non_negative_int("state['epoch']", state["epoch"])
        self._resume_at = self._done = check_non_negative_int("state['batches_done']", state["batches_done"])
        if self._resume_at > len(self.batches):
            raise bad_value("state['batches_done']", f"at most {len(self.batches)}", self._resume_at)

"""Sequence packing: axolotl's ``MultipackBatchSampler`` API, exact, resumable and fast.

Several sequences are packed into one fixed-capacity row ("bin") of at most
``batch_max_len`` tokens and at most ``bin_size`` sequences; ``batch_size``
bins make a batch. The planner packs each group of ``group_size`` sequences
first fit, in a shuffled order (as axolotl does since 2025) or longest first
(first-fit decreasing, FFD, as axolotl did before) when that needs fewer bins,
so it never needs more bins than either (``algorithm="ffd"`` keeps the exact
FFD bins; see :mod:`dynabatch.sampling._ffd_kernels`). The sampler keeps
axolotl's names, argument order, defaults and return shapes.

What this implementation adds to the reference:

* **Nothing is lost silently.** A sequence longer than ``batch_max_len`` raises a ``ValueError`` naming it (or
  is truncated to ``batch_max_len`` with ``oversized="truncate"``); the reference put it alone in an over-full
  bin. ``drop_last`` (the reference's default ``True`` is kept) drops only whole bins that cannot fill a batch on
  every rank; the samples dropped are counted in :attr:`MultipackBatchSampler.num_samples_dropped` and logged
  at WARNING, once per epoch.
* **Deterministic.** The same ``seed`` and epoch give the same batches whatever ``num_processes`` (groups are
  packed independently and concatenated in order), on every rank. A ``RandomSampler`` is replaced by a
  permutation from ``np.random.default_rng([seed, epoch])``: torch's ``RandomSampler`` draws a fresh order on
  every iteration, which would make ``len()``, resumption and the ranks disagree.
* **Bins in random batches.** Unless ``sequential=True``, an epoch's bins are shuffled (seeded by ``seed`` and
  the epoch) before they are grouped into batches of ``batch_size`` bins, so a batch's composition does not
  follow the packer's order (nor the lengths), and ``drop_last`` drops randomly composed bins: at most one
  batch's worth per rank.
* **Resumable and sharded** on the one sampler base,
  :class:`dynabatch.sampling.base.PlannedBatchSampler` (a batch is a grouped
  batch there: its groups are the bins): ``state_dict`` / ``load_state_dict``
  resume mid-epoch; ``num_replicas`` ranks get the same number of batches and
  disjoint indices, without dropping anything unless ``drop_last`` (a batch
  split to even the counts is split between its bins first); ``shard=False``
  yields every rank's batches in turn for accelerate's round-robin dealer, so
  the HF ``Trainer`` hook (:class:`dynabatch.training.hf.BatchSamplerTrainer`)
  takes it like any other dynabatch sampler.

The packer is :func:`dynabatch.sampling.ffd.pack_arrays`, its compiled kernels
(and why numba) in :mod:`dynabatch.sampling._ffd_kernels`; axolotl's packing
functions (``ffd_check``, ``pack_group``, ``pack_parallel``,
``allocate_sequentially``) are in :mod:`dynabatch.compat.axolotl`.

Example:
    >>> import numpy as np
    >>> from dynabatch.sampling.multipack import MultipackBatchSampler
    >>> lengths = np.array([5, 3, 8, 2, 6, 4, 7, 1])
    >>> sampler = MultipackBatchSampler(list(range(8)), batch_size=2, batch_max_len=10,
    ...                                 lengths=lengths, drop_last=False)
    >>> batches = list(sampler)
    >>> batches  # bins (each within 10 tokens) in a seeded random order, two per batch
    [[[4, 5], [2, 7]], [[6], [1, 3, 0]]]
    >>> all(lengths[b].sum() <= 10 for batch in batches for b in batch)
    True
    >>> len(sampler), round(sampler.efficiency(), 3)
    (2, 0.9)
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from itertools import pairwise
from typing import Any

import numpy as np
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from dynabatch._digest import fingerprint
from dynabatch._validation import (
    bad_type,
    bad_value,
    check_bool,
    check_lengths,
    check_positive_int,
    check_positive_number,
)
from dynabatch.sampling._ffd_kernels import bins_to_lists, sequential_offsets
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.ffd import check_algorithm, check_fits, check_start_method, pack_arrays
from dynabatch.sampling.ranks import reduce_across_ranks
from dynabatch.sampling.smart import as_lengths

__all__ = ["MultipackBatchSampler"]

LOG = logging.getLogger(__name__)

_EXTRA_KWARGS = ("seed", "oversized", "num_replicas", "rank", "shard", "algorithm")


class MultipackBatchSampler(PlannedBatchSampler, BatchSampler):
    """Batch sampler class for efficient packing of variable-length sequences.

    This sampler packs sequences into fixed-capacity bins (batches) to maximize
    GPU memory utilization and training throughput by reducing padding. It
    supports both parallel packing (first fit per group, shuffled or longest
    first, whichever needs fewer bins; the reference: the FFD algorithm) and
    sequential packing (preserving original sequence order). Each batch is a list of up to
    ``batch_size`` bins, each bin a list of dataset indices.

    Args:
        sampler: the order of the dataset indices (e.g. ``RandomSampler(ds)``,
            ``SequentialSampler(ds)`` or a list); it must cover as many items as
            ``lengths``. A ``RandomSampler`` becomes a seeded permutation per
            epoch (see the module docs); any other sampler is iterated each
            epoch (its ``set_epoch`` is called) and must give one permutation of
            the dataset, the same on every pass (else ``ValueError`` when built). A
            ``DistributedSampler`` over several ranks is refused: this sampler
            shares the batches among ranks itself (``num_replicas``, ``rank``).
        batch_size: Number of bins per batch.
        batch_max_len: Bin capacity in tokens (maximum sequence length).
        lengths: Sequence lengths indexed like the dataset, in the forms every sampler takes: 1-D,
            ``(n, 1)``, or one key field's mapping (``tokenize_source(...).lengths``).
        packing_efficiency_estimate: Initial efficiency estimate, in (0, 1]; kept
            for compatibility (the batch count here is exact, not estimated).
        drop_last: Drop the bins that cannot fill a last batch of ``batch_size`` bins on every rank
            (counted in :attr:`num_samples_dropped`, a WARNING once per epoch); ``False`` keeps all.
        num_count_samples: kept for compatibility: the reference estimated the
            batch count from this many random packings; here the epoch's plan is
            deterministic, so ``len()`` is exact.
        sequential: pack in sampler order (a bin never mixes non-neighbours)
            instead of by groups.
        group_size: Sequences per packing group.
        bin_size: Maximum number of sequences in one bin.
        num_processes: processes for packing the groups (``None``: this process).
        safe_mode: kept for compatibility: a group may always open one bin per sequence, so it never binds.
        mp_start_method: start method of those processes.
        **kwargs: dynabatch's additions, all optional: ``seed`` (0; with the epoch
            seeds the order of a ``RandomSampler``), ``oversized`` (``"error"``,
            or ``"truncate"`` to count a too-long sequence as ``batch_max_len``
            tokens: truncate it when collating, e.g.
            ``PackedCollator(max_length=batch_max_len)``), ``num_replicas`` and
            ``rank`` (default: the process group's), ``shard`` (``True``; ``False``
            yields every rank's batches in turn, for accelerate's dealer),
            ``algorithm`` (``"auto"``: per group, first fit in a shuffled order
            seeded by ``seed`` and the epoch, or longest first when that needs
            fewer bins; ``"ffd"``: the reference's first-fit decreasing, its
            exact bins; ``"shuffled"``: the shuffled order only, as axolotl
            since 2025). Other keywords are ignored with a warning, as the
            reference ignores them.

    ``len(sampler)`` is this rank's number of batches in the current epoch (the
    same on every rank). Call :meth:`set_epoch` before each epoch. Epochs,
    ``set_min_batches``, ``max_len``, ``state_dict`` and ``load_state_dict``
    are the base's (:class:`~dynabatch.sampling.base.PlannedBatchSampler`).
    """

    _state_keys = ("order_fingerprint",)
    _same_what = "lengths and packing settings"
    _differ_hint = ""
    yields_bins = True  # a batch is a list of bins: a DataLoader needs a PackedDataset (the Trainer hook wraps it)

    def __init__(
        self,
        sampler: Sampler[int] | Iterable[int],
        batch_size: int,
        batch_max_len: int,
        lengths: np.ndarray,
        packing_efficiency_estimate: float = 1.0,
        drop_last: bool = True,
        num_count_samples: int = 4,
        sequential: bool = False,
        group_size: int = 100000,
        bin_size: int = 200,
        num_processes: int | None = None,
        safe_mode: bool = True,
        mp_start_method: str = "fork",
        **kwargs: Any,
    ) -> None:
        batch_size = check_positive_int("batch_size", batch_size)
        self.batch_max_len = check_positive_int("batch_max_len", batch_max_len)
        for name, value in (("drop_last", drop_last), ("sequential", sequential), ("safe_mode", safe_mode)):
            check_bool(name, value)
        unknown = sorted(set(kwargs) - set(_EXTRA_KWARGS))
        if unknown:
            LOG.warning("MultipackBatchSampler ignores the keyword arguments %s", unknown)
        # The batches come in the order planned (bins are shuffled in the plan): the base does not reorder them.
        PlannedBatchSampler.__init__(self, shuffle=False, seed=kwargs.get("seed", 0),
                                     num_replicas=kwargs.get("num_replicas"), rank=kwargs.get("rank"),
                                     shard=kwargs.get("shard", True))
        BatchSampler.__init__(self, sampler, batch_size, drop_last)
        self.packing_efficiency_estimate = check_positive_number(
            "packing_efficiency_estimate", packing_efficiency_estimate or 1.0)
        if self.packing_efficiency_estimate > 1:
            raise bad_value("packing_efficiency_estimate", "in (0, 1]", packing_efficiency_estimate)
        self.num_count_samples = check_positive_int("num_count_samples", num_count_samples)
        self.sequential = sequential
        self.group_size = check_positive_int("group_size", group_size)
        self.bin_size = check_positive_int("bin_size", bin_size)
        self.num_processes = None if num_processes is None else check_positive_int("num_processes", num_processes)
        self.safe_mode = safe_mode
        self.mp_start_method = check_start_method(mp_start_method)
        self.algorithm = check_algorithm(kwargs.get("algorithm", "auto"))
        self.oversized = kwargs.get("oversized", "error")
        if self.oversized not in ("error", "truncate"):
            raise bad_value("oversized", "'error' or 'truncate'", self.oversized)

        self.lengths = self._check_lengths(lengths)
        self._check_sampler(sampler)
        if self.sequential and not isinstance(sampler, SequentialSampler) and isinstance(sampler, RandomSampler):
            LOG.warning("sequential=True with a RandomSampler packs neighbours of a shuffled order")

        self.total_tokens_used = 0
        self.total_token_slots = 0
        self.num_samples_dropped = 0
        self._warned_epoch: int | None = None  # the last epoch whose dropped samples were logged
        self.len_across_ranks: int | None = None
        self._last_order: tuple[int, np.ndarray] | None = None  # the last epoch planned and the sampler's order
        self._stats_epoch: int | None = None
        self._order(self.epoch)  # a sampler that is not a fixed permutation of the dataset is refused now

    # ----------------------------------------------------------------- validation

    def _check_lengths(self, lengths: Any) -> np.ndarray:
        columns, names = as_lengths(lengths)  # every sampler's forms: 1-D, (n, 1), {field: lengths}
        keyed = isinstance(lengths, Mapping)
        if columns.shape[1] != 1:
            raise bad_value("lengths", "one length per sample (a packed row concatenates one sequence per sample): "
                            f"pass {f'one field of {list(names)}' if keyed else 'one column'}",
                            f"<{columns.shape[1]} key fields of {len(columns)} samples>")
        array = check_lengths(f"lengths[{names[0]!r}]" if keyed else "lengths", columns[:, 0], positive=True)
        if self.oversized == "error":
            check_fits("lengths", array, self.batch_max_len,
                       f" (batch_max_len={self.batch_max_len}; pass oversized='truncate' to cut it)")
        return np.minimum(array, self.batch_max_len)

    def _check_sampler(self, sampler: Any) -> None:
        if isinstance(sampler, DistributedSampler):
            if sampler.num_replicas > 1:
                # Each rank would pack only its own share, into its own number of batches: DDP would wait forever
                # on the rank with fewer (and with num_replicas > 1 here too, the share would be split again).
                raise bad_value("sampler", "an order of the whole dataset (RandomSampler, SequentialSampler or a "
                                "list of indices), not a DistributedSampler over several ranks: "
                                "MultipackBatchSampler shares its batches among the ranks itself (num_replicas, "
                                "rank), every rank the same number, while each rank's share of a DistributedSampler "
                                "packs into its own number of batches", f"<DistributedSampler over "
                                f"num_replicas={sampler.num_replicas}, rank={sampler.rank}>")
            size = len(sampler.dataset)  # type: ignore[arg-type]
        elif hasattr(sampler, "__len__"):
            size = len(sampler)
        else:
            raise bad_type("sampler", "a Sampler or an iterable of indices with a length", sampler)
        if size != self.lengths.size:
            raise ValueError(f"sampler should cover as many items as lengths ({self.lengths.size}), "
                             f"but got len(sampler)={size}")

    # ----------------------------------------------------------------- planning

    def _order(self, epoch: int) -> np.ndarray:
        sampler = self.sampler
        if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == self.lengths.size:
            return np.random.default_rng([self.seed, epoch]).permutation(self.lengths.size)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        order = np.fromiter((int(i) for i in sampler), dtype=np.int64)
        self._check_order(order)
        # The plan is made more than once an epoch (len(), max_len(), a saved state): an order that changes between
        # two passes gives a plan other than the one counted (a Trainer's steps per epoch) and cannot be resumed.
        if not np.array_equal(order, np.fromiter((int(i) for i in sampler), dtype=np.int64)):
            raise bad_value("sampler", "deterministic in an epoch (the same order every time it is iterated, as a "
                            "list of indices, a SequentialSampler or a DistributedSampler, seeded by its epoch; a "
                            "torch generator draws a new order each pass): for a shuffle pass a RandomSampler without "
                            "replacement, which this sampler permutes by seed and epoch",
                            f"<{type(sampler).__name__} that gave two orders in epoch {epoch}>")
        return order

    def _check_order(self, order: np.ndarray) -> None:
        """Refuses an order that is not a permutation of the dataset: an index out of range, missing or repeated."""
        n = self.lengths.size
        if order.size and (order.min() < 0 or order.max() >= n):
            bad = order[(order < 0) | (order >= n)][0]
            raise bad_value("sampler", f"yielding indices in [0, {n})", f"index {bad}")
        counts = np.bincount(order, minlength=n)
        if order.size != n or (counts != 1).any():
            repeated, missing = np.flatnonzero(counts > 1), np.flatnonzero(counts == 0)
            raise bad_value("sampler", f"an order of the dataset yielding each of its {n} indices once (every "
                            "sample packed once an epoch; a sampler with replacement repeats some and leaves others "
                            "out)", f"<{order.size} indices, {repeated.size} repeated (first {repeated[:1].tolist()}), "
                            f"{missing.size} missing (first {missing[:1].tolist()})>")

    def _plan_bins(self, order: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's bins: dataset indices ``items`` and each bin's ``starts`` / ``ends`` into them."""
        lengths = self.lengths[order]
        if self.sequential:
            offsets = sequential_offsets(lengths, self.batch_max_len, self.bin_size)
            items = order
        else:
            flat, offsets = pack_arrays(lengths, self.batch_max_len, self.group_size, self.bin_size,
                                         self.num_processes or 1, self.mp_start_method,
                                         algorithm=self.algorithm, seed=[self.seed, epoch])
            items = order[flat]
        return items, offsets[:-1], offsets[1:]

    def plan(self, epoch: int) -> list[list[np.ndarray]]:
        """The epoch's batches of ``batch_size`` bins: bins shuffled (unless ``sequential``), ``drop_last`` applied."""
        order = self._order(epoch)
        self._last_order = (epoch, order)  # digested only when a state is saved or loaded
        items, starts, ends = self._plan_bins(order, epoch)
        if not self.sequential:  # batches of randomly composed bins, not of the packer's neighbours
            perm = np.random.default_rng([self.seed, epoch, 1]).permutation(starts.size)
            starts, ends = starts[perm], ends[perm]
        if self.drop_last:
            keep = starts.size // (self.num_replicas * self.batch_size) * self.num_replicas * self.batch_size
            self.num_samples_dropped = int((ends[keep:] - starts[keep:]).sum())
            if self.num_samples_dropped and self._warned_epoch != epoch:  # plan() runs several times an epoch
                self._warned_epoch = epoch
                LOG.warning("drop_last=True drops %d of %d samples (%d bins that cannot fill a last batch of %d "
                            "bins on every rank) in epoch %d; drop_last=False keeps every sample",
                            self.num_samples_dropped, self.lengths.size, starts.size - keep, self.batch_size, epoch)
            starts, ends = starts[:keep], ends[:keep]
        else:
            self.num_samples_dropped = 0
        bins = [items[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        return [bins[i : i + self.batch_size] for i in range(0, len(bins), self.batch_size)]

    def generate_batches(self, set_stats: bool = False) -> list[list[list[int]]]:
        """Generate packed batches for training.

        Args:
            set_stats: Whether to update efficiency statistics (once per epoch).

        Returns:
            list[list[list[int]]]: List of batches, where each batch contains
            multiple bins, and each bin contains multiple sequence indices.
        """
        batches = self.epoch_batches()
        bins = [b for batch in batches for b in batch]
        flat = np.concatenate(bins) if bins else np.zeros(0, np.int64)
        if set_stats:
            self._count_stats(flat, len(bins))
        # every bin a list at once (one tolist, list slices): 100,000s of bins in a fraction of a second
        as_lists = bins_to_lists(flat, np.cumsum([0, *map(len, bins)]))
        bounds = np.cumsum([0, *map(len, batches)]).tolist()
        return [as_lists[a:b] for a, b in pairwise(bounds)]

    def _count_stats(self, flat: np.ndarray | None = None, n_bins: int | None = None) -> None:
        """Adds this epoch's tokens and token slots to the efficiency statistics, once per epoch."""
        if self._stats_epoch == self.epoch:
            return
        if flat is None:
            bins = [b for batch in self.epoch_batches() for b in batch]
            flat = np.concatenate(bins) if bins else np.zeros(0, np.int64)
            n_bins = len(bins)
        self._stats_epoch = self.epoch
        self.total_tokens_used += int(self.lengths[flat].sum())
        self.total_token_slots += n_bins * self.batch_max_len

    # ----------------------------------------------------------------- axolotl's sampler methods

    def __iter__(self) -> Any:
        self._count_stats()  # a pass counts in the efficiency statistics
        return super().__iter__()

    def num_batches(self) -> int:
        """The number of batches of this rank in the current epoch."""
        return len(self)

    def efficiency(self) -> float:
        """Calculate the packing efficiency (ratio of tokens used to total token slots).

        Higher is better - 1.0 would mean perfect packing with no wasted space.
        Counts the epochs iterated so far (the current one if none was).
        """
        if self.total_token_slots == 0:
            self._count_stats()
        if self.total_token_slots == 0:
            return 0.0
        return float(self.total_tokens_used / self.total_token_slots)

    def gather_efficiency(self) -> float:
        """Gather and synchronize packing efficiency estimates across all distributed ranks.

        Without a process group, this rank's efficiency is the measurement.

        Returns:
            float: A conservative efficiency estimate based on the measurements:
            99.7% of the best rank's efficiency, rounded down to 0.5% (the
            reference floored to a whole number first, which gave 0.0).
        """
        (best,) = reduce_across_ranks([self.efficiency()], "max")
        LOG.debug("sample packing efficiency across ranks: max %.4f", best)
        return math.floor(0.997 * best * 200.0) / 200.0

    def gather_len_batches(self, num: int) -> int:
        """Gather and synchronize batch counts across all distributed ranks.

        Returns the minimum number of batches available on any rank (``num``
        itself without a process group). This sampler already gives every rank
        the same count; the collective is for callers that check it.
        """
        if isinstance(num, bool) or not isinstance(num, numbers.Real):
            raise bad_type("num", "a number of batches", num)
        least = math.floor(reduce_across_ranks([num], "min")[0])
        LOG.info("gather_len_batches: %d (this rank: %s)", least, num)
        self.len_across_ranks = least
        return least

    # ----------------------------------------------------------------- resumption

    def identity(self) -> list[Any]:
        """The lengths and the packing settings (a saved state only loads into a sampler with equal ones)."""
        return [self.lengths, self.batch_size, self.batch_max_len, self.drop_last, self.sequential, self.group_size,
                self.bin_size, self.oversized, self.algorithm]

    def _order_fingerprint(self) -> str:
        epoch, order = self._last_order if self._last_order is not None else (None, None)
        return fingerprint(order if epoch == self.epoch else self._order(self.epoch))

    def _extra_state(self) -> dict[str, Any]:
        return {"order_fingerprint": self._order_fingerprint()}

    def _check_resumed_plan(self, state: dict[str, Any]) -> None:
        now = self._order_fingerprint()
        if state["order_fingerprint"] != now:
            raise ValueError(
                "state should come from a sampler that gave the same order in that epoch, but got "
                f"state['order_fingerprint']={state['order_fingerprint']!r} (now {now!r}): "
                "pass a deterministic sampler (a RandomSampler is seeded by seed and epoch)"
            )

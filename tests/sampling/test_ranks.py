"""The one routine that deals batches to ranks: world, reduction, splits of flat and grouped batches."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.sampling.ranks import (
    batch_samples,
    deal,
    order_steps,
    reduce_across_ranks,
    resolve_world,
    split_batch,
    split_for_replicas,
)


def test_resolve_world_defaults_and_errors():
    assert resolve_world(None, None) == (0, 1)  # no process group here: (rank, world size)
    assert resolve_world(2, 3) == (2, 3)
    with pytest.raises(ValueError, match="num_replicas should be a positive integer"):
        resolve_world(None, 0)
    with pytest.raises(ValueError, match="rank should be a non-negative integer"):
        resolve_world(-1, 2)
    with pytest.raises(ValueError, match=r"rank should be in \[0, num_replicas=2\), but got rank=2"):
        resolve_world(2, 2)


def test_reduce_across_ranks_without_a_process_group_is_the_values_and_refuses_other_ops():
    # over two gloo ranks it is exercised by the multipack (min/max) and trainer (sum) two-process tests
    assert reduce_across_ranks([2, 3.5], "min") == [2.0, 3.5]
    with pytest.raises(ValueError, match=r"op should be one of 'sum', 'min', 'max', but got op='mean'"):
        reduce_across_ranks([1.0], "mean")


groups_st = st.lists(st.lists(st.integers(0, 10**6), min_size=1, max_size=6), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(groups=groups_st, parts=st.integers(1, 12))
def test_a_grouped_batch_splits_between_groups_first_and_loses_nothing(groups, parts):
    batch = [np.asarray(g) for g in groups]
    total = batch_samples(batch)
    if parts > total:
        return
    pieces = split_batch(batch, parts)
    assert len(pieces) == parts and all(batch_samples(p) > 0 for p in pieces)
    assert np.concatenate([g for p in pieces for g in p]).tolist() == np.concatenate(batch).tolist()  # order kept
    if parts <= len(batch):  # enough groups: every group stays whole
        assert sorted(map(len, (g for p in pieces for g in p))) == sorted(map(len, batch))


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=20), world=st.integers(1, 6),
       grouped=st.booleans())
def test_every_rank_gets_the_same_number_of_batches_and_every_sample_once(sizes, world, grouped):
    edges = np.cumsum([0, *sizes])
    batches = [np.arange(a, b) for a, b in zip(edges[:-1], edges[1:])]
    if grouped:  # bins of two-or-fewer groups each
        batches = [np.array_split(b, min(2, len(b))) for b in batches]
    total = int(edges[-1])
    needed = len(batches) + (-len(batches)) % world
    if total < needed:
        with pytest.raises(ValueError, match=r"num_replicas should be at most \d+ for \d+ samples in \d+ batch"):
            split_for_replicas(batches, world)
        return
    out = split_for_replicas(batches, world)
    assert len(out) % world == 0 and len(out) - len(batches) < world
    order = order_steps(len(out), world, shuffle=True, seed=1, epoch=2)
    shares = [deal(order, world, r).tolist() for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    flat = [int(i) for s in shares for b in s for i in np.concatenate(out[b] if grouped else [out[b]])]
    assert sorted(flat) == list(range(total))


def test_batches_too_small_to_split_for_the_ranks_are_refused_naming_the_rule_and_the_largest_world():
    # 7 samples for 2 ranks, but 7 batches of one sample (each a whole budget): 8 batches cannot be made.
    # "at most the number of samples (7)" was the old rule, which num_replicas=2 keeps.
    single = [np.array([i]) for i in range(7)]
    with pytest.raises(ValueError, match=r"^num_replicas should be at most 1 for 7 samples in 7 batches: 2 ranks need "
                                         r"8 batches \(4 each\) of at least one sample, and batches are only split, "
                                         r"never merged or padded, but got num_replicas=2$"):
        split_for_replicas(single, 2)
    assert len(split_for_replicas(single, 7)) == 7
    # A floor that even one rank cannot reach names min_batches, not num_replicas.
    with pytest.raises(ValueError, match=r"^min_batches should be at most 2 for 2 samples on 1 ranks"):
        split_for_replicas([np.arange(2)], 1, 3)

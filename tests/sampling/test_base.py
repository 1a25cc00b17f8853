import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch._digest import fingerprint
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.ranks import order_steps, split_for_replicas


class _Chunks(PlannedBatchSampler):
    """Consecutive chunks of given sizes; the plan changes with the epoch (rotated sizes)."""

    def __init__(self, sizes, **kwargs):
        super().__init__(**kwargs)
        self.sizes = list(sizes)

    def plan(self, epoch):
        sizes = self.sizes[epoch % len(self.sizes):] + self.sizes[: epoch % len(self.sizes)]
        edges = np.cumsum([0, *sizes])
        return [np.arange(a, b) for a, b in itertools.pairwise(edges)]

    def identity(self):
        return [np.asarray(self.sizes)]


sizes_st = st.lists(st.integers(1, 9), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, world=st.integers(1, 5), seed=st.integers(0, 3), epoch=st.integers(0, 3),
       shuffle=st.booleans())
def test_ranks_get_equal_counts_and_every_index_once(sizes, world, seed, epoch, shuffle):
    total = sum(sizes)
    if total < max(world, len(sizes) + (-len(sizes)) % world):
        with pytest.raises(ValueError, match=r"num_replicas should be at most \d+ for \d+ samples in \d+ batch"):
            _Chunks(sizes, num_replicas=world, rank=0).epoch_batches(epoch)
        return
    per_rank = []
    for rank in range(world):
        s = _Chunks(sizes, num_replicas=world, rank=rank, seed=seed, shuffle=shuffle)
        s.set_epoch(epoch)
        per_rank.append(list(s))
        assert len(s) == len(per_rank[-1])
    assert len({len(b) for b in per_rank}) == 1
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    assert seen == list(range(total))
    assert all(len(b) > 0 for batches in per_rank for b in batches)
    # shard=False deals out, round-robin, exactly what each rank gets with shard=True
    everything = list(_Chunks(sizes, num_replicas=world, seed=seed, shuffle=shuffle, shard=False).epoch_batches(epoch))
    for rank in range(world):
        assert [b.tolist() for b in everything[rank::world]] == per_rank[rank]


def test_split_takes_the_largest_batches_and_keeps_order():
    batches = [np.array([0, 1, 2, 3, 4, 5]), np.array([6, 7]), np.array([8, 9, 10])]
    out = split_for_replicas(batches, 5)
    assert [b.tolist() for b in out] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9, 10]]
    assert split_for_replicas(batches, 3) == batches


def test_first_step_stays_first_and_the_order_changes_with_the_epoch():
    orders = [order_steps(20, 2, shuffle=True, seed=0, epoch=e).tolist() for e in range(3)]
    assert all(o[:2] == [0, 1] for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert order_steps(20, 2, shuffle=True, seed=0, epoch=1).tolist() == orders[1]
    assert order_steps(20, 2, shuffle=True, seed=1, epoch=1).tolist() != orders[1]


def test_resume_mid_epoch_loses_and_repeats_nothing():
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    full = _Chunks(sizes, seed=7)
    full.set_epoch(2)
    expected = list(full)
    s = _Chunks(sizes, seed=7)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["batches_done"] == 4
    resumed = _Chunks(sizes, seed=7)
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert head + tail == expected
    resumed.set_epoch(3)  # the next epoch starts from its beginning
    assert len(list(resumed)) == len(resumed)


def test_set_epoch_to_another_epoch_drops_the_resume_point():
    s = _Chunks([2, 2, 2, 2])
    s.load_state_dict({**s.state_dict(), "batches_done": 3})
    s.set_epoch(1)
    assert len(list(s)) == 4


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"fingerprint": "0" * 16}, ValueError, "state should come from a sampler over the same data"),
        ({"seed": 1}, ValueError, r"state\['seed'\] should be 0 as in this sampler"),
        ({"num_replicas": 2}, ValueError, r"state\['num_replicas'\] should be 1 as in this sampler"),
        ({"shard": False}, ValueError, r"state\['shard'\] should be True"),
        ({"batches_done": 99}, ValueError, r"state\['batches_done'\] should be at most 3"),
        ({"batches_done": -1}, ValueError, r"state\['batches_done'\] should be a non-negative integer"),
    ],
)
def test_load_state_dict_refuses_other_states(change, error, match):
    s = _Chunks([1, 2, 3])
    with pytest.raises(error, match=match):
        s.load_state_dict({**s.state_dict(), **change})


def test_load_state_dict_refuses_other_data_and_non_dicts():
    state = _Chunks([1, 2, 3]).state_dict()
    with pytest.raises(ValueError, match="fingerprint"):
        _Chunks([1, 2, 4]).load_state_dict(state)
    with pytest.raises(TypeError, match="state should be a dict from _Chunks.state_dict"):
        _Chunks([1]).load_state_dict([1])
    with pytest.raises(ValueError, match=r"missing \['batches_done'\]"):
        _Chunks([1]).load_state_dict({k: v for k, v in state.items() if k != "batches_done"})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"shuffle": 1}, TypeError, "shuffle should be a bool"),
        ({"shard": "yes"}, TypeError, "shard should be a bool"),
        ({"seed": -1}, ValueError, "seed should be a non-negative integer, but got seed=-1"),
        ({"num_replicas": 0}, ValueError, "num_replicas should be a positive integer"),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"rank should be in \[0, num_replicas=2\), but got rank=2"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        _Chunks([1], **kwargs)


def test_fingerprint_tells_dtype_and_shape_apart():
    assert fingerprint([np.arange(4)]) != fingerprint([np.arange(4).reshape(2, 2)])
    assert fingerprint([np.arange(4)]) != fingerprint([np.arange(4, dtype=np.int32)])


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, world=st.integers(1, 3), floor=st.integers(0, 40))
def test_min_batches_splits_batches_up_to_a_floor_and_loses_nothing(sizes, world, floor):
    total = sum(sizes)
    per_rank = []
    for rank in range(world):
        s = _Chunks(sizes, num_replicas=world, rank=rank)
        needed = max(len(sizes), floor * world)
        if total < needed + (-needed) % world:
            with pytest.raises(ValueError, match=r"(num_replicas|min_batches) should be at most \d+ for \d+ samples"):
                s.set_min_batches(floor)
                s.epoch_batches()
            return
        s.set_min_batches(floor)
        per_rank.append(list(s))
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) >= floor
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(total))
    # every batch is a contiguous part of one planned chunk
    edges = np.cumsum([0, *sizes])
    for batches in per_rank:
        for b in batches:
            chunk = np.searchsorted(edges, b[0], side="right")
            assert b[-1] < edges[chunk] and b == list(range(b[0], b[0] + len(b)))


def test_max_len_makes_every_epoch_as_long_as_the_longest():
    s = _Chunks([5, 1, 1, 1])  # rotates: every epoch has 4 batches; floor 6 splits the 5-row chunk
    assert s.max_len(3) == 4
    s.set_min_batches(6)
    assert len(s) == 6 and sorted(i for b in s for i in b) == list(range(8))
    state = s.state_dict()
    with pytest.raises(ValueError, match=r"state\['min_batches'\] should be 0 as in this sampler"):
        _Chunks([5, 1, 1, 1]).load_state_dict(state)
    legacy = {k: v for k, v in _Chunks([5, 1, 1, 1]).state_dict().items() if k != "min_batches"}
    _Chunks([5, 1, 1, 1]).load_state_dict(legacy)


def test_state_saved_between_iter_and_the_first_batch_is_the_start_of_the_pass():
    s = _Chunks([2, 2, 2, 2, 2], seed=3)
    expected = list(s)  # a full pass: 5 of 5 handed out
    it = iter(s)  # a new pass starts here, before any next()
    state = s.state_dict()
    assert state["batches_done"] == 0
    resumed = _Chunks([2, 2, 2, 2, 2], seed=3)
    resumed.load_state_dict(state)
    assert list(resumed) == expected == list(it)


class _Epochs(PlannedBatchSampler):
    """Epoch ``e`` has ``e + 1`` one-row batches."""

    def __init__(self):
        super().__init__(shuffle=False)

    def plan(self, epoch):
        return [np.array([i]) for i in range(epoch + 1)]

    def identity(self):
        return ["epochs"]


class _Other(_Epochs):
    pass


def test_max_len_plans_every_epoch_and_keeps_the_current_one_and_its_resume_point():
    s = _Epochs()
    s.set_epoch(1)
    s.load_state_dict({**s.state_dict(), "batches_done": 1})
    assert s.max_len(4) == 4
    assert s.epoch == 1 and list(s) == [[1]]


def test_a_state_loads_only_into_the_same_class_and_keys():
    state = _Epochs().state_dict()
    with pytest.raises(ValueError, match="state should come from a sampler over the same data and settings"):
        _Other().load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['epoch'\]"):
        _Epochs().load_state_dict({k: v for k, v in state.items() if k != "epoch"})

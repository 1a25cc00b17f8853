"""axolotl's packing functions: pack_group, pack_parallel, ffd_check, allocate_sequentially against plain references."""

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.compat.axolotl import allocate_sequentially, ffd_check, pack_group, pack_parallel
from dynabatch.sampling._ffd_kernels import shuffle_noise

lengths_st = st.lists(st.integers(1, 64), min_size=0, max_size=120)


def _brute_ffd(lengths, capacity, bin_size=10**9):
    """FFD written plainly: a list of bins scanned left to right."""
    return _brute_first_fit(lengths, sorted(range(len(lengths)), key=lambda i: -lengths[i]), capacity, bin_size)


def _brute_first_fit(lengths, order, capacity, bin_size=10**9):
    """First fit in ``order`` written plainly (``sorted()`` above is stable: ties in position order)."""
    room, bins = [], []
    for i in order:
        for b in range(len(bins)):
            if room[b] >= lengths[i] and len(bins[b]) < bin_size:
                room[b] -= lengths[i]
                bins[b].append(i)
                break
        else:
            room.append(capacity - lengths[i])
            bins.append([i])
    return bins


def _shuffled_order(m, seed):
    """The order ``algorithm="shuffled"`` places a group of ``m`` in: Fisher-Yates with ``shuffle_noise``."""
    noise, order = shuffle_noise(m, seed), list(range(m))
    for k in range(m - 1, 0, -1):
        j = int(noise[k] * (k + 1))
        order[k], order[j] = order[j], order[k]
    return order


# lengths of every shape the packer meets: long tails, many very short ones (the bin_size cap binds), near capacity
mixed_lengths_st = st.one_of(
    lengths_st,
    st.lists(st.integers(1, 4), max_size=150),
    st.lists(st.one_of(st.integers(1, 3), st.integers(20, 64)), max_size=150),
    st.lists(st.integers(30, 64), max_size=60),
)


@settings(deadline=None, max_examples=80)
@given(lengths=lengths_st, bin_size=st.integers(1, 6), offset=st.integers(0, 50))
def test_pack_group_ffd_flag_gives_the_reference_bins(lengths, bin_size, offset):
    bins = pack_group(np.array(lengths, dtype=np.int64), offset, 64, max(len(lengths), 1), bin_size, algorithm="ffd")
    assert bins == [[i + offset for i in b] for b in _brute_ffd(lengths, 64, bin_size)]


@settings(deadline=None, max_examples=80)
@given(lengths=mixed_lengths_st, bin_size=st.integers(1, 8), seed=st.integers(0, 5))
def test_pack_group_shuffled_flag_is_first_fit_in_the_seeded_order(lengths, bin_size, seed):
    bins = pack_group(np.array(lengths, dtype=np.int64), 0, 64, max(len(lengths), 1), bin_size, algorithm="shuffled",
                      seed=seed)
    assert bins == _brute_first_fit(lengths, _shuffled_order(len(lengths), seed), 64, bin_size)


@settings(deadline=None, max_examples=150)
@given(lengths=mixed_lengths_st, bin_size=st.integers(1, 8), seed=st.integers(0, 5), offset=st.integers(0, 9))
def test_pack_group_never_needs_more_bins_than_ffd_or_shuffled_first_fit(lengths, bin_size, seed, offset):
    arr = np.array(lengths, dtype=np.int64)
    bins = pack_group(arr, offset, 64, max(len(lengths), 1), bin_size, seed=seed)
    ffd = _brute_ffd(lengths, 64, bin_size)
    shuffled = _brute_first_fit(lengths, _shuffled_order(len(lengths), seed), 64, bin_size)
    assert len(bins) <= min(len(ffd), len(shuffled))
    # it is one of the two, the shuffled one unless FFD needs fewer bins
    assert bins == [[i + offset for i in b] for b in (ffd if len(ffd) < len(shuffled) else shuffled)]
    assert sorted(i - offset for b in bins for i in b) == list(range(len(lengths)))  # each index exactly once
    assert all(arr[[i - offset for i in b]].sum() <= 64 and 1 <= len(b) <= bin_size for b in bins)


@settings(deadline=None, max_examples=60)
@given(lengths=mixed_lengths_st, group_size=st.integers(1, 50), bin_size=st.integers(1, 8),
       algorithm=st.sampled_from(["auto", "ffd", "shuffled"]))
def test_pack_parallel_packs_each_group_alone(lengths, group_size, bin_size, algorithm):
    arr = np.array(lengths, dtype=np.int64)
    bins = pack_parallel(arr, bin_capacity=64, group_size=group_size, bin_size=bin_size, num_processes=1,
                         algorithm=algorithm)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(arr[b].sum() <= 64 and 1 <= len(b) <= bin_size for b in bins)
    bounds = [0]  # each group's bins come after the previous group's and hold only its indices
    for g0 in range(0, len(lengths), group_size):
        mine = [b for b in bins if g0 <= b[0] < g0 + group_size]
        assert all(g0 <= i < g0 + group_size for b in mine for i in b)
        assert bins[bounds[-1] : bounds[-1] + len(mine)] == mine
        bounds.append(bounds[-1] + len(mine))
        ffd = pack_group(arr[g0 : g0 + group_size], g0, 64, group_size, bin_size, algorithm="ffd")
        if algorithm == "ffd":
            assert mine == ffd
        elif algorithm == "auto":
            assert len(mine) <= len(ffd)


def test_pack_parallel_same_bins_whatever_num_processes():
    lengths = np.random.default_rng(0).integers(1, 300, size=5000)
    for algorithm in ("auto", "ffd"):
        one = pack_parallel(lengths, 512, group_size=700, bin_size=20, num_processes=1, algorithm=algorithm)
        assert pack_parallel(lengths, 512, group_size=700, bin_size=20, num_processes=3, algorithm=algorithm) == one
    assert pack_parallel(lengths, 512, group_size=700, bin_size=20, seed=1) != one  # another seed, another order


@settings(deadline=None, max_examples=80)
@given(lengths=lengths_st, num_bins=st.integers(0, 12))
def test_ffd_check_agrees_with_ffd(lengths, num_bins):
    assert ffd_check(np.array(lengths, dtype=np.int64), 64, num_bins) == (len(_brute_ffd(lengths, 64)) <= num_bins)


def test_pack_group_safe_mode_refuses_instead_of_skipping():
    lengths = np.array([6, 6, 6])
    with pytest.raises(ValueError, match=r"max_bins should be enough bins .* but got max_bins=2"):
        pack_group(lengths, 0, bin_capacity=10, max_bins=2, bin_size=200)
    assert sorted(pack_group(lengths, 0, bin_capacity=10, max_bins=2, bin_size=200, safe_mode=False)) == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"max_bins should be enough bins .* but got max_bins=2"):
        pack_group(lengths, 0, bin_capacity=10, max_bins=2, bin_size=200, algorithm="shuffled")


@settings(deadline=None, max_examples=60)
@given(lengths=lengths_st, num_ranks=st.integers(1, 4), bin_size=st.integers(1, 6))
def test_allocate_sequentially_keeps_order(lengths, num_ranks, bin_size):
    arr = np.array(lengths, dtype=np.int64)
    every = []
    for rank in range(num_ranks):
        mine, used, slots = allocate_sequentially(arr, rank, 64, num_ranks, bin_size=bin_size)
        every.append(mine)
        assert used == sum(lengths)
    bins = [b for k in range(max(map(len, every), default=0)) for share in every if k < len(share) for b in [share[k]]]
    assert [i for b in bins for i in b] == list(range(len(lengths)))
    assert slots == len(bins) * 64
    assert all(arr[b].sum() <= 64 and len(b) <= bin_size for b in bins)
    # a new bin only when the next sequence does not fit (or the bin is full)
    for prev, nxt in pairwise(bins):
        assert arr[prev].sum() + arr[nxt[0]] > 64 or len(prev) == bin_size


def test_functions_refuse_bad_input():
    with pytest.raises(ValueError, match=r"sequence_lengths\[1\] should be at most the bin capacity 10 tokens"):
        pack_parallel(np.array([3, 11]), 10, group_size=10, bin_size=5)
    with pytest.raises(TypeError, match="sequence_lengths should be a 1-D sequence of integer token lengths"):
        ffd_check(np.array([1.5, 2.0]), 10, 2)
    with pytest.raises(ValueError, match="group_size should be a positive integer, but got group_size=0"):
        pack_parallel(np.array([3]), 10, group_size=0, bin_size=5)
    with pytest.raises(ValueError, match=r"rank should be in \[0, num_ranks=2\), but got rank=2"):
        allocate_sequentially(np.array([3]), 2, 10, 2)
    with pytest.raises(ValueError, match="algorithm should be 'auto', 'ffd' or 'shuffled', but got algorithm='bfd'"):
        pack_parallel(np.array([3]), 10, group_size=10, bin_size=5, algorithm="bfd")
    with pytest.raises(TypeError, match="algorithm should be 'auto', 'ffd' or 'shuffled', but got algorithm=None"):
        pack_group(np.array([3]), 0, 10, 1, 5, algorithm=None)
    with pytest.raises(ValueError, match="seed should be a non-negative integer, but got seed=-1"):
        pack_group(np.array([3]), 0, 10, 1, 5, seed=-1)
    with pytest.raises(ValueError, match=r"mp_start_method should be one of .*, but got mp_start_method='x'"):
        pack_parallel(np.array([3, 4]), 10, group_size=1, bin_size=5, num_processes=2, mp_start_method="x")

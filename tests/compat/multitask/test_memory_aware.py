"""plan_memory_aware_batches: budget, task mix and exactly-once, as properties (no model needed)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.compat.multitask.memory_aware import plan_memory_aware_batches
from dynabatch.memory.budget import MemoryBudget


def _linear(per_row):
    """A cost that grows with rows and padded length: 100 + sum over rows of per_row[task] * length."""
    per_row = np.asarray(per_row, dtype=np.float64)

    def cost(counts, length):  # counts has one entry per task id up to the largest present
        return 100.0 + float(counts @ per_row[: len(counts)]) * length

    return cost


@settings(max_examples=60, deadline=None)
@given(
    tasks=st.lists(st.integers(0, 2), min_size=1, max_size=80),
    seed=st.integers(0, 5),
    weight=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    batch_size=st.one_of(st.none(), st.integers(1, 12)),
    sort_window=st.one_of(st.none(), st.integers(1, 20)),
    data=st.data(),
)
def test_every_index_once_and_every_batch_under_budget(tasks, seed, weight, batch_size, sort_window, data):
    lengths = data.draw(st.lists(st.integers(1, 64), min_size=len(tasks), max_size=len(tasks)))
    tasks, lengths = np.array(tasks), np.array(lengths)
    cost = _linear([1.0, 2.0, 4.0])
    budget = data.draw(st.floats(100 + 4 * 64, 5000))
    plan = plan_memory_aware_batches(tasks, lengths, cost, budget, batch_size=batch_size,
                                     task_diversity_weight=weight, seed=seed, epoch=seed, sort_window=sort_window)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(tasks)))
    costs = []
    for batch in plan:
        counts = np.bincount(tasks[batch], minlength=int(tasks.max()) + 1)
        costs.append(cost(counts, int(lengths[batch].max())))
        assert costs[-1] <= budget
        assert batch_size is None or len(batch) <= batch_size
        if weight == 0.0:
            assert len(set(tasks[batch].tolist())) == 1
    assert costs[0] == max(costs)  # the costliest batch first


def test_full_diversity_mirrors_the_global_mix_and_zero_gives_single_task_batches():
    tasks = np.repeat([0, 1, 2], [40, 20, 20])
    lengths = np.full(80, 10)
    for seed in range(3):
        mixed = plan_memory_aware_batches(tasks, lengths, _linear([1, 1, 1]), 1e9, batch_size=8,
                                          task_diversity_weight=1.0, seed=seed)
        for batch in mixed:
            counts = np.bincount(tasks[batch], minlength=3)
            assert np.all(np.abs(counts - len(batch) * np.array([0.5, 0.25, 0.25])) <= 1.5), counts
        single = plan_memory_aware_batches(tasks, lengths, _linear([1, 1, 1]), 1e9, batch_size=8,
                                           task_diversity_weight=0.0, seed=seed)
        assert all(len(set(tasks[b].tolist())) == 1 for b in single)
    half = plan_memory_aware_batches(tasks, lengths, _linear([1, 1, 1]), 1e9, batch_size=8, seed=0)
    assert 0 < sum(len(set(tasks[b].tolist())) > 1 for b in half) < len(half)


def test_memory_decides_the_rows_per_task():
    tasks = np.repeat([0, 1], 20)
    lengths = np.repeat([10, 40], 20)
    plan = plan_memory_aware_batches(tasks, lengths, _linear([1, 1]), 500, task_diversity_weight=0.0, shuffle=False)
    rows = {int(tasks[b[0]]): len(b) for b in plan}
    assert rows == {0: 20, 1: 10}  # 100 + 40 * 10 = 500; 100 + 10 * 40 = 500


def test_sort_window_cuts_padding():
    rng = np.random.default_rng(0)
    tasks, lengths = np.repeat([0, 1], 200), rng.integers(4, 64, size=400)

    def padded(plan):
        return sum(len(b) * int(lengths[b].max()) for b in plan)

    kw = {"batch_size": 16, "task_diversity_weight": 0.0, "seed": 1}
    plain = plan_memory_aware_batches(tasks, lengths, _linear([1, 1]), 1e9, **kw)
    sorted_ = plan_memory_aware_batches(tasks, lengths, _linear([1, 1]), 1e9, sort_window=128, **kw)
    assert padded(sorted_) < 0.8 * padded(plain)


def test_shuffle_is_seeded_and_local():
    tasks, lengths = np.repeat([0, 1], 30), np.arange(60) % 17 + 1
    state = np.random.get_state()
    a = plan_memory_aware_batches(tasks, lengths, _linear([1, 2]), 400, seed=3, epoch=1)
    b = plan_memory_aware_batches(tasks, lengths, _linear([1, 2]), 400, seed=3, epoch=1)
    c = plan_memory_aware_batches(tasks, lengths, _linear([1, 2]), 400, seed=3, epoch=2)
    assert [x.tolist() for x in a] == [x.tolist() for x in b] != [x.tolist() for x in c]
    assert np.all(np.random.get_state()[1] == state[1])


def test_a_sample_alone_as_large_as_a_failed_shape_is_refused():
    # One row 10 wide ran out of memory: the sample of length 12 was planned alone anyway, a batch sure to fail.
    budget = MemoryBudget(None, 1000, memory_margin=0.0, failed_shapes=[(1, 10)])
    with pytest.raises(ValueError, match=r"budget should allow one sample alone \(task 0 at length 12 is at least as "
                       r"large as a shape that ran out of memory, of \[\(1, 10\)\] \(rows, width\)\), but got "
                       r"budget=1000.0"):
        plan_memory_aware_batches(np.zeros(3, np.int64), np.array([5, 12, 3]), _linear([1]), budget, batch_size=4)
    budget = MemoryBudget(None, 1000, memory_margin=0.0, failed_shapes=[(2, 10)])  # one row still fits: planned
    plan = plan_memory_aware_batches(np.zeros(3, np.int64), np.array([5, 12, 3]), _linear([1]), budget, batch_size=4)
    assert sorted(len(b) for b in plan) == [1, 2] and max(len(b) for b in plan if 1 in b) == 1


def test_bad_input_is_named():
    tasks, lengths = np.array([0, 1]), np.array([10, 50])
    with pytest.raises(ValueError, match=r"budget should be at least what one sample needs \(task 1 at length 50"):
        plan_memory_aware_batches(tasks, lengths, _linear([1, 2]), 150)
    with pytest.raises(ValueError, match=r"budget should be a number of bytes > 0.*, but got budget=0"):
        plan_memory_aware_batches(tasks, lengths, _linear([1, 2]), 0)
    with pytest.raises(ValueError, match=r"task_diversity_weight should be a number in \[0, 1\], but got task_diversity_weight=1.5"):
        plan_memory_aware_batches(tasks, lengths, _linear([1, 2]), 1000, task_diversity_weight=1.5)
    with pytest.raises(ValueError, match=r"lengths should be one length per task id \(2\)"):
        plan_memory_aware_batches(tasks, lengths[:1], _linear([1, 2]), 1000)
    with pytest.raises(TypeError, match=r"task_ids should be a 1-D sequence of integer task ids"):
        plan_memory_aware_batches(np.array([0.5]), np.array([3]), _linear([1]), 1000)
    assert plan_memory_aware_batches(np.array([], dtype=int), np.array([], dtype=int), _linear([1]), 10) == []
